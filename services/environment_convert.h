// Environment observations between rollout/env/environment.h and the wire
// (proto/grpo/v1/environment.proto): one definition for GrpcEnvironment and EnvironmentServer.
#pragma once

#include <vector>

#include "common/status.h"
#include "grpo/v1/environment.pb.h"
#include "rollout/env/environment.h"

namespace grpo::services {

// InvalidArgument when the observation cannot travel: metadata neither a JSON object nor null,
// or a message role other than "tool" and "user". `out` is cleared first.
Status ToProto(const rollout::EnvObservation& obs, v1::EnvObservation* out);

// The observation of an answer without `error`. InvalidArgument naming the field for
// metadata_json that is not a JSON object or for a message role other than "tool" and "user".
StatusOr<rollout::EnvObservation> FromProto(const v1::EnvObservation& obs);

// A step's tool calls (EnvStep.tool_calls) both ways; InvalidArgument for an unnamed call or
// arguments that are not a JSON object.
void ToolCallsToProto(const std::vector<common::ToolCall>& calls, v1::EnvStep* out);
StatusOr<std::vector<common::ToolCall>> ToolCallsFromProto(const v1::EnvStep& step);

}  // namespace grpo::services
