// Environments stepped between the model's turns of a multi-turn episode (docs/ARCHITECTURE.md
// "Multi-turn episodes"). One EnvSession per episode: Reset with the dataset row and a seed, then
// one Step per model turn with the turn's text, until an observation says done or truncated, or a
// limit of the episode loop (rollout/env/episode.h) ends it. The session's destructor ends the
// episode (a remote environment frees its state then). No gRPC here: services/ implements this
// interface over gRPC and over OpenEnv's protocol; FunctionEnvironment below is the in-process one
// that tests and the built-in tasks use.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tool_calls.h"

namespace grpo::rollout {

// Deadline of one Reset or Step call.
inline constexpr std::chrono::milliseconds kDefaultEnvStepTimeout{30000};

// What an environment answers to a reset or to a model turn.
struct EnvObservation {
  // Shown to the model before its next turn, rendered with the chat template after the turn
  // (role "tool" or "user"). Empty on a step that ends the episode is fine.
  std::vector<common::ChatMessage> messages;
  std::optional<double> reward;  // this step's reward; the episode's is the sum of the given ones
  bool done = false;             // the episode ended (the task is over)
  bool truncated = false;        // the environment cut the episode short
  nlohmann::json metadata;       // object or null; the last one reaches the reward functions
  // Reset only: the tools the environment offers (JSON function schemas, as in a chat template's
  // `tools`). When there are any, every model turn is parsed for <tool_call> blocks
  // (common/tokenizer/tool_calls.h): well-formed calls reach StepToolCalls, and a turn with a
  // malformed one is answered by the worker with an error observation, the environment not
  // stepped (rollout/env/episode.h).
  std::vector<nlohmann::json> tools;
};

// How a Reset or Step call failed, from its Status: the `kind` label of
// grpo_rollout_env_errors_total (common::kEnvErrorKinds).
//   timeout     DeadlineExceeded: missed the step deadline
//   unavailable Unavailable: the environment could not be reached or went away (crashed)
//   error       anything else (the environment reported an error, answered nonsense)
std::string_view EnvErrorKind(const Status& status);

// One episode. Reset is called once, first; then Step once per model turn. Not thread-safe: one
// episode loop drives it; different sessions run concurrently. Errors as EnvErrorKind says; after
// an error the session is not called again.
class EnvSession {
 public:
  virtual ~EnvSession() = default;
  // row: the dataset row (a JSON object); seed: the episode's seed (the same for the same row,
  // generation index and learner seed, so an episode replays).
  virtual StatusOr<EnvObservation> Reset(const nlohmann::json& row, uint64_t seed,
                                         std::chrono::steady_clock::time_point deadline) = 0;
  // action: the text of the model's turn (special tokens such as the closing <|im_end|> left
  // out).
  virtual StatusOr<EnvObservation> Step(const std::string& action,
                                        std::chrono::steady_clock::time_point deadline) = 0;
  // A step of an environment that declared tools: the turn's text and its well-formed tool calls
  // (empty: the turn called none, e.g. a final answer). Default: Step(action), the environment
  // parsing the text itself.
  virtual StatusOr<EnvObservation> StepToolCalls(const std::string& action,
                                                 const std::vector<common::ToolCall>& calls,
                                                 std::chrono::steady_clock::time_point deadline) {
    (void)calls;
    return Step(action, deadline);
  }
};

// A source of sessions. Thread-safe: Open may be called concurrently.
class Environment {
 public:
  virtual ~Environment() = default;
  virtual std::string name() const = 0;
  // A new session (one episode). Unavailable when the environment cannot be reached.
  virtual StatusOr<std::unique_ptr<EnvSession>> Open() = 0;
};

// An in-process environment from two functions, three with StepToolCalls (tests, built-in tasks).
// Each session gets its own copy of a state object (json, initially null) that reset and step read
// and write. Its sessions borrow the functions: the environment must outlive them.
class FunctionEnvironment : public Environment {
 public:
  using ResetFn = std::function<StatusOr<EnvObservation>(const nlohmann::json& row, uint64_t seed,
                                                         nlohmann::json& state)>;
  using StepFn =
      std::function<StatusOr<EnvObservation>(const std::string& action, nlohmann::json& state)>;
  // StepToolCalls; null = Step.
  using StepToolCallsFn = std::function<StatusOr<EnvObservation>(
      const std::string& action, const std::vector<common::ToolCall>& calls,
      nlohmann::json& state)>;
  FunctionEnvironment(std::string name, ResetFn reset, StepFn step,
                      StepToolCallsFn step_tool_calls = nullptr)
      : name_(std::move(name)),
        reset_(std::move(reset)),
        step_(std::move(step)),
        step_tool_calls_(std::move(step_tool_calls)) {}

  std::string name() const override { return name_; }
  StatusOr<std::unique_ptr<EnvSession>> Open() override;

 private:
  const std::string name_;
  const ResetFn reset_;
  const StepFn step_;
  const StepToolCallsFn step_tool_calls_;
};

}  // namespace grpo::rollout
