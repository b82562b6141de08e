"""Independent PyTorch transcription of docs/GRPO_SPEC.md (rewards, advantages, the per-token loss,
aggregation, importance-sampling correction and the clip metrics), for the unit tests that need
arbitrary tensors in and out. Written from the spec and TRL 1.16, not from the C++ code; run with
the project's venv Python. TRL's own code checks the same loss on real batches in
tests/reference/trl_grpo_ref.py; this file covers what TRL has no function to call for: the
advantage computation (inside GRPOTrainer._generate_and_score_completions), arbitrary
[B, T] log-prob inputs for the gradient w.r.t. logp, and the IS-correction modes.
JSON on stdin, JSON on stdout:

  {"advantages": [case...], "losses": [case...]}

Reward values: a number, null (the function returned no reward) or "inf" / "-inf".
Everything runs in float64.
"""
import json
import math
import sys

import torch

torch.set_default_dtype(torch.float64)

STD_EPS = 1e-4


def parse_reward(v):
    if v is None:
        return math.nan
    if isinstance(v, str):
        return float(v)  # "inf", "-inf"
    return float(v)


def nan_to_none(x):
    return None if isinstance(x, float) and math.isnan(x) else x


def trl_frac_reward_zero_std(r, keep, gid, mode):
    """TRL 1.16's frac_reward_zero_std (grpo_trainer.py, _generate_and_score_completions):
    is_std_zero = isclose(std_rewards, 0) per sample, std_rewards the sample's group nanstd
    (scale_rewards group|none) or the batch's nanstd (batch), averaged over all samples. TRL's
    own nanstd; a sample dropped here (an infinite reward) is NaN for it."""
    from trl.trainer.utils import nanstd

    x = torch.where(keep, r, torch.full_like(r, math.nan))
    if mode == "batch":
        std = nanstd(x).expand_as(x)
    else:
        std = torch.empty_like(x)
        for g in torch.unique(gid):
            sel = gid == g
            std[sel] = nanstd(x[sel])
    # TRL takes .float() (float32); float64 here so the test can compare exactly.
    return torch.isclose(std, torch.zeros_like(std)).double().mean().item()


def normalize_then_sum(raw, w, keep, scorable, gid):
    """TRL 1.16's multi_objective_aggregation "normalize_then_sum" (GDPO), transcribed from
    grpo_trainer.py _generate_and_score_completions with TRL's own nanstd: each function
    normalised within its group, the weighted nansum, then normalised over the batch; a dropped
    sample (infinite reward, which TRL never sees) is NaN throughout. Returns (advantages,
    frac_reward_zero_std)."""
    from trl.trainer.utils import nanstd

    x = torch.where(keep[:, None], raw, torch.full_like(raw, math.nan))
    z = torch.full_like(x, math.nan)
    for g in torch.unique(gid):
        sel = gid == g
        grouped = x[sel]
        mean_k = torch.nanmean(grouped, dim=0, keepdim=True)
        std_k = nanstd(grouped, dim=0, keepdim=True)
        z[sel] = (grouped - mean_k) / (std_k + STD_EPS)
    rewards = (z * w[None, :]).nansum(dim=1)
    rewards[~scorable] = math.nan
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    adv = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std + STD_EPS), nan=0.0)
    frac = torch.isclose(std, torch.zeros_like(std)).double().mean().item()
    return adv, frac


def advantages_case(case):
    raw = torch.tensor([[parse_reward(v) for v in row] for row in case["rewards"]])
    n, k = raw.shape
    w = torch.tensor(case.get("weights") or [1.0] * k)
    # A non-finite reward drops the sample; null counts as 0 (nansum); a sample whose every
    # reward is null is unscorable (TRL PR 5902): reward NaN, out of every statistic, A = 0.
    keep = ~torch.isinf(raw).any(dim=1)
    scorable = keep & ~torch.isnan(raw).all(dim=1)
    r = torch.where(keep, (raw * w).nansum(dim=1), torch.zeros(n))
    r = torch.where(keep & ~scorable, torch.full((n,), math.nan), r)
    if case.get("group_ids") is not None:
        gid = torch.tensor(case["group_ids"])
    else:
        gid = torch.arange(n) // case["num_generations"]
    mode = case["scale_rewards"]

    kept_r = r[scorable]
    batch_std = kept_r.std().item() if kept_r.numel() >= 2 else 0.0
    adv = torch.zeros(n)
    std_used = torch.zeros(n)
    n_groups = 0
    for g in torch.unique(gid):
        sel = (gid == g) & scorable
        rg = r[sel]
        if rg.numel() == 0:
            continue
        n_groups += 1
        mean = rg.mean()
        std = rg.std() if rg.numel() >= 2 else torch.tensor(0.0)
        all_equal = bool((rg == rg[0]).all())
        scale = std if mode in ("group", "none") else torch.tensor(batch_std)
        std_used[sel] = scale
        if all_equal:
            continue  # A = 0 everywhere in the group
        a = rg - mean
        if mode != "none":
            a = a / (scale + STD_EPS)
        adv[sel] = a

    frac = trl_frac_reward_zero_std(r, keep, gid, mode)
    if case.get("multi_objective_aggregation", "sum_then_normalize") == "normalize_then_sum":
        adv, frac = normalize_then_sum(raw, w, keep, scorable, gid)

    fn_mean, fn_std = [], []
    for j in range(k):
        col = raw[keep, j]
        col = col[~torch.isnan(col)]
        fn_mean.append(col.mean().item() if col.numel() >= 1 else math.nan)
        fn_std.append(col.std().item() if col.numel() >= 2 else math.nan)
    return {
        "rewards": [nan_to_none(x) for x in r.tolist()],
        "advantages": adv.tolist(),
        "keep": keep.tolist(),
        "num_dropped": int((~keep).sum()),
        "num_groups": n_groups,
        "reward_mean": kept_r.mean().item() if kept_r.numel() else None,
        "reward_std": kept_r.std().item() if kept_r.numel() >= 2 else None,  # TRL PR 4785
        "frac_reward_zero_std": frac,
        "reward_fn_mean": [nan_to_none(x) for x in fn_mean],
        "reward_fn_std": [nan_to_none(x) for x in fn_std],
    }


def loss_case(case):
    cfg = case["config"]
    logp = torch.tensor(case["logp"], requires_grad=True)
    m = torch.tensor(case["mask"])
    A = torch.tensor(case["advantages"])[:, None]
    old = torch.tensor(case["old"]) if case.get("old") is not None else logp.detach()
    eps = cfg.get("epsilon", 0.2)
    eps_high = cfg.get("epsilon_high")
    if eps_high is None:
        eps_high = eps
    delta = cfg.get("delta")
    beta = cfg.get("beta", 0.0)
    level = cfg.get("importance_sampling_level", "token")
    corr = cfg.get("importance_sampling_correction", "none")
    cap = cfg.get("importance_sampling_cap", 3.0)
    loss_type = cfg.get("loss_type", "dapo")
    L = cfg.get("max_completion_length", 256)
    norm = case["normaliser"]
    ga = norm.get("gradient_accumulation_steps", 1)

    # ratio (token) or ratio_s (sequence, GSPO); an all-padding sequence counts 1 token.
    if level == "token":
        ratio = torch.exp(logp - old)
    else:
        ratio = torch.exp((m * (logp - old)).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    c1 = ratio
    c2 = torch.clamp(ratio, 1 - eps, 1 + eps_high)
    if delta is not None:
        c1 = torch.clamp(c1, max=delta)
    loss_t = -torch.min(c1 * A, c2 * A)
    loss_t = loss_t.expand(m.shape)

    out = {}
    if case.get("beh") is not None:
        beh = torch.tensor(case["beh"])
        is_ratio = torch.exp(old - beh)
        if corr == "token_truncate":
            loss_t = loss_t * torch.clamp(is_ratio, max=cap)
        elif corr == "token_mask":  # TRL since its PR 4530: the ratio stays, above cap -> 0
            loss_t = loss_t * is_ratio * (is_ratio <= cap).double()
        out["is_ratio_mean"] = ((is_ratio * m).sum() / m.sum()).item()
        out["is_ratio_max"] = is_ratio[m > 0].max().item()
    if beta != 0.0:
        ref = torch.tensor(case["ref"])
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        loss_t = loss_t + beta * kl
        out["kl"] = ((kl * m).sum() / m.sum()).item()

    B = m.shape[0]
    if loss_type == "grpo":
        loss = ((loss_t * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / ga
    elif loss_type == "bnpo":
        loss = (loss_t * m).sum() / m.sum().clamp(min=1.0) / ga
    elif loss_type == "dr_grpo":
        loss = (loss_t * m).sum() / (B * L) / ga
    elif loss_type == "dapo":
        loss = (loss_t * m).sum() / norm["step_completion_tokens"]
    else:
        raise ValueError(loss_type)
    loss.backward()

    # TRL 1.16: flags on the ratio the loss uses (after the delta clamp); with sequence-level
    # importance sampling one flag per sequence, averaged over the sequences.
    r = c1.detach()
    low = ((r < 1 - eps) & (A < 0)).double()
    high = ((r > 1 + eps_high) & (A > 0)).double()
    region = ((low + high) > 0).double()
    if level == "token":
        flag_mean = lambda x: ((x * m).sum() / m.sum().clamp(min=1.0)).item()
    else:
        flag_mean = lambda x: x.mean().item()
    out.update({
        "loss": loss.item(),
        "grad": logp.grad.tolist(),
        "tokens": m.sum().item(),
        "clip_low_mean": flag_mean(low),
        "clip_high_mean": flag_mean(high),
        "clip_region_mean": flag_mean(region),
    })
    return out


def main():
    req = json.load(sys.stdin)
    res = {
        "advantages": [advantages_case(c) for c in req.get("advantages", [])],
        "losses": [loss_case(c) for c in req.get("losses", [])],
    }
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
