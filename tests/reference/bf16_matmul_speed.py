"""Reference for tests/common/device_test.cc: how much slower PyTorch multiplies bf16 matrices
than fp32 ones on this CPU (torch.mm, the best of 5 runs after a warm-up, each dtype,
interleaved).

stdin: {"m": rows, "k": inner, "n": columns, "threads": intra-op threads}
stdout: {"fp32_seconds": s, "bf16_seconds": s, "slowdown": bf16 / fp32}
"""
import json
import sys
import time

import torch

cfg = json.load(sys.stdin)
torch.set_num_threads(cfg["threads"])
gen = torch.Generator().manual_seed(0)
a = torch.randn(cfg["m"], cfg["k"], generator=gen)
b = torch.randn(cfg["k"], cfg["n"], generator=gen)


def seconds(x, y):
    t0 = time.perf_counter()
    torch.mm(x, y)
    return time.perf_counter() - t0


a16, b16 = a.bfloat16(), b.bfloat16()
torch.mm(a, b)
torch.mm(a16, b16)
runs = [(seconds(a, b), seconds(a16, b16)) for _ in range(5)]
fp32 = min(f for f, _ in runs)
bf16 = min(h for _, h in runs)
json.dump({"fp32_seconds": fp32, "bf16_seconds": bf16, "slowdown": bf16 / fp32}, sys.stdout)
