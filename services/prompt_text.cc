#include "services/prompt_text.h"

#include <vector>

#include "common/chat_template.h"

namespace grpo::services {

StatusOr<std::string> PromptText(const nlohmann::json& row) {
  if (!row.is_object()) return Status::InvalidArgument("row is not a JSON object");
  if (row.contains("prompt") && row["prompt"].is_string()) {
    return row["prompt"].get<std::string>();
  }
  if (!row.contains("messages") || !row["messages"].is_array()) {
    return Status::InvalidArgument("needs \"prompt\" (string) or \"messages\" (array)");
  }
  std::vector<common::ChatMessage> msgs;
  for (const auto& m : row["messages"]) {
    if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
        !m["content"].is_string()) {
      return Status::InvalidArgument("each message needs string role and content");
    }
    msgs.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return common::ApplyChatTemplate(msgs, /*add_generation_prompt=*/true);
}

}  // namespace grpo::services
