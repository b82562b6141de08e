#include "common/tokenizer/tool_calls.h"

namespace grpo::common {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

std::string_view TrimWhitespace(std::string_view s) {
  constexpr std::string_view kSpace = " \t\r\n\f\v";
  const size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
}

// A well-formed call, or the reason the body is not one.
void ParseBlock(std::string_view body, size_t offset, ParsedToolCalls* out) {
  auto malformed = [&](MalformedToolCallReason reason, std::string detail) {
    out->malformed.push_back({reason, std::move(detail), std::string(body), offset});
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {
    malformed(MalformedToolCallReason::kNotJson, e.what());
    return;
  }
  if (!j.is_object()) {
    malformed(MalformedToolCallReason::kNotJson,
              std::string("expected a JSON object, got ") + j.type_name());
    return;
  }
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) {
    malformed(MalformedToolCallReason::kNoName, "\"name\" must be a non-empty string");
    return;
  }
  nlohmann::json arguments = nlohmann::json::object();
  if (const auto a = j.find("arguments"); a != j.end() && !a->is_null()) {
    if (!a->is_object()) {
      malformed(MalformedToolCallReason::kArgumentsNotObject,
                std::string("\"arguments\" must be an object, got ") + a->type_name());
      return;
    }
    arguments = *a;
  }
  out->calls.push_back({name->get<std::string>(), std::move(arguments), offset});
}

}  // namespace

std::string_view MalformedToolCallReasonName(MalformedToolCallReason reason) {
  switch (reason) {
    case MalformedToolCallReason::kNotJson:
      return "not_json";
    case MalformedToolCallReason::kNoName:
      return "no_name";
    case MalformedToolCallReason::kArgumentsNotObject:
      return "arguments_not_object";
    case MalformedToolCallReason::kUnclosedTag:
      return "unclosed_tag";
  }
  return "unknown";
}

ParsedToolCalls ParseToolCalls(std::string_view turn_text) {
  ParsedToolCalls out;
  size_t open = turn_text.find(kOpen);
  while (open != std::string_view::npos) {
    const size_t body_begin = open + kOpen.size();
    const size_t close = turn_text.find(kClose, body_begin);
    const size_t next_open = turn_text.find(kOpen, body_begin);
    if (close == std::string_view::npos ||
        (next_open != std::string_view::npos && next_open < close)) {
      const size_t body_end = next_open == std::string_view::npos ? turn_text.size() : next_open;
      out.malformed.push_back(
          {MalformedToolCallReason::kUnclosedTag,
           "no </tool_call> after the <tool_call> at byte " + std::to_string(open),
           std::string(turn_text.substr(body_begin, body_end - body_begin)), open});
      open = next_open;
      continue;
    }
    ParseBlock(TrimWhitespace(turn_text.substr(body_begin, close - body_begin)), open, &out);
    open = turn_text.find(kOpen, close + kClose.size());
  }
  return out;
}

}  // namespace grpo::common
