#include "common/tokenizer/chat_template.h"

namespace grpo::common {

StatusOr<std::string> ApplyChatTemplate(const std::vector<ChatMessage>& messages,
                                        bool add_generation_prompt) {
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool") {
      return Status::InvalidArgument("chat message " + std::to_string(i) + " has role '" + m.role +
                                     "'; expected system, user, assistant or tool");
    }
    out += "<|im_start|>";
    out += m.role;
    out += '\n';
    out += m.content;
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace grpo::common
