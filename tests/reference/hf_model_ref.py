#!/usr/bin/python3
"""Independent reference forward pass for Qwen2 / Qwen3 / Llama checkpoints.

Written from the published Hugging Face modeling code (transformers' modeling_qwen2.py,
modeling_qwen3.py, modeling_llama.py: RMSNorm, default rotary embedding with rotate_half,
repeat_kv, eager attention with an additive causal + padding mask, SwiGLU MLP), for Debian's
/usr/bin/python3 with python3-torch only (no transformers, no safetensors package: the
safetensors file format is parsed here with struct + json + numpy).

Usage: hf_model_ref.py MODEL_DIR INPUT_JSON OUTPUT_JSON
  INPUT_JSON: {"input_ids": [[...], ...], "attention_mask": [[...], ...]}
  OUTPUT_JSON: {"shape": [B, T, V], "logits": [flat float32 values, row-major]}
"""
import json
import math
import os
import struct
import sys

import numpy as np
import torch

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    buf = data[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = buf[begin:end]
        if info["dtype"] == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u16.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = torch.from_numpy(arr.copy().reshape(info["shape"])).to(torch.float32)
    return out


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for name in files:
        weights.update(read_safetensors(os.path.join(model_dir, name)))
    return weights


class Config:
    def __init__(self, d):
        self.model_type = d["model_type"]
        self.vocab_size = d["vocab_size"]
        self.hidden_size = d["hidden_size"]
        self.num_hidden_layers = d["num_hidden_layers"]
        self.num_attention_heads = d["num_attention_heads"]
        self.num_key_value_heads = d.get("num_key_value_heads") or self.num_attention_heads
        self.head_dim = d.get("head_dim") or self.hidden_size // self.num_attention_heads
        self.rms_norm_eps = d.get("rms_norm_eps", 1e-6)
        self.rope_theta = d.get("rope_theta", 10000.0)
        self.tie_word_embeddings = d.get("tie_word_embeddings", False)


def rms_norm(hidden_states, weight, eps):
    # Qwen2RMSNorm.forward
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def rotary_cos_sin(cfg, position_ids):
    # Qwen2RotaryEmbedding (rope_type "default"): inv_freq, then freqs = inv_freq @ positions.
    dim = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def linear(x, w, name, weights):
    b = weights.get(name + ".bias")
    y = x @ w.t()
    return y + b if b is not None else y


def causal_mask_4d(attention_mask, dtype):
    # The eager path of transformers' _prepare_4d_causal_attention_mask_with_cache_position:
    # min_dtype above the diagonal, then min_dtype where the key is padding.
    bsz, seq = attention_mask.shape
    min_dtype = torch.finfo(dtype).min
    causal = torch.full((seq, seq), fill_value=min_dtype, dtype=dtype)
    causal = torch.triu(causal, diagonal=1)
    causal = causal[None, None, :, :].expand(bsz, 1, -1, -1).clone()
    padding_mask = causal + attention_mask[:, None, None, :].to(dtype)
    padding_mask = padding_mask == 0
    causal = causal.masked_fill(padding_mask, min_dtype)
    return causal


def attention(cfg, weights, prefix, hidden_states, cos, sin, mask4d):
    bsz, q_len, _ = hidden_states.shape
    hidden_shape = (bsz, q_len, -1, cfg.head_dim)
    q = linear(hidden_states, weights[prefix + "q_proj.weight"], prefix + "q_proj", weights)
    k = linear(hidden_states, weights[prefix + "k_proj.weight"], prefix + "k_proj", weights)
    v = linear(hidden_states, weights[prefix + "v_proj.weight"], prefix + "v_proj", weights)
    q = q.view(hidden_shape)
    k = k.view(hidden_shape)
    if cfg.model_type == "qwen3":
        # Qwen3Attention: q_norm / k_norm on the head dimension, before the transpose and RoPE.
        q = rms_norm(q, weights[prefix + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, weights[prefix + "k_norm.weight"], cfg.rms_norm_eps)
    query_states = q.transpose(1, 2)
    key_states = k.transpose(1, 2)
    value_states = v.view(hidden_shape).transpose(1, 2)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    # eager_attention_forward
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    key_states = repeat_kv(key_states, n_rep)
    value_states = repeat_kv(value_states, n_rep)
    scaling = cfg.head_dim**-0.5
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights + mask4d[:, :, :, : key_states.shape[-2]]
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(
        query_states.dtype
    )
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    attn_output = attn_output.reshape(bsz, q_len, -1)
    return linear(attn_output, weights[prefix + "o_proj.weight"], prefix + "o_proj", weights)


def mlp(weights, prefix, x):
    gate = x @ weights[prefix + "gate_proj.weight"].t()
    up = x @ weights[prefix + "up_proj.weight"].t()
    return (torch.nn.functional.silu(gate) * up) @ weights[prefix + "down_proj.weight"].t()


def forward(cfg, weights, input_ids, attention_mask):
    # position_ids as GenerationMixin.prepare_inputs_for_generation builds them from the mask.
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)

    hidden_states = torch.nn.functional.embedding(input_ids, weights["model.embed_tokens.weight"])
    mask4d = causal_mask_4d(attention_mask, hidden_states.dtype)
    cos, sin = rotary_cos_sin(cfg, position_ids)
    for i in range(cfg.num_hidden_layers):
        p = "model.layers.%d." % i
        residual = hidden_states
        hidden_states = rms_norm(hidden_states, weights[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        hidden_states = attention(cfg, weights, p + "self_attn.", hidden_states, cos, sin, mask4d)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = rms_norm(
            hidden_states, weights[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps
        )
        hidden_states = mlp(weights, p + "mlp.", hidden_states)
        hidden_states = residual + hidden_states
    hidden_states = rms_norm(hidden_states, weights["model.norm.weight"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        lm_head = weights["model.embed_tokens.weight"]
    else:
        lm_head = weights["lm_head.weight"]
    return hidden_states @ lm_head.t()


def main(argv):
    if len(argv) != 4:
        sys.stderr.write(__doc__)
        return 2
    model_dir, input_path, output_path = argv[1:]
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = Config(json.load(f))
    weights = load_weights(model_dir)
    with open(input_path) as f:
        inp = json.load(f)
    input_ids = torch.tensor(inp["input_ids"], dtype=torch.int64)
    attention_mask = torch.tensor(inp["attention_mask"], dtype=torch.int64)
    with torch.no_grad():
        logits = forward(cfg, weights, input_ids, attention_mask)
    flat = logits.to(torch.float32).reshape(-1).tolist()
    with open(output_path, "w") as f:
        json.dump({"shape": list(logits.shape), "logits": flat}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
