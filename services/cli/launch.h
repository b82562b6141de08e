// How a `grpo` process starts: the settings glibc and libgomp read only at start-up, and the two
// executables. `grpo` (services/cli/main.cc) is a launcher without libtorch: it runs the commands
// that compute nothing itself (demo, config, submit, status, watch, cancel) and executes
// `grpo-torch` (torch_main.cc, every command) for the rest, so that those commands do not pay
// libtorch's start (about 0.3 s of CPU here) and the demo starts its children at once.
#pragma once

#include <string>

#include "common/status.h"

namespace grpo::services {

// The settings (described in launch.cc) are complete for argv's command in envp; else the
// process re-executes itself with them added, at once. Plain C: grpo-torch calls it from its
// .preinit_array, before any library (libgomp, libtorch, glibc's own) has been initialised. A
// process re-executes itself at most once.
void ReexecWithStartupSettings(int argc, char** argv, char** envp);

// Sets the settings argv's command lacks in this process's environment, for what it executes
// next: the launcher's grpo-torch, or the demo's children (whose own settings are the serving
// ones, as the demo's).
void ApplyStartupSettings(int argc, char** argv);

// The subcommand in argv (the first word that is not an option or --log_level's value), or
// nullptr.
const char* Subcommand(int argc, char** argv);

// Whether `command` (Subcommand's) is one the launcher runs itself (it needs no libtorch).
bool IsLauncherCommand(const char* command);

// LRU_CACHE_CAPACITY=kKernelCacheCapacity unless the user set it (launch.cc): the kernels
// libtorch keeps for the bf16/fp16 matmuls it runs on the CPU. Before the first matmul.
inline constexpr int kKernelCacheCapacity = 128;
void BoundKernelCaches();

// GRPO_PARENT_PID=<pid>: end (SIGTERM) when that process ends (main.cc's callers).
void DieWithParentIfAsked();

// grpo-torch: this executable when it is grpo-torch, else the first of grpo-torch beside it and
// in ../lib/grpo/ from it that exists (the image installs it there); NotFound naming them.
StatusOr<std::string> GrpoTorchExecutable();

// The `grpo` launcher beside this executable (or in ../../bin/ from ../lib/grpo/), else this
// executable: what a benchmark's script runs as GRPO_BIN.
std::string GrpoLauncherExecutable();

}  // namespace grpo::services
