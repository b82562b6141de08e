"""TRL 1.16's own `GRPOTrainer._compute_loss` on arbitrary per-token log-probs.

`_compute_loss` runs unchanged, bound to a stand-in for the trainer whose
`_get_per_token_logps_and_entropies` returns the case's log-probs as a leaf tensor (and its
entropies, float32 as TRL's, or zeros), so the loss, its gradient with respect to the log-probs and every metric TRL logs are
TRL's for any [B, T] inputs: every loss type, two-sided clipping, the KL term with and without
`use_bias_correction_kl`, the off-policy sequence mask, the entropy quantile mask and the
importance-sampling correction. `get_off_policy_mask`, `get_gamma_weights` (vespo) and
`get_high_entropy_mask` are TRL's, and so is the entropy bonus with its adaptive controller
(`entropy_coef`, `use_adaptive_entropy`: the stand-in holds the state GRPOTrainer.__init__
sets; with the bonus on the entropies are a leaf too, and their gradient is returned).

Written from TRL's source, not a function TRL exposes: the importance-sampling ratio. TRL
computes it inside `_generate_and_score_completions` (trl/trainer/grpo_trainer.py, "Compute the
importance sampling ratio when using vLLM"); `is_ratio` below transcribes those lines:
diff = (old - sampling) * mask with NaN as 0, summed over tokens for the sequence_* modes, exp,
then clamp(min=clip_min, max=clip_max) for *_truncate or zero outside [clip_min, clip_max] for
*_mask. `old` is the case's `old`, or the log-probs themselves when the case has none (under vLLM
TRL always computes old, and at the same weights it equals them). The worker's behaviour log-probs
play vLLM's sampling log-probs: with `beh`, `use_vllm` is on and `sampling_per_token_logps` is
`beh` (the off-policy mask reads it), and `vllm_importance_sampling_correction` is on unless the
mode is "none".

Multi-turn: a case's "tool_mask" (0 on environment tokens, 1 on the model's) goes into
`_compute_loss`'s inputs as TRL's `tool_mask`, beside "mask" as its `completion_mask`; TRL then
trains on completion_mask * tool_mask, and the importance-sampling ratio is taken over that
product too (TRL's `mask = completion_mask * tool_mask` in `_generate_and_score_completions`).

stdin: {"cases": [{"logp": [[...]], "old": [[...]] | null, "beh": ... | null, "ref": ... | null,
  "advantages": [...], "mask": [[...]], "tool_mask": [[...]] | absent,
  "config": {TRL GRPOConfig names}, "num_items_in_batch": N,
  "gradient_accumulation_steps": GA, "last_world_entropy": H | null}]}
stdout: {"cases": [{"loss": L, "grad": [[dL/dlogp]], "metrics": {name: value}, and with the entropy
  bonus on "entropy_grad": [[dL/dH]], "entropy_coef": the coefficient after the step,
  "last_world_entropy": the controller's entropy}]}
Float64 throughout.
"""
import json
import math
import sys
import types
from collections import defaultdict
from contextlib import nullcontext

import torch

from trl import GRPOTrainer


class SingleProcessAccelerator:
    """The single-process accelerate.Accelerator surface `_compute_loss` touches (shared with
    trl_grpo_ref.py)."""

    num_processes = 1
    is_main_process = True
    sync_gradients = True

    def gather(self, t):
        return t

    def gather_for_metrics(self, t):
        return t

    def reduce(self, t, reduction="sum"):
        return t

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t

    def autocast(self):
        return nullcontext()


def trainer_args(c, steps_per_generation):
    """The `self.args` fields `_compute_loss` reads, from GRPOConfig names in `c` (TRL's
    defaults where absent; shared with trl_grpo_ref.py)."""
    return types.SimpleNamespace(
        delta=c.get("delta"),
        use_bias_correction_kl=bool(c.get("use_bias_correction_kl", True)),
        steps_per_generation=int(steps_per_generation),
        sapo_temperature_pos=float(c.get("sapo_temperature_pos", 1.0)),
        sapo_temperature_neg=float(c.get("sapo_temperature_neg", 1.05)),
        vespo_k_pos=float(c.get("vespo_k_pos", 2.0)),
        vespo_lambda_pos=float(c.get("vespo_lambda_pos", 3.0)),
        vespo_k_neg=float(c.get("vespo_k_neg", 3.0)),
        vespo_lambda_neg=float(c.get("vespo_lambda_neg", 2.0)),
        entropy_coef_min=float(c.get("entropy_coef_min", 0.0)),
        entropy_coef_max=float(c.get("entropy_coef_max", 1.0)),
        entropy_coef_delta=float(c.get("entropy_coef_delta", 0.005)),
        entropy_target=float(c.get("entropy_target", 0.2)),
        report_to=[],
    )


class StandIn:
    _compute_loss = GRPOTrainer._compute_loss
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask

    def __init__(self, case, logp_leaf, entropy):
        c = case["config"]
        self._logp = logp_leaf
        self._entropy = entropy
        eps = float(c.get("epsilon", 0.2))
        eps_high = c.get("epsilon_high")
        ga = int(case.get("gradient_accumulation_steps", 1))
        self.args = trainer_args(c, ga)
        self.state = types.SimpleNamespace(global_step=0)
        self.accelerator = SingleProcessAccelerator()
        self.model = types.SimpleNamespace(training=True)
        self.beta = float(c.get("beta", 0.0))
        self.loss_type = c["loss_type"]
        self.epsilon_low = eps
        self.epsilon_high = float(eps_high) if eps_high is not None else eps
        self.importance_sampling_level = c.get("importance_sampling_level", "token")
        self.max_completion_length = int(c.get("max_completion_length", 256))
        self.current_gradient_accumulation_steps = ga
        self.top_entropy_quantile = float(c.get("top_entropy_quantile", 1.0))
        self.off_policy_mask_threshold = c.get("off_policy_mask_threshold")
        mode = c.get("vllm_importance_sampling_mode", "none")
        self.use_vllm = case.get("beh") is not None
        self.vllm_importance_sampling_correction = self.use_vllm and mode != "none"
        self.aux_loss_enabled = False
        # The entropy bonus's state, as GRPOTrainer.__init__ sets it (the case may give the
        # previous step's entropy, which the adaptive controller gates on).
        self.entropy_coef = float(c.get("entropy_coef", 0.0))
        self.use_adaptive_entropy = bool(c.get("use_adaptive_entropy", False))
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        last = case.get("last_world_entropy")
        self._last_world_entropy = float("inf") if last is None else float(last)
        self._entropy_window_stats = None
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           **kwargs):
        return self._logp, self._entropy, None


def is_ratio(c, old, sampling, mask):
    """TRL's vllm_importance_sampling_ratio (transcribed; see the module docstring)."""
    mode = c["vllm_importance_sampling_mode"]
    clip_min = c.get("vllm_importance_sampling_clip_min")
    clip_max = c.get("vllm_importance_sampling_clip_max", 3.0)
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def run_case(case):
    t = lambda k: torch.tensor(case[k]) if case.get(k) is not None else None
    logp = t("logp").requires_grad_(True)
    mask = t("mask").to(torch.int64)
    b, n = mask.shape
    c = case["config"]
    bonus = float(c.get("entropy_coef", 0.0)) != 0.0 or bool(c.get("use_adaptive_entropy"))
    if case.get("entropy") is None:
        entropy = torch.zeros_like(logp)
    elif bonus:
        # The bonus's gradient flows through the entropies: a float64 leaf, so that the bonus is
        # compared at float64 (the values are float32's, as the model gives them).
        entropy = t("entropy").requires_grad_(True)
    else:
        entropy = t("entropy").float()
    trainer = StandIn(case, logp, entropy)
    inputs = {
        "prompt_ids": torch.zeros((b, 1), dtype=torch.int64),
        "prompt_mask": torch.ones((b, 1), dtype=torch.int64),
        "completion_ids": torch.zeros((b, n), dtype=torch.int64),
        "completion_mask": mask,
        "advantages": t("advantages"),
        "num_items_in_batch": torch.tensor(float(case["num_items_in_batch"])),
    }
    old = t("old")
    if old is not None:
        inputs["old_per_token_logps"] = old
    if trainer.beta != 0.0:
        inputs["ref_per_token_logps"] = t("ref")
    tool_mask = t("tool_mask")
    if tool_mask is not None:
        tool_mask = tool_mask.to(torch.int64)
        inputs["tool_mask"] = tool_mask
    beh = t("beh")
    if beh is not None:
        inputs["sampling_per_token_logps"] = beh
        if trainer.vllm_importance_sampling_correction:
            o = old if old is not None else logp.detach()
            is_mask = mask if tool_mask is None else mask * tool_mask
            inputs["importance_sampling_ratio"] = is_ratio(case["config"], o, beh, is_mask)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items() if v}
    metrics.pop("entropy", None)
    out = {"loss": loss.item(), "grad": logp.grad.tolist(), "metrics": metrics}
    if bonus:
        out["entropy_grad"] = entropy.grad.tolist()
        out["entropy_coef"] = trainer.entropy_coef  # after the step (adaptive: updated)
        last = trainer._last_world_entropy
        out["last_world_entropy"] = None if math.isinf(last) else last
    return out


def main():
    torch.set_default_dtype(torch.float64)
    request = json.loads(sys.stdin.read())
    json.dump({"cases": [run_case(c) for c in request["cases"]]}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
