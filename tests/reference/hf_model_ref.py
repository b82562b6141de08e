"""Hugging Face's own forward (and backward) for Qwen2 / Qwen3 / Llama checkpoints.

Loads MODEL_DIR with `transformers.AutoModelForCausalLM.from_pretrained` as it is (fp32, eager
attention) and, when asked, with `AutoTokenizer.from_pretrained`, so a directory our code wrote is
checked by the code users will load it with. Position ids are built from the attention mask the
way transformers' GenerationMixin builds them for left-padded batches (cumsum - 1).

Usage: hf_model_ref.py MODEL_DIR INPUT_JSON OUTPUT_JSON
  INPUT_JSON: {"input_ids": [[...], ...], "attention_mask": [[...], ...],
               "loss_weights": [[...], ...]    (optional, [B, T]),
               "texts": ["...", ...]}          (optional)
  OUTPUT_JSON: {"shape": [B, T, V], "logits": [flat float32, row-major],
                "logprobs": [[B][T] log p(ids[t] | ids[<t]), null at t = 0],
                "loss": L, "grads": {param name: [flat float32]}   (with loss_weights),
                "token_ids": [[...], ...]                         (with texts)}
  The scalar loss is L = sum_{b,t>=1} w[b][t] * mask[b][t] * mask[b][t-1] * logprobs[b][t]; its
  gradient is taken with respect to every parameter by name as transformers names them.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(argv):
    if len(argv) != 4:
        sys.stderr.write(__doc__)
        return 2
    model_dir, input_path, output_path = argv[1:]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with open(input_path) as f:
        inp = json.load(f)
    out = {}
    if "input_ids" in inp:
        input_ids = torch.tensor(inp["input_ids"], dtype=torch.int64)
        attention_mask = torch.tensor(inp["attention_mask"], dtype=torch.int64)
        position_ids = attention_mask.cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        want_grad = "loss_weights" in inp
        with torch.set_grad_enabled(want_grad):
            logits = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
            ).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            token_logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        rows = []
        for b in range(input_ids.shape[0]):
            rows.append([None] + [float(v) for v in token_logp[b].tolist()])
        out["shape"] = list(logits.shape)
        out["logits"] = logits.detach().reshape(-1).tolist()
        out["logprobs"] = rows
        if want_grad:
            w = torch.tensor(inp["loss_weights"], dtype=torch.float32)[:, 1:]
            m = (attention_mask[:, 1:] * attention_mask[:, :-1]).float()  # real token, real context
            loss = (w * m * token_logp).sum()
            loss.backward()
            loss = loss.detach()
            out["loss"] = loss.item()
            out["grads"] = {
                name: p.grad.reshape(-1).tolist()
                for name, p in model.named_parameters()
                if p.grad is not None
            }
    if "texts" in inp:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        out["token_ids"] = [
            tokenizer(t, add_special_tokens=False)["input_ids"] for t in inp["texts"]
        ]
    with open(output_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
