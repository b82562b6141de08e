// `grpo-torch`: every `grpo` command; the `grpo` launcher (main.cc) executes it for those that
// load libtorch (services/cli/launch.h). Containers run `grpo` with different subcommands.
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/cuda/cuda_module.h"
#include "common/logging.h"
#include "common/malloc_info.h"
#include "common/mapped_allocator.h"
#include "services/cli/cli.h"
#include "services/cli/launch.h"

namespace {

constexpr const char* kVersion = "0.1.0";

// Ends the process with `code` once its output is written, without the libraries' static
// destructors: libtorch's deregister every operator it registered at start, about 75 ms of every
// grpo-torch process's end on this 2-core VM (`grpo-torch generate --help`, 6 runs each: 0.32-0.37
// s with them, 0.25-0.29 s without). Nothing of ours finishes work in a static destructor: a
// command stops its services, checkpoints and closes its ledger before it returns. Sanitizer
// builds end normally: LeakSanitizer reports from an exit handler.
[[noreturn]] void ExitWithoutTeardown(int code) {
  std::cout.flush();
  std::cerr.flush();
  if (auto* logger = spdlog::default_logger_raw(); logger != nullptr) logger->flush();
  std::fflush(nullptr);
#ifdef GRPO_SANITIZED
  std::exit(code);
#else
  std::_Exit(code);
#endif
}

}  // namespace

// The startup settings (launch.cc), from the .preinit_array: before any library's initialiser.
__attribute__((section(".preinit_array"), used)) static void (*const kReexecWithStartupSettings)(
    int, char**, char**) = &grpo::services::ReexecWithStartupSettings;

int main(int argc, char** argv) {
  // The demo's children (the other commands have them from the launcher or the re-execution).
  grpo::services::ApplyStartupSettings(argc, argv);
  grpo::common::InstallMappedCpuAllocator();
  grpo::services::BoundKernelCaches();
  // Before anything asks libtorch about CUDA (common/cuda/cuda_module.h).
  if (grpo::Status s = grpo::common::LoadCudaModule(); !s.ok()) {
    std::cerr << "grpo: " << s.ToString() << "\n";
    return 1;
  }
  grpo::services::DieWithParentIfAsked();
  // A write to a peer that closed its socket is an error to handle, not a signal that kills the
  // process: Gloo writes without MSG_NOSIGNAL, so a worker continued after a SIGSTOP outlasted
  // its group (the learner closed it) died of SIGPIPE (gloo_stall_test, chaos_test).
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"grpo-serve: distributed GRPO fine-tuning of language models"};
  app.set_version_flag("--version", [] {
    return std::string(kVersion) + "\nCUDA module: " + grpo::common::CudaModuleState() +
           "\nmalloc: " + grpo::common::MallocName() +
           "\ncpu allocator: " + grpo::common::CpuAllocatorName();
  });
  std::string log_level = "warn";
  app.add_option("--log_level", log_level, "trace|debug|info|warn|error|off (stderr)");
  app.require_subcommand(1);

  grpo::services::CliAction action;
  grpo::services::AddConfigCommand(app, &action);
  grpo::services::AddModelToolCommands(app, &action);
  grpo::services::AddTrainLocalCommand(app, &action);
  grpo::services::AddLearnerCommands(app, &action);
  grpo::services::AddPlanCommand(app, &action);
  grpo::services::AddBenchCommand(app, &action);
  grpo::services::AddGenerateCommand(app, &action);
  grpo::services::AddRolloutCommands(app, &action);
  grpo::services::AddEnvServerCommand(app, &action);
  grpo::services::AddDemoCommand(app, &action);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // --help, --version, or a usage error
    ExitWithoutTeardown(grpo::services::ParseErrorExit(app, e));
  }
  if (grpo::Status s = grpo::common::InitLogging(log_level); !s.ok()) {
    std::cerr << "grpo: " << s.ToString() << "\n";
    return 2;
  }
  if (!action) return 2;
  // libgomp starts libtorch with one intra-op thread here; use every core unless the user set
  // OMP_NUM_THREADS.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
  ExitWithoutTeardown(action());
}
