// The memory planner (learner/distributed/memory_plan.h): parameter counts against models the
// code builds, hand-computed figures for every sharding mode, a 7B-class model that does not
// fit one 80 GiB GPU and the change that makes it fit, and the prediction against the resident
// memory of a real training step measured in a fresh process.
#include "learner/distributed/memory_plan.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/counting_allocator.h"
#include "common/model/model.h"
#include "common/weight_sync/backends.h"
#include "common/weight_sync/weight_sync.h"
#include "learner/distributed/collectives.h"
#include "learner/grpo_trainer.h"
#include "tests/test_util.h"

namespace grpo::learner::distributed {
namespace {

namespace fs = std::filesystem;
using common::ModelConfig;

ModelConfig Config(std::string type, int64_t v, int64_t d, int64_t i, int64_t layers, int64_t heads,
                   int64_t kv, bool tied) {
  ModelConfig c;
  c.model_type = std::move(type);
  c.vocab_size = v;
  c.hidden_size = d;
  c.intermediate_size = i;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv;
  c.head_dim = d / heads;
  c.tie_word_embeddings = tied;
  c.attention_bias = c.model_type == "qwen2";
  c.qk_norm = c.model_type == "qwen3";
  return c;
}

// --- Parameter counts: the planner's arithmetic against the tensors common::Model builds.

struct BuiltCounts {
  int64_t total = 0, per_layer = 0, largest_tensor = 0, embedding = 0;
};

BuiltCounts CountBuilt(const ModelConfig& c) {
  auto model = common::Model::InitRandom(c, 1);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  BuiltCounts b;
  if (!model.ok()) return b;
  b.total = (*model)->NumParameters();
  for (const auto& [name, t] : (*model)->NamedParameters()) {
    if (name.rfind("model.layers.0.", 0) == 0) b.per_layer += t.numel();
    if (name == "model.embed_tokens.weight") b.embedding = t.numel();
    b.largest_tensor = std::max<int64_t>(b.largest_tensor, t.numel());
  }
  return b;
}

class ParameterCount : public ::testing::TestWithParam<ModelConfig> {};

TEST_P(ParameterCount, EqualsTheBuiltModelsTensors) {
  const ModelConfig c = GetParam();
  const BuiltCounts built = CountBuilt(c);
  const ParameterCounts planned = CountParameters(c);
  EXPECT_EQ(planned.total, built.total);
  EXPECT_EQ(planned.per_layer, built.per_layer);
  EXPECT_EQ(planned.embedding, built.embedding);
  EXPECT_EQ(planned.largest_tensor, built.largest_tensor);
  EXPECT_EQ(planned.lm_head, c.tie_word_embeddings ? 0 : c.vocab_size * c.hidden_size);
}

ModelConfig WithBias(ModelConfig c, bool bias) {
  c.attention_bias = bias;
  return c;
}
ModelConfig WithHeadDim(ModelConfig c, int64_t head_dim) {
  c.head_dim = head_dim;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Families, ParameterCount,
    ::testing::Values(
        // qwen2, tied (the tiny preset's shape): q/k/v biases, no o_proj bias.
        Config("qwen2", 259, 64, 176, 2, 4, 2, true),
        // qwen2, untied, MLP wider than the vocabulary's matrix.
        Config("qwen2", 300, 96, 1024, 3, 6, 3, false),
        // qwen3: q_norm and k_norm, no biases; head_dim apart from hidden / heads.
        WithHeadDim(Config("qwen3", 512, 64, 192, 2, 4, 2, false), 32),
        // qwen3 with attention_bias: o_proj is biased too.
        WithBias(Config("qwen3", 512, 64, 192, 2, 4, 1, true), true),
        // llama, no biases, no GQA; and with attention_bias (o_proj biased).
        Config("llama", 1000, 128, 344, 2, 8, 8, false),
        WithBias(Config("llama", 1000, 128, 344, 2, 8, 4, true), true)));

// Qwen2.5-7B's config.json (Hugging Face Qwen/Qwen2.5-7B), typed in.
ModelConfig Qwen25_7B() {
  ModelConfig c = Config("qwen2", 152064, 3584, 18944, 28, 28, 4, false);
  c.head_dim = 128;
  return c;
}

TEST(ParameterCountOf, Qwen25_7BIsItsPublishedCount) {
  // 7,615,616,512: the sum of the shapes in Qwen2.5-7B's model.safetensors.index.json.
  EXPECT_EQ(CountParameters(Qwen25_7B()).total, 7'615'616'512);
}

// --- Hand-computed figures. The small model: qwen2, V = 1000, D = 64, I = 128, 2 layers,
// 4 heads of 16, 2 KV heads (Q = 64, K = 32), tied.
//   embedding 1000 x 64 = 64,000
//   layer: q 64x64 + 64, k 32x64 + 32, v 32x64 + 32, o 64x64, mlp 3 x 128x64, 2 norms x 64
//        = 4,096 + 64 + 2,048 + 32 + 2,048 + 32 + 4,096 + 24,576 + 128 = 37,120
//   total = 64,000 + 2 x 37,120 + 64 (model.norm) = 138,304 = P
//   largest tensor = largest unit = the embedding, 64,000 = U
ModelConfig Small() { return Config("qwen2", 1000, 64, 128, 2, 4, 2, true); }

common::GrpoConfig SmallRun() {
  common::GrpoConfig c;
  c.num_generations = 2;
  c.per_device_train_batch_size = 2;
  c.max_prompt_length = 6;
  c.max_completion_length = 10;
  c.logprob_chunk_tokens = 8;
  return c;
}

// Whether one of the plan's notes contains `words`.
bool NoteSays(const MemoryPlan& p, const std::string& words) {
  return std::any_of(p.notes.begin(), p.notes.end(),
                     [&](const std::string& n) { return n.find(words) != std::string::npos; });
}

TEST(MemoryPlanSmall, CountsTheSmallModelByHand) {
  const ParameterCounts c = CountParameters(Small());
  EXPECT_EQ(c.per_layer, 37'120);
  EXPECT_EQ(c.total, 138'304);
  EXPECT_EQ(c.largest_unit, 64'000);
}

// micro_batch_threads 2: a second micro-batch at once (its peak again) and the gradient it
// computes apart, the whole model's in fp32 at one rank: 138,304 x 4 = 553,216 bytes.
TEST(MemoryPlanSmall, TwoMicroBatchesAtOnceAddOneMicroBatchAndAGradient) {
  common::GrpoConfig cfg = SmallRun();
  auto one = PlanMemory(Small(), cfg, 1, "cpu");
  cfg.micro_batch_threads = 2;
  auto two = PlanMemory(Small(), cfg, 1, "cpu");
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_EQ(one->SecondMicroBatch(), 0);
  EXPECT_EQ(two->SecondMicroBatch(), one->MicroBatchPeak() + 553'216);
  EXPECT_EQ(two->TrainingPeak() - one->TrainingPeak(), one->MicroBatchPeak() + 553'216);
  EXPECT_EQ(two->Total() - one->Total(), one->MicroBatchPeak() + 553'216);
  EXPECT_NE(FormatPlan(*two, 0).find("micro_batch_threads 2"), std::string::npos);
  EXPECT_EQ(FormatPlan(*one, 0).find("micro_batch_threads 2"), std::string::npos);
}

struct StateCase {
  std::string fsdp;
  bool bf16;
  int world;
  // Expected bytes: parameters, gradients, master weights, master gradients, AdamW state,
  // gathered beside the LM head and beside a layer's backward, optimizer step; host_offloaded
  // (cuda).
  int64_t params, grads, master, master_grads, adamw, gathered_lm_head, gathered, step, host;
};

class MemoryPlanState : public ::testing::TestWithParam<StateCase> {};

TEST_P(MemoryPlanState, MatchesZeroArithmetic) {
  const StateCase& k = GetParam();
  common::GrpoConfig cfg = SmallRun();
  cfg.fsdp = k.fsdp;
  cfg.bf16 = k.bf16;
  auto plan = PlanMemory(Small(), cfg, k.world, "cuda");
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->parameters, k.params);
  EXPECT_EQ(plan->gradients, k.grads);
  EXPECT_EQ(plan->master_weights, k.master);
  EXPECT_EQ(plan->master_gradients, k.master_grads);
  EXPECT_EQ(plan->adamw_state, k.adamw);
  EXPECT_EQ(plan->gathered_lm_head, k.gathered_lm_head);
  EXPECT_EQ(plan->gathered_layer, k.gathered);
  EXPECT_EQ(plan->optimizer_step, k.step);
  EXPECT_EQ(plan->host_offloaded, k.host);
}

// fp32: parameters 4P = 553,216, gradients 4P, AdamW 8P = 1,106,432; the step's temporaries
// 8U = 512,000 (the fp64 copy of the embedding's gradient). shard_grad_op: as built, below;
// full_shard divides the parameters too. Beside the LM-head pass full_shard holds the head's
// unit (the tied embedding) whole, 4U = 256,000; beside a layer's backward still that unit,
// and the layer L = 37,120 whole, its gradients, their flat and the prefetched layer before it:
// 256,000 + 4 x 4L = 849,920. One rank, or no_shard: nothing divided, nothing gathered.
// bf16: parameters and gradients 2P = 276,608, master and its gradient 4P each, AdamW 8P; offload
// moves master, master gradient, AdamW and the step to the host.
INSTANTIATE_TEST_SUITE_P(
    EveryModeAndWorldSize, MemoryPlanState,
    ::testing::Values(
        StateCase{"no_shard", false, 1, 553'216, 553'216, 0, 0, 1'106'432, 0, 0, 512'000, 0},
        // Data parallel: the step also holds the 25 MiB gradient all-reduce bucket, the larger.
        StateCase{"no_shard", false, 2, 553'216, 553'216, 0, 0, 1'106'432, 0, 0, 25ll << 20, 0},
        StateCase{"no_shard", false, 4, 553'216, 553'216, 0, 0, 1'106'432, 0, 0, 25ll << 20, 0},
        StateCase{"shard_grad_op", false, 1, 553'216, 553'216, 0, 0, 1'106'432, 0, 0, 512'000, 0},
        // As built (learner/distributed/sharded_adamw.h): the fp32 gradient shard 4P / 2 =
        // 276,608; AdamW 8P / 2 = 553,216; beside a layer's backward one bucket in flight (here
        // the whole model, 4P < 25 MiB): 553,216 (the layer's fresh gradient is the layer
        // backward's, the LM head's the LM-head pass's); the step one bucket and three of its
        // halves: 553,216 + 3 x 276,608 = 1,383,040.
        StateCase{"shard_grad_op", false, 2, 553'216, 276'608, 0, 0, 553'216, 0, 553'216, 1'383'040,
                  0},
        // / 4: 138,304; AdamW 276,608; in flight 553,216; step 553,216 + 3 x 138,304 = 968,128.
        StateCase{"shard_grad_op", false, 4, 553'216, 138'304, 0, 0, 276'608, 0, 553'216, 968'128,
                  0},
        StateCase{"full_shard", false, 1, 553'216, 553'216, 0, 0, 1'106'432, 0, 0, 512'000, 0},
        StateCase{"full_shard", false, 2, 276'608, 276'608, 0, 0, 553'216, 256'000, 849'920,
                  256'000, 0},
        StateCase{"full_shard", false, 4, 138'304, 138'304, 0, 0, 276'608, 256'000, 849'920,
                  128'000, 0},
        // bf16, no_shard: 2P, 2P, 4P, 4P, 8P, step 8U.
        StateCase{"no_shard", true, 1, 276'608, 276'608, 553'216, 553'216, 1'106'432, 0, 0, 512'000,
                  0},
        // bf16, full_shard over 4 as built: no bf16 copy between uses (0, 0); the fp32 master
        // shard and its gradient 4P/4 = 138,304 each; AdamW 8P/4 = 276,608; beside the LM head
        // the head's bf16 unit 2U = 128,000; beside a layer's backward that unit and the layer's
        // bf16 weights and gradients 2 x 2L, the fp32 flat they are reduced in 4L and the
        // prefetched layer's bf16 weights 2L: 128,000 + 10 x 37,120 = 499,200; step 8U/4 =
        // 128,000.
        StateCase{"full_shard", true, 4, 0, 0, 138'304, 138'304, 276'608, 128'000, 499'200, 128'000,
                  0},
        // With offload as built: no model state on the GPU, the gathered units as above; on the
        // host the four fp32 shards 16P/4 = 553,216 and the step's temporaries of one unit's
        // chunk 8 x U/4 = 128,000: 681,216.
        StateCase{"full_shard offload", true, 4, 0, 0, 0, 0, 0, 128'000, 499'200, 0, 681'216},
        // no_shard / shard_grad_op offload as built (step_optimizer.h HostsMaster): the compute
        // copy on the GPU, the fp32 master on the host. fp32 at one rank: the copy 4P and its
        // gradient 4P on the GPU; on the host the master 4P, its gradient 4P, AdamW 8P and the
        // step 8U: 16 x 138,304 + 512,000 = 2,724,864; no GPU step buffer (fp32 crosses as it is).
        StateCase{"no_shard offload", false, 1, 553'216, 553'216, 0, 0, 0, 0, 0, 0, 2'724'864},
        // bf16 at 2 ranks: the copy 2P and its gradient 2P; the step on the GPU the larger of the
        // 25 MiB all-reduce bucket and a tensor cast to fp32 as it crosses (4U = 256,000); the
        // host as above, 2,724,864.
        StateCase{"no_shard offload", true, 2, 276'608, 276'608, 0, 0, 0, 0, 0, 25ll << 20,
                  2'724'864},
        // shard_grad_op, fp32 at 2 ranks: the copy 4P; no gradient kept on the GPU, one fp32
        // bucket in flight (the whole model, 553,216); the step all-gathers a bucket beside
        // this rank's half of it: 553,216 + 276,608 = 829,824. Host: the master's half 4P/2 =
        // 276,608 (ZeRO-Offload partitions it), the gradient shard 4P/2 = 276,608, AdamW 8P/2 =
        // 553,216, the step 8U/2 = 256,000: 1,362,432.
        StateCase{"shard_grad_op offload", false, 2, 553'216, 0, 0, 0, 0, 0, 553'216, 829'824,
                  1'362'432},
        // bf16 at 4: the copy 2P; the step gathers a bucket in bf16 beside this rank's quarter
        // of it: 276,608 + 69,152 = 345,760; host 138,304 + 138,304 + 276,608 + 128,000 =
        // 681,216.
        StateCase{"shard_grad_op offload", true, 4, 276'608, 0, 0, 0, 0, 0, 553'216, 345'760,
                  681'216},
        // shard_grad_op with bf16 at 2 (ZeRO-2 with mixed precision): the bf16 copy 2P whole;
        // the fp32 gradient shard, the fp32 master's half and AdamW's 4P/2, 4P/2 and 8P/2; one
        // fp32 bucket in flight (553,216); the step: the rank's fp32 half updated in place,
        // sqrt(v) and the denominator (2 x 276,608), cast to bf16 (138,304) and all-gathered
        // into a bf16 bucket (276,608): 968,128.
        StateCase{"shard_grad_op", true, 2, 276'608, 276'608, 276'608, 0, 553'216, 0, 553'216,
                  968'128, 0}));

// Loading with shard_grad_op's master sharded: the whole fp32 model (4P = 553,216) until the
// chunks are cut from rank 0's, beside one flat fp32 bucket of the broadcast (here the whole
// model, 553,216); with offload the model on the host (host_load) and the bucket on the GPU.
TEST(MemoryPlanSmall, ShardGradOpLoadsTheMasterWholeInMemoryAndAChunkARankFromFiles) {
  common::GrpoConfig cfg = SmallRun();
  cfg.fsdp = "shard_grad_op";
  cfg.bf16 = true;
  auto plan = PlanMemory(Small(), cfg, 2, "cuda");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->load, 1'106'432);
  EXPECT_EQ(plan->host_load, 0);
  cfg.fsdp = "shard_grad_op offload";
  plan = PlanMemory(Small(), cfg, 2, "cuda");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->load, 553'216);
  EXPECT_EQ(plan->host_load, 553'216);
  // Beside the offloaded state (4P/2 + 4P/2 + 8P/2 + 8U/2 = 1,362,432) and the process, the
  // larger of the loaded model and the two snapshots (2 x 4P).
  EXPECT_EQ(plan->HostTotal(), 1'362'432 + 2 * 553'216 + plan->host_other);
  // Read from model_name_or_path (sharded loading): the copy a tensor at a time before the
  // shards exist, then each rank's chunks; the largest tensor in fp32 (4U = 256,000) is below
  // the shards (4P/2 + 4P/2 + 8P/2 = 1,106,432), so nothing beyond them, on the GPU or the host.
  cfg.model_name_or_path = "/models/small";
  plan = PlanMemory(Small(), cfg, 2, "cuda");
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->sharded_loading);
  EXPECT_EQ(plan->load, 0);
  EXPECT_EQ(plan->host_load, 0);
  cfg.fsdp = "shard_grad_op";
  plan = PlanMemory(Small(), cfg, 2, "cuda");
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->sharded_loading);
  EXPECT_EQ(plan->load, 0);
  // At 32 ranks the shards (16P/32 = 69,152) are below that tensor: 256,000 - 69,152.
  plan = PlanMemory(Small(), cfg, 32, "cuda");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->load, 186'848);
  cfg.model_name_or_path.clear();
  // fp32 without offload: the parameters are the master, nothing to cut.
  cfg.fsdp = "shard_grad_op";
  cfg.bf16 = false;
  plan = PlanMemory(Small(), cfg, 2, "cuda");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->load, 0);
}

TEST(MemoryPlanSmall, ActivationsFromTheForwardsSavedTensorsFp32) {
  // B = 2 rows of T = 6 + 10 = 16 tokens (32 tokens), N = 20 completion tokens, chunk 8; s = 4.
  // G = 3: a micro-batch may straddle two groups, so no prompt is shared and each row runs whole.
  // Per token of a layer: input 4D + input norm 8D = 768; q, rotate(q), scaled q 3 x 4Q = 768;
  // k, rotate(k), roped k, v 4 x 4K = 512; attention output 4Q = 256; residual 4D + post norm
  // 8D = 768; MLP 4 x 4I = 2,048: 5,120 bytes. Probabilities B x H x T x T = 2,048 x 4 = 8,192.
  // A layer: 32 x 5,120 + 8,192 = 172,032.
  // Shared: mask B x T x T = 512 + the attention mask made of it 512 x 4 = 2,048 + cos, sin
  // 2 x 32 x 16 x 4 = 4,096 + int64 inputs 24 x 32 = 768; final norm 32 x (4D + 8D) = 24,576;
  // together 32,000.
  common::GrpoConfig cfg = SmallRun();
  cfg.num_generations = 3;
  auto plan = PlanMemory(Small(), cfg, 1, "cpu");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->activations_no_checkpointing, 2 * 172'032 + 32'000);  // 376,064
  // Checkpointing keeps each layer's input only: 2 x 32 x 4D = 16,384.
  EXPECT_EQ(plan->activations_checkpointing, 16'384 + 32'000);
  // Logits: a fp32 [8, 1000] chunk and a [min(64, 8), 1000] block of exp(): 32,000 + 32,000.
  EXPECT_EQ(plan->logits_chunk, 64'000);
  // LM head: [N, D] hidden and gradient 2 x 4 x 20 x 64 = 10,240; fp32 [V, D] accumulator
  // 256,000 with the chunk (330,240), or in backward the saved and the scaled [V, D] gradients
  // 512,000 (522,240).
  EXPECT_EQ(plan->lm_head_pass, 522'240);
  // Backward of a layer: max(8 x 2,048 score gradients, 3 x 4 x 32 x 128 MLP gradients) =
  // 49,152; the tied LM head's gradient held (4 x 64,000) and two [B, T, D] gradients (16,384);
  // the largest weight's fresh gradient 4 x 128 x 64 = 32,768: 354,304.
  EXPECT_EQ(plan->layer_backward_no_checkpointing, 354'304);
  // Recomputed: + the layer's activations 172,032, all its weights' gradients 4 x 37,120 =
  // 148,480 instead of one: 49,152 + 272,384 + 172,032 + 148,480.
  EXPECT_EQ(plan->layer_backward_checkpointing, 642'048);
  EXPECT_EQ(plan->MicroBatchPeak(), 376'064 + 522'240);
  // State 16P = 2,212,864; the micro-batch (898,304) outweighs the step (512,000).
  EXPECT_EQ(plan->TrainingPeak(), 2'212'864 + 898'304);
  // On the CPU the service adds its snapshot 4P, the 16 MiB gloo bucket and the process; the
  // publishing phase (a second snapshot, 553,216) is below the micro-batch.
  EXPECT_EQ(plan->Total(), 2'212'864 + 553'216 + (16ll << 20) + kHostRuntimeBytes + 898'304);
}

TEST(MemoryPlanSmall, ActivationsBf16KeepFp32CopiesOfNormsAndSoftmax) {
  // s = 2. Per token of a layer: 2D + 8D = 640; 3 x 2Q + 4 x 2K = 640; 2Q = 128; 2D + 8D = 640;
  // 4 x 2I = 1,024: 3,072. Probabilities fp32 + bf16 copy: 2,048 x 6 = 12,288. A layer:
  // 32 x 3,072 + 12,288 = 110,592. Shared: 512 + the attention mask 512 x 2 + cos, sin
  // 2 x 32 x 16 x 2 + 768 = 4,352; final norm
  // 32 x (2D + 8D) = 20,480. G = 3: no prompt shared, as above.
  common::GrpoConfig cfg = SmallRun();
  cfg.num_generations = 3;
  cfg.bf16 = true;
  auto plan = PlanMemory(Small(), cfg, 1, "cpu");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->activations_no_checkpointing, 2 * 110'592 + 4'352 + 20'480);
  EXPECT_EQ(plan->activations_checkpointing, 2 * 32 * 2 * 64 + 4'352 + 20'480);
  // Chunk: max(6 x 8 x 1000, 4 x 8 x 1000 + 4 x 8 x 1000) = 64,000.
  EXPECT_EQ(plan->logits_chunk, 64'000);
}

// The rows of one group (G = 2, B = 2) share their prompt: it runs through the layers once
// (U = 1 row of P = 6 tokens, 6 keys per query), then both completions but their last token
// (2 rows of S = 9 tokens, each query over the prompt's 6 keys and its own 9).
TEST(MemoryPlanSmall, ActivationsOfAPromptSharedByItsGroup) {
  auto plan = PlanMemory(Small(), SmallRun(), 1, "cpu");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->distinct_prompts, 1);
  // Tokens 6 + 18 = 24 at 5,120 bytes (above); probabilities 1 x 4 x 6 x 6 + 2 x 4 x 9 x 15 =
  // 144 + 1,080 = 1,224 at 4 bytes; each completion row's copy of the prompt's keys and values,
  // 2 rows x 6 columns x 2 x 4K = 3,072. A layer: 122,880 + 4,896 + 3,072 = 130,848.
  // Shared: the masks' 36 + 270 = 306 cells x (1 + 4) = 1,530; cos, sin 2 x 24 x 16 x 4 = 3,072;
  // the padded rows' int64 inputs 24 x 32 = 768. The final norm over the 2 x 10 positions that
  // predict: 20 x 12D = 15,360. Together 20,730.
  EXPECT_EQ(plan->activations_no_checkpointing, 2 * 130'848 + 20'730);  // 282,426
  EXPECT_EQ(plan->activations_checkpointing, 2 * 24 * 4 * 64 + 20'730);
  // Backward of a layer, a stream at a time: max(8 x 144, 3 x 4 x 6 x 128, 8 x 1,080,
  // 3 x 4 x 18 x 128) = 27,648; the tied head's gradient 256,000 and two gradients of the 24
  // tokens 12,288; the largest weight's 32,768.
  EXPECT_EQ(plan->layer_backward_no_checkpointing, 27'648 + 268'288 + 32'768);
  EXPECT_EQ(plan->layer_backward_checkpointing, 130'848 + 27'648 + 268'288 + 4 * 37'120);
}

// The most distinct prompts in a micro-batch of B rows cut from whole groups of G rows: counted
// here by walking every micro-batch of a long batch.
TEST(MemoryPlanSmall, DistinctPromptsAreTheMostAMicroBatchSpans) {
  for (int64_t b : {1, 2, 3, 4, 5, 6, 8, 16}) {
    for (int64_t g : {1, 2, 3, 4, 8}) {
      int64_t most = 0;
      for (int64_t m = 0; m < 64; ++m) {
        std::set<int64_t> groups;
        for (int64_t row = m * b; row < (m + 1) * b; ++row) groups.insert(row / g);
        most = std::max<int64_t>(most, static_cast<int64_t>(groups.size()));
      }
      common::GrpoConfig cfg = SmallRun();
      cfg.per_device_train_batch_size = b;
      cfg.num_generations = g;
      auto plan = PlanMemory(Small(), cfg, 1, "cpu");
      ASSERT_TRUE(plan.ok());
      EXPECT_EQ(plan->distinct_prompts, most) << "B " << b << " G " << g;
    }
  }
}

TEST(MemoryPlanSmall, ReferenceModelWhenBetaIsNotZero) {
  common::GrpoConfig cfg = SmallRun();
  auto none = PlanMemory(Small(), cfg, 1, "cpu");
  cfg.beta = 0.04;
  cfg.bf16 = true;
  auto with = PlanMemory(Small(), cfg, 1, "cpu");
  ASSERT_TRUE(none.ok() && with.ok());
  EXPECT_EQ(none->reference_model, 0);
  EXPECT_EQ(with->reference_model, 2 * 138'304);  // a bf16 copy
  // Where full_shard gathers the policy's units, the reference is sharded too (FrozenShards):
  // 1/4 of the bf16 copy a rank; with offload on a GPU on the host, beside the policy's four
  // fp32 shards and the step's 8 bytes a chunk of the largest unit (the 64 x 1000 embedding).
  // Not where the policy stays whole (no_shard), nor at one CPU rank.
  cfg.fsdp = "full_shard";
  auto sharded = PlanMemory(Small(), cfg, 4, "cpu");
  ASSERT_TRUE(sharded.ok());
  EXPECT_EQ(sharded->reference_model, 2 * 138'304 / 4);
  cfg.fsdp = "full_shard offload";
  auto offloaded = PlanMemory(Small(), cfg, 2, "cuda");
  ASSERT_TRUE(offloaded.ok());
  EXPECT_EQ(offloaded->reference_model, 0);
  EXPECT_EQ(offloaded->host_offloaded, 16 * 138'304 / 2 + 8 * 64'000 / 2 + 2 * 138'304 / 2);
  cfg.fsdp = "no_shard";
  auto whole = PlanMemory(Small(), cfg, 4, "cpu");
  cfg.fsdp = "full_shard";
  auto alone = PlanMemory(Small(), cfg, 1, "cpu");
  ASSERT_TRUE(whole.ok() && alone.ok());
  EXPECT_EQ(whole->reference_model, 2 * 138'304);
  EXPECT_EQ(alone->reference_model, 2 * 138'304);
}

// The plan notes the autograd LM-head path exactly where the trainer takes it: the plan spells
// the rule from the config (no libtorch there), the trainer asks TokenSeparable.
TEST(MemoryPlanSmall, NotesTheAutogradPathWhereTheTrainerTakesIt) {
  std::vector<common::GrpoConfig> configs(6, SmallRun());
  configs[1].importance_sampling_level = "sequence";
  configs[2].loss_type = "vespo";
  configs[3].off_policy_mask_threshold = 0.5;
  configs[4].top_entropy_quantile = 0.2;
  configs[5].loss_type = "cispo";  // token-separable: fused
  for (const common::GrpoConfig& cfg : configs) {
    auto plan = PlanMemory(Small(), cfg, 1, "cpu");
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    const bool noted = NoteSays(*plan, "runs through autograd");
    GrpoLossConfig lc;
    lc.loss_type = *ParseLossType(cfg.loss_type);
    lc.importance_sampling_level = *ParseImportanceSamplingLevel(cfg.importance_sampling_level);
    lc.off_policy_mask_threshold = cfg.off_policy_mask_threshold;
    lc.top_entropy_quantile = cfg.top_entropy_quantile;
    EXPECT_EQ(noted, !TokenSeparable(lc, /*has_old=*/true)) << cfg.loss_type;
  }
}

TEST(MemoryPlanSmall, WeightSyncBucketsAreTheBackendsDefaults) {
  common::GrpoConfig cfg = SmallRun();
  auto gloo = PlanMemory(Small(), cfg, 1, "cpu");
  cfg.weight_sync_backend = "cuda_ipc";
  auto ipc = PlanMemory(Small(), cfg, 1, "cuda");
  ASSERT_TRUE(gloo.ok() && ipc.ok());
  EXPECT_EQ(gloo->weight_sync_bucket, common::kDefaultBucketBytes);
  EXPECT_EQ(ipc->weight_sync_bucket, common::WeightSyncBackendOptions{}.ipc_bucket_bytes);
  // A GPU copy of the fp32 weights for NCCL / CUDA IPC workers, and two on the host.
  EXPECT_EQ(ipc->weight_snapshot, 4 * 138'304);
  EXPECT_EQ(ipc->host_weight_snapshot, 2 * 4 * 138'304);
}

TEST(MemoryPlanSmall, RefusesBadInput) {
  common::GrpoConfig cfg = SmallRun();
  EXPECT_EQ(PlanMemory(Small(), cfg, 0, "cpu").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanMemory(Small(), cfg, 1, "auto").status().code(), StatusCode::kInvalidArgument);
  cfg.fsdp = "zero3";
  auto bad = PlanMemory(Small(), cfg, 1, "cpu");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fsdp"), std::string::npos);
}

// The largest model a config.json may declare (model_config.h's bounds), counted by hand:
// q = k = 2^10 heads x 2^11 = 2^21; a layer is q, k, v, o (2^39 + 2 x 2^39 + 2^39), the MLP
// (3 x 2^20 x 2^18) and two norms (2 x 2^18), plus qwen2's q/k/v biases (3 x 2^21); tied
// embeddings 2^24 x 2^18 and the final norm 2^18.
common::ModelConfig LargestModel() {
  common::ModelConfig m = Config("qwen2", int64_t{1} << 24, int64_t{1} << 18, int64_t{1} << 20,
                                 int64_t{1} << 10, int64_t{1} << 10, int64_t{1} << 10, true);
  m.head_dim = int64_t{1} << 11;
  return m;
}

TEST(MemoryPlanBounds, TheLargestModelIsCountedExactly) {
  const common::ModelConfig m = LargestModel();
  ASSERT_TRUE(m.Validate("largest").ok()) << m.Validate("largest").ToString();
  const int64_t per_layer = 4 * (int64_t{1} << 39) + 3 * (int64_t{1} << 38) +
                            2 * (int64_t{1} << 18) + 3 * (int64_t{1} << 21);
  const ParameterCounts c = CountParameters(m);
  EXPECT_EQ(c.per_layer, per_layer);
  EXPECT_EQ(c.total, (int64_t{1} << 42) + (int64_t{1} << 10) * per_layer + (int64_t{1} << 18));
  common::GrpoConfig cfg = SmallRun();
  auto plan = PlanMemory(m, cfg, 1, "cpu");
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->parameters, 4 * c.total);
  EXPECT_EQ(plan->adamw_state, 8 * c.total);
  EXPECT_GT(plan->Total(), 24 * c.total);
}

// At every bound at once (the largest model, 2^20 rows of 2 x 2^24 tokens) the activations of
// one micro-batch pass 2^63 bytes: refused with the knobs named, never overflowed (tests/fuzz
// found the plan's int64 products overflowing from a config.json alone).
TEST(MemoryPlanBounds, AMicroBatchBeyondAnyDeviceIsRefusedNamingTheKnobs) {
  common::GrpoConfig cfg = SmallRun();
  cfg.per_device_train_batch_size = int64_t{1} << 20;
  cfg.max_prompt_length = cfg.max_completion_length = int64_t{1} << 24;
  cfg.logprob_chunk_tokens = int64_t{1} << 24;
  ASSERT_TRUE(cfg.Validate().ok()) << cfg.Validate().ToString();
  for (bool bf16 : {false, true}) {
    cfg.bf16 = bf16;
    auto plan = PlanMemory(LargestModel(), cfg, 4, "cuda");
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find("activations_no_checkpointing"), std::string::npos)
        << plan.status().ToString();
    EXPECT_NE(plan.status().message().find("per_device_train_batch_size"), std::string::npos);
  }
}

// Past 2^53 (where a double would round) the figures stay exact: one fp32 row of 2^25 tokens of
// the small model (4 heads, I 128, D 64, tied V 1000). Its layer backward, by hand: the widest
// gradient is the scores' 8 x (4 x 2^25 x 2^25) = 2^55 (the MLP's 3 x 4 x 2^25 x 128 is less),
// held are the tied [V, D] gradient 4 x 1000 x 64 and 2 x 4 x 2^25 x 64 = 2^34, and the largest
// weight's gradient 4 x 128 x 64.
TEST(MemoryPlanBounds, FiguresPast2To53AreExact) {
  common::GrpoConfig cfg = SmallRun();
  cfg.per_device_train_batch_size = 1;
  cfg.max_prompt_length = cfg.max_completion_length = int64_t{1} << 24;
  auto plan = PlanMemory(Small(), cfg, 1, "cpu");
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->layer_backward_no_checkpointing,
            (int64_t{1} << 55) + 4 * 1000 * 64 + (int64_t{1} << 34) + 4 * 128 * 64);
}

// full_shard without its prefetch (fsdp_prefetch: false): beside a layer's backward the head's
// unit 4U and the layer whole, its gradients and their flat, 3 x 4L: 256,000 + 445,440 =
// 701,440 at 4 ranks, one layer 4L = 148,480 less. The layer's phase is the larger either way
// (the LM-head pass 522,240 + 256,000 against the layer's 354,304 + 701,440), so the
// micro-batch's peak falls by that layer; the model state is the same.
TEST(MemoryPlanSmall, FullShardWithoutPrefetchHoldsOneLayerLess) {
  common::GrpoConfig cfg = SmallRun();
  cfg.fsdp = "full_shard";
  auto with = PlanMemory(Small(), cfg, 4, "cuda");
  cfg.fsdp_prefetch = false;
  auto without = PlanMemory(Small(), cfg, 4, "cuda");
  ASSERT_TRUE(with.ok() && without.ok());
  EXPECT_EQ(without->gathered_layer, 701'440);
  EXPECT_EQ(with->gathered_layer - without->gathered_layer, 148'480);
  EXPECT_EQ(without->gathered_lm_head, with->gathered_lm_head);
  EXPECT_EQ(with->MicroBatchPeak() - without->MicroBatchPeak(), 148'480);
  EXPECT_EQ(with->ModelState(), without->ModelState());
}

// full_shard at one rank shards nothing, unless offloaded on a GPU (ZeRO-Offload on one GPU:
// the shards on the host, a unit gathered at a time); the note says which.
// full_shard after the backward (FinishBackward, the activations freed): the head's unit whole
// (4U = 256,000 in fp32), the .grad of the units autograd accumulates (tied: the one [V, D],
// 256,000; untied: the head's and the embedding's, 512,000) and the fp32 flat the first is
// packed into (256,000): 768,000 tied, 1,024,000 untied; bf16 tied 2U + 2U + 4U = 512,000.
// It is the larger phase only where a layer is small beside the head (MemoryPlanRanks, short rows);
// here, with rows of 1 + 1 tokens, untied, the LM-head pass is 4 x 2 x 1 x 64 + 8 x 64,000 =
// 512,512, and a layer's backward the larger: the activations 2 x (2 x 5,120 + 64) + 4 + 16 (the
// attention mask, 4 x 4) + 256 + 48 + 1,536 = 22,468, the layer's backward 3,072 + 1,024 +
// 32,768 = 36,864, and beside it the head's unit and .grad and the layer four times 512,000 +
// 16 x 37,120 = 1,105,920: 1,165,252.
TEST(MemoryPlanSmall, FullShardAfterTheBackwardHoldsTheHeadAndItsGradients) {
  common::GrpoConfig cfg = SmallRun();
  cfg.fsdp = "full_shard";
  auto tied = PlanMemory(Small(), cfg, 2, "cpu");
  ModelConfig untied_model = Small();
  untied_model.tie_word_embeddings = false;
  auto untied = PlanMemory(untied_model, cfg, 2, "cpu");
  cfg.bf16 = true;
  auto bf16 = PlanMemory(Small(), cfg, 2, "cpu");
  ASSERT_TRUE(tied.ok() && untied.ok() && bf16.ok());
  EXPECT_EQ(tied->finish_backward, 768'000);
  EXPECT_EQ(untied->finish_backward, 1'024'000);
  EXPECT_EQ(bf16->finish_backward, 512'000);
  EXPECT_GT(tied->MicroBatchPeak(), tied->finish_backward);  // 2 rows of 16 tokens: not here

  common::GrpoConfig short_rows = SmallRun();
  short_rows.fsdp = "full_shard";
  short_rows.per_device_train_batch_size = 1;
  short_rows.max_prompt_length = short_rows.max_completion_length = 1;
  auto small = PlanMemory(untied_model, short_rows, 2, "cpu");
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->lm_head_pass, 512'512);
  EXPECT_EQ(small->MicroBatchPeak(), 1'165'252);
  EXPECT_LT(small->finish_backward, small->MicroBatchPeak());
  short_rows.fsdp = "no_shard";
  auto unsharded = PlanMemory(untied_model, short_rows, 2, "cpu");
  ASSERT_TRUE(unsharded.ok());
  EXPECT_EQ(unsharded->finish_backward, 0);
}

TEST(MemoryPlanSmall, OneFullShardRankIsNoShardUnlessOffloaded) {
  common::GrpoConfig cfg = SmallRun();
  cfg.fsdp = "full_shard";
  auto alone = PlanMemory(Small(), cfg, 1, "cuda");
  cfg.fsdp = "full_shard offload";
  auto offloaded = PlanMemory(Small(), cfg, 1, "cuda");
  ASSERT_TRUE(alone.ok() && offloaded.ok());
  EXPECT_TRUE(NoteSays(*alone, "shards nothing"));
  EXPECT_EQ(alone->gathered_lm_head, 0);
  EXPECT_FALSE(NoteSays(*offloaded, "shards nothing"));
  EXPECT_EQ(offloaded->gathered_lm_head, 4 * 64'000);  // the tied head's unit, fp32
}

TEST(MemoryPlanSmall, CpuOffloadChangesNothingAndSaysSo) {
  common::GrpoConfig cfg = SmallRun();
  auto plain = PlanMemory(Small(), cfg, 1, "cpu");
  cfg.fsdp = "no_shard offload";
  auto offload = PlanMemory(Small(), cfg, 1, "cpu");
  ASSERT_TRUE(plain.ok() && offload.ok());
  EXPECT_EQ(offload->Total(), plain->Total());
  EXPECT_TRUE(NoteSays(*offload, "offload changes nothing"));
}

// bf16 on the CPU: the plan says that oneDNN's compiled kernels come on top of the tensors
// (README "bf16 on the CPU"); fp32 on the CPU and bf16 on a GPU do not compile per shape.
TEST(MemoryPlanSmall, Bf16OnTheCpuNotesTheCompiledKernels) {
  common::GrpoConfig cfg = SmallRun();
  auto fp32 = PlanMemory(Small(), cfg, 1, "cpu");
  cfg.bf16 = true;
  auto cpu = PlanMemory(Small(), cfg, 1, "cpu");
  auto gpu = PlanMemory(Small(), cfg, 1, "cuda");
  ASSERT_TRUE(fp32.ok() && cpu.ok() && gpu.ok());
  EXPECT_FALSE(NoteSays(*fp32, "compiled kernel"));
  EXPECT_TRUE(NoteSays(*cpu, "compiled kernel"));
  EXPECT_FALSE(NoteSays(*gpu, "compiled kernel"));
}

// --- Suggestions.

// Applies a suggestion's changes as a user would: the keys through SetConfigValue.
std::pair<common::GrpoConfig, int> Apply(common::GrpoConfig cfg, int world, const Suggestion& s) {
  for (const ConfigChange& c : s.changes) {
    if (c.key == "world_size") {
      world = std::stoi(c.value);
    } else {
      EXPECT_TRUE(common::SetConfigValue(cfg, c.key, c.value).ok()) << c.key << " " << c.value;
    }
  }
  EXPECT_TRUE(cfg.Validate().ok());
  return {cfg, world};
}

constexpr int64_t k80GiB = 80ll << 30;

TEST(MemoryPlan7B, OneRankDoesNotFit80GiBAndTheSuggestionDoes) {
  common::GrpoConfig cfg;  // the defaults: 8 rows of 512 + 256 tokens
  cfg.bf16 = true;
  auto plan = PlanMemory(Qwen25_7B(), cfg, 1, "cuda");
  ASSERT_TRUE(plan.ok());
  // bf16 model state alone is 20 bytes per parameter: 152 GB.
  EXPECT_EQ(plan->ModelState(), 20 * 7'615'616'512);
  EXPECT_FALSE(plan->Fits(k80GiB));
  auto fix = SuggestFix(Qwen25_7B(), cfg, 1, "cuda", k80GiB);
  ASSERT_TRUE(fix.ok()) << fix.status().ToString();
  ASSERT_FALSE(fix->changes.empty());
  EXPECT_TRUE(fix->plan.Fits(k80GiB));
  const auto [fixed, world] = Apply(cfg, 1, *fix);
  auto replanned = PlanMemory(Qwen25_7B(), fixed, world, "cuda");
  ASSERT_TRUE(replanned.ok());
  EXPECT_TRUE(replanned->Fits(k80GiB)) << fix->Text();
  EXPECT_EQ(replanned->Total(), fix->plan.Total());
  std::printf("7B on one 80 GiB GPU: %s\n", fix->Text().c_str());
}

TEST(MemoryPlan7B, EightFullShardRanksWithCheckpointingFit) {
  common::GrpoConfig cfg;
  cfg.bf16 = true;
  cfg.gradient_checkpointing = true;
  cfg.fsdp = "full_shard";
  auto plan = PlanMemory(Qwen25_7B(), cfg, 8, "cuda");
  ASSERT_TRUE(plan.ok());
  // 16 bytes per parameter over 8 ranks as built (the fp32 master, its gradient and AdamW; no
  // bf16 copy between uses: 15.2 GB). Beside the LM-head pass the head's unit, bf16 [V, D];
  // beside a layer's backward that unit and the untied head's bf16 .grad, and a decoder layer
  // (L = q 3584 x 3584 + 3584, k and v 2 x (512 x 3584 + 512), o 3584 x 3584, MLP 3 x 18944 x
  // 3584, 2 norms x 3584 = 233,057,792) as bf16 weights and gradients, the fp32 flat they are
  // reduced in and the prefetched layer's bf16 weights: 2 x 2VD + 10L.
  EXPECT_EQ(plan->parameters, 0);
  EXPECT_EQ(plan->master_weights + plan->master_gradients + plan->adamw_state,
            16 * 7'615'616'512ll / 8);
  EXPECT_EQ(plan->params.per_layer, 233'057'792);
  EXPECT_EQ(plan->gathered_lm_head, 2 * 152064ll * 3584);
  EXPECT_EQ(plan->gathered_layer, 4 * 152064ll * 3584 + 10 * 233'057'792ll);
  EXPECT_TRUE(plan->Fits(k80GiB)) << FormatPlan(*plan, k80GiB);
}

// weight_publish stream keeps no snapshot. On the CPU the snapshot plan holds 4 bytes a
// parameter for the published version and as much again while the next is made (28.4 GiB twice
// for the 7B: 4 x 7,615,616,512); the streaming plan holds none of it. On a GPU the device copy
// for GPU backends goes too (the group's bucket stays), and the host keeps one tensor at a
// time: the [V, D] embedding, 4 x 152,064 x 3,584 bytes.
TEST(MemoryPlan7B, AStreamingLearnerHoldsNoPublishedWeights) {
  common::GrpoConfig cfg;
  cfg.bf16 = true;
  cfg.gradient_checkpointing = true;
  cfg.per_device_train_batch_size = 1;
  cfg.num_generations = 2;
  cfg.steps_per_generation = 2;
  cfg.fsdp = "full_shard";
  cfg.model_name_or_path = "/models/Qwen2.5-7B";  // each rank reads its shards (sharded loading)
  const int64_t n = 7'615'616'512ll;
  auto snapshot = PlanMemory(Qwen25_7B(), cfg, 64, "cpu");
  cfg.weight_publish = "stream";
  auto streamed = PlanMemory(Qwen25_7B(), cfg, 64, "cpu");
  ASSERT_TRUE(snapshot.ok() && streamed.ok());
  EXPECT_EQ(snapshot->weight_snapshot, 4 * n);
  EXPECT_EQ(streamed->weight_snapshot, 0);
  EXPECT_TRUE(streamed->streams_weights);
  // Loading holds one unit's bf16 buffer beside the shards: the [V, D] embedding,
  // 2 x 152,064 x 3,584 bytes (1.02 GiB).
  EXPECT_TRUE(streamed->sharded_loading);
  EXPECT_EQ(streamed->load, 2 * 152064ll * 3584);
  // Streamed, the largest phase is the micro-batch; with the snapshot, the snapshot held (4n)
  // and the second one made while it is held (a phase of 4n, the largest).
  const int64_t rest = streamed->weight_sync_bucket + streamed->runtime;
  EXPECT_GT(streamed->MicroBatchPeak(), std::max(streamed->load, streamed->publish_unit));
  EXPECT_EQ(streamed->Total(), streamed->ModelState() + rest + streamed->MicroBatchPeak());
  EXPECT_EQ(snapshot->Total(), snapshot->ModelState() + rest + 4 * n + 4 * n);
  // At 64 ranks a rank's model state is 16 x 7.6 G / 64 = 1.9 GB (1.77 GiB); with the
  // micro-batch (5.2 GiB), the bucket and the process (0.39), 7.4 GiB streamed; with the two
  // snapshots (8n = 56.74 GiB) 58.9: 16 GiB fits only streaming.
  EXPECT_NEAR(streamed->Total() / double(1ll << 30), 7.38, 0.01);
  EXPECT_NEAR(snapshot->Total() / double(1ll << 30), 58.90, 0.01);
  EXPECT_FALSE(snapshot->Fits(16ll << 30)) << FormatPlan(*snapshot, 16ll << 30);
  EXPECT_TRUE(streamed->Fits(16ll << 30)) << FormatPlan(*streamed, 16ll << 30);
  // A model built in memory (no model_name_or_path) is whole on every rank while the shards are
  // cut from rank 0's: the fp32 model and its bf16 copy (6n = 42.6 GiB) and the [V, D] unit
  // packed in fp32 (2.03 GiB): 44.6 GiB, the largest phase.
  common::GrpoConfig in_memory_cfg = cfg;
  in_memory_cfg.model_name_or_path.clear();
  auto in_memory = PlanMemory(Qwen25_7B(), in_memory_cfg, 64, "cpu");
  ASSERT_TRUE(in_memory.ok());
  EXPECT_FALSE(in_memory->sharded_loading);
  EXPECT_EQ(in_memory->load, 6 * n + 4 * 152064ll * 3584);
  EXPECT_EQ(in_memory->Total(), streamed->Total() - streamed->MicroBatchPeak() + in_memory->load);
  EXPECT_NE(FormatPlan(*streamed, 0).find("weight_publish stream"), std::string::npos);

  cfg.weight_sync_backend = "auto";
  auto gpu = PlanMemory(Qwen25_7B(), cfg, 8, "cuda");
  ASSERT_TRUE(gpu.ok());
  EXPECT_EQ(gpu->weight_snapshot, 0);
  EXPECT_EQ(gpu->host_weight_snapshot, 4 * 152064ll * 3584);
  cfg.weight_publish = "snapshot";
  auto gpu_snapshot = PlanMemory(Qwen25_7B(), cfg, 8, "cuda");
  ASSERT_TRUE(gpu_snapshot.ok());
  EXPECT_EQ(gpu_snapshot->weight_snapshot, 4 * n);
  EXPECT_EQ(gpu_snapshot->host_weight_snapshot, 2 * 4 * n);
  EXPECT_EQ(gpu->weight_sync_bucket, gpu_snapshot->weight_sync_bucket);
  // The device copy, counted again as the publishing phase when it is the largest one.
  EXPECT_GE(gpu_snapshot->Total() - gpu->Total(), 4 * n);
  EXPECT_LE(gpu_snapshot->Total() - gpu->Total(), 2 * 4 * n);
}

// The bench model's shape with sequences long enough that activations matter.
ModelConfig Bench() { return Config("qwen2", 32768, 256, 704, 4, 4, 2, true); }

TEST(SuggestFix, CheckpointingAloneWhenItIsEnough) {
  common::GrpoConfig cfg;
  cfg.max_prompt_length = 1024;
  cfg.max_completion_length = 1024;
  auto off = PlanMemory(Bench(), cfg, 1, "cuda");
  cfg.gradient_checkpointing = true;
  auto on = PlanMemory(Bench(), cfg, 1, "cuda");
  ASSERT_TRUE(off.ok() && on.ok());
  ASSERT_LT(on->Total(), off->Total());
  cfg.gradient_checkpointing = false;
  const int64_t budget = (on->Total() + off->Total()) / 2;
  auto fix = SuggestFix(Bench(), cfg, 1, "cuda", budget);
  ASSERT_TRUE(fix.ok()) << fix.status().ToString();
  ASSERT_EQ(fix->changes.size(), 1u);
  EXPECT_EQ(fix->changes[0].key, "gradient_checkpointing");
  EXPECT_EQ(fix->Text(), "set gradient_checkpointing: true");
}

TEST(SuggestFix, SmallerBatchKeepsTheOptimizerBatch) {
  common::GrpoConfig cfg;
  cfg.gradient_checkpointing = true;
  cfg.per_device_train_batch_size = 16;
  cfg.max_prompt_length = 1024;
  cfg.max_completion_length = 1024;
  cfg.fsdp = "full_shard offload";
  auto at4 = PlanMemory(
      Bench(),
      [&] {
        common::GrpoConfig c = cfg;
        c.per_device_train_batch_size = 4;
        return c;
      }(),
      1, "cuda");
  ASSERT_TRUE(at4.ok());
  auto fix = SuggestFix(Bench(), cfg, 1, "cuda", at4->Total());
  ASSERT_TRUE(fix.ok()) << fix.status().ToString();
  const auto [fixed, world] = Apply(cfg, 1, *fix);
  EXPECT_EQ(world, 1);                              // rows first: ranks come last
  EXPECT_EQ(fixed.per_device_train_batch_size, 4);  // the largest divisor of 16 that fits
  EXPECT_EQ(fixed.gradient_accumulation_steps, 4);
  EXPECT_EQ(fixed.GenerationBatchSize(), cfg.GenerationBatchSize());
}

TEST(SuggestFix, TheFewestRanksThatFit) {
  // On the CPU (offload changes nothing there), with every other knob already turned.
  common::GrpoConfig cfg;
  cfg.gradient_checkpointing = true;
  cfg.per_device_train_batch_size = 1;
  cfg.num_generations = 2;
  cfg.steps_per_generation = 2;
  cfg.fsdp = "full_shard";
  cfg.bf16 = true;
  cfg.weight_publish = "stream";
  auto fix = SuggestFix(Qwen25_7B(), cfg, 1, "cpu", k80GiB);
  ASSERT_TRUE(fix.ok()) << fix.status().ToString();
  ASSERT_EQ(fix->changes.size(), 1u);
  ASSERT_EQ(fix->changes[0].key, "world_size");
  const int w = std::stoi(fix->changes[0].value);
  auto fewer = PlanMemory(Qwen25_7B(), cfg, w - 1, "cpu");
  ASSERT_TRUE(fewer.ok());
  EXPECT_FALSE(fewer->Fits(k80GiB));
  EXPECT_TRUE(fix->plan.Fits(k80GiB));
  EXPECT_EQ(fix->Text(),
            "run " + std::to_string(w) + " ranks (world_size " + std::to_string(w) + ")");
}

TEST(SuggestFix, OffloadOnlyWhereTheHostHoldsIt) {
  common::GrpoConfig cfg;
  cfg.bf16 = true;
  // Offloaded, a rank's host holds master, its gradient and AdamW (16 bytes per parameter, 122
  // GB) beside two fp32 snapshots (61 GB): a 1 TiB host does, a 64 GiB one does not.
  auto roomy = SuggestFix(Qwen25_7B(), cfg, 1, "cuda", k80GiB, SuggestOptions{1ll << 40});
  auto tight = SuggestFix(Qwen25_7B(), cfg, 1, "cuda", k80GiB, SuggestOptions{64ll << 30});
  ASSERT_TRUE(roomy.ok() && tight.ok());
  EXPECT_EQ(roomy->Text(), "set fsdp: no_shard offload");
  EXPECT_LE(roomy->plan.HostTotal(), 1ll << 40);
  // full_shard at 2 ranks would fit the host but not the GPU (its load phase, above):
  // offloaded, over 2 ranks the host holds 16n/2 = 56.7 GiB and the rest, 61.2 GiB.
  EXPECT_EQ(tight->Text(),
            "set weight_publish: stream, fsdp: full_shard offload and run 2 ranks (world_size 2)");
  EXPECT_LE(tight->plan.HostTotal(), 64ll << 30);
}

TEST(SuggestFix, NotFoundWhenNothingFits) {
  auto fix = SuggestFix(Qwen25_7B(), common::GrpoConfig{}, 1, "cuda", 1ll << 20);
  EXPECT_EQ(fix.status().code(), StatusCode::kNotFound);
}

// The 7B in bf16 (n = 7,615,616,512, V x D = 152,064 x 3,584) on one 80 GiB GPU, a model built
// in memory. The first change that fits is no_shard offload: on the GPU the bf16 compute copy
// and its gradient (4n = 28.37 GiB), the micro-batch (as planned without offload, the same
// forward: the 8 rows are one group, their prompt runs once, so the activations of the 28 layers
// are 28 x (2,552 tokens x 256,000 bytes + 51.15 M probabilities x 6 + 8.4 MB of the rows'
// copies of the prompt's keys and values) = 25.3 GiB, 28.4 with the LM head's pass; 61.9 GiB
// when each row ran its prompt) and CUDA's 1 GiB: 57.78 GiB. The GPU step (a [V, D] tensor cast
// to fp32 as it crosses, 4VD = 2.03 GiB) is smaller than the micro-batch. The host: the fp32
// master, its gradient and AdamW (16n) and the step (8VD).
TEST(SuggestFix, SevenBInBf16OnOne80GiBGpuOffloadsTheMaster) {
  const int64_t n = 7'615'616'512, vd = 152064ll * 3584;
  common::GrpoConfig big;
  big.bf16 = true;
  common::GrpoConfig checkpointed = big;
  checkpointed.gradient_checkpointing = true;
  auto plain = PlanMemory(Qwen25_7B(), checkpointed, 1, "cuda");
  auto unchecked = PlanMemory(Qwen25_7B(), big, 1, "cuda");
  ASSERT_TRUE(plain.ok() && unchecked.ok());
  EXPECT_EQ(unchecked->distinct_prompts, 1);
  EXPECT_NEAR(unchecked->activations_no_checkpointing / double(1ll << 30), 25.3, 0.05);
  auto offload = SuggestFix(Qwen25_7B(), big, 1, "cuda", k80GiB);
  ASSERT_TRUE(offload.ok()) << offload.status().ToString();
  EXPECT_EQ(offload->Text(), "set fsdp: no_shard offload");
  const MemoryPlan& p = offload->plan;
  EXPECT_EQ(p.ModelState(), 4 * n);
  EXPECT_EQ(p.optimizer_step, 4 * vd);
  EXPECT_EQ(p.MicroBatchPeak(), unchecked->MicroBatchPeak());
  EXPECT_EQ(p.Total(), 4 * n + unchecked->MicroBatchPeak() + kCudaRuntimeBytes);
  EXPECT_NEAR(p.Total() / double(1ll << 30), 57.78, 0.01);
  EXPECT_EQ(p.host_offloaded, 16 * n + 8 * vd);
  // With 128 GiB of host beside the GPU the offloaded state (16n = 113.5 GiB) and the two
  // published snapshots (2 x 4n = 56.7 GiB) do not fit it; streamed, the host holds the state,
  // the step's temporaries (8VD = 4.06 GiB), one tensor on its way to GetWeights (the [V, D]
  // embedding: 4VD = 2.03 GiB), the process (384 MiB) and a gloo bucket (16 MiB): 120.0 GiB.
  SuggestOptions host128;
  host128.host_bytes = 128ll << 30;
  auto streamed = SuggestFix(Qwen25_7B(), big, 1, "cuda", k80GiB, host128);
  ASSERT_TRUE(streamed.ok()) << streamed.status().ToString();
  EXPECT_EQ(streamed->Text(), "set weight_publish: stream and fsdp: no_shard offload");
  EXPECT_EQ(streamed->plan.Total(), p.Total());
  EXPECT_EQ(streamed->plan.HostTotal(), 16 * n + 8 * vd + 4 * vd + (384ll << 20) + (16ll << 20));
  // With 112 GiB the offloaded state alone (16n) does not fit the host. shard_grad_op offload
  // partitions it (16n / N), but loads the whole fp32 model there first (4n): at 2 ranks 8n =
  // 56.7 GiB beside 4n = 28.4 GiB loading, or beside the two snapshots (8n): it fits streamed,
  // and the GPU holds the bf16 copy 2n = 14.19 GiB beside the micro-batch (28.41, above) and
  // CUDA's 1.0: 43.59 GiB, four knobs, and shard_grad_op is tried before full_shard. (When each
  // row ran its prompt, the GPU needed checkpointing too, five knobs, and full_shard offload
  // came first with four.) full_shard at 2 ranks without offload does not fit: its state
  // 56.7 GiB beside the load phase of a model built in memory (`big` names no
  // model_name_or_path: every rank holds the whole fp32 model and its bf16 copy, 42.6 GiB, and
  // packs the [V, D] unit in fp32: 44.6) is 101.3 GiB.
  SuggestOptions host112;
  host112.host_bytes = 112ll << 30;
  auto zero3 = SuggestFix(Qwen25_7B(), big, 1, "cuda", k80GiB, host112);
  ASSERT_TRUE(zero3.ok()) << zero3.status().ToString();
  EXPECT_EQ(zero3->Text(),
            "set weight_publish: stream, fsdp: shard_grad_op offload and run 2 ranks (world_size "
            "2)");
  EXPECT_EQ(zero3->plan.ModelState(), 2 * n);
  EXPECT_EQ(zero3->plan.MicroBatchPeak(), unchecked->MicroBatchPeak());
  EXPECT_NEAR(zero3->plan.Total() / double(1ll << 30), 43.59, 0.01);
  EXPECT_LE(zero3->plan.HostTotal(), 112ll << 30);
  // On 40 GiB the same no_shard offload fits a model built in memory: the master is made on
  // the host and only its bf16 copy reaches the GPU (no loading phase there).
  auto at40 = SuggestFix(Qwen25_7B(), big, 1, "cuda", 40ll << 30);
  ASSERT_TRUE(at40.ok()) << at40.status().ToString();
  EXPECT_EQ(at40->Text(), "set gradient_checkpointing: true and fsdp: no_shard offload");
  EXPECT_EQ(at40->plan.load, 0);
  // Read from its files (model_name_or_path) with 112 GiB of host, two ZeRO-2 ranks fit without
  // offload: each holds the bf16 copy 2n and half of the fp32 gradient, master and moments
  // (16n / 2), 10n = 70.9 GiB, reads its chunks of the master from the files (no load phase),
  // and holds the checkpointed micro-batch (as planned without sharding, 3.6 GiB, plus at most
  // one 25 MiB gradient bucket in flight) and CUDA's 1 GiB: 75.55 GiB (77.0 when each row ran
  // its prompt). Without checkpointing the micro-batch (28.4) does not fit beside the state.
  // shard_grad_op is tried before full_shard. With the master whole on every rank (before
  // 2026-12-06) it was 91.2 GiB.
  common::GrpoConfig from_files = big;
  from_files.model_name_or_path = "/models/Qwen2.5-7B";
  auto zero2 = SuggestFix(Qwen25_7B(), from_files, 1, "cuda", k80GiB, host112);
  ASSERT_TRUE(zero2.ok()) << zero2.status().ToString();
  EXPECT_EQ(zero2->Text(),
            "set gradient_checkpointing: true, fsdp: shard_grad_op and run 2 ranks (world_size 2)");
  const MemoryPlan& z = zero2->plan;
  EXPECT_EQ(z.ModelState(), 10 * n);
  EXPECT_TRUE(z.sharded_loading);
  EXPECT_EQ(z.load, 0);
  EXPECT_GE(z.Total(), 10 * n + plain->MicroBatchPeak() + kCudaRuntimeBytes);
  EXPECT_LE(z.Total(), 10 * n + plain->MicroBatchPeak() + kCudaRuntimeBytes + (25ll << 20));
  EXPECT_NEAR(z.Total() / double(1ll << 30), 75.55, 0.01);
  EXPECT_LE(z.HostTotal(), 112ll << 30);
}

// The 7B in bf16 read from its files (model_name_or_path: sharded loading) on one 40 GiB GPU
// with full_shard offload and checkpointing. Offloaded, the GPU holds no model state; loading
// holds one unit's bf16 buffer (the [V, D] embedding, 2VD = 1.02 GiB), less than the
// micro-batch's peak with its gathered units; with CUDA's 1 GiB and no weight-sync bucket on the
// GPU the rank needs 7.45 GiB (10.3 before the micro-batch's 8 rows, one group, ran their prompt
// once: 512 + 8 x 255 tokens through the layers instead of 8 x 768). A model built in memory
// needs 44.6 GiB so (every rank holds it whole in fp32 and its bf16 copy while it is cut into
// shards: 6n = 42.6 GiB, the [V, D] unit's bf16 buffer 1.0, CUDA 1.0).
TEST(MemoryPlan7B, ShardedLoadingFitsFullShardOffloadOnOne40GiBGpu) {
  common::GrpoConfig cfg;
  cfg.bf16 = true;
  cfg.model_name_or_path = "/models/Qwen2.5-7B";
  cfg.gradient_checkpointing = true;
  cfg.fsdp = "full_shard offload";
  auto plan = PlanMemory(Qwen25_7B(), cfg, 1, "cuda");
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const MemoryPlan& p = *plan;
  EXPECT_TRUE(p.sharded_loading);
  EXPECT_EQ(p.load, 2 * 152064ll * 3584);
  EXPECT_EQ(p.ModelState(), 0);
  EXPECT_GT(p.MicroBatchPeak(), p.load);
  EXPECT_EQ(p.Total(), p.runtime + p.weight_sync_bucket + p.weight_snapshot +
                           std::max({p.MicroBatchPeak(), p.optimizer_step, p.weight_snapshot,
                                     p.publish_unit}));
  EXPECT_NEAR(p.Total() / double(1ll << 30), 7.45, 0.05);
  cfg.model_name_or_path.clear();
  auto in_memory = PlanMemory(Qwen25_7B(), cfg, 1, "cuda");
  ASSERT_TRUE(in_memory.ok());
  EXPECT_NEAR(in_memory->Total() / double(1ll << 30), 44.6, 0.05);
}

TEST(CheckFitsDevice, RefusesNamingTheKnob) {
  common::GrpoConfig cfg;
  cfg.bf16 = true;
  Status s = CheckFitsDevice(Qwen25_7B(), cfg, 1, "cuda", k80GiB);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  // The refusal names the change SuggestFix finds (its figure derived by hand above).
  auto fix = SuggestFix(Qwen25_7B(), cfg, 1, "cuda", k80GiB);
  ASSERT_TRUE(fix.ok());
  EXPECT_NE(
      s.message().find(": set fsdp: no_shard offload (" + FormatBytes(fix->plan.Total()) + ")"),
      std::string::npos)
      << s.message();
  // On 6 GiB nothing fits: offloaded, the units gathered beside a layer's backward (4.20 GiB)
  // and CUDA (1.0) leave too little for a micro-batch of one row. It says so, at the knobs'
  // extremes.
  s = CheckFitsDevice(Qwen25_7B(), cfg, 1, "cuda", 6ll << 30);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("no change fits 6.0 GiB per rank: with "
                             "gradient_checkpointing, 1 row, weight_publish stream, full_shard "
                             "offload and 1024 ranks a rank still needs "),
            std::string::npos)
      << s.message();
  // A single knob is named as it is.
  common::GrpoConfig longer;
  longer.max_prompt_length = 1024;
  longer.max_completion_length = 1024;
  auto off = PlanMemory(Bench(), longer, 1, "cuda");
  longer.gradient_checkpointing = true;
  auto on = PlanMemory(Bench(), longer, 1, "cuda");
  longer.gradient_checkpointing = false;
  ASSERT_TRUE(off.ok() && on.ok());
  s = CheckFitsDevice(Bench(), longer, 1, "cuda", (off->Total() + on->Total()) / 2);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find(": set gradient_checkpointing: true ("), std::string::npos)
      << s.message();
  EXPECT_TRUE(CheckFitsDevice(Small(), SmallRun(), 1, "cpu", 1ll << 30).ok());
  EXPECT_TRUE(CheckFitsDevice(Qwen25_7B(), cfg, 1, "cuda", 0).ok());  // unknown: not checked
}

// --- Measured: one real optimizer step on the CPU, in a fresh process.

int64_t ProcStatusKib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return std::atoll(line.c_str() + prefix.size());
  }
  return -1;
}

// The measured step: the bench model (its state and [V, D] LM head outweigh libtorch's own
// noise), two micro-batches of 4 rows of 64 + 192 tokens.
common::GrpoConfig MeasuredConfig(const std::string& mode) {
  common::GrpoConfig c;
  c.bf16 = mode == "bf16";
  c.gradient_checkpointing = mode == "fp32-checkpointing";
  c.device = "cpu";
  c.num_generations = 4;
  c.per_device_train_batch_size = 4;
  c.gradient_accumulation_steps = 2;  // the second micro-batch runs with every .grad allocated
  c.max_prompt_length = 64;
  c.max_completion_length = 192;
  c.logprob_chunk_tokens = 256;
  c.learning_rate = 1e-3;
  c.importance_sampling_correction = "none";
  return c;
}

// `groups` groups of full-length rows (the plan's worst case), rewards 0 .. G-1.
std::vector<common::RolloutGroup> MeasuredGroups(const common::GrpoConfig& cfg, int64_t vocab,
                                                 int groups) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> tok(0, static_cast<int>(vocab) - 1);
  std::vector<common::RolloutGroup> out(groups);
  for (int g = 0; g < groups; ++g) {
    out[g].prompt_id = std::to_string(g);
    for (int64_t i = 0; i < cfg.max_prompt_length; ++i) out[g].prompt_ids.push_back(tok(rng));
    for (int64_t j = 0; j < cfg.num_generations; ++j) {
      common::Completion c;
      for (int64_t i = 0; i < cfg.max_completion_length; ++i) c.token_ids.push_back(tok(rng));
      c.rewards = {static_cast<double>(j)};
      out[g].completions.push_back(c);
    }
  }
  return out;
}

// Child of MemoryPlanMeasured: GRPO_PLAN_CHILD=fp32|bf16|fp32-checkpointing. Warms libtorch up
// on a tiny step, resets the peak resident set (clear_refs 5; where the kernel refuses, the
// warm-up's lower peak stays below the step's), then trains one optimizer step of the bench
// model from scratch and prints "measured <peak - baseline bytes>".
TEST(MemoryPlanMeasuredChild, DISABLED_TrainOneStep) {
  const char* mode = std::getenv("GRPO_PLAN_CHILD");
  if (mode == nullptr) GTEST_SKIP() << "run by MemoryPlanMeasured only";
  {  // warm-up: thread pools, BLAS buffers, the autograd engine
    common::GrpoConfig cfg = MeasuredConfig(mode);
    cfg.max_prompt_length = 4;
    cfg.max_completion_length = 4;
    ModelConfig tiny = Config("qwen2", 259, 64, 176, 2, 4, 2, true);
    auto model = common::Model::InitRandom(tiny, 1);
    ASSERT_TRUE(model.ok());
    auto trainer = GrpoTrainer::Create(cfg, model->get(), nullptr);
    ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
    ASSERT_TRUE((*trainer)->TrainGenerationBatch(MeasuredGroups(cfg, tiny.vocab_size, 2)).ok());
  }
  std::ofstream("/proc/self/clear_refs") << "5";
  const common::GrpoConfig cfg = MeasuredConfig(mode);
  const ModelConfig mc = Bench();
  const auto groups = MeasuredGroups(cfg, mc.vocab_size, 2);  // 8 rows: two micro-batches of 4
  const int64_t baseline = ProcStatusKib("VmRSS");
  auto model = common::Model::InitRandom(mc, 2);
  ASSERT_TRUE(model.ok());
  auto trainer = GrpoTrainer::Create(cfg, model->get(), nullptr);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto result = (*trainer)->TrainGenerationBatch(groups);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_EQ(result->steps.size(), 1u);
  const int64_t peak = ProcStatusKib("VmHWM");
  std::printf("measured %lld\n", static_cast<long long>((peak - baseline) * 1024));
}

// Runs the child once per mode and returns the bytes it measured (-1 on failure).
int64_t MeasureInChild(const std::string& mode) {
  static std::map<std::string, int64_t> measured;
  if (auto it = measured.find(mode); it != measured.end()) return it->second;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return -1;
  self[n] = '\0';
  int rc = 0;
  const std::string out = grpo::testing::RunCommand(
      "GRPO_PLAN_CHILD=" + mode + " OMP_NUM_THREADS=2 MALLOC_MMAP_THRESHOLD_=131072 '" +
          std::string(self) +
          "' --gtest_filter=MemoryPlanMeasuredChild.DISABLED_TrainOneStep "
          "--gtest_also_run_disabled_tests",
      &rc);
  const size_t at = out.find("measured ");
  EXPECT_EQ(rc, 0) << out;
  if (at == std::string::npos) return -1;
  std::istringstream in(out.substr(at + 9));
  int64_t bytes = -1;
  in >> bytes;
  measured[mode] = bytes;
  return bytes;
}

// The plan against what the step measured. The child runs with a fixed mmap threshold
// (MALLOC_MMAP_THRESHOLD_=128 KiB), so that every block libtorch frees goes back to the kernel
// and the resident set follows the live bytes the plan counts. With glibc's default (a
// threshold that rises to 32 MiB as blocks are freed) the heap keeps freed activations for
// reuse, and the peak resident set was 9-43% above these figures (README "Know before you
// launch: grpo plan").
class MemoryPlanMeasured : public ::testing::TestWithParam<std::string> {};

TEST_P(MemoryPlanMeasured, TrainingPeakWithin15PercentOfTheMeasuredStep) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan's allocator (redzones, a quarantine of freed blocks) is not the "
                  "program's: its resident set measures the sanitizer (tests/sanitize/run.py)";
#endif
  auto plan = PlanMemory(Bench(), MeasuredConfig(GetParam()), 1, "cpu");
  ASSERT_TRUE(plan.ok());
  const int64_t measured = MeasureInChild(GetParam());
  ASSERT_GT(measured, 0);
  const double predicted = static_cast<double>(plan->TrainingPeak());
  std::printf("%s: predicted %.1f MiB (state %.1f, micro-batch %.1f), measured %.1f MiB\n",
              GetParam().c_str(), predicted / (1 << 20),
              static_cast<double>(plan->ModelState()) / (1 << 20),
              static_cast<double>(plan->MicroBatchPeak()) / (1 << 20),
              static_cast<double>(measured) / (1 << 20));
  EXPECT_NEAR(static_cast<double>(measured), predicted, 0.15 * predicted);
}

INSTANTIATE_TEST_SUITE_P(Precisions, MemoryPlanMeasured,
                         ::testing::Values("fp32", "bf16", "fp32-checkpointing"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(MemoryPlanMeasuredActivations, CheckpointingSavesWhatThePlanSays) {
  // The difference of the two runs isolates the micro-batch (the model state is the same).
  auto off = PlanMemory(Bench(), MeasuredConfig("fp32"), 1, "cpu");
  auto on = PlanMemory(Bench(), MeasuredConfig("fp32-checkpointing"), 1, "cpu");
  ASSERT_TRUE(off.ok() && on.ok());
  const double predicted = static_cast<double>(off->TrainingPeak() - on->TrainingPeak());
  const double measured =
      static_cast<double>(MeasureInChild("fp32") - MeasureInChild("fp32-checkpointing"));
  std::printf("checkpointing saves: predicted %.1f MiB, measured %.1f MiB\n", predicted / (1 << 20),
              measured / (1 << 20));
  EXPECT_NEAR(measured, predicted, 0.25 * predicted);
}

// The plan of a rank against the live tensor bytes each rank allocated (ranks are threads over
// FakeRankGroup, each counted apart by common::ThreadCount; one intra-op thread, so that every
// tensor is allocated on its rank's thread). Live bytes are what the plan counts: no allocator
// of the process (glibc's free blocks) between the two, and the same figure every run.
struct RanksCase {
  const char* fsdp;
  bool bf16;
  int world;
  bool tied;
  // 4 + 4 tokens: full_shard's peak is after the backward, or loading. fp32 only: in bf16 a
  // rank's count there depends on the other thread's timing (FakeRankGroup's reduce-scatter
  // shares the ranks' buffers: 0-16 MiB more here), which processes do not share.
  bool short_rows = false;
  // full_shard, shard_grad_op bf16: the model built in memory on every rank (rank 0's broadcast)
  // rather than read from its files a shard a rank (model_name_or_path, Model::LoadDeferred).
  bool in_memory = false;
  // beta != 0: a reference model, from the files as the policy (another seed's weights) or
  // built in memory with it; sharded where full_shard is (FrozenShards).
  double beta = 0;
};

class MemoryPlanRanks : public ::testing::TestWithParam<RanksCase> {};

TEST_P(MemoryPlanRanks, EachPhaseBoundsEveryRanksLiveBytesWithin7Percent) {
  const RanksCase& k = GetParam();
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  common::CountingScope counting;
  common::GrpoConfig cfg = MeasuredConfig(k.bf16 ? "bf16" : "fp32");
  cfg.fsdp = k.fsdp;
  cfg.beta = k.beta;
  if (k.short_rows) cfg.max_prompt_length = cfg.max_completion_length = 4;
  ModelConfig mc = Bench();
  mc.tie_word_embeddings = k.tied;
  // full_shard reads the model from its files, each rank its shards, as `grpo learner` does
  // with model_name_or_path, and so does shard_grad_op with bf16 (its master's chunks, its bf16
  // copy whole); the other modes and `in_memory` build it on every rank.
  const std::string fsdp = k.fsdp;
  const bool from_files =
      (fsdp == "full_shard" || (fsdp == "shard_grad_op" && k.bf16)) && !k.in_memory;
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_plan_ranks_" + std::to_string(::getpid()) + "_" + k.fsdp);
  const fs::path ref_dir = dir.string() + "_reference";
  if (from_files) {
    fs::remove_all(dir);
    fs::remove_all(ref_dir);
    auto saved = common::Model::InitRandom(mc, 2);
    ASSERT_TRUE(saved.ok());
    ASSERT_TRUE((*saved)->Save(dir.string()).ok());
    cfg.model_name_or_path = dir.string();
    if (k.beta != 0) {
      auto ref = common::Model::InitRandom(mc, 3);
      ASSERT_TRUE(ref.ok());
      ASSERT_TRUE((*ref)->Save(ref_dir.string()).ok());
    }
  }
  auto plan = PlanMemory(mc, cfg, k.world, "cpu");
  EXPECT_EQ(plan->sharded_loading, from_files);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  // Two micro-batches of 4 rows on every rank: the second runs with every .grad allocated.
  const auto groups = MeasuredGroups(cfg, mc.vocab_size, 2 * k.world);
  FakeRankGroup group(k.world, std::chrono::seconds(60));
  // Each rank's peak while the model is made and the trainer sharded it, then while it trains.
  std::vector<int64_t> load_peaks(k.world, -1), train_peaks(k.world, -1);
  std::vector<std::string> errors(k.world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < k.world; ++r) {
    ranks.emplace_back([&, r] {
      common::ThreadCount count;
      auto model =
          from_files ? common::Model::LoadDeferred(dir.string()) : common::Model::InitRandom(mc, 2);
      if (!model.ok()) {
        errors[r] = model.status().ToString();
        return;
      }
      std::unique_ptr<common::Model> reference;
      if (k.beta != 0) {
        auto ref = from_files ? common::Model::LoadDeferred(ref_dir.string())
                              : common::Model::InitRandom(mc, 3);
        if (!ref.ok()) {
          errors[r] = ref.status().ToString();
          return;
        }
        reference = std::move(ref).value();
      }
      auto trainer = GrpoTrainer::Create(cfg, model->get(), std::move(reference), &group.Rank(r));
      if (!trainer.ok()) {
        errors[r] = trainer.status().ToString();
        return;
      }
      load_peaks[r] = count.peak();
      count.Reset();
      auto result = (*trainer)->TrainGenerationBatch(groups);
      if (!result.ok() || result->steps.size() != 1) {
        errors[r] = result.ok() ? "expected one step" : result.status().ToString();
        return;
      }
      train_peaks[r] = count.peak();
    });
  }
  for (auto& t : ranks) t.join();
  at::set_num_threads(threads);
  if (from_files) fs::remove_all(dir);
  if (from_files) fs::remove_all(ref_dir);
  // What the plan leaves out: scalars, ids, a generator's state (a few hundred bytes here).
  constexpr int64_t kSmall = 64 << 10;
  const int64_t state = plan->ModelState();
  const int64_t train = state + std::max(plan->MicroBatchPeak(), plan->optimizer_step);
  const int64_t load = state + plan->load;
  auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
  for (int r = 0; r < k.world; ++r) {
    ASSERT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
    std::printf(
        "%s%s, %d ranks, %s%s: rank %d training predicted %.2f MiB (state %.2f, micro-batch "
        "%.2f), live %.2f (%.3f); loading predicted %.2f, live %.2f\n",
        k.fsdp, k.bf16 ? " bf16" : "", k.world, k.tied ? "tied" : "untied",
        k.short_rows ? ", short rows" : "", r, mib(train), mib(state), mib(plan->MicroBatchPeak()),
        mib(train_peaks[r]), static_cast<double>(train_peaks[r]) / train, mib(load),
        mib(load_peaks[r]));
    // Upper bounds (a plan that falls short runs out of memory), and close ones: training
    // 0.954-0.977 with the rows of 64 + 192 tokens, 1.000 with short rows (after the
    // backward); loading exact. Counted once beside the whole micro-batch, full_shard's
    // gathered units gave 0.77-0.79, shard_grad_op's bucket and LM-head gradient 0.80-0.85.
    EXPECT_LE(train_peaks[r], train + kSmall) << "rank " << r << ": training";
    EXPECT_GE(static_cast<double>(train_peaks[r]), 0.93 * train) << "rank " << r << ": training";
    EXPECT_LE(std::max(train_peaks[r], load_peaks[r]), plan->TrainingPeak() + kSmall)
        << "rank " << r;
    if (plan->load > 0 || plan->sharded_loading) {  // what loading holds beside the state
      EXPECT_LE(load_peaks[r], load + kSmall) << "rank " << r << ": loading";
    }
    if (plan->load > 0) {
      EXPECT_GE(static_cast<double>(load_peaks[r]), 0.93 * load) << "rank " << r << ": loading";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, MemoryPlanRanks,
    ::testing::Values(
        RanksCase{"no_shard", false, 2, true}, RanksCase{"shard_grad_op", false, 2, true},
        RanksCase{"full_shard", false, 2, true}, RanksCase{"full_shard", false, 4, true},
        RanksCase{"full_shard", true, 2, true}, RanksCase{"shard_grad_op", true, 2, true},
        // shard_grad_op bf16 built in memory: the whole fp32 model until the master is cut.
        RanksCase{"shard_grad_op", true, 2, true, false, true},
        RanksCase{"no_shard", false, 2, false}, RanksCase{"shard_grad_op", false, 2, false},
        RanksCase{"full_shard", false, 2, false}, RanksCase{"full_shard", true, 2, false},
        RanksCase{"full_shard", false, 2, false, true},
        RanksCase{"full_shard", false, 2, true, true},
        RanksCase{"full_shard", false, 2, true, true, /*in_memory=*/true},
        RanksCase{"full_shard", false, 2, false, false, /*in_memory=*/true},
        RanksCase{"full_shard", false, 2, true, false, false, /*beta=*/0.04},
        RanksCase{"full_shard", true, 2, false, false, false, /*beta=*/0.04},
        RanksCase{"no_shard", false, 2, true, false, false, /*beta=*/0.04}),
    [](const auto& info) {
      const RanksCase& k = info.param;
      return std::string(k.fsdp) + (k.bf16 ? "_bf16" : "") + "_" + std::to_string(k.world) +
             (k.tied ? "_tied" : "_untied") + (k.short_rows ? "_short" : "") +
             (k.in_memory ? "_in_memory" : "") + (k.beta != 0 ? "_reference" : "");
    });

}  // namespace
}  // namespace grpo::learner::distributed
