#include "services/grpc_learner_link.h"

#include "services/auth.h"
#include "services/convert.h"

namespace grpo::services {
namespace {

void Prepare(grpc::ClientContext& context, std::chrono::milliseconds timeout,
             const std::string& auth_token) {
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  AddAuth(context, auth_token);
}

}  // namespace

GrpcLearnerLink::GrpcLearnerLink(std::shared_ptr<grpc::Channel> channel, std::string auth_token)
    : auth_token_(std::move(auth_token)), stub_(v1::LearnerService::NewStub(channel)) {}

StatusOr<rollout::Registration> GrpcLearnerLink::Register(const rollout::RegisterRequest& request,
                                                          std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout, auth_token_);
  v1::RegisterRequest req;
  req.set_worker_id(request.worker_id);
  req.set_hostname(request.hostname);
  req.set_pid(request.pid);
  req.set_weight_sync_backend(request.weight_sync_backend);
  req.set_device(request.device);
  req.set_gpu_uuid(request.gpu_uuid);
  v1::RegisterResponse r;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Register(&context, req, &r)).WithContext("Register"));
  rollout::Registration out;
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

StatusOr<rollout::HeartbeatReply> GrpcLearnerLink::Heartbeat(
    const rollout::HeartbeatRequest& request, std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout, auth_token_);
  v1::HeartbeatRequest req;
  req.set_worker_id(request.worker_id);
  req.set_weight_version(request.weight_version);
  req.set_leases_held(request.leases_held);
  v1::HeartbeatResponse r;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Heartbeat(&context, req, &r)).WithContext("Heartbeat"));
  rollout::HeartbeatReply out;
  out.policy_version = r.policy_version();
  out.group_epoch = r.group_epoch();
  out.shutdown = r.shutdown();
  out.learner_incarnation = r.learner_incarnation();
  return out;
}

StatusOr<rollout::LeaseReply> GrpcLearnerLink::LeasePrompts(const std::string& worker_id,
                                                            int32_t max_prompts,
                                                            std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout, auth_token_);
  v1::LeasePromptsRequest req;
  req.set_worker_id(worker_id);
  req.set_max_prompts(max_prompts);
  v1::LeasePromptsResponse r;
  RETURN_IF_ERROR(
      FromGrpcStatus(stub_->LeasePrompts(&context, req, &r)).WithContext("LeasePrompts"));
  rollout::LeaseReply out;
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

StatusOr<rollout::PushReply> GrpcLearnerLink::PushGroups(
    const std::string& worker_id, const std::vector<common::RolloutGroup>& groups,
    std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout, auth_token_);
  v1::PushRolloutsResponse r;
  std::unique_ptr<grpc::ClientWriter<v1::RolloutGroup>> writer = stub_->PushRollouts(&context, &r);
  v1::RolloutGroup msg;
  for (const auto& g : groups) {
    msg.Clear();
    ToProto(g, &msg);
    msg.set_worker_id(worker_id);
    if (!writer->Write(msg)) break;  // the stream broke: Finish says why
  }
  writer->WritesDone();
  RETURN_IF_ERROR(FromGrpcStatus(writer->Finish()).WithContext("PushRollouts"));
  rollout::PushReply out;
  out.accepted = r.accepted();
  out.rejected = r.rejected();
  for (const auto& [reason, n] : r.rejected_by_reason()) out.rejected_by_reason[reason] = n;
  out.messages.assign(r.messages().begin(), r.messages().end());
  return out;
}

}  // namespace grpo::services
