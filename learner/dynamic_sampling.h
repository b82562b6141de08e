// DAPO's dynamic sampling (docs/GRPO_SPEC.md "Dynamic sampling"; Yu et al. 2025, "DAPO",
// arXiv 2503.14476, section 3.2; veRL's `algorithm.filter_groups`): a group whose rewards are all
// equal has zero advantage, so it adds nothing to the policy gradient but still costs a share of
// the batch. With `dynamic_sampling`, the learner filters such groups at ingest (the ledger
// records them as FILTERED for their pass: not trained, not lost, not leased again in it) and
// keeps leasing prompts until the generation batch is full of groups with a signal, or until
// `max_num_gen_batches` batches' worth of groups arrived for it; then it trains on what it has.
#pragma once

#include <cstdint>
#include <vector>

#include "common/rollout_types.h"
#include "learner/advantages.h"

namespace grpo::learner {

// |std| at or below this is zero: torch.isclose(std, 0)'s atol, the test of TRL's
// frac_reward_zero_std.
inline constexpr double kZeroRewardStd = 1e-8;

// True when the group has a learning signal, i.e. its advantages are not all zero:
// - sum_then_normalize: the completions' totals sum_k w_k r_k (a null reward counts as 0) have
//   an unbiased std above kZeroRewardStd over the completions that are kept (no +-inf reward)
//   and scorable (some reward not null), of which there must be at least two;
// - normalize_then_sum (GDPO): some reward function has an unbiased std above kZeroRewardStd
//   over its non-null values of the group's kept completions (at least two).
// `reward_weights` empty = all 1.
bool GroupHasSignal(const common::RolloutGroup& group, const std::vector<double>& reward_weights,
                    MultiObjectiveAggregation aggregation);

// What one generation batch cost under dynamic sampling (step metrics
// `dynamic_sampling/groups_filtered`, `dynamic_sampling/num_gen_batches`,
// `dynamic_sampling/short_batch`).
struct BatchFill {
  int64_t groups_filtered = 0;  // filtered since the batch before it was taken
  // Batches' worth of groups that arrived for it (trained + filtered) / batch size, rounded up
  // (veRL's num_gen_batches): 1 when nothing was filtered.
  int64_t num_gen_batches = 1;
  bool short_batch = false;  // it had fewer groups than a generation batch
};

// The count of groups that arrived for the batch being filled. Not thread-safe: the learner's
// lock guards it.
class BatchFillCounter {
 public:
  // batch_groups >= 1; max_num_gen_batches 0 = no limit.
  BatchFillCounter(int64_t batch_groups, int64_t max_num_gen_batches)
      : batch_groups_(batch_groups), max_num_gen_batches_(max_num_gen_batches) {}

  void AddFiltered() { ++filtered_; }
  int64_t filtered() const { return filtered_; }
  // The trainer should take the `buffered` groups now although they are fewer than a batch:
  // max_num_gen_batches batches' worth of groups arrived (buffered + filtered).
  bool ShortBatchDue(int64_t buffered) const;
  // A batch of `taken` groups was taken: what it cost; the count starts again.
  BatchFill Take(int64_t taken);

 private:
  int64_t batch_groups_;
  int64_t max_num_gen_batches_;
  int64_t filtered_ = 0;
};

}  // namespace grpo::learner
