// A model turn of an episode whose environment declared tools (EnvObservation::tools at reset):
// the turn's <tool_call> blocks parsed (common/tokenizer/tool_calls.h), a malformed one answered
// by the worker, the well-formed ones handed to the environment as structured calls.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "common/status.h"
#include "rollout/env/environment.h"

namespace grpo::rollout {

// Tool calls of the turns of one or more episodes.
struct ToolCallCounts {
  int64_t calls = 0;  // blocks parsed, well-formed or not
  // Malformed blocks by MalformedToolCallReasonName (not_json, no_name, arguments_not_object,
  // unclosed_tag).
  std::map<std::string, int64_t> failures;
  void Add(const ToolCallCounts& other);
};

// Every block of `turn` counts as a call. When one or more are malformed, the environment is not
// stepped: the answer is one `tool` message naming each malformed block's reason and detail (the
// model sees its mistake and the episode goes on), and each counts as a failure. Otherwise the
// answer is session.StepToolCalls(turn, calls, deadline) (no calls: a final answer). These counts
// are higher than TRL's tools/ metrics, which count a turn with a malformed block as plain text
// (common/tokenizer/tool_calls.h).
StatusOr<EnvObservation> StepToolTurn(EnvSession& session, const std::string& turn,
                                      std::chrono::steady_clock::time_point deadline,
                                      ToolCallCounts* counts);

}  // namespace grpo::rollout
