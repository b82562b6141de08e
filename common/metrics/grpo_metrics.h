// The project's metric families, defined in this one place (docs/GRPO_SPEC.md
// "Metrics per optimizer step"). Each process creates one LearnerMetrics or WorkerMetrics
// against its Registry at start-up and updates the families through the pointers, which the
// registry owns (they live as long as it does). Every label takes values from a fixed set below
// or, for `reward_fn`, from the configured reward_funcs.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "common/group_refusal.h"
#include "common/metrics/metrics.h"
#include "common/status.h"

namespace grpo::common {

// Values of `reason` on grpo_groups_rejected_total: the one table of refusal reasons.
inline constexpr const auto& kRejectReasons = kGroupRefusalNames;
// Values of `state` on grpo_ledger_prompts (the prompt ledger's states).
inline constexpr std::array<std::string_view, 5> kLedgerStates = {"queued", "leased", "trained",
                                                                  "rejected", "filtered"};
// Values of `region` on grpo_clip_ratio (docs/GRPO_SPEC.md clip_ratio/{low,high,region}_mean).
inline constexpr std::array<std::string_view, 3> kClipRegions = {"low", "high", "region"};
// Values of `stat` on grpo_logprob_mismatch (StepMetrics logprob_mismatch/{mean,max}).
inline constexpr std::array<std::string_view, 2> kLogprobMismatchStats = {"mean", "max"};
// Values of `kind` on grpo_rollout_reward_errors_total.
inline constexpr std::array<std::string_view, 2> kRewardErrorKinds = {"error", "timeout"};
// How an environment call failed (rollout::EnvErrorKind) and how an episode ended.
inline constexpr std::array<std::string_view, 3> kEnvErrorKinds = {"timeout", "unavailable",
                                                                   "error"};
// common::MalformedToolCallReasonName's values.
inline constexpr std::array<std::string_view, 4> kMalformedToolCallReasons = {
    "not_json", "no_name", "arguments_not_object", "unclosed_tag"};
inline constexpr std::array<std::string_view, 6> kEpisodeEnds = {
    "done", "env_truncated", "max_turns", "length", "error", "stopped"};

// The learner's families. Gauges hold the latest optimizer step's value.
struct LearnerMetrics {
  // InvalidArgument when a reward function name is empty or repeated; AlreadyExists when the
  // registry already holds these families.
  static StatusOr<LearnerMetrics> Create(Registry& registry,
                                         const std::vector<std::string>& reward_funcs);

  // grpo_optimizer_steps_total: steps
  Counter* optimizer_steps = nullptr;
  // grpo_policy_version: version after the latest step
  Gauge* policy_version = nullptr;
  // grpo_loss: unitless
  Gauge* loss = nullptr;
  // grpo_reward_mean: weighted total reward, unitless
  Gauge* reward_mean = nullptr;
  // grpo_reward_std
  Gauge* reward_std = nullptr;
  // grpo_reward_fn_mean{reward_fn}: raw reward of one function
  Gauge* reward_fn_mean = nullptr;
  // grpo_reward_fn_std{reward_fn}
  Gauge* reward_fn_std = nullptr;
  // grpo_reward_zero_std_ratio: fraction of groups, 0..1
  Gauge* reward_zero_std_ratio = nullptr;
  // grpo_completion_mean_length_tokens: tokens
  Gauge* completion_mean_length = nullptr;
  // grpo_completion_clipped_ratio: fraction without EOS, 0..1
  Gauge* completion_clipped_ratio = nullptr;
  // grpo_kl: nats per token (0 when beta is 0)
  Gauge* kl = nullptr;
  // grpo_clip_ratio{region}: fraction of tokens, 0..1
  Gauge* clip_ratio = nullptr;
  // grpo_entropy: nats per token
  Gauge* entropy = nullptr;
  // grpo_is_ratio_mean: importance-sampling ratio
  Gauge* is_ratio_mean = nullptr;
  // grpo_is_ratio_max
  Gauge* is_ratio_max = nullptr;
  // grpo_logprob_mismatch{stat}: |behaviour - old| log-prob over completion tokens, nats
  // (mean or max; 0 until a step whose groups carry behaviour log-probs)
  Gauge* logprob_mismatch = nullptr;
  // grpo_grad_norm: L2 norm before clipping
  Gauge* grad_norm = nullptr;
  // grpo_learning_rate
  Gauge* learning_rate = nullptr;
  // grpo_learner_tokens_per_second: trained tokens / step time
  Gauge* tokens_per_second = nullptr;
  // grpo_step_duration_seconds: one optimizer step
  Histogram* step_duration = nullptr;
  // grpo_buffer_groups: groups waiting to be trained
  Gauge* buffer_groups = nullptr;
  // grpo_staleness_versions: policy versions behind, per group
  Histogram* staleness = nullptr;
  // grpo_groups_accepted_total: groups
  Counter* groups_accepted = nullptr;
  // grpo_groups_rejected_total{reason}: groups
  Counter* groups_rejected = nullptr;
  // grpo_groups_filtered_total: groups dynamic sampling did not train (all rewards equal)
  Counter* groups_filtered = nullptr;
  // grpo_short_batches_total: generation batches trained with fewer groups than a batch, because
  // max_num_gen_batches batches' worth of groups arrived (dynamic sampling)
  Counter* short_batches = nullptr;
  // grpo_ledger_prompts{state}: prompts
  Gauge* ledger_prompts = nullptr;
  // grpo_weight_sync_duration_seconds: one version's sync
  Histogram* weight_sync_duration = nullptr;
  // grpo_weight_sync_bytes_total: bytes sent
  Counter* weight_sync_bytes = nullptr;
  // grpo_checkpoint_duration_seconds: one checkpoint save
  Histogram* checkpoint_duration = nullptr;
  // grpo_checkpoint_failures_total: saves that failed (the previous checkpoint stays valid)
  Counter* checkpoint_failures = nullptr;
  // grpo_ledger_errors_total: ledger updates that failed after training (logged as errors)
  Counter* ledger_errors = nullptr;
  // grpo_peak_memory_bytes: peak resident set (or device memory)
  Gauge* peak_memory = nullptr;
  // grpo_learner_lock_max_hold_seconds: the longest one holder kept the learner's state lock
  // since the process started, in seconds (RPCs that need it wait that long)
  Gauge* lock_max_hold = nullptr;
};

// A rollout worker's families.
struct WorkerMetrics {
  // Same errors as LearnerMetrics::Create.
  static StatusOr<WorkerMetrics> Create(Registry& registry,
                                        const std::vector<std::string>& reward_funcs);

  // grpo_rollout_tokens_generated_total: completion tokens
  Counter* tokens_generated = nullptr;
  // grpo_rollout_generation_duration_seconds: one group
  Histogram* generation_duration = nullptr;
  // grpo_rollout_reward_duration_seconds{reward_fn}: one call
  Histogram* reward_duration = nullptr;
  // grpo_rollout_reward_errors_total{reward_fn,kind}: calls
  Counter* reward_errors = nullptr;
  // grpo_rollout_weight_version: policy version generating now
  Gauge* weight_version = nullptr;
  // grpo_rollout_leases_held: prompt leases
  Gauge* leases_held = nullptr;
  // grpo_rollout_groups_pushed_total: groups
  Counter* groups_pushed = nullptr;
  // grpo_rollout_episodes_total{end}: multi-turn episodes, by how they ended
  Counter* episodes = nullptr;
  // grpo_rollout_episode_turns_total: model turns of multi-turn episodes
  Counter* episode_turns = nullptr;
  // grpo_rollout_env_errors_total{kind}: environment calls (reset, step, open) that failed
  Counter* env_errors = nullptr;
  // grpo_rollout_env_wait_seconds_total: episode loop blocked on the environment, no turn decoding
  Counter* env_wait = nullptr;
  // grpo_rollout_tool_calls_total: <tool_call> blocks in turns of episodes with tools
  Counter* tool_calls = nullptr;
  // grpo_rollout_tool_call_failures_total{reason}: malformed ones, answered by the worker
  Counter* tool_call_failures = nullptr;
};

}  // namespace grpo::common
