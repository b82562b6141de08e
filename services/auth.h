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

// The whole of a PEM file named by config key `key` ("" for an empty path). NotFound naming the
// key and path when unreadable, InvalidArgument when it holds no PEM block.
StatusOr<std::string> ReadPemFile(const std::string& path, const char* key);

// Server credentials from tls_cert_file + tls_key_file (insecure when both are empty).
StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const common::GrpoConfig& config);

// Insecure credentials, or TLS when `root_certs_pem` is non-empty.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const std::string& root_certs_pem);

// Channel with explicit message size limits (weights stream in chunks well under them).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const std::string& root_certs_pem = "");

inline constexpr int kMaxMessageBytes = 64 << 20;

}  // namespace grpo::services
