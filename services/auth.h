// Shared-token authentication for every RPC, and optional TLS. The token travels as
// `authorization: Bearer <token>` metadata; it is never logged nor exported as a metric.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_metadata_processor.h>

#include <memory>
#include <string>
#include <string_view>

#include "common/config.h"
#include "common/status.h"

namespace grpo::services {

// Reads the token of config key `key` from `path` (trailing whitespace stripped). Empty path = no
// auth (empty token). NotFound when the file cannot be read; InvalidArgument when it is empty or
// holds a byte that gRPC metadata cannot carry (outside printable ASCII 0x20-0x7e: gRPC aborts
// the process on such a value), naming the key, the path and the byte's offset, never the token.
StatusOr<std::string> ReadAuthToken(const std::string& path, const char* key = "auth_token_file");

// Server side: OK when `token` is empty (auth off) or the call carries it; UNAUTHENTICATED
// otherwise. Constant-time comparison. Handlers keep calling it as defence in depth behind the
// credentials' TokenAuthProcessor.
grpc::Status CheckAuth(const grpc::ServerContextBase& context, const std::string& token);

// Methods served without the token: grpc.health.v1 Check and Watch (they reveal only SERVING or
// NOT_SERVING, and probes such as Kubernetes' carry no token).
bool IsUnauthenticatedMethod(std::string_view path);

// Checks `authorization: Bearer <token>` in a call's initial metadata, inside gRPC's transport,
// before the request message is read: a refused call costs its headers, not its body
// (UNAUTHENTICATED, the message ending in kRefusedBeforeTheBody). Non-blocking (a constant-time
// compare); thread-safe.
inline constexpr const char* kRefusedBeforeTheBody = " (refused before the request was read)";
class TokenAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenAuthProcessor(std::string token) : token_(std::move(token)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const std::string token_;
};

// Client side: adds the token to a call.
void AddAuth(grpc::ClientContext& context, const std::string& token);

// The whole of a PEM file named by config key `key` ("" for an empty path). NotFound naming the
// key and path when unreadable, InvalidArgument when it holds no PEM block.
StatusOr<std::string> ReadPemFile(const std::string& path, const char* key);

// Server credentials from tls_cert_file + tls_key_file (insecure when both are empty). A
// non-empty `auth_token` installs a TokenAuthProcessor for it, with TLS and without (gRPC's own
// InsecureServerCredentials() cannot take a processor: it aborts).
StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const common::GrpoConfig& config, const std::string& auth_token = "");

// Insecure credentials, or TLS when `root_certs_pem` is non-empty.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const std::string& root_certs_pem);

// Channel with explicit message size limits (weights stream in chunks well under them).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const std::string& root_certs_pem = "");

inline constexpr int kMaxMessageBytes = 64 << 20;

// Server limits (GrpoConfig grpc_memory_quota_mb, grpc_max_threads) on `builder`: a
// grpc::ResourceQuota named `name` bounding transport buffers and the threads serving calls
// (calls beyond the threads are refused with RESOURCE_EXHAUSTED), the message size limits, and
// the port held alone (no SO_REUSEPORT: a second server on a held port fails to listen).
void ApplyServerLimits(grpc::ServerBuilder& builder, const common::GrpoConfig& config,
                       const std::string& name);

// True for loopback literals ("127.x.y.z", "::1", "localhost"); false for wildcards and any
// other address. For the "auth is off on an open port" warning.
bool IsLoopbackAddress(std::string_view host);

}  // namespace grpo::services
