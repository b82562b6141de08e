#include "services/auth.h"

#include <grpc/grpc_security.h>
#include <grpcpp/resource_quota.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace grpo::services {
namespace {

// `got == "Bearer " + token` in time that depends on the lengths only.
bool BearerMatches(std::string_view got, const std::string& token) {
  const std::string want = "Bearer " + token;
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) diff |= got[i] ^ want[i];
  return diff == 0;
}

// Insecure server credentials that take an AuthMetadataProcessor: core's insecure credentials
// (grpc_insecure_server_credentials_create) with a C processor that calls the C++ one inline on
// gRPC's thread (so it must not block; AuthContext is null and consumed or response metadata are
// ignored: TokenAuthProcessor uses none of them).
class ProcessedInsecureServerCredentials final : public grpc::ServerCredentials {
 public:
  ProcessedInsecureServerCredentials() : creds_(grpc_insecure_server_credentials_create()) {}
  ~ProcessedInsecureServerCredentials() override { grpc_server_credentials_release(creds_); }

  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>& processor) override {
    auto* state = new std::shared_ptr<grpc::AuthMetadataProcessor>(processor);
    grpc_server_credentials_set_auth_metadata_processor(creds_, {&Process, &Destroy, state});
  }

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), creds_);
  }

  static void Process(void* state, grpc_auth_context* /*context*/, const grpc_metadata* md,
                      size_t num_md, grpc_process_auth_metadata_done_cb cb, void* user_data) {
    auto& processor = *static_cast<std::shared_ptr<grpc::AuthMetadataProcessor>*>(state);
    grpc::AuthMetadataProcessor::InputMetadata input;
    for (size_t i = 0; i < num_md; ++i) {
      input.emplace(
          grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].key)),
                           GRPC_SLICE_LENGTH(md[i].key)),
          grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].value)),
                           GRPC_SLICE_LENGTH(md[i].value)));
    }
    grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
    const grpc::Status s = processor->Process(input, nullptr, &consumed, &response);
    cb(user_data, nullptr, 0, nullptr, 0, static_cast<grpc_status_code>(s.error_code()),
       s.ok() ? nullptr : s.error_message().c_str());
  }
  static void Destroy(void* state) {
    delete static_cast<std::shared_ptr<grpc::AuthMetadataProcessor>*>(state);
  }

  grpc_server_credentials* const creds_;  // owned
};

}  // namespace

StatusOr<std::string> ReadAuthToken(const std::string& path, const char* key) {
  if (path.empty()) return std::string();
  const std::string what = std::string(key) + " " + path;
  if (std::error_code ec; std::filesystem::is_directory(path, ec)) {
    return Status::InvalidArgument(what + " is a directory, not a token file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot read " + what);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token = ss.str();
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) {
    token.pop_back();
  }
  if (token.empty()) return Status::InvalidArgument(what + " is empty");
  // What gRPC accepts in a non-binary metadata value (grpc_header_nonbin_value_is_legal).
  for (size_t i = 0; i < token.size(); ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c < 0x20 || c > 0x7e) {
      char byte[8];
      std::snprintf(byte, sizeof(byte), "0x%02x", c);
      return Status::InvalidArgument(what + " holds byte " + byte + " at offset " +
                                     std::to_string(i) +
                                     ": a token must be printable ASCII (gRPC metadata)");
    }
  }
  return token;
}

grpc::Status CheckAuth(const grpc::ServerContextBase& context, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing authorization metadata");
  }
  if (!BearerMatches(std::string_view(it->second.data(), it->second.size()), token)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad token");
  }
  return grpc::Status::OK;
}

bool IsUnauthenticatedMethod(std::string_view path) {
  return path == "/grpc.health.v1.Health/Check" || path == "/grpc.health.v1.Health/Watch";
}

grpc::Status TokenAuthProcessor::Process(const InputMetadata& auth_metadata,
                                         grpc::AuthContext* /*context*/,
                                         OutputMetadata* /*consumed_auth_metadata*/,
                                         OutputMetadata* /*response_metadata*/) {
  if (token_.empty()) return grpc::Status::OK;
  if (auto path = auth_metadata.find(":path");
      path != auth_metadata.end() &&
      IsUnauthenticatedMethod(std::string_view(path->second.data(), path->second.size()))) {
    return grpc::Status::OK;
  }
  auto it = auth_metadata.find("authorization");
  if (it == auth_metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        std::string("missing authorization metadata") + kRefusedBeforeTheBody);
  }
  if (!BearerMatches(std::string_view(it->second.data(), it->second.size()), token_)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        std::string("bad token") + kRefusedBeforeTheBody);
  }
  return grpc::Status::OK;
}

void AddAuth(grpc::ClientContext& context, const std::string& token) {
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
}

StatusOr<std::string> ReadPemFile(const std::string& path, const char* key) {
  if (path.empty()) return std::string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(std::string("cannot read ") + key + " " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string pem = ss.str();
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return Status::InvalidArgument(std::string(key) + " " + path + " holds no PEM block");
  }
  return pem;
}

// SslServerCredentials from tls_cert_file + tls_key_file, both set.
static StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsServerCredentials(
    const common::GrpoConfig& config);

StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const common::GrpoConfig& config, const std::string& auth_token) {
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (config.tls_cert_file.empty() && config.tls_key_file.empty()) {
    if (auth_token.empty()) return grpc::InsecureServerCredentials();
    creds = std::make_shared<ProcessedInsecureServerCredentials>();
  } else {
    ASSIGN_OR_RETURN(creds, TlsServerCredentials(config));
  }
  if (!auth_token.empty()) {
    creds->SetAuthMetadataProcessor(std::make_shared<TokenAuthProcessor>(auth_token));
  }
  return creds;
}

static StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsServerCredentials(
    const common::GrpoConfig& config) {
  if (config.tls_cert_file.empty() || config.tls_key_file.empty()) {
    return Status::InvalidArgument("TLS needs tls_cert_file and tls_key_file together");
  }
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile(config.tls_cert_file, "tls_cert_file"));
  ASSIGN_OR_RETURN(pair.private_key, ReadPemFile(config.tls_key_file, "tls_key_file"));
  grpc::SslServerCredentialsOptions opts;
  opts.pem_key_cert_pairs.push_back(std::move(pair));
  return grpc::SslServerCredentials(opts);
}

void ApplyServerLimits(grpc::ServerBuilder& builder, const common::GrpoConfig& config,
                       const std::string& name) {
  grpc::ResourceQuota quota(name);
  quota.Resize(static_cast<size_t>(config.grpc_memory_quota_mb) << 20);
  quota.SetMaxThreads(static_cast<int>(config.grpc_max_threads));
  builder.SetResourceQuota(quota);  // the builder takes its own reference
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // gRPC binds with SO_REUSEPORT by default on Linux: a second server on a port already held
  // would start, and the kernel would split the connections between the two. A learner started
  // twice on one port (or restarted while another process took its port) then serves half the
  // workers and clients each, silently. Off, the second server fails to listen, by name.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

bool IsLoopbackAddress(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const std::string& root_certs_pem) {
  if (root_certs_pem.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions opts;
  opts.pem_root_certs = root_certs_pem;
  return grpc::SslCredentials(opts);
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const std::string& root_certs_pem) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return grpc::CreateCustomChannel(address, ChannelCredentials(root_certs_pem), args);
}

}  // namespace grpo::services
