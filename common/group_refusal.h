// Why the learner refused a pushed rollout group: the one table of the reasons. The trainer's
// validation (learner::RejectReason is this enum), the learner's ingest policy (Learner::Refuse),
// the label set of grpo_groups_rejected_total{reason} and the worker (which reacts to
// unknown_policy) all read it, so a reason is spelled once. Header only; pure.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

namespace grpo::common {

enum class GroupRefusal {
  // GrpoTrainer::ValidateGroup: the group itself.
  kGroupSize,          // not num_generations completions
  kEmptyPrompt,        //
  kEmptyCompletion,    //
  kCompletionTooLong,  // longer than max_completion_length
  kEnvMask,            // env_mask neither empty nor one 0/1 per token, or no token is 1
  kToolCounts,         // negative tool counts, more failures than calls, or counts without tools
  kTokenVersions,      // token_versions neither empty nor one non-decreasing version per token
                       // in [policy_version, the learner's version]
  kTokenOutOfVocab,    //
  kLogprobLength,      // behaviour log-probs not one per completion token
  kRewardCount,        // not one reward per reward function
  kNonFiniteReward,    // NaN or +-inf reward (null is fine: it counts as 0)
  kRewardOutOfRange,   // |reward| > learner::kMaxAbsReward
  kStale,              // policy_version older than max_staleness allows
  // The prompt ledger: the lease it names.
  kUnknownLease,
  kExpiredLease,
  // The learner: its state, or weights it did not publish.
  kJobEnded,
  kLedgerError,
  kBufferFull,
  kUnknownPolicy,  // another learner incarnation's weights, or a version above its own
  kLearnerStopping,
  // The worker could not generate the group (RolloutGroup::failure): it gives the lease back, or
  // the prompt itself failed (RolloutGroup::prompt_failed; the prompt is rejected).
  kWorkerFailed,
  kPromptFailed,
};

// Indexed by GroupRefusal: the metric's label values and the PushReply's reason keys.
inline constexpr std::array<std::string_view, 22> kGroupRefusalNames = {
    "group_size",     "empty_prompt",  "empty_completion",  "completion_too_long",
    "env_mask",       "tool_counts",   "token_versions",    "token_out_of_vocab",
    "logprob_length", "reward_count",  "non_finite_reward", "reward_out_of_range",
    "stale",          "unknown_lease", "expired_lease",     "job_ended",
    "ledger_error",   "buffer_full",   "unknown_policy",    "learner_stopping",
    "worker_failed",  "prompt_failed"};
static_assert(static_cast<size_t>(GroupRefusal::kPromptFailed) + 1 == kGroupRefusalNames.size(),
              "one name per GroupRefusal, in its order");

constexpr std::string_view GroupRefusalName(GroupRefusal reason) {
  return kGroupRefusalNames[static_cast<size_t>(reason)];
}

}  // namespace grpo::common
