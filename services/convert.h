// The one place where wire messages (grpo.v1) and domain structs (common/rollout_types.h,
// common/status.h) meet.
#pragma once

#include <grpcpp/support/status.h>

#include "common/rollout_types.h"
#include "common/status.h"
#include "grpo/v1/learner.pb.h"

namespace grpo::services {

void ToProto(const common::RolloutGroup& group, v1::RolloutGroup* out);
// Structural conversion only (the learner validates content): never fails.
common::RolloutGroup FromProto(const v1::RolloutGroup& group);

// grpo::StatusCode values equal grpc::StatusCode's.
grpc::Status ToGrpcStatus(const Status& status);
Status FromGrpcStatus(const grpc::Status& status);

}  // namespace grpo::services
