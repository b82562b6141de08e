// common::ProcessSupervisor against /bin/sh children: exit codes and signals as POSIX reports
// them, logs where the spec says, groups signalled whole, and nothing left running after StopAll
// or the destructor.
#include "common/process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace grpo::common {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class ProcessSupervisorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("grpo_process_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  ProcessSpec Sh(const std::string& script) {
    ProcessSpec spec;
    spec.argv = {"/bin/sh", "-c", script};
    spec.stdout_path = (dir_ / "out").string();
    spec.stderr_path = (dir_ / "err").string();
    return spec;
  }
  std::string Read(const std::string& name) {
    std::ifstream in(dir_ / name);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // Polls a pid file the child wrote until it holds a pid.
  pid_t PidFrom(const std::string& name) {
    for (int i = 0; i < 250; ++i) {
      const std::string text = Read(name);
      if (!text.empty() && text.back() == '\n') return static_cast<pid_t>(std::stol(text));
      std::this_thread::sleep_for(20ms);
    }
    return -1;
  }
  bool FileSays(const std::string& name, const std::string& text) {
    for (int i = 0; i < 250; ++i) {
      if (Read(name) == text) return true;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }
  // Running (a zombie is not: an orphan is reaped by whatever init this machine has, or never).
  static bool Alive(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string stat;
    if (!std::getline(in, stat)) return false;
    const size_t paren = stat.rfind(')');
    return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
  }

  fs::path dir_;
};

TEST_F(ProcessSupervisorTest, ReportsTheExitCodeAndWritesStdoutAndStderrWhereAsked) {
  ProcessSupervisor sup;
  auto p = sup.Spawn("a", Sh("echo to-out; echo to-err >&2; exit 3"));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(sup.Wait("a", 10s), 3);
  EXPECT_TRUE((*p)->reaped);
  EXPECT_EQ(Read("out"), "to-out\n");
  EXPECT_EQ(Read("err"), "to-err\n");
  EXPECT_FALSE(sup.Signal("a", SIGTERM));  // reaped: nothing to signal
  EXPECT_EQ(sup.Wait("nobody", 10ms), std::nullopt);
}

TEST_F(ProcessSupervisorTest, OneLogForBothStreamsAndStdinIsEmpty) {
  ProcessSupervisor sup;
  ProcessSpec spec = Sh("echo one; echo two >&2; cat; echo three");
  spec.stderr_path = spec.stdout_path;
  ASSERT_TRUE(sup.Spawn("a", spec).ok());
  EXPECT_EQ(sup.Wait("a", 10s), 0);  // cat read /dev/null: EOF at once
  EXPECT_EQ(Read("out"), "one\ntwo\nthree\n");
}

TEST_F(ProcessSupervisorTest, APipedStdoutIsReadFromTheParent) {
  ProcessSupervisor sup;
  ProcessSpec spec = Sh("echo '{\"port\": 41}'");
  spec.pipe_stdout = true;
  auto p = sup.Spawn("a", spec);
  ASSERT_TRUE(p.ok());
  ASSERT_GE((*p)->stdout_fd, 0);
  char buf[64] = {};
  std::string got;
  for (ssize_t n; (n = ::read((*p)->stdout_fd, buf, sizeof(buf))) > 0;) got.append(buf, n);
  ::close((*p)->stdout_fd);
  EXPECT_EQ(got, "{\"port\": 41}\n");
  EXPECT_EQ(sup.Wait("a", 10s), 0);
}

TEST_F(ProcessSupervisorTest, AProgramThatCannotBeExecutedExits127AndSaysSo) {
  ProcessSupervisor sup;
  ProcessSpec spec;
  spec.argv = {(dir_ / "no-such-program").string()};
  spec.stderr_path = (dir_ / "err").string();
  ASSERT_TRUE(sup.Spawn("a", spec).ok());
  EXPECT_EQ(sup.Wait("a", 10s), 127);
  EXPECT_EQ(Read("err"), "exec failed: " + (dir_ / "no-such-program").string() + "\n");
  EXPECT_FALSE(sup.Spawn("b", ProcessSpec{}).ok());  // no argv
  ProcessSpec bad_log = Sh("true");
  bad_log.stdout_path = (dir_ / "missing-dir" / "out").string();
  EXPECT_FALSE(sup.Spawn("c", bad_log).ok());
}

TEST_F(ProcessSupervisorTest, ASignalReachesTheChildsWholeGroupAndTheCodeIs128PlusIt) {
  ProcessSupervisor sup;
  // The child starts a grandchild in its group and waits on it.
  ASSERT_TRUE(
      sup.Spawn("a", Sh("sleep 100 & echo $! > " + (dir_ / "grandchild").string() + "; wait"))
          .ok());
  const pid_t grandchild = PidFrom("grandchild");
  ASSERT_GT(grandchild, 0);
  EXPECT_TRUE(Alive(grandchild));
  EXPECT_EQ(sup.Wait("a", 200ms), std::nullopt);  // still running
  EXPECT_TRUE(sup.Signal("a", SIGTERM));
  EXPECT_EQ(sup.Wait("a", 10s), 128 + SIGTERM);
  // The grandchild got the same SIGTERM (one group); reparented to init it is reaped there.
  const auto until = Clock::now() + 10s;
  while (Alive(grandchild) && Clock::now() < until) std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(Alive(grandchild));
}

TEST_F(ProcessSupervisorTest, StopAllTermsThenKillsWhatIgnoresTheTermAfterTheGrace) {
  ProcessSupervisor sup;
  ASSERT_TRUE(sup.Spawn("polite", Sh("exec sleep 100")).ok());
  ProcessSpec stubborn = Sh("trap '' TERM; echo ready > " + (dir_ / "ready").string() +
                            "; while true; do sleep 0.05; done");
  stubborn.stdout_path = (dir_ / "stubborn-out").string();
  ASSERT_TRUE(sup.Spawn("stubborn", stubborn).ok());
  ASSERT_TRUE(FileSays("ready", "ready\n"));  // the trap is set
  const auto t0 = Clock::now();
  sup.StopAll(500ms);
  const auto took = Clock::now() - t0;
  EXPECT_TRUE(sup.AllReaped());
  EXPECT_EQ(sup.Find("polite")->exit_code, 128 + SIGTERM);
  EXPECT_EQ(sup.Find("stubborn")->exit_code, 128 + SIGKILL);
  EXPECT_GE(took, 450ms);  // it waited the grace for the stubborn one
  EXPECT_LT(took, 10s);
}

TEST_F(ProcessSupervisorTest, ChildrenOutsideTheirOwnGroupShareOneThatStopAllSignals) {
  pid_t grandchild = -1;
  pid_t pid_a = -1, pid_b = -1;
  {
    ProcessSupervisor sup;
    ProcessSpec a = Sh("sleep 100 & echo $! > " + (dir_ / "grandchild").string() + "; wait");
    a.own_group = false;
    a.die_with_parent = true;
    ProcessSpec b = Sh("exec sleep 100");
    b.own_group = false;
    auto pa = sup.Spawn("a", a);
    auto pb = sup.Spawn("b", b);
    ASSERT_TRUE(pa.ok() && pb.ok());
    pid_a = (*pa)->pid;
    pid_b = (*pb)->pid;
    EXPECT_EQ(::getpgid(pid_a), pid_a);  // the first leads the shared group
    EXPECT_EQ(::getpgid(pid_b), pid_a);
    grandchild = PidFrom("grandchild");
    ASSERT_GT(grandchild, 0);
    EXPECT_EQ(::getpgid(grandchild), pid_a);
    // A reused name: Find and Signal take the newest.
    ASSERT_TRUE(sup.Spawn("b", Sh("exit 5")).ok());
    EXPECT_EQ(sup.Wait("b", 10s), 5);
    EXPECT_NE(sup.Find("b")->pid, pid_b);
  }  // the destructor kills and reaps all, grandchild included
  EXPECT_FALSE(Alive(pid_a));
  EXPECT_FALSE(Alive(pid_b));
  const auto until = Clock::now() + 10s;
  while (Alive(grandchild) && Clock::now() < until) std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(Alive(grandchild));
}

TEST_F(ProcessSupervisorTest, KillIsImmediateAndTakesTheGroupWithIt) {
  ProcessSupervisor sup;
  ASSERT_TRUE(sup.Spawn("a", Sh("trap '' TERM; sleep 100 & echo $! > " +
                                (dir_ / "grandchild").string() + "; wait"))
                  .ok());
  const pid_t grandchild = PidFrom("grandchild");
  ASSERT_GT(grandchild, 0);
  const auto t0 = Clock::now();
  sup.Kill("a");
  EXPECT_LT(Clock::now() - t0, 5s);
  EXPECT_EQ(sup.Find("a")->exit_code, 128 + SIGKILL);
  const auto until = Clock::now() + 10s;
  while (Alive(grandchild) && Clock::now() < until) std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(Alive(grandchild));
}

}  // namespace
}  // namespace grpo::common
