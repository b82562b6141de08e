// DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13; TRL's
// `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`) as a built-in reward
// function, `soft_overlong_punishment`: with L = the completion's tokens, L_max and L_cache,
//   0                                   L <= L_max - L_cache
//   ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max
//   -1                                  L > L_max
// It punishes completions near the length limit without rewarding short ones.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/status.h"
#include "rollout/reward.h"

namespace grpo::rollout {

// options {"max_completion_len": int >= 1 (required; RewardRunner::FromConfig fills in the
// config's max_completion_length), "soft_punish_cache": int in [0, max_completion_len]
// (default max_completion_len / 5, DAPO's 4096 of 20480)}. InvalidArgument naming the option.
StatusOr<std::unique_ptr<RewardFunction>> MakeSoftOverlongPunishment(const nlohmann::json& options);

// The reward of one completion of `tokens` tokens.
double SoftOverlongPunishment(int64_t tokens, int64_t max_completion_len,
                              int64_t soft_punish_cache);

}  // namespace grpo::rollout
