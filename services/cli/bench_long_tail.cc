// grpo bench long_tail: what continuous batching and in-flight weight updates buy a worker on a
// task whose completion lengths are skewed (issue 26, "the long tail"; the workload is
// rollout/bench/long_tail.h, which grpo_gpu_bench runs on CUDA). The tiny model, G = 8, 64
// prompts; every 8th prompt's group runs 8x longer than the others (256 tokens against 32; no
// stop id, so every row runs to its budget). At most 8 groups decode at once. Modes:
//   rounds                 8 prompts admitted only when nothing decodes (a Generate call per lease)
//   continuous             a prompt admitted as soon as a group leaves (continuous_batching), with
//                          no weight update: the ceiling of the modes below
//   continuous+drain       the learner's updates every 64 decode steps, taken as a worker without
//                          partial_rollouts takes them: admission stops until the groups in flight
//                          are done
//   continuous+in_flight   taken between two decode steps (partial_rollouts), the keys/values
//                          recomputed, or kept (`_keep`)
//   rounds+updates         rounds with the same updates (taken between rounds)
// Reported: groups/s, tokens/s, decode steps against the ideal (every step at full occupancy),
// the mean rows decoding, and each round's ratios to rounds and to continuous+drain.
#include <algorithm>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "rollout/bench/long_tail.h"
#include "services/cli/bench_services_util.h"
#include "services/cli/bench_util.h"

namespace grpo::services::bench {
namespace {

using nlohmann::json;
using rollout::bench::LongTailMode;
using rollout::bench::LongTailRun;

// About one learner step of `grpo bench long_tail_e2e` in this worker's decode steps (a step of
// ~140 ms against ~1.5 ms a decode step at 64 rows).
constexpr int64_t kUpdateEvery = 64;

}  // namespace

int BenchLongTail(bool as_json, int reps) {
  auto cfg = common::ModelConfigPreset("tiny");
  if (!cfg.ok()) return Fail("long_tail", cfg.status());
  auto model = common::Model::InitRandom(*cfg, 1);
  if (!model.ok()) return Fail("long_tail", model.status());
  std::shared_ptr<const common::Model> policy(std::move(model).value());
  const rollout::bench::LongTailShape shape;
  const auto prompts = rollout::bench::LongTailPrompts(shape.groups, shape.prompt_tokens,
                                                       policy->config().vocab_size, 5);
  const std::vector<LongTailMode> modes = {
      {"rounds", false, 0, false, true},
      {"continuous", true, 0, false, true},
      {"continuous+drain", true, kUpdateEvery, false, true},
      {"continuous+in_flight", true, kUpdateEvery, true, true},
      {"continuous+in_flight_keep", true, kUpdateEvery, true, false},
      {"rounds+updates", false, kUpdateEvery, false, true}};
  constexpr size_t kRounds = 0, kDrain = 2;
  // A warm-up pass, then the modes interleaved in `reps` rounds (this VM's speed drifts within
  // minutes): each round's ratios are the figures.
  if (auto warm = rollout::bench::RunLongTail(policy, shape, modes[1], prompts); !warm.ok()) {
    return Fail("long_tail", warm.status());
  }
  const int rounds = std::max(1, reps);
  std::vector<std::vector<LongTailRun>> runs(modes.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < modes.size(); ++i) {
      auto run = rollout::bench::RunLongTail(policy, shape, modes[i], prompts);
      if (!run.ok()) return Fail("long_tail", run.status().WithContext(modes[i].name));
      runs[i].push_back(*run);
    }
  }
  const auto over_rounds = [&](const std::function<double(int)>& value) {
    std::vector<double> v;
    for (int r = 0; r < rounds; ++r) v.push_back(value(r));
    return Summarize(std::move(v));
  };
  const int64_t full_rows = shape.in_flight * shape.num_generations;
  std::vector<json> rows;
  for (size_t i = 0; i < modes.size(); ++i) {
    const auto secs = [&](size_t m, int r) { return runs[m][r].seconds; };
    const Timing t = over_rounds([&](int r) { return secs(i, r); });
    const Timing vs_rounds = over_rounds([&](int r) { return secs(kRounds, r) / secs(i, r); });
    const Timing vs_drain = over_rounds([&](int r) { return secs(kDrain, r) / secs(i, r); });
    const LongTailRun& last = runs[i].back();
    const double ideal_steps = static_cast<double>(last.tokens) / static_cast<double>(full_rows);
    rows.push_back(
        {{"bench", "long_tail"},
         {"mode", modes[i].name},
         {"continuous_batching", modes[i].continuous},
         {"update_every_steps", modes[i].update_every},
         {"partial_rollouts", modes[i].partial_rollouts},
         {"partial_rollout_kv_cache",
          modes[i].partial_rollouts ? (modes[i].recompute_kv ? "recompute" : "keep") : ""},
         {"groups", shape.groups},
         {"groups_in_flight", shape.in_flight},
         {"num_generations", shape.num_generations},
         {"budget_short", shape.short_tokens},
         {"budget_long", shape.long_tokens},
         {"long_every", shape.long_every},
         {"reps", rounds},
         {"tokens", last.tokens},
         {"decode_steps", last.decode_steps},
         {"ideal_decode_steps", ideal_steps},
         {"vs_ideal_steps", ideal_steps / static_cast<double>(last.decode_steps)},
         {"mean_rows_decoding", last.mean_rows()},
         {"full_rows", full_rows},
         {"updates", last.updates},
         {"switches_in_flight", last.switches},
         {"drains", last.drains},
         {"recompute_tokens", last.recompute_tokens},
         {"s_median", t.median},
         {"s_min", t.min},
         {"s_max", t.max},
         {"groups_per_second", static_cast<double>(shape.groups) / t.median},
         {"tokens_per_second", static_cast<double>(last.tokens) / t.median},
         {"vs_rounds", vs_rounds.median},
         {"vs_rounds_min", vs_rounds.min},
         {"vs_rounds_max", vs_rounds.max},
         {"vs_drain", vs_drain.median},
         {"vs_drain_min", vs_drain.min},
         {"vs_drain_max", vs_drain.max}});
  }
  if (as_json) {
    for (const json& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "long_tail: tiny model, " << shape.groups << " prompts x G=" << shape.num_generations
            << ", at most " << shape.in_flight << " groups decoding; every " << shape.long_every
            << "th group " << shape.long_tokens << " tokens, the others " << shape.short_tokens
            << "; updates = a new policy version every " << kUpdateEvery
            << " decode steps\n  medians of " << rounds
            << " interleaved rounds; vs rounds, vs drain: each round's own ratios (median [min, "
               "max])\n"
            << std::fixed;
  std::cout << "  " << std::left << std::setw(26) << "mode" << std::right << std::setw(8) << "s"
            << std::setw(10) << "groups/s" << std::setw(8) << "steps" << std::setw(8) << "ideal"
            << std::setw(7) << "rows" << std::setw(9) << "updates" << std::setw(8) << "drains"
            << std::setw(11) << "recompute" << std::setw(20) << "vs rounds" << std::setw(20)
            << "vs drain"
            << "\n";
  const auto ratio = [](const json& r, const std::string& key) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(2) << r[key].get<double>() << "x ["
      << r[key + "_min"].get<double>() << ", " << r[key + "_max"].get<double>() << "]";
    return s.str();
  };
  for (const json& r : rows) {
    std::cout << "  " << std::left << std::setw(26) << r["mode"].get<std::string>() << std::right
              << std::setprecision(2) << std::setw(8) << r["s_median"].get<double>()
              << std::setprecision(1) << std::setw(10) << r["groups_per_second"].get<double>()
              << std::setw(8) << r["decode_steps"].get<int64_t>() << std::setprecision(0)
              << std::setw(8) << r["ideal_decode_steps"].get<double>() << std::setprecision(1)
              << std::setw(7) << r["mean_rows_decoding"].get<double>() << std::setw(9)
              << r["updates"].get<int64_t>() << std::setw(8) << r["drains"].get<int64_t>()
              << std::setw(11) << r["recompute_tokens"].get<int64_t>() << std::setw(20)
              << ratio(r, "vs_rounds") << std::setw(20) << ratio(r, "vs_drain") << "\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
