// Turns of episodes whose environment declared tools (rollout/env/tool_turn.h): the calls and the
// texts below are written by hand, and so are the counts expected of them.
#include "rollout/env/tool_turn.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/metrics/grpo_metrics.h"
#include "common/tokenizer/tool_calls.h"

namespace grpo::rollout {
namespace {

using nlohmann::json;

const auto kDeadline = std::chrono::steady_clock::time_point::max();

struct Recorder {
  int steps = 0;                                          // plain Step calls
  std::vector<std::vector<common::ToolCall>> tool_steps;  // StepToolCalls calls
};

FunctionEnvironment Calculator(Recorder* rec, bool structured = true) {
  FunctionEnvironment::StepToolCallsFn with_calls;
  if (structured) {
    with_calls = [rec](const std::string&, const std::vector<common::ToolCall>& calls,
                       json&) -> StatusOr<EnvObservation> {
      rec->tool_steps.push_back(calls);
      EnvObservation obs;
      if (calls.empty()) {
        obs.done = true;
      } else {
        obs.messages = {{"tool", "14"}};
      }
      return obs;
    };
  }
  return FunctionEnvironment(
      "calculator",
      [](const json&, uint64_t, json&) -> StatusOr<EnvObservation> {
        EnvObservation obs;
        obs.tools = {json{{"name", "calculator"}}};
        return obs;
      },
      [rec](const std::string&, json&) -> StatusOr<EnvObservation> {
        ++rec->steps;
        return EnvObservation{};
      },
      with_calls);
}

TEST(ToolTurn, WellFormedCallsReachTheEnvironmentStructured) {
  Recorder rec;
  FunctionEnvironment env = Calculator(&rec);
  auto session = env.Open().value();
  ToolCallCounts counts;
  const std::string turn =
      "Let me compute.<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": "
      "\"2+3*4\"}}\n</tool_call> and <tool_call>{\"name\": \"calculator\"}</tool_call>";
  auto obs = StepToolTurn(*session, turn, kDeadline, &counts);
  ASSERT_TRUE(obs.ok()) << obs.status().ToString();
  ASSERT_EQ(rec.tool_steps.size(), 1u);
  ASSERT_EQ(rec.tool_steps[0].size(), 2u);
  EXPECT_EQ(rec.tool_steps[0][0].name, "calculator");
  EXPECT_EQ(rec.tool_steps[0][0].arguments, (json{{"expression", "2+3*4"}}));
  EXPECT_EQ(rec.tool_steps[0][1].arguments, json::object());
  EXPECT_EQ(obs->messages.at(0).content, "14");
  EXPECT_EQ(counts.calls, 2);
  EXPECT_TRUE(counts.failures.empty());
  EXPECT_EQ(rec.steps, 0);
}

TEST(ToolTurn, AMalformedCallIsAnsweredByTheWorkerAndTheEnvironmentIsNotStepped) {
  Recorder rec;
  FunctionEnvironment env = Calculator(&rec);
  auto session = env.Open().value();
  ToolCallCounts counts;
  const std::string turn =
      "<tool_call>{\"name\": \"calculator\", \"arguments\": {}}</tool_call>"
      "<tool_call>{not json}</tool_call><tool_call>{\"arguments\": {}}</tool_call>";
  auto obs = StepToolTurn(*session, turn, kDeadline, &counts);
  ASSERT_TRUE(obs.ok());
  EXPECT_TRUE(rec.tool_steps.empty());
  EXPECT_EQ(rec.steps, 0);
  ASSERT_EQ(obs->messages.size(), 1u);
  EXPECT_EQ(obs->messages[0].role, "tool");
  const std::string& text = obs->messages[0].content;
  EXPECT_NE(text.find("error: malformed tool call (not_json)"), std::string::npos) << text;
  EXPECT_NE(text.find("error: malformed tool call (no_name)"), std::string::npos) << text;
  EXPECT_FALSE(obs->done);
  EXPECT_EQ(counts.calls, 3);
  EXPECT_EQ(counts.failures, (std::map<std::string, int64_t>{{"no_name", 1}, {"not_json", 1}}));
}

TEST(ToolTurn, ATurnWithoutCallsIsAFinalAnswerStepped) {
  Recorder rec;
  FunctionEnvironment env = Calculator(&rec);
  auto session = env.Open().value();
  ToolCallCounts counts;
  auto obs = StepToolTurn(*session, "The answer is 14.", kDeadline, &counts);
  ASSERT_TRUE(obs.ok());
  ASSERT_EQ(rec.tool_steps.size(), 1u);
  EXPECT_TRUE(rec.tool_steps[0].empty());
  EXPECT_TRUE(obs->done);
  EXPECT_EQ(counts.calls, 0);
}

TEST(ToolTurn, AnEnvironmentWithoutStructuredStepsGetsTheText) {
  Recorder rec;
  FunctionEnvironment env = Calculator(&rec, /*structured=*/false);
  auto session = env.Open().value();
  ToolCallCounts counts;
  ASSERT_TRUE(StepToolTurn(*session, "<tool_call>{\"name\": \"calculator\"}</tool_call>", kDeadline,
                           &counts)
                  .ok());
  EXPECT_EQ(rec.steps, 1);
  EXPECT_EQ(counts.calls, 1);
}

TEST(ToolTurn, TheMetricLabelsAreTheParsersReasons) {
  const common::MalformedToolCallReason reasons[] = {
      common::MalformedToolCallReason::kNotJson, common::MalformedToolCallReason::kNoName,
      common::MalformedToolCallReason::kArgumentsNotObject,
      common::MalformedToolCallReason::kUnclosedTag};
  ASSERT_EQ(std::size(reasons), common::kMalformedToolCallReasons.size());
  for (size_t i = 0; i < std::size(reasons); ++i) {
    EXPECT_EQ(common::MalformedToolCallReasonName(reasons[i]),
              common::kMalformedToolCallReasons[i]);
  }
}

// The episode loop counts environment failures by EnvErrorKind; the metric's label set is
// common::kEnvErrorKinds, in the order timeout, unavailable, error.
TEST(EnvErrorKind, NamesAreTheMetricsLabels) {
  EXPECT_EQ(EnvErrorKind(Status::DeadlineExceeded("x")), common::kEnvErrorKinds[0]);
  EXPECT_EQ(EnvErrorKind(Status::Unavailable("x")), common::kEnvErrorKinds[1]);
  EXPECT_EQ(EnvErrorKind(Status::Internal("x")), common::kEnvErrorKinds[2]);
  EXPECT_EQ(EnvErrorKind(Status::InvalidArgument("x")), common::kEnvErrorKinds[2]);
}

}  // namespace
}  // namespace grpo::rollout
