// The tests' Children (tests/services/process_util.h): a test process that dies without running
// its destructors (CTest's timeout, Ctrl-C, a crash) takes the servers it started with it. And
// ReservedPort (tests/reserved_port.h): a port no concurrent test takes.
#include "tests/services/process_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tests/reserved_port.h"

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

// The port of a socket bound to port 0 on loopback (the kernel's choice), held while `hold`.
int KernelPort(int* hold) {
  *hold = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (*hold < 0 || ::bind(*hold, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 0;
  socklen_t len = sizeof(addr);
  if (::getsockname(*hold, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  return ntohs(addr.sin_port);
}

TEST(ReservedPort, IsBelowThePortsTheKernelHandsOutForPortZero) {
  const int low = ReservedPort::EphemeralRange().first;
  ReservedPort reserved;
  ASSERT_GT(reserved.port(), 0);
  EXPECT_LT(reserved.port(), low);
  EXPECT_GE(reserved.port(), 1024);
  EXPECT_TRUE(ReservedPort::Bindable(reserved.port()));
  // What port 0 gets, a few times over, is in the ephemeral range: never the reserved port.
  int holds[8];
  for (int& hold : holds) {
    const int port = KernelPort(&hold);
    ASSERT_GT(port, 0);
    EXPECT_GE(port, low);
    EXPECT_NE(port, reserved.port());
  }
  for (int hold : holds) ::close(hold);
}

TEST(ReservedPort, IsHeldAgainstOtherReservationsUntilReleased) {
  // 64 reservations at once (the flock is per open file, so this process conflicts with itself as
  // another test process would): all distinct.
  std::set<int> ports;
  {
    std::vector<std::unique_ptr<ReservedPort>> held;
    for (int i = 0; i < 64; ++i) {
      held.push_back(std::make_unique<ReservedPort>());
      ASSERT_GT(held.back()->port(), 0);
      ports.insert(held.back()->port());
    }
    EXPECT_EQ(ports.size(), 64u);
  }
  // Released: the lock file of each can be locked again.
  for (int port : ports) {
    const std::string lock = (fs::temp_directory_path() / "grpo-test-ports" / std::to_string(port));
    const int fd = ::open(lock.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0) << lock;
    EXPECT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0) << port;
    ::close(fd);
  }
}

TEST(ReservedPort, SkipsAPortSomeoneListensOn) {
  // A port bound by another socket is not Bindable, so a reservation never hands it out.
  int hold = -1;
  const int taken = KernelPort(&hold);
  ASSERT_GT(taken, 0);
  ASSERT_EQ(::listen(hold, 1), 0);
  EXPECT_FALSE(ReservedPort::Bindable(taken));
  ::close(hold);
}

}  // namespace
}  // namespace grpo::testing
