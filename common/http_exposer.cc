#include "common/http_exposer.h"

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
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
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, const Registry& registry, const HttpExposer::HealthCheck& health,
          std::chrono::milliseconds timeout)
      : stream_(std::move(socket)), registry_(registry), health_(health), timeout_(timeout) {}

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
};

}  // namespace

struct HttpExposer::Impl {
  Impl(const Registry& r, HealthCheck h, std::chrono::milliseconds t)
      : registry(r), health(std::move(h)), timeout(t) {}

  void Accept() {
    acceptor->async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted || !acceptor->is_open()) return;  // stopping
      if (!ec) {
        std::make_shared<Session>(std::move(socket), registry, health, timeout)->Read();
      } else {
        GRPO_LOG_WARN("metrics http: accept failed: {}", ec.message());
      }
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
  const std::chrono::milliseconds timeout;
  // Set by Start, reset by Stop (the acceptor before the io_context it uses). Touched by the
  // server thread only between the two.
  std::unique_ptr<asio::io_context> io;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::thread thread;
  std::atomic<uint16_t> port{0};
};

HttpExposer::HttpExposer(const Registry& registry, HealthCheck health,
                         std::chrono::milliseconds io_timeout)
    : impl_(std::make_unique<Impl>(registry, std::move(health), io_timeout)) {}

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
  impl_->io.reset();
  impl_->port = 0;
}

uint16_t HttpExposer::port() const { return impl_->port; }

}  // namespace grpo::common
