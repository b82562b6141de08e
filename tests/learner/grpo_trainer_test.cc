#include "learner/grpo_trainer.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "tests/learner/trainer_test_util.h"

namespace grpo::learner {
namespace {

using common::Completion;
using common::RolloutGroup;
using trainer_test::MakeGroups;
using trainer_test::TinyModel;

common::GrpoConfig BaseConfig() {
  common::GrpoConfig c;
  c.num_generations = 4;
  c.per_device_train_batch_size = 8;
  c.gradient_accumulation_steps = 1;
  c.max_completion_length = 16;
  c.learning_rate = 1e-2;
  c.lr_scheduler_type = "constant";
  c.max_grad_norm = 0;  // measure only
  c.importance_sampling_correction = "none";
  c.logprob_chunk_tokens = 5;  // several chunks per micro-batch
  return c;
}

// Parameter change of one optimizer step. With adam_epsilon = 1 and small gradients the
// first AdamW step is lr * g / (|g| + 1) ~ lr * g: the change tracks the gradient itself.
std::vector<at::Tensor> StepDelta(common::GrpoConfig cfg, const std::vector<RolloutGroup>& g,
                                  double* loss) {
  cfg.adam_epsilon = 1.0;
  auto model = TinyModel();
  std::vector<at::Tensor> before;
  for (auto& p : model->Parameters()) before.push_back(p.detach().clone());
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  EXPECT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto r = (*trainer)->TrainGenerationBatch(g);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->steps.size(), 1u);
  *loss = r->steps[0].loss;
  std::vector<at::Tensor> delta;
  auto params = model->Parameters();
  for (size_t i = 0; i < params.size(); ++i) delta.push_back(params[i].detach() - before[i]);
  return delta;
}

double RelDiff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]).pow(2).sum().item<double>();
    den += a[i].pow(2).sum().item<double>();
  }
  return std::sqrt(num / den);
}

class SplitInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(SplitInvariance, StepUpdateDoesNotDependOnMicroBatchSplit) {
  // G = 8 sequences of one group, one optimizer step, split into 1, 2 or 8 micro-batches.
  auto groups = MakeGroups(1, 8, 3);
  common::GrpoConfig cfg = BaseConfig();
  cfg.num_generations = 8;
  cfg.loss_type = GetParam();
  double loss1, loss2, loss8;
  cfg.per_device_train_batch_size = 8;
  cfg.gradient_accumulation_steps = 1;
  auto d1 = StepDelta(cfg, groups, &loss1);
  cfg.per_device_train_batch_size = 4;
  cfg.gradient_accumulation_steps = 2;
  auto d2 = StepDelta(cfg, groups, &loss2);
  cfg.per_device_train_batch_size = 1;
  cfg.gradient_accumulation_steps = 8;
  auto d8 = StepDelta(cfg, groups, &loss8);
  if (GetParam() == "grpo" || GetParam() == "dapo" || GetParam() == "dr_grpo") {
    // grpo averages per sequence, dapo/dr_grpo per step-level constants: split-free.
    EXPECT_LT(RelDiff(d1, d2), 1e-4);
    EXPECT_LT(RelDiff(d1, d8), 1e-4);
    EXPECT_NEAR(loss1, loss2, 1e-5);
    EXPECT_NEAR(loss1, loss8, 1e-5);
  } else {
    // bnpo normalises by the micro-batch's own tokens (TRL): only the 1-vs-1 split is equal,
    // so check against a fresh run with the same split instead.
    double again;
    auto d2b = StepDelta(cfg, groups, &again);
    EXPECT_LT(RelDiff(d8, d2b), 1e-6);
  }
  double norm = 0;
  for (auto& t : d1) norm += t.pow(2).sum().item<double>();
  EXPECT_GT(norm, 0.0);  // something trained
}

INSTANTIATE_TEST_SUITE_P(LossTypes, SplitInvariance,
                         ::testing::Values("grpo", "bnpo", "dr_grpo", "dapo"));

// The fused path (token-level IS: log-probs and LM-head gradient in one pass) against the
// recompute path (sequence-level IS: autograd through chunked log-probs). On policy the ratio is
// 1 at every token, and with dapo aggregation the gradient is the same for both levels (by hand:
// token level, d/dlogp_t of -A r_t / N is -A / N; sequence level, each of a sequence's |o| terms
// -A s / N with s = exp(mean(logp - sg(logp))) contributes -A / (|o| N) to every token of it).
TEST(GrpoTrainer, FusedTokenPathAndRecomputeSequencePathGiveTheSameOnPolicyStep) {
  auto groups = MakeGroups(2, 4, 5);
  common::GrpoConfig cfg = BaseConfig();
  cfg.loss_type = "dapo";
  cfg.per_device_train_batch_size = 4;
  cfg.gradient_accumulation_steps = 2;
  double loss_token, loss_sequence;
  cfg.importance_sampling_level = "token";
  const auto d_token = StepDelta(cfg, groups, &loss_token);
  cfg.importance_sampling_level = "sequence";
  const auto d_sequence = StepDelta(cfg, groups, &loss_sequence);
  EXPECT_LT(RelDiff(d_token, d_sequence), 1e-4);
  EXPECT_NEAR(loss_token, loss_sequence, 1e-5);
  double norm = 0;
  for (auto& t : d_token) norm += t.pow(2).sum().item<double>();
  EXPECT_GT(norm, 0.0);
}

TEST(GrpoTrainer, EqualRewardsGiveZeroAdvantageAndLeaveWeightsUnchanged) {
  auto groups = MakeGroups(2, 4, 5);
  for (auto& g : groups)
    for (auto& c : g.completions) c.rewards = {0.5};
  auto model = TinyModel();
  std::vector<at::Tensor> before;
  for (auto& p : model->Parameters()) before.push_back(p.detach().clone());
  auto trainer = GrpoTrainer::Create(BaseConfig(), model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto r = (*trainer)->TrainGenerationBatch(groups);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 1u);
  EXPECT_EQ(r->steps[0].loss, 0.0);
  EXPECT_EQ(r->steps[0].grad_norm, 0.0);
  EXPECT_DOUBLE_EQ(r->steps[0].frac_reward_zero_std, 1.0);
  auto after = model->Parameters();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i]));
}

TEST(GrpoTrainer, NumIterationsGivesThatManyStepsPerGenerationBatch) {
  // Generation batch = 8 sequences = per_device_train_batch_size 4 x steps_per_generation 2,
  // gradient_accumulation_steps 2: one optimizer step per pass, num_iterations 3 passes.
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;
  cfg.gradient_accumulation_steps = 2;
  cfg.num_iterations = 3;
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto r = (*trainer)->TrainGenerationBatch(MakeGroups(2, 4, 9));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 3u);
  EXPECT_EQ((*trainer)->policy_version(), 3);
  // First pass: the policy still equals `old`, so the ratio is 1 and nothing is clipped.
  EXPECT_EQ(r->steps[0].clip_ratio_region, 0.0);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r->steps[i].iteration, i);
    EXPECT_EQ(r->steps[i].step, i + 1);
  }
}

TEST(GrpoTrainer, BadGroupsAreRejectedWithReasonsAndTheRestTrains) {
  auto groups = MakeGroups(7, 4, 11, /*version=*/0);
  groups[0].completions[1].rewards = {std::nan("")};
  groups[1].completions[2].token_ids.clear();
  groups[2].completions[0].token_ids.assign(17, 3);   // max_completion_length 16
  groups[3].completions[3].token_ids.push_back(259);  // vocab 259
  groups[4].completions[0].logprobs = {-0.5f};        // tokens != log-probs
  groups[5].completions.pop_back();                   // 3 of 4
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;  // 1 kept group = 4 sequences
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto r = (*trainer)->TrainGenerationBatch(groups);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->groups_trained, 1);
  ASSERT_EQ(r->rejected.size(), 6u);
  EXPECT_EQ(r->rejected[0].second, RejectReason::kNonFiniteReward);
  EXPECT_EQ(r->rejected[1].second, RejectReason::kEmptyCompletion);
  EXPECT_EQ(r->rejected[2].second, RejectReason::kCompletionTooLong);
  EXPECT_EQ(r->rejected[3].second, RejectReason::kTokenOutOfVocab);
  EXPECT_EQ(r->rejected[4].second, RejectReason::kLogprobLength);
  EXPECT_EQ(r->rejected[5].second, RejectReason::kGroupSize);
  EXPECT_EQ(r->steps.size(), 1u);
  EXPECT_EQ(r->steps[0].sequences, 4);
}

TEST(GrpoTrainer, StaleGroupsBeyondMaxStalenessAreRejected) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.max_staleness = 1;
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  (*trainer)->RestoreCounters(5, 5);
  auto groups = MakeGroups(2, 4, 13, /*version=*/4);
  groups[1].policy_version = 3;
  RejectReason reason;
  EXPECT_TRUE((*trainer)->ValidateGroup(groups[0], &reason).ok());
  Status s = (*trainer)->ValidateGroup(groups[1], &reason);
  EXPECT_EQ(reason, RejectReason::kStale);
  EXPECT_NE(s.message().find("max_staleness is 1"), std::string::npos) << s.message();
}

TEST(GrpoTrainer, BetaNeedsAReferenceModelAndReportsKl) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.beta = 0.1;
  auto model = TinyModel();
  EXPECT_FALSE(GrpoTrainer::Create(cfg, model.get(), nullptr).ok());
  auto trainer = GrpoTrainer::Create(cfg, model.get(), TinyModel());
  ASSERT_TRUE(trainer.ok());
  cfg.num_iterations = 1;
  auto r = (*trainer)->TrainGenerationBatch(MakeGroups(2, 4, 17));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->steps[0].has_kl);
  // The reference equals the policy before the first step: KL is 0 to rounding.
  EXPECT_NEAR(r->steps[0].kl, 0.0, 1e-6);
}

TEST(GrpoTrainer, BatchDumpHoldsInputsAndMetrics) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.dump_batches_dir = ::testing::TempDir() + "/grpo_dump_test";
  std::filesystem::remove_all(cfg.dump_batches_dir);
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto groups = MakeGroups(2, 4, 19);
  auto r = (*trainer)->TrainGenerationBatch(groups);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto f = common::SafetensorsFile::Open(cfg.dump_batches_dir + "/step-00000001.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto ids = (*f)->Get("completion_ids");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(0), 8);
  // Row 0's completion tokens, right-padded.
  const auto& c0 = groups[0].completions[0].token_ids;
  for (size_t t = 0; t < c0.size(); ++t) EXPECT_EQ((*ids)[0][t].item<int64_t>(), c0[t]);
  auto rewards = (*f)->Get("rewards");
  ASSERT_TRUE(rewards.ok());
  EXPECT_NEAR((*rewards)[5].item<double>(), *groups[1].completions[1].rewards[0], 1e-12);
  for (const char* name : {"prompt_ids", "prompt_mask", "completion_mask", "advantages",
                           "logprobs_first_micro_batch"}) {
    EXPECT_NE((*f)->Find(name), nullptr) << name;
  }
  auto metrics = nlohmann::json::parse((*f)->metadata().at("metrics"));
  EXPECT_DOUBLE_EQ(metrics["loss"].get<double>(), r->steps[0].loss);
}

// docs/GRPO_SPEC.md: `old = logp.detach()` only when no optimizer step falls inside the generation
// batch. Here the batch is 2 micro-batches with gradient_accumulation_steps 1 (TRL:
// steps_per_generation 2), num_iterations 1, on-policy: step 2 runs after step 1 moved the
// policy, so its ratio must be exp(logp - old) with old from the batch's start. With
// old = logp.detach() the ratio would be exactly 1 and nothing could ever be clipped; a large
// learning rate moves the policy so far that tokens of step 2 are clipped.
TEST(GrpoTrainer, BatchSpanningTwoStepsUsesOldLogprobsFromItsStart) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;  // one group per micro-batch
  cfg.gradient_accumulation_steps = 1;
  cfg.learning_rate = 0.3;
  cfg.dump_batches_dir = ::testing::TempDir() + "/grpo_old_span_test";
  std::filesystem::remove_all(cfg.dump_batches_dir);
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto r = (*trainer)->TrainGenerationBatch(MakeGroups(2, 4, 23));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 2u);
  EXPECT_EQ(r->steps[0].clip_ratio_region, 0.0);  // step 1 starts from the generating policy
  EXPECT_GT(r->steps[1].clip_ratio_region, 0.0);
  auto f = common::SafetensorsFile::Open(cfg.dump_batches_dir + "/step-00000002.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto old = (*f)->Get("old_logprobs");
  auto now = (*f)->Get("logprobs");
  auto mask = (*f)->Get("completion_mask");
  ASSERT_TRUE(old.ok() && now.ok() && mask.ok());
  const double moved = ((*now - *old).abs() * *mask).max().item<double>();
  EXPECT_GT(moved, 0.1);
}

// docs/GRPO_SPEC.md "When `old` is computed": a stale batch (generated one version back) whose
// one pass fits inside one optimizer step needs no forward for `old`: the policy cannot move
// before its last micro-batch, so `old` is the current policy's log-probs, logp.detach(). The
// versions the groups missed are corrected through `beh` (sequence_mask here). Checked by hand:
// `old` from the model's own full-logits forward after step 1 (log_softmax in double, one
// unpadded sequence at a time), `beh` = old + d_i / |o_i| per token, so rho_i = exp(-d_i); one
// sequence gets rho = e^2 > the cap (3) and is masked. At ratio 1 the dapo loss is
// -sum_i w_i A_i |o_i| / sum_i |o_i| (A: the group's z-scores, unbiased std + 1e-4), and
// logprob_mismatch/mean is sum_i |d_i| / sum_i |o_i|. And no `old` was computed: the step's dump
// has no old_logprobs (an extra forward would have written them).
TEST(GrpoTrainer, AStaleBatchInsideOneStepTakesOldFromTheStepsOwnForward) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.loss_type = "dapo";
  cfg.importance_sampling_correction = "sequence_mask";
  cfg.max_staleness = 1;
  cfg.dump_batches_dir = ::testing::TempDir() + "/grpo_stale_old_test";
  std::filesystem::remove_all(cfg.dump_batches_dir);
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto first = (*trainer)->TrainGenerationBatch(MakeGroups(2, 4, 31));  // version 0 -> 1
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ((*trainer)->policy_version(), 1);

  auto groups = MakeGroups(2, 4, 37, /*version=*/0);  // one version stale
  double tokens = 0, mismatch = 0;
  std::vector<double> d_of;  // d_i per sequence, in batch order
  {
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < groups.size(); ++g) {
      for (size_t j = 0; j < groups[g].completions.size(); ++j) {
        Completion& c = groups[g].completions[j];
        std::vector<int64_t> seq(groups[g].prompt_ids.begin(), groups[g].prompt_ids.end());
        seq.insert(seq.end(), c.token_ids.begin(), c.token_ids.end());
        const auto T = static_cast<int64_t>(seq.size());
        const auto P = static_cast<int64_t>(groups[g].prompt_ids.size());
        const at::Tensor ids = at::tensor(seq, at::kLong).view({1, T});
        const at::Tensor logits =
            model->Logits(model->ForwardHidden(ids, at::ones({1, T}, at::kLong)))[0];
        const at::Tensor lsm = at::log_softmax(logits.to(at::kDouble), -1);
        const double d = (g == 0 && j == 0) ? -2.0 : 0.1 * (static_cast<double>(j) - 1.5);
        const auto n = static_cast<double>(c.token_ids.size());
        c.logprobs.clear();
        for (size_t t = 0; t < c.token_ids.size(); ++t) {
          const double old = lsm[P - 1 + static_cast<int64_t>(t)][c.token_ids[t]].item<double>();
          c.logprobs.push_back(static_cast<float>(old + d / n));
        }
        d_of.push_back(d);
        tokens += n;
        mismatch += std::abs(d);
      }
    }
  }
  double want_loss = 0;
  size_t i = 0;
  for (const auto& g : groups) {
    double mean = 0, var = 0;
    for (const auto& c : g.completions) mean += *c.rewards[0] / 4.0;
    for (const auto& c : g.completions) var += std::pow(*c.rewards[0] - mean, 2) / 3.0;
    for (const auto& c : g.completions) {
      const double a = (*c.rewards[0] - mean) / (std::sqrt(var) + 1e-4);
      const double rho = std::exp(-d_of[i++]);
      const double w = rho <= 3.0 ? rho : 0.0;
      want_loss += -w * a * static_cast<double>(c.token_ids.size()) / tokens;
    }
  }
  auto r = (*trainer)->TrainGenerationBatch(groups);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 1u);
  EXPECT_NEAR(r->steps[0].staleness_mean, 1.0, 1e-12);
  EXPECT_NEAR(r->steps[0].loss, want_loss, 1e-4 * std::abs(want_loss) + 1e-6);
  EXPECT_NEAR(r->steps[0].logprob_mismatch_mean, mismatch / tokens, 1e-5);
  auto f = common::SafetensorsFile::Open(cfg.dump_batches_dir + "/step-00000002.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->Find("old_logprobs"), nullptr) << "a forward computed `old`";
  EXPECT_NE((*f)->Find("logprobs"), nullptr);
}

// An optimizer step is always gradient_accumulation_steps micro-batches, spanning generation
// batches when it must (docs/GRPO_SPEC.md, TRL): the same four micro-batches (one group each) fed
// as generation batches of 1, 2 or 4 micro-batches (steps_per_generation 1, 2, 4) against 2
// accumulation steps give two steps of 2 micro-batches each, and the first step's loss and
// gradient norm do not depend on the split. (steps_per_generation 1 used to take four
// half-size steps, each divided by the full count: half the gradient.) Step 2 is the same for
// 1 and 2, whose later groups come from the policy after step 1 (version 1); with 4 the whole
// batch comes from version 0 and step 2 corrects for it through `old`, a different step.
TEST(GrpoTrainer, StepsSpanGenerationBatchesAndDoNotDependOnStepsPerGeneration) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;
  cfg.gradient_accumulation_steps = 2;
  cfg.max_grad_norm = 0;
  struct Run {
    std::vector<StepMetrics> steps;
  };
  auto run = [&](int per_batch) {
    Run out;
    auto model = TinyModel();
    auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
    EXPECT_TRUE(trainer.ok());
    auto groups = MakeGroups(4, 4, 29);
    for (int i = 0; i < 4; i += per_batch) {
      std::vector<RolloutGroup> batch(groups.begin() + i, groups.begin() + i + per_batch);
      for (auto& g : batch) g.policy_version = (*trainer)->policy_version();
      if (per_batch == 4) {
        for (auto& g : batch) g.policy_version = 0;
      }
      auto r = (*trainer)->TrainGenerationBatch(batch);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      for (auto& s : r->steps) out.steps.push_back(s);
    }
    EXPECT_EQ((*trainer)->open_step_micro_batches(), 0);
    return out;
  };
  const Run one = run(1), two = run(2), four = run(4);
  for (const Run* r : {&one, &two, &four}) {
    ASSERT_EQ(r->steps.size(), 2u);
    for (const auto& s : r->steps) {
      EXPECT_EQ(s.micro_batches, 2);
      EXPECT_EQ(s.sequences, 8);
    }
  }
  for (const Run* r : {&one, &four}) {
    EXPECT_NEAR(r->steps[0].loss, two.steps[0].loss, 1e-5 * std::abs(two.steps[0].loss));
    EXPECT_NEAR(r->steps[0].grad_norm, two.steps[0].grad_norm, 1e-5 * two.steps[0].grad_norm);
  }
  EXPECT_GT(two.steps[0].grad_norm, 0.0);
  EXPECT_NEAR(one.steps[1].loss, two.steps[1].loss, 1e-5 * std::abs(two.steps[1].loss));
  EXPECT_NEAR(one.steps[1].grad_norm, two.steps[1].grad_norm, 1e-5 * two.steps[1].grad_norm);
}

std::vector<at::Tensor> Weights(common::Model& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model.Parameters()) out.push_back(p.detach().clone());
  return out;
}

bool BitEqual(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

// The files in `dir`, by name.
std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Every tensor of two batch dumps equal (same names, shapes, dtypes and values; NaN == NaN).
void ExpectSameDumpTensors(const std::string& path, const std::string& reference) {
  auto a = common::SafetensorsFile::Open(path);
  auto b = common::SafetensorsFile::Open(reference);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  std::vector<std::string> names_a = (*a)->Names(), names_b = (*b)->Names();
  std::sort(names_a.begin(), names_a.end());
  std::sort(names_b.begin(), names_b.end());
  ASSERT_EQ(names_a, names_b);
  for (const std::string& name : names_a) {
    auto ta = (*a)->Get(name);
    auto tb = (*b)->Get(name);
    ASSERT_TRUE(ta.ok() && tb.ok()) << name;
    EXPECT_EQ(ta->sizes(), tb->sizes()) << name;
    EXPECT_EQ(ta->scalar_type(), tb->scalar_type()) << name;
    if (ta->sizes() == tb->sizes()) {
      EXPECT_TRUE(at::equal(ta->nan_to_num(-7.0), tb->nan_to_num(-7.0))) << name;
    }
  }
}

// The header's contract for an error inside a step: the step is discarded whole. A failure at
// the third of three micro-batches of one step (two micro-batches' gradient and the third's
// already in .grad, the step's counters counting two), then a good batch: its step must be
// exactly the step of a fresh trainer (same initial weights) that never saw the failed batch.
TEST(GrpoTrainer, AnErrorInsideAStepLeavesNothingOfItForTheNextStep) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;  // one group per micro-batch
  cfg.gradient_accumulation_steps = 3;  // a batch of 3 groups is one step
  const auto failing = MakeGroups(3, 4, 31), good = MakeGroups(3, 4, 37);

  auto model = TinyModel();
  const auto initial = Weights(*model);
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  (*trainer)->TEST_set_micro_batch_fault([](int64_t micro_batch) {
    return micro_batch == 2 ? Status::Internal("injected micro-batch failure") : Status::OK();
  });
  auto failed = (*trainer)->TrainGenerationBatch(failing);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("injected micro-batch failure"), std::string::npos);
  EXPECT_EQ((*trainer)->open_step_micro_batches(), 0);
  EXPECT_EQ((*trainer)->global_step(), 0);
  EXPECT_TRUE(BitEqual(Weights(*model), initial));
  (*trainer)->TEST_set_micro_batch_fault(nullptr);
  auto r = (*trainer)->TrainGenerationBatch(good);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 1u);

  auto fresh_model = TinyModel();
  auto fresh = GrpoTrainer::Create(cfg, fresh_model.get(), nullptr);
  ASSERT_TRUE(fresh.ok());
  auto expected = (*fresh)->TrainGenerationBatch(good);
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  ASSERT_EQ(expected->steps.size(), 1u);

  EXPECT_GT(expected->steps[0].grad_norm, 0.0);
  EXPECT_EQ(r->steps[0].loss, expected->steps[0].loss);
  EXPECT_EQ(r->steps[0].grad_norm, expected->steps[0].grad_norm);
  EXPECT_EQ(r->steps[0].micro_batches, 3);
  EXPECT_EQ(r->steps[0].sequences, expected->steps[0].sequences);
  EXPECT_EQ(r->steps[0].completion_tokens, expected->steps[0].completion_tokens);
  EXPECT_TRUE(BitEqual(Weights(*model), Weights(*fresh_model)));
}

// An error discards the open step also when an earlier generation batch opened it: here batch A
// (one micro-batch of a 2-micro-batch step) opens step 1, batch B fails in its micro-batch, and
// step 1 is then C + D only: the same step, and the same dump, as a fresh trainer's on C and D.
TEST(GrpoTrainer, AnErrorDiscardsTheOpenStepCarriedOverFromTheBatchBefore) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;
  cfg.gradient_accumulation_steps = 2;
  cfg.steps_per_generation = 1;  // a generation batch of one group: one micro-batch
  const auto groups = MakeGroups(4, 4, 41);
  const std::vector<RolloutGroup> a = {groups[0]}, b = {groups[1]}, c = {groups[2]},
                                  d = {groups[3]};
  const std::string dir = ::testing::TempDir() + "/grpo_discard_carried_test";
  std::filesystem::remove_all(dir);

  auto model = TinyModel();
  cfg.dump_batches_dir = dir + "/after_failure";
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto ra = (*trainer)->TrainGenerationBatch(a);
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  EXPECT_TRUE(ra->steps.empty());
  EXPECT_EQ((*trainer)->open_step_micro_batches(), 1);
  (*trainer)->TEST_set_micro_batch_fault(
      [](int64_t) { return Status::Internal("injected micro-batch failure"); });
  EXPECT_FALSE((*trainer)->TrainGenerationBatch(b).ok());
  EXPECT_EQ((*trainer)->open_step_micro_batches(), 0);
  (*trainer)->TEST_set_micro_batch_fault(nullptr);
  ASSERT_TRUE((*trainer)->TrainGenerationBatch(c).ok());
  auto rd = (*trainer)->TrainGenerationBatch(d);
  ASSERT_TRUE(rd.ok()) << rd.status().ToString();
  ASSERT_EQ(rd->steps.size(), 1u);

  auto fresh_model = TinyModel();
  cfg.dump_batches_dir = dir + "/fresh";
  auto fresh = GrpoTrainer::Create(cfg, fresh_model.get(), nullptr);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE((*fresh)->TrainGenerationBatch(c).ok());
  auto expected = (*fresh)->TrainGenerationBatch(d);
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  ASSERT_EQ(expected->steps.size(), 1u);

  EXPECT_GT(expected->steps[0].grad_norm, 0.0);
  EXPECT_EQ(rd->steps[0].loss, expected->steps[0].loss);
  EXPECT_EQ(rd->steps[0].grad_norm, expected->steps[0].grad_norm);
  EXPECT_EQ(rd->steps[0].sequences, 8);
  EXPECT_TRUE(BitEqual(Weights(*model), Weights(*fresh_model)));
  // Nothing of A or B in the dumps either: step 1's one file holds the rows of C and D.
  EXPECT_EQ(FilesIn(dir + "/after_failure"),
            (std::vector<std::string>{"step-00000001.safetensors"}));
  ExpectSameDumpTensors(dir + "/after_failure/step-00000001.safetensors",
                        dir + "/fresh/step-00000001.safetensors");
}

// README "Batch dumps": one file per optimizer step, also for a step that spans generation
// batches. Two batches of one micro-batch each make one step of two; its file holds both
// batches' rows in training order, as the same step trained from one batch of both groups does.
TEST(GrpoTrainer, AStepSpanningGenerationBatchesIsDumpedAsOneFile) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;
  cfg.gradient_accumulation_steps = 2;
  const auto groups = MakeGroups(2, 4, 43);
  const std::string dir = ::testing::TempDir() + "/grpo_span_dump_test";
  std::filesystem::remove_all(dir);

  auto model = TinyModel();
  cfg.steps_per_generation = 1;  // one group per generation batch
  cfg.dump_batches_dir = dir + "/spanning";
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE((*trainer)->TrainGenerationBatch({groups[0]}).ok());
  auto r = (*trainer)->TrainGenerationBatch({groups[1]});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->steps.size(), 1u);

  auto one_model = TinyModel();
  cfg.steps_per_generation = 2;  // both groups in one generation batch: the same step
  cfg.dump_batches_dir = dir + "/one_batch";
  auto one = GrpoTrainer::Create(cfg, one_model.get(), nullptr);
  ASSERT_TRUE(one.ok());
  auto expected = (*one)->TrainGenerationBatch(groups);
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  ASSERT_EQ(expected->steps.size(), 1u);

  EXPECT_EQ(FilesIn(dir + "/spanning"), (std::vector<std::string>{"step-00000001.safetensors"}));
  ExpectSameDumpTensors(dir + "/spanning/step-00000001.safetensors",
                        dir + "/one_batch/step-00000001.safetensors");
  auto f = common::SafetensorsFile::Open(dir + "/spanning/step-00000001.safetensors");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(nlohmann::json::parse((*f)->metadata().at("micro_batch_sizes")),
            nlohmann::json::array({4, 4}));
  EXPECT_NEAR(nlohmann::json::parse((*f)->metadata().at("metrics"))["loss"].get<double>(),
              expected->steps[0].loss, 1e-6 * std::abs(expected->steps[0].loss) + 1e-9);
}

// A step flushed short (FlushPartialStep: a learner stopping inside a step) is dumped like any
// other, to `step-<8 digits>.safetensors`. Its one micro-batch, normalised by its own count, is
// the step that gradient_accumulation_steps 1 takes on the same group.
TEST(GrpoTrainer, AFlushedStepIsDumpedAsItsStepFile) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.per_device_train_batch_size = 4;
  cfg.steps_per_generation = 1;
  const auto groups = MakeGroups(1, 4, 47);
  const std::string dir = ::testing::TempDir() + "/grpo_flush_dump_test";
  std::filesystem::remove_all(dir);

  auto model = TinyModel();
  cfg.gradient_accumulation_steps = 2;
  cfg.dump_batches_dir = dir + "/flushed";
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto r = (*trainer)->TrainGenerationBatch(groups);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->steps.empty());
  auto flushed = (*trainer)->FlushPartialStep();
  ASSERT_TRUE(flushed.ok()) << flushed.status().ToString();
  ASSERT_TRUE(flushed->has_value());

  auto whole_model = TinyModel();
  cfg.gradient_accumulation_steps = 1;
  cfg.dump_batches_dir = dir + "/whole";
  auto whole = GrpoTrainer::Create(cfg, whole_model.get(), nullptr);
  ASSERT_TRUE(whole.ok());
  auto expected = (*whole)->TrainGenerationBatch(groups);
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  ASSERT_EQ(expected->steps.size(), 1u);

  EXPECT_EQ(FilesIn(dir + "/flushed"), (std::vector<std::string>{"step-00000001.safetensors"}));
  ExpectSameDumpTensors(dir + "/flushed/step-00000001.safetensors",
                        dir + "/whole/step-00000001.safetensors");
  auto f = common::SafetensorsFile::Open(dir + "/flushed/step-00000001.safetensors");
  ASSERT_TRUE(f.ok());
  const auto metrics = nlohmann::json::parse((*f)->metadata().at("metrics"));
  EXPECT_EQ(metrics["micro_batches"].get<int64_t>(), 1);
  EXPECT_NEAR(metrics["loss"].get<double>(), expected->steps[0].loss,
              1e-6 * std::abs(expected->steps[0].loss) + 1e-9);
  EXPECT_NEAR(metrics["grad_norm"].get<double>(), expected->steps[0].grad_norm,
              1e-6 * expected->steps[0].grad_norm);
}

// A trainer restored at step S redoes the steps after S: their dumps (and part files of older
// versions, and unfinished .tmp files) go; steps up to S and other files stay.
TEST(GrpoTrainer, RemoveDumpsAfterRemovesTheStepsAfterItOnly) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.dump_batches_dir = ::testing::TempDir() + "/grpo_remove_dumps_test";
  std::filesystem::remove_all(cfg.dump_batches_dir);
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok());
  auto none = (*trainer)->RemoveDumpsAfter(0);  // no directory yet
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(*none, 0);
  std::filesystem::create_directories(cfg.dump_batches_dir);
  for (const char* name : {"step-00000001.safetensors", "step-00000002-part.safetensors",
                           "step-00000002.safetensors", "step-00000003-part.safetensors",
                           "step-00000003.safetensors", "step-00000004.safetensors.tmp",
                           "step-123456789.safetensors", "notes.txt", "step-x.safetensors"}) {
    std::ofstream(cfg.dump_batches_dir + "/" + name) << "x";
  }
  auto removed = (*trainer)->RemoveDumpsAfter(2);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 4);
  EXPECT_EQ(FilesIn(cfg.dump_batches_dir),
            (std::vector<std::string>{"notes.txt", "step-00000001.safetensors",
                                      "step-00000002-part.safetensors", "step-00000002.safetensors",
                                      "step-x.safetensors"}));
}

}  // namespace
}  // namespace grpo::learner
