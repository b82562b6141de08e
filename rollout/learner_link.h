// LearnerLink: what a rollout worker asks of its learner (LearnerService in learner.proto, less
// the weights, which come through a WeightReceiver, and the rendezvous store), over the plain
// structs of common/learner_protocol.h. Implementations: services::GrpcLearnerLink (the gRPC
// client) and FakeLearnerLink (rollout/fake_learner_link.h, in memory, for tests of RolloutLoop).
// Header only and free of gRPC and protobuf.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/learner_protocol.h"
#include "common/rollout_types.h"
#include "common/status.h"

namespace grpo::rollout {

using common::HeartbeatReply;
using common::HeartbeatRequest;
using common::LeaseReply;
using common::PromptLease;
using common::PushReply;
using common::RegisterRequest;
using common::Registration;

// Thread-safe: the worker calls Heartbeat from its heartbeat thread while its main thread calls
// the others. Every call gets its deadline; errors are Status codes as the learner gave them
// (Unavailable, DeadlineExceeded ... are worth retrying; NotFound from Heartbeat or LeasePrompts
// means the learner does not know this worker).
class LearnerLink {
 public:
  virtual ~LearnerLink() = default;

  virtual StatusOr<Registration> Register(const RegisterRequest& request,
                                          std::chrono::milliseconds timeout) = 0;
  virtual StatusOr<HeartbeatReply> Heartbeat(const HeartbeatRequest& request,
                                             std::chrono::milliseconds timeout) = 0;
  // `weight_version`: the policy version the worker starts these leases' groups with (-1: it
  // takes the published one first). `long_poll`: while there is no lease budget, or no prompt
  // queued, the learner may wait for one (up to 3 s) before it answers; false when rows decode
  // and wait for the answer (it comes at once).
  virtual StatusOr<LeaseReply> LeasePrompts(const std::string& worker_id, int32_t max_prompts,
                                            int64_t weight_version, bool long_poll,
                                            std::chrono::milliseconds timeout) = 0;
  // Pushes every group of one round in one go (each stamped with `worker_id`). OK means the
  // learner answered; how many it accepted is in the reply.
  virtual StatusOr<PushReply> PushGroups(const std::string& worker_id,
                                         const std::vector<common::RolloutGroup>& groups,
                                         std::chrono::milliseconds timeout) = 0;
};

}  // namespace grpo::rollout
