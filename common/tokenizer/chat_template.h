// ChatML prompt formatting (Qwen's chat format without tools or thinking blocks).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace grpo::common {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
};

// "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then "<|im_start|>assistant\n" when
// add_generation_prompt. Contents are copied verbatim. InvalidArgument naming the message index
// and role for any other role. Thread-safe.
StatusOr<std::string> ApplyChatTemplate(const std::vector<ChatMessage>& messages,
                                        bool add_generation_prompt);

}  // namespace grpo::common
