"""Reference for tests/common/device_test.cc: how much slower PyTorch multiplies bf16 matrices
than fp32 ones on this CPU (torch.mm, the best of 5 runs after a warm-up, each dtype).

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


def best(x, y):
    torch.mm(x, y)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(x, y)
        times.append(time.perf_counter() - t0)
    return min(times)


fp32 = best(a, b)
bf16 = best(a.bfloat16(), b.bfloat16())
json.dump({"fp32_seconds": fp32, "bf16_seconds": bf16, "slowdown": bf16 / fp32}, sys.stdout)
