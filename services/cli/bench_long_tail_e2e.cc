// grpo bench long_tail_e2e: the long tail through the services (issue 26, "the long tail"): the
// demo task with skewed completion lengths trained by an in-process LearnerServer and one
// RolloutWorker thread, or --workers of them (bench_e2e.h). Each pass of the 8 built-in rows has
// one row that may run to max_completion_length 256 and seven with their own budget of 32 (a row's
// "max_completion_length"); a policy initialised from scratch hardly ever stops early, so a long
// group is ~8x the others. A step trains 8 groups. Rows: sync and async (max_staleness 1) with a
// Generate call per lease, then async with in-flight weight updates (partial_rollouts), with
// continuous batching, and with both. Reported: steps/s, the learner's idle share, stale groups
// refused, and the reward curve's ends.
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "services/cli/bench_e2e.h"
#include "services/cli/bench_services_util.h"
#include "services/cli/bench_util.h"
#include "services/cli/demo_task.h"

namespace grpo::services::bench {
namespace {

using nlohmann::json;

constexpr int64_t kLong = 256, kShort = 32, kGroupsPerStep = 8, kDatasetCopies = 64;

struct Mode {
  std::string name;
  int64_t max_staleness;
  bool partial_rollouts, continuous_batching;
};

E2eJob LongTailJob(const Mode& m, int64_t steps, int workers) {
  E2eJob job;
  job.config = DemoTaskConfig();
  job.config.max_completion_length = kLong;
  // 8 groups of 8 a step: 4 micro-batches of 16.
  job.config.gradient_accumulation_steps =
      kGroupsPerStep * job.config.num_generations / job.config.per_device_train_batch_size;
  job.config.max_steps = steps;
  job.config.max_staleness = m.max_staleness;
  job.config.partial_rollouts = m.partial_rollouts;
  job.config.continuous_batching = m.continuous_batching;
  const std::vector<json> rows = BuiltinDataset();
  for (int64_t copy = 0; copy < kDatasetCopies; ++copy) {
    for (size_t i = 0; i < rows.size(); ++i) {
      json row = rows[i];
      if (i != 0) row["max_completion_length"] = kShort;
      job.lines.push_back(row.dump());
    }
  }
  job.reward_options = DemoRewardOptions();
  job.workers = workers;
  job.prompts_per_lease = kGroupsPerStep;
  return job;
}

}  // namespace

int BenchLongTailE2e(const ServiceBenchOptions& o) {
  const int64_t steps = o.steps > 0 ? o.steps : 16;
  const int workers = static_cast<int>(o.workers > 0 ? o.workers : 1);
  const std::vector<Mode> modes = {{"sync", 0, false, false},
                                   {"async", 1, false, false},
                                   {"async+in_flight", 1, true, false},
                                   {"async+continuous", 1, false, true},
                                   {"async+in_flight+continuous", 1, true, true},
                                   {"async2", 2, false, false},
                                   {"async2+continuous", 2, false, true},
                                   {"async2+in_flight+continuous", 2, true, true}};
  std::vector<E2eResult> results;
  for (const Mode& m : modes) {
    auto r = RunE2eJob(LongTailJob(m, steps, workers));
    if (!r.ok()) return Fail("long_tail_e2e", r.status().WithContext(m.name));
    results.push_back(std::move(r).value());
  }
  const double sync = results[0].steps_per_second, async = results[1].steps_per_second;
  std::vector<json> rows;
  for (size_t i = 0; i < modes.size(); ++i) {
    const E2eResult& r = results[i];
    rows.push_back({{"bench", "long_tail_e2e"},
                    {"mode", modes[i].name},
                    {"max_staleness", r.max_staleness},
                    {"workers", workers},
                    {"partial_rollouts", modes[i].partial_rollouts},
                    {"continuous_batching", modes[i].continuous_batching},
                    {"steps", r.steps},
                    {"batches_timed", r.batches_timed},
                    {"steps_per_second", r.steps_per_second},
                    {"vs_sync", r.steps_per_second / sync},
                    {"vs_async", r.steps_per_second / async},
                    {"learner_idle_fraction", r.learner_idle_fraction},
                    {"t_step_s", r.t_step},
                    {"stale_groups_refused", r.stale_refused},
                    {"reward_first", r.reward_first},
                    {"reward_last", r.reward_last},
                    {"wall_s", r.wall_s}});
    Merge(rows.back(), TimingJson(r.batch_interval, "batch_s"));
  }
  if (o.json) {
    for (const json& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << std::fixed << "long_tail_e2e: the demo task, one row in 8 may run to " << kLong
            << " tokens and the others to " << kShort << " (their own max_completion_length), "
            << kGroupsPerStep << " groups of " << DemoTaskConfig().num_generations
            << " a step, an in-process LearnerServer and " << workers
            << " RolloutWorker thread(s) (" << kGroupsPerStep << " prompts a lease) on the same "
            << std::thread::hardware_concurrency() << " cores; the first step is the warm-up\n"
            << "  idle = the learner's share of the timed steps spent waiting for groups; "
               "refused = stale groups; reward = mean step reward, first and last quarter\n";
  std::cout << std::left << std::setw(28) << "mode" << std::right << std::setw(9) << "step/s"
            << std::setw(9) << "vs sync" << std::setw(10) << "vs async" << std::setw(7) << "idle"
            << std::setw(8) << "t s" << std::setw(9) << "refused" << std::setw(16) << "reward"
            << std::setw(8) << "wall s"
            << "\n";
  for (const json& r : rows) {
    std::cout << std::left << std::setw(28) << r["mode"].get<std::string>() << std::right
              << std::setprecision(3) << std::setw(9) << r["steps_per_second"].get<double>()
              << std::setprecision(2) << std::setw(8) << r["vs_sync"].get<double>() << "x"
              << std::setw(9) << r["vs_async"].get<double>() << "x" << std::setw(7)
              << r["learner_idle_fraction"].get<double>() << std::setprecision(3) << std::setw(8)
              << r["t_step_s"].get<double>() << std::setw(9)
              << r["stale_groups_refused"].get<int64_t>() << std::setprecision(1) << std::setw(8)
              << r["reward_first"].get<double>() << " -> " << std::setw(5)
              << r["reward_last"].get<double>() << std::setw(8) << r["wall_s"].get<double>()
              << "\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
