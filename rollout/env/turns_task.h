// "turns": the built-in multi-turn task of `grpo demo --task multi_turn`, which a tiny policy
// initialised from scratch learns on CPU in minutes. The environment answers every model turn
// with a short user message ("ok") and ends the episode (done) after the row's "turns" turns
// (default kDefaultTaskTurns); each stepped turn earns 1/turns. A turn that runs the episode out
// of max_completion_length is never stepped, so the reward, the fraction of the turns completed
// (0, 1/3, 2/3, 1 with three turns), rises as the policy learns to keep its turns short enough
// for all of them to fit.
#pragma once

#include <cstdint>
#include <memory>

#include "rollout/env/environment.h"

namespace grpo::rollout {

inline constexpr int64_t kDefaultTaskTurns = 3;

std::unique_ptr<Environment> MakeTurnsEnvironment();

}  // namespace grpo::rollout
