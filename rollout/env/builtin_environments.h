// Environments built into grpo, by name: what `grpo env-server --task NAME` serves and what a
// worker can step in process. Each is a FunctionEnvironment (rollout/env/environment.h).
//
// guess_number: guess a secret integer; the dataset row's prompt states the task.
//   Reset: the secret is low + seed % (high - low + 1), with "low" and "high" from the row
//     (integers, low <= high; default 1 and 100, so the secret is 1 + seed % 100). No messages.
//     InvalidArgument for a bad "low"/"high".
//   Step: the guess is the last integer in the action text (an optional '-' before its digits).
//     Answers one "user" message: "higher" (the secret is higher than the guess), "lower", or
//     "correct" with reward 1.0 and done; reward 0.0 otherwise. No integer in the text: "say a
//     number", reward 0.0. It never ends the episode otherwise (the episode loop's turn limit
//     does). Metadata: {"guesses": N}, the number of integers guessed so far.
// turns: the multi-turn demo task (rollout/env/turns_task.h).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "rollout/env/environment.h"

namespace grpo::rollout {

// The names MakeBuiltinEnvironment knows, sorted.
std::vector<std::string> BuiltinEnvironmentNames();

// A new environment of the built-in task `name` (its name() is `name`). InvalidArgument listing
// the known names for any other name. The environment is thread-safe (Open from any thread).
StatusOr<std::unique_ptr<Environment>> MakeBuiltinEnvironment(std::string_view name);

}  // namespace grpo::rollout
