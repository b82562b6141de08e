// Advantages and the GRPO loss against hand-computed numbers and against tests/reference/
// grpo_ref.py, an independent PyTorch transcription of docs/GRPO_SPEC.md; and the property that one
// optimizer step's gradient does not depend on its micro-batch split.
#include "learner/grpo_loss.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "learner/advantages.h"
#include "learner/chunked_logprobs.h"
#include "tests/learner/tensor_json.h"
#include "tests/test_util.h"

namespace grpo::learner {
namespace {

using nlohmann::json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

at::Tensor D(const std::vector<double>& v) { return at::tensor(v, at::dtype(at::kDouble)); }
at::Tensor D2(const std::vector<std::vector<double>>& rows) {
  std::vector<at::Tensor> r;
  for (const auto& row : rows) r.push_back(D(row));
  return at::stack(r);
}

using grpo::testing::ToJson;

double FromJson(const json& j) { return j.is_null() ? kNaN : j.get<double>(); }

// ---------------------------------------------------------------- advantages, by hand

TEST(Advantages, GroupStdOfOneZeroZeroOne) {
  // mean 0.5, unbiased std sqrt(1/3): A = +-0.5 / (sqrt(1/3) + 1e-4).
  auto r = ComputeAdvantages(D2({{1}, {0}, {0}, {1}}), {.num_generations = 4});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const double a = 0.5 / (std::sqrt(1.0 / 3.0) + 1e-4);
  const std::vector<double> want = {a, -a, -a, a};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(r->advantages[i].item<double>(), want[i], 1e-12);
  EXPECT_EQ(r->num_dropped, 0);
  EXPECT_DOUBLE_EQ(r->reward_mean, 0.5);
  EXPECT_NEAR(r->reward_std, std::sqrt(1.0 / 3.0), 1e-12);
  EXPECT_EQ(r->frac_reward_zero_std, 0.0);
}

TEST(Advantages, AllEqualGroupHasExactlyZeroAdvantageAndCountsInFracZeroStd) {
  auto r = ComputeAdvantages(D2({{0.1}, {0.1}, {0.1}, {1}, {2}, {3}}), {.num_generations = 3});
  ASSERT_TRUE(r.ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(r->advantages[i].item<double>(), 0.0);
  // Group 2: mean 2, std 1.
  EXPECT_NEAR(r->advantages[3].item<double>(), -1.0 / (1.0 + 1e-4), 1e-12);
  EXPECT_DOUBLE_EQ(r->frac_reward_zero_std, 0.5);
}

// TRL's frac_reward_zero_std is a share of samples, and a group with fewer than two scored
// samples has no std (nanstd: NaN, which isclose(., 0) is not). Group {2, null} has one scored
// sample, group {1, 1} std 0: 2 of 4 samples. With scale_rewards batch the batch's std decides
// for every sample: std{2, 1, 1} > 0, so none.
TEST(Advantages, FracRewardZeroStdIsTrlsShareOfSamples) {
  const at::Tensor rewards = D2({{2}, {kNaN}, {1}, {1}});
  auto group = ComputeAdvantages(rewards, {.num_generations = 2});
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EXPECT_DOUBLE_EQ(group->frac_reward_zero_std, 0.5);
  auto batch =
      ComputeAdvantages(rewards, {.num_generations = 2, .scale_rewards = ScaleRewards::kBatch});
  ASSERT_TRUE(batch.ok());
  EXPECT_DOUBLE_EQ(batch->frac_reward_zero_std, 0.0);
  auto all_equal = ComputeAdvantages(D2({{1}, {1}, {1}, {1}}),
                                     {.num_generations = 2, .scale_rewards = ScaleRewards::kBatch});
  ASSERT_TRUE(all_equal.ok());
  EXPECT_DOUBLE_EQ(all_equal->frac_reward_zero_std, 1.0);
}

TEST(Advantages, NoneScalingIsRewardMinusGroupMean) {
  auto r = ComputeAdvantages(D2({{1}, {0}, {0}, {3}}),
                             {.num_generations = 2, .scale_rewards = ScaleRewards::kNone});
  ASSERT_TRUE(r.ok());
  const std::vector<double> want = {0.5, -0.5, -1.5, 1.5};
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(r->advantages[i].item<double>(), want[i]);
}

TEST(Advantages, NullRewardCountsAsZeroAndWeightsApply) {
  // r = 1*r0 + 2*r1 with nulls as 0: {1+2, 0+4, 5+0}; row 3 has no reward at all.
  auto r = ComputeAdvantages(D2({{1, 1}, {kNaN, 2}, {5, kNaN}, {kNaN, kNaN}}),
                             {.num_generations = 2, .reward_weights = {1.0, 2.0}});
  ASSERT_TRUE(r.ok());
  const std::vector<double> want = {3, 4, 5};
  for (int i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(r->rewards[i].item<double>(), want[i]);
  EXPECT_TRUE(std::isnan(r->rewards[3].item<double>()));
  EXPECT_EQ(r->num_dropped, 0);
  EXPECT_EQ(r->num_unscorable, 1);
  EXPECT_DOUBLE_EQ(r->reward_fn_mean[0], 3.0);  // nanmean {1, 5}
  EXPECT_DOUBLE_EQ(r->reward_fn_mean[1], 1.5);  // nanmean {1, 2}
}

// TRL's PR 5902: a completion whose every reward function returned null is left out of its
// group's mean and std and gets A = 0 (counting it as 0 would hand it and its group-mates a
// spurious advantage). Group {2, 0, null}: mean 1, std sqrt(2), so A = +-1 / (sqrt(2) + 1e-4);
// counted as 0 the mean would be 2/3 and A(null) = -2/3 / (std(2,0,0) + 1e-4) != 0.
TEST(Advantages, AllNullSampleIsLeftOutOfItsGroupAndGetsZeroAdvantage) {
  auto r = ComputeAdvantages(D2({{2, kNaN}, {0, kNaN}, {kNaN, kNaN}}), {.num_generations = 3});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const double a = 1.0 / (std::sqrt(2.0) + 1e-4);
  EXPECT_NEAR(r->advantages[0].item<double>(), a, 1e-12);
  EXPECT_NEAR(r->advantages[1].item<double>(), -a, 1e-12);
  EXPECT_EQ(r->advantages[2].item<double>(), 0.0);
  EXPECT_EQ(r->num_unscorable, 1);
  EXPECT_DOUBLE_EQ(r->reward_mean, 1.0);  // over the two scored samples
  EXPECT_NEAR(r->reward_std, std::sqrt(2.0), 1e-12);
}

// TRL's PR 4785: `reward_std` is the std of all the batch's rewards, not the mean of the group
// stds. Groups {0, 2} and {10, 12}: group stds are sqrt(2) each, the batch's std of
// {0, 2, 10, 12} is sqrt(((6^2 + 4^2) * 2) / 3) = sqrt(104 / 3).
TEST(Advantages, RewardStdIsTheStdOfTheWholeBatch) {
  auto r = ComputeAdvantages(D2({{0}, {2}, {10}, {12}}), {.num_generations = 2});
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->reward_std, std::sqrt(104.0 / 3.0), 1e-12);
}

TEST(Advantages, NonFiniteRewardDropsTheSampleOnly) {
  auto r = ComputeAdvantages(D2({{1}, {kInf}, {0}, {2}, {-kInf}, {4}}), {.num_generations = 3});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->num_dropped, 2);
  EXPECT_FALSE(r->keep[1].item<bool>());
  EXPECT_FALSE(r->keep[4].item<bool>());
  EXPECT_EQ(r->advantages[1].item<double>(), 0.0);
  // Group 1 is {1, 0}: mean 0.5, std sqrt(0.5).
  EXPECT_NEAR(r->advantages[0].item<double>(), 0.5 / (std::sqrt(0.5) + 1e-4), 1e-12);
  EXPECT_TRUE(at::isfinite(r->advantages).all().item<bool>());
}

TEST(Advantages, BadConfigIsInvalidArgument) {
  auto mismatch =
      ComputeAdvantages(D2({{1, 2}, {3, 4}}), {.num_generations = 2, .reward_weights = {1.0}});
  EXPECT_EQ(mismatch.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("reward_weights"), std::string::npos);
  auto indivisible = ComputeAdvantages(D2({{1}, {2}, {3}}), {.num_generations = 2});
  EXPECT_EQ(indivisible.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(indivisible.status().message().find("num_generations"), std::string::npos);
  EXPECT_FALSE(ComputeAdvantages(D({1, 2}), {.num_generations = 2}).ok());
  EXPECT_FALSE(ComputeAdvantages(D2({{1}, {2}}), D({0, 0}), {}).ok());  // ids not integer
  EXPECT_FALSE(ParseScaleRewards("batchwise").ok());
  EXPECT_EQ(*ParseScaleRewards("none"), ScaleRewards::kNone);
}

// ---------------------------------------------------------------- advantages vs reference

struct AdvCase {
  std::vector<std::vector<double>> rewards;
  int64_t g;
  std::vector<double> weights;
  std::vector<int64_t> group_ids;  // empty = consecutive groups of g
};

TEST(Advantages, MatchReferenceForEveryScaling) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch"))
      << grpo::testing::ReferencePython() << " cannot import torch (deploy/setup.sh)";
  const std::vector<AdvCase> cases = {
      {{{1}, {0}, {0}, {1}}, 4, {}, {}},
      {{{1}, {1}, {0}, {0}, {2}, {2}, {2}, {5}}, 4, {}, {}},  // ties
      {{{3}, {3}, {3}, {3}, {0}, {1}, {0}, {1}}, 4, {}, {}},  // one all-equal group
      {{{1}, {1}, {2}, {2}}, 2, {}, {}},                      // all groups equal
      {{{0.5, kNaN}, {kNaN, 1}, {1, 1}, {kNaN, kNaN}, {2, -1}, {0, 0.25}}, 3, {1.0, 0.5}, {}},
      {{{1}, {kInf}, {0}, {2}, {-kInf}, {4}, {kNaN}, {7}, {kInf}}, 3, {}, {}},  // drops
      {{{1, kNaN}, {2, kNaN}, {0.3, kNaN}, {4, kNaN}}, 2, {}, {}},              // a null column
      {{{0.2}, {1.7}, {-0.4}, {0.9}, {1.1}, {0.0}, {2.5}, {0.3}, {-1.2}, {0.8}, {0.6}, {1.4}},
       3,
       {},
       {}},
      {{{1}, {5}, {2}, {7}, {3}, {3}}, 0, {}, {2, 0, 2, 0, 9, 9}},  // explicit ids
      {{{2}, {kNaN}, {1}, {1}, {kInf}, {4}}, 2, {}, {}},  // one scored sample; one dropped
  };
  const std::vector<ScaleRewards> modes = {ScaleRewards::kGroup, ScaleRewards::kBatch,
                                           ScaleRewards::kNone};
  json req = {{"advantages", json::array()}};
  std::vector<AdvantageResult> got;
  using MOA = MultiObjectiveAggregation;
  std::vector<std::string> names;
  for (const auto& c : cases) {
    for (ScaleRewards mode : modes)
      for (MOA moa : {MOA::kSumThenNormalize, MOA::kNormalizeThenSum}) {
        if (moa == MOA::kNormalizeThenSum && mode != ScaleRewards::kGroup) continue;  // not used
        names.push_back("case " + std::to_string(&c - cases.data()) + " " +
                        std::string(ScaleRewardsName(mode)) +
                        (moa == MOA::kNormalizeThenSum ? " normalize_then_sum" : ""));
        const AdvantageConfig cfg{.num_generations = c.g,
                                  .scale_rewards = mode,
                                  .reward_weights = c.weights,
                                  .multi_objective_aggregation = moa};
        const at::Tensor r = D2(c.rewards);
        auto res = c.group_ids.empty()
                       ? ComputeAdvantages(r, cfg)
                       : ComputeAdvantages(r, at::tensor(c.group_ids, at::kLong), cfg);
        ASSERT_TRUE(res.ok()) << res.status().ToString();
        got.push_back(*res);
        json jc = {{"rewards", ToJson(r)},
                   {"num_generations", c.g},
                   {"scale_rewards", std::string(ScaleRewardsName(mode))}};
        if (moa == MOA::kNormalizeThenSum) jc["multi_objective_aggregation"] = "normalize_then_sum";
        if (!c.weights.empty()) jc["weights"] = c.weights;
        if (!c.group_ids.empty()) jc["group_ids"] = c.group_ids;
        req["advantages"].push_back(jc);
      }
  }
  const json ref = grpo::testing::RunReference("grpo_ref.py", req);
  ASSERT_FALSE(ref.is_null());
  ASSERT_EQ(ref["advantages"].size(), got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(names[i]);
    const json& e = ref["advantages"][i];
    const AdvantageResult& r = got[i];
    ASSERT_EQ(e["advantages"].size(), static_cast<size_t>(r.advantages.size(0)));
    for (int64_t j = 0; j < r.advantages.size(0); ++j) {
      EXPECT_NEAR(r.advantages[j].item<double>(), e["advantages"][j].get<double>(), 1e-9);
      if (e["rewards"][j].is_null()) {
        EXPECT_TRUE(std::isnan(r.rewards[j].item<double>())) << "unscorable row " << j;
      } else {
        EXPECT_NEAR(r.rewards[j].item<double>(), e["rewards"][j].get<double>(), 1e-12);
      }
      EXPECT_EQ(r.keep[j].item<bool>(), e["keep"][j].get<bool>());
    }
    EXPECT_EQ(r.num_dropped, e["num_dropped"].get<int64_t>());
    EXPECT_EQ(r.num_groups, e["num_groups"].get<int64_t>());
    EXPECT_NEAR(r.reward_mean, e["reward_mean"].get<double>(), 1e-9);
    EXPECT_NEAR(r.reward_std, e["reward_std"].get<double>(), 1e-9);  // std of the whole batch
    EXPECT_NEAR(r.frac_reward_zero_std, e["frac_reward_zero_std"].get<double>(), 1e-12);
    for (size_t k = 0; k < r.reward_fn_mean.size(); ++k) {
      const double wm = FromJson(e["reward_fn_mean"][k]), ws = FromJson(e["reward_fn_std"][k]);
      EXPECT_EQ(std::isnan(r.reward_fn_mean[k]), std::isnan(wm));
      EXPECT_EQ(std::isnan(r.reward_fn_std[k]), std::isnan(ws));
      if (!std::isnan(wm)) {
        EXPECT_NEAR(r.reward_fn_mean[k], wm, 1e-9);
      }
      if (!std::isnan(ws)) {
        EXPECT_NEAR(r.reward_fn_std[k], ws, 1e-9);
      }
    }
  }
}

// ---------------------------------------------------------------- loss, by hand

GrpoLossInputs TwoTokens(std::vector<double> adv) {
  // One token per sequence: ratios e^{0.5} = 1.6487 and e^{-0.5} = 0.6065.
  at::Tensor logp = D2({{0.0}, {0.0}}).requires_grad_(true);
  return {.logp = logp, .old = D2({{-0.5}, {0.5}}), .advantages = D(adv), .mask = D2({{1}, {1}})};
}

TEST(GrpoLoss, ClippedTokensGiveNoGradientAndCountInClipMetrics) {
  GrpoLossInputs in = TwoTokens({1.0, -1.0});
  auto out = ComputeGrpoLoss({}, in, {.step_completion_tokens = 2});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  // Token 0: A > 0, ratio > 1.2 -> loss -1.2. Token 1: A < 0, ratio < 0.8 -> loss +0.8.
  EXPECT_NEAR(out->loss.item<double>(), (-1.2 + 0.8) / 2, 1e-12);
  out->loss.backward();
  EXPECT_EQ(in.logp.grad().abs().sum().item<double>(), 0.0);
  EXPECT_DOUBLE_EQ(out->metrics.ClipLowMean(), 0.5);
  EXPECT_DOUBLE_EQ(out->metrics.ClipHighMean(), 0.5);
  EXPECT_DOUBLE_EQ(out->metrics.ClipRegionMean(), 1.0);
}

TEST(GrpoLoss, RatioOutsideRegionOnTheUnclippedSideKeepsItsGradient) {
  GrpoLossInputs in = TwoTokens({-1.0, 1.0});
  auto out = ComputeGrpoLoss({}, in, {.step_completion_tokens = 2});
  ASSERT_TRUE(out.ok());
  const double r0 = std::exp(0.5), r1 = std::exp(-0.5);
  // loss_t = -A * ratio (the unclipped term is the min); d/dlogp = -A * ratio.
  EXPECT_NEAR(out->loss.item<double>(), (r0 - r1) / 2, 1e-12);
  out->loss.backward();
  EXPECT_NEAR(in.logp.grad()[0][0].item<double>(), r0 / 2, 1e-12);
  EXPECT_NEAR(in.logp.grad()[1][0].item<double>(), -r1 / 2, 1e-12);
  EXPECT_EQ(out->metrics.ClipRegionMean(), 0.0);
}

TEST(GrpoLoss, OnPolicyGradientIsMinusAdvantageOverStepTokens) {
  // old undefined = logp.detach(): ratio 1, d loss / d logp = -A * m / N_tokens (dapo).
  at::Tensor logp = D2({{-1, -2, -3}, {-0.5, -0.1, -9}}).requires_grad_(true);
  GrpoLossInputs in{.logp = logp, .advantages = D({2.0, -1.0}), .mask = D2({{1, 1, 0}, {1, 1, 1}})};
  auto out = ComputeGrpoLoss({}, in, {.step_completion_tokens = 10});
  ASSERT_TRUE(out.ok());
  EXPECT_NEAR(out->loss.item<double>(), -(2.0 * 2 - 1.0 * 3) / 10, 1e-12);
  out->loss.backward();
  const at::Tensor want = D2({{-0.2, -0.2, 0}, {0.1, 0.1, 0.1}});
  EXPECT_TRUE(at::allclose(logp.grad(), want, 0, 1e-12)) << logp.grad();
}

// token_mask keeps the IS ratio below the cap and zeroes the tokens above it (TRL since its
// PR 4530). On policy (ratio 1), A = 1, two tokens with exp(old - beh) = 2 and 4, cap 3:
// w = {2, 0}, so the dapo loss over 2 tokens is -(1 * 2 + 0) / 2 = -1 (a 0/1 mask gave -0.5)
// and d loss / d logp = {-2 / 2, 0}.
TEST(GrpoLoss, TokenMaskKeepsTheRatioBelowTheCap) {
  at::Tensor logp = D2({{-1.0, -1.0}}).requires_grad_(true);
  GrpoLossInputs in{.logp = logp,
                    .beh = D2({{-1.0 - std::log(2.0), -1.0 - std::log(4.0)}}),
                    .advantages = D({1.0}),
                    .mask = D2({{1, 1}})};
  GrpoLossConfig cfg;
  cfg.importance_sampling_correction = ImportanceSamplingCorrection::kTokenMask;
  cfg.importance_sampling_cap = 3.0;
  auto out = ComputeGrpoLoss(cfg, in, {.step_completion_tokens = 2});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_NEAR(out->loss.item<double>(), -1.0, 1e-12);
  out->loss.backward();
  EXPECT_TRUE(at::allclose(logp.grad(), D2({{-1.0, 0.0}}), 0, 1e-12)) << logp.grad();
}

// Clip flags use the ratio the loss uses: after the delta clamp (TRL reassigns coef_1). Ratio
// e^{0.5} = 1.65 with A > 0 is above 1 + epsilon (high-clipped); with delta 1.1 the clamped
// ratio 1.1 is inside [0.8, 1.2], so it is not flagged.
TEST(GrpoLoss, ClipFlagsUseTheRatioAfterTheDeltaClamp) {
  GrpoLossConfig cfg;
  auto plain = ComputeGrpoLoss(cfg, TwoTokens({1.0, 1.0}), {.step_completion_tokens = 2});
  ASSERT_TRUE(plain.ok());
  EXPECT_DOUBLE_EQ(plain->metrics.ClipHighMean(), 0.5);
  cfg.delta = 1.1;
  auto clamped = ComputeGrpoLoss(cfg, TwoTokens({1.0, 1.0}), {.step_completion_tokens = 2});
  ASSERT_TRUE(clamped.ok());
  EXPECT_DOUBLE_EQ(clamped->metrics.ClipHighMean(), 0.0);
}

// The step's clip ratios are the mean over micro-batches of each one's token mean (TRL 1.16):
// micro-batch 1 has 1 of 1 token high-clipped, micro-batch 2 has 0 of 3: (1 + 0) / 2 = 0.5,
// where one mean over the step's 4 tokens would give 0.25.
TEST(GrpoLossMetrics, StepMeansAreMeansOfMicroBatchMeans) {
  GrpoLossConfig cfg;
  GrpoLossInputs a{.logp = D2({{0.0}}).requires_grad_(true),
                   .old = D2({{-0.5}}),
                   .advantages = D({1.0}),
                   .mask = D2({{1}})};
  GrpoLossInputs b{.logp = D2({{0.0, 0.0, 0.0}}).requires_grad_(true),
                   .old = D2({{0.0, 0.0, 0.0}}),
                   .advantages = D({1.0}),
                   .mask = D2({{1, 1, 1}})};
  auto ma = ComputeGrpoLoss(cfg, a, {.step_completion_tokens = 4});
  auto mb = ComputeGrpoLoss(cfg, b, {.step_completion_tokens = 4});
  ASSERT_TRUE(ma.ok() && mb.ok());
  GrpoLossMetrics step = ma->metrics;
  step.Merge(mb->metrics);
  EXPECT_DOUBLE_EQ(step.ClipHighMean(), 0.5);
  EXPECT_DOUBLE_EQ(step.ClipRegionMean(), 0.5);
}

TEST(GrpoLoss, DapoNormalisesByTokensOfWholeStep) {
  at::Tensor logp = D2({{-1, -2}}).requires_grad_(true);
  GrpoLossInputs in{.logp = logp, .advantages = D({1.0}), .mask = D2({{1, 1}})};
  auto a = ComputeGrpoLoss({}, in, {.step_completion_tokens = 2});
  auto b = ComputeGrpoLoss({}, in, {.step_completion_tokens = 8});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(a->loss.item<double>(), -1.0, 1e-12);
  EXPECT_NEAR(b->loss.item<double>(), -0.25, 1e-12);
}

TEST(GrpoLoss, GarbageAtPaddingNeverLeaksIntoLossOrGradient) {
  const at::Tensor mask = D2({{1, 1, 0, 0}, {1, 0, 0, 0}});
  const at::Tensor pad = mask == 0;
  auto run = [&](bool garbage) {
    at::Tensor logp = D2({{-1, -2, -1, -1}, {-0.5, -1, -1, -1}});
    at::Tensor old = logp - 0.1, beh = logp + 0.2, ref = logp - 0.3;
    if (garbage) {
      logp = logp.masked_fill(pad, -kInf);
      old = old.masked_fill(pad, kNaN);
      beh = beh.masked_fill(pad, kInf);
      ref = ref.masked_fill(pad, kInf);
    }
    logp.requires_grad_(true);
    GrpoLossConfig cfg{
        .beta = 0.1,
        .importance_sampling_correction = ImportanceSamplingCorrection::kTokenTruncate};
    for (auto level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
      cfg.importance_sampling_level = level;
      GrpoLossInputs in{.logp = logp,
                        .old = old,
                        .beh = beh,
                        .ref = ref,
                        .advantages = D({1.0, -2.0}),
                        .mask = mask};
      auto out = ComputeGrpoLoss(cfg, in, {.step_completion_tokens = 3});
      EXPECT_TRUE(out.ok()) << out.status().ToString();
      out->loss.backward();
    }
    return logp.grad().clone();
  };
  const at::Tensor clean = run(false), dirty = run(true);
  EXPECT_TRUE(at::isfinite(dirty).all().item<bool>()) << dirty;
  EXPECT_TRUE(at::equal(clean, dirty));
}

TEST(GrpoLoss, BadInputsAreInvalidArgumentNamingTheProblem) {
  at::Tensor logp = D2({{-1, -2}, {-1, -2}}).requires_grad_(true);
  const GrpoLossInputs good{.logp = logp, .advantages = D({1, -1}), .mask = D2({{1, 1}, {1, 0}})};
  const LossNormaliser n{.step_completion_tokens = 3};
  auto expect_error = [&](GrpoLossConfig cfg, GrpoLossInputs in, LossNormaliser norm,
                          const std::string& needle) {
    auto out = ComputeGrpoLoss(cfg, in, norm);
    ASSERT_FALSE(out.ok()) << needle;
    EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find(needle), std::string::npos) << out.status().ToString();
  };
  ASSERT_TRUE(ComputeGrpoLoss({}, good, n).ok());
  GrpoLossInputs in = good;
  in.mask = D2({{1, 1, 1}, {1, 1, 1}});
  expect_error({}, in, n, "mask must be [B, T]");
  in = good;
  in.advantages = D({1, 2, 3});
  expect_error({}, in, n, "advantages");
  in = good;
  in.old = D2({{kNaN, 0}, {0, 0}});
  expect_error({}, in, n, "old is not finite");
  in = good;
  in.advantages = D({kInf, 0});
  expect_error({}, in, n, "advantages are not finite");
  in = good;
  in.mask = D2({{1, 0.5}, {1, 0}});
  expect_error({}, in, n, "mask has values");
  expect_error({.beta = 0.1}, good, n, "ref");
  expect_error({.importance_sampling_correction = ImportanceSamplingCorrection::kTokenMask}, good,
               n, "beh");
  expect_error({}, good, {.step_completion_tokens = 0}, "step_completion_tokens");
  expect_error({.loss_type = LossType::kGrpo}, good, {.gradient_accumulation_steps = 0},
               "gradient_accumulation_steps");
  expect_error({.epsilon = -0.1}, good, n, "epsilon");
  expect_error({.delta = 0.9}, good, n, "delta");
}

TEST(GrpoLossConfig, DefaultsAreTrlsAndNamesParse) {
  const GrpoLossConfig c;
  EXPECT_EQ(c.loss_type, LossType::kDapo);
  EXPECT_DOUBLE_EQ(c.epsilon, 0.2);
  EXPECT_DOUBLE_EQ(c.EpsilonHigh(), 0.2);
  EXPECT_DOUBLE_EQ(c.beta, 0.0);
  EXPECT_DOUBLE_EQ(c.importance_sampling_cap, 3.0);
  EXPECT_TRUE(c.Validate().ok());
  for (auto t : {LossType::kGrpo, LossType::kBnpo, LossType::kDrGrpo, LossType::kDapo}) {
    EXPECT_EQ(*ParseLossType(LossTypeName(t)), t);
  }
  EXPECT_EQ(*ParseImportanceSamplingLevel("sequence"), ImportanceSamplingLevel::kSequence);
  EXPECT_EQ(*ParseImportanceSamplingCorrection("token_mask"),
            ImportanceSamplingCorrection::kTokenMask);
  EXPECT_FALSE(ParseLossType("ppo").ok());
  EXPECT_EQ(*ParseImportanceSamplingCorrection("sequence_mask"),
            ImportanceSamplingCorrection::kSequenceMask);
  EXPECT_FALSE(ParseImportanceSamplingCorrection("sequence").ok());
  EXPECT_TRUE(c.use_bias_correction_kl);  // TRL 1.16's default
  EXPECT_DOUBLE_EQ(c.sapo_temperature_pos, 1.0);
  EXPECT_DOUBLE_EQ(c.sapo_temperature_neg, 1.05);
  EXPECT_DOUBLE_EQ(c.vespo_k_pos, 2.0);
  EXPECT_DOUBLE_EQ(c.vespo_lambda_pos, 3.0);
  EXPECT_DOUBLE_EQ(c.vespo_k_neg, 3.0);
  EXPECT_DOUBLE_EQ(c.vespo_lambda_neg, 2.0);
  EXPECT_FALSE(c.off_policy_mask_threshold.has_value());
  EXPECT_FALSE(c.importance_sampling_min.has_value());
}

// ---------------------------------------------------------------- loss vs reference

struct LossVariant {
  std::string name;
  GrpoLossConfig cfg;
  bool on_policy = false;  // old undefined
  bool with_beh = false;
};

TEST(GrpoLoss, MatchesReferenceForEveryLossTypeAndOption) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch"))
      << grpo::testing::ReferencePython() << " cannot import torch (deploy/setup.sh)";
  at::manual_seed(7);
  const auto opts = at::dtype(at::kDouble);
  const int64_t b = 4, t = 6;
  const at::Tensor logp0 = -at::rand({b, t}, opts) * 3 - 0.05;
  const at::Tensor old = logp0 + 0.5 * at::randn({b, t}, opts);
  const at::Tensor beh = old + 0.7 * at::randn({b, t}, opts);
  const at::Tensor ref = logp0 + 0.3 * at::randn({b, t}, opts);
  const at::Tensor adv = D({1.3, -0.7, 0.4, -1.1});
  const at::Tensor mask = D2({{1, 1, 1, 1, 1, 1},
                              {1, 1, 1, 0, 0, 0},
                              {1, 0, 0, 0, 0, 0},
                              {0, 0, 0, 0, 0, 0}});  // an all-masked (truncated) completion
  const LossNormaliser norm{.step_completion_tokens = 25, .gradient_accumulation_steps = 3};

  using ISC = ImportanceSamplingCorrection;
  const std::vector<LossVariant> variants = {
      {"plain", {}},
      {"on_policy", {}, true},
      {"eps_high_delta", {.epsilon_high = 0.28, .delta = 1.5}},
      // grpo_ref.py transcribes the plain k3 KL; trl_loss_test checks the bias-corrected one
      // (TRL's default) with TRL's own code.
      {"beta", {.beta = 0.04, .use_bias_correction_kl = false}},
      {"is_truncate",
       {.importance_sampling_correction = ISC::kTokenTruncate, .importance_sampling_cap = 1.5},
       false,
       true},
      {"is_mask",
       {.importance_sampling_correction = ISC::kTokenMask, .importance_sampling_cap = 1.5},
       false,
       true},
      {"all",
       {.epsilon = 0.1,
        .epsilon_high = 0.3,
        .delta = 2.0,
        .beta = 0.1,
        .importance_sampling_correction = ISC::kTokenTruncate,
        .importance_sampling_cap = 2.0,
        .max_completion_length = 10,
        .use_bias_correction_kl = false},
       false,
       true},
  };
  json req = {{"losses", json::array()}};
  std::vector<std::pair<GrpoLossOutput, at::Tensor>> got;  // output, grad
  std::vector<std::string> names;
  for (auto lt : {LossType::kGrpo, LossType::kBnpo, LossType::kDrGrpo, LossType::kDapo}) {
    for (auto level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
      for (const auto& v : variants) {
        GrpoLossConfig cfg = v.cfg;
        cfg.loss_type = lt;
        cfg.importance_sampling_level = level;
        at::Tensor logp = logp0.clone().requires_grad_(true);
        GrpoLossInputs in{.logp = logp,
                          .old = v.on_policy ? at::Tensor() : old,
                          .beh = v.with_beh ? beh : at::Tensor(),
                          .ref = cfg.beta != 0 ? ref : at::Tensor(),
                          .advantages = adv,
                          .mask = mask};
        auto out = ComputeGrpoLoss(cfg, in, norm);
        ASSERT_TRUE(out.ok()) << out.status().ToString();
        out->loss.backward();
        got.emplace_back(*out, logp.grad().clone());
        names.push_back(std::string(LossTypeName(lt)) + "/" +
                        std::string(ImportanceSamplingLevelName(level)) + "/" + v.name);
        json c = {{"logp", ToJson(logp0)},
                  {"advantages", ToJson(adv)},
                  {"mask", ToJson(mask)},
                  {"normaliser",
                   {{"step_completion_tokens", norm.step_completion_tokens},
                    {"gradient_accumulation_steps", norm.gradient_accumulation_steps}}}};
        json jc = {
            {"loss_type", std::string(LossTypeName(lt))},
            {"epsilon", cfg.epsilon},
            {"beta", cfg.beta},
            {"importance_sampling_level", std::string(ImportanceSamplingLevelName(level))},
            {"importance_sampling_correction",
             std::string(ImportanceSamplingCorrectionName(cfg.importance_sampling_correction))},
            {"importance_sampling_cap", cfg.importance_sampling_cap},
            {"max_completion_length", cfg.max_completion_length}};
        if (cfg.epsilon_high) jc["epsilon_high"] = *cfg.epsilon_high;
        if (cfg.delta) jc["delta"] = *cfg.delta;
        c["config"] = jc;
        if (!v.on_policy) c["old"] = ToJson(old);
        if (v.with_beh) c["beh"] = ToJson(beh);
        if (cfg.beta != 0) c["ref"] = ToJson(ref);
        req["losses"].push_back(c);
      }
    }
  }
  const json res = grpo::testing::RunReference("grpo_ref.py", req);
  ASSERT_FALSE(res.is_null());
  ASSERT_EQ(res["losses"].size(), got.size());
  double clipped_tokens = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(names[i]);
    const json& e = res["losses"][i];
    const auto& [out, grad] = got[i];
    EXPECT_NEAR(out.loss.item<double>(), e["loss"].get<double>(), 1e-6);
    EXPECT_NEAR(out.metrics.loss, e["loss"].get<double>(), 1e-6);
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t c = 0; c < t; ++c) {
        EXPECT_NEAR(grad[r][c].item<double>(), e["grad"][r][c].get<double>(), 1e-6)
            << "grad[" << r << "][" << c << "]";
      }
    }
    const GrpoLossMetrics& m = out.metrics;
    EXPECT_DOUBLE_EQ(m.tokens, e["tokens"].get<double>());
    EXPECT_NEAR(m.ClipLowMean(), e["clip_low_mean"].get<double>(), 1e-12);
    EXPECT_NEAR(m.ClipHighMean(), e["clip_high_mean"].get<double>(), 1e-12);
    EXPECT_NEAR(m.ClipRegionMean(), e["clip_region_mean"].get<double>(), 1e-12);
    EXPECT_EQ(m.has_kl, e.contains("kl"));
    if (m.has_kl) {
      EXPECT_NEAR(m.KlMean(), e["kl"].get<double>(), 1e-9);
    }
    EXPECT_EQ(m.has_is_ratio, e.contains("is_ratio_mean"));
    if (m.has_is_ratio) {
      EXPECT_NEAR(m.IsRatioMean(), e["is_ratio_mean"].get<double>(), 1e-9);
      EXPECT_NEAR(m.is_ratio_max, e["is_ratio_max"].get<double>(), 1e-9);
    }
    clipped_tokens += m.ClipRegionMean();
  }
  EXPECT_GT(clipped_tokens, 0) << "the data must exercise clipping";
}

// ---------------------------------------------------------------- micro-batch invariance

// One optimizer step over G = 8 sequences of different lengths whose log-probs come from
// hidden states through ChunkedTokenLogprobs; returns d(step loss)/d(hidden, W) accumulated
// over `micro_batches` equal splits, and the merged metrics.
struct StepResult {
  at::Tensor grad_hidden, grad_w;
  GrpoLossMetrics metrics;
};

StepResult RunStep(const GrpoLossConfig& cfg, int64_t micro_batches, const at::Tensor& mask,
                   bool off_policy) {
  at::manual_seed(11);
  const int64_t g = 8, t = 7, d = 6, v = 13;
  const auto opts = at::dtype(at::kFloat);
  const at::Tensor hidden = at::randn({g, t, d}, opts).requires_grad_(true);
  const at::Tensor w = (0.7 * at::randn({v, d}, opts)).requires_grad_(true);
  const at::Tensor labels = at::randint(0, v, {g, t}, at::kLong);
  const at::Tensor noise_old = 0.4 * at::randn({g, t}, opts);
  const at::Tensor noise_beh = 0.6 * at::randn({g, t}, opts);
  const at::Tensor noise_ref = 0.3 * at::randn({g, t}, opts);
  const at::Tensor rewards = at::randn({g, 1}, at::kDouble);
  auto adv = ComputeAdvantages(rewards, {.num_generations = g});
  EXPECT_TRUE(adv.ok());
  const double step_tokens = mask.sum().item<double>();

  StepResult res;
  const int64_t per = g / micro_batches;
  for (int64_t k = 0; k < micro_batches; ++k) {
    const at::Tensor h = hidden.narrow(0, k * per, per);
    const at::Tensor logp =
        ChunkedTokenLogprobs(h, w, labels.narrow(0, k * per, per), /*chunk_tokens=*/5, 0.7);
    const at::Tensor lp_d = logp.detach();
    GrpoLossInputs in{.logp = logp,
                      .old = off_policy ? lp_d + noise_old.narrow(0, k * per, per) : at::Tensor(),
                      .beh = lp_d + noise_beh.narrow(0, k * per, per),
                      .ref = lp_d + noise_ref.narrow(0, k * per, per),
                      .advantages = adv->advantages.narrow(0, k * per, per),
                      .mask = mask.narrow(0, k * per, per)};
    auto out = ComputeGrpoLoss(
        cfg, in,
        {.step_completion_tokens = step_tokens, .gradient_accumulation_steps = micro_batches});
    EXPECT_TRUE(out.ok()) << out.status().ToString();
    out->loss.backward();
    res.metrics.Merge(out->metrics);
  }
  res.grad_hidden = hidden.grad();
  res.grad_w = w.grad();
  return res;
}

// Varying completion lengths: 7, 1, 4, 0 (truncated + masked), 6, 2, 7, 3.
at::Tensor VaryingMask() {
  const std::vector<int64_t> lengths = {7, 1, 4, 0, 6, 2, 7, 3};
  at::Tensor m = at::zeros({8, 7}, at::kFloat);
  for (int64_t i = 0; i < 8; ++i) m[i].narrow(0, 0, lengths[i]).fill_(1);
  return m;
}

double RelativeDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

void ExpectSameStep(const StepResult& a, const StepResult& ref) {
  EXPECT_LT(RelativeDiff(a.grad_hidden, ref.grad_hidden), 1e-5);
  EXPECT_LT(RelativeDiff(a.grad_w, ref.grad_w), 1e-5);
  EXPECT_NEAR(a.metrics.loss, ref.metrics.loss, 1e-5 * std::abs(ref.metrics.loss) + 1e-7);
  EXPECT_EQ(a.metrics.tokens, ref.metrics.tokens);
  // The clip ratios and kl are means over micro-batches of per-micro-batch means (TRL 1.16), so
  // they are not invariant under the split by definition; the gradient and the loss are.
  EXPECT_NEAR(a.metrics.IsRatioMean(), ref.metrics.IsRatioMean(), 1e-6);
  EXPECT_NEAR(a.metrics.is_ratio_max, ref.metrics.is_ratio_max, 1e-6 * ref.metrics.is_ratio_max);
}

GrpoLossConfig FullConfig(LossType lt, ImportanceSamplingLevel level) {
  return {.loss_type = lt,
          .epsilon_high = 0.28,
          .delta = 1.6,
          .beta = 0.04,
          .importance_sampling_level = level,
          .importance_sampling_correction = ImportanceSamplingCorrection::kTokenTruncate,
          .importance_sampling_cap = 1.5,
          .max_completion_length = 7};
}

class StepGradient : public ::testing::TestWithParam<LossType> {};

// grpo, dr_grpo and dapo: the step gradient with varying lengths is the same for 1, 2 or 8
// equal micro-batches. bnpo is covered below: it normalises by the micro-batch's tokens (TRL),
// so it is split-independent only when the micro-batches hold equal token counts.
TEST_P(StepGradient, DoesNotDependOnMicroBatchSplit) {
  const LossType lt = GetParam();
  const bool varying = lt != LossType::kBnpo;
  const at::Tensor mask = varying ? VaryingMask() : at::ones({8, 7}, at::kFloat);
  for (auto level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
    for (bool off_policy : {false, true}) {
      SCOPED_TRACE(std::string(ImportanceSamplingLevelName(level)) +
                   (off_policy ? " off-policy" : " on-policy"));
      const GrpoLossConfig cfg = FullConfig(lt, level);
      const StepResult one = RunStep(cfg, 1, mask, off_policy);
      ASSERT_GT(one.grad_w.abs().max().item<double>(), 0.0);
      if (off_policy) {
        EXPECT_GT(one.metrics.ClipRegionMean(), 0);
      }
      for (int64_t mb : {2, 8}) {
        SCOPED_TRACE("micro_batches " + std::to_string(mb));
        ExpectSameStep(RunStep(cfg, mb, mask, off_policy), one);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryLossType, StepGradient,
                         ::testing::Values(LossType::kGrpo, LossType::kBnpo, LossType::kDrGrpo,
                                           LossType::kDapo),
                         [](const auto& info) { return std::string(LossTypeName(info.param)); });

TEST(GrpoLoss, BnpoNormalisesPerMicroBatchSoUnequalLengthsChangeTheStep) {
  // Documented TRL behaviour (docs/GRPO_SPEC.md "Aggregation": sum / sum m per micro-batch,
  // then / GA).
  const GrpoLossConfig cfg = FullConfig(LossType::kBnpo, ImportanceSamplingLevel::kToken);
  const StepResult one = RunStep(cfg, 1, VaryingMask(), true);
  const StepResult eight = RunStep(cfg, 8, VaryingMask(), true);
  EXPECT_GT(RelativeDiff(eight.grad_w, one.grad_w), 1e-3);
}

}  // namespace
}  // namespace grpo::learner
