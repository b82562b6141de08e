#!/usr/bin/env python3
"""Dynamic sampling on the demo task, on and off, side by side (issue 23's measurement).

Runs `grpo demo --json` (a learner and two rollout workers as processes on this machine) with
`--dynamic_sampling false` and `true`, interleaved, for each seed, and reports per run:
  - the share of optimizer steps with a non-zero gradient (grad_norm > 0);
  - the mean frac_reward_zero_std of the trained batches (TRL's: share of samples in groups
    whose rewards are all equal);
  - the wall time from the process start, and the step, at which the reward's moving mean over
    `--window` steps first reaches `--threshold`;
  - groups filtered in all (the sum of dynamic_sampling/groups_filtered).
Then the mean of each over the seeds, and the ratio on/off of the time to the threshold.

Usage: tests/bench/dynamic_sampling_demo.py --grpo build/services/grpo [--seeds 1 2 3]
       [--threshold -6] [--window 5] [--max_steps 60] [--json]
"""
import argparse
import json
import statistics
import subprocess
import sys
import time


def run(grpo, seed, dynamic, max_steps, threshold, window):
    cmd = [grpo, "demo", "--json", "--seed", str(seed), "--max_steps", str(max_steps),
           "--dynamic_sampling", "true" if dynamic else "false"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    steps, rewards = [], []
    reached_s = reached_step = None
    for line in proc.stdout:
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "step" not in row or "grad_norm" not in row:
            continue  # the summary object
        steps.append(row)
        rewards.append(row["reward"])
        if reached_s is None and len(rewards) >= window:
            if statistics.fmean(rewards[-window:]) >= threshold:
                reached_s = time.monotonic() - start
                reached_step = row["step"]
    code = proc.wait()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {code}")
    return {
        "dynamic_sampling": dynamic,
        "seed": seed,
        "steps": len(steps),
        "nonzero_grad_share": sum(1 for s in steps if s["grad_norm"] > 0) / max(1, len(steps)),
        "frac_reward_zero_std": statistics.fmean(s["frac_reward_zero_std"] for s in steps),
        "groups_filtered": int(sum(s.get("dynamic_sampling/groups_filtered", 0) for s in steps)),
        "seconds_to_threshold": reached_s,
        "step_at_threshold": reached_step,
        "last10_reward": statistics.fmean(rewards[-10:]),
        "seconds": time.monotonic() - start,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grpo", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--threshold", type=float, default=-6.0)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--max_steps", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for seed in a.seeds:
        for dynamic in (False, True):
            r = run(a.grpo, seed, dynamic, a.max_steps, a.threshold, a.window)
            rows.append(r)
            if a.json:
                print(json.dumps({"bench": "dynamic_sampling_demo", **r}), flush=True)
    if a.json:
        return
    print(f"{'dyn':>5} {'seed':>4} {'steps':>5} {'grad>0':>7} {'zero_std':>8} {'filtered':>8} "
          f"{'t_thr_s':>8} {'step_thr':>8} {'last10':>7} {'total_s':>7}")
    for r in rows:
        t = "-" if r["seconds_to_threshold"] is None else f"{r['seconds_to_threshold']:.1f}"
        st = "-" if r["step_at_threshold"] is None else str(r["step_at_threshold"])
        print(f"{str(r['dynamic_sampling']):>5} {r['seed']:>4} {r['steps']:>5} "
              f"{r['nonzero_grad_share']:>7.3f} {r['frac_reward_zero_std']:>8.3f} "
              f"{r['groups_filtered']:>8} {t:>8} {st:>8} {r['last10_reward']:>7.2f} "
              f"{r['seconds']:>7.1f}")
    for dynamic in (False, True):
        rs = [r for r in rows if r["dynamic_sampling"] == dynamic]
        times = [r["seconds_to_threshold"] for r in rs if r["seconds_to_threshold"] is not None]
        stp = [r["step_at_threshold"] for r in rs if r["step_at_threshold"] is not None]
        print(f"dynamic_sampling {str(dynamic).lower():5}: non-zero-gradient steps "
              f"{statistics.fmean(r['nonzero_grad_share'] for r in rs):.3f}, "
              f"frac_reward_zero_std {statistics.fmean(r['frac_reward_zero_std'] for r in rs):.3f}, "
              f"threshold reached in {len(times)}/{len(rs)} runs, mean "
              f"{statistics.fmean(times) if times else float('nan'):.1f} s / step "
              f"{statistics.fmean(stp) if stp else float('nan'):.1f}, last-10 reward "
              f"{statistics.fmean(r['last10_reward'] for r in rs):.2f}")


if __name__ == "__main__":
    sys.exit(main())
