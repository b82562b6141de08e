// Shared-token authentication for every RPC, and optional TLS. The token travels as
// `authorization: Bearer <token>` metadata; it is never logged nor exported as a metric.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "common/config.h"
#include "common/status.h"

namespace grpo::services {

// Reads the token (trailing whitespace stripped). Empty path = no auth (empty token).
// NotFound / InvalidArgument (empty file) naming the path otherwise.
StatusOr<std::string> ReadAuthToken(const std::string& path);

// Server side: OK when `token` is empty (auth off) or the call carries it; UNAUTHENTICATED
// otherwise. Constant-time comparison.
grpc::Status CheckAuth(const grpc::ServerContext& context, const std::string& token);

// Client side: adds the token to a call.
void AddAuth(grpc::ClientContext& context, const std::string& token);

// Insecure credentials, or TLS when `root_certs_pem` is non-empty.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const std::string& root_certs_pem);

// Channel with explicit message size limits (weights stream in chunks well under them).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const std::string& root_certs_pem = "");

inline constexpr int kMaxMessageBytes = 64 << 20;

}  // namespace grpo::services
