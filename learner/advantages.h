// Rewards and group-relative advantages (docs/GRPO_SPEC.md "Rewards and advantages").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace grpo::learner {

// TRL `scale_rewards`.
enum class ScaleRewards {
  kGroup,  // divide by the group's unbiased std + 1e-4 (default)
  kBatch,  // divide by the whole generation batch's unbiased std + 1e-4
  kNone,   // no division (Dr. GRPO)
};

// "group" | "batch" | "none"; InvalidArgument naming the value otherwise.
StatusOr<ScaleRewards> ParseScaleRewards(std::string_view name);
std::string_view ScaleRewardsName(ScaleRewards s);

// Added to the std before dividing (docs/GRPO_SPEC.md, TRL).
inline constexpr double kAdvantageStdEpsilon = 1e-4;

// TRL `multi_objective_aggregation`: how several reward functions become one advantage.
enum class MultiObjectiveAggregation {
  kSumThenNormalize,  // the weighted sum, then group-relative by scale_rewards (default)
  // GDPO (arXiv 2601.05242): each function normalised within its group
  // ((r_k - mean_group) / (std_group + 1e-4), NaN-aware), the weighted sum of those, then
  // normalised over the whole batch ((s - mean) / (std + 1e-4)); scale_rewards is not used.
  kNormalizeThenSum,
};
StatusOr<MultiObjectiveAggregation> ParseMultiObjectiveAggregation(std::string_view name);

struct AdvantageConfig {
  int64_t num_generations = 8;  // G: consecutive rows form a group (ignored with explicit ids)
  ScaleRewards scale_rewards = ScaleRewards::kGroup;
  std::vector<double> reward_weights{};  // one per reward function; empty = all 1
  MultiObjectiveAggregation multi_objective_aggregation =
      MultiObjectiveAggregation::kSumThenNormalize;
};

// Everything is computed over the kept, scorable samples only (a sample is unscorable when every
// reward function returned null: TRL's PR 5902). A group with fewer than two such samples has
// std 0 (its advantages are 0). Groups whose kept rewards are all equal have A = 0 exactly
// (sum_then_normalize; normalize_then_sum is TRL's formula throughout).
struct AdvantageResult {
  at::Tensor rewards;     // [N] float64: sum_k w_k r_{i,k}, nulls as 0; 0 for dropped samples,
                          // NaN for unscorable ones
  at::Tensor advantages;  // [N] float64; 0 for dropped and unscorable samples
  at::Tensor keep;        // [N] bool: false where some reward was +-inf (sample dropped)
  int64_t num_dropped = 0;
  int64_t num_unscorable = 0;  // kept samples whose every reward function returned null
  int64_t num_groups = 0;      // groups with at least one kept sample
  // TRL metric names in comments. Means/stds over kept samples.
  double reward_mean = 0.0;  // `reward`
  double reward_std = 0.0;   // `reward_std`: unbiased std of the batch's rewards (TRL
                             // since its PR 4785); NaN with fewer than two
  // TRL's `frac_reward_zero_std`: the share of samples whose group's std (the batch's with
  // scale_rewards batch) is 0; a group of fewer than two scored samples has no std (TRL: NaN).
  double frac_reward_zero_std = 0.0;
  // Per reward function, over kept samples with a non-null value (TRL nanmean / nanstd):
  std::vector<double> reward_fn_mean;  // `rewards/<fn>/mean`; NaN when no value at all
  std::vector<double> reward_fn_std;   // `rewards/<fn>/std`, unbiased; NaN when < 2 values
};

// rewards_per_fn: [N, K] floating, NaN = the function returned no reward (counts as 0),
// +-inf = invalid sample (dropped, counted). Groups are consecutive blocks of
// config.num_generations rows. InvalidArgument on a bad shape, N % G != 0, a weights length
// other than K, or non-finite weights.
StatusOr<AdvantageResult> ComputeAdvantages(const at::Tensor& rewards_per_fn,
                                            const AdvantageConfig& config);

// As above, with explicit group ids: group_ids [N] integer, rows with the same id form a group
// (any order, any sizes); config.num_generations is not used.
StatusOr<AdvantageResult> ComputeAdvantages(const at::Tensor& rewards_per_fn,
                                            const at::Tensor& group_ids,
                                            const AdvantageConfig& config);

}  // namespace grpo::learner
