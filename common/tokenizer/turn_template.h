// Chat formats for multi-turn episodes, token in, token out: the rollout worker keeps the ids the
// model generated and appends an environment's observation as the ids of the text the chat
// template puts after the model's turn (RenderObservationSuffix), never re-tokenising the
// history. That is only sound for a prefix-preserving format (CheckPrefixPreserving): one whose
// rendering of a conversation does not change when messages are appended.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/chat_template.h"

namespace grpo::common {

enum class ChatFormat {
  // "chatml": every message "<|im_start|>{role}\n{content}<|im_end|>\n" (ApplyChatTemplate);
  // tool messages keep the role "tool". Prefix-preserving.
  kChatML,
  // "qwen3": the chat template shipped with Qwen3 (tests/data/qwen3-tokenizer), no tools declared.
  // Tool messages are grouped into one user turn of
  // "\n<tool_response>\n{content}\n</tool_response>"
  // blocks; an assistant message after the last user query gets a "<think>...</think>" block only
  // when it is the last message or has reasoning, and earlier ones lose theirs. NOT
  // prefix-preserving: for rendering prompts only, never for multi-turn training.
  kQwen3,
  // "qwen3_training": TRL's training variant of it (trl/chat_templates/qwen3_training.jinja, which
  // GRPOTrainer swaps in when tools are used): every assistant message gets its think block
  // ("<think>\n{reasoning}\n</think>\n\n", empty reasoning included). Prefix-preserving.
  kQwen3Training,
};

// "chatml", "qwen3" or "qwen3_training"; InvalidArgument listing those names otherwise.
StatusOr<ChatFormat> ParseChatFormat(std::string_view name);
// The inverse of ParseChatFormat.
std::string_view ChatFormatName(ChatFormat format);

// The whole conversation as the format's template renders it (Hugging Face
// apply_chat_template(messages, add_generation_prompt) without tools, reasoning_content or
// enable_thinking), ending with "<|im_start|>assistant\n" when add_generation_prompt. For the
// Qwen3 formats a "<think>...</think>" in an assistant content is split off and re-rendered as the
// template does. Roles: system, user, assistant, tool; InvalidArgument naming the index and role
// otherwise. Thread-safe.
StatusOr<std::string> RenderChat(ChatFormat format, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt);

// The text to append after a model turn so that the model sees `observation` (one or more
// messages, roles tool or user) and then the generation prompt "<|im_start|>assistant\n".
// turn_closed: the model's turn ended with "<|im_end|>" and the text starts right after that
// token (with the "\n" the template puts there); otherwise (cut by the length budget) it starts
// with "<|im_end|>" itself. Encode it with the model's tokenizer and append the ids; in a
// prefix-preserving format, prompt ids + generated ids (+ "<|im_end|>") + these ids equal the ids
// of the whole conversation rendered by RenderChat. InvalidArgument for an empty observation or a
// message of another role (naming its index and role). Thread-safe.
StatusOr<std::string> RenderObservationSuffix(ChatFormat format,
                                              const std::vector<ChatMessage>& observation,
                                              bool turn_closed);

// TRL's is_chat_template_prefix_preserving, in text: renders [user, assistant with a tool call]
// and [user, assistant with a tool call, tool] with the generation prompt; the first must be a
// prefix of the second, and what follows the first's last "<|im_end|>" in the second must be
// RenderObservationSuffix of the tool message (closed turn). FailedPrecondition naming the format,
// the first differing character offset and the text around it otherwise (the real "qwen3" fails;
// "qwen3_training" is its fix). OK for chatml and qwen3_training. Thread-safe.
Status CheckPrefixPreserving(ChatFormat format);

}  // namespace grpo::common
