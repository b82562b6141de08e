// Admission: the lease budget, a pure function (the generation-batch arithmetic it takes is
// GrpoConfig's: GenerationBatchGroups, VersionsPerGenerationBatch). The staleness rule of a
// group that arrives is GrpoTrainer::ValidateGroup's (policy_version - group version <=
// max_staleness); the budget below keeps leases inside that same bound.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/status.h"

namespace grpo::learner {

struct LeaseBudgetInput {
  int64_t buffered = 0;      // groups in the buffer and being accepted
  int64_t leased_out = 0;    // leases granted, not yet pushed
  bool training = false;     // a batch is being trained now
  int64_t batch_groups = 1;  // GrpoConfig::GenerationBatchGroups
  int64_t buffer_capacity = 2;
  int64_t max_staleness = 0;
  int64_t versions_per_batch = 1;  // GrpoConfig::VersionsPerGenerationBatch
  // Versions the asking worker's policy is behind the learner's published one (0 when it did
  // not say): its groups start that much staler.
  int64_t worker_lag = 0;
};

// Groups that may be leased now (>= 0) so that none of them goes stale: a group leased now is
// generated with the worker's policy, worker_lag versions behind the current one, and trained
// after the batches ahead of it (the one in training, the groups buffered, being pushed and
// leased out), each of which moves the policy versions_per_batch versions; max_staleness bounds
// that. 0 while the buffer is full, and for a worker more than max_staleness behind.
int64_t LeaseBudget(const LeaseBudgetInput& in);

}  // namespace grpo::learner
