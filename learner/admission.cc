#include "learner/admission.h"

#include <algorithm>

namespace grpo::learner {

StatusOr<int64_t> GenerationBatchGroups(const common::GrpoConfig& config) {
  const int64_t completions =
      config.per_device_train_batch_size * config.EffectiveStepsPerGeneration();
  const int64_t groups = config.num_generations > 0 ? completions / config.num_generations : 0;
  if (groups < 1) {
    return Status::InvalidArgument(
        "config key 'num_generations' exceeds the generation batch "
        "(per_device_train_batch_size * steps_per_generation)");
  }
  return groups;
}

int64_t VersionsPerGenerationBatch(const common::GrpoConfig& config) {
  const int64_t spg = config.EffectiveStepsPerGeneration();
  const int64_t gas = std::max<int64_t>(1, config.gradient_accumulation_steps);
  return std::max<int64_t>(1, (spg + gas - 1) / gas * config.num_iterations);
}

int64_t LeaseBudget(const LeaseBudgetInput& in) {
  // Batches that may be trained between a group's generation and its own batch.
  const int64_t batches_ahead = in.max_staleness / std::max<int64_t>(1, in.versions_per_batch);
  const int64_t stale_limit = (batches_ahead + 1 - (in.training ? 1 : 0)) * in.batch_groups;
  if (in.buffered >= in.buffer_capacity) return 0;  // a full buffer: groups would only wait
  return std::max<int64_t>(0, stale_limit - in.buffered - in.leased_out);
}

}  // namespace grpo::learner
