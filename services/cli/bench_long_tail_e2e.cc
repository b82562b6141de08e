// grpo bench long_tail_e2e: the long tail through the services (issue 26, "the long tail"): the
// demo task with skewed completion lengths trained by an in-process LearnerServer and one
// RolloutWorker thread, or --workers of them (bench_e2e.h). Each pass of the 8 built-in rows has
// one row that may run to max_completion_length 256 and seven with their own budget of 32 (a row's
// "max_completion_length"); a policy initialised from scratch hardly ever stops early, so a long
// group is ~8x the others. A step trains 8 groups. Rows: sync and async (max_staleness 1) with a
// Generate call per lease, then async with in-flight weight updates (partial_rollouts), with
// continuous batching, and with both. Reported: steps/s, the learner's idle share, stale groups
// refused, and the reward curve's ends.
#include <algorithm>
#include <functional>
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
  std::string kv_cache = "recompute";  // partial_rollout_kv_cache, with partial_rollouts
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
  job.config.partial_rollout_kv_cache = m.kv_cache;
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
                                   {"async+in_flight_keep", 1, true, false, "keep"},
                                   {"async+continuous", 1, false, true},
                                   {"async+in_flight+continuous", 1, true, true},
                                   {"async+in_flight_keep+continuous", 1, true, true, "keep"},
                                   {"async2", 2, false, false},
                                   {"async2+continuous", 2, false, true},
                                   {"async2+in_flight+continuous", 2, true, true},
                                   {"async2+in_flight_keep+continuous", 2, true, true, "keep"}};
  // The modes interleaved, `reps` rounds of all of them: this VM's speed drifts by tens of per
  // cent within minutes, so each round's ratios (to its own sync and async runs) are the
  // figures, and each row reports their median, min and max over the rounds.
  const int reps = std::max(1, o.reps);
  std::vector<std::vector<E2eResult>> runs(modes.size());  // [mode][round]
  for (int rep = 0; rep < reps; ++rep) {
    for (size_t i = 0; i < modes.size(); ++i) {
      if (!o.json) {
        std::cerr << "long_tail_e2e: round " << rep + 1 << "/" << reps << ", " << modes[i].name
                  << "\n";
      }
      auto r = RunE2eJob(LongTailJob(modes[i], steps, workers));
      if (!r.ok()) return Fail("long_tail_e2e", r.status().WithContext(modes[i].name));
      runs[i].push_back(std::move(r).value());
    }
  }
  const auto over_rounds = [&](const std::function<double(int)>& value) {
    std::vector<double> v;
    for (int rep = 0; rep < reps; ++rep) v.push_back(value(rep));
    return Summarize(std::move(v));
  };
  std::vector<json> rows;
  for (size_t i = 0; i < modes.size(); ++i) {
    const auto sps = [&](size_t mode, int rep) { return runs[mode][rep].steps_per_second; };
    const Timing speed = over_rounds([&](int rep) { return sps(i, rep); });
    const Timing vs_sync = over_rounds([&](int rep) { return sps(i, rep) / sps(0, rep); });
    const Timing vs_async = over_rounds([&](int rep) { return sps(i, rep) / sps(1, rep); });
    const Timing idle = over_rounds([&](int rep) { return runs[i][rep].learner_idle_fraction; });
    const Timing t_step = over_rounds([&](int rep) { return runs[i][rep].t_step; });
    const Timing first = over_rounds([&](int rep) { return runs[i][rep].reward_first; });
    const Timing last = over_rounds([&](int rep) { return runs[i][rep].reward_last; });
    const Timing wall = over_rounds([&](int rep) { return runs[i][rep].wall_s; });
    int64_t refused = 0, refused_max = 0;
    for (const E2eResult& r : runs[i]) {
      refused += r.stale_refused;
      refused_max = std::max(refused_max, r.stale_refused);
    }
    rows.push_back(
        {{"bench", "long_tail_e2e"},
         {"mode", modes[i].name},
         {"max_staleness", runs[i][0].max_staleness},
         {"workers", workers},
         {"partial_rollouts", modes[i].partial_rollouts},
         {"continuous_batching", modes[i].continuous_batching},
         {"partial_rollout_kv_cache", modes[i].partial_rollouts ? modes[i].kv_cache : ""},
         {"steps", runs[i][0].steps},
         {"reps", reps},
         {"batches_timed", runs[i][0].batches_timed},
         {"steps_per_second", speed.median},
         {"steps_per_second_min", speed.min},
         {"steps_per_second_max", speed.max},
         {"vs_sync", vs_sync.median},
         {"vs_sync_min", vs_sync.min},
         {"vs_sync_max", vs_sync.max},
         {"vs_async", vs_async.median},
         {"vs_async_min", vs_async.min},
         {"vs_async_max", vs_async.max},
         {"learner_idle_fraction", idle.median},
         {"t_step_s", t_step.median},
         {"stale_groups_refused", refused},
         {"stale_groups_refused_max_per_run", refused_max},
         {"reward_first", first.median},
         {"reward_last", last.median},
         {"wall_s", wall.median}});
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
  std::cout << "  medians over " << reps
            << " interleaved rounds; vs sync and vs async are each round's own ratios (median, "
               "[min, max]); refused = stale groups over all rounds\n";
  std::cout << std::left << std::setw(34) << "mode" << std::right << std::setw(9) << "step/s"
            << std::setw(9) << "vs sync" << std::setw(10) << "vs async" << std::setw(19)
            << "[min, max]" << std::setw(7) << "idle" << std::setw(8) << "t s" << std::setw(9)
            << "refused" << std::setw(16) << "reward" << std::setw(8) << "wall s"
            << "\n";
  for (const json& r : rows) {
    std::cout << std::left << std::setw(34) << r["mode"].get<std::string>() << std::right
              << std::setprecision(3) << std::setw(9) << r["steps_per_second"].get<double>()
              << std::setprecision(2) << std::setw(8) << r["vs_sync"].get<double>() << "x"
              << std::setw(9) << r["vs_async"].get<double>() << "x" << std::setw(8) << "["
              << r["vs_async_min"].get<double>() << ", " << r["vs_async_max"].get<double>() << "]"
              << std::setw(7) << r["learner_idle_fraction"].get<double>() << std::setprecision(3)
              << std::setw(8) << r["t_step_s"].get<double>() << std::setw(9)
              << r["stale_groups_refused"].get<int64_t>() << std::setprecision(1) << std::setw(8)
              << r["reward_first"].get<double>() << " -> " << std::setw(5)
              << r["reward_last"].get<double>() << std::setw(8) << r["wall_s"].get<double>()
              << "\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
