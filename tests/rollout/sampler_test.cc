#include "rollout/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace grpo::rollout {
namespace {

// logits [2, 1, 0, -1]; softmax = [0.643914, 0.236883, 0.087144, 0.032059].
at::Tensor FourLogits() { return at::tensor({2.0f, 1.0f, 0.0f, -1.0f}).unsqueeze(0); }

void ExpectProbs(const at::Tensor& probs, const std::vector<double>& expected, double tol = 1e-5) {
  ASSERT_EQ(probs.size(1), static_cast<int64_t>(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(probs[0][i].item<double>(), expected[i], tol) << "token " << i;
  }
}

SamplingParams Params(double t, int64_t k = 0, double p = 1.0, std::optional<double> min_p = {},
                      double penalty = 1.0) {
  SamplingParams s;
  s.temperature = t;
  s.top_k = k;
  s.top_p = p;
  s.min_p = min_p;
  s.repetition_penalty = penalty;
  return s;
}

TEST(Sampler, NoFilterIsSoftmax) {
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0)),
              {0.643914, 0.236883, 0.087144, 0.032059});
}

TEST(Sampler, TemperatureDividesLogits) {
  // softmax([1, 0.5, 0, -0.5])
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(2.0)),
              {0.455054, 0.276004, 0.167405, 0.101536});
}

TEST(Sampler, TopKKeepsTheKLargest) {
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 2)), {0.731059, 0.268941, 0, 0});
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 3)), {0.665241, 0.244728, 0.090031, 0});
  // k larger than the vocabulary keeps everything.
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 10)),
              {0.643914, 0.236883, 0.087144, 0.032059});
}

TEST(Sampler, TopPDropsTheTailWhoseMassIsAtMostOneMinusP) {
  // Ascending cumulative mass: 0.0321, 0.1192, 0.3561, 1.
  // top_p 0.7: drop <= 0.3 -> tokens 3, 2.
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 0, 0.7)), {0.731059, 0.268941, 0, 0});
  // top_p 0.9: drop <= 0.1 -> token 3 only.
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 0, 0.9)),
              {0.665241, 0.244728, 0.090031, 0});
  // top_p 0.6: drop <= 0.4 -> everything but the top token.
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 0, 0.6)), {1, 0, 0, 0});
}

TEST(Sampler, MinPDropsTokensBelowFractionOfTopProb) {
  // Top prob 0.643914: min_p 0.2 -> threshold 0.1288 drops 0.0871 and 0.0321.
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 0, 1.0, 0.2)),
              {0.731059, 0.268941, 0, 0});
  // min_p 0.1 -> threshold 0.0644 drops only 0.0321.
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(1.0, 0, 1.0, 0.1)),
              {0.665241, 0.244728, 0.090031, 0});
}

TEST(Sampler, WarpersApplyInHuggingFaceOrder) {
  // T=2: [1, .5, 0, -.5]; top_k 3: softmax([1, .5, 0]) = [0.506480, 0.307196, 0.186324];
  // top_p 0.8 drops ascending mass <= 0.2 -> token 2; renormalised [0.622459, 0.377541];
  // min_p 0.5 -> threshold 0.311 keeps both, min_p 0.7 -> threshold 0.436 keeps only token 0.
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(2.0, 3, 0.8, 0.5)),
              {0.622459, 0.377541, 0, 0});
  ExpectProbs(FilteredProbs(FourLogits(), {}, Params(2.0, 3, 0.8, 0.7)), {1, 0, 0, 0});
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  at::Tensor seen = at::tensor({1, 0, 0, 1}).to(at::kBool).unsqueeze(0);
  at::Tensor x = ProcessLogits(FourLogits(), seen, Params(1.0, 0, 1.0, {}, 2.0));
  // 2 / 2 = 1 (seen), 1 (unseen), 0 (unseen), -1 * 2 = -2 (seen).
  EXPECT_TRUE(at::allclose(x, at::tensor({1.0f, 1.0f, 0.0f, -2.0f}).unsqueeze(0)));
  ExpectProbs(FilteredProbs(FourLogits(), seen, Params(1.0, 0, 1.0, {}, 2.0)),
              {0.413622, 0.413622, 0.152163, 0.020593});
}

TEST(Sampler, GreedyIsArgmaxWithUnitTemperatureLogprob) {
  at::manual_seed(1);
  at::Tensor logits = at::randn({8, 100});
  std::vector<at::Generator> gens;  // greedy draws nothing
  auto out = Sample(logits, {}, Params(0.0), gens);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(at::equal(out->tokens, logits.argmax(1)));
  at::Tensor expected = std::get<0>(logits.log_softmax(1).max(1));
  EXPECT_TRUE(at::allclose(out->logprobs, expected, 1e-6, 1e-6));
}

TEST(Sampler, GreedyAppliesRepetitionPenalty) {
  at::Tensor seen = at::tensor({1, 0, 0, 0}).to(at::kBool).unsqueeze(0);
  std::vector<at::Generator> gens;
  // [2, 1, 0, -1] with penalty 4 on token 0 -> [0.5, 1, 0, -1]: argmax 1.
  auto out = Sample(FourLogits(), seen, Params(0.0, 0, 1.0, {}, 4.0), gens);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->tokens[0].item<int64_t>(), 1);
}

TEST(Sampler, LogprobIsOfTheUnfilteredTemperedDistribution) {
  at::manual_seed(2);
  at::Tensor logits = at::randn({16, 50});
  std::vector<at::Generator> gens;
  for (int i = 0; i < 16; ++i) gens.push_back(MakeRowGenerator(3, 0, i));
  auto out = Sample(logits, {}, Params(0.7, 5, 0.9, 0.05), gens);
  ASSERT_TRUE(out.ok());
  at::Tensor expected =
      (logits / 0.7).log_softmax(1).gather(1, out->tokens.unsqueeze(1)).squeeze(1);
  EXPECT_TRUE(at::allclose(out->logprobs, expected, 1e-6, 1e-6));
}

// Pearson chi-square of counts vs probabilities over the tokens with p > 0; counts of tokens
// with p == 0 must be 0.
double ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n,
                 int* dof) {
  double chi2 = 0;
  *dof = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = p[i] * n;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
    ++*dof;
  }
  return chi2;
}

TEST(Sampler, EmpiricalFrequenciesMatchHandComputedTopK) {
  const int64_t n = 20000;
  at::Tensor logits = FourLogits().expand({n, 4}).contiguous();
  std::vector<at::Generator> gens;
  for (int64_t i = 0; i < n; ++i) gens.push_back(MakeRowGenerator(11, i, 0));
  auto out = Sample(logits, {}, Params(1.0, 3), gens);
  ASSERT_TRUE(out.ok());
  std::vector<int64_t> counts(4, 0);
  for (int64_t i = 0; i < n; ++i) ++counts[out->tokens[i].item<int64_t>()];
  int dof = 0;
  const double chi2 = ChiSquare(counts, {0.665241, 0.244728, 0.090031, 0.0}, n, &dof);
  EXPECT_EQ(dof, 2);
  EXPECT_LT(chi2, 27.6);  // P(chi2_2 > 27.6) = 1e-6
}

TEST(Sampler, EmpiricalFrequenciesMatchFilteredDistribution) {
  // One row sampled many times from its own stream.
  at::manual_seed(5);
  at::Tensor logits = at::randn({1, 30}) * 2;
  const SamplingParams params = Params(0.8, 20, 0.95, 0.02);
  at::Tensor probs = FilteredProbs(logits, {}, params).to(at::kDouble);
  std::vector<double> p(probs.data_ptr<double>(), probs.data_ptr<double>() + 30);
  std::vector<at::Generator> gens{MakeRowGenerator(12, 0, 0)};
  const int64_t n = 20000;
  std::vector<int64_t> counts(30, 0);
  for (int64_t i = 0; i < n; ++i) {
    auto out = Sample(logits, {}, params, gens);
    ASSERT_TRUE(out.ok());
    ++counts[out->tokens[0].item<int64_t>()];
  }
  int dof = 0;
  const double chi2 = ChiSquare(counts, p, n, &dof);
  ASSERT_GT(dof, 3);
  // Mean dof, sd sqrt(2 dof): a bound 8 sd above the mean.
  EXPECT_LT(chi2, dof + 8 * std::sqrt(2.0 * dof));
}

TEST(Sampler, RowStreamDoesNotDependOnOtherRows) {
  at::manual_seed(6);
  at::Tensor logits = at::randn({3, 40});
  const SamplingParams params = Params(1.0);
  std::vector<at::Generator> batch{MakeRowGenerator(9, 0, 0), MakeRowGenerator(9, 1, 0),
                                   MakeRowGenerator(9, 2, 0)};
  std::vector<at::Generator> alone{MakeRowGenerator(9, 2, 0)};
  for (int step = 0; step < 20; ++step) {
    auto a = Sample(logits, {}, params, batch);
    auto b = Sample(logits.narrow(0, 2, 1), {}, params, alone);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->tokens[2].item<int64_t>(), b->tokens[0].item<int64_t>()) << "step " << step;
  }
}

TEST(Sampler, RowGeneratorsDifferAcrossPromptAndGenerationIndex) {
  at::Generator a = MakeRowGenerator(1, 0, 0), b = MakeRowGenerator(1, 0, 1),
                c = MakeRowGenerator(1, 1, 0), d = MakeRowGenerator(1, 0, 0);
  const double ua = NextUniform(a);
  EXPECT_NE(ua, NextUniform(b));
  EXPECT_NE(ua, NextUniform(c));
  EXPECT_EQ(ua, NextUniform(d));
  EXPECT_GE(ua, 0.0);
  EXPECT_LT(ua, 1.0);
}

TEST(Sampler, ValidateNamesTheKey) {
  EXPECT_NE(Params(-1).Validate().message().find("temperature"), std::string::npos);
  EXPECT_NE(Params(1, -1).Validate().message().find("top_k"), std::string::npos);
  EXPECT_NE(Params(1, 0, 1.5).Validate().message().find("top_p"), std::string::npos);
  EXPECT_NE(Params(1, 0, 1, 2.0).Validate().message().find("min_p"), std::string::npos);
  EXPECT_NE(Params(1, 0, 1, {}, 0).Validate().message().find("repetition_penalty"),
            std::string::npos);
  EXPECT_TRUE(Params(0.7, 50, 0.9, 0.1, 1.1).Validate().ok());
}

TEST(Sampler, BadShapesAreInvalidArgument) {
  std::vector<at::Generator> gens{MakeRowGenerator(1, 0, 0)};
  EXPECT_EQ(Sample(at::zeros({4}), {}, Params(1), gens).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Sample(at::zeros({2, 4}), {}, Params(1), gens).status().code(),
            StatusCode::kInvalidArgument);  // 1 generator for 2 rows
  EXPECT_EQ(
      Sample(at::zeros({1, 4}), at::zeros({1, 3}, at::kBool), Params(1), gens).status().code(),
      StatusCode::kInvalidArgument);
}

// The window form the generator uses on a GPU: the same uniforms give the same tokens and
// log-probs as drawing them from the generators inside Sample.
TEST(Sampler, GivenUniformsDrawWhatTheGeneratorsWould) {
  const at::Tensor logits = at::randn({5, 40}, at::kFloat);
  SamplingParams p;
  p.temperature = 0.7;
  p.top_k = 10;
  std::vector<at::Generator> gens, copies;
  for (int i = 0; i < 5; ++i) {
    gens.push_back(MakeRowGenerator(3, i, 0));
    copies.push_back(MakeRowGenerator(3, i, 0));
  }
  auto drawn = Sample(logits, at::Tensor(), p, gens);
  ASSERT_TRUE(drawn.ok());
  std::vector<double> u;
  for (auto& g : copies) u.push_back(NextUniform(g));
  auto given = SampleWithUniforms(logits, at::Tensor(), p, at::tensor(u, at::kDouble));
  ASSERT_TRUE(given.ok());
  EXPECT_TRUE(at::equal(drawn->tokens, given->tokens));
  EXPECT_TRUE(at::equal(drawn->logprobs, given->logprobs));
}

TEST(Sampler, GivenUniformsMustBeOneFloat64PerRow) {
  const at::Tensor logits = at::randn({3, 8}, at::kFloat);
  SamplingParams p;
  for (const at::Tensor& u :
       {at::Tensor(), at::rand({2}, at::kDouble), at::rand({3}, at::kFloat)}) {
    auto r = SampleWithUniforms(logits, at::Tensor(), p, u);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  p.temperature = 0;  // greedy draws nothing
  EXPECT_TRUE(SampleWithUniforms(logits, at::Tensor(), p, at::Tensor()).ok());
}

}  // namespace
}  // namespace grpo::rollout
