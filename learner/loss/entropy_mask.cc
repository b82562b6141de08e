#include "learner/loss/entropy_mask.h"

#include <ATen/core/grad_mode.h>

namespace grpo::learner::loss {

at::Tensor HighEntropyMask(const at::Tensor& entropy, const at::Tensor& valid,
                           const at::Tensor& mask, double quantile) {
  at::NoGradGuard no_grad;
  const at::Tensor e = entropy.detach().to(at::kFloat);  // TRL's .float()
  const at::Tensor local = e.masked_select(valid);
  if (local.numel() == 0) return at::zeros_like(mask);
  const at::Tensor threshold = at::quantile(local, quantile);
  return ((e * valid.to(at::kFloat) >= threshold) & valid).to(mask.scalar_type());
}

}  // namespace grpo::learner::loss
