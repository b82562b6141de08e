// CUDA against the CPU (issue 15 §3, label `gpu`): every test skips without a CUDA device.
// The reference is always the fp32 CPU path (itself checked against transformers and TRL).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <string>

#include "../precision_test_util.h"
#include "common/model/device.h"

namespace grpo::testing {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!common::CudaAvailable()) GTEST_SKIP() << "no CUDA device"

const at::Device kCuda(at::kCUDA, 0);

// fp32 on CUDA vs the CPU: the same math with other kernels (TF32 is off by default in
// libtorch for matmuls); 1e-4 nats per token.
constexpr double kCudaFp32LogprobTolerance = 1e-4;
constexpr double kBf16LogprobTolerance = 0.05;  // as device_test (0.01 measured on the CPU)

TEST(CudaParity, Fp32LogprobsEqualTheCpu) {
  SKIP_WITHOUT_CUDA();
  auto cpu = PrecisionTinyModel();
  auto cuda = PrecisionTinyModel(kCuda);
  const at::Tensor ids = PrecisionIds();
  EXPECT_LT(MaxAbsDiff(SequenceLogprobs(*cpu, ids), SequenceLogprobs(*cuda, ids)),
            kCudaFp32LogprobTolerance);
}

TEST(CudaParity, Bf16LogprobsWithinToleranceOfTheFp32Cpu) {
  SKIP_WITHOUT_CUDA();
  auto cpu = PrecisionTinyModel();
  auto cuda = PrecisionTinyModel(kCuda, at::kBFloat16);
  const at::Tensor ids = PrecisionIds();
  EXPECT_LT(MaxAbsDiff(SequenceLogprobs(*cpu, ids), SequenceLogprobs(*cuda, ids)),
            kBf16LogprobTolerance);
}

TEST(CudaParity, Fp32LearnerStepEqualsTheCpu) {
  SKIP_WITHOUT_CUDA();
  auto cpu = PrecisionTinyModel();
  const auto groups = GeneratedGroups(*cpu, 4, 4, 12);
  common::GrpoConfig cfg = PrecisionTrainerConfig();
  cfg.adam_epsilon = 1.0;
  cfg.learning_rate = 1.0;  // delta = g / (|g| + 1) ~ g: above fp32 resolution of the weights  //
                            // the update tracks the gradient (see precision_test)
  cfg.num_iterations = 2;   // the no-grad `old` pass too (one step of 4 micro-batches)
  cfg.gradient_accumulation_steps = 4;
  learner::StepMetrics cpu_metrics, cuda_metrics;
  const auto cpu_delta = OneStepDelta(*cpu, cfg, groups, &cpu_metrics);
  auto cuda = PrecisionTinyModel(kCuda);
  cfg.device = "cuda";
  const auto cuda_delta = OneStepDelta(*cuda, cfg, groups, &cuda_metrics);
  ASSERT_FALSE(cuda_delta.empty());
  EXPECT_LT(RelativeL2(cpu_delta, cuda_delta), 1e-4);
  EXPECT_NEAR(cuda_metrics.loss, cpu_metrics.loss, 1e-5 + 1e-4 * std::abs(cpu_metrics.loss));
  EXPECT_LT(cuda_metrics.logprob_mismatch_max, 1e-4);
  EXPECT_GT(cuda_metrics.peak_memory_bytes, 0);
  for (const auto& p : cuda->Parameters()) EXPECT_TRUE(p.is_cuda());
}

TEST(CudaParity, GreedyDecodeGivesTheCpuTokens) {
  SKIP_WITHOUT_CUDA();
  auto cpu = PrecisionTinyModel();
  auto cuda = PrecisionTinyModel(kCuda);
  const auto a = GeneratedGroups(*cpu, 6, 2, 16, /*temperature=*/0.0);
  const auto b = GeneratedGroups(*cuda, 6, 2, 16, /*temperature=*/0.0);  // 16-token windows
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < a[i].completions.size(); ++j) {
      EXPECT_EQ(a[i].completions[j].token_ids, b[i].completions[j].token_ids) << i << "/" << j;
      for (size_t t = 0; t < a[i].completions[j].logprobs.size(); ++t) {
        EXPECT_NEAR(a[i].completions[j].logprobs[t], b[i].completions[j].logprobs[t],
                    kCudaFp32LogprobTolerance);
      }
    }
  }
}

TEST(CudaParity, SampledDecodeWithStopTokensMatchesTheCpu) {
  SKIP_WITHOUT_CUDA();
  auto cpu = PrecisionTinyModel();
  auto cuda = PrecisionTinyModel(kCuda);
  rollout::GeneratorOptions o;
  o.num_generations = 4;
  o.max_completion_length = 20;
  o.stop_token_ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  // varied lengths
  auto run = [&](const common::Model& m) {
    auto gen = rollout::Generator::Create(rollout::BorrowModel(m), 0, o);
    EXPECT_TRUE(gen.ok());
    auto r = (*gen)->Generate(PrecisionPrompts(8));
    EXPECT_TRUE(r.ok());
    return std::move(r).value();
  };
  const auto a = run(*cpu), b = run(*cuda);
  // Sampling compares a uniform against a CDF: tokens agree unless a uniform falls within the
  // fp32 noise of a CDF boundary; allow one differing completion in 32.
  int differ = 0;
  for (size_t i = 0; i < a.groups.size(); ++i) {
    for (size_t j = 0; j < a.groups[i]->completions.size(); ++j) {
      differ += a.groups[i]->completions[j].token_ids != b.groups[i]->completions[j].token_ids;
    }
  }
  EXPECT_LE(differ, 1);
}

// A checkpoint of a bf16 trainer on CUDA (fp32 master and AdamW state on the GPU) restores into
// a fresh CUDA trainer with the same weights and optimizer state.
// One GPU, `fsdp: full_shard offload` at world size 1 (the gate gathers each unit from the
// host shards onto the GPU; gradients go back to the host, where AdamW steps), in fp32 and in
// bf16, with gradient checkpointing: the steps (loss, grad_norm) and the weights after them
// equal the plain trainer's on the same GPU (no_shard), to 1e-5. Between steps the GPU holds no
// parameter values and AdamW's state is on the host. With beta 0.04 and a reference of other
// weights (the tiny model of seed 8, whole on the GPU in the plain run): offloaded, its shard is
// on the host too (FrozenShards) and its parameters hold no GPU memory. `no_shard offload` and
// `shard_grad_op offload` (the fp32 master on the host, a compute copy on the GPU; at one rank
// the two are one): the same steps, the master and AdamW's state on the host, the compute copy
// on the GPU.
TEST(CudaParity, FullShardOffloadOnOneGpuTakesThePlainSteps) {
  SKIP_WITHOUT_CUDA();
  auto cpu = PrecisionTinyModel();
  const auto groups = GeneratedGroups(*cpu, 4, 4, 12);
  for (const bool bf16 : {false, true}) {
    struct Run {
      std::vector<learner::StepMetrics> steps;
      std::vector<at::Tensor> weights;
    };
    auto train = [&](const std::string& fsdp) {
      Run out;
      common::GrpoConfig cfg = PrecisionTrainerConfig();
      cfg.device = "cuda";
      cfg.bf16 = bf16;
      cfg.fsdp = fsdp;
      cfg.gradient_checkpointing = true;
      cfg.num_iterations = 2;  // the no-grad `old` pass too
      cfg.per_device_train_batch_size = 4;
      cfg.gradient_accumulation_steps = 2;  // 4 micro-batches a batch: 2 steps a pass
      cfg.max_grad_norm = 1.0;
      cfg.beta = 0.04;
      auto model = PrecisionTinyModel(kCuda);
      auto tiny = common::ModelConfigPreset("tiny");
      EXPECT_TRUE(tiny.ok());
      auto reference = common::Model::InitRandom(*tiny, 8);
      EXPECT_TRUE(reference.ok());
      common::Model* ref = reference->get();
      auto trainer = learner::GrpoTrainer::Create(cfg, model.get(), std::move(reference).value());
      EXPECT_TRUE(trainer.ok()) << trainer.status().ToString();
      if (!trainer.ok()) return out;
      auto r = (*trainer)->TrainGenerationBatch(groups);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (!r.ok()) return out;
      out.steps = r->steps;
      if ((*trainer)->optimizer().ShardsParameters()) {
        for (const at::Tensor& p : (*trainer)->compute_model().Parameters()) {
          EXPECT_TRUE(p.is_cuda());
          EXPECT_EQ(p.storage().nbytes(), 0u) << "a parameter holds GPU memory between steps";
        }
        const auto pieces = (*trainer)->optimizer().StatePieces();
        EXPECT_FALSE(pieces.empty());
        for (const auto& piece : pieces) EXPECT_TRUE(piece.moments[0].is_cpu()) << piece.param;
        EXPECT_NE((*trainer)->reference_shards(), nullptr);
        for (const at::Tensor& p : ref->Parameters()) {
          EXPECT_EQ(p.storage().nbytes(), 0u) << "the reference holds GPU memory between steps";
        }
        auto gathered = (*trainer)->optimizer().GatherWeights("the test's weights", true);
        EXPECT_TRUE(gathered.ok()) << gathered.status().ToString();
        if (gathered.ok()) {
          for (const auto& [name, w] : *gathered) out.weights.push_back(w.cpu());
        }
      } else {
        const bool host_master = fsdp != "no_shard";
        for (const at::Tensor& p : model->Parameters()) {
          EXPECT_EQ(p.is_cpu(), host_master) << fsdp;
          out.weights.push_back(p.detach().cpu());
        }
        for (const at::Tensor& p : (*trainer)->compute_model().Parameters()) {
          EXPECT_TRUE(p.is_cuda()) << fsdp;
        }
        auto state = (*trainer)->optimizer().StateDict("the test's state");
        EXPECT_TRUE(state.ok()) << state.status().ToString();
        if (state.ok()) {
          for (const auto& [name, t] : *state) {
            if (name == "step") continue;
            EXPECT_EQ(t.is_cpu(), host_master) << fsdp << " " << name;
          }
        }
      }
      return out;
    };
    const Run plain = train("no_shard");
    ASSERT_EQ(plain.steps.size(), 2u) << "bf16 " << bf16;
    for (const char* fsdp : {"full_shard offload", "no_shard offload", "shard_grad_op offload"}) {
      const Run offloaded = train(fsdp);
      ASSERT_EQ(offloaded.steps.size(), plain.steps.size()) << "bf16 " << bf16;
      for (size_t i = 0; i < plain.steps.size(); ++i) {
        const auto& a = offloaded.steps[i];
        const auto& b = plain.steps[i];
        EXPECT_NEAR(a.loss, b.loss, 1e-6 + 1e-5 * std::abs(b.loss)) << "bf16 " << bf16;
        EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-6 + 1e-5 * b.grad_norm) << "bf16 " << bf16;
      }
      ASSERT_EQ(offloaded.weights.size(), plain.weights.size());
      for (size_t i = 0; i < plain.weights.size(); ++i) {
        const double scale = plain.weights[i].abs().max().item<double>();
        EXPECT_LE((offloaded.weights[i] - plain.weights[i]).abs().max().item<double>(),
                  1e-5 * scale)
            << "bf16 " << bf16 << " parameter " << i << " " << fsdp;
      }
    }
  }
}

TEST(CudaParity, Bf16CheckpointOnCudaRoundTrips) {
  SKIP_WITHOUT_CUDA();
  CheckBf16CheckpointRoundTrip(kCuda);
}

// The demo task's shape (services/cli/demo_task.cc: TRL's length reward with target 8 tokens, its
// batching, Dr. GRPO scaling, cosine schedule, 60 steps) on the tiny preset initialised from
// scratch as `grpo demo` does, trained in bf16 on CUDA with generation on the bf16 compute
// copy: the mean reward of the last 10 steps must beat the first 10 by 2 tokens.
// GRPO_DEMO_ON_CPU=1 runs it on the CPU instead when there is no GPU (minutes on 2 cores).
TEST(CudaParity, Bf16RunOfTheDemoTaskLearns) {
  const char* on_cpu = std::getenv("GRPO_DEMO_ON_CPU");
  const bool cpu = !common::CudaAvailable() && on_cpu != nullptr && std::string(on_cpu) == "1";
  if (!cpu) SKIP_WITHOUT_CUDA();
  const at::Device device = cpu ? at::Device(at::kCPU) : kCuda;
  auto preset = common::ModelConfigPreset("tiny");
  ASSERT_TRUE(preset.ok());
  auto init = common::Model::InitRandom(*preset, 1, device);
  ASSERT_TRUE(init.ok());
  std::unique_ptr<common::Model> model = std::move(init).value();
  common::GrpoConfig cfg;
  cfg.device = device.str();
  cfg.bf16 = true;
  cfg.num_generations = 8;
  cfg.per_device_train_batch_size = 16;
  cfg.gradient_accumulation_steps = 2;
  cfg.max_completion_length = 24;
  cfg.learning_rate = 3e-3;
  cfg.lr_scheduler_type = "cosine";
  cfg.scale_rewards = "none";
  cfg.max_steps = 60;
  cfg.seed = 1;
  auto trainer = learner::GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  rollout::GeneratorOptions o = rollout::GeneratorOptions::FromConfig(cfg);
  const common::Model& worker = (*trainer)->compute_model();  // generation in bf16
  auto gen = rollout::Generator::Create(rollout::BorrowModel(worker), 0, o);
  ASSERT_TRUE(gen.ok());
  const auto prompts = PrecisionPrompts(64);
  std::vector<double> curve;
  int64_t cursor = 0;
  while ((*trainer)->global_step() < cfg.max_steps) {
    std::vector<std::vector<int32_t>> batch;
    std::vector<int64_t> indices;
    for (int i = 0; i < 4; ++i, ++cursor) {
      batch.push_back(prompts[cursor % prompts.size()]);
      indices.push_back(cursor);
    }
    ASSERT_TRUE((*gen)->SetPolicy(rollout::BorrowModel(worker), (*trainer)->policy_version()).ok());
    auto r = (*gen)->Generate(batch, indices);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::vector<common::RolloutGroup> groups;
    for (size_t i = 0; i < r->groups.size(); ++i) {
      common::RolloutGroup g = r->groups[i].value();
      g.prompt_id = std::to_string(indices[i]);
      for (auto& c : g.completions) {
        c.rewards = {-std::abs(static_cast<double>(c.token_ids.size()) - 8.0)};
      }
      groups.push_back(std::move(g));
    }
    auto result = (*trainer)->TrainGenerationBatch(groups);
    ASSERT_TRUE(result.ok()) << result.status().ToString();
    for (const auto& s : result->steps) curve.push_back(s.reward);
  }
  ASSERT_GE(curve.size(), 20u);
  auto mean = [](auto b, auto e) { return std::accumulate(b, e, 0.0) / std::distance(b, e); };
  const double first = mean(curve.begin(), curve.begin() + 10);
  const double last = mean(curve.end() - 10, curve.end());
  std::printf("bf16 demo on %s: reward first 10 steps %.2f, last 10 %.2f\n", device.str().c_str(),
              first, last);
  EXPECT_GT(last, first + 2.0);
}

}  // namespace
}  // namespace grpo::testing
