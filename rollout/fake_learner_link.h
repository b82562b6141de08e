// FakeLearnerLink: an in-memory learner for tests of RolloutLoop (no gRPC server): it hands out
// dataset rows under leases, records what the loop sends, and can fail calls, restart (a new
// incarnation) or forget the worker on request. FakeWeightReceiver serves the fake learner's
// model as its weights.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/mutex.h"
#include "common/rollout_types.h"
#include "rollout/learner_link.h"
#include "rollout/weight_receiver.h"

namespace grpo::rollout {

// Thread-safe: every call takes `mu`. Tests set the behaviour before the loop runs or under
// `mu`, and read what was recorded under `mu`.
class FakeLearnerLink final : public LearnerLink {
 public:
  common::Mutex mu;

  // Behaviour.
  // row_json, leased in order as lease-<i> / prompt-<i>.
  std::vector<std::string> rows GRPO_GUARDED_BY(mu);
  // At most this many per LeasePrompts (and max_prompts).
  int leases_per_call GRPO_GUARDED_BY(mu) = 2;
  // Else an empty lease answers retry_after_ms.
  bool job_done_when_empty GRPO_GUARDED_BY(mu) = true;
  int64_t retry_after_ms GRPO_GUARDED_BY(mu) = 20;
  // The next N LeasePrompts lease nothing (retry_after_ms), as a learner without lease budget.
  int empty_leases_next GRPO_GUARDED_BY(mu) = 0;
  int64_t version GRPO_GUARDED_BY(mu) = 1;                // the learner's policy version
  std::string incarnation GRPO_GUARDED_BY(mu) = "inc-1";  // a restart changes it
  std::string config_json GRPO_GUARDED_BY(mu) = "{}";     // Registration::config_json
  // Its config is model_config_json; its parameters are the weights (FakeWeightReceiver).
  std::shared_ptr<const common::Model> model GRPO_GUARDED_BY(mu);
  int64_t heartbeat_interval_ms GRPO_GUARDED_BY(mu) = 20;
  // The first N calls of any kind fail with Unavailable.
  int unavailable_first_n GRPO_GUARDED_BY(mu) = 0;
  // Heartbeat and LeasePrompts are NotFound until the next Register.
  bool unknown_worker GRPO_GUARDED_BY(mu) = false;
  bool shutdown GRPO_GUARDED_BY(mu) = false;  // Heartbeat answers shutdown
  // The push's answer; default: every group accepted. May fail (a Status) or reject some.
  std::function<StatusOr<PushReply>(const std::vector<common::RolloutGroup>&)> on_push
      GRPO_GUARDED_BY(mu);
  // Called under mu, after a lease that leased rows, and after each accepted push.
  std::function<void(FakeLearnerLink&)> after_lease GRPO_GUARDED_BY(mu);
  std::function<void(FakeLearnerLink&)> after_push GRPO_GUARDED_BY(mu);

  // Recorded.
  int calls GRPO_GUARDED_BY(mu) = 0;
  std::vector<RegisterRequest> registers GRPO_GUARDED_BY(mu);
  std::vector<HeartbeatRequest> heartbeats GRPO_GUARDED_BY(mu);
  int lease_calls GRPO_GUARDED_BY(mu) = 0;
  struct LeaseAsk {
    int64_t weight_version;
    bool long_poll;
  };
  std::vector<LeaseAsk> lease_asks GRPO_GUARDED_BY(mu);  // each LeasePrompts'
  int push_calls GRPO_GUARDED_BY(mu) = 0;
  std::vector<common::RolloutGroup> pushed GRPO_GUARDED_BY(mu);  // of pushes that were answered OK
  std::vector<std::string> pushed_worker_ids GRPO_GUARDED_BY(mu);
  // Versions, one per FakeWeightReceiver::Receive.
  std::vector<int64_t> weights_served GRPO_GUARDED_BY(mu);
  size_t next_row GRPO_GUARDED_BY(mu) = 0;

  StatusOr<Registration> Register(const RegisterRequest& request,
                                  std::chrono::milliseconds timeout) override;
  StatusOr<HeartbeatReply> Heartbeat(const HeartbeatRequest& request,
                                     std::chrono::milliseconds timeout) override;
  StatusOr<LeaseReply> LeasePrompts(const std::string& worker_id, int32_t max_prompts,
                                    int64_t weight_version, bool long_poll,
                                    std::chrono::milliseconds timeout) override;
  StatusOr<PushReply> PushGroups(const std::string& worker_id,
                                 const std::vector<common::RolloutGroup>& groups,
                                 std::chrono::milliseconds timeout) override;

 private:
  bool Unavailable() GRPO_REQUIRES(mu) { return calls++ < unavailable_first_n; }
};

// Copies the fake learner's current model (FakeLearnerLink::model, fp32) into the worker's
// model, bit for bit, and returns its version and incarnation. Backend "fake". Not thread-safe, as
// the interface says; the learner's state is read under its mutex.
class FakeWeightReceiver final : public WeightReceiver {
 public:
  explicit FakeWeightReceiver(FakeLearnerLink* learner) : learner_(learner) {}
  StatusOr<ReceivedVersion> Receive(int64_t min_version, common::Model& model,
                                    std::chrono::milliseconds timeout) override;
  std::string backend() const override { return "fake"; }

 private:
  FakeLearnerLink* const learner_;  // borrowed
};

}  // namespace grpo::rollout
