#include "services/cli/launch.h"

#include <alloca.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <iostream>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

namespace grpo::services {

// Plain C from here up to ReexecWithStartupSettings: it runs before any library is initialised.

// The subcommand in argv (the first word that is not an option or --log_level's value), or
// nullptr.
const char* Subcommand(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--log_level") == 0) {
      ++i;
      continue;
    }
    if (argv[i][0] != '\0' && argv[i][0] != '-') return argv[i];
  }
  return nullptr;
}

namespace {

// Two settings that glibc and libgomp read only at start-up; values the user set are left as
// they are. The launcher sets them before it executes grpo-torch (and the demo for its
// children); grpo-torch started some other way re-executes itself once with them, from its
// .preinit_array, before any library's initialiser has run.
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
// - GLIBC_TUNABLES=glibc.malloc.hugetlb=1, for a binary on glibc's malloc (GRPO_MALLOC=system;
//   tcmalloc, the default, reads no glibc.malloc tunable): libtorch frees and re-allocates its
//   activation buffers every step, and fresh pages are expensive on VMs (about 33 us per 4 KiB
//   page fault measured here); glibc backs large blocks with transparent huge pages only when
//   asked. `grpo bench learner_step`: 21.6 s vs 37.6 s per step.
constexpr const char* kSpinAlone = "GOMP_SPINCOUNT=300000";
constexpr const char* kSpinServing = "GOMP_SPINCOUNT=0";
constexpr const char* kOmpOurs = "GRPO_OMP_DEFAULTS";
constexpr const char* kReexecPid = "GRPO_REEXEC_PID";

bool IsServingCommand(const char* command) {
  if (command == nullptr) return false;
  for (const char* serving : {"learner", "rollout", "reward-server", "env-server", "demo"}) {
    if (std::strcmp(command, serving) == 0) return true;
  }
  return false;
}

// The value of `name` in envp, or nullptr.
const char* EnvValue(char** envp, const char* name) {
  const size_t n = std::strlen(name);
  for (char** e = envp; *e != nullptr; ++e) {
    if (std::strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
  }
  return nullptr;
}

// The settings this process lacks, as "NAME=value" in add[] (room for 4); returns how many.
int MissingStartupSettings(int argc, char** argv, char** envp, const char** add) {
  int adding = 0;
#ifdef GRPO_GLIBC_MALLOC
  if (EnvValue(envp, "GLIBC_TUNABLES") == nullptr)
    add[adding++] = "GLIBC_TUNABLES=glibc.malloc.hugetlb=1";
#endif
  const bool ours = EnvValue(envp, kOmpOurs) != nullptr;
  if (ours || (EnvValue(envp, "OMP_WAIT_POLICY") == nullptr &&
               EnvValue(envp, "GOMP_SPINCOUNT") == nullptr)) {
    const char* spin_setting = IsServingCommand(Subcommand(argc, argv)) ? kSpinServing : kSpinAlone;
    const char* spin = std::strchr(spin_setting, '=') + 1;
    const char* policy = EnvValue(envp, "OMP_WAIT_POLICY");
    const char* now = EnvValue(envp, "GOMP_SPINCOUNT");
    if (!ours || policy == nullptr || std::strcmp(policy, "PASSIVE") != 0 || now == nullptr ||
        std::strcmp(now, spin) != 0) {
      add[adding++] = "OMP_WAIT_POLICY=PASSIVE";
      add[adding++] = spin_setting;
      if (!ours) add[adding++] = "GRPO_OMP_DEFAULTS=1";
    }
  }
  return adding;
}

}  // namespace

bool IsLauncherCommand(const char* command) {
  if (command == nullptr) return false;
  for (const char* light : {"demo", "config", "submit", "status", "watch", "cancel"}) {
    if (std::strcmp(command, light) == 0) return true;
  }
  return false;
}

// grpo-torch runs this from its .preinit_array, which the dynamic loader calls with (argc, argv,
// envp) after relocating every library and before any library's initialiser: libgomp's (which
// reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once), libtorch's (its operator registry: most of the
// 0.29 s a load takes on this 2-core VM) and glibc's, which resets the environment to envp, so a
// setenv there would be lost. When a setting is missing, the process re-executes itself at once
// with it added (about 50 ms here: the libraries mapped and relocated again). Started by the
// launcher (or the demo) it finds them set and goes on; a benchmark's children, which grpo-torch
// starts as itself, may not. The launcher's own commands compute nothing: no re-execution for
// them (grpo-torch runs them too).
// kOmpOurs marks values a grpo process set (inherited by its children), not the user's: a
// serving command started under a computing one (`grpo bench peer_trl` runs `grpo demo`) takes
// its own spin count, not the bench's. kReexecPid (this process's id) is set on the
// re-execution: a process re-executes itself at most once, whatever the loader makes of the
// environment.
void ReexecWithStartupSettings(int argc, char** argv, char** envp) {
  if (IsLauncherCommand(Subcommand(argc, argv))) return;
  char pid_setting[40];
  std::snprintf(pid_setting, sizeof(pid_setting), "%s=%ld", kReexecPid,
                static_cast<long>(::getpid()));
  const char* done = EnvValue(envp, kReexecPid);
  if (done != nullptr && std::strcmp(done, std::strchr(pid_setting, '=') + 1) == 0) return;
  const char* add[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
  int adding = MissingStartupSettings(argc, argv, envp, add);
  if (adding == 0) return;
  add[adding++] = pid_setting;
  // On the stack: nothing here may need an initialised library (not even malloc's).
  size_t kept = 0;
  for (char** e = envp; *e != nullptr; ++e) ++kept;
  char** env = static_cast<char**>(alloca((kept + adding + 1) * sizeof(char*)));
  size_t n = 0;
  for (char** e = envp; *e != nullptr; ++e) {
    bool replaced = false;  // what is set here: OMP_WAIT_POLICY, GOMP_SPINCOUNT, kReexecPid
    for (int i = 0; i < adding; ++i) {
      const size_t name = static_cast<size_t>(std::strchr(add[i], '=') - add[i]);
      replaced = replaced || (std::strncmp(*e, add[i], name + 1) == 0);
    }
    if (!replaced) env[n++] = *e;
  }
  for (int i = 0; i < adding; ++i) env[n++] = const_cast<char*>(add[i]);
  env[n] = nullptr;
  ::execve("/proc/self/exe", argv, env);  // returns only on failure: carry on without
}

void ApplyStartupSettings(int argc, char** argv) {
  const char* add[4] = {nullptr, nullptr, nullptr, nullptr};
  const int adding = MissingStartupSettings(argc, argv, environ, add);
  for (int i = 0; i < adding; ++i) {
    const std::string setting = add[i];
    const size_t eq = setting.find('=');
    ::setenv(setting.substr(0, eq).c_str(), setting.substr(eq + 1).c_str(), 1);
  }
}

// On the CPU libtorch runs bf16 and fp16 matmuls through oneDNN (ideep), which compiles a kernel
// for every shape and keeps it in two caches of 1024 entries each by default: ideep's
// (LRU_CACHE_CAPACITY, read when the first matmul runs) and oneDNN's own
// (ONEDNN_PRIMITIVE_CACHE_CAPACITY). Training and decoding meet a new shape with every
// micro-batch length and every row count, so a bf16 run on the CPU grew by hundreds of MiB
// until the caches were full: `grpo train-local --bf16 true` (tiny model) peaked at 233 MiB at
// its first step, 737 MiB by its 30th and 748 by its 300th, against 188 MiB in fp32. With
// Model::AttendedColumns (most decode shapes gone) and ideep's cache at 128 entries, the same
// run: 353 MiB by step 30, 422 by step 300, at the same speed. oneDNN's own cache, which the
// decode's shapes come back to every generation batch, keeps its size: at 256 entries the
// generation took twice as long (README "bf16 on the CPU").
void BoundKernelCaches() {
  ::setenv("LRU_CACHE_CAPACITY", std::to_string(kKernelCacheCapacity).c_str(), /*overwrite=*/0);
}

// GRPO_PARENT_PID=<pid>: end (SIGTERM) when the process that started this one ends, and at once
// when it has already ended. grpo_serve.start_local sets it instead of running a preexec_fn in
// the child: a preexec_fn makes Python fork without exec and run code in the child, where grpcio's
// fork handlers can restart its poller thread just before the child closes its file
// descriptors; that thread then died of EBADF and took the child with it (SIGABRT, about 1 start
// in 60 of a learner from a process with gRPC calls in flight). The variable is removed so that
// this process's own children (grpo demo's) do not inherit it.
void DieWithParentIfAsked() {
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

namespace {

// The first of `candidates` (made lexically normal) this process may execute, or nullopt;
// `tried` lists them all.
std::optional<std::string> FirstExecutable(std::initializer_list<std::filesystem::path> candidates,
                                           std::string* tried) {
  for (const std::filesystem::path& path : candidates) {
    const std::filesystem::path p = path.lexically_normal();
    if (::access(p.c_str(), X_OK) == 0) return p.string();
    *tried += (tried->empty() ? "" : ", ") + p.string();
  }
  return std::nullopt;
}

}  // namespace

StatusOr<std::string> GrpoTorchExecutable() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return Status::NotFound("no place to look for grpo-torch: " + ec.message());
  if (exe.filename() == "grpo-torch") return exe.string();
  std::string tried;
  std::optional<std::string> found = FirstExecutable(
      {exe.parent_path() / "grpo-torch", exe.parent_path() / ".." / "lib" / "grpo" / "grpo-torch"},
      &tried);
  if (found) return *found;
  return Status::NotFound("grpo-torch (the commands that load libtorch) is in none of " + tried);
}

std::string GrpoLauncherExecutable() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "/proc/self/exe";
  std::string tried;
  return FirstExecutable(
             {exe.parent_path() / "grpo", exe.parent_path() / ".." / ".." / "bin" / "grpo"}, &tried)
      .value_or(exe.string());
}

}  // namespace grpo::services
