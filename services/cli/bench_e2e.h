// One training job through the services, timed (services/cli/bench_e2e.cc): an in-process
// LearnerServer and RolloutWorker threads over loopback (gRPC + Gloo weight sync), as
// `grpo bench e2e` runs the demo task and `grpo bench long_tail_e2e` a skewed one.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "services/cli/bench_util.h"

namespace grpo::services::bench {

struct E2eJob {
  // The learner's configuration (max_steps, max_staleness, num_iterations, continuous_batching,
  // partial_rollouts, ...); output_dir, ports and checkpointing are the bench's.
  common::GrpoConfig config;
  std::vector<std::string> lines;  // the dataset, one JSON row each
  nlohmann::json reward_options;   // the workers' reward_options
  int workers = 1;
  int64_t prompts_per_lease = 0;  // the workers' (0 = their default)
};

struct E2eResult {
  std::string mode;  // "sync" (max_staleness 0) or "async"
  int64_t max_staleness = 0, num_iterations = 1, steps = 0, steps_per_batch = 0;
  int64_t batches_timed = 0;
  double steps_per_second = 0;
  Timing batch_interval;  // between generation-batch completions, after the first
  double t_step = 0;      // mean train time per optimizer step (StepMetrics.step_seconds)
  double g_batch = 0;     // one worker's generation time per generation batch
  // Over the timed batches: the share of the time the learner did not train (waited for groups).
  double learner_idle_fraction = 0;
  double wall_s = 0;
  double reward_first = 0, reward_last = 0;  // mean step reward of the first and last quarter
  int64_t stale_refused = 0;
};

// Runs `job` to max_steps; the first generation batch is the warm-up. FailedPrecondition when
// fewer than 3 generation batches ended (too few to time); the job's or a worker's error.
StatusOr<E2eResult> RunE2eJob(const E2eJob& job);

}  // namespace grpo::services::bench
