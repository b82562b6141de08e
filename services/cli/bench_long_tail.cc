// grpo bench long_tail: what continuous batching (config continuous_batching) buys a worker on a
// task whose completion lengths are skewed (issue 26, "the long tail"). The tiny model, G = 8,
// 64 prompts; every 8th prompt's group may run 8x longer than the others (a budget of 256
// tokens against 32; the stop id is one the model never samples, so every row runs to its
// budget). Both modes keep at most 8 groups decoding through the same Generator::GenerateStream
// loop: `rounds` admits 8 prompts only when nothing decodes (what a worker did: one Generate
// call per lease), `continuous` admits a prompt as soon as a group leaves. Reported: groups/s,
// tokens/s, the mean rows decoding per step against the 64 a full batch holds, and the ideal
// (every step at full occupancy).
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "rollout/generator.h"
#include "services/cli/bench_services_util.h"
#include "services/cli/bench_util.h"

namespace grpo::services::bench {
namespace {

using nlohmann::json;

constexpr int64_t kGroups = 64, kInFlight = 8, kG = 8, kPromptTokens = 16;
constexpr int64_t kShort = 32, kLong = 8 * kShort, kLongEvery = 8;

struct LongTailRun {
  double seconds = 0;
  int64_t tokens = 0, steps = 0, row_steps = 0;  // row_steps: rows decoding, summed over steps
};

StatusOr<LongTailRun> RunLongTail(const rollout::Generator& gen, bool continuous,
                                  const std::vector<std::vector<int32_t>>& prompts,
                                  int64_t* steps_seen, int64_t* rows_now) {
  LongTailRun run;
  size_t next = 0;
  rollout::GroupStream stream;
  stream.max_prompts = kInFlight;
  stream.take = [&](int64_t room, bool idle, int64_t) {
    std::vector<rollout::StreamPrompt> out;
    if (!continuous && !idle) return out;
    while (room-- > 0 && next < prompts.size()) {
      const int64_t i = static_cast<int64_t>(next++);
      out.push_back({prompts[i], i, i, i % kLongEvery == 0 ? kLong : kShort});
      *rows_now += kG;
    }
    return out;
  };
  stream.done = [&](rollout::StreamedGroup g) {
    if (!g.group.ok()) return;
    for (const auto& c : g.group->completions) {
      run.tokens += static_cast<int64_t>(c.token_ids.size());
    }
    *rows_now -= kG;
  };
  *steps_seen = 0;
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(rollout::StreamStats stats, gen.GenerateStream(stream));
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.steps = *steps_seen;
  if (stats.num_groups != kGroups) {
    return Status::Internal("long_tail: " + std::to_string(stats.num_groups) + " groups of " +
                            std::to_string(kGroups));
  }
  return run;
}

}  // namespace

int BenchLongTail(bool as_json, int reps) {
  auto cfg = common::ModelConfigPreset("tiny");
  if (!cfg.ok()) return Fail("long_tail", cfg.status());
  auto model = common::Model::InitRandom(*cfg, 1);
  if (!model.ok()) return Fail("long_tail", model.status());
  std::shared_ptr<const common::Model> policy(std::move(model).value());
  const std::vector<std::vector<int32_t>> prompts =
      RandomPrompts(kGroups, kPromptTokens, policy->config().vocab_size, 5);
  // Rows decoding at each step, counted through the window hook.
  int64_t steps_seen = 0, rows_now = 0, row_steps = 0;
  rollout::GeneratorOptions o;
  o.num_generations = kG;
  o.max_completion_length = kLong;
  o.max_prompt_length = kPromptTokens;
  o.eos_token_ids = {static_cast<int32_t>(policy->config().vocab_size - 1)};  // ~never sampled
  o.seed = 11;
  o.window_hook = [&](int64_t steps) {
    steps_seen = steps;
    row_steps += rows_now;
  };
  auto gen = rollout::Generator::Create(policy, 0, o);
  if (!gen.ok()) return Fail("long_tail", gen.status());

  std::vector<json> rows;
  for (bool continuous : {false, true}) {
    std::vector<double> seconds;
    LongTailRun last;
    for (int r = 0; r < std::max(1, reps); ++r) {
      row_steps = 0;
      auto run = RunLongTail(**gen, continuous, prompts, &steps_seen, &rows_now);
      if (!run.ok()) return Fail("long_tail", run.status());
      last = *run;
      last.row_steps = row_steps;
      seconds.push_back(run->seconds);
    }
    const Timing t = Summarize(seconds);
    const double occupancy =
        static_cast<double>(last.row_steps) / static_cast<double>(std::max<int64_t>(1, last.steps));
    rows.push_back({{"bench", "long_tail"},
                    {"mode", continuous ? "continuous" : "rounds"},
                    {"groups", kGroups},
                    {"groups_in_flight", kInFlight},
                    {"num_generations", kG},
                    {"budget_short", kShort},
                    {"budget_long", kLong},
                    {"long_every", kLongEvery},
                    {"tokens", last.tokens},
                    {"decode_steps", last.steps},
                    {"mean_rows_decoding", occupancy},
                    {"full_rows", kInFlight * kG},
                    {"s_median", t.median},
                    {"s_min", t.min},
                    {"s_max", t.max},
                    {"groups_per_second", kGroups / t.median},
                    {"tokens_per_second", static_cast<double>(last.tokens) / t.median}});
  }
  // The ideal: every step at full occupancy, i.e. the tokens in tokens / (rows per step) steps.
  const double ideal_steps =
      static_cast<double>(rows[0]["tokens"].get<int64_t>()) / static_cast<double>(kInFlight * kG);
  for (json& r : rows) {
    r["ideal_decode_steps"] = ideal_steps;
    r["vs_ideal_steps"] = ideal_steps / r["decode_steps"].get<double>();
    r["vs_rounds"] = rows[0]["s_median"].get<double>() / r["s_median"].get<double>();
  }
  if (as_json) {
    for (const json& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "long_tail: tiny model, " << kGroups << " prompts x G=" << kG << ", at most "
            << kInFlight << " groups decoding; every " << kLongEvery << "th group " << kLong
            << " tokens, the others " << kShort << "\n"
            << std::fixed;
  for (const json& r : rows) {
    std::cout << "  " << std::left << std::setw(11) << r["mode"].get<std::string>() << std::right
              << std::setprecision(2) << std::setw(7) << r["s_median"].get<double>() << " s "
              << std::setprecision(1) << std::setw(7) << r["groups_per_second"].get<double>()
              << " groups/s " << std::setprecision(0) << std::setw(7)
              << r["tokens_per_second"].get<double>() << " tokens/s  " << std::setw(5)
              << r["decode_steps"].get<int64_t>() << " steps (ideal " << ideal_steps << ")  "
              << std::setprecision(1) << r["mean_rows_decoding"].get<double>() << " of "
              << kInFlight * kG << " rows a step  " << std::setprecision(2)
              << r["vs_rounds"].get<double>() << "x rounds\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
