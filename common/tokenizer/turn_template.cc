#include "common/tokenizer/turn_template.h"

#include <algorithm>
#include <array>
#include <utility>

namespace grpo::common {
namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kGenerationPrompt = "<|im_start|>assistant\n";

constexpr std::array<std::pair<ChatFormat, std::string_view>, 3> kFormatNames = {{
    {ChatFormat::kChatML, "chatml"},
    {ChatFormat::kQwen3, "qwen3"},
    {ChatFormat::kQwen3Training, "qwen3_training"},
}};

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool EndsWith(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Python's str.lstrip('\n'), rstrip('\n') and strip('\n'), as the Jinja templates call them.
std::string_view LStripNewlines(std::string_view s) {
  const size_t i = s.find_first_not_of('\n');
  return i == std::string_view::npos ? std::string_view() : s.substr(i);
}
std::string_view RStripNewlines(std::string_view s) {
  const size_t i = s.find_last_not_of('\n');
  return i == std::string_view::npos ? std::string_view() : s.substr(0, i + 1);
}
std::string_view StripNewlines(std::string_view s) { return RStripNewlines(LStripNewlines(s)); }

Status CheckRoles(const std::vector<ChatMessage>& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
      return Status::InvalidArgument("chat message " + std::to_string(i) + " has role '" + r +
                                     "'; expected system, user, assistant or tool");
    }
  }
  return Status::OK();
}

// The Qwen3 templates' split of an assistant content holding "</think>": the reasoning is what
// lies between the last "<think>" and the first "</think>", the content what follows the last
// "</think>" (newlines trimmed as the template does). Without "</think>": no reasoning.
struct AssistantParts {
  std::string_view reasoning;
  std::string_view content;
};
AssistantParts SplitThink(std::string_view content) {
  const size_t first_close = content.find("</think>");
  if (first_close == std::string_view::npos) return {{}, content};
  const size_t last_close = content.rfind("</think>");
  std::string_view before = RStripNewlines(content.substr(0, first_close));
  const size_t open = before.rfind("<think>");
  if (open != std::string_view::npos)
    before = before.substr(open + std::string_view("<think>").size());
  return {LStripNewlines(before),
          LStripNewlines(content.substr(last_close + std::string_view("</think>").size()))};
}

void AppendThinkTurn(const AssistantParts& parts, std::string* out) {
  *out += "<think>\n";
  *out += StripNewlines(parts.reasoning);
  *out += "\n</think>\n\n";
  *out += LStripNewlines(parts.content);
}

// One message of the Qwen3 templates' loop (the system message at index 0 is rendered before the
// loop). `think_always`: the training variant.
void AppendQwen3Message(const std::vector<ChatMessage>& messages, size_t i, size_t last_query_index,
                        bool think_always, std::string* out) {
  const ChatMessage& m = messages[i];
  const bool last = i + 1 == messages.size();
  if (m.role == "user" || (m.role == "system" && i != 0)) {
    *out += kImStart;
    *out += m.role + "\n" + m.content;
    *out += kImEnd;
    *out += "\n";
  } else if (m.role == "assistant") {
    const AssistantParts parts = SplitThink(m.content);
    *out += "<|im_start|>assistant\n";
    if (think_always || (i > last_query_index && (last || !parts.reasoning.empty()))) {
      AppendThinkTurn(parts, out);
    } else {
      *out += parts.content;
    }
    *out += kImEnd;
    *out += "\n";
  } else if (m.role == "tool") {
    if (i == 0 || messages[i - 1].role != "tool") *out += "<|im_start|>user";
    *out += "\n<tool_response>\n" + m.content + "\n</tool_response>";
    if (last || messages[i + 1].role != "tool") {
      *out += kImEnd;
      *out += "\n";
    }
  }
}

std::string RenderQwen3(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                        bool think_always) {
  std::string out;
  if (!messages.empty() && messages[0].role == "system") {
    out += "<|im_start|>system\n" + messages[0].content + "<|im_end|>\n";
  }
  // The last user message that is not a wrapped tool response: the "query" (messages.size() - 1
  // when there is none, as in the template).
  size_t last_query_index = messages.empty() ? 0 : messages.size() - 1;
  for (size_t k = messages.size(); k-- > 0;) {
    const ChatMessage& m = messages[k];
    if (m.role == "user" &&
        !(StartsWith(m.content, "<tool_response>") && EndsWith(m.content, "</tool_response>"))) {
      last_query_index = k;
      break;
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    AppendQwen3Message(messages, i, last_query_index, think_always, &out);
  }
  if (add_generation_prompt) out += kGenerationPrompt;
  return out;
}

// `s` with newlines and other control characters escaped, for error messages.
std::string Escaped(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\\') {
      out += "\\\\";
    } else {
      out += c;
    }
  }
  return out;
}

// Up to 24 bytes of `s` on each side of offset `at`, the offset marked with '|' (a multi-byte
// UTF-8 character at either end may be cut).
std::string Around(std::string_view s, size_t at) {
  const size_t begin = at > 24 ? at - 24 : 0;
  const size_t end = std::min(s.size(), at + 24);
  return "\"" + Escaped(s.substr(begin, at - begin)) + "|" + Escaped(s.substr(at, end - at)) + "\"";
}

size_t FirstDifference(std::string_view a, std::string_view b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

StatusOr<ChatFormat> ParseChatFormat(std::string_view name) {
  std::string names;
  for (const auto& [format, n] : kFormatNames) {
    if (n == name) return format;
    names += names.empty() ? "" : ", ";
    names += n;
  }
  return Status::InvalidArgument("unknown chat format '" + std::string(name) +
                                 "'; expected one of " + names);
}

std::string_view ChatFormatName(ChatFormat format) {
  for (const auto& [f, n] : kFormatNames) {
    if (f == format) return n;
  }
  return "unknown";
}

StatusOr<std::string> RenderChat(ChatFormat format, const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt) {
  RETURN_IF_ERROR(CheckRoles(messages));
  switch (format) {
    case ChatFormat::kChatML:
      return ApplyChatTemplate(messages, add_generation_prompt);
    case ChatFormat::kQwen3:
      return RenderQwen3(messages, add_generation_prompt, /*think_always=*/false);
    case ChatFormat::kQwen3Training:
      return RenderQwen3(messages, add_generation_prompt, /*think_always=*/true);
  }
  return Status::InvalidArgument("unknown chat format");
}

StatusOr<std::string> RenderObservationSuffix(ChatFormat format,
                                              const std::vector<ChatMessage>& observation,
                                              bool turn_closed) {
  if (observation.empty()) {
    return Status::InvalidArgument("an observation needs at least one message");
  }
  for (size_t i = 0; i < observation.size(); ++i) {
    const std::string& r = observation[i].role;
    if (r != "tool" && r != "user") {
      return Status::InvalidArgument("observation message " + std::to_string(i) + " has role '" +
                                     r + "'; expected tool or user");
    }
  }
  std::string out = turn_closed ? "\n" : std::string(kImEnd) + "\n";
  switch (format) {
    case ChatFormat::kChatML: {
      ASSIGN_OR_RETURN(std::string turns, ApplyChatTemplate(observation, true));
      return out + turns;
    }
    case ChatFormat::kQwen3:
    case ChatFormat::kQwen3Training:
      // After an assistant turn, so the first tool message opens a user turn; no system message
      // at index 0, and no assistant message whose think block would depend on the query index.
      for (size_t i = 0; i < observation.size(); ++i) {
        AppendQwen3Message(observation, i, /*last_query_index=*/0, /*think_always=*/false, &out);
      }
      out += kGenerationPrompt;
      return out;
  }
  return Status::InvalidArgument("unknown chat format");
}

Status CheckPrefixPreserving(ChatFormat format) {
  // TRL's dummy conversation; the tool call is written as the text the Qwen3 template renders
  // for {"name": "dummy", "arguments": {}} with empty content.
  const std::vector<ChatMessage> first_messages = {
      {"user", "dummy"},
      {"assistant", "<tool_call>\n{\"name\": \"dummy\", \"arguments\": {}}\n</tool_call>"}};
  const std::vector<ChatMessage> tool = {{"tool", "dummy"}};
  std::vector<ChatMessage> second_messages = first_messages;
  second_messages.push_back(tool[0]);

  ASSIGN_OR_RETURN(const std::string first, RenderChat(format, first_messages, false));
  ASSIGN_OR_RETURN(const std::string second, RenderChat(format, second_messages, true));
  ASSIGN_OR_RETURN(const std::string suffix, RenderObservationSuffix(format, tool, true));
  const std::string name(ChatFormatName(format));

  if (!StartsWith(second, first)) {
    const size_t at = FirstDifference(first, second);
    return Status::FailedPrecondition(
        "chat format '" + name +
        "' is not prefix-preserving: appending a tool message changes the rendering of the "
        "conversation before it (first difference at character " +
        std::to_string(at) + ": " + Around(first, at) + " became " + Around(second, at) +
        "), so appending observation tokens to a model turn would not give the ids the template "
        "gives; use a prefix-preserving format (chatml, qwen3_training)");
  }
  const size_t end_of_turn = first.rfind(kImEnd);
  if (end_of_turn == std::string::npos) {
    return Status::FailedPrecondition("chat format '" + name +
                                      "': the rendered assistant turn has no <|im_end|>");
  }
  const std::string_view remainder = std::string_view(second).substr(end_of_turn + kImEnd.size());
  if (remainder != suffix) {
    const size_t at = FirstDifference(remainder, suffix);
    return Status::FailedPrecondition(
        "chat format '" + name +
        "': the text after the model turn's <|im_end|> is not the observation suffix (first "
        "difference at character " +
        std::to_string(at) + " after <|im_end|>: template " + Around(remainder, at) + ", suffix " +
        Around(suffix, at) + ")");
  }
  return Status::OK();
}

}  // namespace grpo::common
