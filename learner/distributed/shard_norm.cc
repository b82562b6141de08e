#include "learner/distributed/shard_norm.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

namespace grpo::learner::distributed {

StatusOr<double> ClipShardedGradNorm(at::Tensor& grad_shard,
                                     const std::vector<std::pair<int64_t, int64_t>>& chunks,
                                     double max_norm, Collectives* ranks,
                                     const std::string& where) {
  at::NoGradGuard no_grad;
  at::Tensor local = at::zeros({1}, grad_shard.options().dtype(at::kDouble));
  for (const auto& [offset, length] : chunks) {
    local.add_(grad_shard.narrow(0, offset, length).to(at::kDouble).square().sum());
  }
  std::vector<at::Tensor> sq = {local};
  RETURN_IF_ERROR(ranks->AllReduceSum(sq, "all-reduce of the gradient norm" + where));
  const double total = std::sqrt(sq[0].item<double>());
  if (max_norm > 0) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0) grad_shard.mul_(coef);
  }
  return total;
}

}  // namespace grpo::learner::distributed
