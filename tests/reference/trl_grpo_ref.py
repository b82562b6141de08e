"""TRL's own GRPO loss for one optimizer step that our learner dumped (`dump_batches_dir`).

The loss is computed by TRL's code, not by a re-implementation: `trl.GRPOTrainer._compute_loss`
and its `_get_per_token_logps_and_entropies` run unchanged, bound to a small stand-in for the
trainer (`TrainerStandIn`) that carries only the attributes those two methods read. The model is
`transformers.AutoModelForCausalLM.from_pretrained(model_dir)` (fp32, eager attention) with TRL's
fused LM head (`trl.trainer.utils.add_fused_lm_head`, the temperature divides the logits there),
exactly as `GRPOTrainer.__init__` prepares it.

Position ids: TRL passes none, so transformers numbers every row 0..T-1, padding included; our
model (and transformers' generation for left-padded batches) uses cumsum(attention_mask) - 1.
For RoPE models the two differ by a constant shift per row, which leaves every attention score
unchanged in exact arithmetic: only float rounding differs. By default this script passes
position ids cumsum(mask) - 1 (1 at padding, as GenerationMixin does) so that the comparison is
of the loss math, not of rounding; `"position_ids": "trl"` keeps TRL's default instead.

Micro-batches: the step's rows are split into `gradient_accumulation_steps` micro-batches of
`per_device_train_batch_size` rows (default: one micro-batch of every row). `_compute_loss` runs
once per micro-batch with `current_gradient_accumulation_steps` = that count, and the step's
numbers are what TRL logs for it: `loss` is the sum of the micro-batch losses (GRPOTrainer sets
`loss_is_scaled_for_ga`, so Trainer adds them up unscaled), every other metric the mean of the
values `_compute_loss` appended to `_metrics`, one per micro-batch (GRPOTrainer.log).

`num_items_in_batch` (dapo): TRL's value is the completion tokens of the whole generation batch
(all ranks), which `_compute_loss` rescales by gradient_accumulation_steps / steps_per_generation.
Default: the completion tokens of the dumped step with steps_per_generation =
gradient_accumulation_steps, i.e. one optimizer step per generation batch.

Input (stdin, or a file named as the only argument): one case object, or {"cases": [...]}:
  {"model_dir": DIR,            policy weights at the start of the step (Model::Save layout)
   "dump": FILE,                step-<8 digits>.safetensors
   "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": null, "delta": null,
   "importance_sampling_level": "token", "max_completion_length": 256, "temperature": 1.0,
   "gradient_accumulation_steps": 1, "per_device_train_batch_size": null,
   "steps_per_generation": null, "num_items_in_batch": null, "num_processes": 1,
   "use_bias_correction_kl": true, "off_policy_mask_threshold": null, "top_entropy_quantile": 1.0,
   "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0, ...,
   "vllm_importance_sampling_mode": "none", "vllm_importance_sampling_clip_max": 3.0,
   "vllm_importance_sampling_clip_min": null, "position_ids": "mask" | "trl", "grad_norm": true}

Multi-turn: when the dump holds `env_mask` (1 on the model's tokens, 0 on environment tokens, 1
at padding), it goes into `_compute_loss`'s inputs as TRL's `tool_mask`; the dump's
`completion_mask` stays TRL's completion_mask (attention over every real token, environment
tokens included). The default `num_items_in_batch` and the importance-sampling ratio then count
completion_mask * tool_mask, as `_generate_and_score_completions` does.

Behaviour log-probs: when the dump holds the workers' `behaviour_logprobs`, they play vLLM's
sampling log-probs (`use_vllm` on, `sampling_per_token_logps`), and a mode other than "none"
turns on TRL's importance-sampling correction with the ratio TRL computes in
`_generate_and_score_completions`, transcribed in trl_loss_ref.py's `is_ratio` (`old` is the
dump's, or TRL's own log-probs at the step's weights when the dump has none, as TRL under vLLM
always computes them).
Output (stdout): for each case (a list under "cases" when the input had one)
  {"loss": L, "metrics": {TRL metric name: value}, "grad_norm": ||grad L|| over the HF model's
   parameters (when asked), "per_token_logps": [[...]] TRL's log-probs of the first micro-batch,
   0 at padding, "dumped_metrics": the dump's own "metrics" header}
"""
import json
import sys
import types
from collections import defaultdict

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from trl_loss_ref import SingleProcessAccelerator, is_ratio, trainer_args


class TrainerStandIn:
    """Duck-typed `self` for GRPOTrainer's loss methods (the attributes TRL 1.16 reads)."""

    _compute_loss = GRPOTrainer._compute_loss
    _get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask

    def __init__(self, case, model):
        eps = float(case.get("epsilon", 0.2))
        eps_high = case.get("epsilon_high")
        ga = int(case.get("gradient_accumulation_steps", 1))
        spg = case.get("steps_per_generation") or ga
        self.args = trainer_args(case, spg)
        self.state = types.SimpleNamespace(global_step=0)  # read by @profiling_decorator
        self.accelerator = SingleProcessAccelerator()
        self.accelerator.num_processes = int(case.get("num_processes", 1))
        self.model = model  # `self.model.training` picks the train/eval branch
        self.beta = float(case.get("beta", 0.0))
        self.loss_type = case.get("loss_type", "dapo")
        self.epsilon_low = eps
        self.epsilon_high = float(eps_high) if eps_high is not None else eps
        self.importance_sampling_level = case.get("importance_sampling_level", "token")
        self.max_completion_length = int(case.get("max_completion_length", 256))
        self.temperature = float(case.get("temperature", 1.0))
        self.current_gradient_accumulation_steps = ga
        self.top_entropy_quantile = float(case.get("top_entropy_quantile", 1.0))
        self.off_policy_mask_threshold = case.get("off_policy_mask_threshold")
        self.use_vllm = False  # set per dump: behaviour log-probs play vLLM's
        self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = False
        # The entropy bonus's state, as GRPOTrainer.__init__ sets it.
        self.entropy_coef = float(case.get("entropy_coef", 0.0))
        self.use_adaptive_entropy = bool(case.get("use_adaptive_entropy", False))
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        self._last_world_entropy = float("inf")
        self._entropy_window_stats = None
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


class _WithPositionIds(torch.nn.Module):
    """Calls the model with position ids cumsum(attention_mask) - 1 (1 at padding)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, **kwargs):
        mask = kwargs["attention_mask"]
        position_ids = mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(mask == 0, 1)
        return self.inner(**kwargs, position_ids=position_ids)


def _load_dump(path):
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata() or {}
    metrics = json.loads(meta["metrics"]) if "metrics" in meta else {}
    return tensors, metrics


def run_case(case):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        case["model_dir"], dtype=torch.float32, attn_implementation="eager"
    )
    model.train()  # no dropout in these models; selects TRL's "train" branch
    add_fused_lm_head(
        model,
        temperature=float(case.get("temperature", 1.0)),
        outputs=("log_probs", "entropy"),
    )
    forward = model if case.get("position_ids", "mask") == "trl" else _WithPositionIds(model)
    trainer = TrainerStandIn(case, model)

    t, dumped_metrics = _load_dump(case["dump"])
    completion_mask = t["completion_mask"].to(torch.int64)  # TRL's masks are integer
    tool_mask = t["env_mask"].to(torch.int64) if "env_mask" in t else None
    loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    n = completion_mask.size(0)
    ga = trainer.current_gradient_accumulation_steps
    bs = int(case.get("per_device_train_batch_size") or -(-n // ga))
    num_items = case.get("num_items_in_batch")
    if num_items is None:
        num_items = loss_mask.sum().item()
    num_items = torch.tensor(float(num_items))

    beh = t.get("behaviour_logprobs")
    mode = case.get("vllm_importance_sampling_mode", "none")
    trainer.use_vllm = beh is not None
    trainer.vllm_importance_sampling_correction = beh is not None and mode != "none"

    model.zero_grad(set_to_none=True)
    want_grad = bool(case.get("grad_norm", True))
    total_loss = 0.0
    first_logps = None
    for b0 in range(0, n, bs):
        rows = slice(b0, min(n, b0 + bs))
        inputs = {
            "prompt_ids": t["prompt_ids"][rows].to(torch.int64),
            "prompt_mask": t["prompt_mask"][rows].to(torch.int64),
            "completion_ids": t["completion_ids"][rows].to(torch.int64),
            "completion_mask": completion_mask[rows],
            "advantages": t["advantages"][rows].to(torch.float32),
            "num_items_in_batch": num_items,
        }
        if tool_mask is not None:
            inputs["tool_mask"] = tool_mask[rows]
        if "old_logprobs" in t:
            inputs["old_per_token_logps"] = t["old_logprobs"][rows].to(torch.float32)
        if trainer.beta != 0.0:
            inputs["ref_per_token_logps"] = t["ref_logprobs"][rows].to(torch.float32)
        if beh is not None:
            inputs["sampling_per_token_logps"] = beh[rows].to(torch.float32)
            if trainer.vllm_importance_sampling_correction:
                old = inputs.get("old_per_token_logps")
                if old is None:
                    with torch.no_grad():
                        old, _, _ = trainer._get_per_token_logps_and_entropies(
                            forward,
                            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                            inputs["completion_ids"].size(1),
                        )
                inputs["importance_sampling_ratio"] = is_ratio(
                    {
                        "vllm_importance_sampling_mode": mode,
                        "vllm_importance_sampling_clip_max": case.get(
                            "vllm_importance_sampling_clip_max", 3.0
                        ),
                        "vllm_importance_sampling_clip_min": case.get(
                            "vllm_importance_sampling_clip_min"
                        ),
                    },
                    old,
                    inputs["sampling_per_token_logps"],
                    loss_mask[rows],
                )
        if first_logps is None:
            with torch.no_grad():
                logps, _, _ = trainer._get_per_token_logps_and_entropies(
                    forward,
                    torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                    torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                    inputs["completion_ids"].size(1),
                )
            first_logps = (logps * inputs["completion_mask"]).tolist()
        loss = trainer._compute_loss(forward, inputs)
        if want_grad:
            loss.backward()
        total_loss += loss.item()

    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items() if v}
    out = {
        "loss": total_loss,
        "metrics": metrics,
        "per_token_logps": first_logps,
        "dumped_metrics": dumped_metrics,
    }
    if want_grad:
        grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
        out["grad_norm"] = torch.cat(grads).double().norm().item() if grads else 0.0
    return out


def main(argv):
    hf_logging.disable_progress_bar()
    if len(argv) > 2:
        sys.stderr.write(__doc__)
        return 2
    text = open(argv[1]).read() if len(argv) == 2 else sys.stdin.read()
    request = json.loads(text)
    if isinstance(request, dict) and "cases" in request:
        result = {"cases": [run_case(c) for c in request["cases"]]}
    else:
        result = run_case(request)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
