#include "learner/dynamic_sampling.h"

#include <algorithm>
#include <cmath>

namespace grpo::learner {
namespace {

// Unbiased std above kZeroRewardStd, over at least two values.
bool Varies(const std::vector<double>& values) {
  if (values.size() < 2) return false;
  double mean = 0.0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(values.size());
  double ss = 0.0;
  for (double v : values) ss += (v - mean) * (v - mean);
  return std::sqrt(ss / static_cast<double>(values.size() - 1)) > kZeroRewardStd;
}

bool Kept(const common::Completion& c) {
  return std::none_of(c.rewards.begin(), c.rewards.end(),
                      [](const std::optional<double>& r) { return r && std::isinf(*r); });
}

}  // namespace

bool GroupHasSignal(const common::RolloutGroup& group, const std::vector<double>& reward_weights,
                    MultiObjectiveAggregation aggregation) {
  const auto weight = [&](size_t k) { return k < reward_weights.size() ? reward_weights[k] : 1.0; };
  size_t functions = 0;
  for (const auto& c : group.completions) functions = std::max(functions, c.rewards.size());
  if (aggregation == MultiObjectiveAggregation::kNormalizeThenSum) {
    for (size_t k = 0; k < functions; ++k) {
      std::vector<double> values;
      for (const auto& c : group.completions) {
        if (Kept(c) && k < c.rewards.size() && c.rewards[k]) values.push_back(*c.rewards[k]);
      }
      if (Varies(values)) return true;
    }
    return false;
  }
  std::vector<double> totals;
  for (const auto& c : group.completions) {
    if (!Kept(c)) continue;
    double total = 0.0;
    bool scored = false;
    for (size_t k = 0; k < c.rewards.size(); ++k) {
      if (!c.rewards[k]) continue;
      total += weight(k) * *c.rewards[k];
      scored = true;
    }
    if (scored) totals.push_back(total);
  }
  return Varies(totals);
}

bool BatchFillCounter::ShortBatchDue(int64_t buffered) const {
  return max_num_gen_batches_ > 0 && buffered > 0 && buffered < batch_groups_ &&
         buffered + filtered_ >= max_num_gen_batches_ * batch_groups_;
}

BatchFill BatchFillCounter::Take(int64_t taken) {
  BatchFill fill;
  fill.groups_filtered = filtered_;
  fill.num_gen_batches =
      std::max<int64_t>(1, (taken + filtered_ + batch_groups_ - 1) / batch_groups_);
  fill.short_batch = taken < batch_groups_;
  filtered_ = 0;
  return fill;
}

}  // namespace grpo::learner
