// Subcommands of the `grpo` executables (services/cli/launch.h). Each Add* registers its
// subcommands on `app`; the chosen one's action is stored in `*action` and run by main after
// parsing. An action returns the process exit code (0 success, 1 runtime failure, 2 bad input).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <limits>
#include <string>

#include "common/config.h"
#include "common/status.h"

namespace grpo::services {

using CliAction = std::function<int()>;

// config: the effective configuration as JSON.
void AddConfigCommand(CLI::App& app, CliAction* action);
// tokenize, logprobs, init-model: tools on the model layer.
void AddModelToolCommands(CLI::App& app, CliAction* action);
// train-local: generate, score and train in one process.
void AddTrainLocalCommand(CLI::App& app, CliAction* action);
// generate: the rollout engine as a JSON Lines tool.
void AddGenerateCommand(CLI::App& app, CliAction* action);
// bench: the benchmarks of docs/BENCHMARKS.md.
void AddBenchCommand(CLI::App& app, CliAction* action);
// rollout (a worker against a learner) and reward-server (RewardService over built-ins).
void AddRolloutCommands(CLI::App& app, CliAction* action);
// env-server: a built-in environment over EnvironmentService (multi-turn episodes).
void AddEnvServerCommand(CLI::App& app, CliAction* action);

// demo: a learner and rollout workers as processes on loopback learn the built-in task.
void AddDemoCommand(CLI::App& app, CliAction* action);

// learner (the service) and its clients: submit, status, watch, cancel.
void AddLearnerCommands(CLI::App& app, CliAction* action);
// submit, status, watch, cancel (registered by AddLearnerCommands).
void AddClientCommands(CLI::App& app, CliAction* action);

// plan: the memory plan of a learner rank (learner/distributed/memory_plan.h).
void AddPlanCommand(CLI::App& app, CliAction* action);

// The exit code of a command line CLI11 refused, after it printed why: 0 for --help and
// --version, else 2 (bad input, as an action says it); CLI11's own codes (105 for a value out
// of range, 109 for an unknown option, ...) are not the ones the commands document.
inline int ParseErrorExit(const CLI::App& app, const CLI::ParseError& e) {
  return app.exit(e) == 0 ? 0 : 2;
}

// A whole number of at least 1 (CLI::PositiveNumber takes any double above 0 and names the
// double's range, 0 to 1.8e308, in its message).
inline CLI::Validator AtLeastOne() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        long long v = 0;
        if (!CLI::detail::lexical_cast(value, v) || v < 1 || v > std::numeric_limits<int>::max()) {
          return "must be a whole number from 1 to " +
                 std::to_string(std::numeric_limits<int>::max()) + ", got " + value;
        }
        return {};
      },
      "INT>=1");
}

}  // namespace grpo::services
