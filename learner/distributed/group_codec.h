// The bytes by which rank 0 hands a generation batch to the other learner ranks (over the rank
// group's command channel, not over gRPC: learner/ builds without protobuf). Little-endian,
// length-prefixed; every field of common::RolloutGroup the trainer reads, the text too.
#pragma once

#include <string>
#include <vector>

#include "common/rollout_types.h"
#include "common/status.h"

namespace grpo::learner::distributed {

std::string EncodeGroups(const std::vector<common::RolloutGroup>& groups);
// DataLoss naming the field where the bytes end early or hold an impossible length.
StatusOr<std::vector<common::RolloutGroup>> DecodeGroups(const std::string& bytes);

}  // namespace grpo::learner::distributed
