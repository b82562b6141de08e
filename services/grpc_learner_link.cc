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
  ToProto(request, &req);
  v1::RegisterResponse r;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Register(&context, req, &r)).WithContext("Register"));
  return FromProto(r);
}

StatusOr<rollout::HeartbeatReply> GrpcLearnerLink::Heartbeat(
    const rollout::HeartbeatRequest& request, std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout, auth_token_);
  v1::HeartbeatRequest req;
  ToProto(request, &req);
  v1::HeartbeatResponse r;
  RETURN_IF_ERROR(FromGrpcStatus(stub_->Heartbeat(&context, req, &r)).WithContext("Heartbeat"));
  return FromProto(r);
}

StatusOr<rollout::LeaseReply> GrpcLearnerLink::LeasePrompts(const std::string& worker_id,
                                                            int32_t max_prompts,
                                                            int64_t weight_version, bool long_poll,
                                                            std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  Prepare(context, timeout, auth_token_);
  v1::LeasePromptsRequest req;
  req.set_worker_id(worker_id);
  req.set_max_prompts(max_prompts);
  req.set_answer_at_once(!long_poll);
  if (weight_version >= 0) req.set_weight_version(weight_version);
  v1::LeasePromptsResponse r;
  RETURN_IF_ERROR(
      FromGrpcStatus(stub_->LeasePrompts(&context, req, &r)).WithContext("LeasePrompts"));
  return FromProto(r);
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
  return FromProto(r);
}

}  // namespace grpo::services
