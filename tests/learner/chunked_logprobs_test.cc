// Memory-flat log-probs: values, entropies and gradients (wrt hidden and the LM head) equal the
// naive full-logits path and hand-computed numbers, for any chunk size and temperature.
#include "learner/chunked_logprobs.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <vector>

#include "learner/grpo_loss.h"
#include "learner/loss/entropy_bonus.h"

namespace grpo::learner {
namespace {

struct Problem {
  at::Tensor hidden;    // [B, T, D]
  at::Tensor w;         // [V, D]
  at::Tensor labels;    // [B, T]
  at::Tensor upstream;  // [B, T]: weights of a generic scalar loss sum(upstream * logp)
};

Problem MakeProblem(at::ScalarType dtype, int64_t b = 3, int64_t t = 13, int64_t d = 8,
                    int64_t v = 29) {
  at::manual_seed(3);
  const auto opts = at::dtype(dtype);
  return {at::randn({b, t, d}, opts).requires_grad_(true),
          (0.8 * at::randn({v, d}, opts)).requires_grad_(true),
          at::randint(0, v, {b, t}, at::kLong), at::randn({b, t}, opts)};
}

struct Grads {
  at::Tensor logp, hidden, w;
};

template <typename Fn>
Grads LogprobsAndGrads(const Problem& p, Fn logprobs) {
  const at::Tensor logp = logprobs(p.hidden, p.w, p.labels);
  const auto g = torch::autograd::grad({(logp * p.upstream).sum()}, {p.hidden, p.w});
  return {logp.detach(), g[0], g[1]};
}

void ExpectClose(const at::Tensor& a, const at::Tensor& b, double tol) {
  ASSERT_EQ(a.sizes(), b.sizes());
  EXPECT_LT((a - b).abs().max().item<double>(), tol) << "max |a - b|";
}

TEST(ChunkedTokenLogprobs, MatchesHandComputedTwoWordVocabulary) {
  // D = 1, W = [[1], [-1]], h = 2, temperature 2: logits [1, -1],
  // logp(label 0) = 1 - log(e + 1/e), logp(label 1) = -1 - log(e + 1/e).
  const at::Tensor h = at::tensor({2.0, 2.0}, at::kDouble).reshape({2, 1});
  const at::Tensor w = at::tensor({1.0, -1.0}, at::kDouble).reshape({2, 1});
  const at::Tensor labels = at::tensor({0, 1}, at::kLong);
  at::Tensor entropy;
  const at::Tensor logp = ChunkedTokenLogprobs(h, w, labels, 1, 2.0, &entropy);
  const double lse = std::log(std::exp(1.0) + std::exp(-1.0));
  EXPECT_NEAR(logp[0].item<double>(), 1 - lse, 1e-12);
  EXPECT_NEAR(logp[1].item<double>(), -1 - lse, 1e-12);
  const double p0 = std::exp(1 - lse), p1 = std::exp(-1 - lse);
  EXPECT_NEAR(entropy[0].item<double>(), -(p0 * std::log(p0) + p1 * std::log(p1)), 1e-12);
}

TEST(ChunkedTokenLogprobs, ValuesAndGradientsMatchNaivePathForEveryChunkSize) {
  const Problem p = MakeProblem(at::kDouble);  // N = 39 tokens
  const Grads naive = LogprobsAndGrads(
      p, [](auto& h, auto& w, auto& l) { return NaiveTokenLogprobs(h, w, l, 0.7); });
  for (int64_t chunk : {1, 4, 7, 38, 39, 40, 1000}) {
    SCOPED_TRACE("chunk_tokens " + std::to_string(chunk));
    const Grads chunked = LogprobsAndGrads(p, [chunk](auto& h, auto& w, auto& l) {
      return ChunkedTokenLogprobs(h, w, l, chunk, 0.7);
    });
    ExpectClose(chunked.logp, naive.logp, 1e-12);
    ExpectClose(chunked.hidden, naive.hidden, 1e-12);
    ExpectClose(chunked.w, naive.w, 1e-12);
  }
}

TEST(ChunkedTokenLogprobs, TemperatureDividesTheLogits) {
  // Independent of the naive path: temperature tau on W equals temperature 1 on W / tau.
  const Problem p = MakeProblem(at::kDouble);
  const at::Tensor a = ChunkedTokenLogprobs(p.hidden, p.w, p.labels, 5, 1.7);
  const at::Tensor b = ChunkedTokenLogprobs(p.hidden, p.w / 1.7, p.labels, 5, 1.0);
  ExpectClose(a, b, 1e-12);
  const at::Tensor c = ChunkedTokenLogprobs(p.hidden, p.w, p.labels, 5, 1.0);
  EXPECT_GT((a - c).abs().max().item<double>(), 1e-3);
}

TEST(ChunkedTokenLogprobs, LogProbabilitiesOfEveryLabelSumToOne) {
  const Problem p = MakeProblem(at::kDouble, 1, 4, 5, 7);
  for (int64_t tok = 0; tok < 4; ++tok) {
    const at::Tensor h = p.hidden.detach()[0][tok].expand({7, 5});
    const at::Tensor all = ChunkedTokenLogprobs(h, p.w.detach(), at::arange(7), 3, 0.9);
    EXPECT_NEAR(all.exp().sum().item<double>(), 1.0, 1e-12);
  }
}

// The entropy and its gradient (the entropy bonus's): the naive path's autograd through
// -sum(softmax * log_softmax) is the reference, for a loss of log-probs and entropies together
// and for one of entropies alone.
TEST(ChunkedTokenLogprobs, EntropyAndItsGradientMatchNaive) {
  const Problem p = MakeProblem(at::kDouble);
  at::manual_seed(5);
  const at::Tensor upstream_h = at::randn(p.labels.sizes(), at::kDouble);
  for (const bool with_logp : {true, false}) {
    at::Tensor e_chunked, e_naive;
    const at::Tensor logp = ChunkedTokenLogprobs(p.hidden, p.w, p.labels, 6, 0.8, &e_chunked);
    const at::Tensor logp_naive = NaiveTokenLogprobs(p.hidden, p.w, p.labels, 0.8, &e_naive);
    EXPECT_EQ(e_chunked.sizes(), p.labels.sizes());
    ExpectClose(e_chunked, e_naive.detach(), 1e-12);
    EXPECT_TRUE(e_chunked.requires_grad());
    EXPECT_GT(e_chunked.min().item<double>(), 0.0);
    EXPECT_LT(e_chunked.max().item<double>(), std::log(29.0) + 1e-12);
    const at::Tensor l = (e_chunked * upstream_h).sum() +
                         (with_logp ? (logp * p.upstream).sum() : at::zeros({}, at::kDouble));
    const at::Tensor l_naive =
        (e_naive * upstream_h).sum() +
        (with_logp ? (logp_naive * p.upstream).sum() : at::zeros({}, at::kDouble));
    const auto g = torch::autograd::grad({l}, {p.hidden, p.w});
    const auto g_naive = torch::autograd::grad({l_naive}, {p.hidden, p.w});
    ExpectClose(g[0], g_naive[0], 1e-11);
    ExpectClose(g[1], g_naive[1], 1e-11);
    EXPECT_GT(g_naive[0].abs().max().item<double>(), 1e-3);
  }
}

TEST(ChunkedTokenLogprobs, FlatHiddenMatchesBatchedHidden) {
  const Problem p = MakeProblem(at::kDouble);
  const at::Tensor batched = ChunkedTokenLogprobs(p.hidden, p.w, p.labels, 4, 1.0);
  const at::Tensor flat =
      ChunkedTokenLogprobs(p.hidden.reshape({-1, 8}), p.w, p.labels.reshape({-1}), 4, 1.0);
  EXPECT_EQ(batched.sizes(), p.labels.sizes());
  EXPECT_TRUE(at::equal(batched.reshape({-1}), flat));
}

TEST(ChunkedTokenLogprobs, Float32MatchesFloat64) {
  const Problem p64 = MakeProblem(at::kDouble);
  Problem p32{p64.hidden.detach().to(at::kFloat).requires_grad_(true),
              p64.w.detach().to(at::kFloat).requires_grad_(true), p64.labels,
              p64.upstream.to(at::kFloat)};
  auto chunked = [](auto& h, auto& w, auto& l) { return ChunkedTokenLogprobs(h, w, l, 5, 0.7); };
  const Grads a = LogprobsAndGrads(p64, chunked), b = LogprobsAndGrads(p32, chunked);
  EXPECT_EQ(b.logp.scalar_type(), at::kFloat);
  ExpectClose(b.logp.to(at::kDouble), a.logp, 1e-5);
  ExpectClose(b.hidden.to(at::kDouble), a.hidden, 1e-5);
  ExpectClose(b.w.to(at::kDouble), a.w, 1e-5);
}

TEST(ChunkedTokenLogprobs, TiedEmbeddingGradientsAddUp) {
  // The LM head is also the input embedding: hidden = tanh(W[ids] @ M).
  at::manual_seed(5);
  const auto opts = at::dtype(at::kDouble);
  const at::Tensor w = at::randn({11, 4}, opts).requires_grad_(true);
  const at::Tensor m = at::randn({4, 4}, opts);
  const at::Tensor ids = at::randint(0, 11, {2, 6}, at::kLong);
  const at::Tensor labels = at::randint(0, 11, {2, 6}, at::kLong);
  auto grad_w = [&](bool chunked) {
    const at::Tensor hidden = at::tanh(at::matmul(w.index_select(0, ids.reshape({-1})), m));
    const at::Tensor lbl = labels.reshape({-1});
    const at::Tensor logp = chunked ? ChunkedTokenLogprobs(hidden, w, lbl, 5, 1.3)
                                    : NaiveTokenLogprobs(hidden, w, lbl, 1.3);
    return torch::autograd::grad({logp.sum()}, {w})[0];
  };
  ExpectClose(grad_w(true), grad_w(false), 1e-12);
}

TEST(ChunkedTokenLogprobs, GradientOnlyWhereRequested) {
  const Problem p = MakeProblem(at::kDouble);
  const at::Tensor frozen_w = p.w.detach();
  const at::Tensor logp = ChunkedTokenLogprobs(p.hidden, frozen_w, p.labels, 5, 1.0);
  const auto g = torch::autograd::grad({(logp * p.upstream).sum()}, {p.hidden});
  const at::Tensor want = torch::autograd::grad(
      {(NaiveTokenLogprobs(p.hidden, frozen_w, p.labels, 1.0) * p.upstream).sum()}, {p.hidden})[0];
  ExpectClose(g[0], want, 1e-12);
}

TEST(ChunkedTokenLogprobs, BadInputsThrowNamingTheProblem) {
  const Problem p = MakeProblem(at::kDouble);
  auto expect_throw = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, expected: " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_throw([&] { ChunkedTokenLogprobs(p.hidden, p.w, p.labels, 0, 1.0); }, "chunk_tokens");
  expect_throw([&] { ChunkedTokenLogprobs(p.hidden, p.w, p.labels, 4, 0.0); }, "temperature");
  expect_throw([&] { ChunkedTokenLogprobs(p.hidden, p.w, p.labels + 29, 4, 1.0); },
               "labels must be in [0, 29)");
  expect_throw([&] { ChunkedTokenLogprobs(p.hidden, p.w, p.labels.reshape({-1}), 4, 1.0); },
               "labels must be");
  expect_throw([&] { ChunkedTokenLogprobs(p.hidden, p.w.narrow(1, 0, 7), p.labels, 4, 1.0); },
               "D = 8");
  expect_throw([&] { ChunkedTokenLogprobs(p.hidden, p.w.to(at::kFloat), p.labels, 4, 1.0); },
               "lm_weight is Float");
  expect_throw([&] { ChunkedTokenLogprobs(p.hidden, p.w, p.labels.to(at::kFloat), 4, 1.0); },
               "labels must be integer");
  expect_throw([&] { NaiveTokenLogprobs(p.hidden[0][0], p.w, p.labels, 1.0); }, "hidden must be");
}

// The fused path (log-probs and the LM head's loss gradient in one pass per chunk) against the
// plain one: naive full-logits log-probs, ComputeGrpoLoss, autograd. Every loss type, on- and
// off-policy (old log-probs), with KL (ref), IS correction (beh), padding, temperature and
// several chunks per micro-batch; float64 so only the algorithm can differ.
TEST(FusedTokenLogprobsLoss, GradientsLossAndEntropyMatchAutogradThroughTheLoss) {
  const Problem p = MakeProblem(at::kDouble);  // B 3, T 13, D 8, V 29
  const int64_t b = 3, t = 13;
  at::manual_seed(11);
  at::Tensor mask = at::ones({b, t}, at::kDouble);
  mask[1].narrow(0, 9, 4).zero_();  // a short completion
  mask[2].narrow(0, 5, 8).zero_();
  const at::Tensor adv = at::tensor({1.3, -0.7, 0.4}, at::kDouble);
  at::Tensor base;
  {
    at::NoGradGuard no_grad;
    base = NaiveTokenLogprobs(p.hidden, p.w, p.labels, 0.8);
  }
  const at::Tensor old = base + 0.3 * at::randn({b, t}, at::kDouble);  // some tokens clip
  const at::Tensor ref = base + 0.2 * at::randn({b, t}, at::kDouble);
  const at::Tensor beh = old + 0.2 * at::randn({b, t}, at::kDouble);

  // Every token-separable objective; on-policy, and off-policy with the KL term (bias-corrected)
  // and a token-level, then a sequence-level IS correction (its weights come from old and beh,
  // so they are constants of the chunk).
  for (const loss::Objective& objective : loss::Objectives()) {
    if (!objective.token_separable) continue;
    const LossType lt = objective.type;
    for (int mode : {0, 1, 2, 3}) {
      // Mode 3: mode 1 with TRL's entropy bonus (its gradient joins the chunk's as dL/dH).
      const bool bonus = mode == 3;
      const bool off_policy = mode != 0;
      GrpoLossConfig cfg;
      cfg.entropy_coef = bonus ? 0.3 : 0.0;
      cfg.loss_type = lt;
      cfg.epsilon_high = lt == LossType::kCispo ? 1.2 : 0.28;
      cfg.beta = off_policy ? 0.05 : 0.0;
      cfg.max_completion_length = t;
      cfg.importance_sampling_correction = mode == 0 ? ImportanceSamplingCorrection::kNone
                                           : mode == 2
                                               ? ImportanceSamplingCorrection::kSequenceMask
                                               : ImportanceSamplingCorrection::kTokenTruncate;
      if (mode == 2) cfg.importance_sampling_min = 0.5;
      ASSERT_TRUE(TokenSeparable(cfg, off_policy));
      LossNormaliser norm;
      norm.step_completion_tokens = 2.0 * mask.sum().item<double>();  // a 2-micro-batch step
      norm.gradient_accumulation_steps = 2;
      norm.entropy_bonus_scale = bonus ? 37.0 : 1.0;
      GrpoLossInputs in;
      in.mask = mask;
      in.advantages = adv;
      if (off_policy) {
        in.old = old;
        in.ref = ref;
        in.beh = beh;
      }
      const std::string where = std::string(LossTypeName(lt)) + " mode " + std::to_string(mode);

      // Reference: full logits, autograd through the loss.
      GrpoLossInputs ref_in = in;
      at::Tensor e_naive;
      ref_in.logp = NaiveTokenLogprobs(p.hidden, p.w, p.labels, 0.8, &e_naive);
      if (bonus) ref_in.entropy = e_naive;  // differentiable: autograd takes the bonus through it
      auto ref_out = ComputeGrpoLoss(cfg, ref_in, norm);
      ASSERT_TRUE(ref_out.ok()) << ref_out.status().ToString();
      const auto ref_g = torch::autograd::grad({ref_out->loss}, {p.hidden, p.w});

      // Fused, 5-token chunks over the 39 tokens.
      Status error;
      auto token_grad = GrpoTokenLossGrad(cfg, in, norm, &error);
      ASSERT_TRUE(token_grad.ok()) << token_grad.status().ToString();
      at::Tensor logp, entropy;
      const at::Tensor entropy_grad =
          bonus ? loss::EntropyBonusTokenGrad(mask, cfg.entropy_coef, norm) : at::Tensor();
      const at::Tensor anchor = FusedTokenLogprobsLoss(p.hidden, p.w, p.labels, *token_grad, &logp,
                                                       5, 0.8, &entropy, entropy_grad);
      ASSERT_TRUE(error.ok()) << error.ToString();
      EXPECT_EQ(anchor.item<double>(), 0.0);
      EXPECT_FALSE(logp.requires_grad());
      const auto g = torch::autograd::grad({anchor}, {p.hidden, p.w});
      ExpectClose(logp, ref_in.logp.detach(), 1e-12);
      ExpectClose(entropy, e_naive.detach(), 1e-12);
      ExpectClose(g[0], ref_g[0], 1e-12);
      ExpectClose(g[1], ref_g[1], 1e-12);
      EXPECT_GT(ref_g[1].abs().max().item<double>(), 1e-4) << where;  // a gradient to compare

      GrpoLossInputs fused_in = in;
      fused_in.logp = logp;
      if (bonus) fused_in.entropy = entropy;
      auto fused_out = ComputeGrpoLoss(cfg, fused_in, norm);
      ASSERT_TRUE(fused_out.ok());
      EXPECT_NEAR(fused_out->metrics.loss, ref_out->metrics.loss, 1e-12) << where;
    }
  }
}

// The fused path is refused where a token's gradient depends on other tokens' current values:
// vespo's sequence weight, the off-policy sequence mask, GSPO's sequence ratio, and a
// sequence-level IS correction whose `old` would be logp.detach().
TEST(FusedTokenLogprobsLoss, IsRefusedWhereTheLossCouplesTokens) {
  const at::Tensor mask = at::ones({2, 3}, at::kDouble);
  GrpoLossInputs in;
  in.mask = mask;
  in.advantages = at::tensor({1.0, -1.0}, at::kDouble);
  const LossNormaliser norm{.step_completion_tokens = 6, .gradient_accumulation_steps = 1};
  Status error;
  std::vector<GrpoLossConfig> coupled(4);
  coupled[0].loss_type = LossType::kVespo;
  coupled[1].off_policy_mask_threshold = 0.5;
  coupled[2].importance_sampling_level = ImportanceSamplingLevel::kSequence;
  coupled[3].importance_sampling_correction = ImportanceSamplingCorrection::kSequenceTruncate;
  for (const GrpoLossConfig& cfg : coupled) {
    EXPECT_FALSE(TokenSeparable(cfg, /*has_old=*/false));
    const Status s = GrpoTokenLossGrad(cfg, in, norm, &error).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("token-separable"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(TokenSeparable(coupled[3], /*has_old=*/true));  // weights from old and beh alone
  EXPECT_TRUE(TokenSeparable(GrpoLossConfig{}, false));
}

}  // namespace
}  // namespace grpo::learner
