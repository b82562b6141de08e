// The one place where wire messages (grpo.v1) and domain structs (common/rollout_types.h,
// common/status.h) meet.
#pragma once

#include <grpcpp/support/status.h>

#include <optional>
#include <string_view>

#include "common/learner_protocol.h"
#include "common/rollout_types.h"
#include "common/status.h"
#include "grpo/v1/learner.pb.h"
#include "learner/job.h"

namespace grpo::services {

void ToProto(const common::RolloutGroup& group, v1::RolloutGroup* out);
// Structural conversion only (the learner validates content): never fails.
common::RolloutGroup FromProto(const v1::RolloutGroup& group);

// Code for code (grpo::StatusCode numbers are gRPC's, checked at compile time in convert.cc);
// the message is kept. A gRPC number outside 0..16 reads as kUnknown, its number appended to the
// message; a grpo::StatusCode outside the enum is sent as UNKNOWN.
grpc::Status ToGrpcStatus(const Status& status);
Status FromGrpcStatus(const grpc::Status& status);

// The worker-facing protocol (common/learner_protocol.h), both directions: the learner's shell
// reads requests and writes replies, the worker's GrpcLearnerLink the reverse.
common::RegisterRequest FromProto(const v1::RegisterRequest& request);
void ToProto(const common::RegisterRequest& request, v1::RegisterRequest* out);
common::Registration FromProto(const v1::RegisterResponse& response);
void ToProto(const common::Registration& registration, v1::RegisterResponse* out);
common::HeartbeatRequest FromProto(const v1::HeartbeatRequest& request);
void ToProto(const common::HeartbeatRequest& request, v1::HeartbeatRequest* out);
common::HeartbeatReply FromProto(const v1::HeartbeatResponse& response);
void ToProto(const common::HeartbeatReply& reply, v1::HeartbeatResponse* out);
common::LeaseReply FromProto(const v1::LeasePromptsResponse& response);
void ToProto(const common::LeaseReply& reply, v1::LeasePromptsResponse* out);
common::PushReply FromProto(const v1::PushRolloutsResponse& response);
void ToProto(const common::PushReply& reply, v1::PushRolloutsResponse* out);

// The job (learner/job.h). A state the learner did not set (JOB_STATE_UNSPECIFIED, or one this
// build does not know) is nullopt.
v1::JobState ToProto(learner::JobState state);
std::optional<learner::JobState> FromProto(v1::JobState state);
// learner::JobStateName of a wire state; "unspecified" for nullopt.
std::string_view JobStateName(v1::JobState state);
void ToProto(const learner::JobSnapshot& job, v1::Job* out);
void ToProto(const learner::JobEvent& event, v1::JobEvent* out);

}  // namespace grpo::services
