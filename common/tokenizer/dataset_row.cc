#include "common/tokenizer/dataset_row.h"

#include <vector>

#include "common/tokenizer/chat_template.h"

namespace grpo::common {

StatusOr<std::string> PromptText(const nlohmann::json& row) {
  if (!row.is_object()) return Status::InvalidArgument("row is not a JSON object");
  const auto prompt = row.find("prompt");
  const auto messages = row.find("messages");
  if (prompt == row.end() && messages == row.end()) {
    return Status::InvalidArgument("needs a \"prompt\" or \"messages\" field");
  }
  if (prompt != row.end() &&
      (!prompt->is_string() || prompt->get_ref<const std::string&>().empty())) {
    return Status::InvalidArgument("\"prompt\" must be a non-empty string");
  }
  std::vector<ChatMessage> chat;
  if (messages != row.end()) {
    if (!messages->is_array() || messages->empty()) {
      return Status::InvalidArgument("\"messages\" must be a non-empty array");
    }
    for (size_t i = 0; i < messages->size(); ++i) {
      const nlohmann::json& m = (*messages)[i];
      const std::string where = "messages[" + std::to_string(i) + "]";
      if (!m.is_object()) return Status::InvalidArgument(where + " must be an object");
      const auto role = m.find("role");
      const auto content = m.find("content");
      if (role == m.end() || !role->is_string() || role->get_ref<const std::string&>().empty()) {
        return Status::InvalidArgument(where + " needs a non-empty string \"role\"");
      }
      if (content == m.end() || !content->is_string()) {
        return Status::InvalidArgument(where + " needs a string \"content\"");
      }
      chat.push_back({role->get<std::string>(), content->get<std::string>()});
    }
  }
  // The template checks the roles, also when "prompt" is what is used.
  ASSIGN_OR_RETURN(std::string text, ApplyChatTemplate(chat, /*add_generation_prompt=*/true));
  if (prompt != row.end()) return prompt->get<std::string>();
  return text;
}

StatusOr<int64_t> RowCompletionBudget(const nlohmann::json& row) {
  if (!row.is_object()) return Status::InvalidArgument("row is not a JSON object");
  const auto it = row.find("max_completion_length");
  if (it == row.end()) return int64_t{0};
  if (!it->is_number_integer() || it->get<int64_t>() < 1) {
    return Status::InvalidArgument("\"max_completion_length\" must be a positive integer");
  }
  return it->get<int64_t>();
}

Status ValidateDatasetRow(const nlohmann::json& row) {
  RETURN_IF_ERROR(PromptText(row).status());
  return RowCompletionBudget(row).status();
}

}  // namespace grpo::common
