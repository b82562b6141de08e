// A minimal HTTP/1.0 GET over a loopback TCP socket, for tests that read /metrics, /healthz or
// Prometheus's API. HTTP/1.0 with `Connection: close`: the server ends the body by closing.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <string>

namespace grpo::testing {

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET http://127.0.0.1:<port><target>; nullopt when the connection or the response fails.
// Every socket operation times out after `timeout_ms`.
inline std::optional<HttpResponse> HttpGet(uint16_t port, const std::string& target,
                                           int timeout_ms = 5000) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return std::nullopt;
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string raw;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        "GET " + target + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
        static_cast<ssize_t>(request.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) raw.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  const size_t head_end = raw.find("\r\n\r\n");
  const size_t sp = raw.find(' ');
  if (head_end == std::string::npos || sp == std::string::npos || raw.rfind("HTTP/", 0) != 0) {
    return std::nullopt;
  }
  HttpResponse r;
  r.status = std::atoi(raw.c_str() + sp + 1);
  r.body = raw.substr(head_end + 4);
  return r;
}

}  // namespace grpo::testing
