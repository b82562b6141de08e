// FakeLearnerLink: an in-memory learner for tests of RolloutLoop (no gRPC server): it hands out
// dataset rows under leases, records what the loop sends, and can fail calls, restart (a new
// incarnation) or forget the worker on request. FakeWeightReceiver serves the fake learner's
// model as its weights.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/rollout_types.h"
#include "rollout/learner_link.h"
#include "rollout/weight_receiver.h"

namespace grpo::rollout {

// Thread-safe: every call takes `mu`. Tests set the behaviour before the loop runs or under
// `mu`, and read what was recorded under `mu`.
class FakeLearnerLink final : public LearnerLink {
 public:
  std::mutex mu;

  // Behaviour. GUARDED_BY(mu)
  std::vector<std::string> rows;    // row_json, leased in order as lease-<i> / prompt-<i>
  int leases_per_call = 2;          // at most this many per LeasePrompts (and max_prompts)
  bool job_done_when_empty = true;  // else an empty lease answers retry_after_ms
  int64_t retry_after_ms = 20;
  int64_t version = 1;                         // the learner's policy version
  std::string incarnation = "inc-1";           // a restart changes it
  std::string config_json = "{}";              // Registration::config_json
  std::shared_ptr<const common::Model> model;  // its config is model_config_json; its
                                               // parameters are the weights (FakeWeightReceiver)
  int64_t heartbeat_interval_ms = 20;
  int unavailable_first_n = 0;  // the first N calls of any kind fail with Unavailable
  bool unknown_worker = false;  // Heartbeat and LeasePrompts are NotFound until the next Register
  bool shutdown = false;        // Heartbeat answers shutdown
  // The push's answer; default: every group accepted. May fail (a Status) or reject some.
  std::function<StatusOr<PushReply>(const std::vector<common::RolloutGroup>&)> on_push;
  std::function<void(FakeLearnerLink&)> after_lease;  // under mu, after a lease that leased rows
  std::function<void(FakeLearnerLink&)> after_push;   // under mu, after each accepted push

  // Recorded. GUARDED_BY(mu)
  int calls = 0;
  std::vector<RegisterRequest> registers;
  std::vector<HeartbeatRequest> heartbeats;
  int lease_calls = 0;
  int push_calls = 0;
  std::vector<common::RolloutGroup> pushed;  // of pushes that were answered OK
  std::vector<std::string> pushed_worker_ids;
  std::vector<int64_t> weights_served;  // versions, one per FakeWeightReceiver::Receive
  size_t next_row = 0;

  StatusOr<Registration> Register(const RegisterRequest& request,
                                  std::chrono::milliseconds timeout) override;
  StatusOr<HeartbeatReply> Heartbeat(const HeartbeatRequest& request,
                                     std::chrono::milliseconds timeout) override;
  StatusOr<LeaseReply> LeasePrompts(const std::string& worker_id, int32_t max_prompts,
                                    std::chrono::milliseconds timeout) override;
  StatusOr<PushReply> PushGroups(const std::string& worker_id,
                                 const std::vector<common::RolloutGroup>& groups,
                                 std::chrono::milliseconds timeout) override;

 private:
  bool Unavailable() { return calls++ < unavailable_first_n; }  // under mu
};

// Copies the fake learner's current model (FakeLearnerLink::model, fp32) into the worker's
// model, bit for bit, and returns its version. Backend "fake". Not thread-safe, as the
// interface says; the learner's state is read under its mutex.
class FakeWeightReceiver final : public WeightReceiver {
 public:
  explicit FakeWeightReceiver(FakeLearnerLink* learner) : learner_(learner) {}
  StatusOr<int64_t> Receive(int64_t min_version, common::Model& model,
                            std::chrono::milliseconds timeout) override;
  std::string backend() const override { return "fake"; }

 private:
  FakeLearnerLink* const learner_;  // borrowed
};

}  // namespace grpo::rollout
