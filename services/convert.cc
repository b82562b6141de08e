#include "services/convert.h"

#include <iterator>
#include <string>

namespace grpo::services {

void ToProto(const common::RolloutGroup& group, v1::RolloutGroup* out) {
  out->set_prompt_id(group.prompt_id);
  out->set_lease_id(group.lease_id);
  out->set_policy_version(group.policy_version);
  out->set_policy_incarnation(group.policy_incarnation);
  out->set_failure(group.failure);
  out->set_prompt_failed(group.prompt_failed);
  out->mutable_prompt_ids()->Assign(group.prompt_ids.begin(), group.prompt_ids.end());
  for (const auto& c : group.completions) {
    v1::Completion* pc = out->add_completions();
    pc->mutable_token_ids()->Assign(c.token_ids.begin(), c.token_ids.end());
    pc->mutable_logprobs()->Assign(c.logprobs.begin(), c.logprobs.end());
    pc->set_truncated(c.truncated);
    pc->set_env_mask(std::string(c.env_mask.begin(), c.env_mask.end()));
    pc->set_uses_tools(c.uses_tools);
    pc->set_tool_calls(c.tool_calls);
    pc->set_tool_call_failures(c.tool_call_failures);
    pc->mutable_token_versions()->Assign(c.token_versions.begin(), c.token_versions.end());
    pc->set_text(c.text);
    for (const auto& r : c.rewards) {
      v1::RewardValue* v = pc->add_rewards();
      if (r) v->set_value(*r);
    }
  }
}

common::RolloutGroup FromProto(const v1::RolloutGroup& group) {
  common::RolloutGroup g;
  g.prompt_id = group.prompt_id();
  g.lease_id = group.lease_id();
  g.policy_version = group.policy_version();
  g.policy_incarnation = group.policy_incarnation();
  g.failure = group.failure();
  g.prompt_failed = group.prompt_failed();
  g.prompt_ids.assign(group.prompt_ids().begin(), group.prompt_ids().end());
  for (const auto& pc : group.completions()) {
    common::Completion c;
    c.token_ids.assign(pc.token_ids().begin(), pc.token_ids().end());
    c.logprobs.assign(pc.logprobs().begin(), pc.logprobs().end());
    c.truncated = pc.truncated();
    c.env_mask.assign(pc.env_mask().begin(), pc.env_mask().end());
    c.uses_tools = pc.uses_tools();
    c.tool_calls = pc.tool_calls();
    c.tool_call_failures = pc.tool_call_failures();
    c.token_versions.assign(pc.token_versions().begin(), pc.token_versions().end());
    c.text = pc.text();
    for (const auto& v : pc.rewards()) {
      c.rewards.push_back(v.has_value() ? std::optional<double>(v.value()) : std::nullopt);
    }
    g.completions.push_back(std::move(c));
  }
  return g;
}

namespace {

// Every gRPC code beside ours, at the index of its number (grpc/impl/codegen/status_code_enum.h).
struct CodePair {
  grpc::StatusCode grpc;
  StatusCode ours;
};
constexpr CodePair kCodes[] = {
    {grpc::StatusCode::OK, StatusCode::kOk},
    {grpc::StatusCode::CANCELLED, StatusCode::kCancelled},
    {grpc::StatusCode::UNKNOWN, StatusCode::kUnknown},
    {grpc::StatusCode::INVALID_ARGUMENT, StatusCode::kInvalidArgument},
    {grpc::StatusCode::DEADLINE_EXCEEDED, StatusCode::kDeadlineExceeded},
    {grpc::StatusCode::NOT_FOUND, StatusCode::kNotFound},
    {grpc::StatusCode::ALREADY_EXISTS, StatusCode::kAlreadyExists},
    {grpc::StatusCode::PERMISSION_DENIED, StatusCode::kPermissionDenied},
    {grpc::StatusCode::RESOURCE_EXHAUSTED, StatusCode::kResourceExhausted},
    {grpc::StatusCode::FAILED_PRECONDITION, StatusCode::kFailedPrecondition},
    {grpc::StatusCode::ABORTED, StatusCode::kAborted},
    {grpc::StatusCode::OUT_OF_RANGE, StatusCode::kOutOfRange},
    {grpc::StatusCode::UNIMPLEMENTED, StatusCode::kUnimplemented},
    {grpc::StatusCode::INTERNAL, StatusCode::kInternal},
    {grpc::StatusCode::UNAVAILABLE, StatusCode::kUnavailable},
    {grpc::StatusCode::DATA_LOSS, StatusCode::kDataLoss},
    {grpc::StatusCode::UNAUTHENTICATED, StatusCode::kUnauthenticated},
};
constexpr int kNumCodes = static_cast<int>(std::size(kCodes));

// Row i holds number i on both sides: the table is gRPC's whole list, in order, and our values
// are gRPC's (what common/status.h promises without seeing gRPC).
constexpr bool EveryRowHoldsItsIndex() {
  for (int i = 0; i < kNumCodes; ++i) {
    if (static_cast<int>(kCodes[i].grpc) != i || static_cast<int>(kCodes[i].ours) != i) {
      return false;
    }
  }
  return true;
}
static_assert(EveryRowHoldsItsIndex(), "kCodes must list codes 0..16 in order, ours equal gRPC's");
static_assert(kNumCodes == static_cast<int>(grpc::StatusCode::UNAUTHENTICATED) + 1,
              "gRPC's last code is UNAUTHENTICATED (16)");

}  // namespace

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int n = static_cast<int>(status.code());
  const grpc::StatusCode code = n > 0 && n < kNumCodes ? kCodes[n].grpc : grpc::StatusCode::UNKNOWN;
  return grpc::Status(code, status.message());
}

Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return Status::OK();
  const int n = static_cast<int>(status.error_code());
  if (n > 0 && n < kNumCodes) return Status(kCodes[n].ours, status.error_message());
  // A number this build does not know (a newer peer, a broken proxy) is no code of ours.
  return Status::Unknown(status.error_message() + " (gRPC status code " + std::to_string(n) + ")");
}

}  // namespace grpo::services

namespace grpo::services {

common::RegisterRequest FromProto(const v1::RegisterRequest& r) {
  common::RegisterRequest out;
  out.worker_id = r.worker_id();
  out.hostname = r.hostname();
  out.pid = r.pid();
  out.weight_sync_backend = r.weight_sync_backend();
  out.device = r.device();
  out.gpu_uuid = r.gpu_uuid();
  return out;
}

void ToProto(const common::RegisterRequest& r, v1::RegisterRequest* out) {
  out->set_worker_id(r.worker_id);
  out->set_hostname(r.hostname);
  out->set_pid(r.pid);
  out->set_weight_sync_backend(r.weight_sync_backend);
  out->set_device(r.device);
  out->set_gpu_uuid(r.gpu_uuid);
}

common::Registration FromProto(const v1::RegisterResponse& r) {
  common::Registration out;
  out.worker_id = r.worker_id();
  out.rank = r.rank();
  out.world_size = r.world_size();
  out.group_epoch = r.group_epoch();
  out.policy_version = r.policy_version();
  out.config_json = r.config_json();
  out.heartbeat_interval_ms = r.heartbeat_interval_ms();
  out.model_config_json = r.model_config_json();
  out.learner_incarnation = r.learner_incarnation();
  out.weight_sync_backend = r.weight_sync_backend();
  out.weight_sync_note = r.weight_sync_note();
  return out;
}

void ToProto(const common::Registration& r, v1::RegisterResponse* out) {
  out->set_worker_id(r.worker_id);
  out->set_rank(r.rank);
  out->set_world_size(r.world_size);
  out->set_group_epoch(r.group_epoch);
  out->set_policy_version(r.policy_version);
  out->set_config_json(r.config_json);
  out->set_heartbeat_interval_ms(r.heartbeat_interval_ms);
  out->set_model_config_json(r.model_config_json);
  out->set_learner_incarnation(r.learner_incarnation);
  out->set_weight_sync_backend(r.weight_sync_backend);
  out->set_weight_sync_note(r.weight_sync_note);
}

common::HeartbeatRequest FromProto(const v1::HeartbeatRequest& r) {
  common::HeartbeatRequest out;
  out.worker_id = r.worker_id();
  out.weight_version = r.weight_version();
  out.leases_held = r.leases_held();
  return out;
}

void ToProto(const common::HeartbeatRequest& r, v1::HeartbeatRequest* out) {
  out->set_worker_id(r.worker_id);
  out->set_weight_version(r.weight_version);
  out->set_leases_held(r.leases_held);
}

common::HeartbeatReply FromProto(const v1::HeartbeatResponse& r) {
  common::HeartbeatReply out;
  out.policy_version = r.policy_version();
  out.group_epoch = r.group_epoch();
  out.shutdown = r.shutdown();
  out.learner_incarnation = r.learner_incarnation();
  return out;
}

void ToProto(const common::HeartbeatReply& r, v1::HeartbeatResponse* out) {
  out->set_policy_version(r.policy_version);
  out->set_group_epoch(r.group_epoch);
  out->set_shutdown(r.shutdown);
  out->set_learner_incarnation(r.learner_incarnation);
}

common::LeaseReply FromProto(const v1::LeasePromptsResponse& r) {
  common::LeaseReply out;
  out.leases.reserve(r.leases_size());
  for (const v1::Lease& l : r.leases()) {
    out.leases.push_back({l.lease_id(), l.prompt_id(), l.row_json(), l.deadline_unix_ms()});
  }
  out.policy_version = r.policy_version();
  out.job_done = r.job_done();
  out.retry_after_ms = r.retry_after_ms();
  out.learner_incarnation = r.learner_incarnation();
  return out;
}

void ToProto(const common::LeaseReply& r, v1::LeasePromptsResponse* out) {
  for (const common::PromptLease& l : r.leases) {
    v1::Lease* lease = out->add_leases();
    lease->set_lease_id(l.lease_id);
    lease->set_prompt_id(l.prompt_id);
    lease->set_row_json(l.row_json);
    lease->set_deadline_unix_ms(l.deadline_unix_ms);
  }
  out->set_policy_version(r.policy_version);
  out->set_job_done(r.job_done);
  out->set_retry_after_ms(r.retry_after_ms);
  out->set_learner_incarnation(r.learner_incarnation);
}

common::PushReply FromProto(const v1::PushRolloutsResponse& r) {
  common::PushReply out;
  out.accepted = r.accepted();
  out.rejected = r.rejected();
  out.filtered = r.filtered();
  for (const auto& [reason, n] : r.rejected_by_reason()) out.rejected_by_reason[reason] = n;
  out.messages.assign(r.messages().begin(), r.messages().end());
  return out;
}

void ToProto(const common::PushReply& r, v1::PushRolloutsResponse* out) {
  out->set_accepted(r.accepted);
  out->set_rejected(r.rejected);
  out->set_filtered(r.filtered);
  for (const auto& [reason, n] : r.rejected_by_reason) {
    (*out->mutable_rejected_by_reason())[reason] = n;
  }
  for (const auto& m : r.messages) out->add_messages(m);
}

v1::JobState ToProto(learner::JobState state) {
  switch (state) {
    case learner::JobState::kWaitingForData:
      return v1::JOB_STATE_WAITING_FOR_DATA;
    case learner::JobState::kRunning:
      return v1::JOB_STATE_RUNNING;
    case learner::JobState::kDone:
      return v1::JOB_STATE_DONE;
    case learner::JobState::kCancelled:
      return v1::JOB_STATE_CANCELLED;
    case learner::JobState::kFailed:
      return v1::JOB_STATE_FAILED;
  }
  return v1::JOB_STATE_UNSPECIFIED;
}

std::optional<learner::JobState> FromProto(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_WAITING_FOR_DATA:
      return learner::JobState::kWaitingForData;
    case v1::JOB_STATE_RUNNING:
      return learner::JobState::kRunning;
    case v1::JOB_STATE_DONE:
      return learner::JobState::kDone;
    case v1::JOB_STATE_CANCELLED:
      return learner::JobState::kCancelled;
    case v1::JOB_STATE_FAILED:
      return learner::JobState::kFailed;
    default:
      return std::nullopt;
  }
}

std::string_view JobStateName(v1::JobState state) {
  const std::optional<learner::JobState> s = FromProto(state);
  return s ? learner::JobStateName(*s) : "unspecified";
}

void ToProto(const learner::JobSnapshot& job, v1::Job* out) {
  v1::LedgerCounts* c = out->mutable_prompts();
  c->set_queued(job.queued);
  c->set_leased(job.leased);
  c->set_trained(job.trained);
  c->set_rejected(job.rejected);
  c->set_filtered(job.filtered);
  c->set_pass(job.pass);
  out->set_state(ToProto(job.state));
  out->set_global_step(job.global_step);
  out->set_max_steps(job.max_steps);
  out->set_policy_version(job.policy_version);
  out->set_workers(job.workers);
  for (const auto& [k, v] : job.last_metrics) (*out->mutable_last_metrics())[k] = v;
  out->set_message(job.message);
}

void ToProto(const learner::JobEvent& event, v1::JobEvent* out) {
  ToProto(event.job, out->mutable_job());
  out->set_step(event.step);
  for (const auto& [k, v] : event.metrics) (*out->mutable_metrics())[k] = v;
}

}  // namespace grpo::services
