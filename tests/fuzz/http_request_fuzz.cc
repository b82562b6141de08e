// libFuzzer target: the requests the metrics server (common/metrics/http_exposer.h) reads from
// any client that can reach its port. One real HttpExposer on loopback serves the whole run; each
// input is sent on a connection of its own, which is then half-closed, and the answer read to
// the server's close. Any input must be answered with HTTP responses or a closed connection,
// never a crash, a hang past the server's own read deadline or undefined behaviour, and the
// server must go on serving: every 64th input is followed by a plain /healthz that must be 200.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "common/metrics/http_exposer.h"
#include "common/metrics/metrics.h"

namespace {

using grpo::common::HttpExposer;
using grpo::common::Registry;

struct Server {
  Registry registry;
  std::unique_ptr<HttpExposer> exposer;
  Server() {
    auto requests = registry.AddCounter("fuzz_requests_total", "Inputs sent, in requests.");
    if (!requests.ok()) std::abort();
    (*requests)->Increment();
    // A short read deadline: an input that is a request cut short is dropped in 200 ms.
    grpo::common::HttpExposerLimits limits;
    limits.io_timeout = std::chrono::milliseconds(200);
    exposer = std::make_unique<HttpExposer>(registry, nullptr, limits);
    if (!exposer->Start("127.0.0.1", 0).ok()) std::abort();
  }
};

Server& TheServer() {
  static Server* server = new Server();  // lives to exit: the exposer's thread serves to the end
  return *server;
}

// Connects `fd` (blocking) to `addr`. libFuzzer's SIGALRM (its -timeout clock) can interrupt
// connect(): the connection then goes on being set up in the background, and connect() itself
// must not be called again until it is done (EALREADY), so wait for the socket to be writable
// and read the outcome from SO_ERROR. Any other failure is the harness's to report, by errno
// (an interrupted connect() aborted a CI run: EINTR is not the server's failure).
void Connect(int fd, const sockaddr_in& addr) {
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) return;
  int err = errno;
  if (err == EINTR) {
    pollfd p{fd, POLLOUT, 0};
    int ready;
    do {
      ready = ::poll(&p, 1, 5000);
    } while (ready < 0 && errno == EINTR);
    if (ready == 1) {
      socklen_t len = sizeof(err);
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;  // getsockopt's
      if (err == 0) return;
    } else {
      err = ready == 0 ? ETIMEDOUT : errno;
    }
  }
  std::fprintf(stderr, "http_request_fuzz: connect: %s\n", std::strerror(err));
  std::abort();
}

// Sends `request`, half-closes, and returns everything the server wrote before it closed.
std::string Exchange(std::string_view request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) std::abort();
  timeval timeout{5, 0};  // far past the server's 200 ms: a hang is a finding
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(TheServer().exposer->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  Connect(fd, addr);
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;  // libFuzzer's SIGALRM (its -timeout clock)
    if (n <= 0) break;  // the server may close on a bad request before reading it all
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  std::string response;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;  // libFuzzer's SIGALRM (its -timeout clock)
      if (errno == ECONNRESET) break;
      // EAGAIN: the 5 s receive timeout, the server neither answered nor closed.
      std::fprintf(stderr, "http_request_fuzz: recv: %s\n", std::strerror(errno));
      std::abort();
    }
    response.append(buf, static_cast<size_t>(n));
  }
  // Reset rather than TIME_WAIT: a long run opens more connections than there are ports.
  linger hard{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
  ::close(fd);
  return response;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static uint64_t inputs = 0;
  const std::string response =
      Exchange(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!response.empty() && response.rfind("HTTP/", 0) != 0) std::abort();
  if (++inputs % 64 == 0) {
    const std::string health = Exchange("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    if (health.rfind("HTTP/1.1 200 ", 0) != 0) std::abort();
  }
  return 0;
}
