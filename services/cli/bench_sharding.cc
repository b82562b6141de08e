// grpo bench sharding [--json] [--reps N]: the learner at world size 1, 2 and 4 for each `fsdp`
// mode (docs/BENCHMARKS.md "sharding"). Each configuration runs its ranks as fresh processes of
// this binary (`bench sharding --child`, RANK/WORLD_SIZE/MASTER_* set as torchrun sets them,
// ProcessGroupGloo on loopback); every configuration trains the same global step (16
// completions of 64 + 128 tokens, 4 groups of 4, micro-batches of 2: gradient accumulation 8 / W
// per rank) from the same weights, so rows compare one to another and to world size 1. The bf16
// rows (one rank, and shard_grad_op and full_shard at 2 and 4) compare to the single bf16 rank.
// With --beta every row trains with a reference model too (a copy of the policy: whole, or sharded
// where full_shard is), and reports its bytes per rank.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/counting_allocator.h"
#include "common/malloc_info.h"
#include "common/mapped_allocator.h"
#include "common/model/safetensors.h"
#include "learner/distributed/collectives.h"
#include "learner/distributed/memory_plan.h"
#include "learner/distributed/rank_group.h"
#include "learner/grpo_trainer.h"
#include "services/cli/bench_util.h"

namespace grpo::services::bench {

namespace {

using nlohmann::json;
namespace dist = learner::distributed;

constexpr int kGroups = 4;
constexpr int kGenerations = 4;
constexpr int kMicro = 2;
constexpr int kStepMicroBatches = kGroups * kGenerations / kMicro;  // over all ranks

common::GrpoConfig ShardingConfig(int world, const std::string& fsdp, bool bf16, double beta) {
  common::GrpoConfig c;
  c.bf16 = bf16;
  c.beta = beta;
  c.num_generations = kGenerations;
  c.per_device_train_batch_size = kMicro;
  c.gradient_accumulation_steps = kStepMicroBatches / world;
  c.steps_per_generation = c.gradient_accumulation_steps;  // one step per generation batch
  c.num_iterations = 1;
  c.max_prompt_length = kPromptLen;
  c.max_completion_length = kCompletionLen;
  c.importance_sampling_correction = "none";
  c.max_staleness = 1 << 20;
  c.max_steps = 1 << 20;
  c.fsdp = fsdp;
  // As data_parallel_test, and for its reason: where an element's micro-batch terms cancel to
  // ~0, AdamW with eps 1e-8 turns the float32 rounding of another summation order (over ranks)
  // into a step of ~lr; the zero-initialised biases, made only of such steps, then differ by
  // 4e-4 of themselves (measured). eps 1e-4 keeps AdamW's update and the comparison meaningful.
  c.adam_epsilon = 1e-4;
  return c;
}

std::vector<common::RolloutGroup> ShardingGroups(int64_t vocab) {
  std::vector<common::RolloutGroup> groups;
  for (int k = 0; k < kGroups; ++k) {
    const at::Tensor ids = RandomIds(kGenerations, vocab, 100 + k);
    common::RolloutGroup g;
    g.prompt_id = "bench-" + std::to_string(k);
    for (int64_t t = 0; t < kPromptLen; ++t) g.prompt_ids.push_back(ids[0][t].item<int32_t>());
    for (int64_t j = 0; j < kGenerations; ++j) {
      common::Completion c;
      for (int64_t t = 0; t < kCompletionLen; ++t) {
        c.token_ids.push_back(ids[j][kPromptLen + t].item<int32_t>());
      }
      c.rewards = {static_cast<double>((j + k) % 3)};
      g.completions.push_back(c);
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

// A pending collective whose wait adds its wall time to `*seconds`.
class TimedPending final : public dist::PendingCollective {
 public:
  TimedPending(std::unique_ptr<dist::PendingCollective> inner, double* seconds)
      : inner_(std::move(inner)), seconds_(seconds) {}
  Status Wait() override {
    const auto t0 = Clock::now();
    Status s = inner_->Wait();
    *seconds_ += Seconds(t0);
    return s;
  }

 private:
  std::unique_ptr<dist::PendingCollective> inner_;
  double* seconds_;
};

// Forwards every collective to `inner`, adding its wall time to `seconds` (of one started
// ahead, the time to start it and the time waited for it: not the time it overlapped).
class TimedCollectives final : public dist::Collectives {
 public:
  explicit TimedCollectives(dist::Collectives* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  Status AllReduceSum(std::vector<at::Tensor>& t, const std::string& w) override {
    return Time([&] { return inner_->AllReduceSum(t, w); });
  }
  Status AllReduceMax(std::vector<at::Tensor>& t, const std::string& w) override {
    return Time([&] { return inner_->AllReduceMax(t, w); });
  }
  Status Broadcast(std::vector<at::Tensor>& t, const std::string& w) override {
    return Time([&] { return inner_->Broadcast(t, w); });
  }
  Status ReduceScatterSum(const at::Tensor& in, at::Tensor& out, const std::string& w) override {
    return Time([&] { return inner_->ReduceScatterSum(in, out, w); });
  }
  Status AllGather(const at::Tensor& in, at::Tensor& out, const std::string& w) override {
    return Time([&] { return inner_->AllGather(in, out, w); });
  }
  // Started on the inner group (so it overlaps as it would), its start and its wait timed.
  std::unique_ptr<dist::PendingCollective> AllGatherAsync(const at::Tensor& in, at::Tensor& out,
                                                          const std::string& w) override {
    const auto t0 = Clock::now();
    auto pending = inner_->AllGatherAsync(in, out, w);
    seconds += Seconds(t0);
    return std::make_unique<TimedPending>(std::move(pending), &seconds);
  }
  double seconds = 0;

 private:
  template <typename Fn>
  Status Time(Fn fn) {
    const auto t0 = Clock::now();
    Status s = fn();
    seconds += Seconds(t0);
    return s;
  }
  dist::Collectives* inner_;
};

// One rank: trains a warm-up step and `reps` timed steps, prints one JSON line.
int ShardingChild(const ShardingBenchOptions& o) {
  const int world = o.world_size;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(static_cast<int>(std::max(1u, cores / static_cast<unsigned>(world))));
  const int64_t base = ProcStatusBytes("VmRSS");  // before the model and the group
  // The pages of files (libtorch's code that the step runs first) the resident set gains.
  const int64_t file_base = ProcStatusBytes("RssFile");
  // The rank's own memory, without those pages: what the plan is held to (README "Sharding,
  // measured").
  const int64_t anon_base = AnonymousPeak::Now();
  AnonymousPeak anon;
  // The bytes of live CPU tensors, what the plan predicts; the resident set adds what the malloc
  // keeps of freed blocks (README "Sharding, measured") and libtorch's own allocations.
  static common::CountingScope counting;
  const int64_t live_base = common::CountingCpuAllocator::Get().Reset();
  dist::SingleRank single;
  std::unique_ptr<dist::RankGroup> group;
  dist::Collectives* inner = &single;
  if (world > 1) {
    auto joined = JoinRankProcesses();
    if (!joined.ok()) {
      std::cerr << joined.status().ToString() << "\n";
      return 1;
    }
    group = std::move(*joined);
    inner = group.get();
  }
  TimedCollectives timed(inner);
  auto model = BenchModel();
  const auto groups = ShardingGroups(model->config().vocab_size);
  std::unique_ptr<common::Model> reference;
  if (o.beta != 0) {
    auto copy = model->Copy(model->device(), model->dtype());
    if (!copy.ok()) {
      std::cerr << copy.status().ToString() << "\n";
      return 1;
    }
    reference = std::move(copy).value();
  }
  common::Model* const ref = reference.get();
  auto trainer = learner::GrpoTrainer::Create(ShardingConfig(world, o.fsdp, o.bf16, o.beta),
                                              model.get(), std::move(reference), &timed);
  if (!trainer.ok()) {
    std::cerr << trainer.status().ToString() << "\n";
    return 1;
  }
  std::vector<double> step_s, comm_s;
  for (int i = 0; i <= o.reps; ++i) {  // step 0 is the warm-up
    timed.seconds = 0;
    auto r = (*trainer)->TrainGenerationBatch(groups);
    if (!r.ok() || r->steps.size() != 1) {
      std::cerr << (r.ok() ? "expected one step" : r.status().ToString()) << "\n";
      return 1;
    }
    if (i == 0) continue;
    step_s.push_back(r->steps[0].step_seconds);
    comm_s.push_back(timed.seconds);
  }
  // The training's peak, before the weights are gathered whole for the comparison below (rank
  // 0 then holds a whole fp32 copy, and the file's buffer: not the learner's peak).
  const int64_t peak = ProcStatusBytes("VmHWM") - base;
  const int64_t live_peak = common::CountingCpuAllocator::Get().peak() - live_base;
  // At the resident set's peak the anonymous part was at least VmHWM less the pages of files
  // now (they only grow here).
  const int64_t anon_peak =
      std::max(anon.Stop(), ProcStatusBytes("VmHWM") - ProcStatusBytes("RssFile")) - anon_base;
  int64_t state =
      (*trainer)->optimizer().ResidentBytes() + (*trainer)->optimizer().ResidentParameterBytes();
  if (&(*trainer)->compute_model() != model.get()) {  // bf16: its copy, and its gradients
    for (const at::Tensor& p : (*trainer)->compute_model().Parameters()) {
      state += static_cast<int64_t>(p.storage().nbytes());
      if (p.grad().defined()) state += p.grad().nbytes();
    }
  }
  // The reference's bytes between steps: its shard, or its whole parameters.
  int64_t reference_bytes = 0;
  if (const dist::FrozenShards* shards = (*trainer)->reference_shards(); shards != nullptr) {
    reference_bytes = shards->ShardBytes();
  } else if (ref != nullptr) {
    for (const at::Tensor& p : ref->Parameters()) reference_bytes += p.nbytes();
  }
  common::NamedTensors weights;
  // full_shard, and shard_grad_op's sharded master: gathered a unit or a bucket at a time.
  if ((*trainer)->optimizer().ShardsParameters()) {
    auto gathered = (*trainer)->optimizer().GatherWeights("the bench's weights", false);
    if (!gathered.ok()) {
      std::cerr << gathered.status().ToString() << "\n";
      return 1;
    }
    weights = std::move(*gathered);
  } else {
    weights = model->NamedParameters();
  }
  if (timed.rank() == 0) {
    if (Status s = common::WriteSafetensors(o.out_path, weights); !s.ok()) {
      std::cerr << s.ToString() << "\n";
      return 1;
    }
  }
  const Timing st = Summarize(step_s), ct = Summarize(comm_s);
  std::cout << json{{"rank", timed.rank()},
                    {"model_state_bytes", state},
                    {"reference_bytes", reference_bytes},
                    {"peak_bytes", peak},
                    {"live_peak_bytes", live_peak},
                    {"anon_peak_bytes", anon_peak},
                    {"malloc", common::MallocName()},
                    {"cpu_allocator", common::CpuAllocatorName()},
                    {"file_pages_bytes", ProcStatusBytes("RssFile") - file_base},
                    {"step_seconds", st.median},
                    {"step_seconds_min", st.min},
                    {"step_seconds_max", st.max},
                    {"comm_seconds", ct.median}}
                   .dump()
            << "\n";
  return 0;
}

// max over parameters of max|a - b| / max|b|; -1 when a file is missing.
double MaxRelDiff(const std::string& a_path, const std::string& b_path) {
  auto a = common::SafetensorsFile::Open(a_path);
  auto b = common::SafetensorsFile::Open(b_path);
  if (!a.ok() || !b.ok()) return -1;
  double worst = 0;
  for (const std::string& name : (*b)->Names()) {
    auto x = (*a)->Get(name);
    auto y = (*b)->Get(name);
    if (!x.ok() || !y.ok()) return -1;
    const double scale = std::max(1e-30, y->abs().max().item<double>());
    worst = std::max(worst, (*x - *y).abs().max().item<double>() / scale);
  }
  return worst;
}

// The ZeRO paper's model-state bytes per rank (Rajbhandari et al. 2020, section 5): fp32, its
// K = 8 (fp32 weights and gradient, two fp32 moments): DDP 16 psi; P_os+g (shard_grad_op)
// 4 psi + 12 psi / N; P_os+g+p (full_shard) 16 psi / N. Mixed precision, its K = 12 (fp32
// master and two moments beside bf16 weights and gradient): DDP 16 psi; P_os+g 2 psi + 14 psi /
// N; P_os+g+p 16 psi / N. (shard_grad_op as built keeps an fp32 gradient shard, not a bf16 one:
// 2 psi / N above the paper's P_os+g.)
double ZeroFormulaBytes(const std::string& mode, int world, double psi, bool bf16) {
  if (mode == "no_shard" || world == 1) return 16 * psi;
  if (mode == "shard_grad_op")
    return bf16 ? 2 * psi + 14 * psi / world : 4 * psi + 12 * psi / world;
  return 16 * psi / world;
}

struct ShardingRun {
  int world;
  std::string mode;
  bool bf16;
  std::string Name() const { return std::to_string(world) + mode + (bf16 ? "-bf16" : ""); }
};

}  // namespace

int BenchSharding(const ShardingBenchOptions& o) {
  if (o.child) return ShardingChild(o);
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_bench_sharding_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto model = BenchModel();
  const double psi = static_cast<double>(model->NumParameters());
  const std::vector<ShardingRun> configs = {
      {1, "no_shard", false},   {2, "no_shard", false},     {2, "shard_grad_op", false},
      {2, "full_shard", false}, {4, "no_shard", false},     {4, "shard_grad_op", false},
      {4, "full_shard", false}, {1, "no_shard", true},      {2, "shard_grad_op", true},
      {2, "full_shard", true},  {4, "shard_grad_op", true}, {4, "full_shard", true}};
  std::vector<json> rows;
  for (const ShardingRun& run : configs) {
    const int world = run.world;
    const std::string& mode = run.mode;
    const std::string weights = (dir / ("w" + run.Name())).string();
    json row = {{"bench", "sharding"},
                {"world_size", world},
                {"mode", mode},
                {"bf16", run.bf16},
                {"beta", o.beta}};
    auto plan = dist::PlanMemory(model->config(), ShardingConfig(world, mode, run.bf16, o.beta),
                                 world, "cpu");
    row["predicted_peak_bytes_per_rank"] = plan.ok() ? plan->TrainingPeak() : -1;
    row["zero_formula_model_state_bytes"] = ZeroFormulaBytes(mode, world, psi, run.bf16);
    std::cerr << "sharding: world size " << world << ", " << mode << (run.bf16 ? ", bf16" : "")
              << " ...\n";
    const std::vector<json> ranks = RunRankProcesses(
        world, "bench sharding --child --world_size " + std::to_string(world) + " --fsdp " + mode +
                   " --reps " + std::to_string(o.reps) + " --out " + weights +
                   (run.bf16 ? " --bf16" : "") + " --beta " + std::to_string(o.beta));
    if (static_cast<int>(ranks.size()) != world) {
      std::cerr << "sharding: a rank of world size " << world << ", " << mode << " failed\n";
      fs::remove_all(dir);
      return 1;
    }
    int64_t state = 0, peak = 0, live_peak = 0, anon_peak = 0, reference = 0, file_pages = 0;
    double comm = 0;
    for (const json& r : ranks) {
      state = std::max(state, r["model_state_bytes"].get<int64_t>());
      reference = std::max(reference, r["reference_bytes"].get<int64_t>());
      peak = std::max(peak, r["peak_bytes"].get<int64_t>());
      live_peak = std::max(live_peak, r["live_peak_bytes"].get<int64_t>());
      anon_peak = std::max(anon_peak, r["anon_peak_bytes"].get<int64_t>());
      file_pages = std::max(file_pages, r["file_pages_bytes"].get<int64_t>());
      comm = std::max(comm, r["comm_seconds"].get<double>());
    }
    row["model_state_bytes_per_rank"] = state;
    row["reference_bytes_per_rank"] = reference;
    row["peak_bytes_per_rank"] = peak;
    row["live_peak_bytes_per_rank"] = live_peak;
    row["anon_peak_bytes_per_rank"] = anon_peak;
    row["file_pages_bytes_per_rank"] = file_pages;
    row["malloc"] = ranks[0]["malloc"];  // whose free blocks the resident set holds
    row["cpu_allocator"] = ranks[0]["cpu_allocator"];
    row["step_seconds"] = ranks[0]["step_seconds"];
    row["step_seconds_min"] = ranks[0]["step_seconds_min"];
    row["step_seconds_max"] = ranks[0]["step_seconds_max"];
    row["comm_seconds"] = comm;
    row["max_rel_diff_vs_single_rank"] =
        MaxRelDiff(weights, (dir / ("w" + ShardingRun{1, "no_shard", run.bf16}.Name())).string());
    rows.push_back(row);
  }
  fs::remove_all(dir);
  const json* one[2] = {nullptr, nullptr};  // the single rank, fp32 and bf16
  for (const json& r : rows) {
    if (r["world_size"] == 1) one[r["bf16"].get<bool>() ? 1 : 0] = &r;
  }
  for (json& r : rows) {
    if (!r.contains("step_seconds")) continue;
    r["step_seconds_vs_single_rank"] =
        r["step_seconds"].get<double>() /
        (*one[r["bf16"].get<bool>() ? 1 : 0])["step_seconds"].get<double>();
    r["model_state_vs_zero_formula"] = r["model_state_bytes_per_rank"].get<double>() /
                                       r["zero_formula_model_state_bytes"].get<double>();
    r["peak_vs_predicted"] =
        r["peak_bytes_per_rank"].get<double>() / r["predicted_peak_bytes_per_rank"].get<double>();
    r["live_peak_vs_predicted"] = r["live_peak_bytes_per_rank"].get<double>() /
                                  r["predicted_peak_bytes_per_rank"].get<double>();
    r["anon_peak_vs_predicted"] = r["anon_peak_bytes_per_rank"].get<double>() /
                                  r["predicted_peak_bytes_per_rank"].get<double>();
  }
  if (o.json) {
    for (const json& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  auto mib = [](const json& v) { return v.get<double>() / 1048576.0; };
  std::cout << "sharding: bench model (" << static_cast<int64_t>(psi)
            << " parameters, fp32 and bf16), one step = 16 x (64 + 128) tokens in micro-batches "
               "of 2, Gloo on loopback, this machine's cores shared by the ranks; bf16 rows "
               "against the single bf16 rank; malloc "
            << (rows.empty() ? std::string("?") : rows[0]["malloc"].get<std::string>())
            << (!rows.empty() && rows[0]["cpu_allocator"] == "mapped"
                    ? " (blocks from " + std::to_string(common::kMappedMinBytes >> 10) +
                          " KiB: MappedCpuAllocator)"
                    : "")
            << "; anon: the peak without the pages of files (libtorch's code)"
            << (o.beta != 0 ? "; beta " + std::to_string(o.beta) +
                                  " (ref MiB: the reference model per rank, beside the state "
                                  "column's optimizer state)"
                            : std::string())
            << "\n"
            << std::left << std::setw(6) << "ranks" << std::setw(20) << "fsdp" << std::right
            << std::setw(12) << "state MiB" << std::setw(11) << "ZeRO MiB" << std::setw(11)
            << "peak MiB" << std::setw(11) << "anon MiB" << std::setw(11) << "live MiB"
            << std::setw(11) << "plan MiB" << std::setw(11) << "anon/plan" << std::setw(10)
            << "step s" << std::setw(9) << "vs 1" << std::setw(10) << "comm s" << std::setw(12)
            << "max diff" << (o.beta != 0 ? "    ref MiB" : "") << "\n";
  for (const json& r : rows) {
    std::cout << std::left << std::setw(6) << r["world_size"].get<int>() << std::setw(20)
              << r["mode"].get<std::string>() + (r["bf16"].get<bool>() ? " bf16" : "") << std::right
              << std::fixed;
    std::cout << std::setprecision(1) << std::setw(12) << mib(r["model_state_bytes_per_rank"])
              << std::setw(11) << mib(r["zero_formula_model_state_bytes"]) << std::setw(11)
              << mib(r["peak_bytes_per_rank"]) << std::setw(11)
              << mib(r["anon_peak_bytes_per_rank"]) << std::setw(11)
              << mib(r["live_peak_bytes_per_rank"]) << std::setw(11)
              << mib(r["predicted_peak_bytes_per_rank"]) << std::setprecision(2) << std::setw(11)
              << r["anon_peak_vs_predicted"].get<double>() << std::setprecision(3) << std::setw(10)
              << r["step_seconds"].get<double>() << std::setprecision(2) << std::setw(9)
              << r["step_seconds_vs_single_rank"].get<double>() << std::setprecision(3)
              << std::setw(10) << r["comm_seconds"].get<double>() << std::scientific
              << std::setprecision(1) << std::setw(11)
              << r["max_rel_diff_vs_single_rank"].get<double>() << std::fixed;
    if (o.beta != 0) std::cout << std::setw(11) << mib(r["reference_bytes_per_rank"]);
    std::cout << "\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
