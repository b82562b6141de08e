// grpo_gpu_bench: the GPU check's benchmarks (deploy/gpu-check.sh, issue 15 §3), one JSON line
// each, with its same-run baseline:
//   matmul_bf16     the measured dense bf16 matmul rate (8192^3 on CUDA): the MFU denominator
//   learner_step    one bf16 GrpoTrainer step of a Qwen3-0.6B-shaped random model: MFU =
//                   6 * params * tokens / step time / matmul_bf16 rate
//   decode          Generator tokens/s for 64 prompts x G=16 (bf16) against the HBM-bandwidth
//                   bound (weights + KV cache read once per step); transformers' generate is
//                   timed by tests/bench/hf_generate_bench.py on the same shape
//   logprob_memory  the trainer's peak CUDA memory above the resident model for one prompt
//                   with G = 4, 16, 64 completions (micro-batch 4): G=64 / G=4 is the figure
//   long_tail       a worker's generation (bf16) on a skewed task (rollout/bench/long_tail.h:
//                   32 prompts x G=8, every 8th group 128 tokens and the others 16, at most 8
//                   groups decoding), the learner's updates every 32 decode steps: a Generate
//                   call per lease against continuous batching with the updates drained, taken
//                   in flight (keys/values recomputed or kept), and without updates (issue 26)
// Usage: grpo_gpu_bench [--small] [--only NAME[,NAME...]]. --small: a 4-layer model and short
// sequences (how it is checked on the CPU; the figures then mean nothing). Without CUDA it runs on
// the CPU.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAFunctions.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/model/device.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "learner/grpo_trainer.h"
#include "rollout/bench/long_tail.h"
#include "rollout/generator.h"

namespace {

using grpo::common::Model;
using grpo::common::ModelConfig;
using json = nlohmann::json;

struct Options {
  bool small = false;
  std::string only;
};

void Sync(const at::Device& d) {
  if (d.is_cuda()) c10::cuda::device_synchronize();
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Qwen3-0.6B's config.json shape (random weights), or a 4-layer cut of it with --small.
ModelConfig Qwen3Shape(bool small) {
  ModelConfig c;
  c.model_type = "qwen3";
  c.vocab_size = small ? 4096 : 151936;
  c.hidden_size = small ? 256 : 1024;
  c.intermediate_size = small ? 768 : 3072;
  c.num_hidden_layers = small ? 2 : 28;
  c.num_attention_heads = small ? 4 : 16;
  c.num_key_value_heads = small ? 2 : 8;
  c.head_dim = small ? 64 : 128;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.max_position_embeddings = 40960;
  c.tie_word_embeddings = true;
  c.qk_norm = true;
  c.eos_token_ids = {};
  return c;
}

void Emit(const json& j) { std::cout << j.dump() << std::endl; }

double MatmulTflops(const at::Device& d, bool small) {
  const int64_t n = small ? 512 : 8192;
  const auto opts = at::TensorOptions().device(d).dtype(at::kBFloat16);
  at::Tensor a = at::randn({n, n}, opts), b = at::randn({n, n}, opts);
  for (int i = 0; i < 3; ++i) at::matmul(a, b);
  Sync(d);
  const int reps = small ? 3 : 10;
  const double t0 = Now();
  for (int i = 0; i < reps; ++i) at::matmul(a, b);
  Sync(d);
  const double s = (Now() - t0) / reps;
  const double tflops = 2.0 * n * n * n / s / 1e12;
  Emit({{"bench", "matmul_bf16"}, {"n", n}, {"tflops", tflops}, {"device", d.str()}});
  return tflops;
}

// Groups of random tokens: `prompts` x G completions of exactly `completion` tokens.
std::vector<grpo::common::RolloutGroup> RandomGroups(int64_t prompts, int64_t g, int64_t prompt,
                                                     int64_t completion, int64_t vocab) {
  std::vector<grpo::common::RolloutGroup> out;
  uint64_t x = 12345;
  auto next = [&] {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab));
  };
  for (int64_t p = 0; p < prompts; ++p) {
    grpo::common::RolloutGroup rg;
    rg.prompt_id = "p" + std::to_string(p);
    for (int64_t i = 0; i < prompt; ++i) rg.prompt_ids.push_back(next());
    for (int64_t j = 0; j < g; ++j) {
      grpo::common::Completion c;
      for (int64_t i = 0; i < completion; ++i) c.token_ids.push_back(next());
      c.rewards = {static_cast<double>(j % 3)};
      rg.completions.push_back(std::move(c));
    }
    out.push_back(std::move(rg));
  }
  return out;
}

grpo::common::GrpoConfig TrainerConfig(const at::Device& d, int64_t g, int64_t micro, int64_t ga) {
  grpo::common::GrpoConfig c;
  c.device = d.is_cuda() ? "cuda" : "cpu";
  c.bf16 = true;
  c.num_generations = g;
  c.per_device_train_batch_size = micro;
  c.gradient_accumulation_steps = ga;
  c.max_prompt_length = 4096;
  c.max_completion_length = 4096;
  c.learning_rate = 1e-6;
  c.lr_scheduler_type = "constant";
  c.importance_sampling_correction = "none";
  c.max_steps = 1000;
  return c;
}

void LearnerStep(const at::Device& d, bool small, double matmul_tflops) {
  const ModelConfig cfg = Qwen3Shape(small);
  auto model = Model::InitRandom(cfg, 1, d, at::kFloat);
  if (!model.ok()) throw std::runtime_error(model.status().ToString());
  const int64_t g = 8, prompts = small ? 1 : 4, micro = small ? 4 : 8;
  const int64_t prompt = small ? 16 : 128, completion = small ? 32 : 896;
  const int64_t ga = prompts * g / micro;  // one optimizer step per generation batch
  auto trainer =
      grpo::learner::GrpoTrainer::Create(TrainerConfig(d, g, micro, ga), model->get(), nullptr);
  if (!trainer.ok()) throw std::runtime_error(trainer.status().ToString());
  const auto groups = RandomGroups(prompts, g, prompt, completion, cfg.vocab_size);
  auto warm = (*trainer)->TrainGenerationBatch(groups);  // allocator and kernel warm-up
  if (!warm.ok()) throw std::runtime_error(warm.status().ToString());
  const int reps = small ? 1 : 3;
  Sync(d);
  const double t0 = Now();
  for (int i = 0; i < reps; ++i) {
    auto r = (*trainer)->TrainGenerationBatch(groups);
    if (!r.ok()) throw std::runtime_error(r.status().ToString());
  }
  Sync(d);
  const double step_s = (Now() - t0) / reps;
  const double tokens = static_cast<double>(prompts * g * (prompt + completion));
  const double params = static_cast<double>((*model)->NumParameters());
  // 6 N T for the matmuls of forward + backward (the tied LM head counted once, in N), plus
  // the attention scores and values: 12 * layers * heads * head_dim * T^2 / 2 per sequence
  // (causal) for forward + backward.
  const double seq = static_cast<double>(prompt + completion);
  const double attn = 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq *
                      seq / 2.0 * static_cast<double>(prompts * g);
  const double flops = 6.0 * params * tokens + attn;
  const double achieved = flops / step_s / 1e12;
  Emit({{"bench", "learner_step"},
        {"params", params},
        {"tokens", tokens},
        {"step_seconds", step_s},
        {"achieved_tflops", achieved},
        {"baseline_matmul_bf16_tflops", matmul_tflops},
        {"mfu", achieved / matmul_tflops},
        {"goal_mfu", 0.35},
        {"peak_memory_bytes", grpo::common::PeakMemoryBytes(d)}});
}

void Decode(const at::Device& d, bool small, double hbm_bytes_per_s) {
  const ModelConfig cfg = Qwen3Shape(small);
  auto model = Model::InitRandom(cfg, 2, d, at::kBFloat16);
  if (!model.ok()) throw std::runtime_error(model.status().ToString());
  const int64_t prompts = small ? 4 : 64, g = small ? 4 : 16;
  const int64_t prompt = small ? 8 : 64, max_new = small ? 16 : 128;
  grpo::rollout::GeneratorOptions o;
  o.num_generations = g;
  o.max_completion_length = max_new;
  o.max_prompt_length = 0;
  o.eos_token_ids = {-1};  // never stops early: every row decodes max_new tokens
  auto gen = grpo::rollout::Generator::Create(grpo::rollout::BorrowModel(**model), 0, o);
  if (!gen.ok()) throw std::runtime_error(gen.status().ToString());
  std::vector<std::vector<int32_t>> ids;
  for (const auto& grp : RandomGroups(prompts, 1, prompt, 1, cfg.vocab_size)) {
    ids.push_back(grp.prompt_ids);
  }
  auto warm = (*gen)->Generate({ids[0]});
  if (!warm.ok()) throw std::runtime_error(warm.status().ToString());
  Sync(d);
  const double t0 = Now();
  auto r = (*gen)->Generate(ids);
  Sync(d);
  const double s = Now() - t0;
  if (!r.ok()) throw std::runtime_error(r.status().ToString());
  const double tokens = static_cast<double>(r->num_completion_tokens);
  // HBM bound: every step reads all weights (bf16) and the KV cache of every row (average
  // length prompt + max_new / 2).
  const double rows = static_cast<double>(prompts * g);
  const double weight_bytes = 2.0 * static_cast<double>((*model)->NumParameters());
  const double kv_bytes = rows * (prompt + max_new / 2.0) * 2.0 * cfg.num_hidden_layers *
                          cfg.num_key_value_heads * cfg.head_dim * 2.0;
  const double bound = hbm_bytes_per_s > 0 ? rows * hbm_bytes_per_s / (weight_bytes + kv_bytes) : 0;
  Emit({{"bench", "decode"},
        {"prompts", prompts},
        {"G", g},
        {"prompt_tokens", prompt},
        {"max_new_tokens", max_new},
        {"completion_tokens", tokens},
        {"seconds", s},
        {"tokens_per_second", tokens / s},
        {"baseline_hbm_bound_tokens_per_second", bound},
        {"hbm_bytes_per_second", hbm_bytes_per_s}});
}

double HbmBandwidth(const at::Device& d, bool small) {
  const int64_t n = small ? (1 << 22) : (1ll << 30);  // bf16 elements: 2 GiB on CUDA
  at::Tensor a = at::empty({n}, at::TensorOptions().device(d).dtype(at::kBFloat16)).fill_(1);
  at::Tensor b = at::empty_like(a);
  for (int i = 0; i < 2; ++i) b.copy_(a);
  Sync(d);
  const int reps = 5;
  const double t0 = Now();
  for (int i = 0; i < reps; ++i) b.copy_(a);
  Sync(d);
  const double bw = 2.0 * 2.0 * static_cast<double>(n) * reps / (Now() - t0);  // read + write
  Emit({{"bench", "copy_bandwidth"}, {"bytes_per_second", bw}});
  return bw;
}

void LogprobMemory(const at::Device& d, bool small) {
  const ModelConfig cfg = Qwen3Shape(small);
  json rows = json::array();
  int64_t peak4 = 0, peak64 = 0;
  for (int64_t g : {4, 16, 64}) {
    auto model = Model::InitRandom(cfg, 3, d, at::kFloat);
    if (!model.ok()) throw std::runtime_error(model.status().ToString());
    auto trainer =
        grpo::learner::GrpoTrainer::Create(TrainerConfig(d, g, 4, g / 4), model->get(), nullptr);
    if (!trainer.ok()) throw std::runtime_error(trainer.status().ToString());
    const auto groups = RandomGroups(1, g, small ? 16 : 64, small ? 32 : 512, cfg.vocab_size);
    Sync(d);
    const int64_t before = grpo::common::CurrentMemoryBytes(d);
    grpo::common::ResetPeakMemory(d);
    const double t0 = Now();
    auto r = (*trainer)->TrainGenerationBatch(groups);
    Sync(d);
    const double s = Now() - t0;
    if (!r.ok()) throw std::runtime_error(r.status().ToString());
    const int64_t peak = grpo::common::PeakMemoryBytes(d) - before;
    if (g == 4) peak4 = peak;
    if (g == 64) peak64 = peak;
    rows.push_back({{"G", g}, {"peak_bytes_above_start", peak}, {"step_seconds", s}});
  }
  Emit({{"bench", "logprob_memory"},
        {"rows", rows},
        {"peak_ratio_G64_over_G4", peak4 > 0 ? static_cast<double>(peak64) / peak4 : 0.0},
        {"goal_ratio", 1.10},
        {"device", d.str()},
        {"note", d.is_cuda() ? "CUDA caching allocator peak" : "CPU: VmHWM, not reset per G"}});
}

void LongTail(const at::Device& d, bool small) {
  const ModelConfig cfg = Qwen3Shape(small);
  auto model = Model::InitRandom(cfg, 3, d, at::kBFloat16);
  if (!model.ok()) throw std::runtime_error(model.status().ToString());
  const std::shared_ptr<const Model> policy = std::move(model).value();
  grpo::rollout::bench::LongTailShape shape;
  shape.groups = small ? 8 : 32;
  shape.in_flight = small ? 4 : 8;
  shape.num_generations = small ? 2 : 8;
  shape.short_tokens = small ? 4 : 16;
  shape.long_tokens = 8 * shape.short_tokens;
  shape.long_every = small ? 4 : 8;
  const int64_t update_every = small ? 8 : 32;
  using Mode = grpo::rollout::bench::LongTailMode;
  const std::vector<Mode> modes = {{"rounds", false, update_every, false, true},
                                   {"continuous", true, 0, false, true},
                                   {"continuous+drain", true, update_every, false, true},
                                   {"continuous+in_flight", true, update_every, true, true},
                                   {"continuous+in_flight_keep", true, update_every, true, false}};
  const auto prompts =
      grpo::rollout::bench::LongTailPrompts(shape.groups, shape.prompt_tokens, cfg.vocab_size, 5);
  const auto run = [&](const Mode& m) {
    auto r = grpo::rollout::bench::RunLongTail(policy, shape, m, prompts);
    if (!r.ok()) throw std::runtime_error(m.name + ": " + r.status().ToString());
    return *r;
  };
  run(modes[1]);  // warm-up
  json out = {{"bench", "long_tail"},
              {"groups", shape.groups},
              {"groups_in_flight", shape.in_flight},
              {"G", shape.num_generations},
              {"budget_short", shape.short_tokens},
              {"budget_long", shape.long_tokens},
              {"long_every", shape.long_every},
              {"update_every_steps", update_every},
              {"device", d.str()}};
  double rounds_s = 0, drain_s = 0;
  for (const Mode& m : modes) {
    const auto r = run(m);
    if (m.name == "rounds") rounds_s = r.seconds;
    if (m.name == "continuous+drain") drain_s = r.seconds;
    out["modes"][m.name] = {{"seconds", r.seconds},
                            {"tokens_per_second", static_cast<double>(r.tokens) / r.seconds},
                            {"decode_steps", r.decode_steps},
                            {"mean_rows_decoding", r.mean_rows()},
                            {"updates", r.updates},
                            {"drains", r.drains},
                            {"recompute_tokens", r.recompute_tokens}};
  }
  for (auto& [name, m] : out["modes"].items()) {
    const double s = m["seconds"].get<double>();
    m["vs_rounds"] = rounds_s / s;
    m["vs_drain"] = drain_s / s;
  }
  // Issue 26's goal, read on the worker: in-flight updates >= 1.3x the same stream without them.
  out["in_flight_vs_drain"] = out["modes"]["continuous+in_flight"]["vs_drain"];
  out["in_flight_keep_vs_drain"] = out["modes"]["continuous+in_flight_keep"]["vs_drain"];
  out["goal_in_flight_vs_drain"] = 1.3;
  Emit(out);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--small") == 0) {
      o.small = true;
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      o.only = argv[++i];
    } else {
      std::cerr << "usage: grpo_gpu_bench [--small] [--only matmul_bf16|learner_step|decode|"
                   "logprob_memory|long_tail]\n";
      return 2;
    }
  }
  const at::Device d =
      grpo::common::CudaAvailable() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  // --only: one name or a comma-separated list.
  auto want = [&](const std::string& name) {
    return o.only.empty() || ("," + o.only + ",").find("," + name + ",") != std::string::npos;
  };
  try {
    double tflops = 0, bw = 0;
    if (want("matmul_bf16") || want("learner_step")) tflops = MatmulTflops(d, o.small);
    if (want("decode")) bw = HbmBandwidth(d, o.small);
    if (want("learner_step")) LearnerStep(d, o.small, tflops);
    if (want("decode")) Decode(d, o.small, bw);
    if (want("logprob_memory")) LogprobMemory(d, o.small);
    if (want("long_tail")) LongTail(d, o.small);
  } catch (const std::exception& e) {
    Emit({{"bench", "error"}, {"what", e.what()}});
    return 1;
  }
  return 0;
}
