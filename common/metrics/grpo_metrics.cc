#include "common/metrics/grpo_metrics.h"

#include <set>
#include <utility>

namespace grpo::common {
namespace {

template <size_t N>
LabelSpec Label(std::string name, const std::array<std::string_view, N>& values) {
  return LabelSpec{std::move(name), std::vector<std::string>(values.begin(), values.end())};
}

StatusOr<LabelSpec> RewardFnLabel(const std::vector<std::string>& reward_funcs) {
  std::set<std::string> seen;
  for (const std::string& f : reward_funcs) {
    if (f.empty() || !seen.insert(f).second) {
      return Status::InvalidArgument("reward_funcs: empty or repeated name \"" + f + "\"");
    }
  }
  return LabelSpec{"reward_fn", reward_funcs};
}

// Bucket bounds, in the family's unit.
const std::vector<double> kStepSecondsBuckets = {0.05, 0.1, 0.25, 0.5, 1,   2.5, 5,
                                                 10,   30,  60,   120, 300, 600};
const std::vector<double> kStalenessBuckets = {0, 1, 2, 3, 4, 6, 8, 12, 16, 32};
const std::vector<double> kWeightSyncSecondsBuckets = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                       2.5,  5,     10,   30,  60,   120};
const std::vector<double> kCheckpointSecondsBuckets = {0.1, 0.25, 0.5, 1,   2.5, 5,
                                                       10,  30,   60,  120, 300, 600};
const std::vector<double> kGenerationSecondsBuckets = {0.05, 0.1, 0.25, 0.5, 1,   2.5,
                                                       5,    10,  30,   60,  120, 300};
const std::vector<double> kRewardSecondsBuckets = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05,
                                                   0.1,    0.5,    1,     5,     10,   30};

}  // namespace

StatusOr<LearnerMetrics> LearnerMetrics::Create(Registry& r,
                                                const std::vector<std::string>& reward_funcs) {
  ASSIGN_OR_RETURN(LabelSpec reward_fn, RewardFnLabel(reward_funcs));
  LearnerMetrics m;
  ASSIGN_OR_RETURN(m.optimizer_steps,
                   r.AddCounter("grpo_optimizer_steps_total", "Optimizer steps taken, in steps."));
  ASSIGN_OR_RETURN(m.policy_version,
                   r.AddGauge("grpo_policy_version",
                              "Policy version after the latest optimizer step, a step count."));
  ASSIGN_OR_RETURN(m.loss, r.AddGauge("grpo_loss", "GRPO loss of the latest step, unitless."));
  ASSIGN_OR_RETURN(
      m.reward_mean,
      r.AddGauge("grpo_reward_mean", "Mean weighted total reward of the latest step, unitless."));
  ASSIGN_OR_RETURN(
      m.reward_std,
      r.AddGauge("grpo_reward_std", "Standard deviation of the weighted total reward, unitless."));
  ASSIGN_OR_RETURN(
      m.reward_fn_mean,
      r.AddGauge("grpo_reward_fn_mean", "Mean unweighted reward of one reward function, unitless.",
                 {reward_fn}));
  ASSIGN_OR_RETURN(
      m.reward_fn_std,
      r.AddGauge("grpo_reward_fn_std",
                 "Standard deviation of one reward function's reward, unitless.", {reward_fn}));
  ASSIGN_OR_RETURN(m.reward_zero_std_ratio,
                   r.AddGauge("grpo_reward_zero_std_ratio",
                              "Fraction (0-1) of groups whose rewards all tie (no signal)."));
  ASSIGN_OR_RETURN(m.completion_mean_length,
                   r.AddGauge("grpo_completion_mean_length_tokens",
                              "Mean completion length of the latest step, in tokens."));
  ASSIGN_OR_RETURN(m.completion_clipped_ratio,
                   r.AddGauge("grpo_completion_clipped_ratio",
                              "Fraction (0-1) of completions cut at max_completion_length."));
  ASSIGN_OR_RETURN(m.kl, r.AddGauge("grpo_kl",
                                    "Mean KL to the reference model, nats per token (0 when "
                                    "beta is 0)."));
  ASSIGN_OR_RETURN(
      m.clip_ratio,
      r.AddGauge("grpo_clip_ratio", "Fraction (0-1) of completion tokens clipped, by region.",
                 {Label("region", kClipRegions)}));
  ASSIGN_OR_RETURN(m.entropy, r.AddGauge("grpo_entropy",
                                         "Mean policy entropy over completion tokens, in nats."));
  ASSIGN_OR_RETURN(m.is_ratio_mean,
                   r.AddGauge("grpo_is_ratio_mean",
                              "Mean importance-sampling ratio policy/behaviour, unitless."));
  ASSIGN_OR_RETURN(m.is_ratio_max,
                   r.AddGauge("grpo_is_ratio_max",
                              "Largest importance-sampling ratio policy/behaviour, unitless."));
  ASSIGN_OR_RETURN(m.logprob_mismatch,
                   r.AddGauge("grpo_logprob_mismatch",
                              "Mean or max over completion tokens of |behaviour - old| log-prob "
                              "(worker vs learner), in nats.",
                              {Label("stat", kLogprobMismatchStats)}));
  ASSIGN_OR_RETURN(m.grad_norm, r.AddGauge("grpo_grad_norm",
                                           "L2 norm of the gradient before clipping, unitless."));
  ASSIGN_OR_RETURN(m.learning_rate,
                   r.AddGauge("grpo_learning_rate", "Learning rate of the latest step."));
  ASSIGN_OR_RETURN(m.tokens_per_second,
                   r.AddGauge("grpo_learner_tokens_per_second",
                              "Trained completion tokens per second of the latest step."));
  ASSIGN_OR_RETURN(m.step_duration, r.AddHistogram("grpo_step_duration_seconds",
                                                   "Wall time of one optimizer step, in seconds.",
                                                   kStepSecondsBuckets));
  ASSIGN_OR_RETURN(
      m.buffer_groups,
      r.AddGauge("grpo_buffer_groups", "Rollout groups buffered for the next generation batch."));
  ASSIGN_OR_RETURN(m.staleness,
                   r.AddHistogram("grpo_staleness_versions",
                                  "Policy versions between a group's generation and its "
                                  "training, in versions.",
                                  kStalenessBuckets));
  ASSIGN_OR_RETURN(m.groups_accepted,
                   r.AddCounter("grpo_groups_accepted_total",
                                "Rollout groups accepted for training, in groups."));
  ASSIGN_OR_RETURN(m.groups_rejected,
                   r.AddCounter("grpo_groups_rejected_total",
                                "Rollout groups refused at ingest, in groups, by reason.",
                                {Label("reason", kRejectReasons)}));
  ASSIGN_OR_RETURN(m.groups_filtered,
                   r.AddCounter("grpo_groups_filtered_total",
                                "Rollout groups received but not trained because their rewards "
                                "were all equal (dynamic sampling), in groups."));
  ASSIGN_OR_RETURN(m.short_batches,
                   r.AddCounter("grpo_short_batches_total",
                                "Generation batches trained short of a full batch after "
                                "max_num_gen_batches batches' worth of groups (dynamic "
                                "sampling), in batches."));
  ASSIGN_OR_RETURN(m.ledger_prompts,
                   r.AddGauge("grpo_ledger_prompts", "Prompts in the ledger, by state.",
                              {Label("state", kLedgerStates)}));
  ASSIGN_OR_RETURN(m.weight_sync_duration,
                   r.AddHistogram("grpo_weight_sync_duration_seconds",
                                  "Wall time to publish one policy version to the workers, in "
                                  "seconds.",
                                  kWeightSyncSecondsBuckets));
  ASSIGN_OR_RETURN(
      m.weight_sync_bytes,
      r.AddCounter("grpo_weight_sync_bytes_total", "Weight bytes sent to the workers, in bytes."));
  ASSIGN_OR_RETURN(
      m.checkpoint_duration,
      r.AddHistogram("grpo_checkpoint_duration_seconds",
                     "Wall time to write one checkpoint, in seconds.", kCheckpointSecondsBuckets));
  ASSIGN_OR_RETURN(m.checkpoint_failures,
                   r.AddCounter("grpo_checkpoint_failures_total",
                                "Checkpoint saves that failed, in saves (the previous checkpoint "
                                "stays the one a restart uses)."));
  ASSIGN_OR_RETURN(m.ledger_errors,
                   r.AddCounter("grpo_ledger_errors_total",
                                "Ledger updates after training that failed, in updates."));
  ASSIGN_OR_RETURN(m.peak_memory, r.AddGauge("grpo_peak_memory_bytes",
                                             "Peak memory of the learner process, in bytes."));
  ASSIGN_OR_RETURN(m.lock_max_hold,
                   r.AddGauge("grpo_learner_lock_max_hold_seconds",
                              "The longest time one holder kept the learner's state lock since "
                              "the process started, in seconds."));
  return m;
}

StatusOr<WorkerMetrics> WorkerMetrics::Create(Registry& r,
                                              const std::vector<std::string>& reward_funcs) {
  ASSIGN_OR_RETURN(LabelSpec reward_fn, RewardFnLabel(reward_funcs));
  WorkerMetrics m;
  ASSIGN_OR_RETURN(m.tokens_generated, r.AddCounter("grpo_rollout_tokens_generated_total",
                                                    "Completion tokens generated, in tokens."));
  ASSIGN_OR_RETURN(m.generation_duration,
                   r.AddHistogram("grpo_rollout_generation_duration_seconds",
                                  "Wall time to generate one group's completions, in seconds.",
                                  kGenerationSecondsBuckets));
  ASSIGN_OR_RETURN(m.reward_duration,
                   r.AddHistogram("grpo_rollout_reward_duration_seconds",
                                  "Wall time of one reward function call on one group, in "
                                  "seconds.",
                                  kRewardSecondsBuckets, {reward_fn}));
  ASSIGN_OR_RETURN(m.reward_errors,
                   r.AddCounter("grpo_rollout_reward_errors_total",
                                "Reward function calls that failed or timed out, in calls.",
                                {reward_fn, Label("kind", kRewardErrorKinds)}));
  ASSIGN_OR_RETURN(m.weight_version,
                   r.AddGauge("grpo_rollout_weight_version",
                              "Policy version the worker generates with, a step count."));
  ASSIGN_OR_RETURN(m.leases_held,
                   r.AddGauge("grpo_rollout_leases_held", "Prompt leases the worker holds."));
  ASSIGN_OR_RETURN(m.groups_pushed,
                   r.AddCounter("grpo_rollout_groups_pushed_total",
                                "Rollout groups pushed to the learner, in groups."));
  ASSIGN_OR_RETURN(m.episodes, r.AddCounter("grpo_rollout_episodes_total",
                                            "Multi-turn episodes by how they ended, in episodes.",
                                            {Label("end", kEpisodeEnds)}));
  ASSIGN_OR_RETURN(m.episode_turns, r.AddCounter("grpo_rollout_episode_turns_total",
                                                 "Model turns of multi-turn episodes, in turns."));
  ASSIGN_OR_RETURN(m.env_errors, r.AddCounter("grpo_rollout_env_errors_total",
                                              "Environment calls that failed, by kind, in calls.",
                                              {Label("kind", kEnvErrorKinds)}));
  ASSIGN_OR_RETURN(m.env_wait,
                   r.AddCounter("grpo_rollout_env_wait_seconds_total",
                                "Time the multi-turn episode loop was blocked on the environment "
                                "(resets, steps) with no turn decoding, in seconds."));
  ASSIGN_OR_RETURN(m.tool_calls,
                   r.AddCounter("grpo_rollout_tool_calls_total",
                                "Tool call blocks in the turns of episodes whose environment "
                                "declared tools, in calls."));
  ASSIGN_OR_RETURN(m.tool_call_failures,
                   r.AddCounter("grpo_rollout_tool_call_failures_total",
                                "Malformed tool call blocks, answered with an error observation, "
                                "in calls.",
                                {Label("reason", kMalformedToolCallReasons)}));
  return m;
}

}  // namespace grpo::common
