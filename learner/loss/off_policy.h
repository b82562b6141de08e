// Corrections for groups that were not sampled by the policy being trained (docs/GRPO_SPEC.md
// "Off-policy correction"): the importance-sampling weight of the behaviour policy (TRL 1.16's
// vLLM importance-sampling correction, its four modes) and DeepSeek-V3.2's off-policy sequence
// mask. Both are detached: they scale the objective's gradient, they carry none.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "common/status.h"

namespace grpo::learner {

// `importance_sampling_correction` (TRL `vllm_importance_sampling_mode`).
enum class ImportanceSamplingCorrection {
  kNone,
  kTokenTruncate,
  kTokenMask,
  kSequenceTruncate,
  kSequenceMask
};

StatusOr<ImportanceSamplingCorrection> ParseImportanceSamplingCorrection(std::string_view name);
std::string_view ImportanceSamplingCorrectionName(ImportanceSamplingCorrection c);
// One weight per sequence (sequence_*), or one per token.
bool IsSequenceLevel(ImportanceSamplingCorrection c);

namespace loss {

// The correction's weights, TRL's `importance_sampling_ratio` after its truncation or mask,
// from `log_rho` = old - beh per token, 0 at padding ([B, T], detached): rho = exp(log_rho) per
// token (1 at padding), or exp(sum_t log_rho) per sequence; `*_truncate` clamps rho to
// [clip_min, cap] (clip_min unset: no lower bound), `*_mask` zeroes rho outside [clip_min, cap]
// and keeps it inside. [B, T] for the token modes, [B, 1] for the sequence modes.
at::Tensor ImportanceSamplingWeights(ImportanceSamplingCorrection mode, const at::Tensor& log_rho,
                                     double cap, std::optional<double> clip_min);

// DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9; TRL `get_off_policy_mask`):
// 1 where A >= 0 or the sequence's mean over its tokens of (sampling - logp) is <= threshold,
// else 0. `sampling` is the behaviour log-prob (the worker's) when the group carries one, else
// `old`; `logp` is detached here. [B, 1].
at::Tensor OffPolicySequenceMask(const at::Tensor& advantages, const at::Tensor& logp,
                                 const at::Tensor& sampling, const at::Tensor& mask,
                                 const at::Tensor& valid, double threshold);

}  // namespace loss
}  // namespace grpo::learner
