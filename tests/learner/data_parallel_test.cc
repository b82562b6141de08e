// Learner ranks (README "Learner ranks"): N data-parallel ranks take the same optimizer steps
// as one rank with N times the gradient accumulation. The single rank is the reference (its
// numbers are TRL's: trl_reference_test); ranks are threads over FakeRankGroup, then real
// processes over c10d (RankGroup: a TCPStore and ProcessGroupGloo on loopback), each started
// from this binary. Faults: a rank that leaves, a rank that stalls past the deadline.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <barrier>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "common/counting_allocator.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "common/process.h"
#include "learner/checkpoint.h"
#include "learner/distributed/collectives.h"
#include "learner/distributed/full_shard_adamw.h"
#include "learner/distributed/group_codec.h"
#include "learner/distributed/rank_group.h"
#include "learner/distributed/seen_checkpoint.h"
#include "learner/distributed/sharded_adamw.h"
#include "learner/distributed/state_shards.h"
#include "learner/grpo_trainer.h"
#include "tests/reserved_port.h"

namespace grpo::learner {
namespace {

using common::Completion;
using common::RolloutGroup;
using distributed::Collectives;
using distributed::FakeRankGroup;
using distributed::FrozenShards;
using distributed::SingleRank;
using grpo::common::CountingCpuAllocator;
using grpo::common::CountingScope;
using grpo::testing::ReservedPort;

std::unique_ptr<common::Model> TinyModelOfSeed(uint64_t seed) {
  auto cfg = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(cfg.ok());
  auto m = common::Model::InitRandom(*cfg, seed);
  EXPECT_TRUE(m.ok());
  return std::move(m).value();
}

std::unique_ptr<common::Model> TinyModel() { return TinyModelOfSeed(7); }

// `groups` groups of 4 completions of varied lengths and rewards, with behaviour log-probs.
std::vector<RolloutGroup> MakeGroups(int groups, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, 255), plen(2, 6), clen(1, 9);
  std::uniform_real_distribution<double> rew(0.0, 1.0);
  std::uniform_real_distribution<float> lp(-6.0f, -0.1f);
  std::vector<RolloutGroup> out;
  for (int g = 0; g < groups; ++g) {
    RolloutGroup rg;
    rg.prompt_id = "p" + std::to_string(seed) + "-" + std::to_string(g);
    for (int i = plen(rng); i > 0; --i) rg.prompt_ids.push_back(tok(rng));
    for (int j = 0; j < 4; ++j) {
      Completion c;
      for (int i = clen(rng); i > 0; --i) {
        c.token_ids.push_back(tok(rng));
        c.logprobs.push_back(lp(rng));
      }
      c.truncated = j == 3;
      c.rewards = {rew(rng)};
      rg.completions.push_back(c);
    }
    out.push_back(rg);
  }
  return out;
}

// Two generation batches: 4 groups (16 sequences: 8 micro-batches of 2), then 3 groups (12
// sequences: 6 micro-batches) that leave a step open, taken by the flush. With 2 and 4 ranks a
// step has 4 micro-batches in all, so the flush's 2 leave ranks with none (4 ranks) or one.
std::vector<std::vector<RolloutGroup>> Batches() { return {MakeGroups(4, 11), MakeGroups(3, 12)}; }

common::GrpoConfig RankConfig(const std::string& loss_type, int world_size) {
  common::GrpoConfig c;
  c.num_generations = 4;
  c.per_device_train_batch_size = 2;
  c.gradient_accumulation_steps = 4 / world_size;  // 4 micro-batches a step in all
  c.steps_per_generation = 4;  // a rank's generation batch holds whole groups (8 completions)
  c.num_iterations = 2;
  c.max_completion_length = 16;
  c.loss_type = loss_type;
  // vespo takes only a token-level correction (TRL's rule; the default is sequence_mask).
  if (loss_type == "vespo") c.importance_sampling_correction = "token_truncate";
  c.learning_rate = 1e-2;
  c.lr_scheduler_type = "linear";
  c.max_steps = 50;
  // AdamW divides each gradient element by its own RMS + eps: where an element's micro-batch
  // terms cancel to ~0, the float32 rounding of a different summation order (ranks sum
  // (g1 + g3) + (g2 + g4), one rank g1 + g2 + g3 + g4) is left, and AdamW turns it into a change
  // of up to lr / eps times it: with eps 1e-8, 1.4e-4 norm-wise relative after 7 steps. eps 1e-4
  // kept that below the check on the machines before (1.3e-6 measured) but not on an AVX2 EPYC
  // (2026-12-05), where other kernels round otherwise: there the worst parameter of
  // DataParallelDumps' shard_grad_op case with a reference ended 1.03x the check's
  // max-abs bound (1.04e-6 against 1.01e-6; the same at the commit before this one), and with
  // eps 1e-3 the worst of every case here is 0.074x that bound and 0.032x the norm-wise one. The
  // update stays AdamW's (elements above 1e-3 still divided by their own RMS).
  c.adam_epsilon = 1e-3;
  c.max_grad_norm = 0.5;  // clipping on: the norm is of the summed gradient
  c.beta = 0;
  c.max_staleness = 10;  // the second batch (generated at version 0) trains after 4 steps
  c.logprob_chunk_tokens = 5;
  return c;
}

struct RunResult {
  std::vector<StepMetrics> steps;
  std::vector<at::Tensor> weights;
  std::string error;
  // TrainPart: the peak of the CPU bytes this rank allocated while it restored a checkpoint and
  // synced with rank 0 (counted only under a common::CountingScope).
  int64_t restore_peak = -1;
  // TrainPart at several ranks: the bytes this rank broadcast (or received) and all-gathered
  // (the gathered outputs) while it restored and synced with rank 0.
  int64_t restore_broadcast_bytes = 0, restore_gather_bytes = 0;
  // With beta != 0: the bytes of the reference's parameters between uses, and of its shard
  // (-1: not sharded), and its units' all-gathers.
  int64_t reference_parameter_bytes = -1, reference_shard_bytes = -1, reference_gathers = 0;
  // Train: whether the policy itself ran the forwards (no compute copy).
  bool computes_on_policy = false;
};

using ModelMaker = std::function<std::unique_ptr<common::Model>()>;

// The reference of Train when beta != 0: the tiny model with its own random weights.
std::unique_ptr<common::Model> TinyReference() { return TinyModelOfSeed(8); }

// Trains the batches and flushes, as rank `ranks->rank()` (or alone when null); with the
// reference `make_reference` makes when cfg.beta != 0.
RunResult Train(const common::GrpoConfig& cfg, Collectives* ranks,
                const ModelMaker& make_model = TinyModel,
                const ModelMaker& make_reference = TinyReference) {
  RunResult out;
  auto model = make_model();
  if (model == nullptr) {
    out.error = "no model";
    return out;
  }
  std::unique_ptr<common::Model> reference;
  if (cfg.beta != 0) reference = make_reference();
  common::Model* const ref = reference.get();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), std::move(reference), ranks);
  if (!trainer.ok()) {
    out.error = trainer.status().ToString();
    return out;
  }
  for (const auto& batch : Batches()) {
    auto r = (*trainer)->TrainGenerationBatch(batch);
    if (!r.ok()) {
      out.error = r.status().ToString();
      return out;
    }
    for (auto& s : r->steps) out.steps.push_back(s);
  }
  auto flushed = (*trainer)->FlushPartialStep();
  if (!flushed.ok()) {
    out.error = flushed.status().ToString();
    return out;
  }
  if (flushed->has_value()) out.steps.push_back(**flushed);
  out.computes_on_policy = &(*trainer)->compute_model() == model.get();
  if (ref != nullptr) {
    out.reference_parameter_bytes = 0;
    for (const at::Tensor& p : ref->Parameters()) {
      out.reference_parameter_bytes += static_cast<int64_t>(p.storage().nbytes());
    }
    if (const FrozenShards* shards = (*trainer)->reference_shards(); shards != nullptr) {
      out.reference_shard_bytes = shards->ShardBytes();
      out.reference_gathers = shards->all_gathers();
    }
  }
  if ((*trainer)->optimizer().ShardsParameters()) {  // full_shard: whole nowhere, gathered
    auto gathered = (*trainer)->optimizer().GatherWeights("the test's weights", true);
    if (!gathered.ok()) {
      out.error = gathered.status().ToString();
      return out;
    }
    for (const auto& [name, w] : *gathered) out.weights.push_back(w);
    return out;
  }
  for (const at::Tensor& p : model->Parameters()) out.weights.push_back(p.detach().clone());
  return out;
}

// Train on `world` thread ranks over a fake group, rank r with config(r).
std::vector<RunResult> TrainOnRanks(int world,
                                    const std::function<common::GrpoConfig(int rank)>& config,
                                    const ModelMaker& make_model = TinyModel,
                                    const ModelMaker& make_reference = TinyReference) {
  FakeRankGroup group(world, std::chrono::seconds(60));
  std::vector<RunResult> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back(
        [&, r] { results[r] = Train(config(r), &group.Rank(r), make_model, make_reference); });
  }
  for (auto& t : threads) t.join();
  return results;
}

// torch.testing.assert_close's rule, |a - b| <= atol + rtol |b|, with rtol 1e-5 and atol 1e-6:
// a loss is a sum of terms of both signs (advantages sum to ~0 in a group), so its relative
// rounding error can exceed its terms' (grpo's partial step 7: 6.6e-7 apart at -0.0378).
bool Close(double a, double b) { return std::fabs(a - b) <= 1e-6 + 1e-5 * std::fabs(b); }

// Every rank's steps and weights against the single rank's.
void ExpectSameAsSingleRank(const RunResult& rank, const RunResult& single, int r) {
  ASSERT_TRUE(rank.error.empty()) << "rank " << r << ": " << rank.error;
  ASSERT_EQ(rank.steps.size(), single.steps.size()) << "rank " << r;
  for (size_t s = 0; s < single.steps.size(); ++s) {
    const StepMetrics& a = rank.steps[s];
    const StepMetrics& b = single.steps[s];
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.micro_batches, b.micro_batches) << "step " << b.step;
    EXPECT_EQ(a.sequences, b.sequences) << "step " << b.step;
    EXPECT_TRUE(Close(a.loss, b.loss))
        << "rank " << r << " step " << b.step << ": " << a.loss << " vs " << b.loss;
    EXPECT_TRUE(Close(a.grad_norm, b.grad_norm))
        << "rank " << r << " step " << b.step << ": " << a.grad_norm << " vs " << b.grad_norm;
    EXPECT_TRUE(Close(a.entropy, b.entropy)) << "step " << b.step;
    EXPECT_NEAR(a.clip_ratio_region, b.clip_ratio_region, 1e-6) << "step " << b.step;
    EXPECT_TRUE(Close(a.logprob_mismatch_mean, b.logprob_mismatch_mean)) << "step " << b.step;
    EXPECT_TRUE(Close(a.is_ratio_max, b.is_ratio_max)) << "step " << b.step;
    EXPECT_TRUE(Close(a.vespo_phi_mean, b.vespo_phi_mean)) << "step " << b.step;
  }
  ASSERT_EQ(rank.weights.size(), single.weights.size());
  for (size_t i = 0; i < single.weights.size(); ++i) {
    const double scale = single.weights[i].norm().item<double>();  // norm-wise relative
    const double diff = (rank.weights[i] - single.weights[i]).norm().item<double>();
    EXPECT_LE(diff, 1e-5 * scale) << "rank " << r << " parameter " << i;
    const double max_abs = single.weights[i].abs().max().item<double>();
    const double max_diff = (rank.weights[i] - single.weights[i]).abs().max().item<double>();
    EXPECT_LE(max_diff, 1e-5 * max_abs) << "rank " << r << " parameter " << i;
  }
}

common::GrpoConfig RankConfig(const std::string& loss_type, int world_size,
                              const std::string& fsdp) {
  common::GrpoConfig c = RankConfig(loss_type, world_size);
  c.fsdp = fsdp;
  return c;
}

class DataParallel : public ::testing::TestWithParam<std::tuple<std::string, int, std::string>> {};

// Rank `rank`'s trainer over `model` (dapo, `fsdp` at `world` ranks) once it trained the first
// batch; the error of its creation or of that batch otherwise.
StatusOr<std::unique_ptr<GrpoTrainer>> TrainFirstBatch(const std::string& fsdp, int world,
                                                       common::Model* model, Collectives* rank) {
  ASSIGN_OR_RETURN(std::unique_ptr<GrpoTrainer> t,
                   GrpoTrainer::Create(RankConfig("dapo", world, fsdp), model, nullptr, rank));
  RETURN_IF_ERROR(t->TrainGenerationBatch(Batches()[0]).status());
  return t;
}

TEST_P(DataParallel, RanksOverThreadsTakeTheSingleRanksSteps) {
  const auto [loss_type, world, fsdp] = GetParam();
  const RunResult single = Train(RankConfig(loss_type, 1), nullptr);
  ASSERT_TRUE(single.error.empty()) << single.error;
  // 8 + 6 micro-batches x 2 iterations = 28 = 7 steps of 4.
  ASSERT_EQ(single.steps.size(), 7u);
  const std::vector<RunResult> results =
      TrainOnRanks(world, [&](int) { return RankConfig(loss_type, world, fsdp); });
  for (int r = 0; r < world; ++r) ExpectSameAsSingleRank(results[r], single, r);
}

INSTANTIATE_TEST_SUITE_P(LossTypes, DataParallel,
                         ::testing::Combine(::testing::Values("dapo", "grpo", "dr_grpo"),
                                            ::testing::Values(2, 4),
                                            ::testing::Values("no_shard", "shard_grad_op")));
// TRL 1.16's other objectives (learner/loss/objectives.h): their aggregations (sequence mean,
// sequence sum, step tokens), vespo's autograd path and its phi metric, over 2 ranks.
INSTANTIATE_TEST_SUITE_P(OtherObjectives, DataParallel,
                         ::testing::Combine(::testing::Values("cispo", "sapo", "luspo", "vespo"),
                                            ::testing::Values(2), ::testing::Values("no_shard")));

// full_shard (ZeRO-3): the same equivalence, with and without gradient checkpointing (with it
// each layer's backward recomputes from the gather of its backward; without it autograd's saved
// tensors read the parameters refilled by that gather). Batches() ends in a flushed step of 2
// micro-batches: at 4 ranks two ranks have none in that round and join its collectives.
// With bf16 the single rank computes in its bf16 copy of the fp32 master and the ranks in the
// bf16 units they gather (each rank's fp32 chunk cast to bf16): the same bf16 weights, so the
// same equivalence holds over the 7 steps.
class DataParallelFullShard
    : public ::testing::TestWithParam<std::tuple<std::string, int, bool, bool>> {};

TEST_P(DataParallelFullShard, RanksOverThreadsTakeTheSingleRanksSteps) {
  const auto [loss_type, world, checkpointing, bf16] = GetParam();
  common::GrpoConfig one = RankConfig(loss_type, 1);
  one.gradient_checkpointing = checkpointing;
  one.bf16 = bf16;
  const RunResult single = Train(one, nullptr);
  ASSERT_TRUE(single.error.empty()) << single.error;
  ASSERT_EQ(single.steps.size(), 7u);
  const std::vector<RunResult> results = TrainOnRanks(world, [&](int) {
    common::GrpoConfig cfg = RankConfig(loss_type, world, "full_shard");
    cfg.gradient_checkpointing = checkpointing;
    cfg.bf16 = bf16;
    return cfg;
  });
  for (int r = 0; r < world; ++r) ExpectSameAsSingleRank(results[r], single, r);
}

INSTANTIATE_TEST_SUITE_P(LossTypes, DataParallelFullShard,
                         ::testing::Combine(::testing::Values("dapo", "grpo", "dr_grpo"),
                                            ::testing::Values(2, 4), ::testing::Bool(),
                                            ::testing::Values(false)));
// vespo's autograd path through the lm_head (ChunkedTokenLogprobs, whose backward reads the
// gathered lm_head), over 2 ranks.
INSTANTIATE_TEST_SUITE_P(AutogradLoss, DataParallelFullShard,
                         ::testing::Combine(::testing::Values("vespo"), ::testing::Values(2),
                                            ::testing::Bool(), ::testing::Values(false)));
INSTANTIATE_TEST_SUITE_P(Bf16, DataParallelFullShard,
                         ::testing::Combine(::testing::Values("dapo", "grpo"),
                                            ::testing::Values(2, 4), ::testing::Bool(),
                                            ::testing::Values(true)));

// Sharded loading (Model::LoadDeferred): each rank reads only its own chunk of each unit from
// the model's files and takes the steps of one rank that read the whole model (Model::Load)
// from the same files. The files hold BF16 (each value converted to fp32 as it is read) in
// several shards (model.safetensors.index.json); the model tied and untied; at 4 ranks the
// chunks of units that 4 does not divide end in padding, which must stay zero.
class DataParallelShardedLoading
    : public ::testing::TestWithParam<std::tuple<int, bool, bool, std::string>> {
};  // world, tied, bf16, fsdp

TEST_P(DataParallelShardedLoading, EachRankReadsItsShardAndTakesTheWholeModelsSteps) {
  const auto [world, tied, bf16, fsdp] = GetParam();
  namespace fs = std::filesystem;
  auto preset = common::ModelConfigPreset("tiny");
  ASSERT_TRUE(preset.ok());
  common::ModelConfig mc = *preset;
  mc.tie_word_embeddings = tied;
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_dp_sharded_loading_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    auto m = common::Model::InitRandom(mc, 7);
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->Save(dir.string()).ok());  // config.json; the fp32 weights are replaced
    fs::remove(dir / "model.safetensors");
    common::NamedTensors half;
    for (const auto& [name, p] : (*m)->NamedParameters()) {
      half.emplace_back(name, p.to(at::kBFloat16));
    }
    ASSERT_TRUE(common::WriteSafetensorsCheckpoint(dir.string(), half, 64 << 10).ok());
  }
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  const auto load = [&](bool deferred) -> std::unique_ptr<common::Model> {
    auto m =
        deferred ? common::Model::LoadDeferred(dir.string()) : common::Model::Load(dir.string());
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return nullptr;
    EXPECT_EQ((*m)->deferred(), deferred);
    return std::move(m).value();
  };
  common::GrpoConfig one = RankConfig("dapo", 1);
  one.bf16 = bf16;
  const RunResult single = Train(one, nullptr, [&] { return load(false); });
  ASSERT_TRUE(single.error.empty()) << single.error;
  ASSERT_EQ(single.steps.size(), 7u);
  const std::vector<RunResult> results = TrainOnRanks(
      world,
      [&, fsdp = fsdp](int) {
        common::GrpoConfig cfg = RankConfig("dapo", world, fsdp);
        cfg.bf16 = bf16;
        return cfg;
      },
      [&] { return load(true); });
  for (int r = 0; r < world; ++r) ExpectSameAsSingleRank(results[r], single, r);
  fs::remove_all(dir);
}

// full_shard reads each rank's chunks of every unit; shard_grad_op with bf16 each rank's chunks
// of its fp32 master and its bf16 copy whole (in fp32 it reads the model whole: the parameters
// compute).
INSTANTIATE_TEST_SUITE_P(WorldsAndPrecisions, DataParallelShardedLoading,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Values("full_shard")));
INSTANTIATE_TEST_SUITE_P(ShardGradOp, DataParallelShardedLoading,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool(),
                                            ::testing::Values(true),
                                            ::testing::Values("shard_grad_op")));

// Every rank must load the policy the same way: a rank that builds it in memory while rank 0
// reads its part from the files (or the other way round) would wait in collectives the others
// never make. It fails at once, naming the fix. Rank 0 reading from the files waits for nothing
// and is made; rank 0 broadcasting its weights waits for the failed rank until the group's
// deadline (2 s here), as for any rank that leaves, and fails.
class DataParallelLoadingMismatch : public ::testing::TestWithParam<std::string> {};

TEST_P(DataParallelLoadingMismatch, ARankThatLoadsOtherwiseFailsAtOnce) {
  namespace fs = std::filesystem;
  const std::string fsdp = GetParam();
  auto preset = common::ModelConfigPreset("tiny");
  ASSERT_TRUE(preset.ok());
  const fs::path dir = fs::temp_directory_path() /
                       ("grpo_dp_loading_mismatch_" + fsdp + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    auto m = common::Model::InitRandom(*preset, 7);
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->Save(dir.string()).ok());
  }
  for (const bool rank0_from_files : {true, false}) {
    FakeRankGroup group(2, std::chrono::seconds(2));
    std::vector<Status> made(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        const bool from_files = (r == 0) == rank0_from_files;
        StatusOr<std::unique_ptr<common::Model>> model =
            from_files ? common::Model::LoadDeferred(dir.string())
                       : StatusOr<std::unique_ptr<common::Model>>(TinyModel());
        if (!model.ok()) {
          made[r] = model.status();
          return;
        }
        common::GrpoConfig cfg = RankConfig("dapo", 2, fsdp);
        cfg.bf16 = true;
        made[r] = GrpoTrainer::Create(cfg, model->get(), nullptr, &group.Rank(r)).status();
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(made[0].ok(), rank0_from_files) << made[0].ToString();
    EXPECT_EQ(made[1].code(), StatusCode::kFailedPrecondition) << made[1].ToString();
    EXPECT_NE(made[1].message().find("every rank must load the model the same way"),
              std::string::npos)
        << made[1].ToString();
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, DataParallelLoadingMismatch,
                         ::testing::Values("full_shard", "shard_grad_op"));

// A deferred model read by an optimizer that does not shard the parameters (no_shard,
// shard_grad_op, one rank) is read whole, and trains as the model Load read.
TEST(DataParallelShardedLoading, OtherModesReadTheWholeModel) {
  namespace fs = std::filesystem;
  auto preset = common::ModelConfigPreset("tiny");
  ASSERT_TRUE(preset.ok());
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_dp_whole_loading_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  {
    auto m = common::Model::InitRandom(*preset, 7);
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->Save(dir.string()).ok());
  }
  const RunResult single = Train(RankConfig("dapo", 1), nullptr);  // TinyModel: the same weights
  ASSERT_TRUE(single.error.empty()) << single.error;
  const auto deferred = [&]() -> std::unique_ptr<common::Model> {
    auto m = common::Model::LoadDeferred(dir.string());
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? std::move(m).value() : nullptr;
  };
  ExpectSameAsSingleRank(Train(RankConfig("dapo", 1, "full_shard"), nullptr, deferred), single, 0);
  for (const char* fsdp : {"no_shard", "shard_grad_op"}) {
    const std::vector<RunResult> results = TrainOnRanks(
        2, [&](int) { return RankConfig("dapo", 2, fsdp); }, deferred);
    for (int r = 0; r < 2; ++r) ExpectSameAsSingleRank(results[r], single, r);
  }
  fs::remove_all(dir);
}

// The reference model (beta 0.04) under full_shard (FrozenShards): the policy and a reference of
// other weights, each saved as BF16 in several files, read a shard a rank (Model::LoadDeferred)
// on 2 and 4 ranks take the steps of one rank that read both whole (Model::Load): the loss holds
// the KL term, so every rank's reference log-probs must be the whole model's, also on the ranks
// that join the forwards of a partial last round (Batches() ends in a step of 2 micro-batches).
// Between uses each rank's reference holds no parameter memory, only its shard: s x the sum over
// units of ceil(unit / W) elements (the tiny model's units by hand, as below), s the compute
// dtype's bytes; and every rank gathered its units as often as the others.
class DataParallelFullShardReference : public ::testing::TestWithParam<std::tuple<int, bool>> {
};  // world, bf16

TEST_P(DataParallelFullShardReference, EachRankHoldsItsShareOfTheReferenceAndTakesTheSteps) {
  const auto [world, bf16] = GetParam();
  namespace fs = std::filesystem;
  auto preset = common::ModelConfigPreset("tiny");
  ASSERT_TRUE(preset.ok());
  const common::ModelConfig& c = *preset;
  const int64_t d = c.hidden_size, q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim, i = c.intermediate_size;
  const int64_t layer = q * d + 2 * kv * d + d * q + q + 2 * kv + 3 * i * d + 2 * d;
  ASSERT_TRUE(c.tie_word_embeddings);
  ASSERT_EQ(c.num_hidden_layers, 2);
  const std::vector<int64_t> units = {c.vocab_size * d, layer, layer, d};
  int64_t n = 0, chunks = 0;
  for (int64_t u : units) {
    n += u;
    chunks += (u + world - 1) / world;
  }
  const int64_t s = bf16 ? 2 : 4;
  const fs::path base =
      fs::temp_directory_path() / ("grpo_dp_reference_" + std::to_string(::getpid()));
  fs::remove_all(base);
  for (const auto& [name, seed] : {std::pair{"policy", 7}, std::pair{"reference", 8}}) {
    auto m = common::Model::InitRandom(c, seed);
    ASSERT_TRUE(m.ok());
    const std::string dir = (base / name).string();
    ASSERT_TRUE((*m)->Save(dir).ok());  // config.json; the fp32 weights are replaced
    fs::remove(fs::path(dir) / "model.safetensors");
    common::NamedTensors half;
    for (const auto& [pname, p] : (*m)->NamedParameters()) {
      half.emplace_back(pname, p.to(at::kBFloat16));
    }
    ASSERT_TRUE(common::WriteSafetensorsCheckpoint(dir, half, 64 << 10).ok());
  }
  const auto load = [&](const char* name, bool deferred) {
    return [&, name, deferred]() -> std::unique_ptr<common::Model> {
      const std::string dir = (base / name).string();
      auto m = deferred ? common::Model::LoadDeferred(dir) : common::Model::Load(dir);
      EXPECT_TRUE(m.ok()) << m.status().ToString();
      return m.ok() ? std::move(m).value() : nullptr;
    };
  };
  common::GrpoConfig one = RankConfig("dapo", 1);
  one.bf16 = bf16;
  one.beta = 0.04;
  const RunResult single = Train(one, nullptr, load("policy", false), load("reference", false));
  ASSERT_TRUE(single.error.empty()) << single.error;
  ASSERT_EQ(single.steps.size(), 7u);
  EXPECT_EQ(single.reference_parameter_bytes, s * n) << "whole on one rank";
  EXPECT_EQ(single.reference_shard_bytes, -1);
  const std::vector<RunResult> results = TrainOnRanks(
      world,
      [&](int) {
        common::GrpoConfig cfg = RankConfig("dapo", world, "full_shard");
        cfg.bf16 = bf16;
        cfg.beta = 0.04;
        return cfg;
      },
      load("policy", true), load("reference", true));
  for (int r = 0; r < world; ++r) {
    ExpectSameAsSingleRank(results[r], single, r);
    EXPECT_EQ(results[r].reference_parameter_bytes, 0) << "rank " << r;
    EXPECT_EQ(results[r].reference_shard_bytes, s * chunks) << "rank " << r;
    EXPECT_GT(results[r].reference_gathers, 0) << "rank " << r;
    EXPECT_EQ(results[r].reference_gathers, results[0].reference_gathers) << "rank " << r;
  }
  fs::remove_all(base);
}

INSTANTIATE_TEST_SUITE_P(WorldsAndPrecisions, DataParallelFullShardReference,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()));

// ZeRO-3's model state: after the steps each rank holds, of the parameters, only its fp32 chunk
// of every unit: 4 x sum over units of ceil(unit / W) bytes (the tiny model's units: the tied
// embedding, 2 layers, the final norm), no unit gathered and no .grad; and the gradient and AdamW
// state as ZeRO-2's but cut per unit: 12 x the same count. During the steps at most two units
// were gathered at once: the lm_head's (the tied embedding) and one layer or the final norm.
TEST(DataParallelFullShardSharding, EachRankHoldsItsShareOfTheParametersToo) {
  auto count = TinyModel();
  const common::ModelConfig& c = count->config();
  const int64_t d = c.hidden_size, q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim, i = c.intermediate_size;
  // Qwen2 with attention biases, no q/k norm: q k v o, their biases, the MLP, two norms.
  const int64_t layer = q * d + 2 * kv * d + d * q + q + 2 * kv + 3 * i * d + 2 * d;
  const std::vector<int64_t> units = {c.vocab_size * d, layer, layer, d};
  int64_t P = 0;
  for (const at::Tensor& p : count->Parameters()) P += p.numel();
  ASSERT_EQ(P, units[0] + units[1] + units[2] + units[3]);
  for (const int world : {2, 4}) {
    int64_t chunks = 0;
    for (int64_t n : units) chunks += (n + world - 1) / world;
    FakeRankGroup group(world, std::chrono::seconds(60));
    std::vector<int64_t> params(world, -1), state(world, -1);
    std::vector<int> most_gathered(world, -1);
    std::vector<std::string> errors(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        auto model = TinyModel();
        auto t = TrainFirstBatch("full_shard", world, model.get(), &group.Rank(r));
        if (!t.ok()) {
          errors[r] = t.status().ToString();
          return;
        }
        for (const at::Tensor& p : model->Parameters()) {
          if (p.grad().defined()) errors[r] = "a whole .grad left after the steps";
          if (p.storage().nbytes() != 0) errors[r] = "a parameter holds memory between steps";
        }
        params[r] = (*t)->optimizer().ResidentParameterBytes();
        state[r] = (*t)->optimizer().ResidentBytes();
        most_gathered[r] =
            dynamic_cast<distributed::FullShardAdamW&>((*t)->optimizer()).max_units_gathered();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(errors[r].empty()) << "world " << world << " rank " << r << ": " << errors[r];
      EXPECT_EQ(params[r], 4 * chunks) << "world " << world << " rank " << r;
      EXPECT_LT(params[r], 4 * P / world + 4 * 4 * world) << "padding: under a world per unit";
      EXPECT_EQ(state[r], 12 * chunks) << "world " << world << " rank " << r;
      // The lm_head (the tied embedding), a layer and the one prefetched during backward.
      EXPECT_EQ(most_gathered[r], 3) << "world " << world << " rank " << r;
    }
  }
}

// One micro-batch through the gate, untied and tied lm_head, with and without checkpointing:
// the forward gathers each unit once (embedding, 2 layers, final norm, the lm_head: when tied,
// the embedding's unit a second time, freed between its two uses), the
// backward each layer and the final norm once more, also when checkpointing recomputes them (no
// third gather). Each gather but a pass's first is started ahead of its use (prefetched): 4 of
// the forward's 5, 2 of the backward's 3; so at most three units are whole at once (the lm_head,
// a layer and the next, in backward); without the prefetch none is, and two. The gradient's norm
// and the weights after one AdamW step equal those of the same model without a gate (plain autograd
// and AdamW).
TEST(DataParallelFullShardSharding, EachUnitIsGatheredOnceForwardAndOnceBackward) {
  for (const bool tied : {true, false}) {
    for (const bool checkpointing : {false, true}) {
      for (const bool prefetch : {true, false}) {
        auto cfg = common::ModelConfigPreset("tiny");
        ASSERT_TRUE(cfg.ok());
        cfg->tie_word_embeddings = tied;
        auto plain = common::Model::InitRandom(*cfg, 5);
        auto gated = common::Model::InitRandom(*cfg, 5);
        ASSERT_TRUE(plain.ok() && gated.ok());
        (*plain)->SetRequiresGrad(true);
        (*gated)->SetRequiresGrad(true);
        SingleRank rank;
        const AdamWOptions adamw{0.9, 0.999, 1e-8, 0.01};
        auto opt = distributed::FullShardAdamW::Create(gated->get(), adamw, &rank, nullptr,
                                                       /*offload=*/false, prefetch);
        ASSERT_TRUE(opt.ok()) << opt.status().ToString();
        at::Generator g = at::detail::createCPUGenerator(3);
        const at::Tensor ids = at::randint(cfg->vocab_size, {2, 12}, g, at::kLong);
        const at::Tensor mask = at::ones({2, 12}, at::kLong);
        auto loss = [&](const common::Model& m) {
          return m.Logits(m.ForwardHidden(ids, mask, checkpointing)).log_softmax(-1).mean();
        };
        loss(**plain).backward();
        (*opt)->ZeroGrad();
        (*opt)->BeforeBackward(" of the test");
        const at::Tensor l = loss(**gated);
        // The embedding, 2 layers, the final norm, the lm_head (tied: the embedding's again).
        const int64_t units = 5, layers_and_norm = 3;
        EXPECT_EQ((*opt)->all_gathers(), units) << "tied " << tied << " ckpt " << checkpointing;
        EXPECT_EQ((*opt)->prefetches(), prefetch ? units - 1 : 0);
        l.backward();
        ASSERT_TRUE((*opt)->AfterBackward(" of the test").ok());
        EXPECT_EQ((*opt)->all_gathers(), units + layers_and_norm)
            << "tied " << tied << " ckpt " << checkpointing;
        EXPECT_EQ((*opt)->prefetches(), prefetch ? units - 1 + layers_and_norm - 1 : 0);
        EXPECT_EQ((*opt)->max_units_gathered(), prefetch ? 3 : 2);
        EXPECT_EQ((*opt)->ResidentParameterBytes(), 4 * (*gated)->NumParameters());
        double sq = 0;
        for (const at::Tensor& p : (*plain)->Parameters()) {
          sq += p.grad().to(at::kDouble).square().sum().item<double>();
        }
        auto norm = (*opt)->ClipGradNorm(0, " of the test");
        ASSERT_TRUE(norm.ok());
        EXPECT_NEAR(*norm, std::sqrt(sq), 1e-5 * std::sqrt(sq));
        AdamW reference((*plain)->NamedParameters(), adamw);
        reference.Step(1e-2);
        ASSERT_TRUE((*opt)->Step(1e-2, " of the test").ok());
        auto weights = (*opt)->GatherWeights("the test's weights", true);
        ASSERT_TRUE(weights.ok());
        const common::NamedTensors want = (*plain)->NamedParameters();
        ASSERT_EQ(weights->size(), want.size());
        for (size_t k = 0; k < want.size(); ++k) {
          EXPECT_EQ((*weights)[k].first, want[k].first);
          const double scale = want[k].second.abs().max().item<double>();
          EXPECT_LE(((*weights)[k].second - want[k].second).abs().max().item<double>(),
                    1e-5 * scale)
              << want[k].first << " tied " << tied << " ckpt " << checkpointing;
        }
      }
    }
  }
}

// ZeRO-2's model state (Rajbhandari et al. 2020, fp32 here): the gradient and AdamW's two
// moments, 12 bytes per parameter on one rank, become 12 x ceil(P / W) on each of W ranks (the
// tiny model is one bucket: each rank owns ceil(P / W) of its elements), and no whole .grad is
// left between steps.
TEST(DataParallelSharding, EachRankHoldsItsShareOfTheGradientAndAdamWState) {
  auto count = TinyModel();
  int64_t P = 0;
  for (const at::Tensor& p : count->Parameters()) P += p.numel();
  for (const int world : {1, 2, 4}) {
    FakeRankGroup group(world, std::chrono::seconds(60));
    std::vector<int64_t> resident(world, -1);
    std::vector<std::string> errors(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        auto model = TinyModel();
        auto t = TrainFirstBatch("shard_grad_op", world, model.get(), &group.Rank(r));
        if (!t.ok()) {
          errors[r] = t.status().ToString();
          return;
        }
        for (const at::Tensor& p : model->Parameters()) {
          if (p.grad().defined() && world > 1) errors[r] = "a whole .grad left after the steps";
        }
        resident[r] = (*t)->optimizer().ResidentBytes();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(errors[r].empty()) << "world " << world << " rank " << r << ": " << errors[r];
      EXPECT_EQ(resident[r], 12 * ((P + world - 1) / world)) << "world " << world << " rank " << r;
    }
  }
}

// One rank whose reduce-scatters record whether they ran inside backward() and how many bytes
// of .grad were alive then.
class RecordingRank final : public SingleRank {
 public:
  explicit RecordingRank(const common::Model* model) : model_(model) {}
  Status ReduceScatterSum(const at::Tensor& in, at::Tensor& out, const std::string& what) override {
    int64_t live = 0;
    for (const at::Tensor& p : model_->Parameters()) {
      if (p.grad().defined()) live += p.grad().nbytes();
    }
    calls.push_back({in_backward, live});
    return SingleRank::ReduceScatterSum(in, out, what);
  }
  bool in_backward = false;
  std::vector<std::pair<bool, int64_t>> calls;

 private:
  const common::Model* model_;
};

// shard_grad_op moves each gradient into its bucket as autograd accumulates it and reduces a
// bucket as soon as it is whole: with one parameter a bucket, every reduce-scatter runs inside
// backward() (none is left for the end), and the whole gradient never exists, with and without
// gradient checkpointing (whose recomputed layers accumulate in their own backward).
TEST(DataParallelSharding, GradientsAreReducedBucketByBucketDuringBackward) {
  auto model = TinyModel();
  model->SetRequiresGrad(true);
  int64_t whole = 0;
  size_t tensors = 0;
  for (const at::Tensor& p : model->Parameters()) {
    whole += p.nbytes();
    ++tensors;
  }
  RecordingRank rank(model.get());
  auto opt = distributed::ShardedAdamW::Create(model->NamedParameters(), model->Parameters(), {},
                                               &rank, /*bucket_bytes=*/1);
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  at::Generator g = at::detail::createCPUGenerator(3);
  const at::Tensor ids = at::randint(model->config().vocab_size, {2, 12}, g, at::kLong);
  const at::Tensor mask = at::ones({2, 12}, at::kLong);
  for (const bool checkpointing : {false, true}) {
    (*opt)->ZeroGrad();
    rank.calls.clear();
    (*opt)->BeforeBackward(" of the test");
    const at::Tensor loss =
        model->Logits(model->ForwardHidden(ids, mask, checkpointing)).pow(2).mean();
    rank.in_backward = true;
    loss.backward();
    rank.in_backward = false;
    ASSERT_TRUE((*opt)->AfterBackward(" of the test").ok());
    ASSERT_EQ(rank.calls.size(), tensors) << "checkpointing " << checkpointing;
    int64_t most = 0;
    for (const auto& [inside, live] : rank.calls) {
      EXPECT_TRUE(inside) << "a bucket waited for the end of backward";
      most = std::max(most, live);
    }
    EXPECT_LT(most, whole / 4) << "checkpointing " << checkpointing;
    for (const at::Tensor& p : model->Parameters()) EXPECT_FALSE(p.grad().defined());
  }
}

// One rank with its master sharded (a bf16 compute copy): restored from a checkpoint's files
// (LoadWeightsFrom), its chunks are the whole fp32 master and its copy is filled from them at
// once, there being no SyncFromRankZero to gather it; both equal the saved model's weights.
TEST(DataParallelSharding, AloneTheRestoredChunksAreTheMasterAndFillTheCopy) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_dp_alone_restore_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto saved = TinyModelOfSeed(11);
  ASSERT_TRUE(saved->Save(dir.string()).ok());
  auto policy = TinyModel();
  std::vector<at::Tensor> copy;
  for (const at::Tensor& p : policy->Parameters()) copy.push_back(p.detach().to(at::kBFloat16));
  SingleRank alone;
  auto opt = distributed::ShardedAdamW::Create(policy->NamedParameters(), copy, {}, &alone,
                                               /*bucket_bytes=*/16 << 10);
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  ASSERT_TRUE((*opt)->ShardsParameters());
  auto files = common::ModelWeights::Open(dir.string(), saved->ParameterShapes(), "the test's");
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  ASSERT_TRUE((*opt)->LoadWeightsFrom({*files, "", ""}).ok());
  auto master = (*opt)->GatherWeights("the test's weights", true);
  ASSERT_TRUE(master.ok()) << master.status().ToString();
  const std::vector<at::Tensor> want = saved->Parameters();
  ASSERT_EQ(master->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE((*master)[i].second.equal(want[i])) << (*master)[i].first;
    EXPECT_TRUE(copy[i].equal(want[i].to(at::kBFloat16))) << (*master)[i].first;
  }
  fs::remove_all(dir);
}

// bf16, one step from the same weights, so every run's bf16 weights are the same and only the
// fp32 summation order differs: loss, grad_norm and the updated master weights equal one rank's
// with the same accumulation. shard_grad_op: the hooks sit on the bf16 compute copy, whose
// gradients go into fp32 buckets (the fp32 master gets no .grad), and the fp32 master is each
// rank's chunks (ZeRO-2 with mixed precision), the master model's parameters empty. full_shard: the
// gate sits on the bf16 copy, each gather casts the fp32 shard to bf16, and between steps neither
// model's parameters hold memory (the fp32 shard alone does, 4 bytes per element as without bf16).
class DataParallelBf16 : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {};

TEST_P(DataParallelBf16, OneStepEqualsTheSingleRanks) {
  const auto [fsdp, world, checkpointing] = GetParam();
  struct One {
    std::vector<at::Tensor> weights;
    StepMetrics metrics;
    std::string error;  // or what is left that should not be
  };
  auto one_step = [&, fsdp = fsdp, checkpointing = checkpointing](int w, Collectives* ranks) {
    One out;
    common::GrpoConfig cfg = RankConfig("dapo", w, w > 1 ? fsdp : "no_shard");
    cfg.bf16 = true;
    cfg.num_iterations = 1;
    cfg.gradient_checkpointing = checkpointing;
    auto model = TinyModel();
    auto t = GrpoTrainer::Create(cfg, model.get(), nullptr, ranks);
    if (!t.ok()) return One{{}, {}, t.status().ToString()};
    auto r = (*t)->TrainGenerationBatch(MakeGroups(2, 11));  // 8 completions: 4 micro-batches
    if (!r.ok()) return One{{}, {}, r.status().ToString()};
    if (r->steps.size() != 1) return One{{}, {}, "steps: " + std::to_string(r->steps.size())};
    out.metrics = r->steps[0];
    const bool full = w > 1 && fsdp == "full_shard";
    // Both shard the fp32 master at several ranks: it is gathered.
    if (w > 1 && !(*t)->optimizer().ShardsParameters()) return One{{}, {}, "the master is whole"};
    if (w > 1) {
      auto gathered = (*t)->optimizer().GatherWeights("the test's weights", true);
      if (!gathered.ok()) return One{{}, {}, gathered.status().ToString()};
      for (const auto& [name, v] : *gathered) out.weights.push_back(v);
    } else {
      for (const at::Tensor& p : model->Parameters()) out.weights.push_back(p.detach().clone());
    }
    if (w == 1) return out;
    for (const common::Model* m :
         {static_cast<const common::Model*>(model.get()), &(*t)->compute_model()}) {
      for (const at::Tensor& p : m->Parameters()) {
        if (p.grad().defined()) out.error = "a whole .grad left after the step";
        // full_shard: neither model between uses; shard_grad_op: the fp32 master.
        if ((full || m == model.get()) && p.storage().nbytes() != 0) {
          out.error = "a parameter holds memory";
        }
      }
    }
    // Both: the resident parameters are the fp32 master's chunks of this rank (their padding:
    // under world per unit or bucket) and nothing else.
    int64_t chunks = 0;
    for (const auto& piece : (*t)->optimizer().StatePieces()) chunks += piece.numel;
    const int64_t bytes = (*t)->optimizer().ResidentParameterBytes();
    if (bytes < 4 * chunks || bytes >= 4 * (chunks + 4 * w)) {
      out.error = "resident parameter bytes " + std::to_string(bytes) + " for " +
                  std::to_string(chunks) + " elements";
    }
    // The compute copy is bf16: whole with shard_grad_op, gathered a unit at a time with
    // full_shard (empty between uses, above).
    for (const at::Tensor& p : (*t)->compute_model().Parameters()) {
      if (p.scalar_type() != at::kBFloat16) out.error = "a compute parameter is not bf16";
      if (!full && p.storage().nbytes() != p.nbytes()) out.error = "the compute copy is not whole";
    }
    if (!full) {
      // shard_grad_op: the chunks make the model once over the ranks.
      int64_t whole = 0;
      for (const at::Tensor& p : model->Parameters()) whole += p.numel();
      if (chunks * w < whole || chunks * w >= whole + 4 * w * w) {
        out.error = std::to_string(chunks) + " elements a rank of " + std::to_string(whole);
      }
    }
    return out;
  };
  const One single = one_step(1, nullptr);
  ASSERT_EQ(single.error, "");
  FakeRankGroup group(world, std::chrono::seconds(60));
  std::vector<One> runs(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { runs[r] = one_step(world, &group.Rank(r)); });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(runs[r].error, "") << "rank " << r;
    EXPECT_TRUE(Close(runs[r].metrics.loss, single.metrics.loss))
        << runs[r].metrics.loss << " vs " << single.metrics.loss;
    EXPECT_TRUE(Close(runs[r].metrics.grad_norm, single.metrics.grad_norm))
        << runs[r].metrics.grad_norm << " vs " << single.metrics.grad_norm;
    ASSERT_EQ(runs[r].weights.size(), single.weights.size());
    for (size_t i = 0; i < single.weights.size(); ++i) {
      const double diff = (runs[r].weights[i] - single.weights[i]).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5 * single.weights[i].abs().max().item<double>())
          << "rank " << r << " " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, DataParallelBf16,
                         ::testing::Values(std::tuple{"shard_grad_op", 2, false},
                                           std::tuple{"shard_grad_op", 4, true},
                                           std::tuple{"full_shard", 2, false},
                                           std::tuple{"full_shard", 2, true},
                                           std::tuple{"full_shard", 4, false}));

// shard_grad_op with bf16 cuts each rank's chunks of the fp32 master from rank 0's weights, and
// every rank's bf16 copy is rank 0's: rank 1 starts from other weights (another seed) and holds
// rank 0's after the trainer is made, before any step.
TEST(DataParallelSharding, TheShardedMasterIsCutFromRankZerosWeights) {
  auto zero = TinyModel();
  std::vector<at::Tensor> expected;
  for (const at::Tensor& p : zero->Parameters()) expected.push_back(p.detach().clone());
  auto other = TinyModelOfSeed(8);
  ASSERT_GT((other->Parameters()[1] - expected[1]).abs().max().item<double>(), 0.0);
  FakeRankGroup group(2, std::chrono::seconds(60));
  std::vector<std::string> errors(2);
  std::vector<std::vector<at::Tensor>> gathered(2), copies(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      common::GrpoConfig cfg = RankConfig("dapo", 2, "shard_grad_op");
      cfg.bf16 = true;
      common::Model* model = r == 0 ? zero.get() : other.get();
      auto t = GrpoTrainer::Create(cfg, model, nullptr, &group.Rank(r));
      if (!t.ok()) {
        errors[r] = t.status().ToString();
        return;
      }
      auto w = (*t)->optimizer().GatherWeights("the test's weights", /*every_rank=*/true);
      if (!w.ok()) {
        errors[r] = w.status().ToString();
        return;
      }
      for (const auto& [name, v] : *w) gathered[r].push_back(v);
      for (const at::Tensor& c : (*t)->compute_model().Parameters()) {
        copies[r].push_back(c.detach().clone());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    ASSERT_EQ(gathered[r].size(), expected.size());
    ASSERT_EQ(copies[r].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_TRUE(at::equal(gathered[r][i], expected[i])) << "rank " << r << " parameter " << i;
      EXPECT_TRUE(at::equal(copies[r][i], expected[i].to(at::kBFloat16)))
          << "rank " << r << " parameter " << i;
    }
  }
}

// Makes the CPU count as a device for step_optimizer.h HostsMaster while it lives.
class HostMasterOnCpu {
 public:
  HostMasterOnCpu() { learner::TEST_host_master_on_cpu = true; }
  ~HostMasterOnCpu() { learner::TEST_host_master_on_cpu = false; }
};

// no_shard and shard_grad_op offload, the fp32 master on the host (step_optimizer.h
// HostsMaster). The CPU counts as the device here, so the master (the policy) and the compute
// copy that runs every forward and backward are two models in host memory, and each step
// crosses between them where it crosses PCIe on a GPU: the gradients into the master after
// each micro-batch, the updated master into the copy. At 1, 2 and 4 ranks, fp32 and bf16: the
// steps and the weights equal the plain single rank's, and the policy is not the model that
// computes.
class DataParallelHostMaster : public ::testing::TestWithParam<std::tuple<std::string, int, bool>> {
};

TEST_P(DataParallelHostMaster, RanksTakeTheSingleRanksStepsWithTheMasterApart) {
  const auto [fsdp, world, bf16] = GetParam();
  HostMasterOnCpu on;
  common::GrpoConfig one = RankConfig("dapo", 1);
  one.bf16 = bf16;
  const RunResult single = Train(one, nullptr);
  ASSERT_TRUE(single.error.empty()) << single.error;
  ASSERT_EQ(single.steps.size(), 7u);
  EXPECT_EQ(single.computes_on_policy, !bf16);
  const std::vector<RunResult> results = TrainOnRanks(world, [&](int) {
    common::GrpoConfig cfg = RankConfig("dapo", world, fsdp + " offload");
    cfg.bf16 = bf16;
    return cfg;
  });
  for (int r = 0; r < world; ++r) {
    ExpectSameAsSingleRank(results[r], single, r);
    EXPECT_FALSE(results[r].computes_on_policy) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Offload, DataParallelHostMaster,
                         ::testing::Combine(::testing::Values("no_shard", "shard_grad_op"),
                                            ::testing::Values(1, 2, 4), ::testing::Bool()));

// The fake's reduce-scatter and all-gather, by hand: rank r passes [r, r+1, r+2, r+3] at 2 ranks.
TEST(FakeRankGroupCollectives, ReduceScatterAndAllGatherByHand) {
  FakeRankGroup group(2, std::chrono::seconds(10));
  std::vector<at::Tensor> scattered(2), gathered(2);
  std::vector<Status> status(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const at::Tensor in = at::arange(4, at::kFloat) + r;
      scattered[r] = at::zeros({2});
      status[r] = group.Rank(r).ReduceScatterSum(in, scattered[r], "rs");
      gathered[r] = at::zeros({4});
      status[2 + r] = group.Rank(r).AllGather(scattered[r], gathered[r], "ag");
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& st : status) ASSERT_TRUE(st.ok()) << st.ToString();
  // Sum [0,1,2,3] + [1,2,3,4] = [1,3,5,7]: rank 0 keeps [1,3], rank 1 [5,7].
  EXPECT_TRUE(at::equal(scattered[0], at::tensor({1.0f, 3.0f})));
  EXPECT_TRUE(at::equal(scattered[1], at::tensor({5.0f, 7.0f})));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(at::equal(gathered[r], at::tensor({1.0f, 3.0f, 5.0f, 7.0f}))) << r;
  }
}

// Forwards every collective to a rank's Collectives: tests override what they observe.
class ForwardingRank : public Collectives {
 public:
  explicit ForwardingRank(Collectives& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  Status AllReduceSum(std::vector<at::Tensor>& t, const std::string& what) override {
    return inner_.AllReduceSum(t, what);
  }
  Status AllReduceMax(std::vector<at::Tensor>& t, const std::string& what) override {
    return inner_.AllReduceMax(t, what);
  }
  Status Broadcast(std::vector<at::Tensor>& t, const std::string& what) override {
    return inner_.Broadcast(t, what);
  }
  Status ReduceScatterSum(const at::Tensor& in, at::Tensor& out, const std::string& what) override {
    return inner_.ReduceScatterSum(in, out, what);
  }
  Status AllGather(const at::Tensor& in, at::Tensor& out, const std::string& what) override {
    return inner_.AllGather(in, out, what);
  }
  std::unique_ptr<distributed::PendingCollective> AllGatherAsync(const at::Tensor& in,
                                                                 at::Tensor& out,
                                                                 const std::string& what) override {
    return inner_.AllGatherAsync(in, out, what);
  }

 private:
  Collectives& inner_;
};

// Counts the bytes a rank broadcasts (or receives) and all-gathers (the gathered outputs).
class TrafficCounter final : public ForwardingRank {
 public:
  using ForwardingRank::ForwardingRank;
  Status Broadcast(std::vector<at::Tensor>& t, const std::string& what) override {
    for (const at::Tensor& x : t) broadcast_bytes += x.nbytes();
    return ForwardingRank::Broadcast(t, what);
  }
  Status AllGather(const at::Tensor& in, at::Tensor& out, const std::string& what) override {
    gather_bytes += out.nbytes();
    return ForwardingRank::AllGather(in, out, what);
  }
  std::unique_ptr<distributed::PendingCollective> AllGatherAsync(const at::Tensor& in,
                                                                 at::Tensor& out,
                                                                 const std::string& what) override {
    gather_bytes += out.nbytes();
    return ForwardingRank::AllGatherAsync(in, out, what);
  }
  int64_t broadcast_bytes = 0, gather_bytes = 0;
};

// Batches [first, last) of Batches() (and the flush after the last), as rank `ranks->rank()`:
// restored from `restore_dir` first when given (rank 0 reads it, SyncFromRankZero hands it to
// the others), and saved to `save_dir` after (by rank 0) when given.
RunResult TrainPart(const common::GrpoConfig& cfg, Collectives* ranks, size_t first, size_t last,
                    const std::string& restore_dir, const std::string& save_dir) {
  RunResult out;
  auto model = TinyModel();
  std::optional<TrafficCounter> counted;
  if (ranks != nullptr) counted.emplace(*ranks);
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr, counted ? &*counted : nullptr);
  if (!trainer.ok()) return {{}, {}, trainer.status().ToString()};
  const int rank = ranks != nullptr ? ranks->rank() : 0;
  {
    common::ThreadCount restoring;
    const int64_t broadcast_before = counted ? counted->broadcast_bytes : 0;
    const int64_t gather_before = counted ? counted->gather_bytes : 0;
    if (!restore_dir.empty() && rank == 0) {
      if (Status s = RestoreCheckpoint(**trainer, restore_dir); !s.ok())
        return {{}, {}, s.ToString()};
    }
    if (Status s = (*trainer)->SyncFromRankZero(); !s.ok()) return {{}, {}, s.ToString()};
    out.restore_peak = restoring.peak();
    if (counted) {
      out.restore_broadcast_bytes = counted->broadcast_bytes - broadcast_before;
      out.restore_gather_bytes = counted->gather_bytes - gather_before;
    }
  }
  const auto batches = Batches();
  for (size_t b = first; b < last; ++b) {
    auto r = (*trainer)->TrainGenerationBatch(batches[b]);
    if (!r.ok()) return {{}, {}, r.status().ToString()};
    for (auto& st : r->steps) out.steps.push_back(st);
  }
  if (last == batches.size()) {
    auto flushed = (*trainer)->FlushPartialStep();
    if (!flushed.ok()) return {{}, {}, flushed.status().ToString()};
    if (flushed->has_value()) out.steps.push_back(**flushed);
  }
  if (!save_dir.empty() && rank == 0) {
    auto saved = SaveCheckpoint(**trainer, save_dir, "");
    if (!saved.ok()) return {{}, {}, saved.status().ToString()};
  } else if (!save_dir.empty()) {  // the gathers of a sharded state (RankCommand::kCheckpoint)
    if (Status s = JoinSaveCheckpoint(**trainer, save_dir); !s.ok()) {
      return {{}, {}, s.ToString()};
    }
  }
  if ((*trainer)->optimizer().ShardsParameters()) {
    auto gathered = (*trainer)->optimizer().GatherWeights("the test's weights", true);
    if (!gathered.ok()) return {{}, {}, gathered.status().ToString()};
    for (const auto& [name, w] : *gathered) out.weights.push_back(w);
    return out;
  }
  for (const at::Tensor& p : model->Parameters()) out.weights.push_back(p.detach().clone());
  return out;
}

// `world` thread ranks over a fake group, each running TrainPart with `bf16`.
std::vector<RunResult> TrainPartOnRanks(int world, size_t first, size_t last,
                                        const std::string& restore_dir, const std::string& save_dir,
                                        const std::string& fsdp = "no_shard", bool bf16 = false) {
  FakeRankGroup group(world, std::chrono::seconds(60));
  std::vector<RunResult> results(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      common::GrpoConfig cfg = RankConfig("dapo", world, fsdp);
      cfg.bf16 = bf16;
      results[r] = TrainPart(cfg, &group.Rank(r), first, last, restore_dir, save_dir);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// The uninterrupted single rank's run, its weights and the steps after batch 0 (which takes
// steps 1-4): what a run resumed from a checkpoint of step 4 must take.
RunResult UninterruptedAfterBatchZero() {
  RunResult r = Train(RankConfig("dapo", 1), nullptr);
  if (r.steps.size() >= 4) r.steps.erase(r.steps.begin(), r.steps.begin() + 4);
  return r;
}

// Checkpoints are rank 0's whole state: one saved at 2 ranks resumes at 1 and one saved at 1
// resumes at 2, and the resumed steps are those of an uninterrupted single-rank run.
TEST(DataParallelCheckpoints, ResumeAtAnotherWorldSizeTakesTheUninterruptedSteps) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("grpo_dp_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const RunResult tail_of_reference = UninterruptedAfterBatchZero();
  ASSERT_TRUE(tail_of_reference.error.empty()) << tail_of_reference.error;

  // Saved at 2 ranks after batch 0, resumed at 1.
  const std::vector<RunResult> two = TrainPartOnRanks(2, 0, 1, "", (dir / "at2").string());
  ASSERT_TRUE(two[0].error.empty()) << two[0].error;
  ASSERT_EQ(two[0].steps.size(), 4u);
  const RunResult one =
      TrainPart(RankConfig("dapo", 1), nullptr, 1, 2, (dir / "at2" / "checkpoint-4").string(), "");
  ExpectSameAsSingleRank(one, tail_of_reference, 0);

  // Saved at 1 rank after batch 0, resumed at 2.
  const RunResult first =
      TrainPart(RankConfig("dapo", 1), nullptr, 0, 1, "", (dir / "at1").string());
  ASSERT_TRUE(first.error.empty()) << first.error;
  const std::vector<RunResult> resumed =
      TrainPartOnRanks(2, 1, 2, (dir / "at1" / "checkpoint-4").string(), "");
  for (int r = 0; r < 2; ++r) ExpectSameAsSingleRank(resumed[r], tail_of_reference, r);
  fs::remove_all(dir);
}

// With the master on the host (no_shard / shard_grad_op offload, the CPU counting as the device):
// a checkpoint saved at 2 ranks after batch 0 holds the master, and resumed at 2 offloaded ranks
// (the compute copy refreshed from the restored master), at 1 offloaded rank and at 1 plain rank
// it takes the uninterrupted single rank's steps.
TEST(DataParallelCheckpoints, HostMasterResumesTheUninterruptedSteps) {
  namespace fs = std::filesystem;
  HostMasterOnCpu on;
  const fs::path dir = fs::temp_directory_path() / ("grpo_dp_host_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const RunResult tail_of_reference = UninterruptedAfterBatchZero();
  ASSERT_TRUE(tail_of_reference.error.empty()) << tail_of_reference.error;
  for (const std::string fsdp : {"no_shard offload", "shard_grad_op offload"}) {
    const fs::path at2 = dir / (fsdp.substr(0, fsdp.find(' ')));
    const std::vector<RunResult> saved = TrainPartOnRanks(2, 0, 1, "", at2.string(), fsdp);
    for (int r = 0; r < 2; ++r)
      ASSERT_TRUE(saved[r].error.empty()) << fsdp << ": " << saved[r].error;
    const std::string ckpt = (at2 / "checkpoint-4").string();
    const std::vector<RunResult> resumed = TrainPartOnRanks(2, 1, 2, ckpt, "", fsdp);
    for (int r = 0; r < 2; ++r) ExpectSameAsSingleRank(resumed[r], tail_of_reference, r);
    // One offloaded rank (the master on the host, replicated: shard_grad_op shards nothing
    // alone) and one plain rank.
    ExpectSameAsSingleRank(TrainPartOnRanks(1, 1, 2, ckpt, "", fsdp)[0], tail_of_reference, 0);
    ExpectSameAsSingleRank(TrainPart(RankConfig("dapo", 1), nullptr, 1, 2, ckpt, ""),
                           tail_of_reference, 0);
  }
  fs::remove_all(dir);
}

// Sharded with bf16 (full_shard, and shard_grad_op, which shards the fp32 master too): the
// checkpoint holds the fp32 master (gathered from the shards, not the bf16 copy or units) and
// the AdamW shards; saved at 4 ranks after batch 0 and resumed at 2 (each rank reading its
// shard, or through rank 0 when a rank does not see the files) and at 1, the resumed steps
// are those of the uninterrupted single bf16 rank.
class Bf16ShardedCheckpoints : public ::testing::TestWithParam<std::string> {};

TEST_P(Bf16ShardedCheckpoints, ResumeAtAnotherWorldSizeTakesTheUninterruptedSteps) {
  namespace fs = std::filesystem;
  const std::string fsdp = GetParam();
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_dp_bf16_ckpt_" + fsdp + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  common::GrpoConfig one = RankConfig("dapo", 1);
  one.bf16 = true;
  RunResult tail_of_reference = Train(one, nullptr);
  ASSERT_TRUE(tail_of_reference.error.empty()) << tail_of_reference.error;
  ASSERT_EQ(tail_of_reference.steps.size(), 7u);
  tail_of_reference.steps.erase(tail_of_reference.steps.begin(),
                                tail_of_reference.steps.begin() + 4);
  const std::vector<RunResult> saved =
      TrainPartOnRanks(4, 0, 1, "", (dir / "at4").string(), fsdp, /*bf16=*/true);
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(saved[r].error.empty()) << r << ": " << saved[r].error;
  const fs::path ckpt = dir / "at4" / "checkpoint-4";
  auto weights = common::SafetensorsFile::Open((ckpt / "model.safetensors").string());
  ASSERT_TRUE(weights.ok()) << weights.status().ToString();
  for (const std::string& name : (*weights)->Names()) {
    EXPECT_EQ((*weights)->Get(name)->scalar_type(), at::kFloat) << name;
  }
  int64_t numel = 0;  // of the model's parameters
  for (const at::Tensor& p : TinyModel()->Parameters()) numel += p.numel();
  std::vector<RunResult> resumed;
  {
    common::CountingScope counting;
    resumed = TrainPartOnRanks(2, 1, 2, ckpt.string(), "", fsdp, /*bf16=*/true);
  }
  for (int r = 0; r < 2; ++r) {
    ExpectSameAsSingleRank(resumed[r], tail_of_reference, r);
    // Each rank read its own shard of the fp32 weights from the files: no weights were
    // broadcast (only the checkpoint's name, counters and flags), and shard_grad_op's bf16
    // compute copy was all-gathered from the ranks' chunks (2 bytes a parameter, and the
    // buckets' padding).
    std::printf(
        "rank %d restored: %lld bytes broadcast, %lld all-gathered (%lld parameters), a peak of "
        "%lld bytes allocated\n",
        r, static_cast<long long>(resumed[r].restore_broadcast_bytes),
        static_cast<long long>(resumed[r].restore_gather_bytes), static_cast<long long>(numel),
        static_cast<long long>(resumed[r].restore_peak));
    EXPECT_LT(resumed[r].restore_broadcast_bytes, 4096) << "rank " << r;
    if (fsdp == "shard_grad_op") {
      EXPECT_GE(resumed[r].restore_gather_bytes, 2 * numel) << "rank " << r;
      EXPECT_LT(resumed[r].restore_gather_bytes, 2 * numel + 4096) << "rank " << r;
      // Beyond its shards a rank held one bucket in bf16 and its chunk's cast (the whole tiny
      // model is one bucket), never the fp32 weights (4 bytes a parameter) rank 0 once read.
      EXPECT_LT(resumed[r].restore_peak, 3 * numel + (64 << 10)) << "rank " << r;
    } else {
      EXPECT_EQ(resumed[r].restore_gather_bytes, 0) << "rank " << r;
    }
  }
  // When rank 1 does not see the checkpoint (output_dir not shared), rank 0 broadcasts the fp32
  // weights instead (4 bytes a parameter), and the steps are the same.
  distributed::TEST_weight_files_probe = [](int rank) { return rank != 1; };
  const std::vector<RunResult> through_rank_zero =
      TrainPartOnRanks(2, 1, 2, ckpt.string(), "", fsdp, /*bf16=*/true);
  distributed::TEST_weight_files_probe = nullptr;
  for (int r = 0; r < 2; ++r) {
    ExpectSameAsSingleRank(through_rank_zero[r], tail_of_reference, r);
    EXPECT_GE(through_rank_zero[r].restore_broadcast_bytes, 4 * numel) << "rank " << r;
    EXPECT_EQ(through_rank_zero[r].restore_gather_bytes, 0) << "rank " << r;
  }
  // At one rank of the mode (full_shard's shards are then the whole weights) and at one plain
  // rank.
  ExpectSameAsSingleRank(TrainPartOnRanks(1, 1, 2, ckpt.string(), "", fsdp, /*bf16=*/true)[0],
                         tail_of_reference, 0);
  ExpectSameAsSingleRank(TrainPart(one, nullptr, 1, 2, ckpt.string(), ""), tail_of_reference, 0);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(DataParallelCheckpoints, Bf16ShardedCheckpoints,
                         ::testing::Values("full_shard", "shard_grad_op"));

// A sharded checkpoint: each rank writes its shard of AdamW's state, and at full_shard rank 0
// gathers each unit of the weights and writes them whole: saved at 4 sharded ranks it resumes
// at 2 sharded ranks (each reads the runs of its own shard from the 4 files) and at 1 (the
// whole state assembled from them), and one saved at 1 resumes at 2 sharded ranks (each takes its
// shard of rank 0's restored state); every resumed run takes the uninterrupted single rank's steps.
// full_shard's also loads in a single-rank Model (Model::Load, the Hugging Face layout) with the
// sharded run's weights.
class ShardedCheckpoints : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    mode_ = GetParam();
    std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(test.begin(), test.end(), '/', '_');
    dir_ = std::filesystem::temp_directory_path() /
           ("grpo_dp_" + mode_ + "_" + test + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    tail_of_reference_ = UninterruptedAfterBatchZero();
    ASSERT_TRUE(tail_of_reference_.error.empty()) << tail_of_reference_.error;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Batch 0 at 4 ranks of this mode, saved at its end (checkpoint-4 under at4/): each rank's run.
  std::vector<RunResult> SaveAtFourRanks() const {
    return TrainPartOnRanks(4, 0, 1, "", (dir_ / "at4").string(), mode_);
  }
  std::filesystem::path At4() const { return dir_ / "at4" / "checkpoint-4"; }

  std::string mode_;
  std::filesystem::path dir_;
  RunResult tail_of_reference_;  // the uninterrupted single rank's steps after batch 0
};

TEST_P(ShardedCheckpoints, ResumeAtAnotherWorldSize) {
  namespace fs = std::filesystem;
  const std::vector<RunResult> four = SaveAtFourRanks();
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(four[r].error.empty()) << r << ": " << four[r].error;
  const std::string at4 = At4().string();
  // Each rank wrote its own shard of AdamW's state: every element of every parameter once, in
  // about a quarter each (a unit's or bucket's padding is at most 3 elements, on the last ranks).
  EXPECT_FALSE(fs::exists(fs::path(at4) / "optimizer.safetensors"));
  int64_t total = 0;
  for (const at::Tensor& w : four[0].weights) total += w.numel();
  int64_t held = 0;
  for (int r = 0; r < 4; ++r) {
    auto f = common::SafetensorsFile::Open(
        (fs::path(at4) / distributed::StateShardFileName(r, 4)).string());
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    int64_t mine = 0;
    for (const std::string& name : (*f)->Names()) {
      if (name.rfind("exp_avg.", 0) == 0) mine += (*f)->Find(name)->shape.at(0);
    }
    EXPECT_LE(std::abs(static_cast<double>(mine) - total / 4.0),
              3.0 * static_cast<double>(four[0].weights.size()))
        << "rank " << r << " holds " << mine << " of " << total;
    held += mine;
  }
  EXPECT_EQ(held, total);
  if (mode_ == "full_shard") {
    auto loaded = common::Model::Load(at4);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    const std::vector<at::Tensor> saved = (*loaded)->Parameters();
    ASSERT_EQ(saved.size(), four[0].weights.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      EXPECT_TRUE(saved[i].equal(four[0].weights[i])) << "parameter " << i;
    }
  }
  std::vector<RunResult> two;
  {
    common::CountingScope counting;
    two = TrainPartOnRanks(2, 1, 2, at4, "", mode_);
  }
  for (int r = 0; r < 2; ++r) ExpectSameAsSingleRank(two[r], tail_of_reference_, r);
  if (mode_ == "full_shard") {
    // Each rank read only its shard of the checkpoint's weights (and its runs of the AdamW
    // shards): rank 0 never held them whole (4 bytes x every parameter), at most one tensor
    // of the files in fp32 at a time.
    auto model = TinyModel();
    int64_t whole = 0, largest = 0;
    for (const at::Tensor& p : model->Parameters()) {
      whole += 4 * p.numel();
      largest = std::max<int64_t>(largest, 4 * p.numel());
    }
    for (int r = 0; r < 2; ++r) {
      std::printf("rank %d restored with a peak of %lld bytes (the whole weights: %lld)\n", r,
                  static_cast<long long>(two[r].restore_peak), static_cast<long long>(whole));
      EXPECT_LE(two[r].restore_peak, largest + (64 << 10)) << "rank " << r;
    }
  }
  ExpectSameAsSingleRank(TrainPart(RankConfig("dapo", 1), nullptr, 1, 2, at4, ""),
                         tail_of_reference_, 0);

  const RunResult first =
      TrainPart(RankConfig("dapo", 1), nullptr, 0, 1, "", (dir_ / "at1").string());
  ASSERT_TRUE(first.error.empty()) << first.error;
  const std::vector<RunResult> resumed =
      TrainPartOnRanks(2, 1, 2, (dir_ / "at1" / "checkpoint-4").string(), "", mode_);
  for (int r = 0; r < 2; ++r) ExpectSameAsSingleRank(resumed[r], tail_of_reference_, r);
}

// Ranks that do not see rank 0's checkpoint directory (output_dir not shared: the probe fails
// on rank 2) fall back to the state gathered through rank 0 and written whole; it resumes at 2
// sharded ranks with the uninterrupted run's steps.
TEST_P(ShardedCheckpoints, RanksThatDoNotShareTheDirectoryGatherTheStateThroughRankZero) {
  namespace fs = std::filesystem;
  TEST_state_shard_probe = [](int rank) { return rank != 2; };
  const std::vector<RunResult> four = SaveAtFourRanks();
  TEST_state_shard_probe = nullptr;
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(four[r].error.empty()) << r << ": " << four[r].error;
  const fs::path at4 = At4();
  EXPECT_TRUE(fs::exists(at4 / "optimizer.safetensors"));
  for (const auto& e : fs::directory_iterator(at4)) {
    EXPECT_EQ(e.path().filename().string().rfind("optimizer-rank-", 0), std::string::npos)
        << e.path();
    EXPECT_NE(e.path().filename().string(), ".shard-probe");
  }
  EXPECT_TRUE(VerifyCheckpoint(at4.string()).ok());
  // Nor, on resume, does rank 1 see the directory: rank 0 hands out the weights of full_shard.
  distributed::TEST_weight_files_probe = [](int rank) { return rank != 1; };
  std::vector<RunResult> two;
  {
    common::CountingScope counting;
    two = TrainPartOnRanks(2, 1, 2, at4.string(), "", mode_);
  }
  distributed::TEST_weight_files_probe = nullptr;
  for (int r = 0; r < 2; ++r) ExpectSameAsSingleRank(two[r], tail_of_reference_, r);
  // Rank 0 handed the state out a parameter at a time (HandOutStateFile): beyond the weights'
  // own restore (whole under shard_grad_op, whose ranks hold them whole; a unit under
  // full_shard) it held at most the file's copy of one moment and the buffer it broadcasts, not
  // the whole state (8 bytes x every parameter, twice the weights) as before.
  auto model = TinyModel();
  int64_t state = 0, largest = 0;
  for (const at::Tensor& p : model->Parameters()) {
    state += 8 * p.numel();
    largest = std::max<int64_t>(largest, 4 * p.numel());
  }
  const int64_t weights = state / 2;
  for (int r = 0; r < 2; ++r) {
    std::printf(
        "rank %d restored through rank 0 with a peak of %lld bytes (the whole state: %lld, "
        "its largest moment %lld)\n",
        r, static_cast<long long>(two[r].restore_peak), static_cast<long long>(state),
        static_cast<long long>(largest));
    EXPECT_LE(two[r].restore_peak, weights + 2 * largest + (64 << 10)) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(DataParallelCheckpoints, ShardedCheckpoints,
                         ::testing::Values("shard_grad_op", "full_shard"));

// Forwards to a rank's Collectives and counts the bytes all-gathered or all-reduced for AdamW's
// state.
class AdamWGatherCounter final : public ForwardingRank {
 public:
  using ForwardingRank::ForwardingRank;
  Status AllReduceSum(std::vector<at::Tensor>& t, const std::string& what) override {
    if (what.find("AdamW") != std::string::npos) {
      for (const at::Tensor& x : t) adamw_bytes += x.nbytes();
    }
    return ForwardingRank::AllReduceSum(t, what);
  }
  Status AllGather(const at::Tensor& in, at::Tensor& out, const std::string& what) override {
    if (what.find("AdamW") != std::string::npos) adamw_bytes += out.nbytes();
    return ForwardingRank::AllGather(in, out, what);
  }
  int64_t adamw_bytes = 0;
};

// While the ranks write their own shards, no AdamW state moves to rank 0; when a rank does not
// see the directory, the whole state (8 bytes a parameter) does, a parameter at a time (the
// probe's and outcome's one-element all-reduces are named otherwise).
TEST(DataParallelCheckpoints, ShardFilesMoveNoAdamWStateToRankZero) {
  namespace fs = std::filesystem;
  int64_t total = 0;
  for (const at::Tensor& p : TinyModel()->Parameters()) total += p.numel();
  for (bool shared : {true, false}) {
    const fs::path dir = fs::temp_directory_path() /
                         ("grpo_dp_gather_" + std::to_string(shared) + std::to_string(::getpid()));
    fs::remove_all(dir);
    FakeRankGroup group(2, std::chrono::seconds(60));
    AdamWGatherCounter rank0(group.Rank(0));
    if (!shared) TEST_state_shard_probe = [](int rank) { return rank == 0; };
    std::vector<RunResult> results(2);
    std::thread other([&] {
      results[1] =
          TrainPart(RankConfig("dapo", 2, "shard_grad_op"), &group.Rank(1), 0, 1, "", dir.string());
    });
    results[0] = TrainPart(RankConfig("dapo", 2, "shard_grad_op"), &rank0, 0, 1, "", dir.string());
    other.join();
    TEST_state_shard_probe = nullptr;
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(results[r].error.empty()) << results[r].error;
    if (shared) {
      EXPECT_EQ(rank0.adamw_bytes, 0);
    } else {
      EXPECT_EQ(rank0.adamw_bytes, 8 * total);
    }
    fs::remove_all(dir);
  }
}

// A checkpoint at full_shard (2 thread ranks, a 12-layer model): each unit of the weights is
// written as it is gathered, so beyond what it held before, the process's CPU allocator never
// holds three units (rank 0's being written, rank 1's next gather), where the whole weights
// are 12 units and more; the AdamW shards are written a run at a time too (not copied whole),
// and so is the state that goes through rank 0 when rank 1 does not see the directory (a
// parameter's moment at a time: rank 0's buffer and rank 1's; the whole state is twice the
// weights). Before, rank 0 gathered the whole weights and then wrote them, and the state whole
// when it went through rank 0. No step is taken, so the weights written are the initial ones:
// those of a fresh model from the same seed.
class FullShardCheckpointMemory : public ::testing::TestWithParam<bool> {};  // shared output_dir

TEST_P(FullShardCheckpointMemory, WritesTheWeightsAndTheStateAUnitAtATime) {
  namespace fs = std::filesystem;
  const bool shared = GetParam();
  const fs::path dir = fs::temp_directory_path() /
                       ("grpo_dp_stream_" + std::to_string(shared) + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto config = common::ModelConfigPreset("tiny");
  ASSERT_TRUE(config.ok());
  config->num_hidden_layers = 12;
  auto reference = common::Model::InitRandom(*config, 7);
  ASSERT_TRUE(reference.ok());
  int64_t whole = 0;
  for (const at::Tensor& p : (*reference)->Parameters()) whole += p.nbytes();

  CountingScope counting;
  CountingCpuAllocator& allocator = CountingCpuAllocator::Get();
  int64_t before = 0;
  std::barrier ready(2, [&]() noexcept { before = allocator.Reset(); });
  FakeRankGroup group(2, std::chrono::seconds(60));
  std::vector<std::string> errors(2);
  std::vector<int64_t> unit(2, 0);
  std::vector<std::thread> threads;
  if (!shared) TEST_state_shard_probe = [](int rank) { return rank == 0; };
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto model = common::Model::InitRandom(*config, 7);
      auto trainer = GrpoTrainer::Create(RankConfig("dapo", 2, "full_shard"), model->get(), nullptr,
                                         &group.Rank(r));
      if (!trainer.ok()) {
        errors[r] = trainer.status().ToString();
        ready.arrive_and_drop();
        return;
      }
      unit[r] =
          dynamic_cast<distributed::FullShardAdamW&>((*trainer)->optimizer()).LargestUnitBytes();
      ready.arrive_and_wait();
      const Status saved = r == 0 ? SaveCheckpoint(**trainer, dir.string(), "").status()
                                  : JoinSaveCheckpoint(**trainer, dir.string());
      if (!saved.ok()) errors[r] = saved.ToString();
    });
  }
  for (auto& t : threads) t.join();
  TEST_state_shard_probe = nullptr;
  const int64_t extra = allocator.peak() - before;
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(errors[r].empty()) << r << ": " << errors[r];
  ASSERT_GT(whole, 4 * unit[0]) << "the model's units must be small against the whole";
  EXPECT_LT(extra, 3 * unit[0]) << "whole weights " << whole << " bytes, a unit " << unit[0];
  std::printf(
      "checkpoint at full_shard (%s): %lld bytes beyond the ranks' own at the peak; a unit "
      "%lld, the whole weights %lld\n",
      shared ? "shard files" : "the state through rank 0", static_cast<long long>(extra),
      static_cast<long long>(unit[0]), static_cast<long long>(whole));

  auto written = common::SafetensorsCheckpoint::Open((dir / "checkpoint-0").string());
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  for (const auto& [name, p] : (*reference)->NamedParameters()) {
    auto got = (*written)->Get(name);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(at::equal(*got, p)) << name;
  }
  EXPECT_EQ(fs::exists(dir / "checkpoint-0" / "optimizer.safetensors"), !shared);
  if (!shared) {  // no step yet: every moment zero, as AdamW::StateDict names them
    auto state =
        common::SafetensorsFile::Open((dir / "checkpoint-0" / "optimizer.safetensors").string());
    ASSERT_TRUE(state.ok()) << state.status().ToString();
    EXPECT_EQ((*state)->Names().size(), 2 * (*reference)->NamedParameters().size() + 1);
    for (const auto& [name, p] : (*reference)->NamedParameters()) {
      auto m = (*state)->Get("exp_avg_sq." + name);
      ASSERT_TRUE(m.ok()) << name;
      EXPECT_EQ(m->sizes(), p.sizes()) << name;
      EXPECT_EQ(m->abs().sum().item<double>(), 0.0) << name;
    }
  }
  EXPECT_TRUE(VerifyCheckpoint((dir / "checkpoint-0").string()).ok());
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(DataParallelCheckpoints, FullShardCheckpointMemory, ::testing::Bool());

// The shard files' reader on files written by hand: runs of a parameter from two files are
// put together whatever the cut; a gap in the runs, a missing file and a mixed world size are
// refused (DataLoss, naming what).
TEST(StateShards, ReadsRunsAcrossFilesAndRefusesAGapOrAMissingFile) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_state_shards_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto write = [&](int rank, int world, common::NamedTensors runs) {
    ASSERT_TRUE(
        common::WriteSafetensors(
            (dir / distributed::StateShardFileName(rank, world)).string(), runs,
            {{"rank", std::to_string(rank)}, {"world_size", std::to_string(world)}, {"step", "7"}})
            .ok());
  };
  // w = [0, 1, 2, 3, 4] (exp_avg) and 10x that (exp_avg_sq), cut 0..3 | 3..5.
  write(0, 2,
        {{"exp_avg.w@0", at::tensor({0.f, 1.f, 2.f})},
         {"exp_avg_sq.w@0", at::tensor({0.f, 10.f, 20.f})}});
  write(1, 2,
        {{"exp_avg.w@3", at::tensor({3.f, 4.f})}, {"exp_avg_sq.w@3", at::tensor({30.f, 40.f})}});
  auto shards = distributed::StateShards::Open(dir.string());
  ASSERT_TRUE(shards.ok()) << shards.status().ToString();
  EXPECT_EQ((*shards)->world_size(), 2);
  EXPECT_EQ((*shards)->step(), 7);
  at::Tensor out = at::zeros({3});
  ASSERT_TRUE((*shards)->Read("w", 0, 2, out).ok());  // elements 2..4, across the cut
  EXPECT_TRUE(at::equal(out, at::tensor({2.f, 3.f, 4.f})));
  ASSERT_TRUE((*shards)->Read("w", 1, 1, out).ok());
  EXPECT_TRUE(at::equal(out, at::tensor({10.f, 20.f, 30.f})));
  const common::NamedTensors params = {{"w", at::zeros({5})}};
  auto whole = distributed::WholeStateFromShards(**shards, params);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_TRUE(at::equal(whole->at(0).second, at::tensor({0.f, 1.f, 2.f, 3.f, 4.f})));
  EXPECT_EQ(whole->at(2).first, "step");
  EXPECT_EQ(whole->at(2).second.item<int64_t>(), 7);
  // A parameter the runs do not cover, and a gap.
  at::Tensor six = at::zeros({6});
  Status s = (*shards)->Read("w", 0, 0, six);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("5 of the 6 elements"), std::string::npos) << s.ToString();
  s = (*shards)->Read("v", 0, 0, out);
  EXPECT_NE(s.message().find("'v'"), std::string::npos) << s.ToString();
  write(1, 2, {{"exp_avg.w@4", at::tensor({4.f})}, {"exp_avg_sq.w@4", at::tensor({40.f})}});
  shards = distributed::StateShards::Open(dir.string());
  ASSERT_TRUE(shards.ok());
  at::Tensor five = at::zeros({5});
  EXPECT_EQ((*shards)->Read("w", 0, 0, five).code(), StatusCode::kDataLoss);  // 3 is missing
  // A missing file; a file of another world size.
  fs::remove(dir / distributed::StateShardFileName(1, 2));
  auto missing = distributed::StateShards::Open(dir.string());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(missing.status().message().find("optimizer-rank-00001-of-00002"), std::string::npos);
  write(1, 3,
        {{"exp_avg.w@3", at::tensor({3.f, 4.f})}, {"exp_avg_sq.w@3", at::tensor({30.f, 40.f})}});
  EXPECT_EQ(distributed::StateShards::Open(dir.string()).status().code(), StatusCode::kDataLoss);
  fs::remove_all(dir);
}

TEST(DataParallelFaults, ARankThatLeavesFailsTheOthersStepAndTheGroupStaysFailed) {
  FakeRankGroup group(2, std::chrono::seconds(60));
  auto cfg = RankConfig("dapo", 2);
  std::vector<Status> got(2);
  std::thread rank1([&] {
    auto model = TinyModel();
    auto t = GrpoTrainer::Create(cfg, model.get(), nullptr, &group.Rank(1));
    ASSERT_TRUE(t.ok());
    group.FailRank(1);  // dies before its first step
  });
  rank1.join();
  auto model = TinyModel();
  auto t = GrpoTrainer::Create(cfg, model.get(), nullptr, &group.Rank(0));
  ASSERT_TRUE(t.ok());
  const auto start = std::chrono::steady_clock::now();
  auto r = (*t)->TrainGenerationBatch(MakeGroups(4, 11));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("rank 1 left"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("all-reduce of the gradients of step 1"), std::string::npos)
      << r.status().ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // The failed step is discarded: no step taken, nothing left open.
  EXPECT_EQ((*t)->global_step(), 0);
  EXPECT_EQ((*t)->open_step_micro_batches(), 0);
}

TEST(DataParallelFaults, ARankThatNeverJoinsFailsTheStepAtTheDeadline) {
  FakeRankGroup group(2, std::chrono::milliseconds(300));
  auto cfg = RankConfig("grpo", 2);
  auto model = TinyModel();
  auto t = GrpoTrainer::Create(cfg, model.get(), nullptr, &group.Rank(0));
  ASSERT_TRUE(t.ok());
  const auto start = std::chrono::steady_clock::now();
  auto r = (*t)->TrainGenerationBatch(MakeGroups(4, 11));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  EXPECT_NE(r.status().message().find("rank 1 did not join"), std::string::npos);
  EXPECT_LT(s, 10.0);
}

// full_shard's collectives run inside the forwards and backwards, where its gate can only throw
// (c10::Error): the step still fails with the collective's own code and message, as the other
// modes' do, whether the first forward is the old log-probs' no-grad one (num_iterations 2, 4
// groups: 8 micro-batches where a step takes 4) or the training step's (num_iterations 1, 2
// groups: one step, on-policy, so no old log-probs). Until 2026-12-06 it failed as Internal.
class DataParallelGateFaults : public ::testing::TestWithParam<bool> {  // old log-probs first
 protected:
  common::GrpoConfig Config() const {
    auto cfg = RankConfig("dapo", 2, "full_shard");
    cfg.num_iterations = GetParam() ? 2 : 1;
    return cfg;
  }
  std::vector<RolloutGroup> Groups() const { return MakeGroups(GetParam() ? 4 : 2, 11); }
  // A group of 2 ranks with collectives' `deadline` and both ranks' trainers (Create is a
  // collective under full_shard).
  void MakeTrainers(std::chrono::milliseconds deadline) {
    group_.emplace(2, deadline);
    std::vector<std::thread> made;
    for (int r = 0; r < 2; ++r) {
      made.emplace_back([&, r] {
        models_[r] = TinyModel();
        auto t = GrpoTrainer::Create(Config(), models_[r].get(), nullptr, &group_->Rank(r));
        if (t.ok()) trainers_[r] = std::move(t).value();
      });
    }
    for (auto& t : made) t.join();
  }
  std::optional<FakeRankGroup> group_;  // outlives the trainers, which borrow its ranks
  std::unique_ptr<common::Model> models_[2];
  std::unique_ptr<GrpoTrainer> trainers_[2];
};

TEST_P(DataParallelGateFaults, ARankThatLeavesFailsTheStepAsUnavailable) {
  MakeTrainers(std::chrono::seconds(60));
  ASSERT_TRUE(trainers_[0] && trainers_[1]);
  group_->FailRank(1);  // dies before its first step
  auto r = trainers_[0]->TrainGenerationBatch(Groups());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().ToString();
  EXPECT_NE(r.status().message().find("rank 1 left"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("step 1"), std::string::npos) << r.status().ToString();
  EXPECT_EQ(trainers_[0]->global_step(), 0);
  EXPECT_EQ(trainers_[0]->open_step_micro_batches(), 0);
}

TEST_P(DataParallelGateFaults, ARankThatStallsFailsTheStepAtTheDeadline) {
  MakeTrainers(std::chrono::milliseconds(500));
  ASSERT_TRUE(trainers_[0] && trainers_[1]);
  const auto start = std::chrono::steady_clock::now();
  auto r = trainers_[0]->TrainGenerationBatch(Groups());  // rank 1 never joins
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  EXPECT_NE(r.status().message().find("rank 1 did not join"), std::string::npos)
      << r.status().ToString();
  EXPECT_LT(s, 10.0);
}

INSTANTIATE_TEST_SUITE_P(DataParallelFaults, DataParallelGateFaults, ::testing::Bool());

// At one rank every mode is the identity: full_shard with bf16 and offload trains alone.
TEST(DataParallelConfig, EveryModeRunsAtOneRank) {
  auto model = TinyModel();
  auto cfg = RankConfig("dapo", 1);
  cfg.fsdp = "full_shard offload";
  cfg.bf16 = true;
  auto t = GrpoTrainer::Create(cfg, model.get(), nullptr);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_FALSE((*t)->optimizer().ShardsParameters());
  EXPECT_TRUE((*t)->TrainGenerationBatch(MakeGroups(2, 11)).ok());
}

// Batch dumps at several ranks: rank 0 writes each step's file, of the whole step (every rank's
// micro-batches, their log-probs summed over the ranks: zeros but on the rank that trained
// each), equal to the single rank's file of the same step (whose numbers are TRL's:
// trl_reference_test); the other ranks write nothing.
class DataParallelDumps : public ::testing::TestWithParam<std::tuple<int, std::string, double>> {};

TEST_P(DataParallelDumps, RankZerosDumpsAreTheSingleRanks) {
  const auto [world, fsdp, beta] = GetParam();
  const std::string dir = ::testing::TempDir() + "/dp_dumps_" + std::to_string(world) + "_" + fsdp +
                          "_" + std::to_string(beta != 0) + "_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  common::GrpoConfig one = RankConfig("grpo", 1);
  one.beta = beta;
  one.dump_batches_dir = dir + "/single";
  const RunResult single = Train(one, nullptr);
  ASSERT_TRUE(single.error.empty()) << single.error;
  ASSERT_EQ(single.steps.size(), 7u);
  const std::vector<RunResult> results = TrainOnRanks(world, [&](int r) {
    common::GrpoConfig cfg = RankConfig("grpo", world, fsdp);
    cfg.beta = beta;
    cfg.dump_batches_dir = dir + "/rank" + std::to_string(r);
    return cfg;
  });
  for (int r = 0; r < world; ++r) ExpectSameAsSingleRank(results[r], single, r);
  for (int r = 1; r < world; ++r) {
    EXPECT_FALSE(std::filesystem::exists(dir + "/rank" + std::to_string(r))) << "rank " << r;
  }
  for (int step = 1; step <= 7; ++step) {
    char name[64];
    std::snprintf(name, sizeof(name), "/step-%08d.safetensors", step);
    auto a = common::SafetensorsFile::Open(dir + "/rank0" + name);
    auto b = common::SafetensorsFile::Open(dir + "/single" + name);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    std::vector<std::string> names = (*b)->Names();
    ASSERT_EQ((*a)->Names(), names) << "step " << step;
    // The log-probs the step trained on; with beta the reference's too.
    for (const char* must : {"logprobs", "old_logprobs", "logprobs_first_micro_batch"}) {
      EXPECT_NE(std::find(names.begin(), names.end(), must), names.end()) << must;
    }
    EXPECT_EQ(std::find(names.begin(), names.end(), "ref_logprobs") != names.end(), beta != 0);
    for (const std::string& n : names) {
      if (n == "learner_incarnation") continue;  // neither trainer was given one
      const at::Tensor x = (*a)->Get(n).value().to(at::kDouble);
      const at::Tensor y = (*b)->Get(n).value().to(at::kDouble);
      ASSERT_EQ(x.sizes(), y.sizes()) << "step " << step << " " << n;
      const at::Tensor nan_x = x.isnan(), nan_y = y.isnan();
      EXPECT_TRUE(at::equal(nan_x, nan_y)) << "step " << step << " " << n;
      const at::Tensor diff = (x - y).abs().masked_fill(nan_y, 0.0);
      const at::Tensor bound = 1e-6 + 1e-5 * y.abs().masked_fill(nan_y, 0.0);
      EXPECT_TRUE(diff.le(bound).all().item<bool>())
          << "step " << step << " " << n << ": max diff " << diff.max().item<double>();
      // Some values are not 0: the sum over ranks carried the trained rank's.
      if (n == "logprobs") {
        EXPECT_GT(x.abs().sum().item<double>(), 0.0);
      }
    }
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, DataParallelDumps,
                         ::testing::Values(std::make_tuple(2, std::string("no_shard"), 0.0),
                                           std::make_tuple(4, std::string("full_shard"), 0.0),
                                           std::make_tuple(2, std::string("shard_grad_op"), 0.04),
                                           std::make_tuple(4, std::string("full_shard"), 0.04)));

TEST(GroupCodec, RoundTripsEveryFieldAndRefusesTruncatedBytes) {
  std::vector<RolloutGroup> groups = MakeGroups(3, 5);
  groups[1].lease_id = "lease-7";
  groups[1].policy_version = 42;
  groups[1].policy_incarnation = "00ff00ff00ff00ff";
  groups[1].completions[2].rewards = {std::nullopt, 0.25};
  groups[1].completions[2].text = "héllo";
  groups[2].completions[1].env_mask.assign(groups[2].completions[1].token_ids.size(), 1);
  groups[2].completions[1].env_mask.back() = 0;  // a multi-turn completion
  groups[2].completions[1].uses_tools = true;    // with tool calls
  groups[2].completions[1].tool_calls = 5;
  groups[2].completions[1].tool_call_failures = 2;
  groups[2].completions[1].token_versions.assign(groups[2].completions[1].token_ids.size(), 41);
  groups[2].completions[1].token_versions.back() = 42;  // updated in flight
  const std::string bytes = distributed::EncodeGroups(groups);
  auto back = distributed::DecodeGroups(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->size(), groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const RolloutGroup& a = (*back)[g];
    const RolloutGroup& b = groups[g];
    EXPECT_EQ(a.prompt_id, b.prompt_id);
    EXPECT_EQ(a.lease_id, b.lease_id);
    EXPECT_EQ(a.policy_version, b.policy_version);
    EXPECT_EQ(a.policy_incarnation, b.policy_incarnation);
    EXPECT_EQ(a.prompt_ids, b.prompt_ids);
    ASSERT_EQ(a.completions.size(), b.completions.size());
    for (size_t c = 0; c < b.completions.size(); ++c) {
      EXPECT_EQ(a.completions[c].token_ids, b.completions[c].token_ids);
      EXPECT_EQ(a.completions[c].logprobs, b.completions[c].logprobs);
      EXPECT_EQ(a.completions[c].env_mask, b.completions[c].env_mask);
      EXPECT_EQ(a.completions[c].truncated, b.completions[c].truncated);
      EXPECT_EQ(a.completions[c].uses_tools, b.completions[c].uses_tools);
      EXPECT_EQ(a.completions[c].tool_calls, b.completions[c].tool_calls);
      EXPECT_EQ(a.completions[c].tool_call_failures, b.completions[c].tool_call_failures);
      EXPECT_EQ(a.completions[c].token_versions, b.completions[c].token_versions);
      EXPECT_EQ(a.completions[c].rewards, b.completions[c].rewards);
      EXPECT_EQ(a.completions[c].text, b.completions[c].text);
    }
  }
  for (size_t cut : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    auto bad = distributed::DecodeGroups(bytes.substr(0, cut));
    EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss) << "cut at " << cut;
  }
  EXPECT_FALSE(distributed::DecodeGroups(bytes + "x").ok());
}

TEST(RankEnv, ReadsTorchrunsVariablesAndNamesABadOne) {
  auto from = [](std::map<std::string, std::string> vars) {
    return distributed::ParseRankEnv([vars](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    });
  };
  auto alone = from({});
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->world_size, 1);
  EXPECT_EQ(alone->rank, 0);
  auto torchrun = from({{"RANK", "3"},
                        {"WORLD_SIZE", "4"},
                        {"LOCAL_RANK", "1"},
                        {"MASTER_ADDR", "10.0.0.2"},
                        {"MASTER_PORT", "29400"}});
  ASSERT_TRUE(torchrun.ok()) << torchrun.status().ToString();
  EXPECT_EQ(torchrun->rank, 3);
  EXPECT_EQ(torchrun->world_size, 4);
  EXPECT_EQ(torchrun->local_rank, 1);
  EXPECT_EQ(torchrun->local_world_size, 1);  // not given: one rank a host
  EXPECT_EQ(torchrun->master_addr, "10.0.0.2");
  EXPECT_EQ(torchrun->master_port, 29400);
  auto local =
      from({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}});
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ(local->local_world_size, 2);
  // A Kubernetes indexed Job names the rank by its completion index.
  auto indexed = from({{"JOB_COMPLETION_INDEX", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "a"}});
  ASSERT_TRUE(indexed.ok());
  EXPECT_EQ(indexed->rank, 2);
  // deploy/k8s: ranks 1.. are an indexed Job whose index 0 is rank 1.
  auto offset = from({{"JOB_COMPLETION_INDEX", "1"},
                      {"GRPO_RANK_OFFSET", "1"},
                      {"WORLD_SIZE", "3"},
                      {"MASTER_ADDR", "a"}});
  ASSERT_TRUE(offset.ok());
  EXPECT_EQ(offset->rank, 2);
  EXPECT_EQ(offset->local_rank, 2);
  struct Bad {
    std::map<std::string, std::string> vars;
    std::string names;
  };
  for (const Bad& bad : std::vector<Bad>{
           {{{"WORLD_SIZE", "two"}}, "WORLD_SIZE"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"MASTER_ADDR", "a"}}, "RANK=2"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "1"}}, "MASTER_ADDR"},
           {{{"WORLD_SIZE", "2"},
             {"JOB_COMPLETION_INDEX", "1"},
             {"GRPO_RANK_OFFSET", "1"},
             {"MASTER_ADDR", "a"}},
            "RANK=2"},
           {{{"WORLD_SIZE", "2"}, {"GRPO_RANK_OFFSET", "-1"}}, "GRPO_RANK_OFFSET"},
           {{{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT"},
           {{{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"LOCAL_WORLD_SIZE", "3"}},
            "LOCAL_WORLD_SIZE=3"},
           {{{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"LOCAL_WORLD_SIZE", "0"}},
            "LOCAL_WORLD_SIZE=0"},
       }) {
    auto r = from(bad.vars);
    ASSERT_FALSE(r.ok()) << bad.names;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(bad.names), std::string::npos) << r.status().ToString();
  }
}

// ---------------------------------------------------------------------------------------------
// Real processes: this binary run as ranks (DataParallelChild.Rank with GRPO_DP_CHILD_OUT set).

TEST(DataParallelChild, Rank) {
  const char* out = std::getenv("GRPO_DP_CHILD_OUT");
  if (out == nullptr) GTEST_SKIP() << "run by DataParallelProcesses as a rank";
  const std::string loss_type = std::getenv("GRPO_DP_LOSS");
  const std::string mode = std::getenv("GRPO_DP_MODE");
  const std::string fsdp = std::getenv("GRPO_DP_FSDP");
  const bool bf16 = std::getenv("GRPO_DP_BF16") != nullptr;
  auto env = distributed::RankEnvFromEnvironment();
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  const int timeout_ms = std::atoi(std::getenv("GRPO_DP_TIMEOUT_MS"));
  auto group = distributed::RankGroup::Join(*env, std::chrono::milliseconds(timeout_ms));
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  if (mode == "die" && env->rank == 1) std::_Exit(3);  // leaves before the first step
  if (mode == "stall" && env->rank == 1) {
    ::raise(SIGSTOP);  // the parent continues it after rank 0 failed
    return;
  }
  common::GrpoConfig cfg = RankConfig(loss_type, env->world_size, fsdp);
  cfg.bf16 = bf16;
  const RunResult r = Train(cfg, group->get());
  nlohmann::json j;
  j["error"] = r.error;
  j["steps"] = nlohmann::json::array();
  for (const StepMetrics& s : r.steps) j["steps"].push_back(s.ToJson());
  common::NamedTensors weights;
  for (size_t i = 0; i < r.weights.size(); ++i) {
    weights.emplace_back("w" + std::to_string(i), r.weights[i]);
  }
  if (r.error.empty()) {
    ASSERT_TRUE(common::WriteSafetensors(std::string(out) + ".safetensors", weights).ok());
  }
  std::ofstream(std::string(out) + ".json") << j.dump();
}

struct ChildRun {
  std::vector<int> exit_codes;
  std::vector<nlohmann::json> results;
  std::vector<std::vector<at::Tensor>> weights;
  double rank0_seconds = 0;
};

ChildRun RunRanks(int world, const std::string& loss_type, const std::string& mode, int timeout_ms,
                  const std::string& fsdp = "no_shard", bool bf16 = false) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() /
                       ("grpo_dp_" + std::to_string(::getpid()) + "_" + loss_type + "_" + mode +
                        "_" + std::to_string(world) + "_" + fsdp + (bf16 ? "_bf16" : ""));
  fs::remove_all(dir);
  fs::create_directories(dir);
  common::ProcessSupervisor sup;
  const ReservedPort reserved;  // held while the ranks run: no concurrent test takes it
  const int port = reserved.port();
  EXPECT_GT(port, 0);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < world; ++r) {
    ::setenv("RANK", std::to_string(r).c_str(), 1);
    ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    ::setenv("GRPO_DP_CHILD_OUT", (dir / ("rank" + std::to_string(r))).c_str(), 1);
    ::setenv("GRPO_DP_LOSS", loss_type.c_str(), 1);
    ::setenv("GRPO_DP_MODE", mode.c_str(), 1);
    ::setenv("GRPO_DP_FSDP", fsdp.c_str(), 1);
    ::setenv("GRPO_DP_TIMEOUT_MS", std::to_string(timeout_ms).c_str(), 1);
    if (bf16) ::setenv("GRPO_DP_BF16", "1", 1);
    common::ProcessSpec spec;
    spec.argv = {"/proc/self/exe", "--gtest_filter=DataParallelChild.Rank"};
    spec.stdout_path = (dir / ("rank" + std::to_string(r) + ".log")).string();
    spec.stderr_path = spec.stdout_path;
    spec.die_with_parent = true;
    EXPECT_TRUE(sup.Spawn("rank" + std::to_string(r), spec).ok());
  }
  for (const char* v :
       {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GRPO_DP_CHILD_OUT", "GRPO_DP_LOSS",
        "GRPO_DP_MODE", "GRPO_DP_FSDP", "GRPO_DP_TIMEOUT_MS", "GRPO_DP_BF16"}) {
    ::unsetenv(v);
  }
  ChildRun run;
  run.exit_codes.assign(world, -1);
  const auto code0 = sup.Wait("rank0", std::chrono::seconds(120));
  run.rank0_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (mode == "stall") sup.Signal("rank1", SIGCONT);
  sup.WaitAll(std::chrono::seconds(60));
  for (int r = 0; r < world; ++r) {
    const auto* p = sup.Find("rank" + std::to_string(r));
    run.exit_codes[r] = p != nullptr ? p->exit_code : -1;
    std::ifstream in(dir / ("rank" + std::to_string(r) + ".json"));
    nlohmann::json j;
    if (in) in >> j;
    run.results.push_back(j);
    std::vector<at::Tensor> w;
    auto file = common::SafetensorsFile::Open(
        (dir / ("rank" + std::to_string(r) + ".safetensors")).string());
    if (file.ok()) {
      for (size_t i = 0; i < (*file)->Names().size(); ++i) {
        w.push_back(*(*file)->Get("w" + std::to_string(i)));
      }
    }
    run.weights.push_back(w);
    if (run.exit_codes[r] != 0 || !j.is_object()) {
      std::ifstream log(dir / ("rank" + std::to_string(r) + ".log"));
      std::cerr << "rank " << r << " log:\n"
                << std::string(std::istreambuf_iterator<char>(log), {});
    }
  }
  (void)code0;
  return run;
}

class DataParallelProcesses
    : public ::testing::TestWithParam<std::tuple<std::string, int, std::string, bool>> {};

TEST_P(DataParallelProcesses, RanksOverC10dTakeTheSingleRanksSteps) {
  const auto [loss_type, world, fsdp, bf16] = GetParam();
  common::GrpoConfig one = RankConfig(loss_type, 1);
  one.bf16 = bf16;
  const RunResult single = Train(one, nullptr);
  ASSERT_TRUE(single.error.empty()) << single.error;
  const ChildRun run = RunRanks(world, loss_type, "train", 60'000, fsdp, bf16);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(run.exit_codes[r], 0) << "rank " << r;
    ASSERT_TRUE(run.results[r].is_object()) << "rank " << r;
    RunResult got;
    got.error = run.results[r]["error"].get<std::string>();
    for (const auto& s : run.results[r]["steps"]) {
      StepMetrics m;
      m.step = s["step"];
      m.micro_batches = s["micro_batches"];
      m.sequences = s["sequences"];
      m.loss = s["loss"];
      m.grad_norm = s["grad_norm"];
      m.entropy = s["entropy"];
      m.clip_ratio_region = s["clip_ratio/region_mean"];
      m.logprob_mismatch_mean = s.value("logprob_mismatch/mean", 0.0);
      m.is_ratio_max = s.value("is_ratio/max", 0.0);
      got.steps.push_back(m);
    }
    got.weights = run.weights[r];
    ExpectSameAsSingleRank(got, single, r);
  }
}

INSTANTIATE_TEST_SUITE_P(
    LossTypes, DataParallelProcesses,
    ::testing::Values(std::make_tuple("dapo", 2, "no_shard", false),
                      std::make_tuple("grpo", 4, "no_shard", false),
                      std::make_tuple("dr_grpo", 2, "no_shard", false),
                      // ZeRO-2 over c10d's _reduce_scatter_base and _allgather_base (Gloo).
                      std::make_tuple("dapo", 4, "shard_grad_op", false),
                      std::make_tuple("grpo", 2, "shard_grad_op", false),
                      // With bf16 the fp32 master sharded too: rank 0's weights broadcast a
                      // bucket at a time, the updated chunks all-gathered in bf16.
                      std::make_tuple("dr_grpo", 2, "shard_grad_op", true),
                      // ZeRO-3: the gathers and reduce-scatters of each unit over Gloo; with bf16
                      // the gathers are of bf16 chunks.
                      std::make_tuple("dapo", 4, "full_shard", false),
                      std::make_tuple("dr_grpo", 2, "full_shard", false),
                      std::make_tuple("grpo", 2, "full_shard", true)));

TEST(DataParallelProcessFaults, ADeadRankFailsRankZerosFirstStepAtOnce) {
  const ChildRun run = RunRanks(2, "dapo", "die", 20'000);
  EXPECT_EQ(run.exit_codes[1], 3);
  ASSERT_TRUE(run.results[0].is_object());
  const std::string error = run.results[0]["error"];
  EXPECT_NE(error.find("UNAVAILABLE"), std::string::npos) << error;
  EXPECT_NE(error.find("all-reduce of the gradients of step 1"), std::string::npos) << error;
  EXPECT_LT(run.rank0_seconds, 20.0) << error;  // a closed connection, not the deadline
}

TEST(DataParallelProcessFaults, AStoppedRankFailsRankZeroWithinTheDeadline) {
  const ChildRun run = RunRanks(2, "dapo", "stall", 3'000);
  ASSERT_TRUE(run.results[0].is_object());
  const std::string error = run.results[0]["error"];
  EXPECT_NE(error.find("DEADLINE_EXCEEDED"), std::string::npos) << error;
  EXPECT_NE(error.find("rank_timeout_seconds"), std::string::npos) << error;
  EXPECT_LT(run.rank0_seconds, 3.0 + 8.0) << error;  // rendezvous + one deadline + the step
}

}  // namespace
}  // namespace grpo::learner
