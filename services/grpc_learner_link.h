// GrpcLearnerLink: rollout::LearnerLink over gRPC, the client side of LearnerService
// (learner.proto): Register, Heartbeat, LeasePrompts and the PushRollouts stream, with the
// worker's token on every call and learner.proto <-> plain struct conversion.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "grpo/v1/learner.grpc.pb.h"
#include "rollout/learner_link.h"

namespace grpo::services {

// Thread-safe (the stub is). Errors: the RPC's status (FromGrpcStatus) with the RPC's name.
class GrpcLearnerLink final : public rollout::LearnerLink {
 public:
  // No RPC here. `auth_token` empty = no auth metadata. `stop` (borrowed, may be null): a
  // LeasePrompts long poll in flight is cancelled half a second after it turns true (a reply
  // already on its way is taken), so a stopped worker does not wait out the learner's long poll
  // (up to 3 s).
  GrpcLearnerLink(std::shared_ptr<grpc::Channel> channel, std::string auth_token,
                  const std::atomic<bool>* stop = nullptr);

  StatusOr<rollout::Registration> Register(const rollout::RegisterRequest& request,
                                           std::chrono::milliseconds timeout) override;
  StatusOr<rollout::HeartbeatReply> Heartbeat(const rollout::HeartbeatRequest& request,
                                              std::chrono::milliseconds timeout) override;
  StatusOr<rollout::LeaseReply> LeasePrompts(const std::string& worker_id, int32_t max_prompts,
                                             int64_t weight_version, bool long_poll,
                                             std::chrono::milliseconds timeout) override;
  // One PushRollouts stream of every group, each with worker_id set.
  StatusOr<rollout::PushReply> PushGroups(const std::string& worker_id,
                                          const std::vector<common::RolloutGroup>& groups,
                                          std::chrono::milliseconds timeout) override;

 private:
  const std::string auth_token_;
  const std::unique_ptr<v1::LearnerService::Stub> stub_;
  const std::atomic<bool>* const stop_;
};

}  // namespace grpo::services
