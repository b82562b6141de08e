// The 80/20 rule's high-entropy token mask (Wang et al., "Beyond the 80/20 Rule", arXiv
// 2506.01939; TRL `top_entropy_quantile`, `get_high_entropy_mask`): only the tokens whose
// entropy is at or above the micro-batch's (1 - rho) quantile keep their policy gradient.
#pragma once

#include <ATen/ATen.h>

namespace grpo::learner::loss {

// [B, T] of 0/1 in mask's dtype: entropy >= torch.quantile (linear interpolation) of the
// entropies of the valid tokens at `quantile`, and valid; all 0 when no token is valid. Over
// this micro-batch's tokens (TRL gathers them over its processes' concurrent micro-batches).
at::Tensor HighEntropyMask(const at::Tensor& entropy, const at::Tensor& valid,
                           const at::Tensor& mask, double quantile);

}  // namespace grpo::learner::loss
