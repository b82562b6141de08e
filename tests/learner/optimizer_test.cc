#include "learner/optimizer.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/test_util.h"

namespace grpo::learner {
namespace {

at::Tensor FromVec(const std::vector<double>& v) {
  return at::tensor(v, at::TensorOptions().dtype(at::kDouble));
}

TEST(AdamW, FirstStepMovesEachWeightByLrTimesSignOfGradient) {
  // After one step m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps).
  at::Tensor p = FromVec({1.0, -2.0, 3.0}).requires_grad_(true);
  p.mutable_grad() = FromVec({0.5, -4.0, 1e-3});
  AdamW opt({{"w", p}}, AdamWOptions{});
  opt.Step(0.1);
  EXPECT_NEAR(p[0].item<double>(), 1.0 - 0.1, 1e-6);
  EXPECT_NEAR(p[1].item<double>(), -2.0 + 0.1, 1e-6);
  EXPECT_NEAR(p[2].item<double>(), 3.0 - 0.1 * 1e-3 / (1e-3 + 1e-8), 1e-9);
}

TEST(AdamW, DecoupledWeightDecayShrinksWeightsWithoutGradientScale) {
  at::Tensor p = FromVec({2.0}).requires_grad_(true);
  p.mutable_grad() = FromVec({1.0});
  AdamW opt({{"w", p}}, AdamWOptions{.weight_decay = 0.5});
  opt.Step(0.1);
  // p * (1 - lr*wd) - lr * sign(g) = 2 * 0.95 - 0.1
  EXPECT_NEAR(p.item<double>(), 1.8, 1e-6);
}

TEST(AdamW, MatchesTorchAdamWWithClippingOverSeveralSteps) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch"))
      << grpo::testing::ReferencePython() << " cannot import torch (deploy/setup.sh)";
  std::vector<std::vector<double>> init = {{0.1, -0.2, 0.3}, {1.0, 2.0}};
  std::vector<std::vector<std::vector<double>>> grads = {
      {{0.5, -1.0, 0.25}, {3.0, -0.1}},
      {{-0.2, 0.4, 0.0}, {0.3, 0.3}},
      {{1.5, 1.5, -1.5}, {-2.0, 0.05}},
  };
  std::vector<double> lrs = {0.01, 0.02, 0.005};
  const AdamWOptions o{.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1};
  const double max_norm = 1.0;

  common::NamedTensors named;
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < init.size(); ++i) {
    params.push_back(FromVec(init[i]).requires_grad_(true));
    named.emplace_back("p" + std::to_string(i), params.back());
  }
  AdamW opt(named, o);
  std::vector<double> norms;
  for (size_t s = 0; s < grads.size(); ++s) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = FromVec(grads[s][i]);
    norms.push_back(ClipGradNorm(params, max_norm));
    opt.Step(lrs[s]);
  }
  auto ref = grpo::testing::RunReference("adamw_ref.py", {{"params", init},
                                                          {"grads", grads},
                                                          {"lr", lrs},
                                                          {"betas", {o.beta1, o.beta2}},
                                                          {"eps", o.eps},
                                                          {"weight_decay", o.weight_decay},
                                                          {"max_grad_norm", max_norm}});
  ASSERT_FALSE(ref.is_null());
  for (size_t i = 0; i < params.size(); ++i) {
    for (size_t j = 0; j < init[i].size(); ++j) {
      EXPECT_NEAR(params[i][j].item<double>(), ref["params"][i][j].get<double>(), 1e-12)
          << "param " << i << "[" << j << "]";
    }
  }
  for (size_t s = 0; s < norms.size(); ++s) {
    EXPECT_NEAR(norms[s], ref["grad_norms"][s].get<double>(), 1e-12);
  }
}

TEST(AdamW, StateDictRoundTripContinuesIdentically) {
  auto make = [] { return FromVec({0.5, -0.5}).requires_grad_(true); };
  at::Tensor a = make(), b = make();
  AdamW oa({{"w", a}}, AdamWOptions{}), ob({{"w", b}}, AdamWOptions{});
  a.mutable_grad() = FromVec({1.0, 2.0});
  oa.Step(0.1);
  ASSERT_TRUE(ob.LoadStateDict(oa.StateDict()).ok());
  {
    at::NoGradGuard g;
    b.copy_(a);
  }
  a.mutable_grad() = FromVec({-1.0, 0.5});
  b.mutable_grad() = FromVec({-1.0, 0.5});
  oa.Step(0.1);
  ob.Step(0.1);
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_EQ(ob.step_count(), 2);
}

TEST(AdamW, LoadStateDictRejectsMissingOrMisshapenTensorsNamingThem) {
  at::Tensor p = FromVec({1.0, 2.0}).requires_grad_(true);
  AdamW opt({{"w", p}}, AdamWOptions{});
  Status s = opt.LoadStateDict({{"step", at::scalar_tensor(3, at::kLong)}});
  EXPECT_NE(s.message().find("exp_avg.w"), std::string::npos) << s.message();
  s = opt.LoadStateDict({{"step", at::scalar_tensor(3, at::kLong)},
                         {"exp_avg.w", at::zeros({3}, at::kDouble)},
                         {"exp_avg_sq.w", at::zeros({2}, at::kDouble)}});
  EXPECT_NE(s.message().find("'exp_avg.w' has shape"), std::string::npos) << s.message();
  EXPECT_EQ(opt.step_count(), 0);
}

TEST(ClipGradNorm, ReturnsNormBeforeClippingAndScalesToMax) {
  at::Tensor a = FromVec({3.0}).requires_grad_(true), b = FromVec({4.0}).requires_grad_(true);
  a.mutable_grad() = FromVec({3.0});
  b.mutable_grad() = FromVec({4.0});
  EXPECT_DOUBLE_EQ(ClipGradNorm({a, b}, 1.0), 5.0);
  EXPECT_NEAR(a.grad().item<double>(), 3.0 / (5.0 + 1e-6), 1e-12);
  EXPECT_NEAR(b.grad().item<double>(), 4.0 / (5.0 + 1e-6), 1e-12);
}

TEST(LrSchedule, WarmupThenLinearOrCosineDecayAsTransformers) {
  // 10 steps, 2 of warmup, base 1.0: values from transformers' formulas by hand.
  EXPECT_DOUBLE_EQ(LearningRateAt(LrSchedule::kLinear, 1.0, 0, 2, 10), 0.0);
  EXPECT_DOUBLE_EQ(LearningRateAt(LrSchedule::kLinear, 1.0, 1, 2, 10), 0.5);
  EXPECT_DOUBLE_EQ(LearningRateAt(LrSchedule::kLinear, 1.0, 2, 2, 10), 1.0);
  EXPECT_DOUBLE_EQ(LearningRateAt(LrSchedule::kLinear, 1.0, 6, 2, 10), 0.5);
  EXPECT_DOUBLE_EQ(LearningRateAt(LrSchedule::kLinear, 1.0, 10, 2, 10), 0.0);
  EXPECT_NEAR(LearningRateAt(LrSchedule::kCosine, 1.0, 6, 2, 10), 0.5, 1e-12);  // cos(pi/2)
  EXPECT_NEAR(LearningRateAt(LrSchedule::kCosine, 1.0, 4, 2, 10), 0.5 * (1 + std::cos(M_PI * 0.25)),
              1e-12);
  EXPECT_DOUBLE_EQ(LearningRateAt(LrSchedule::kConstant, 0.3, 7, 2, 10), 0.3);
  EXPECT_FALSE(ParseLrSchedule("exponential").ok());
}

}  // namespace
}  // namespace grpo::learner
