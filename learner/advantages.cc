#include "learner/advantages.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

namespace grpo::learner {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Unbiased std of values (torch's std()); 0 when fewer than two values.
double UnbiasedStd(const std::vector<double>& values, double mean) {
  if (values.size() < 2) return 0.0;
  double ss = 0.0;
  for (double v : values) ss += (v - mean) * (v - mean);
  return std::sqrt(ss / static_cast<double>(values.size() - 1));
}

double Mean(const std::vector<double>& values) {
  double s = 0.0;
  for (double v : values) s += v;
  return values.empty() ? 0.0 : s / static_cast<double>(values.size());
}

Status CheckRewards(const at::Tensor& rewards_per_fn, const AdvantageConfig& config) {
  if (!rewards_per_fn.defined() || rewards_per_fn.dim() != 2) {
    return Status::InvalidArgument("rewards_per_fn must be a [N, K] tensor");
  }
  if (!at::isFloatingType(rewards_per_fn.scalar_type())) {
    return Status::InvalidArgument("rewards_per_fn must be floating point");
  }
  const int64_t n = rewards_per_fn.size(0);
  const int64_t k = rewards_per_fn.size(1);
  if (n == 0 || k == 0) return Status::InvalidArgument("rewards_per_fn is empty");
  if (!config.reward_weights.empty() && static_cast<int64_t>(config.reward_weights.size()) != k) {
    return Status::InvalidArgument(
        "reward_weights has " + std::to_string(config.reward_weights.size()) +
        " entries but there are " + std::to_string(k) + " reward functions");
  }
  for (double w : config.reward_weights) {
    if (!std::isfinite(w)) return Status::InvalidArgument("reward_weights must be finite");
  }
  return Status::OK();
}

// GDPO's advantages (TRL's normalize_then_sum, grpo_trainer.py _generate_and_score_completions):
// per function k and group g, z = (r - nanmean) / (nanstd + 1e-4), a std of fewer than two
// values being NaN (then z is NaN, and nansum skips it); s_i = nansum_k w_k z_ik; then
// A = (s - mean) / (std + 1e-4) over the scorable kept samples, 0 where that is NaN. Writes
// *batch_std (NaN with fewer than two samples) for frac_reward_zero_std.
void NormalizeThenSum(const double* rp, int64_t n, int64_t k, const std::vector<double>& weights,
                      const std::vector<int64_t>& group, int64_t num_groups,
                      const std::vector<bool>& usable, double* adv, double* batch_std) {
  std::vector<double> sum(n, 0.0);
  for (int64_t j = 0; j < k; ++j) {
    std::vector<std::vector<double>> vals(num_groups);
    for (int64_t i = 0; i < n; ++i) {
      if (usable[i] && !std::isnan(rp[i * k + j])) vals[group[i]].push_back(rp[i * k + j]);
    }
    std::vector<double> mean(num_groups), std(num_groups);
    for (int64_t g = 0; g < num_groups; ++g) {
      mean[g] = vals[g].empty() ? kNaN : Mean(vals[g]);
      std[g] = vals[g].size() < 2 ? kNaN : UnbiasedStd(vals[g], mean[g]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const double z = (rp[i * k + j] - mean[group[i]]) / (std[group[i]] + kAdvantageStdEpsilon);
      if (usable[i] && !std::isnan(z)) sum[i] += weights[j] * z;
    }
  }
  std::vector<double> scored;
  for (int64_t i = 0; i < n; ++i) {
    if (usable[i]) scored.push_back(sum[i]);
  }
  const double mean = Mean(scored);
  *batch_std = scored.size() < 2 ? kNaN : UnbiasedStd(scored, mean);
  for (int64_t i = 0; i < n; ++i) {
    const double a = (sum[i] - mean) / (*batch_std + kAdvantageStdEpsilon);
    adv[i] = usable[i] && !std::isnan(a) ? a : 0.0;
  }
}

// group[i] in [0, num_groups) for every row.
StatusOr<AdvantageResult> Compute(const at::Tensor& rewards_per_fn,
                                  const std::vector<int64_t>& group, int64_t num_groups,
                                  const AdvantageConfig& config) {
  const at::Tensor r = rewards_per_fn.detach().to(at::kCPU, at::kDouble).contiguous();
  const int64_t n = r.size(0);
  const int64_t k = r.size(1);
  const double* rp = r.data_ptr<double>();
  std::vector<double> weights = config.reward_weights;
  if (weights.empty()) weights.assign(k, 1.0);

  AdvantageResult out;
  at::Tensor rewards = at::zeros({n}, at::kDouble);
  at::Tensor advantages = at::zeros({n}, at::kDouble);
  at::Tensor keep = at::ones({n}, at::kBool);
  double* rew = rewards.data_ptr<double>();
  double* adv = advantages.data_ptr<double>();
  bool* kp = keep.data_ptr<bool>();

  // Combine: nansum over functions; any +-inf drops the sample. A sample whose every function
  // returned null is unscorable (TRL's PR 5902): its reward is NaN, it is left out of every
  // statistic below and its advantage is 0.
  std::vector<bool> scorable(n, false);
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      const double v = rp[i * k + j];
      if (std::isnan(v)) continue;
      if (std::isinf(v)) {
        kp[i] = false;
        break;
      }
      scorable[i] = true;
      sum += weights[j] * v;
    }
    if (!kp[i]) {
      ++out.num_dropped;
    } else if (scorable[i]) {
      rew[i] = sum;
    } else {
      rew[i] = kNaN;
      ++out.num_unscorable;
    }
  }

  // Group statistics over kept rows.
  std::vector<std::vector<double>> members(num_groups);
  std::vector<double> kept_rewards;
  for (int64_t i = 0; i < n; ++i) {
    if (!kp[i] || !scorable[i]) continue;
    members[group[i]].push_back(rew[i]);
    kept_rewards.push_back(rew[i]);
  }
  std::vector<double> g_mean(num_groups, 0.0), g_std(num_groups, 0.0);
  std::vector<bool> g_all_equal(num_groups, true);
  int64_t groups_present = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const auto& m = members[g];
    if (m.empty()) continue;
    ++groups_present;
    g_mean[g] = Mean(m);
    g_std[g] = UnbiasedStd(m, g_mean[g]);
    const auto [lo, hi] = std::minmax_element(m.begin(), m.end());
    g_all_equal[g] = (*lo == *hi);
  }
  const double batch_mean = Mean(kept_rewards);
  const double batch_std = UnbiasedStd(kept_rewards, batch_mean);
  // TRL's frac_reward_zero_std: the share of all samples whose std (their group's, or the
  // batch's with scale_rewards batch) is torch.isclose to 0 (|std| <= 1e-8). A std of fewer
  // than two scored samples is NaN there (nanstd), never zero.
  auto zero_std = [](size_t count, double std) { return count >= 2 && std <= 1e-8; };
  int64_t samples_zero_std = 0;
  if (config.multi_objective_aggregation == MultiObjectiveAggregation::kNormalizeThenSum) {
    std::vector<bool> usable(n);
    for (int64_t i = 0; i < n; ++i) usable[i] = kp[i] && scorable[i];
    double gdpo_std = kNaN;
    NormalizeThenSum(rp, n, k, weights, group, num_groups, usable, adv, &gdpo_std);
    samples_zero_std = std::abs(gdpo_std) <= 1e-8 ? n : 0;  // NaN: never
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = group[i];
      samples_zero_std += config.scale_rewards == ScaleRewards::kBatch
                              ? zero_std(kept_rewards.size(), batch_std)
                              : zero_std(members[g].size(), g_std[g]);
    }
  }

  for (int64_t i = 0; i < n; ++i) {
    if (config.multi_objective_aggregation == MultiObjectiveAggregation::kNormalizeThenSum) break;
    if (!kp[i] || !scorable[i]) continue;
    const int64_t g = group[i];
    const double scale_std = config.scale_rewards == ScaleRewards::kBatch ? batch_std : g_std[g];
    if (g_all_equal[g]) continue;  // A = 0 exactly (docs/GRPO_SPEC.md)
    double a = rew[i] - g_mean[g];
    if (config.scale_rewards != ScaleRewards::kNone) a /= scale_std + kAdvantageStdEpsilon;
    adv[i] = a;
  }

  const int64_t scored = static_cast<int64_t>(kept_rewards.size());
  out.num_groups = groups_present;
  // TRL logs the std of the whole batch's rewards (its PR 4785), not the mean of group stds.
  out.reward_mean = scored > 0 ? batch_mean : kNaN;
  out.reward_std = scored > 1 ? batch_std : kNaN;
  out.frac_reward_zero_std =
      n > 0 ? static_cast<double>(samples_zero_std) / static_cast<double>(n) : kNaN;

  for (int64_t j = 0; j < k; ++j) {
    std::vector<double> vals;
    for (int64_t i = 0; i < n; ++i) {
      const double v = rp[i * k + j];
      if (kp[i] && !std::isnan(v)) vals.push_back(v);
    }
    const double mean = vals.empty() ? kNaN : Mean(vals);
    out.reward_fn_mean.push_back(mean);
    out.reward_fn_std.push_back(vals.size() < 2 ? kNaN : UnbiasedStd(vals, mean));
  }

  out.rewards = rewards;
  out.advantages = advantages;
  out.keep = keep;
  return out;
}

}  // namespace

StatusOr<MultiObjectiveAggregation> ParseMultiObjectiveAggregation(std::string_view name) {
  if (name == "sum_then_normalize") return MultiObjectiveAggregation::kSumThenNormalize;
  if (name == "normalize_then_sum") return MultiObjectiveAggregation::kNormalizeThenSum;
  return Status::InvalidArgument("unknown multi_objective_aggregation '" + std::string(name) +
                                 "' (expected sum_then_normalize|normalize_then_sum)");
}

StatusOr<ScaleRewards> ParseScaleRewards(std::string_view name) {
  if (name == "group") return ScaleRewards::kGroup;
  if (name == "batch") return ScaleRewards::kBatch;
  if (name == "none") return ScaleRewards::kNone;
  return Status::InvalidArgument("unknown scale_rewards '" + std::string(name) +
                                 "' (expected group|batch|none)");
}

std::string_view ScaleRewardsName(ScaleRewards s) {
  switch (s) {
    case ScaleRewards::kGroup:
      return "group";
    case ScaleRewards::kBatch:
      return "batch";
    case ScaleRewards::kNone:
      return "none";
  }
  return "unknown";
}

StatusOr<AdvantageResult> ComputeAdvantages(const at::Tensor& rewards_per_fn,
                                            const AdvantageConfig& config) {
  RETURN_IF_ERROR(CheckRewards(rewards_per_fn, config));
  const int64_t n = rewards_per_fn.size(0);
  const int64_t g = config.num_generations;
  if (g < 1) return Status::InvalidArgument("num_generations must be >= 1");
  if (n % g != 0) {
    return Status::InvalidArgument("batch of " + std::to_string(n) +
                                   " samples is not a multiple of num_generations " +
                                   std::to_string(g));
  }
  std::vector<int64_t> group(n);
  for (int64_t i = 0; i < n; ++i) group[i] = i / g;
  return Compute(rewards_per_fn, group, n / g, config);
}

StatusOr<AdvantageResult> ComputeAdvantages(const at::Tensor& rewards_per_fn,
                                            const at::Tensor& group_ids,
                                            const AdvantageConfig& config) {
  RETURN_IF_ERROR(CheckRewards(rewards_per_fn, config));
  const int64_t n = rewards_per_fn.size(0);
  if (!group_ids.defined() || group_ids.dim() != 1 || group_ids.size(0) != n ||
      !at::isIntegralType(group_ids.scalar_type(), /*includeBool=*/false)) {
    return Status::InvalidArgument("group_ids must be an integer [N] tensor with N = " +
                                   std::to_string(n));
  }
  const at::Tensor ids = group_ids.to(at::kCPU, at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::map<int64_t, int64_t> index;
  std::vector<int64_t> group(n);
  for (int64_t i = 0; i < n; ++i) {
    auto [it, inserted] = index.emplace(ip[i], static_cast<int64_t>(index.size()));
    group[i] = it->second;
  }
  return Compute(rewards_per_fn, group, static_cast<int64_t>(index.size()), config);
}

}  // namespace grpo::learner
