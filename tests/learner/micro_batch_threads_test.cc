// micro_batch_threads 2 (README "Two micro-batches at once"): the trainer hands the next
// micro-batch of a step to a worker thread and adds its gradient after its own micro-batch's.
// The reference is the same trainer at micro_batch_threads 1, one micro-batch after the other:
// the steps must be the same bits (loss, grad norm, every weight), whatever the loss's path
// (fused token losses, autograd through sequence-level ones), the accumulation (odd, even),
// gradient checkpointing, num_iterations and steps that span generation batches.
#include <gtest/gtest.h>

#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "learner/grpo_trainer.h"
#include "tests/learner/trainer_test_util.h"

namespace grpo::learner {
namespace {

using common::RolloutGroup;
using trainer_test::MakeGroups;
using trainer_test::TinyModel;

struct Trained {
  std::vector<StepMetrics> steps;
  std::vector<at::Tensor> weights;
};

// The tiny model's initial weights and a trainer of them at `threads` micro-batch threads.
struct Setup {
  std::unique_ptr<common::Model> model;
  std::unique_ptr<GrpoTrainer> trainer;  // null where Create failed (the test has failed)
};

Setup MakeTrainer(common::GrpoConfig cfg, int threads) {
  cfg.micro_batch_threads = threads;
  Setup s{TinyModel(), nullptr};
  auto trainer = GrpoTrainer::Create(cfg, s.model.get(), nullptr);
  EXPECT_TRUE(trainer.ok()) << trainer.status().ToString();
  if (trainer.ok()) s.trainer = std::move(*trainer);
  return s;
}

void KeepWeights(const common::Model& model, Trained* run) {
  for (auto& p : model.Parameters()) run->weights.push_back(p.detach().clone());
}

// Trains `batches` generation batches of 3 groups of 4 from the same initial weights.
Trained Train(common::GrpoConfig cfg, int threads, int batches) {
  Setup s = MakeTrainer(std::move(cfg), threads);
  Trained run;
  if (s.trainer == nullptr) return run;
  for (int b = 0; b < batches; ++b) {
    auto r = s.trainer->TrainGenerationBatch(MakeGroups(3, 4, 11 + b));
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return run;
    for (auto& step : r->steps) run.steps.push_back(step);
  }
  KeepWeights(*s.model, &run);
  return run;
}

void ExpectSameBits(const Trained& one, const Trained& two) {
  ASSERT_EQ(one.steps.size(), two.steps.size());
  ASSERT_FALSE(one.steps.empty());
  for (size_t i = 0; i < one.steps.size(); ++i) {
    EXPECT_EQ(one.steps[i].loss, two.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(one.steps[i].grad_norm, two.steps[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(one.steps[i].micro_batches, two.steps[i].micro_batches) << "step " << i + 1;
    EXPECT_EQ(one.steps[i].completion_tokens, two.steps[i].completion_tokens);
    EXPECT_GT(one.steps[i].grad_norm, 0.0);  // something trained
  }
  ASSERT_EQ(one.weights.size(), two.weights.size());
  for (size_t i = 0; i < one.weights.size(); ++i) {
    EXPECT_TRUE(at::equal(one.weights[i], two.weights[i])) << "parameter " << i;
  }
}

common::GrpoConfig BaseConfig() {
  common::GrpoConfig c;
  c.num_generations = 4;
  c.per_device_train_batch_size = 2;  // 6 micro-batches a generation batch of 3 groups
  c.steps_per_generation = 6;
  c.gradient_accumulation_steps = 2;
  c.max_completion_length = 16;
  c.learning_rate = 1e-2;
  c.lr_scheduler_type = "constant";
  c.max_grad_norm = 1.0;
  c.importance_sampling_correction = "none";
  c.logprob_chunk_tokens = 5;  // several chunks per micro-batch
  return c;
}

struct Case {
  std::string name;
  std::string loss_type;
  std::string level;  // importance_sampling_level: token (fused) or sequence (autograd)
  int64_t accumulation;
  int64_t iterations;
  bool checkpointing;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class MicroBatchThreads : public ::testing::TestWithParam<Case> {};

TEST_P(MicroBatchThreads, TwoThreadsTakeTheSameStepsBitForBit) {
  const Case& c = GetParam();
  common::GrpoConfig cfg = BaseConfig();
  cfg.loss_type = c.loss_type;
  cfg.importance_sampling_level = c.level;
  cfg.gradient_accumulation_steps = c.accumulation;
  cfg.num_iterations = c.iterations;
  cfg.gradient_checkpointing = c.checkpointing;
  const Trained one = Train(cfg, 1, 2), two = Train(cfg, 2, 2);
  ExpectSameBits(one, two);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MicroBatchThreads,
    ::testing::Values(
        // 6 micro-batches a batch: pairs fill steps of 2; steps of 4 span the two batches.
        Case{"DapoFusedAccumulation2", "dapo", "token", 2, 1, false},
        Case{"DapoFusedAccumulation4SpansBatches", "dapo", "token", 4, 1, false},
        // 3: a pair, then a micro-batch alone, in every step.
        Case{"GrpoFusedAccumulation3TwoIterations", "grpo", "token", 3, 2, false},
        Case{"DrGrpoSequenceLevelAccumulation2", "dr_grpo", "sequence", 2, 1, false},
        Case{"BnpoCheckpointedAccumulation4", "bnpo", "token", 4, 1, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// An error in the micro-batch the trainer runs while the worker trains the next (stream
// position 2 of 6, accumulation 2: the step of positions 2 and 3): that step is discarded whole,
// the worker's gradient included, and what follows is the sequential trainer's under the same
// fault, bit for bit.
Trained TrainThroughAFault(common::GrpoConfig cfg, int threads) {
  Setup s = MakeTrainer(std::move(cfg), threads);
  Trained run;
  if (s.trainer == nullptr) return run;
  s.trainer->TEST_set_micro_batch_fault([](int64_t micro_batch) {
    return micro_batch == 2 ? Status::Internal("injected micro-batch failure") : Status::OK();
  });
  auto failed = s.trainer->TrainGenerationBatch(MakeGroups(3, 4, 5));
  EXPECT_FALSE(failed.ok());
  if (!failed.ok()) {
    EXPECT_NE(failed.status().message().find("injected micro-batch failure"), std::string::npos);
  }
  EXPECT_EQ(s.trainer->open_step_micro_batches(), 0);
  EXPECT_EQ(s.trainer->global_step(), 1);  // the step of positions 0 and 1 was taken
  s.trainer->TEST_set_micro_batch_fault(nullptr);
  auto r = s.trainer->TrainGenerationBatch(MakeGroups(3, 4, 11));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (!r.ok()) return run;
  run.steps = r->steps;
  KeepWeights(*s.model, &run);
  return run;
}

TEST(MicroBatchThreadsErrors, AFailedMicroBatchBesideTheWorkerLeavesNothingOfTheStep) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.loss_type = "dapo";
  const Trained one = TrainThroughAFault(cfg, 1), two = TrainThroughAFault(cfg, 2);
  ExpectSameBits(one, two);
}

TEST(MicroBatchThreadsErrors, RefusedWhereTheGradientsAreNotTheTrainersOwn) {
  common::GrpoConfig cfg = BaseConfig();
  cfg.micro_batch_threads = 2;
  cfg.bf16 = true;  // a compute copy: its gradients move to the master after each micro-batch
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_FALSE(trainer.ok());
  EXPECT_NE(trainer.status().message().find("micro_batch_threads"), std::string::npos);

  cfg.bf16 = false;
  cfg.micro_batch_threads = 3;
  const Status bad = cfg.Validate();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("micro_batch_threads"), std::string::npos);
}

}  // namespace
}  // namespace grpo::learner
