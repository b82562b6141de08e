#include "learner/admission.h"

#include <algorithm>

namespace grpo::learner {

int64_t LeaseBudget(const LeaseBudgetInput& in) {
  // Batches that may be trained between a group's generation and its own batch.
  const int64_t batches_ahead = in.max_staleness / std::max<int64_t>(1, in.versions_per_batch);
  const int64_t stale_limit = (batches_ahead + 1 - (in.training ? 1 : 0)) * in.batch_groups;
  if (in.buffered >= in.buffer_capacity) return 0;  // a full buffer: groups would only wait
  return std::max<int64_t>(0, stale_limit - in.buffered - in.leased_out);
}

}  // namespace grpo::learner
