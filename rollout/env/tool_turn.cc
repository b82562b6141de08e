#include "rollout/env/tool_turn.h"

#include <utility>

namespace grpo::rollout {

void ToolCallCounts::Add(const ToolCallCounts& other) {
  calls += other.calls;
  for (const auto& [reason, n] : other.failures) failures[reason] += n;
}

StatusOr<EnvObservation> StepToolTurn(EnvSession& session, const std::string& turn,
                                      std::chrono::steady_clock::time_point deadline,
                                      ToolCallCounts* counts) {
  const common::ParsedToolCalls parsed = common::ParseToolCalls(turn);
  counts->calls += static_cast<int64_t>(parsed.calls.size() + parsed.malformed.size());
  if (parsed.malformed.empty()) return session.StepToolCalls(turn, parsed.calls, deadline);
  std::string text;
  for (const common::MalformedToolCall& m : parsed.malformed) {
    const std::string reason(common::MalformedToolCallReasonName(m.reason));
    counts->failures[reason] += 1;
    if (!text.empty()) text += "\n";
    text += "error: malformed tool call (" + reason + ")";
    if (!m.detail.empty()) text += ": " + m.detail;
  }
  EnvObservation obs;
  obs.messages = {{"tool", std::move(text)}};
  return obs;
}

}  // namespace grpo::rollout
