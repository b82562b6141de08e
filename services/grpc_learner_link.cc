#include "services/grpc_learner_link.h"

#include <optional>

#include "common/mutex.h"
#include "services/auth.h"
#include "services/convert.h"

namespace grpo::services {
namespace {

// How often a long poll in flight looks at the stop flag, and how long after the stop it still
// waits for the reply before it cancels: a reply already on its way (the learner leased while
// the stop came) is taken, and its round runs as a stop during a round does.
constexpr std::chrono::milliseconds kStopPoll{20};
constexpr std::chrono::milliseconds kStopGrace{500};

void Prepare(grpc::ClientContext& context, std::chrono::milliseconds timeout,
             const std::string& auth_token) {
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  AddAuth(context, auth_token);
}

}  // namespace

GrpcLearnerLink::GrpcLearnerLink(std::shared_ptr<grpc::Channel> channel, std::string auth_token,
                                 const std::atomic<bool>* stop)
    : auth_token_(std::move(auth_token)),
      stub_(v1::LearnerService::NewStub(channel)),
      stop_(stop) {}

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
  if (!long_poll || stop_ == nullptr) {
    RETURN_IF_ERROR(
        FromGrpcStatus(stub_->LeasePrompts(&context, req, &r)).WithContext("LeasePrompts"));
    return FromProto(r);
  }
  // A long poll: the call runs on gRPC's callback thread while this one watches the stop flag.
  common::Mutex mu;
  common::CondVar cv;
  bool done = false;
  grpc::Status status;
  stub_->async()->LeasePrompts(&context, &req, &r, [&](grpc::Status s) {
    common::MutexLock lock(&mu);
    status = std::move(s);
    done = true;
    cv.NotifyAll();
  });
  {
    common::MutexLock lock(&mu);
    std::optional<std::chrono::steady_clock::time_point> cancel_at;
    bool cancelled = false;
    while (!done) {
      if (!cancel_at && stop_->load()) cancel_at = std::chrono::steady_clock::now() + kStopGrace;
      if (!cancelled && cancel_at && std::chrono::steady_clock::now() >= *cancel_at) {
        context.TryCancel();  // the callback still runs (CANCELLED): wait for it
        cancelled = true;
      }
      cv.WaitFor(&mu, kStopPoll);
    }
  }
  RETURN_IF_ERROR(FromGrpcStatus(status).WithContext("LeasePrompts"));
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
