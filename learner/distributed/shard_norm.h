// The gradient norm of a sharded optimizer (ShardedAdamW, FullShardAdamW): each rank holds
// chunks of the gradient, zero-padded, in one flat fp32 buffer.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "learner/distributed/collectives.h"

namespace grpo::learner::distributed {

// The whole gradient's L2 norm: the squared norms of this rank's `chunks` of `grad_shard`
// ((offset, length) pairs; in fp64, one chunk at a time, so the copy is one chunk) all-reduced
// over `ranks` (the padding is zero, so the sum is the whole gradient's). With max_norm > 0 it
// scales `grad_shard` in place as torch's clip_grad_norm_ does (optimizer.h ClipGradNorm).
// The collective's error names "all-reduce of the gradient norm" + where.
StatusOr<double> ClipShardedGradNorm(at::Tensor& grad_shard,
                                     const std::vector<std::pair<int64_t, int64_t>>& chunks,
                                     double max_norm, Collectives* ranks, const std::string& where);

}  // namespace grpo::learner::distributed
