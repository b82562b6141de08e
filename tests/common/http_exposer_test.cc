// HttpExposer over a real loopback socket, spoken to by a raw-socket HTTP client.
#include "common/http_exposer.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

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

}  // namespace
}  // namespace grpo::common
