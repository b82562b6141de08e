// common/tokenizer/tool_calls: Qwen3-style <tool_call> blocks, values checked by hand.
#include "common/tokenizer/tool_calls.h"

#include <gtest/gtest.h>

#include <string>

namespace grpo::common {
namespace {

using json = nlohmann::json;

TEST(ToolCalls, OneWellFormedCall) {
  const std::string text =
      "<tool_call>\n{\"name\": \"multiply\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>";
  const ParsedToolCalls p = ParseToolCalls(text);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_TRUE(p.malformed.empty());
  EXPECT_EQ(p.calls[0].name, "multiply");
  EXPECT_EQ(p.calls[0].arguments, json({{"a", 2}, {"b", 3}}));
  EXPECT_EQ(p.calls[0].offset, 0u);
}

TEST(ToolCalls, SeveralCallsWithTextAroundThemInOrder) {
  const std::string text =
      "<think>\nTwo lookups.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"weather\", "
      "\"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\nand\n<tool_call>\n{\"name\": "
      "\"time\", \"arguments\": {\"tz\": \"Asia/Tokyo\", \"h24\": true}}\n</tool_call>\nDone."
      "<|im_end|>";
  const ParsedToolCalls p = ParseToolCalls(text);
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_TRUE(p.malformed.empty());
  EXPECT_EQ(p.calls[0].name, "weather");
  EXPECT_EQ(p.calls[0].arguments, json({{"city", "Zürich"}}));
  EXPECT_EQ(p.calls[0].offset, text.find("<tool_call>"));
  EXPECT_EQ(p.calls[1].name, "time");
  EXPECT_EQ(p.calls[1].arguments, json({{"tz", "Asia/Tokyo"}, {"h24", true}}));
  EXPECT_EQ(p.calls[1].offset, text.rfind("<tool_call>"));
}

TEST(ToolCalls, MissingOrNullArgumentsAreAnEmptyObjectAsInTrl) {
  const ParsedToolCalls p = ParseToolCalls(
      "<tool_call>{\"name\": \"now\"}</tool_call><tool_call> {\"name\": \"now\", \"arguments\": "
      "null} </tool_call>");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].arguments, json::object());
  EXPECT_EQ(p.calls[1].arguments, json::object());
}

TEST(ToolCalls, NoBlocksNoCalls) {
  const ParsedToolCalls p = ParseToolCalls("The answer is 42. </tool_call> stray close tag.");
  EXPECT_TRUE(p.calls.empty());
  EXPECT_TRUE(p.malformed.empty());
}

TEST(ToolCalls, MalformedJsonIsReportedBesideTheGoodCall) {
  const std::string text =
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
  const ParsedToolCalls p = ParseToolCalls(text);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "g");
  ASSERT_EQ(p.malformed.size(), 1u);
  EXPECT_EQ(p.malformed[0].reason, MalformedToolCallReason::kNotJson);
  EXPECT_EQ(p.malformed[0].body, "{\"name\": \"f\", \"arguments\": {\"a\": 1}");
  EXPECT_EQ(p.malformed[0].offset, 0u);
  EXPECT_FALSE(p.malformed[0].detail.empty());
  EXPECT_EQ(MalformedToolCallReasonName(p.malformed[0].reason), "not_json");
}

TEST(ToolCalls, AJsonValueThatIsNotAnObjectIsNotJsonOfACall) {
  const ParsedToolCalls p = ParseToolCalls("<tool_call>[\"f\", 1]</tool_call>");
  EXPECT_TRUE(p.calls.empty());
  ASSERT_EQ(p.malformed.size(), 1u);
  EXPECT_EQ(p.malformed[0].reason, MalformedToolCallReason::kNotJson);
}

TEST(ToolCalls, MissingEmptyOrNonStringNameIsNoName) {
  const ParsedToolCalls p = ParseToolCalls(
      "<tool_call>{\"arguments\": {\"a\": 1}}</tool_call>"
      "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>"
      "<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>");
  EXPECT_TRUE(p.calls.empty());
  ASSERT_EQ(p.malformed.size(), 3u);
  for (const MalformedToolCall& m : p.malformed) {
    EXPECT_EQ(m.reason, MalformedToolCallReason::kNoName) << m.body;
  }
  EXPECT_EQ(MalformedToolCallReasonName(MalformedToolCallReason::kNoName), "no_name");
}

TEST(ToolCalls, ArgumentsThatAreNotAnObject) {
  const ParsedToolCalls p = ParseToolCalls(
      "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>"
      "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>");
  EXPECT_TRUE(p.calls.empty());
  ASSERT_EQ(p.malformed.size(), 2u);
  EXPECT_EQ(p.malformed[0].reason, MalformedToolCallReason::kArgumentsNotObject);
  EXPECT_EQ(p.malformed[1].reason, MalformedToolCallReason::kArgumentsNotObject);
  EXPECT_EQ(MalformedToolCallReasonName(p.malformed[0].reason), "arguments_not_object");
}

TEST(ToolCalls, UnclosedTagAtTheEndOfTheTurn) {
  const std::string text =
      "Calling.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}<|im_end|>";
  const ParsedToolCalls p = ParseToolCalls(text);
  EXPECT_TRUE(p.calls.empty());
  ASSERT_EQ(p.malformed.size(), 1u);
  EXPECT_EQ(p.malformed[0].reason, MalformedToolCallReason::kUnclosedTag);
  EXPECT_EQ(p.malformed[0].offset, 9u);
  EXPECT_EQ(p.malformed[0].body, "\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}<|im_end|>");
  EXPECT_EQ(MalformedToolCallReasonName(p.malformed[0].reason), "unclosed_tag");
}

TEST(ToolCalls, UnclosedTagFollowedByAClosedOne) {
  // The first block never closes before the second opens: it is unclosed, the second is a call.
  const std::string text =
      "<tool_call>\n{\"name\": \"f\"\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"x\": "
      "[1, 2]}}\n</tool_call>";
  const ParsedToolCalls p = ParseToolCalls(text);
  ASSERT_EQ(p.malformed.size(), 1u);
  EXPECT_EQ(p.malformed[0].reason, MalformedToolCallReason::kUnclosedTag);
  EXPECT_EQ(p.malformed[0].body, "\n{\"name\": \"f\"\n");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "g");
  EXPECT_EQ(p.calls[0].arguments, json({{"x", {1, 2}}}));
  EXPECT_EQ(p.calls[0].offset, text.rfind("<tool_call>"));
}

}  // namespace
}  // namespace grpo::common
