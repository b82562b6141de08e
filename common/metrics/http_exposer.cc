#include "common/metrics/http_exposer.h"

#include <algorithm>
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <exception>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "common/logging.h"

namespace grpo::common {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;

constexpr const char* kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";
constexpr const char* kTextContentType = "text/plain; charset=utf-8";
constexpr uint32_t kMaxHeaderBytes = 8 * 1024;
constexpr uint64_t kMaxBodyBytes = 4 * 1024;

// One connection: read a request, answer it, repeat while keep-alive. Lives on the server
// thread only, kept alive by the shared_ptr its pending handler holds.
// `open` counts live sessions (the connection cap); it belongs to HttpExposer::Impl, which
// outlives every session.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const Registry& registry, const HttpExposer::HealthCheck& health,
          std::chrono::milliseconds timeout, std::atomic<size_t>& open)
      : stream_(std::move(socket)),
        registry_(registry),
        health_(health),
        timeout_(timeout),
        open_(open) {
    open_.fetch_add(1);
  }
  ~Session() { open_.fetch_sub(1); }

  void Read() {
    parser_.emplace();
    parser_->header_limit(kMaxHeaderBytes);
    parser_->body_limit(kMaxBodyBytes);
    stream_.expires_after(timeout_);
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

 private:
  void OnRead(beast::error_code ec) {
    if (ec) {  // end_of_stream, timeout, malformed request: drop the connection
      Close();
      return;
    }
    const http::request<http::string_body>& req = parser_->get();
    res_ = {};
    res_.version(req.version());
    res_.keep_alive(req.keep_alive());
    res_.set(http::field::server, "grpo");
    try {
      Respond(req);
    } catch (const std::exception& e) {
      SetText(http::status::internal_server_error, std::string("internal error: ") + e.what());
    }
    res_.prepare_payload();
    stream_.expires_after(timeout_);
    http::async_write(stream_, res_, [self = shared_from_this()](beast::error_code ec, size_t) {
      self->OnWrite(ec);
    });
  }

  void Respond(const http::request<http::string_body>& req) {
    std::string_view target(req.target().data(), req.target().size());
    target = target.substr(0, target.find('?'));
    if (req.method() != http::verb::get) {
      SetText(http::status::method_not_allowed, "only GET is served");
      res_.set(http::field::allow, "GET");
      return;
    }
    if (target == "/metrics") {
      res_.result(http::status::ok);
      res_.set(http::field::content_type, kMetricsContentType);
      res_.body() = registry_.Expose();
      return;
    }
    if (target == "/healthz") {
      Status health;
      try {
        if (health_) health = health_();
      } catch (const std::exception& e) {
        health = Status::Internal(std::string("health check threw: ") + e.what());
      } catch (...) {
        health = Status::Internal("health check threw");
      }
      if (health.ok()) {
        SetText(http::status::ok, "ok");
      } else {
        SetText(http::status::service_unavailable, health.ToString());
      }
      return;
    }
    SetText(http::status::not_found, "not found; try /metrics or /healthz");
  }

  void SetText(http::status status, std::string body) {
    res_.result(status);
    res_.set(http::field::content_type, kTextContentType);
    res_.body() = std::move(body) + "\n";
  }

  void OnWrite(beast::error_code ec) {
    if (ec || !res_.keep_alive()) {
      Close();
      return;
    }
    Read();
  }

  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::response<http::string_body> res_;
  const Registry& registry_;
  const HttpExposer::HealthCheck& health_;  // owned by HttpExposer::Impl, which outlives us
  const std::chrono::milliseconds timeout_;
  std::atomic<size_t>& open_;
};

}  // namespace

struct HttpExposer::Impl {
  Impl(const Registry& r, HealthCheck h, HttpExposerLimits l)
      : registry(r), health(std::move(h)), limits(l) {}

  void Accept() {
    acceptor->async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor->is_open()) return;  // stopping
      if (ec) {
        OnAcceptError(ec);
        return;
      }
      backoff = kHttpAcceptBackoffMin;
      if (open.load() >= limits.max_connections) {
        refused.fetch_add(1);
        beast::error_code ignored;
        socket.shutdown(tcp::socket::shutdown_both, ignored);
        socket.close(ignored);
      } else {
        std::make_shared<Session>(std::move(socket), registry, health, limits.io_timeout, open)
            ->Read();
      }
      Accept();
    });
  }

  // Logs at most once per kHttpAcceptErrorLogInterval, and accepts again after `backoff`.
  void OnAcceptError(const beast::error_code& ec) {
    accept_errors.fetch_add(1);
    ++errors_since_log;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_error_log >= kHttpAcceptErrorLogInterval) {
      GRPO_LOG_WARN(
          "metrics http: accept failed: {} ({} failures since the last report; "
          "retrying in {} ms)",
          ec.message(), errors_since_log, backoff.count());
      last_error_log = now;
      errors_since_log = 0;
    }
    retry_timer->expires_after(backoff);
    backoff = std::min(backoff * 2, kHttpAcceptBackoffMax);
    retry_timer->async_wait([this](beast::error_code wait_ec) {
      if (wait_ec || !acceptor->is_open()) return;  // stopping
      Accept();
    });
  }

  void Run() {
    for (;;) {  // a handler that throws (e.g. bad_alloc) must not end the thread or the process
      try {
        io->run();
        return;
      } catch (const std::exception& e) {
        GRPO_LOG_ERROR("metrics http: {}", e.what());
      }
    }
  }

  const Registry& registry;
  const HealthCheck health;
  const HttpExposerLimits limits;
  // Set by Start, reset by Stop (the acceptor and timer before the io_context they use). Touched
  // by the server thread only between the two.
  std::unique_ptr<asio::io_context> io;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::unique_ptr<asio::steady_timer> retry_timer;
  std::chrono::milliseconds backoff = kHttpAcceptBackoffMin;  // server thread
  std::chrono::steady_clock::time_point last_error_log{};     // server thread
  int64_t errors_since_log = 0;                               // server thread
  std::thread thread;
  std::atomic<uint16_t> port{0};
  std::atomic<size_t> open{0};
  std::atomic<int64_t> refused{0};
  std::atomic<int64_t> accept_errors{0};
};

HttpExposer::HttpExposer(const Registry& registry, HealthCheck health,
                         std::chrono::milliseconds io_timeout)
    : HttpExposer(registry, std::move(health),
                  HttpExposerLimits{io_timeout, kDefaultHttpMaxConnections}) {}

HttpExposer::HttpExposer(const Registry& registry, HealthCheck health, HttpExposerLimits limits)
    : impl_(std::make_unique<Impl>(registry, std::move(health), limits)) {}

HttpExposer::~HttpExposer() { Stop(); }

Status HttpExposer::Start(const std::string& host, uint16_t port) {
  if (impl_->io) return Status::FailedPrecondition("metrics http server already started");
  beast::error_code ec;
  asio::ip::address address;
  if (host.empty()) {
    address = asio::ip::address_v4::any();
  } else if (host == "localhost") {
    address = asio::ip::address_v4::loopback();
  } else {
    address = asio::ip::make_address(host, ec);
    if (ec) return Status::InvalidArgument("metrics http: bad host \"" + host + "\"");
  }
  auto io = std::make_unique<asio::io_context>(1);
  auto acceptor = std::make_unique<tcp::acceptor>(*io);
  const tcp::endpoint endpoint(address, port);
  const std::string where = host + ":" + std::to_string(port);
  acceptor->open(endpoint.protocol(), ec);
  if (!ec && address.is_v6()) acceptor->set_option(asio::ip::v6_only(false), ec);  // "::" = all
  if (!ec) acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor->bind(endpoint, ec);
  if (!ec) acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    return Status::Unavailable("metrics http: cannot listen on " + where + ": " + ec.message());
  impl_->port = acceptor->local_endpoint(ec).port();
  impl_->retry_timer = std::make_unique<asio::steady_timer>(*io);
  impl_->backoff = kHttpAcceptBackoffMin;
  impl_->io = std::move(io);
  impl_->acceptor = std::move(acceptor);
  impl_->Accept();
  impl_->thread = std::thread([impl = impl_.get()] { impl->Run(); });
  return Status::OK();
}

void HttpExposer::Stop() {
  if (!impl_->io) return;
  impl_->io->stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  // Destroying the io_context destroys pending handlers, hence the sessions and their sockets.
  impl_->acceptor.reset();
  impl_->retry_timer.reset();
  impl_->io.reset();
  impl_->port = 0;
}

HttpExposerLimits HttpExposerLimitsFrom(const GrpoConfig& config) {
  HttpExposerLimits limits;
  limits.io_timeout = std::chrono::milliseconds(
      static_cast<int64_t>(std::max(0.001, config.metrics_io_timeout_seconds) * 1000));
  limits.max_connections =
      static_cast<size_t>(std::max<int64_t>(1, config.metrics_max_connections));
  return limits;
}

uint16_t HttpExposer::port() const { return impl_->port; }
size_t HttpExposer::open_connections() const { return impl_->open.load(); }
int64_t HttpExposer::refused_connections() const { return impl_->refused.load(); }
int64_t HttpExposer::accept_errors() const { return impl_->accept_errors.load(); }

}  // namespace grpo::common
