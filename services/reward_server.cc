#include "services/reward_server.h"

#include <exception>
#include <mutex>

#include "services/auth.h"

namespace grpo::services {

RewardServiceImpl::RewardServiceImpl(
    std::map<std::string, std::shared_ptr<const rollout::RewardFunction>> functions,
    std::string auth_token)
    : functions_(std::move(functions)), auth_token_(std::move(auth_token)) {}

grpc::Status RewardServiceImpl::Score(grpc::ServerContext* context, const v1::ScoreRequest* request,
                                      v1::ScoreResponse* response) {
  if (grpc::Status auth = CheckAuth(*context, auth_token_); !auth.ok()) return auth;
  const rollout::RewardFunction* fn = nullptr;
  if (request->reward_fn().empty() && functions_.size() == 1) {
    fn = functions_.begin()->second.get();
  } else if (auto it = functions_.find(request->reward_fn()); it != functions_.end()) {
    fn = it->second.get();
  }
  if (fn == nullptr) {
    std::string known;
    for (const auto& [name, f] : functions_) known += (known.empty() ? "" : ", ") + name;
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "unknown reward_fn '" + request->reward_fn() + "' (served: " + known + ")");
  }
  std::vector<rollout::RewardInput> inputs;
  inputs.reserve(request->samples_size());
  for (int i = 0; i < request->samples_size(); ++i) {
    const v1::RewardSample& s = request->samples(i);
    rollout::RewardInput in;
    in.prompt = s.prompt();
    in.completion = s.completion();
    in.completion_tokens = s.completion_tokens();
    if (!s.row_json().empty()) {
      in.row = nlohmann::json::parse(s.row_json(), nullptr, /*allow_exceptions=*/false);
      if (in.row.is_discarded()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "sample " + std::to_string(i) + ": row_json is not JSON");
      }
    }
    inputs.push_back(std::move(in));
  }
  std::vector<std::optional<double>> scores;
  try {
    scores = fn->Score(inputs);
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL, fn->name() + " threw: " + e.what());
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, fn->name() + " threw");
  }
  if (scores.size() != inputs.size()) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        fn->name() + " returned " + std::to_string(scores.size()) + " scores for " +
                            std::to_string(inputs.size()) + " samples");
  }
  for (const auto& s : scores) {
    v1::RewardValue* v = response->add_scores();
    if (s) v->set_value(*s);
  }
  return grpc::Status::OK;
}

StatusOr<std::unique_ptr<RewardServer>> RewardServer::Start(
    const std::string& address,
    std::map<std::string, std::shared_ptr<const rollout::RewardFunction>> functions,
    std::string auth_token) {
  if (functions.empty()) return Status::InvalidArgument("reward server needs a reward function");
  for (const auto& [name, fn] : functions) {
    if (fn == nullptr) return Status::InvalidArgument("reward function '" + name + "' is null");
  }
  // Defaults of the gRPC limits (grpc_memory_quota_mb, grpc_max_threads); plaintext.
  const common::GrpoConfig defaults;
  ASSIGN_OR_RETURN(auto credentials, ServerCredentials(defaults, auth_token));
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<RewardServer> server(new RewardServer());
  server->service_ =
      std::make_unique<RewardServiceImpl>(std::move(functions), std::move(auth_token));
  grpc::ServerBuilder builder;
  ApplyServerLimits(builder, defaults, "grpo-reward-server");
  builder.AddListeningPort(address, credentials, &server->port_);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return Status::Unavailable("reward server cannot listen on " + address);
  }
  return server;
}

RewardServer::~RewardServer() { Shutdown(); }

void RewardServer::Shutdown(std::chrono::milliseconds grace) {
  std::call_once(shutdown_once_, [&] {
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + grace);
      server_->Wait();
    }
  });
}

}  // namespace grpo::services
