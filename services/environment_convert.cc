#include "services/environment_convert.h"

#include <string>

namespace grpo::services {
namespace {

bool IsObservationRole(const std::string& role) { return role == "tool" || role == "user"; }

}  // namespace

Status ToProto(const rollout::EnvObservation& obs, v1::EnvObservation* out) {
  out->Clear();
  if (!obs.metadata.is_null() && !obs.metadata.is_object()) {
    return Status::InvalidArgument("observation metadata must be a JSON object or null, got " +
                                   std::string(obs.metadata.type_name()));
  }
  for (const auto& m : obs.messages) {
    if (!IsObservationRole(m.role)) {
      return Status::InvalidArgument("observation message role '" + m.role +
                                     "' (expected tool or user)");
    }
    v1::EnvMessage* pm = out->add_messages();
    pm->set_role(m.role);
    pm->set_content(m.content);
  }
  if (obs.reward) out->set_reward(*obs.reward);
  out->set_done(obs.done);
  out->set_truncated(obs.truncated);
  // Replacement characters rather than an exception for invalid UTF-8 in a string.
  if (obs.metadata.is_object()) {
    out->set_metadata_json(
        obs.metadata.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  for (const nlohmann::json& tool : obs.tools) {
    if (!tool.is_object()) {
      return Status::InvalidArgument("a declared tool must be a JSON object, got " +
                                     std::string(tool.type_name()));
    }
    out->add_tools_json(tool.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  return Status::OK();
}

StatusOr<rollout::EnvObservation> FromProto(const v1::EnvObservation& obs) {
  rollout::EnvObservation out;
  out.messages.reserve(obs.messages_size());
  for (const auto& m : obs.messages()) {
    if (!IsObservationRole(m.role())) {
      return Status::InvalidArgument("observation message role '" + m.role() +
                                     "' (expected tool or user)");
    }
    out.messages.push_back({m.role(), m.content()});
  }
  if (obs.has_reward()) out.reward = obs.reward();
  out.done = obs.done();
  out.truncated = obs.truncated();
  if (!obs.metadata_json().empty()) {
    out.metadata = nlohmann::json::parse(obs.metadata_json(), nullptr, /*allow_exceptions=*/false);
    if (out.metadata.is_discarded() || !out.metadata.is_object()) {
      return Status::InvalidArgument("observation metadata_json is not a JSON object");
    }
  }
  for (const std::string& tool : obs.tools_json()) {
    nlohmann::json t = nlohmann::json::parse(tool, nullptr, /*allow_exceptions=*/false);
    if (t.is_discarded() || !t.is_object()) {
      return Status::InvalidArgument("observation tools_json entry is not a JSON object");
    }
    out.tools.push_back(std::move(t));
  }
  return out;
}

void ToolCallsToProto(const std::vector<common::ToolCall>& calls, v1::EnvStep* out) {
  for (const common::ToolCall& call : calls) {
    v1::EnvToolCall* pc = out->add_tool_calls();
    pc->set_name(call.name);
    pc->set_arguments_json(
        call.arguments.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
}

StatusOr<std::vector<common::ToolCall>> ToolCallsFromProto(const v1::EnvStep& step) {
  std::vector<common::ToolCall> calls;
  for (const v1::EnvToolCall& pc : step.tool_calls()) {
    common::ToolCall call;
    call.name = pc.name();
    call.arguments = pc.arguments_json().empty()
                         ? nlohmann::json::object()
                         : nlohmann::json::parse(pc.arguments_json(), nullptr, false);
    if (call.name.empty() || call.arguments.is_discarded() || !call.arguments.is_object()) {
      return Status::InvalidArgument("a tool call needs a name and arguments_json object");
    }
    calls.push_back(std::move(call));
  }
  return calls;
}

}  // namespace grpo::services
