// Reward functions scored in-process by rollout workers, and RewardRunner, which applies several
// of them to a group with reward_weights and a deadline per call (docs/GRPO_SPEC.md "Rewards
// and advantages").
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "common/rollout_types.h"
#include "common/status.h"

namespace grpo::rollout {

// Deadline for one reward function call on one group.
inline constexpr std::chrono::milliseconds kDefaultRewardTimeout{30000};
// Calls of one function abandoned at their deadline and still running; at this many, the
// runner stops starting new calls of that function (nulls + errors) until some finish.
inline constexpr int64_t kMaxAbandonedRewardCalls = 4;

struct RewardInput {
  std::string prompt;             // prompt text
  std::string completion;         // completion text
  int64_t completion_tokens = 0;  // completion length in tokens
  nlohmann::json row;             // the dataset row's extra fields (object, or null)
  // Multi-turn episodes (rollout/env/episode.h): the sum of the environment's step rewards (0
  // when it gave none; nullopt for a single-turn group) and its last observation's metadata
  // (null when none).
  std::optional<double> env_reward;
  nlohmann::json env_metadata;
};

// What an episode's environment said, per completion, for RewardRunner::ScoreGroup.
struct EnvFeedback {
  // The episode's summed step rewards (0 when the environment gave none); nullopt = no episode.
  std::optional<double> reward;
  nlohmann::json metadata;  // the last observation's; null = none
};

// How one reward function's call on one group failed. The names are the values of the `kind`
// label of grpo_rollout_reward_errors_total (common::kRewardErrorKinds).
enum class RewardErrorKind {
  kError,    // threw, returned the wrong number of scores, or could not be started
  kTimeout,  // missed a deadline (the runner's, or one of its own such as an RPC deadline), or
             // too many of its earlier calls were still running to start it
};
// "error" or "timeout".
std::string_view RewardErrorKindName(RewardErrorKind kind);

// What a RewardFunction's Score may throw to say which kind of failure it had (e.g. a remote
// function whose RPC missed its deadline: kTimeout). Any other exception is a kError.
class RewardError : public std::runtime_error {
 public:
  RewardError(RewardErrorKind kind, const std::string& what)
      : std::runtime_error(what), kind_(kind) {}
  RewardErrorKind kind() const { return kind_; }

 private:
  RewardErrorKind kind_;
};

// Score may be called from any thread, concurrently; implementations keep no mutable state.
class RewardFunction {
 public:
  virtual ~RewardFunction() = default;
  virtual std::string name() const = 0;
  // One score per input, in order; nullopt = no reward for that sample. May throw:
  // RewardRunner turns an exception into nulls for the group and counts it (a RewardError by
  // its kind, anything else as kError).
  virtual std::vector<std::optional<double>> Score(
      const std::vector<RewardInput>& inputs) const = 0;
};

// Built-ins (options is a JSON object or null; an unknown option or a wrong type is
// InvalidArgument naming the function and the option):
//   accuracy   {}: 1.0 if ExtractFinalAnswer(completion) matches row["answer"] (AnswersMatch),
//              else 0.0 (also when nothing can be extracted); null when the row has no answer.
//              A string answer holding "\boxed{}" or "####" is reduced by ExtractFinalAnswer.
//   format     {"pattern": PCRE2 regex}: 1.0 if the completion matches, else 0.0. Default
//              `^<think>[\s\S]*?</think>\s*<answer>[\s\S]*?</answer>$`. An invalid pattern is
//              InvalidArgument naming the "pattern" option.
//   length     {"target_length": int >= 0 (default 20), "unit": "tokens" (default) | "chars"}:
//              -|target_length - length| (TRL's reward_len example; "chars" counts Unicode code
//              points like Python's len(str), "tokens" uses RewardInput::completion_tokens).
//   json_valid {}: 1.0 if the whole completion parses as JSON (nlohmann), else 0.0.
//   env        {}: the environment's summed step rewards of a multi-turn episode, 0 when it gave
//              none (RewardInput::env_reward); null for single-turn groups.
//   soft_overlong_punishment {"max_completion_len", "soft_punish_cache"}: DAPO's soft overlong
//              punishment, TRL's get_soft_overlong_punishment (rollout/soft_overlong_reward.h).
// Unknown name: InvalidArgument listing the known names.
StatusOr<std::unique_ptr<RewardFunction>> MakeRewardFunction(
    std::string_view name, const nlohmann::json& options = nlohmann::json::object());
std::vector<std::string> BuiltinRewardFunctionNames();

// The final answer in text: the content of the last \boxed{...} (nested braces), else what
// follows the last "####" on its line, else the last number; nullopt when there is none.
std::optional<std::string> ExtractFinalAnswer(std::string_view text);
// A number written as "1,000", "-0.50", "$3", "1/2", "\frac{1}{2}", "42." ...; nullopt otherwise.
std::optional<double> ParseNumber(std::string_view text);
// Both parse as numbers and agree to 1e-6 relative; else equal after normalisation (trim,
// lower-case ASCII, collapse whitespace, strip $...$, \text{...} and a trailing period).
bool AnswersMatch(std::string_view predicted, std::string_view reference);

// What went wrong in one RewardRunner::ScoreGroup call (one entry per failed function).
struct RewardCallReport {
  int64_t errors = 0;                 // failures of kind kError
  int64_t timeouts = 0;               // failures of kind kTimeout
  std::vector<std::string> messages;  // "<fn>: <what>", one per failed function, in order
  // Per function, in order: how its call failed; nullopt when it gave its scores.
  std::vector<std::optional<RewardErrorKind>> error_kinds;
  // Per function, in order: seconds its Score call took, the timeout when it missed the
  // deadline; nullopt when it was not started.
  std::vector<std::optional<double>> seconds;
};

// Applies reward functions to groups. Thread-safe: ScoreGroup may run concurrently.
// Each call of a function runs on its own detached thread and is waited for until the
// deadline. (Not std::async: its future's destructor joins, so a hung function would hang the
// worker.) A call that misses the deadline is abandoned and finishes in the background; it
// holds shared ownership of its function and inputs, never of the runner.
class RewardRunner {
 public:
  // weights: one per function (finite), empty = all 1. InvalidArgument otherwise, or for a
  // null function, or a non-positive timeout.
  static StatusOr<std::unique_ptr<RewardRunner>> Create(
      std::vector<std::shared_ptr<const RewardFunction>> functions,
      std::vector<double> weights = {}, std::chrono::milliseconds timeout = kDefaultRewardTimeout);
  // config.reward_funcs (built-ins by name, options from options_by_name[name]) and
  // config.reward_weights.
  static StatusOr<std::unique_ptr<RewardRunner>> FromConfig(
      const common::GrpoConfig& config,
      const nlohmann::json& options_by_name = nlohmann::json::object(),
      std::chrono::milliseconds timeout = kDefaultRewardTimeout);

  // Scores every completion of `group` (its text and token count) with every function, all
  // functions concurrently, and sets each Completion::rewards to one value per function (in
  // order). A function that throws, returns the wrong number of scores or misses the deadline
  // gives nullopt for the whole group and is counted, by its RewardErrorKind, in the report and
  // the totals. Never throws.
  // `env`: per completion, the feedback of its episode's environment (empty: none).
  // RewardInput::completion_tokens counts the model's tokens only (Completion::env_mask).
  RewardCallReport ScoreGroup(common::RolloutGroup& group, const std::string& prompt_text,
                              const nlohmann::json& row,
                              const std::vector<EnvFeedback>& env = {}) const;

  // sum_k w_k * rewards[k], nulls as 0 (docs/GRPO_SPEC.md).
  double WeightedReward(const common::Completion& completion) const;

  std::vector<std::string> names() const;
  const std::vector<double>& weights() const { return weights_; }
  int64_t total_errors() const { return errors_->load(); }
  int64_t total_timeouts() const { return timeouts_->load(); }
  // Abandoned calls still running, over all functions.
  int64_t abandoned_in_flight() const;

 private:
  RewardRunner(std::vector<std::shared_ptr<const RewardFunction>> functions,
               std::vector<double> weights, std::chrono::milliseconds timeout);

  const std::vector<std::shared_ptr<const RewardFunction>> functions_;
  const std::vector<double> weights_;
  const std::chrono::milliseconds timeout_;
  // Per function: calls abandoned at their deadline and still running (shared with the calls'
  // threads, which decrement it when they finish).
  std::vector<std::shared_ptr<std::atomic<int64_t>>> abandoned_;
  std::shared_ptr<std::atomic<int64_t>> errors_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> timeouts_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace grpo::rollout
