// The tests' Children (tests/services/process_util.h): a test process that dies without running
// its destructors (CTest's timeout, Ctrl-C, a crash) takes the servers it started with it.
#include "tests/services/process_util.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

namespace grpo::testing {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// Running (a zombie is not: an orphan is reaped by whatever init this machine has, or never).
bool Alive(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

TEST(Children, DieWithTheTestProcessThatStartedThem) {
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_children_test_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path pid_file = dir / "child.pid";
  // A test process in miniature (this one, forked: one thread, as a test's main thread): it starts
  // a child through Children, says its pid, and waits to be killed.
  const pid_t test_process = ::fork();
  ASSERT_GE(test_process, 0);
  if (test_process == 0) {
    Children children(dir);
    const pid_t child = children.Spawn("server", {"/bin/sleep", "300"});
    {
      std::ofstream out(dir / "child.pid.tmp");
      out << child << "\n";
    }
    fs::rename(dir / "child.pid.tmp", pid_file);
    while (true) ::pause();
  }
  pid_t child = -1;
  ASSERT_TRUE(WaitUntil(
      [&] {
        const std::string text = ReadFile(pid_file);
        if (text.empty()) return false;
        child = static_cast<pid_t>(std::stol(text));
        return true;
      },
      milliseconds(10000)));
  ASSERT_GT(child, 0);
  ASSERT_TRUE(Alive(child));

  ::kill(test_process, SIGKILL);  // no destructor runs
  int status = 0;
  ASSERT_EQ(::waitpid(test_process, &status, 0), test_process);
  EXPECT_TRUE(WaitUntil([&] { return !Alive(child); }, milliseconds(5000)))
      << "the child " << child << " outlived the test process that started it";
  if (Alive(child)) ::kill(child, SIGKILL);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace grpo::testing
