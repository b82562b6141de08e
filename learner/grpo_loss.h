// The clipped GRPO loss of one micro-batch (docs/GRPO_SPEC.md "Per-token loss", "Aggregation",
// "Off-policy correction", "Metrics per optimizer step").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "common/status.h"
#include "learner/chunked_logprobs.h"
#include "learner/loss/aggregation.h"
#include "learner/loss/objectives.h"
#include "learner/loss/off_policy.h"

namespace grpo::learner {

// TRL `importance_sampling_level`: token (GRPO) or sequence (GSPO).
enum class ImportanceSamplingLevel { kToken, kSequence };

// Parse the config spellings; InvalidArgument naming the value and the choices otherwise.
StatusOr<ImportanceSamplingLevel> ParseImportanceSamplingLevel(std::string_view name);
std::string_view ImportanceSamplingLevelName(ImportanceSamplingLevel l);

struct GrpoLossConfig {
  LossType loss_type = LossType::kDapo;
  double epsilon = 0.2;                  // lower clip: ratio >= 1 - epsilon
  std::optional<double> epsilon_high{};  // upper clip: ratio <= 1 + epsilon_high; unset = epsilon
  std::optional<double> delta{};         // two-sided clipping: c1 = min(ratio, delta)
  double beta = 0.0;                     // KL coefficient; != 0 needs ref log-probs
  ImportanceSamplingLevel importance_sampling_level = ImportanceSamplingLevel::kToken;
  ImportanceSamplingCorrection importance_sampling_correction = ImportanceSamplingCorrection::kNone;
  double importance_sampling_cap = 3.0;             // C_max (TRL vllm_importance_sampling_clip_max)
  std::optional<double> importance_sampling_min{};  // C_min (TRL ..._clip_min); unset: none
  int64_t max_completion_length = 256;              // dr_grpo's denominator
  // The KL term times the importance ratio (DeepSeek-V3.2, arXiv 2512.02556; TRL's default).
  bool use_bias_correction_kl = true;
  // DeepSeek-V3.2's off-policy sequence mask; unset = off (loss/off_policy.h).
  std::optional<double> off_policy_mask_threshold{};
  // The 80/20 rule: the share of highest-entropy tokens that keep their policy gradient; 1 = all
  // (loss/entropy_mask.h). < 1 needs the tokens' entropy.
  double top_entropy_quantile = 1.0;
  double sapo_temperature_pos = 1.0;                 // sapo: tau for A > 0
  double sapo_temperature_neg = 1.05;                // sapo: tau for A <= 0
  double vespo_k_pos = 2.0, vespo_lambda_pos = 3.0;  // vespo: A >= 0
  double vespo_k_neg = 3.0, vespo_lambda_neg = 2.0;  // vespo: A < 0
  // The entropy bonus's coefficient for this micro-batch (loss/entropy_bonus.h; the trainer's
  // EntropyController sets it per step): the loss subtracts entropy_coef x the bonus when the
  // inputs carry the entropies. 0 = none.
  double entropy_coef = 0.0;

  double EpsilonHigh() const { return epsilon_high.value_or(epsilon); }
  // InvalidArgument naming the option: epsilon in [0, 1], epsilon_high >= 0, delta > 1,
  // beta >= 0, cap > 0, 0 <= importance_sampling_min < cap, off_policy_mask_threshold >= 0,
  // top_entropy_quantile in (0, 1],
  // sapo temperatures > 0, vespo k >= 0 and lambda > 0, max_completion_length >= 1, vespo with a
  // token-level (or no) correction (TRL's rule); all finite.
  Status Validate() const;
};

// Whether ComputeGrpoLoss's gradient w.r.t. logp is a sum of per-token terms, each depending on
// its own token only, so that GrpoTokenLossGrad's per-chunk gradient is exact: the objective is
// token-separable, importance sampling is token-level, no off-policy sequence mask, and a
// sequence-level IS correction has `old` given (without it old = logp.detach() couples tokens),
// and no entropy quantile (over the micro-batch's tokens).
bool TokenSeparable(const GrpoLossConfig& config, bool has_old);

// One micro-batch. All [B, T] tensors share logp's device. Values at padding positions
// (mask == 0) are never used and may be anything, inf and NaN included.
struct GrpoLossInputs {
  at::Tensor logp{};        // [B, T] current policy log-probs, with grad
  at::Tensor old{};         // [B, T] or undefined (= logp.detach(): on-policy, num_iterations 1)
  at::Tensor beh{};         // [B, T] worker's behaviour log-probs; needed by the IS correction
  at::Tensor ref{};         // [B, T] reference log-probs; needed when beta != 0
  at::Tensor advantages{};  // [B]
  at::Tensor mask{};        // [B, T] completion mask, values 0 or 1
  // [B, T] per-token entropy; needed when top_entropy_quantile < 1; with entropy_coef != 0 the
  // bonus is computed from it (and its gradient flows through it when it has one).
  at::Tensor entropy{};
};

// Sums and counts, so micro-batches (and ranks) aggregate exactly: Merge() them over a step,
// then read the means. Token counts are over masked (mask == 1) tokens.
// Metrics of one micro-batch, or of several merged. TRL 1.16 logs `kl` and the clip ratios of an
// optimizer step as the mean over its micro-batches of each micro-batch's mean (over its masked
// tokens; over its sequences for the clip flags with sequence-level importance sampling), so
// the *_sum fields hold sums of per-micro-batch means.
struct GrpoLossMetrics {
  double loss = 0.0;             // sum of the micro-batch loss values = the step's `loss`
  double tokens = 0.0;           // masked completion tokens
  int64_t micro_batches = 0;     // micro-batches merged
  double clip_low_sum = 0.0;     // fraction with ratio < 1 - epsilon and A < 0
  double clip_high_sum = 0.0;    // fraction with ratio > 1 + epsilon_high and A > 0
  double clip_region_sum = 0.0;  // fraction with either of the above
  double kl_sum = 0.0;           // mean of exp(ref-logp)-(ref-logp)-1; only when beta != 0
  double is_ratio_sum = 0.0;     // sum of exp(old - beh) over tokens; only when beh is given
  double is_ratio_tokens = 0.0;  // tokens counted in is_ratio_sum
  double is_ratio_max = 0.0;     // max of exp(old - beh); 0 when none
  double phi_sum = 0.0;          // vespo: mean over sequences of phi (per micro-batch, summed)
  // The entropies summed over the tokens the policy term acts on, and those tokens (the adaptive
  // entropy controller's window, token weighted as TRL's); only when entropy is given.
  double entropy_sum = 0.0;
  double entropy_tokens = 0.0;
  bool has_kl = false;
  bool has_is_ratio = false;

  void Merge(const GrpoLossMetrics& other);
  // TRL names: `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`, `kl`
  // (means over micro-batches), and this system's `is_ratio/mean` (over tokens). 0 when empty.
  double ClipLowMean() const;
  double ClipHighMean() const;
  double ClipRegionMean() const;
  double KlMean() const;
  double IsRatioMean() const;
  double PhiMean() const;  // `vespo/phi_seq_mean`
};

struct GrpoLossOutput {
  at::Tensor loss;  // scalar, already divided per the Aggregation table: call backward() on
                    // each micro-batch's loss and the accumulated gradient is the step's
  GrpoLossMetrics metrics;
};

// The loss of one micro-batch. InvalidArgument on a bad config, shape/dtype/device mismatch,
// a mask that is not 0/1, non-finite values at masked positions or in advantages, a missing
// ref (beta != 0) or beh (IS correction), or a bad normaliser. Computes in float64 when logp
// is float64, else in float32. Metrics copy to the host once (one device sync).
StatusOr<GrpoLossOutput> ComputeGrpoLoss(const GrpoLossConfig& config, const GrpoLossInputs& in,
                                         const LossNormaliser& normaliser);

// The per-token gradient dL/dlogp of ComputeGrpoLoss for FusedTokenLogprobsLoss: `in` without
// logp ([B, T] shapes); a chunk's gradient is ComputeGrpoLoss's own (autograd) on log-probs
// holding the chunk's values in place and finite placeholders elsewhere, which is exact because
// the loss is then a sum of per-token terms. InvalidArgument unless TokenSeparable. A loss error
// inside a chunk is stored in *error (the chunk's gradient is then 0): check it after the fused
// call.
StatusOr<TokenLossGrad> GrpoTokenLossGrad(const GrpoLossConfig& config, GrpoLossInputs in,
                                          const LossNormaliser& normaliser, Status* error);

}  // namespace grpo::learner
