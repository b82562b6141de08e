// Admission: the generation-batch arithmetic and the lease budget, as pure functions in one
// place (docs/GRPO_SPEC.md "num_iterations and the generation batch"). The staleness rule of a
// group that arrives is GrpoTrainer::ValidateGroup's (policy_version - group version <=
// max_staleness); the budget below keeps leases inside that same bound.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/status.h"

namespace grpo::learner {

// Prompts (groups) per generation batch: per_device_train_batch_size x steps_per_generation
// completions / num_generations. InvalidArgument when num_generations exceeds the batch.
StatusOr<int64_t> GenerationBatchGroups(const common::GrpoConfig& config);

// Optimizer steps (policy versions) one generation batch makes: ceil(steps_per_generation /
// gradient_accumulation_steps) per pass, num_iterations passes; at least 1.
int64_t VersionsPerGenerationBatch(const common::GrpoConfig& config);

struct LeaseBudgetInput {
  int64_t buffered = 0;      // groups in the buffer and being accepted
  int64_t leased_out = 0;    // leases granted, not yet pushed
  bool training = false;     // a batch is being trained now
  int64_t batch_groups = 1;  // GenerationBatchGroups
  int64_t buffer_capacity = 2;
  int64_t max_staleness = 0;
  int64_t versions_per_batch = 1;  // VersionsPerGenerationBatch
};

// Groups that may be leased now (>= 0) so that none of them goes stale: a group leased now is
// generated with the current policy and trained after the batches ahead of it (the one in
// training, the groups buffered, being pushed and leased out), each of which moves the policy
// versions_per_batch versions; max_staleness bounds that. 0 while the buffer is full.
int64_t LeaseBudget(const LeaseBudgetInput& in);

}  // namespace grpo::learner
