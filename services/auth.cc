#include "services/auth.h"

#include <fstream>
#include <sstream>

namespace grpo::services {

StatusOr<std::string> ReadAuthToken(const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read auth_token_file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string token = ss.str();
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) {
    token.pop_back();
  }
  if (token.empty()) return Status::InvalidArgument("auth_token_file " + path + " is empty");
  return token;
}

grpc::Status CheckAuth(const grpc::ServerContext& context, const std::string& token) {
  if (token.empty()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing authorization metadata");
  }
  const std::string got(it->second.data(), it->second.size());
  const std::string want = "Bearer " + token;
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) diff |= got[i] ^ want[i];
  if (diff != 0) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad token");
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

StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const common::GrpoConfig& config) {
  if (config.tls_cert_file.empty() && config.tls_key_file.empty()) {
    return grpc::InsecureServerCredentials();
  }
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
