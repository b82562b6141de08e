#include "learner/loss/entropy_bonus.h"

#include <algorithm>

namespace grpo::learner::loss {

at::Tensor EntropyBonus(const at::Tensor& entropy, const at::Tensor& effective,
                        const at::Tensor& valid, const LossNormaliser& normaliser) {
  const at::Tensor h = at::where(valid, entropy, at::zeros({}, entropy.options()));
  const at::Tensor tokens = effective.sum().clamp_min(1.0);
  return (h * effective).sum() / tokens /
         static_cast<double>(std::max<int64_t>(1, normaliser.gradient_accumulation_steps)) *
         normaliser.entropy_bonus_scale;
}

at::Tensor EntropyBonusTokenGrad(const at::Tensor& effective, double coef,
                                 const LossNormaliser& normaliser) {
  // The token count stays on the device: no host sync per micro-batch.
  const double ga =
      static_cast<double>(std::max<int64_t>(1, normaliser.gradient_accumulation_steps));
  return effective * (-coef * normaliser.entropy_bonus_scale / ga) / effective.sum().clamp_min(1.0);
}

double EntropyController::ApplyCoef() const {
  if (!config_.enabled()) return 0.0;
  if (!config_.adaptive) return coef_;
  return last_entropy_ <= config_.target ? coef_ : 0.0;
}

void EntropyController::EndStep(double entropy_sum, double tokens) {
  if (!config_.adaptive) return;
  const double entropy = entropy_sum / std::max(1.0, tokens);
  coef_ = entropy <= config_.target ? std::min(coef_ + config_.coef_delta, config_.coef_max)
                                    : std::max(coef_ - config_.coef_delta, config_.coef_min);
  last_entropy_ = entropy;
}

}  // namespace grpo::learner::loss
