#include "learner/admission.h"

#include <algorithm>

namespace grpo::learner {

int64_t LeaseBudget(const LeaseBudgetInput& in) {
  // Batches that may be trained between a group's generation and its own batch.
  // A worker's groups start worker_lag versions behind: they may wait that many fewer. A worker
  // more than max_staleness behind gets nothing (its groups would only be refused); it takes the
  // published weights before it asks again.
  const int64_t room = in.max_staleness - std::max<int64_t>(0, in.worker_lag);
  if (room < 0) return 0;
  const int64_t batches_ahead = room / std::max<int64_t>(1, in.versions_per_batch);
  const int64_t stale_limit = (batches_ahead + 1 - (in.training ? 1 : 0)) * in.batch_groups;
  if (in.buffered >= in.buffer_capacity) return 0;  // a full buffer: groups would only wait
  return std::max<int64_t>(0, stale_limit - in.buffered - in.leased_out);
}

}  // namespace grpo::learner
