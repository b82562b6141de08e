// `grpo`: the one executable of grpo-serve. Containers run it with different subcommands.
#include <ATen/Parallel.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/cuda/cuda_module.h"
#include "common/logging.h"
#include "common/malloc_info.h"
#include "services/cli/cli.h"

namespace {

constexpr const char* kVersion = "0.1.0";

// `grpo config [--config FILE] [--key value ...]`: the effective configuration as JSON, after
// validation. Users check what a run will use; deployments lint their YAML with it.
void AddConfigCommand(CLI::App& app, grpo::services::CliAction* action) {
  auto* cmd = app.add_subcommand("config",
                                 "Print the effective configuration (YAML file plus "
                                 "--key value overrides) as JSON, after validation");
  cmd->allow_extras();
  cmd->footer("Keys:\n" + grpo::common::ConfigHelp());
  cmd->callback([cmd, action] {
    *action = [cmd] {
      grpo::common::GrpoConfig config;
      grpo::Status s = grpo::common::ApplyConfigOverrides(config, cmd->remaining());
      if (s.ok()) s = config.Validate();
      if (!s.ok()) {
        std::cerr << "grpo config: " << s.ToString() << "\n";
        return 2;
      }
      std::cout << config.ToJson().dump(2) << "\n";
      return 0;
    };
  });
}

}  // namespace

// Two settings that glibc and libgomp read only at start-up, applied by re-executing once;
// values the user set are left as they are.
// - GLIBC_TUNABLES=glibc.malloc.hugetlb=1: libtorch frees and re-allocates its activation
//   buffers every step, and fresh pages are expensive on VMs (about 33 us per 4 KiB page fault
//   measured here); glibc backs large blocks with transparent huge pages only when asked.
//   `grpo bench learner_step`: 21.6 s vs 37.6 s per step. For a binary built with glibc's
//   malloc (GRPO_MALLOC=system); tcmalloc, the default, reads no glibc.malloc tunable.
// - OMP_WAIT_POLICY=PASSIVE, with GOMP_SPINCOUNT=300000 for commands that compute alone (set
//   together, only when the user set neither):
//   - For a command that has the machine to itself (train-local, generate, bench, the model
//     tools), an OpenMP thread that finished a parallel region spins about 3 ms (libgomp's
//     estimate: 100,000 spins per ms) for the next one, then sleeps. With more OpenMP threads in
//     the process than cores it does not spin at all (PASSIVE makes libgomp's throttled spin
//     count 0). Sleeping at once made every small op wake a thread and park it again, so that
//     two intra-op threads were slower than one. `grpo train-local` on the demo task (2 cores,
//     2 threads, ms per step, generation + training), GOMP_SPINCOUNT 0 -> 300000: tiny model
//     65 + 111 -> 22 + 35 (one thread: 23 + 50); bench model 394 + 887 -> 233 + 645 (one
//     thread: 461 + 1228).
//   - The serving processes (learner, rollout, reward-server, env-server, and demo, whose
//     children they are) sleep at once (spin 0). They share machines: the demo, compose on one
//     host, the fault tests. A spinning team takes the core another process needs. With spin, a
//     learner and 2 workers at 2 threads each on 2 cores ran 2.03 steps/s instead of 4.49
//     (`grpo bench peer_trl --fast`'s services rows), and elastic_workers_test took 86 s instead
//     of 36.
//   - Not ACTIVE (spin for good): idle threads would hold the cores, and with Debian's libtorch
//     on OpenBLAS spinning cost a step 3.27 s instead of 1.56 s.
inline constexpr const char* kOmpSpinCount = "300000";
inline constexpr const char* kOmpOurs = "GRPO_OMP_DEFAULTS";

// The subcommand in argv (the first word that is not an option or --log_level's value).
static std::string Subcommand(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--log_level") {
      ++i;
      continue;
    }
    if (!a.empty() && a[0] != '-') return a;
  }
  return "";
}

static bool IsServingCommand(const std::string& command) {
  return command == "learner" || command == "rollout" || command == "reward-server" ||
         command == "env-server" || command == "demo";
}

static void ReexecWithRuntimeSettingsOnce(int argc, char** argv) {
  bool changed = false;
  if (std::getenv("GLIBC_TUNABLES") == nullptr) {
    ::setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1", 1);
    changed = true;
  }
  // kOmpOurs marks values a grpo process set (inherited by its children), not the user's: a
  // serving command started under a computing one (`grpo bench peer_trl` runs `grpo demo`) takes
  // its own spin count, not the bench's.
  const bool ours = std::getenv(kOmpOurs) != nullptr;
  if (ours ||
      (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr)) {
    const char* spin = IsServingCommand(Subcommand(argc, argv)) ? "0" : kOmpSpinCount;
    const char* now = std::getenv("GOMP_SPINCOUNT");
    if (!ours || now == nullptr || std::string(now) != spin) {
      ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
      ::setenv("GOMP_SPINCOUNT", spin, 1);
      ::setenv(kOmpOurs, "1", 1);
      changed = true;
    }
  }
  // `grpo demo` computes nothing itself: its children (learner, workers) inherit the settings,
  // and the demo starts about half a second sooner (libtorch's load, paid once, not twice).
  if (Subcommand(argc, argv) == "demo") return;
  if (changed) ::execv("/proc/self/exe", argv);  // returns only on failure: carry on without
}

// GRPO_PARENT_PID=<pid>: end (SIGTERM) when the process that started this one ends, and at once
// when it has already ended. grpo_serve.start_local sets it instead of running a preexec_fn in
// the child: a preexec_fn makes Python fork without exec and run code in the child, where grpcio's
// fork handlers can restart its poller thread just before the child closes its file
// descriptors; that thread then died of EBADF and took the child with it (SIGABRT, about 1 start
// in 60 of a learner from a process with gRPC calls in flight). The variable is removed so that
// this process's own children (grpo demo's) do not inherit it.
static void DieWithParentIfAsked() {
  const char* value = std::getenv("GRPO_PARENT_PID");
  if (value == nullptr) return;
  char* end = nullptr;
  const long parent = std::strtol(value, &end, 10);
  const bool valid = *value != '\0' && *end == '\0' && parent > 0;
  ::unsetenv("GRPO_PARENT_PID");
  if (!valid) {
    std::cerr << "grpo: GRPO_PARENT_PID='" << value << "' is not a process id; ignored\n";
    return;
  }
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != static_cast<pid_t>(parent)) ::raise(SIGTERM);  // already orphaned
}

int main(int argc, char** argv) {
  ReexecWithRuntimeSettingsOnce(argc, argv);
  // Before anything asks libtorch about CUDA (common/cuda/cuda_module.h).
  if (grpo::Status s = grpo::common::LoadCudaModule(); !s.ok()) {
    std::cerr << "grpo: " << s.ToString() << "\n";
    return 1;
  }
  DieWithParentIfAsked();
  // A write to a peer that closed its socket is an error to handle, not a signal that kills the
  // process: Gloo writes without MSG_NOSIGNAL, so a worker continued after a SIGSTOP outlasted
  // its group (the learner closed it) died of SIGPIPE (gloo_stall_test, chaos_test).
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"grpo-serve: distributed GRPO fine-tuning of language models"};
  app.set_version_flag("--version", [] {
    return std::string(kVersion) + "\nCUDA module: " + grpo::common::CudaModuleState() +
           "\nmalloc: " + grpo::common::MallocName();
  });
  std::string log_level = "warn";
  app.add_option("--log_level", log_level, "trace|debug|info|warn|error|off (stderr)");
  app.require_subcommand(1);

  grpo::services::CliAction action;
  AddConfigCommand(app, &action);
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
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
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
  return action();
}
