// TRL 1.16's entropy bonus (docs/GRPO_SPEC.md "Entropy bonus"): L = L_policy - coef * H, H the
// mean per-token entropy of the micro-batch over the tokens the policy term acts on, divided by
// the step's micro-batch count only (never by a loss type's own normaliser, so `entropy_coef`
// means the same for every loss type); and Skywork-OR1's adaptive coefficient
// (`use_adaptive_entropy`, arXiv 2505.22312), TRL's controller.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "learner/loss/aggregation.h"

namespace grpo::learner::loss {

// The bonus of one micro-batch: mean(H over `effective` tokens) / GA x entropy_bonus_scale
// (mean over at least one token). entropy [B, T] (with grad, or not), effective [B, T] 0/1 (the
// completion mask, times the high-entropy mask with top_entropy_quantile < 1), valid: where the
// entropy is defined (padding may hold anything). The loss subtracts coef x this.
at::Tensor EntropyBonus(const at::Tensor& entropy, const at::Tensor& effective,
                        const at::Tensor& valid, const LossNormaliser& normaliser);

// d(-coef x EntropyBonus)/dH per token: -coef x effective / (max(1, tokens) x GA) x scale, for
// the fused LM-head path (the bonus is linear in H).
at::Tensor EntropyBonusTokenGrad(const at::Tensor& effective, double coef,
                                 const LossNormaliser& normaliser);

struct EntropyControlConfig {
  double entropy_coef = 0.0;  // static coefficient, or the adaptive one's initial value
  bool adaptive = false;
  double coef_min = 0.0, coef_max = 1.0, coef_delta = 0.005;
  double target = 0.2;  // nats
  bool enabled() const { return entropy_coef != 0.0 || adaptive; }
};

// The coefficient of each optimizer step. Static: entropy_coef. Adaptive (TRL's): the step
// applies coef while the previous step's entropy (over all micro-batches and ranks, token
// weighted) is at or below the target, else 0; after each step coef moves by delta toward more
// entropy bonus (entropy <= target) or less (above), within [coef_min, coef_max]. The first
// step has no previous entropy (+inf): no bonus.
class EntropyController {
 public:
  explicit EntropyController(EntropyControlConfig config)
      : config_(config), coef_(config.entropy_coef) {}

  const EntropyControlConfig& config() const { return config_; }
  // What the micro-batches of the next step multiply the bonus by.
  double ApplyCoef() const;
  // The coefficient now (TRL logs it as `entropy_coef`).
  double coef() const { return coef_; }
  double last_entropy() const { return last_entropy_; }
  // After a step whose effective tokens' entropies summed to `entropy_sum` over `tokens`.
  void EndStep(double entropy_sum, double tokens);
  // Checkpoint restore (and rank 0's state on the other ranks).
  void Restore(double coef, double last_entropy) {
    coef_ = coef;
    last_entropy_ = last_entropy;
  }

 private:
  EntropyControlConfig config_;
  double coef_ = 0.0;
  double last_entropy_ = std::numeric_limits<double>::infinity();
};

}  // namespace grpo::learner::loss
