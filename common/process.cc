#include "common/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

namespace grpo::common {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kPoll{20};

// O_CLOEXEC: a log of one child must not stay open in the next one.
int OpenOutput(const std::string& path) {
  return ::open(path.empty() ? "/dev/null" : path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                0644);
}

Status Errno(const std::string& what) {
  return Status::Internal(what + ": " + std::strerror(errno));
}

void CloseAll(std::initializer_list<int> fds) {
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
}

}  // namespace

ProcessSupervisor::~ProcessSupervisor() { StopAll(stop_grace_); }

StatusOr<Process*> ProcessSupervisor::Spawn(const std::string& name, ProcessSpec spec) {
  if (spec.argv.empty() || spec.argv[0].empty()) {
    return Status::InvalidArgument("process " + name + ": no program to run");
  }
  // Everything the child needs is made before fork: it may only make async-signal-safe calls.
  std::vector<std::string> args = spec.argv;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int in_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (in_fd < 0) return Errno("open /dev/null");
  int pipe_fds[2] = {-1, -1};
  int out_fd = -1;
  if (spec.pipe_stdout) {
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
      CloseAll({in_fd});
      return Errno("pipe");
    }
    out_fd = pipe_fds[1];
  } else {
    out_fd = OpenOutput(spec.stdout_path);
    if (out_fd < 0) {
      CloseAll({in_fd});
      return Errno("cannot create " + spec.stdout_path);
    }
  }
  int err_fd = -1;
  const bool one_log =
      !spec.pipe_stdout && !spec.stderr_path.empty() && spec.stderr_path == spec.stdout_path;
  if (!one_log) {
    err_fd = OpenOutput(spec.stderr_path);
    if (err_fd < 0) {
      CloseAll({in_fd, out_fd, pipe_fds[0]});
      return Errno("cannot create " + spec.stderr_path);
    }
  }
  const bool own_group = spec.own_group;
  const bool die_with_parent = spec.die_with_parent;
  const pid_t target_pgid = own_group ? 0 : shared_pgid_;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, target_pgid);
    if (die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // the parent is already gone
    }
    ::dup2(in_fd, 0);
    ::dup2(out_fd, 1);
    ::dup2(one_log ? out_fd : err_fd, 2);
    ::execv(argv[0], argv.data());
    const char msg[] = "exec failed: ";
    (void)!::write(2, msg, sizeof(msg) - 1);
    (void)!::write(2, argv[0], std::strlen(argv[0]));
    (void)!::write(2, "\n", 1);
    ::_exit(127);
  }
  const int fork_errno = errno;
  CloseAll({in_fd, out_fd, err_fd});
  if (pid < 0) {
    CloseAll({pipe_fds[0]});
    errno = fork_errno;
    return Errno("fork");
  }
  // Also from the parent, so that a Signal right after Spawn cannot miss the group.
  ::setpgid(pid, own_group ? pid : (shared_pgid_ != 0 ? shared_pgid_ : pid));
  if (!own_group && shared_pgid_ == 0) shared_pgid_ = pid;
  auto p = std::make_unique<Process>();
  p->name = name;
  p->spec = std::move(spec);
  p->pid = pid;
  p->stdout_fd = pipe_fds[0];
  processes_.push_back(std::move(p));
  return processes_.back().get();
}

Process* ProcessSupervisor::Find(const std::string& name) {
  for (auto it = processes_.rbegin(); it != processes_.rend(); ++it) {
    if ((*it)->name == name) return it->get();
  }
  return nullptr;
}

void ProcessSupervisor::SignalProcess(const Process& p, int sig) const {
  if (p.spec.own_group) ::kill(-p.pid, sig);
  ::kill(p.pid, sig);
}

bool ProcessSupervisor::Signal(const std::string& name, int sig) {
  Process* p = Find(name);
  if (p == nullptr || p->reaped) return false;
  SignalProcess(*p, sig);
  return true;
}

void ProcessSupervisor::Finish(Process& p, int wait_status) {
  p.reaped = true;
  p.exit_code = WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 128 + WTERMSIG(wait_status);
  if (p.spec.own_group) ::kill(-p.pid, SIGKILL);  // what it left running in its group
}

std::vector<Process*> ProcessSupervisor::Reap() {
  std::vector<Process*> exited;
  for (auto& p : processes_) {
    if (p->reaped) continue;
    int status = 0;
    if (::waitpid(p->pid, &status, WNOHANG) != p->pid) continue;
    Finish(*p, status);
    exited.push_back(p.get());
  }
  return exited;
}

bool ProcessSupervisor::AllReaped() const {
  for (const auto& p : processes_) {
    if (!p->reaped) return false;
  }
  return true;
}

std::optional<int> ProcessSupervisor::Wait(const std::string& name,
                                           std::chrono::milliseconds timeout) {
  Process* p = Find(name);
  if (p == nullptr) return std::nullopt;
  const auto until = Clock::now() + timeout;
  while (true) {
    Reap();
    if (p->reaped) return p->exit_code;
    if (Clock::now() >= until) return std::nullopt;
    std::this_thread::sleep_for(kPoll);
  }
}

bool ProcessSupervisor::WaitAll(std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  while (Reap(), !AllReaped() && Clock::now() < until) std::this_thread::sleep_for(kPoll);
  return AllReaped();
}

void ProcessSupervisor::Kill(const std::string& name) {
  Process* p = Find(name);
  if (p == nullptr || p->reaped) return;
  KillAndReap(*p);
}

void ProcessSupervisor::KillAndReap(Process& p) {
  SignalProcess(p, SIGKILL);
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(p.pid, &status, 0);
  } while (r < 0 && errno == EINTR);  // a signal to this process (the demo's Ctrl-C) is no exit
  if (r == p.pid) {
    Finish(p, status);
  } else {
    p.reaped = true;  // not our child any more (ECHILD): nothing left to reap
  }
}

void ProcessSupervisor::StopAll(std::chrono::milliseconds grace) {
  Reap();
  if (grace.count() > 0 && !AllReaped()) {
    for (const auto& p : processes_) {
      if (!p->reaped) SignalProcess(*p, SIGTERM);
    }
    if (shared_pgid_ != 0) ::kill(-shared_pgid_, SIGTERM);
    WaitAll(grace);
  }
  for (auto& p : processes_) {
    if (!p->reaped) KillAndReap(*p);
  }
  if (shared_pgid_ != 0) ::kill(-shared_pgid_, SIGKILL);  // grandchildren in the shared group
}

}  // namespace grpo::common
