// HttpExposer over a real loopback socket, spoken to by a raw-socket HTTP client.
#include "common/metrics/http_exposer.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace grpo::common {
namespace {

// Connects to 127.0.0.1:port with a 5 s receive timeout; -1 on failure.
int Connect(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Everything the server sends until it closes the connection (or 5 s pass).
std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

struct Response {
  int status = 0;
  std::string headers;  // the header block, lower-cased names as sent
  std::string body;
};

Response Parse(const std::string& raw) {
  Response r;
  const size_t end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return r;
  r.status = std::stoi(raw.substr(9, 3));
  r.headers = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  return r;
}

Response Request(uint16_t port, const std::string& method, const std::string& target) {
  const int fd = Connect(port);
  EXPECT_GE(fd, 0);
  if (fd < 0) return {};
  const std::string req =
      method + " " + target + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  const std::string raw = ReadAll(fd);
  ::close(fd);
  return Parse(raw);
}

class HttpExposerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    requests_ = registry_.AddCounter("test_requests_total", "Requests, in requests.").value();
    requests_->Increment(3);
  }
  Registry registry_;
  Counter* requests_ = nullptr;
};

TEST_F(HttpExposerTest, ServesMetricsAsPrometheusText) {
  HttpExposer exposer(registry_);
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  ASSERT_NE(exposer.port(), 0);
  const Response r = Request(exposer.port(), "GET", "/metrics");
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.headers.find("Content-Type: text/plain; version=0.0.4; charset=utf-8"),
            std::string::npos)
      << r.headers;
  EXPECT_EQ(r.body,
            "# HELP test_requests_total Requests, in requests.\n"
            "# TYPE test_requests_total counter\n"
            "test_requests_total 3\n");
}

TEST_F(HttpExposerTest, MetricsReflectUpdatesBetweenScrapes) {
  HttpExposer exposer(registry_);
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  requests_->Increment();
  EXPECT_NE(Request(exposer.port(), "GET", "/metrics?x=1").body.find("test_requests_total 4\n"),
            std::string::npos);
}

TEST_F(HttpExposerTest, HealthzIsOkWithoutACallback) {
  HttpExposer exposer(registry_);
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const Response r = Request(exposer.port(), "GET", "/healthz");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "ok\n");
}

TEST_F(HttpExposerTest, HealthzIs503WithTheCallbacksReason) {
  HttpExposer exposer(registry_, [] { return Status::Unavailable("ledger is not open"); });
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const Response r = Request(exposer.port(), "GET", "/healthz");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.body, "UNAVAILABLE: ledger is not open\n");
}

TEST_F(HttpExposerTest, HealthCallbackThatThrowsIs503) {
  HttpExposer exposer(registry_, []() -> Status { throw std::runtime_error("boom"); });
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const Response r = Request(exposer.port(), "GET", "/healthz");
  EXPECT_EQ(r.status, 503);
  EXPECT_NE(r.body.find("boom"), std::string::npos);
}

TEST_F(HttpExposerTest, OtherPathsAre404AndOtherMethods405) {
  HttpExposer exposer(registry_);
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  EXPECT_EQ(Request(exposer.port(), "GET", "/").status, 404);
  EXPECT_EQ(Request(exposer.port(), "GET", "/metricsx").status, 404);
  const Response post = Request(exposer.port(), "POST", "/metrics");
  EXPECT_EQ(post.status, 405);
  EXPECT_NE(post.headers.find("Allow: GET"), std::string::npos) << post.headers;
}

TEST_F(HttpExposerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  HttpExposer exposer(registry_);
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const int fd = Connect(exposer.port());
  ASSERT_GE(fd, 0);
  const std::string reqs =
      "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(::send(fd, reqs.data(), reqs.size(), 0), static_cast<ssize_t>(reqs.size()));
  const std::string raw = ReadAll(fd);
  ::close(fd);
  EXPECT_EQ(raw.find("HTTP/1.1 200"), 0u) << raw;
  EXPECT_NE(raw.find("HTTP/1.1 200", 1), std::string::npos) << raw;
}

TEST_F(HttpExposerTest, IdleConnectionIsClosedAfterTheReadTimeout) {
  HttpExposer exposer(registry_, nullptr, std::chrono::milliseconds(200));
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const int fd = Connect(exposer.port());
  ASSERT_GE(fd, 0);
  const auto start = std::chrono::steady_clock::now();
  char c;
  EXPECT_EQ(::recv(fd, &c, 1, 0), 0);  // orderly close by the server, not our 5 s timeout
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  ::close(fd);
  EXPECT_EQ(Request(exposer.port(), "GET", "/healthz").status, 200);  // still serving
}

TEST_F(HttpExposerTest, StopClosesOpenConnectionsAndFreesThePort) {
  auto exposer = std::make_unique<HttpExposer>(registry_);
  ASSERT_TRUE(exposer->Start("127.0.0.1", 0).ok());
  const uint16_t port = exposer->port();
  // A keep-alive connection that has been served once, then sits idle across Stop.
  const int fd = Connect(port);
  ASSERT_GE(fd, 0);
  const std::string req = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(fd, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  std::string got;
  char buf[512];
  while (got.find("\r\n\r\nok\n") == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, static_cast<size_t>(n));
  }
  exposer->Stop();
  exposer->Stop();  // idempotent
  EXPECT_EQ(exposer->port(), 0);
  EXPECT_EQ(::recv(fd, buf, 1, 0), 0) << std::strerror(errno);  // FIN, not our 5 s timeout
  ::close(fd);
  EXPECT_LT(Connect(port), 0);
  HttpExposer again(registry_);
  EXPECT_TRUE(again.Start("127.0.0.1", port).ok());
}

TEST_F(HttpExposerTest, StartErrors) {
  HttpExposer a(registry_);
  EXPECT_EQ(a.Start("not an address", 0).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.Start("127.0.0.1", 0).ok());
  EXPECT_EQ(a.Start("127.0.0.1", 0).code(), StatusCode::kFailedPrecondition);
  HttpExposer b(registry_);
  EXPECT_EQ(b.Start("127.0.0.1", a.port()).code(), StatusCode::kUnavailable);  // port taken
}

// Polls `cond` every 20 ms until it holds or `timeout` passes; returns its last value.
bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

// Open file descriptors of this process.
int OpenFds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n - 1;  // the directory's own fd
}

// True when the server has closed `fd` (EOF or reset), without blocking.
bool ClosedByServer(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) != 1) return false;
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
}

// A client that connects and sends nothing holds a slot only until the cap: connections beyond
// limits.max_connections are closed at once, the server holds at most the cap, and /metrics
// answers a new client as soon as the holders go away (issue 12 item 7).
TEST_F(HttpExposerTest, ConnectionsBeyondTheCapAreClosedAtOnce) {
  constexpr size_t kCap = 8;
  constexpr int kClients = 40;
  // Held connections would stay open for a minute: only the cap can close them in this test.
  HttpExposer exposer(registry_, nullptr, HttpExposerLimits{std::chrono::seconds(60), kCap});
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const int fds_before = OpenFds();
  std::vector<int> clients;
  for (int i = 0; i < kClients; ++i) {
    const int fd = Connect(exposer.port());
    ASSERT_GE(fd, 0) << "connection " << i;
    clients.push_back(fd);
  }
  const auto closed = [&] { return std::count_if(clients.begin(), clients.end(), ClosedByServer); };
  int64_t closed_now = 0;
  EXPECT_TRUE(WaitFor(
      [&] {
        closed_now = closed();
        return closed_now >= kClients - static_cast<int64_t>(kCap);
      },
      std::chrono::seconds(20)))
      << closed_now << " of " << kClients << " closed; the server holds "
      << exposer.open_connections();
  EXPECT_EQ(exposer.open_connections(), kCap);
  EXPECT_EQ(exposer.refused_connections(), kClients - static_cast<int64_t>(kCap));
  RecordProperty("fds_before", fds_before);
  RecordProperty("fds_while_held", OpenFds());
  // Our kClients sockets plus the server's side of the kCap it keeps (+2 for slack).
  EXPECT_LE(OpenFds(), fds_before + kClients + static_cast<int>(kCap) + 2);
  for (int fd : clients) ::close(fd);
  EXPECT_TRUE(WaitFor([&] { return Request(exposer.port(), "GET", "/metrics").status == 200; },
                      std::chrono::seconds(20)));
  EXPECT_TRUE(WaitFor([&] { return exposer.open_connections() == 0; }, std::chrono::seconds(20)));
  EXPECT_LE(OpenFds(), fds_before + 2);
}

// A client that trickles its request a byte at a time (slowloris) is cut off at the I/O deadline
// of the whole request, not refreshed by every byte.
TEST_F(HttpExposerTest, SlowlorisIsClosedAtTheRequestDeadline) {
  HttpExposer exposer(
      registry_, nullptr,
      HttpExposerLimits{std::chrono::milliseconds(500), kDefaultHttpMaxConnections});
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const int fd = Connect(exposer.port());
  ASSERT_GE(fd, 0);
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: ";
  const auto start = std::chrono::steady_clock::now();
  bool closed = false;
  for (size_t i = 0; std::chrono::steady_clock::now() - start < std::chrono::seconds(30); ++i) {
    const char c = i < req.size() ? req[i] : 'a';
    if (::send(fd, &c, 1, MSG_NOSIGNAL) != 1 || ClosedByServer(fd)) {
      closed = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the attack's pace
  }
  EXPECT_TRUE(closed) << "a trickling client held its connection for 30 s";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  ::close(fd);
  EXPECT_EQ(Request(exposer.port(), "GET", "/healthz").status, 200);
}

// Accept failing with EMFILE (the process is out of file descriptors) must not spin: the server
// backs off (10 ms doubling to 1 s) and logs at most once a second, then serves the waiting
// client once descriptors are free again. Today's failure: half a million lines a second.
TEST_F(HttpExposerTest, AcceptErrorsBackOffAndAreLoggedRateLimited) {
  std::ostringstream log;
  auto previous = spdlog::default_logger();
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("http_exposer_test", sink));
  HttpExposer exposer(registry_);
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  // The client's socket exists before descriptors run out; it connects after, so the server's
  // accept of it is the first allocation that fails.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  // Every descriptor below the lowest free one is in use, so a soft limit equal to it makes
  // the next allocation (the server's accept) fail with EMFILE.
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  const int lowest_free = ::dup(0);
  ASSERT_GE(lowest_free, 0);
  ::close(lowest_free);
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(lowest_free);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(exposer.port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected =
      ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;  // kernel backlog
  const std::string req = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  const bool sent = ::send(fd, req.data(), req.size(), 0) == static_cast<ssize_t>(req.size());
  // A fixed window to measure a rate over (not a synchronisation).
  const auto window = std::chrono::milliseconds(2500);
  std::this_thread::sleep_for(window);
  const int64_t errors = exposer.accept_errors();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(connected && sent) << std::strerror(errno);

  std::string text;
  {
    spdlog::default_logger()->flush();
    text = log.str();
  }
  const auto lines = std::count(text.begin(), text.end(), '\n');
  RecordProperty("accept_errors", static_cast<int>(errors));
  RecordProperty("log_lines", static_cast<int>(lines));
  // With backoff: attempts at ~10, 30, 70, 150, 310, 630, 1270, 2270 ms: 8 in 2.5 s; give room
  // for a slow machine but far below a busy loop.
  EXPECT_GE(errors, 1) << "accept never failed: the test did not exhaust descriptors";
  EXPECT_LE(errors, 20);
  EXPECT_GE(lines, 1);
  EXPECT_LE(lines, 5) << text.substr(0, 2000);
  EXPECT_NE(text.find("Too many open files"), std::string::npos) << text.substr(0, 2000);
  // The waiting client is served once descriptors are back (within the 1 s backoff cap).
  const std::string raw = ReadAll(fd);
  ::close(fd);
  spdlog::set_default_logger(previous);
  EXPECT_EQ(Parse(raw).status, 200) << raw;
}

}  // namespace
}  // namespace grpo::common
