#include "rollout/env/environment.h"

namespace grpo::rollout {

std::string_view EnvErrorKind(const Status& status) {
  switch (status.code()) {
    case StatusCode::kDeadlineExceeded:
      return "timeout";
    case StatusCode::kUnavailable:
      return "unavailable";
    default:
      return "error";
  }
}

namespace {

class FunctionSession : public EnvSession {
 public:
  FunctionSession(const FunctionEnvironment::ResetFn& reset,
                  const FunctionEnvironment::StepFn& step,
                  const FunctionEnvironment::StepToolCallsFn& step_tool_calls)
      : reset_(reset), step_(step), step_tool_calls_(step_tool_calls) {}

  StatusOr<EnvObservation> Reset(const nlohmann::json& row, uint64_t seed,
                                 std::chrono::steady_clock::time_point) override {
    return reset_(row, seed, state_);
  }
  StatusOr<EnvObservation> Step(const std::string& action,
                                std::chrono::steady_clock::time_point) override {
    return step_(action, state_);
  }
  StatusOr<EnvObservation> StepToolCalls(const std::string& action,
                                         const std::vector<common::ToolCall>& calls,
                                         std::chrono::steady_clock::time_point) override {
    return step_tool_calls_ ? step_tool_calls_(action, calls, state_) : step_(action, state_);
  }

 private:
  const FunctionEnvironment::ResetFn& reset_;  // owned by the environment, which outlives this
  const FunctionEnvironment::StepFn& step_;
  const FunctionEnvironment::StepToolCallsFn& step_tool_calls_;
  nlohmann::json state_;
};

}  // namespace

StatusOr<std::unique_ptr<EnvSession>> FunctionEnvironment::Open() {
  return std::unique_ptr<EnvSession>(
      std::make_unique<FunctionSession>(reset_, step_, step_tool_calls_));
}

}  // namespace grpo::rollout
