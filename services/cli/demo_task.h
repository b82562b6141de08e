// The built-in demo task, shared by `grpo train-local` and `grpo demo`: short
// chat prompts and TRL's length reward (target kDemoTargetLength tokens), with
// defaults under which a tiny policy initialised from scratch learns it in a
// couple of minutes on 2 CPU cores. Also the reward-curve report both commands
// end with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/config.h"

namespace grpo::services {

// The length reward's target (tokens).
inline constexpr int64_t kDemoTargetLength = 8;

// Dataset rows ({"messages": [...]}, one user question each). A policy
// initialised from scratch almost never emits EOS early, so the length reward
// starts near -(max_completion_length - target) and rises as it learns to stop.
std::vector<nlohmann::json> BuiltinDataset();

// The training defaults of the demo task (batching, learning rate, schedule,
// max_steps 60, reward_funcs [length], seed 1); output_dir and checkpointing
// are left to the caller.
common::GrpoConfig DemoTaskConfig();

// The multi-turn demo task (`grpo demo --task multi_turn`): DemoTaskConfig with the built-in
// "turns" environment (rollout/env/turns_task.h: three turns, answered "ok", each worth 1/3 once
// stepped) and its reward (reward_funcs [env]); max_completion_length bounds the whole episode
// and is small enough that only short turns let all three fit.
common::GrpoConfig MultiTurnTaskConfig();

// {"length": {"target_length": target}}: the reward options of the demo task.
nlohmann::json DemoRewardOptions(int64_t target_length = kDemoTargetLength);

// A text plot of y over steps: `height` rows, one column per bucket of steps
// (at most `width`).
std::string TextPlot(const std::vector<double> &y, int width = 60, int height = 12);

// Mean and standard error of the mean of v[b, e); 0 when the range is empty (or
// has one value).
double Mean(const std::vector<double> &v, size_t b, size_t e);
double StdErr(const std::vector<double> &v, size_t b, size_t e);

// First-k vs last-k comparison of a reward curve (k = min(10, n / 3), at least
// 1).
struct CurveSummary {
  size_t steps = 0, window = 0;
  double first = 0, last = 0;
  double gain_in_std_errors = 0;  // (last - first) / sqrt(se_first^2 + se_last^2); 0 if se = 0
};
CurveSummary SummarizeCurve(const std::vector<double> &curve);

}  // namespace grpo::services
