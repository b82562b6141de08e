// The checks a pushed rollout group must pass before it is trained on: its shape against the
// run's settings, its token ids against the vocabulary, its rewards and behaviour log-probs, a
// multi-turn completion's env_mask (empty, or one 0/1 per token, the first a policy token) and
// its staleness. Pure (no libtorch): GrpoTrainer::ValidateGroup fills the limits from its config
// and policy, and the wire fuzz target (tests/fuzz/wire_message_fuzz.cc) calls it on whatever
// a client sends.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/group_refusal.h"
#include "common/rollout_types.h"
#include "common/status.h"

namespace grpo::learner {

// The largest |reward| taken: weighted sums, means and variances of a generation batch of such
// rewards stay finite in double (1e15^2 * 1e6 rows is far below DBL_MAX).
inline constexpr double kMaxAbsReward = 1e15;

struct GroupLimits {
  int64_t num_generations = 0;        // completions a group must hold
  int64_t vocab_size = 0;             // token ids in [0, vocab_size)
  int64_t max_completion_length = 0;  // tokens per completion at most
  size_t reward_funcs = 0;            // rewards per completion; 0: as many as the first holds
  int64_t policy_version = 0;         // the learner's, now
  int64_t max_staleness = 0;          // versions a group may lag behind it
};

// OK when `group` can be trained on under `limits`; otherwise InvalidArgument naming the group
// and why, and `*reason` (when given) the refusal's code (one of kGroupSize .. kStale).
Status CheckGroup(const common::RolloutGroup& group, const GroupLimits& limits,
                  common::GroupRefusal* reason = nullptr);

// The tokens of `c` sampled from the policy, the ones trained on and counted as its length: the
// 1s of env_mask, or every token when env_mask is empty (single-turn; no scan).
int64_t ModelTokenCount(const common::Completion& c);

}  // namespace grpo::learner
