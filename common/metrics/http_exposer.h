// HttpExposer: a small HTTP/1.1 server (Boost.Beast) on its own thread serving
//   GET /metrics  200, `text/plain; version=0.0.4; charset=utf-8`, body Registry::Expose()
//   GET /healthz  200 "ok", or 503 with the health callback's message
// 404 for other paths, 405 for other methods. Every socket read and write has a deadline
// (house rule: every network wait has one), so an idle or slow client cannot hold the server.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/config.h"
#include "common/metrics/metrics.h"
#include "common/status.h"

namespace grpo::common {

// Per-request deadline for reading a request and writing its response; an idle keep-alive
// connection, or one that trickles its request (slowloris), is closed after it.
inline constexpr std::chrono::milliseconds kDefaultHttpIoTimeout{10'000};
// Open connections at most; one accepted beyond it is closed at once (a scraper needs one).
inline constexpr size_t kDefaultHttpMaxConnections = 64;
// After a failed accept (EMFILE, ENFILE, ENOBUFS ...) the next one waits this long, doubling up
// to the maximum, back to the minimum after a success: no busy loop while fds are exhausted.
inline constexpr std::chrono::milliseconds kHttpAcceptBackoffMin{10};
inline constexpr std::chrono::milliseconds kHttpAcceptBackoffMax{1000};
// Failed accepts are logged at most once per this interval (with the count in between).
inline constexpr std::chrono::milliseconds kHttpAcceptErrorLogInterval{1000};

struct HttpExposerLimits {
  std::chrono::milliseconds io_timeout = kDefaultHttpIoTimeout;
  size_t max_connections = kDefaultHttpMaxConnections;  // >= 1
};
// From config keys metrics_io_timeout_seconds and metrics_max_connections.
HttpExposerLimits HttpExposerLimitsFrom(const GrpoConfig& config);

// Start/Stop/port may be called from any thread (not concurrently with each other), but not
// from the health callback.
class HttpExposer {
 public:
  // OK = healthy. Runs on the server thread, once per /healthz request: must be quick and
  // thread-safe. Exceptions it throws become a 503.
  using HealthCheck = std::function<Status()>;

  // `registry` is borrowed and must outlive the exposer. No `health` = always healthy.
  explicit HttpExposer(const Registry& registry, HealthCheck health = nullptr,
                       std::chrono::milliseconds io_timeout = kDefaultHttpIoTimeout);
  HttpExposer(const Registry& registry, HealthCheck health, HttpExposerLimits limits);
  ~HttpExposer();  // Stop()s
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  // Binds `host` (an IPv4/IPv6 literal, "localhost"; "" = 0.0.0.0, "::" = IPv4 and IPv6) and `port`
  // (0 = a free port; see port()) and starts serving. InvalidArgument for a bad host,
  // Unavailable when the address cannot be bound, FailedPrecondition when already started.
  Status Start(const std::string& host, uint16_t port);
  // Closes the listener and every connection, and joins the thread. Idempotent.
  void Stop();
  // The bound port while started; 0 otherwise.
  uint16_t port() const;
  // Connections open now (at most limits.max_connections), connections closed at once because
  // the cap was reached, and failed accepts, since construction. Any thread.
  size_t open_connections() const;
  int64_t refused_connections() const;
  int64_t accept_errors() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace grpo::common
