// The prompt text of a dataset row, shared by `grpo train-local` and the rollout workers (the
// learner hands rows out as JSON in Lease::row_json).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"

namespace grpo::services {

// row["prompt"] when it is a string; else row["messages"] (an array of {role, content} strings)
// through the ChatML template with the generation prompt. InvalidArgument otherwise (not an
// object, neither key, a malformed message, an unknown role). An empty "prompt" is returned
// as it is (the Generator rejects the empty prompt).
StatusOr<std::string> PromptText(const nlohmann::json& row);

}  // namespace grpo::services
