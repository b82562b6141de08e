// Child processes that are always stopped and reaped: the one supervisor behind `grpo demo`
// (a learner and its workers) and the tests that run `grpo` and reference servers as real
// processes (tests/services/process_util.h). POSIX fork/exec, nothing else.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace grpo::common {

struct ProcessSpec {
  // argv[0] is a path (execv: no PATH search).
  std::vector<std::string> argv;
  // Files the child's stdout and stderr are written to (truncated first; the same path for both
  // gives one log). Empty: /dev/null. stdin is always /dev/null.
  std::string stdout_path;
  std::string stderr_path;
  // stdout to a pipe instead of stdout_path; Process::stdout_fd is its read end, the caller's
  // to close.
  bool pipe_stdout = false;
  // A process group of its own, so Signal reaches it (and what it started) alone. Otherwise it
  // joins the supervisor's one group (its first such child leads it), which StopAll signals at
  // once.
  bool own_group = true;
  // SIGKILL when the thread that spawned it exits (PR_SET_PDEATHSIG): for a supervisor that
  // lives on the main thread, so that a crash of the parent leaves no orphan behind.
  bool die_with_parent = false;
};

// exit_code: the exit status, or 128 + the signal that ended it; -1 until reaped.
struct Process {
  std::string name;
  ProcessSpec spec;
  pid_t pid = -1;
  int stdout_fd = -1;
  int exit_code = -1;
  bool reaped = false;
};

// Not thread-safe: one thread at a time. The destructor stops whatever still runs (SIGKILL at once
// unless given a grace) and reaps it, so no process outlives its supervisor.
class ProcessSupervisor {
 public:
  // The destructor stops what still runs with StopAll(stop_grace).
  explicit ProcessSupervisor(std::chrono::milliseconds stop_grace = {}) : stop_grace_(stop_grace) {}
  ~ProcessSupervisor();
  ProcessSupervisor(const ProcessSupervisor&) = delete;
  ProcessSupervisor& operator=(const ProcessSupervisor&) = delete;

  // Starts spec.argv. A child that cannot exec writes "exec failed" to its stderr and exits
  // 127. Errors: the log or the pipe cannot be created, fork fails.
  StatusOr<Process*> Spawn(const std::string& name, ProcessSpec spec);

  // The newest process started under `name`, or null.
  Process* Find(const std::string& name);

  // Sends `sig` to the process (to its group when it has its own); false when it is not
  // running (reaped, or never started).
  bool Signal(const std::string& name, int sig);

  // Reaps processes that exited, without blocking; returns them. A process with its own group
  // takes what it left running in that group with it (SIGKILL).
  std::vector<Process*> Reap();
  bool AllReaped() const;

  // Waits up to `timeout` for the newest `name` to exit: its exit code, or nullopt while it
  // still runs (or was never started).
  std::optional<int> Wait(const std::string& name, std::chrono::milliseconds timeout);
  // Waits up to `timeout` for every process; true when all exited.
  bool WaitAll(std::chrono::milliseconds timeout);

  // SIGKILL and reap the newest `name`; returns once it is gone.
  void Kill(const std::string& name);
  // SIGTERM to every running process (every group), up to `grace` for them to exit, then
  // SIGKILL; returns once all are reaped. A zero grace kills at once.
  void StopAll(std::chrono::milliseconds grace);

  const std::vector<std::unique_ptr<Process>>& processes() const { return processes_; }

 private:
  void SignalProcess(const Process& p, int sig) const;
  void Finish(Process& p, int wait_status);
  // SIGKILL, then a blocking reap.
  void KillAndReap(Process& p);

  const std::chrono::milliseconds stop_grace_;
  pid_t shared_pgid_ = 0;  // the first shared-group child's pid
  std::vector<std::unique_ptr<Process>> processes_;
};

}  // namespace grpo::common
