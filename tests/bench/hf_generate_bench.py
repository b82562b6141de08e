"""transformers' generate on the shape grpo_gpu_bench's decode uses (deploy/gpu-check.sh).

A random Qwen3-0.6B-shaped model in bf16 (or, with --small, the bench's small cut), 64 prompts
of 64 random tokens, 16 sampled completions each of exactly 128 new tokens (min_new_tokens =
max_new_tokens, as our side never stops early). Prints one JSON line: completion tokens/s.
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    try:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except Exception as e:  # noqa: BLE001 - any import failure means no baseline
        print(json.dumps({"bench": "hf_generate", "skipped": f"import failed: {e}"}))
        return 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    small = a.small
    cfg = Qwen3Config(
        vocab_size=4096 if small else 151936, hidden_size=256 if small else 1024,
        intermediate_size=768 if small else 3072, num_hidden_layers=2 if small else 28,
        num_attention_heads=4 if small else 16, num_key_value_heads=2 if small else 8,
        head_dim=64 if small else 128, rope_theta=1000000.0, tie_word_embeddings=True,
        max_position_embeddings=40960, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    prompts, g = (4, 4) if small else (64, 16)
    plen, new = (8, 16) if small else (64, 128)
    ids = torch.randint(1, cfg.vocab_size, (prompts, plen), device=dev)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=g,
              max_new_tokens=new, min_new_tokens=new)
    with torch.no_grad():
        warm = ids[:1]
        model.generate(warm, attention_mask=torch.ones_like(warm),
                       **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        s = time.time() - t0
    tokens = (out.shape[1] - plen) * out.shape[0]
    print(json.dumps({"bench": "hf_generate", "device": dev, "prompts": prompts, "G": g,
                      "max_new_tokens": new, "completion_tokens": tokens, "seconds": s,
                      "tokens_per_second": tokens / s}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
