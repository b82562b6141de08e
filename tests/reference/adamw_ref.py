"""Reference for tests/learner/optimizer_test.cc: torch.optim.AdamW and clip_grad_norm_.

stdin: {"params": [[...], ...], "grads": [[[...], ...] per step], "lr": [..per step],
        "betas": [b1, b2], "eps": e, "weight_decay": wd, "max_grad_norm": m}
stdout: {"params": [[...], ...] after all steps, "grad_norms": [...]}
"""
import json
import sys

import torch

cfg = json.load(sys.stdin)
params = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in cfg["params"]]
opt = torch.optim.AdamW(params, lr=1.0, betas=tuple(cfg["betas"]), eps=cfg["eps"],
                        weight_decay=cfg["weight_decay"], foreach=False)
norms = []
for grads, lr in zip(cfg["grads"], cfg["lr"]):
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g, dtype=torch.float64)
    norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg["max_grad_norm"])))
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
json.dump({"params": [p.detach().tolist() for p in params], "grad_norms": norms}, sys.stdout)
