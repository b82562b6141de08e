#include "rollout/fake_learner_link.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

namespace grpo::rollout {
namespace {

Status NotReady() { return Status::Unavailable("fake learner not ready"); }

}  // namespace

StatusOr<Registration> FakeLearnerLink::Register(const RegisterRequest& request,
                                                 std::chrono::milliseconds) {
  common::MutexLock lock(&mu);
  if (Unavailable()) return NotReady();
  if (model == nullptr) return Status::FailedPrecondition("fake learner has no model");
  registers.push_back(request);
  Registration r;
  r.worker_id = request.worker_id.empty() ? "worker-1" : request.worker_id;
  r.rank = 1;
  r.world_size = 2;
  r.group_epoch = 1;
  r.policy_version = version;
  r.config_json = config_json;
  r.heartbeat_interval_ms = heartbeat_interval_ms;
  r.model_config_json = model->config().ToJson().dump();
  r.learner_incarnation = incarnation;
  unknown_worker = false;
  return r;
}

StatusOr<HeartbeatReply> FakeLearnerLink::Heartbeat(const HeartbeatRequest& request,
                                                    std::chrono::milliseconds) {
  common::MutexLock lock(&mu);
  if (Unavailable()) return NotReady();
  if (unknown_worker) return Status::NotFound("unknown worker: Register again");
  heartbeats.push_back(request);
  return HeartbeatReply{version, 1, shutdown, incarnation};
}

StatusOr<LeaseReply> FakeLearnerLink::LeasePrompts(const std::string&, int32_t max_prompts,
                                                   int64_t weight_version, bool long_poll,
                                                   std::chrono::milliseconds) {
  common::MutexLock lock(&mu);
  if (Unavailable()) return NotReady();
  ++lease_calls;
  lease_asks.push_back({weight_version, long_poll});
  if (unknown_worker) return Status::NotFound("unknown worker: Register again");
  LeaseReply r;
  r.policy_version = version;
  r.learner_incarnation = incarnation;
  const int n = std::min(max_prompts, leases_per_call);
  const int64_t deadline =
      std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch() + std::chrono::seconds(60))
          .count();
  if (empty_leases_next > 0) {
    --empty_leases_next;
    r.retry_after_ms = retry_after_ms;
    return r;
  }
  for (int i = 0; i < n && next_row < rows.size(); ++i, ++next_row) {
    const std::string k = std::to_string(next_row);
    r.leases.push_back({"lease-" + k, "prompt-" + k, rows[next_row], deadline});
  }
  if (r.leases.empty()) {
    if (job_done_when_empty) {
      r.job_done = true;
    } else {
      r.retry_after_ms = retry_after_ms;
    }
  } else if (after_lease) {
    after_lease(*this);
  }
  return r;
}

StatusOr<PushReply> FakeLearnerLink::PushGroups(const std::string& worker_id,
                                                const std::vector<common::RolloutGroup>& groups,
                                                std::chrono::milliseconds) {
  common::MutexLock lock(&mu);
  if (Unavailable()) return NotReady();
  ++push_calls;
  PushReply reply;
  reply.accepted = static_cast<int64_t>(groups.size());
  if (on_push) {
    StatusOr<PushReply> answer = on_push(groups);
    if (!answer.ok()) return answer.status();
    reply = std::move(answer).value();
  }
  for (const auto& g : groups) {
    pushed.push_back(g);
    pushed_worker_ids.push_back(worker_id);
  }
  if (after_push) after_push(*this);
  return reply;
}

StatusOr<ReceivedVersion> FakeWeightReceiver::Receive(int64_t min_version, common::Model& model,
                                                      std::chrono::milliseconds) {
  common::MutexLock lock(&learner_->mu);
  if (learner_->model == nullptr) return Status::Unavailable("fake learner has no model");
  if (learner_->version < min_version) {
    return Status::Unavailable("fake learner is at version " + std::to_string(learner_->version));
  }
  const common::NamedTensors from = learner_->model->NamedParameters();
  common::NamedTensors to = model.NamedParameters();
  if (from.size() != to.size()) return Status::InvalidArgument("parameter count differs");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i].first != to[i].first || !from[i].second.sizes().equals(to[i].second.sizes())) {
      return Status::InvalidArgument("parameter " + from[i].first + " does not fit");
    }
    to[i].second.copy_(from[i].second);
  }
  learner_->weights_served.push_back(learner_->version);
  return ReceivedVersion{learner_->version, learner_->incarnation};
}

}  // namespace grpo::rollout
