"""Expected Qwen3 token ids for tests/common/tokenizer_test.cc from Hugging Face's own encoder.

Hugging Face `tokenizers` (the Rust library behind transformers' fast tokenizers) loads the real
Qwen3 tokenizer.json and encodes each text without adding special tokens (special tokens written
in the text are still recognised, as transformers does for Qwen3).

Usage: qwen3_ids.py TOKENIZER_JSON < texts.jsonl > ids.jsonl
  stdin: JSON Lines, each a JSON string. stdout: one JSON array of ids per input line.
"""
import json
import sys

from tokenizers import Tokenizer


def main():
    tokenizer = Tokenizer.from_file(sys.argv[1])
    out = []
    for line in sys.stdin.read().split("\n"):
        if not line:
            continue
        text = json.loads(line)
        if not isinstance(text, str):
            raise SystemExit(f"expected a JSON string, got {line}")
        out.append(json.dumps(tokenizer.encode(text, add_special_tokens=False).ids))
    sys.stdout.write("\n".join(out) + ("\n" if out else ""))


if __name__ == "__main__":
    main()
