// Subcommands of the `grpo` executable. Each Add* registers its subcommands on `app`; the
// chosen one's action is stored in `*action` and run by main after parsing. An action returns
// the process exit code (0 success, 1 runtime failure, 2 bad input).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace grpo::services {

using CliAction = std::function<int()>;

// tokenize, logprobs, init-model: tools on the model layer.
void AddModelToolCommands(CLI::App& app, CliAction* action);
// train-local: generate, score and train in one process.
void AddTrainLocalCommand(CLI::App& app, CliAction* action);

}  // namespace grpo::services
