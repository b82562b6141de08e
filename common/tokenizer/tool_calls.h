// Tool calls in a model turn, Qwen3 (Hermes) style: any number of
//   <tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>
// blocks, with text before, between and after them.
//
// Counting them as TRL's GRPOTrainer does (trl/trainer/grpo_trainer.py, _tool_call_loop and the
// "tools/" metrics in _generate; TRL 1.16):
//   tools/call_frequency    = calls / completions in the batch (all ranks),
//   tools/failure_frequency = failures / calls (0 when there are no calls).
// A call is one entry of the turn's parsed tool_calls that TRL goes on to execute: it counts only
// for turns that get a tool round (not the turn that hits max_tool_calling_iterations), and still
// counts when the result is then dropped for exceeding max_completion_length. A failure is a
// counted call whose execution failed: unknown tool name, the tool raised (wrong argument names
// included), or a type other than "function".
// TRL parses a turn all or nothing (parse_response): one malformed block (not JSON, no name,
// unclosed) turns the WHOLE turn into plain text with no calls, so it ends the episode and counts
// as neither a call nor a failure, even beside well-formed blocks. "arguments" that is not an
// object parses, and fails when executed (f(**args) raises): a call and a failure.
// So, to get TRL's numbers from ParseToolCalls' result for a turn that gets a tool round:
//   if any malformed entry has a reason other than kArgumentsNotObject: 0 calls, 0 failures;
//   else calls = calls.size() + malformed.size(),
//        failures = malformed.size() + the failed executions among `calls`.
// A caller that instead answers malformed blocks with an error observation (as this parser
// allows) and counts each as a call and a failure gets higher numbers than TRL; say which.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace grpo::common {

struct ToolCall {
  std::string name;          // non-empty
  nlohmann::json arguments;  // always an object; {} when the block has none or null (as TRL)
  size_t offset = 0;         // byte offset of the block's "<tool_call>" in the turn text
};

enum class MalformedToolCallReason {
  kNotJson,             // the block's body is not a JSON object
  kNoName,              // no "name", or it is not a non-empty string
  kArgumentsNotObject,  // "arguments" present and not an object (nor null)
  kUnclosedTag,         // "<tool_call>" with no "</tool_call>" before the next "<tool_call>"
};

// "not_json", "no_name", "arguments_not_object", "unclosed_tag" (a small fixed set: usable as a
// metric label).
std::string_view MalformedToolCallReasonName(MalformedToolCallReason reason);

struct MalformedToolCall {
  MalformedToolCallReason reason;
  std::string detail;  // e.g. the JSON parser's message; for an error observation, not a label
  std::string body;    // the text between the tags (to the end of the turn when unclosed)
  size_t offset = 0;   // byte offset of the block's "<tool_call>" in the turn text
};

struct ParsedToolCalls {
  std::vector<ToolCall> calls;               // well-formed blocks, in order
  std::vector<MalformedToolCall> malformed;  // the others, in order
};

// Every <tool_call> block of turn_text (the decoded model turn, with or without "<|im_end|>").
// A block's body is the text between the tags with surrounding whitespace trimmed; it must be a
// JSON object with a non-empty string "name" and an object (or missing/null) "arguments"; other
// keys are ignored. Text outside blocks and a stray "</tool_call>" are ignored. Never fails: what
// is wrong is reported in `malformed`. Thread-safe.
ParsedToolCalls ParseToolCalls(std::string_view turn_text);

}  // namespace grpo::common
