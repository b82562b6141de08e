"""Chat renderings for tests/common/turn_template_test.cc from Hugging Face transformers and TRL.

transformers.AutoTokenizer loads the real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json
with its Jinja chat template) and renders/tokenises whole conversations with
apply_chat_template, under one of three templates:
  chatml          a plain ChatML Jinja template (below),
  qwen3           the template in tokenizer_config.json, as shipped with Qwen3,
  qwen3_training  TRL's training variant (trl/chat_templates/qwen3_training.jinja).
It also reports whether each template is prefix-preserving, twice: by TRL's own
is_chat_template_prefix_preserving (tool_calls as structured data), and by the same token-level
check on the dummy conversation written as text (the assistant's tool call in its content), as the
C++ side renders it.

stdin: {"tokenizer_dir": DIR, "conversations": [{"format": F, "messages": [{"role", "content"}],
        "add_generation_prompt": bool}, ...]}
stdout: {"renders": [{"text": str, "ids": [int]}, ...], "newline_id": int, "im_end_id": int,
         "prefix_preserving": {F: {"trl": bool, "text": bool}}, "trl_recognises_qwen3": bool}
"""
import json
import sys

from transformers import AutoTokenizer
from trl.chat_template_utils import (
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    qwen3_training_chat_template,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def text_prefix_preserving(tok, template):
    call = '<tool_call>\n{"name": "dummy", "arguments": {}}\n</tool_call>'
    first = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": call}]
    second = first + [{"role": "tool", "content": "dummy"}]
    ids1 = tok.apply_chat_template(first, tokenize=True, return_dict=False, chat_template=template)
    ids2 = tok.apply_chat_template(
        second, tokenize=True, return_dict=False, add_generation_prompt=True, chat_template=template
    )
    return ids2[: len(ids1)] == ids1


def main():
    request = json.load(sys.stdin)
    tok = AutoTokenizer.from_pretrained(request["tokenizer_dir"])
    shipped = tok.chat_template
    templates = {"chatml": CHATML, "qwen3": shipped, "qwen3_training": qwen3_training_chat_template}

    renders = []
    for conv in request["conversations"]:
        template = templates[conv["format"]]
        kwargs = dict(add_generation_prompt=conv["add_generation_prompt"], chat_template=template)
        text = tok.apply_chat_template(conv["messages"], tokenize=False, **kwargs)
        ids = tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=False, **kwargs)
        renders.append({"text": text, "ids": list(ids)})

    prefix = {}
    for name, template in templates.items():
        tok.chat_template = template
        prefix[name] = {
            "trl": bool(is_chat_template_prefix_preserving(tok)),
            "text": bool(text_prefix_preserving(tok, template)),
        }
    # TRL swaps in its training template only for the chat templates it knows by exact text.
    tok.chat_template = shipped
    try:
        recognised = get_training_chat_template(tok) == qwen3_training_chat_template
    except ValueError:
        recognised = False

    newline = tok.encode("\n", add_special_tokens=False)
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    if len(newline) != 1 or len(im_end) != 1:
        raise SystemExit(f"expected single tokens, got {newline} {im_end}")
    json.dump(
        {
            "renders": renders,
            "newline_id": newline[0],
            "im_end_id": im_end[0],
            "prefix_preserving": prefix,
            "trl_recognises_qwen3": recognised,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
