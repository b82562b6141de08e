// `grpo`: the executable users, scripts and containers run. A launcher without libtorch: the
// commands that compute nothing (demo, config and the learner's clients: submit, status, watch,
// cancel) run here; every other command (and --help, --version) executes grpo-torch with the same
// arguments, in the same process (services/cli/launch.h). libtorch's start costs about 0.3 s of
// CPU on this 2-core VM; `grpo demo` paid it before it could start its learner and workers (which
// pay it again, side by side), and `grpo status` paid it for one RPC.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <iostream>
#include <string>

#include "common/logging.h"
#include "services/cli/cli.h"
#include "services/cli/launch.h"

int main(int argc, char** argv) {
  // For what runs next: grpo-torch, or the demo's learner and workers.
  grpo::services::ApplyStartupSettings(argc, argv);
  if (!grpo::services::IsLauncherCommand(grpo::services::Subcommand(argc, argv))) {
    auto torch = grpo::services::GrpoTorchExecutable();
    if (!torch.ok()) {
      std::cerr << "grpo: " << torch.status().ToString() << "\n";
      return 127;
    }
    ::execv(torch->c_str(), argv);
    std::cerr << "grpo: cannot execute " << *torch << ": " << std::strerror(errno) << "\n";
    return 127;
  }
  grpo::services::DieWithParentIfAsked();
  std::signal(SIGPIPE, SIG_IGN);  // a peer that closed its socket is an error, not a kill
  CLI::App app{"grpo-serve: distributed GRPO fine-tuning of language models"};
  std::string log_level = "warn";
  app.add_option("--log_level", log_level, "trace|debug|info|warn|error|off (stderr)");
  app.require_subcommand(1);
  grpo::services::CliAction action;
  grpo::services::AddConfigCommand(app, &action);
  grpo::services::AddClientCommands(app, &action);
  grpo::services::AddDemoCommand(app, &action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return grpo::services::ParseErrorExit(app, e);
  }
  if (grpo::Status s = grpo::common::InitLogging(log_level); !s.ok()) {
    std::cerr << "grpo: " << s.ToString() << "\n";
    return 2;
  }
  if (!action) return 2;
  return action();
}
