// RewardServer: serves RewardService.Score (reward.proto) with in-process reward functions, for
// deployments that score outside the workers (`grpo reward-server`) and for tests.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/config.h"
#include "common/status.h"
#include "grpo/v1/reward.grpc.pb.h"
#include "rollout/reward.h"

namespace grpo::services {

// Grace period for in-flight calls on Shutdown.
inline constexpr std::chrono::milliseconds kDefaultRewardServerShutdownTimeout{5000};

// Thread-safe: gRPC calls Score from its own threads; the functions are const.
class RewardServiceImpl final : public v1::RewardService::Service {
 public:
  // functions by the name clients send in ScoreRequest.reward_fn. `auth_token` empty = no auth.
  RewardServiceImpl(std::map<std::string, std::shared_ptr<const rollout::RewardFunction>> functions,
                    std::string auth_token);

  // UNAUTHENTICATED without the token; NOT_FOUND for an unknown reward_fn (an empty one picks
  // the only function when there is one); INVALID_ARGUMENT for a row_json that is not JSON;
  // INTERNAL when the function throws or returns the wrong number of scores. Never throws.
  grpc::Status Score(grpc::ServerContext* context, const v1::ScoreRequest* request,
                     v1::ScoreResponse* response) override;

 private:
  const std::map<std::string, std::shared_ptr<const rollout::RewardFunction>> functions_;
  const std::string auth_token_;
};

// Owns a running grpc::Server with RewardService and grpc.health.v1. Thread-safe.
class RewardServer {
 public:
  // address: "HOST:PORT"; port 0 picks a free one (see port()). A non-empty `auth_token` (the
  // reward_auth_token_file's, never the learner's) is checked before a call's message is read
  // (TokenAuthProcessor). Unavailable when it cannot bind; InvalidArgument for no functions.
  static StatusOr<std::unique_ptr<RewardServer>> Start(
      const std::string& address,
      std::map<std::string, std::shared_ptr<const rollout::RewardFunction>> functions,
      std::string auth_token = "");
  ~RewardServer();  // Shutdown()

  int port() const { return port_; }
  // Stops accepting calls, waits up to `grace` for running ones, then cancels them. Idempotent.
  void Shutdown(std::chrono::milliseconds grace = kDefaultRewardServerShutdownTimeout);

 private:
  RewardServer() = default;
  std::unique_ptr<RewardServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::once_flag shutdown_once_;
};

}  // namespace grpo::services
