// A TCP port a test keeps across a server's restarts. A port the kernel handed out for port 0
// is free again the moment its server dies, and a concurrent test (ctest -j) that binds port 0
// can be handed it before the server comes back on it. ReservedPort takes its port from below
// the kernel's ephemeral range (never handed out for port 0) and holds an flock on a file named
// after it for its own life, so no other test process that reserves ports takes it either.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>

namespace grpo::testing {

class ReservedPort {
 public:
  ReservedPort() {
    const int low = EphemeralRange().first;
    const int first = std::max(1024, low - kSpan);
    const int span = low - first;
    if (span <= 0) {
      ADD_FAILURE() << "no ports below the ephemeral range starting at " << low;
      return;
    }
    const std::filesystem::path dir = std::filesystem::temp_directory_path() / "grpo-test-ports";
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::random_device random;
    const int start = static_cast<int>(random() % static_cast<unsigned>(span));
    for (int i = 0; i < span; ++i) {
      const int port = first + (start + i) % span;
      const std::string lock = (dir / std::to_string(port)).string();
      const int fd = ::open(lock.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0666);
      if (fd < 0) continue;
      if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || !Bindable(port)) {
        ::close(fd);
        continue;
      }
      fd_ = fd;
      port_ = port;
      return;
    }
    ADD_FAILURE() << "no free port in [" << first << ", " << low << ")";
  }
  ~ReservedPort() {
    if (fd_ >= 0) ::close(fd_);  // releases the flock
  }
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;

  // The port; 0 when none could be reserved (a failure was added).
  int port() const { return port_; }

  // /proc/sys/net/ipv4/ip_local_port_range (Linux's default 32768 60999 when unreadable).
  static std::pair<int, int> EphemeralRange() {
    std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
    int low = 0, high = 0;
    if (!(in >> low >> high) || low <= 0 || high < low) return {32768, 60999};
    return {low, high};
  }

  // True if a listening socket can bind `port` on every IPv4 address now, as the servers bind it
  // (SO_REUSEADDR on, so connections left in TIME_WAIT do not count).
  static bool Bindable(int port) {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return false;
    const int one = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(s, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(s);
    return ok;
  }

 private:
  // How many ports below the ephemeral range are candidates.
  static constexpr int kSpan = 8192;
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace grpo::testing
