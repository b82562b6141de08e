// In-flight weight updates (GeneratorOptions::partial_rollouts, rollout/generator.h): a policy
// installed while a Generate call decodes is switched to at the end of the current window. The
// reference for every behaviour log-prob is a full forward (no KV cache) of the sequence the row
// ended with, under the policy its token version names: with the cache recomputed at the switch,
// every token's log-prob is that policy's (so no key/value was read under other weights); with it
// kept, the tokens after the switch read the old policy's keys/values and differ from it.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "rollout/decode_parts.h"
#include "rollout/generator.h"
#include "tests/rollout/scaled_tiny_model.h"

namespace grpo::rollout {
namespace {

using common::Model;

// The reference for RestartSharingPrompts: a KV stepper holding `contexts` (each a prompt and
// its completion so far but the last token), left-padded and prefilled whole.
std::unique_ptr<decode::KvStepper> WholeContexts(const Model& model,
                                                 const std::vector<std::vector<int32_t>>& contexts,
                                                 int64_t remaining) {
  auto [ids, mask] = decode::LeftPadded(contexts);
  auto stepper = std::make_unique<decode::KvStepper>(model);
  stepper->Start(ids, mask, /*g=*/1, ids.size(1) + remaining + 1);
  return stepper;
}

constexpr int64_t kMaxNew = 12, kSwitchAt = 5, kG = 3;

// Rows stop at <|im_end|> (258) or kMaxNew; those that stop before kSwitchAt never switch.
GeneratorOptions Options(bool partial, bool recompute) {
  GeneratorOptions o;
  o.num_generations = kG;
  o.max_completion_length = kMaxNew;
  o.seed = 321;
  o.eos_token_ids = {258};
  o.stop_check_interval = 1;
  o.partial_rollouts = partial;
  o.recompute_kv_on_update = recompute;
  return o;
}

struct Outcome {
  GenerateResult result;
  int hook_calls = 0;
};

// One Generate call of two prompts with version 4 of `a`; with `b`, version 5 of it is installed
// by the window hook once kSwitchAt tokens were decoded.
Outcome Generate(bool partial, bool recompute, std::shared_ptr<const Model> a,
                 std::shared_ptr<const Model> b, const std::vector<std::vector<int32_t>>& prompts) {
  GeneratorOptions o = Options(partial, recompute);
  Generator* self = nullptr;
  Outcome run;
  o.window_hook = [&](int64_t steps) {
    ++run.hook_calls;
    if (steps == kSwitchAt && b != nullptr) {
      EXPECT_TRUE(self->SetPolicy(b, 5).ok());
    }
  };
  auto gen = Generator::Create(a, 4, o);
  EXPECT_TRUE(gen.ok()) << gen.status().ToString();
  self = gen->get();
  auto r = (*gen)->Generate(prompts);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  run.result = std::move(r).value();
  return run;
}

const std::vector<std::vector<int32_t>> kPrompts = {{5, 17, 42, 99, 3}, {200, 11, 7}};

TEST(PartialRollouts, TokensAfterTheSwitchRecordTheNewVersionAndItsLogprobsWithARecomputedCache) {
  const auto a = ScaledTinyModel(1), b = ScaledTinyModel(2);
  const Outcome run = Generate(/*partial=*/true, /*recompute=*/true, a, b, kPrompts);
  EXPECT_EQ(run.result.policy_version, 4);  // the groups keep their oldest token's version
  double max_diff = 0;
  int64_t after_switch = 0;
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    const common::RolloutGroup& group = *run.result.groups[p];
    EXPECT_EQ(group.policy_version, 4);
    for (int64_t k = 0; k < kG; ++k) {
      const common::Completion& c = group.completions[k];
      ASSERT_EQ(c.token_versions.size(), c.token_ids.size());
      const std::vector<double> under_a = TeacherForced(*a, kPrompts[p], c.token_ids);
      const std::vector<double> under_b = TeacherForced(*b, kPrompts[p], c.token_ids);
      for (int64_t j = 0; j < static_cast<int64_t>(c.token_ids.size()); ++j) {
        // Tokens 0..kSwitchAt-1 were sampled before the switch, the rest after it.
        EXPECT_EQ(c.token_versions[j], j < kSwitchAt ? 4 : 5) << p << "/" << k << " token " << j;
        const double want = j < kSwitchAt ? under_a[j] : under_b[j];
        max_diff = std::max(max_diff, std::abs(c.logprobs[j] - want));
        after_switch += j >= kSwitchAt;
      }
    }
  }
  EXPECT_LT(max_diff, 1e-4);
  EXPECT_GE(after_switch, 10) << "few rows got past the switch: the test shows little";
}

TEST(PartialRollouts, AKeptCacheIsReadUnderTheNewWeightsAndTheMismatchShows) {
  const auto a = ScaledTinyModel(1), b = ScaledTinyModel(2);
  const Outcome run = Generate(/*partial=*/true, /*recompute=*/false, a, b, kPrompts);
  double before = 0, after = 0;
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    for (const common::Completion& c : run.result.groups[p]->completions) {
      ASSERT_EQ(c.token_versions.size(), c.token_ids.size());
      const std::vector<double> under_a = TeacherForced(*a, kPrompts[p], c.token_ids);
      const std::vector<double> under_b = TeacherForced(*b, kPrompts[p], c.token_ids);
      for (int64_t j = 0; j < static_cast<int64_t>(c.token_ids.size()); ++j) {
        EXPECT_EQ(c.token_versions[j], j < kSwitchAt ? 4 : 5) << "token " << j;
        double& worst = j < kSwitchAt ? before : after;
        worst = std::max(worst, std::abs(c.logprobs[j] - (j < kSwitchAt ? under_a : under_b)[j]));
      }
    }
  }
  EXPECT_LT(before, 1e-4);
  // The old keys/values change what the new weights predict: by far more than rounding.
  EXPECT_GT(after, 1e-2);
}

TEST(PartialRollouts, TheSameWeightsUnderANewVersionSampleTheSameTokens) {
  const auto a = ScaledTinyModel(1);
  const Outcome plain = Generate(/*partial=*/false, true, a, nullptr, kPrompts);
  for (bool recompute : {true, false}) {
    const Outcome switched = Generate(/*partial=*/true, recompute, a, a, kPrompts);
    for (size_t p = 0; p < kPrompts.size(); ++p) {
      for (int64_t k = 0; k < kG; ++k) {
        const common::Completion& x = plain.result.groups[p]->completions[k];
        const common::Completion& y = switched.result.groups[p]->completions[k];
        EXPECT_EQ(x.token_ids, y.token_ids) << recompute << " " << p << "/" << k;
        EXPECT_TRUE(x.token_versions.empty());
        for (size_t j = 0; j < x.logprobs.size(); ++j) {
          EXPECT_NEAR(x.logprobs[j], y.logprobs[j], 1e-4) << recompute << " token " << j;
        }
      }
    }
  }
}

// The recompute of a switch shares each prompt's prefill among its rows: prompts of 5 and 9
// tokens, 3 rows each (and a third prompt no row holds), every row 4 fed completion tokens. It
// runs 5 + 9 + 6 x 4 = 38 tokens through the model, where a prefill of the whole contexts runs
// 3 x (5 + 4) + 3 x (9 + 4) = 66; and the next two steps give its logits. Rows whose fed
// lengths differ (continuous batching's groups, one with none fed yet) share it too:
// 5 + 4 + 0 + 5 = 14 tokens where the whole contexts take 3 x 5 + 9 = 24, with their logits.
TEST(PartialRollouts, ARecomputeSharesEachPromptsPrefillAndGivesTheWholeContextsLogits) {
  const auto model = ScaledTinyModel(3);
  const std::vector<std::vector<int32_t>> prompts = {
      {5, 17, 42, 99, 3}, {7, 7}, {200, 11, 7, 1, 2, 3, 4, 5, 6}};
  const std::vector<int64_t> row_prompt = {0, 0, 2, 0, 2, 2};
  const std::vector<std::vector<int32_t>> fed = {{1, 2, 3, 4},     {9, 8, 7, 6}, {4, 4, 4, 4},
                                                 {30, 31, 32, 33}, {5, 6, 7, 8}, {1, 1, 2, 2}};
  std::vector<std::vector<int32_t>> contexts;
  for (size_t i = 0; i < fed.size(); ++i) {
    contexts.push_back(prompts[row_prompt[i]]);
    contexts.back().insert(contexts.back().end(), fed[i].begin(), fed[i].end());
  }
  int64_t prefilled = -1;
  auto shared =
      decode::RestartSharingPrompts(*model, prompts, row_prompt, fed, 6, at::kCPU, &prefilled);
  EXPECT_EQ(prefilled, 38);
  auto whole = WholeContexts(*model, contexts, 6);
  for (const std::vector<int64_t>& next :
       {std::vector<int64_t>{3, 1, 4, 1, 5, 9}, std::vector<int64_t>{2, 6, 5, 3, 5, 8}}) {
    const at::Tensor tokens = at::tensor(next, at::kLong);
    const at::Tensor a = shared->Step(tokens), b = whole->Step(tokens);
    EXPECT_LT((a - b).abs().max().item<double>(), 1e-4 * b.abs().max().item<double>());
  }
  // Unequal fed lengths, one row with none.
  const std::vector<std::vector<int32_t>> ragged = {{1, 2, 3, 4}, {}, {4, 4, 4, 4, 4}};
  auto unequal =
      decode::RestartSharingPrompts(*model, prompts, {0, 0, 0}, ragged, 6, at::kCPU, &prefilled);
  EXPECT_EQ(prefilled, 14);
  std::vector<std::vector<int32_t>> ragged_contexts;
  for (const auto& f : ragged) {
    ragged_contexts.push_back(prompts[0]);
    ragged_contexts.back().insert(ragged_contexts.back().end(), f.begin(), f.end());
  }
  auto ragged_whole = WholeContexts(*model, ragged_contexts, 6);
  for (const std::vector<int64_t>& next :
       {std::vector<int64_t>{3, 1, 4}, std::vector<int64_t>{2, 6, 5}}) {
    const at::Tensor tokens = at::tensor(next, at::kLong);
    const at::Tensor a = unequal->Step(tokens), b = ragged_whole->Step(tokens);
    EXPECT_LT((a - b).abs().max().item<double>(), 1e-4 * b.abs().max().item<double>());
  }
  // No fed token yet (a switch after the first): the prompts alone, 5 + 9.
  auto first = decode::RestartSharingPrompts(
      *model, prompts, row_prompt, std::vector<std::vector<int32_t>>(6), 6, at::kCPU, &prefilled);
  EXPECT_EQ(prefilled, 14);
  const at::Tensor tokens = at::tensor(std::vector<int64_t>{3, 1, 4, 1, 5, 9}, at::kLong);
  std::vector<std::vector<int32_t>> prompts_only;
  for (int64_t k : row_prompt) prompts_only.push_back(prompts[k]);
  auto plain = WholeContexts(*model, prompts_only, 6);
  const at::Tensor a = first->Step(tokens), b = plain->Step(tokens);
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-4 * b.abs().max().item<double>());
}

// A long-tail switch: prompts whose rows were fed 12, 5 and 1 tokens (more than 2x apart) are
// prefilled in three buckets, joined and put back in row order (rows interleaved here): the
// same 5 + 9 + 3 prompt tokens once each and 2 x 12 + 2 x 1 + 5 = 31 fed tokens, where one
// bucket would have run every row to 12 (5 x 12 = 60). Each row's logits at the next two steps
// are those of its whole context, and so are the logits after the rows decode past the
// longest's columns.
TEST(PartialRollouts, ARecomputeOfFedLengthsFarApartGivesTheWholeContextsLogits) {
  const auto model = ScaledTinyModel(4);
  const std::vector<std::vector<int32_t>> prompts = {
      {5, 17, 42, 99, 3}, {200, 11, 7, 1, 2, 3, 4, 5, 6}, {8, 9, 10}};
  const std::vector<int64_t> row_prompt = {1, 0, 2, 0, 1};
  const std::vector<std::vector<int32_t>> fed = {{40},
                                                 {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
                                                 {21, 22, 23, 24, 25},
                                                 {12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1},
                                                 {41}};
  std::vector<std::vector<int32_t>> contexts;
  for (size_t i = 0; i < fed.size(); ++i) {
    contexts.push_back(prompts[row_prompt[i]]);
    contexts.back().insert(contexts.back().end(), fed[i].begin(), fed[i].end());
  }
  constexpr int64_t kRemaining = 8;
  int64_t prefilled = -1;
  auto bucketed = decode::RestartSharingPrompts(*model, prompts, row_prompt, fed, kRemaining,
                                                at::kCPU, &prefilled);
  EXPECT_EQ(prefilled, 5 + 9 + 3 + 31);
  auto whole = WholeContexts(*model, contexts, kRemaining);
  for (int step = 0; step < kRemaining; ++step) {
    std::vector<int64_t> next;
    for (int64_t r = 0; r < 5; ++r) next.push_back((7 * step + 3 * r + 1) % 250);
    const at::Tensor tokens = at::tensor(next, at::kLong);
    const at::Tensor a = bucketed->Step(tokens), b = whole->Step(tokens);
    EXPECT_LT((a - b).abs().max().item<double>(), 1e-4 * b.abs().max().item<double>())
        << "step " << step;
  }
}

TEST(PartialRollouts, WithoutTheKeyACallKeepsItsSnapshotAndRecordsNoVersions) {
  const auto a = ScaledTinyModel(1), b = ScaledTinyModel(2);
  const Outcome run = Generate(/*partial=*/false, true, a, b, kPrompts);
  EXPECT_GT(run.hook_calls, kSwitchAt);
  for (size_t p = 0; p < kPrompts.size(); ++p) {
    for (const common::Completion& c : run.result.groups[p]->completions) {
      EXPECT_TRUE(c.token_versions.empty());
      const std::vector<double> under_a = TeacherForced(*a, kPrompts[p], c.token_ids);
      for (size_t j = 0; j < c.token_ids.size(); ++j) {
        EXPECT_NEAR(c.logprobs[j], under_a[j], 1e-4) << "token " << j;
      }
    }
  }
}

}  // namespace
}  // namespace grpo::rollout
