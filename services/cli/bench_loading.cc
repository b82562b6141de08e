// grpo bench loading [--json] [--reps N] [--layers L]: how full_shard ranks load a model from its
// files (docs/BENCHMARKS.md "loading"). A model of the loading bench's shape (Qwen2-style, hidden
// 1024, 16 layers, MLP 4096, vocab 65536 tied: 352 M parameters, 1.41 GB in fp32) is written
// once; then for 2 and 4 ranks, each a fresh process of this binary (`bench loading --child`,
// RANK/WORLD_SIZE/MASTER_* as torchrun sets them, ProcessGroupGloo on loopback), it is loaded
// with `fsdp: full_shard` two ways: `sharded`, each rank reading only its own chunks from the
// files (Model::LoadDeferred, what `grpo learner` does with model_name_or_path), and `whole`,
// every rank reading the whole model (Model::Load) while the shards are cut from rank 0's
// broadcast (what every rank did before sharded loading). Each row: the peak resident set of a
// rank while it loads and shards (above the one before), the live CPU tensor bytes' peak, the
// plan's loading peak, and the seconds from the group's join to the shards cut.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/counting_allocator.h"
#include "learner/distributed/memory_plan.h"
#include "learner/distributed/rank_group.h"
#include "learner/grpo_trainer.h"
#include "services/cli/bench_util.h"

namespace grpo::services::bench {

namespace {

using nlohmann::json;
namespace dist = learner::distributed;

common::ModelConfig LoadingModelConfig(int64_t layers) {
  common::ModelConfig c = *common::ModelConfigPreset("bench");
  c.hidden_size = 1024;
  c.intermediate_size = 4096;
  c.num_hidden_layers = layers > 0 ? layers : 16;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.vocab_size = 65536;
  c.tie_word_embeddings = true;
  return c;
}

common::GrpoConfig LoadingConfig(const std::string& model_dir, bool sharded) {
  common::GrpoConfig c;
  c.fsdp = "full_shard";
  c.num_generations = 4;
  c.per_device_train_batch_size = 2;
  c.steps_per_generation = 2;
  c.max_prompt_length = kPromptLen;
  c.max_completion_length = kCompletionLen;
  // The plan counts sharded loading from model_name_or_path, the whole model without it.
  if (sharded) c.model_name_or_path = model_dir;
  return c;
}

// One rank: joins the group, loads the model one way and shards it (GrpoTrainer::Create), prints
// one JSON line.
int LoadingChild(const LoadingBenchOptions& o) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(static_cast<int>(std::max(1u, cores / static_cast<unsigned>(o.world_size))));
  static common::CountingScope counting;
  auto group = JoinRankProcesses();
  if (!group.ok()) {
    std::cerr << group.status().ToString() << "\n";
    return 1;
  }
  const bool sharded = o.impl == "sharded";
  const int64_t base = ProcStatusBytes("VmRSS");  // the process and the group, nothing loaded
  const int64_t live_base = common::CountingCpuAllocator::Get().Reset();
  const auto t0 = Clock::now();
  auto model =
      sharded ? common::Model::LoadDeferred(o.model_dir) : common::Model::Load(o.model_dir);
  if (!model.ok()) {
    std::cerr << model.status().ToString() << "\n";
    return 1;
  }
  auto trainer = learner::GrpoTrainer::Create(LoadingConfig(o.model_dir, sharded), model->get(),
                                              nullptr, group->get());
  if (!trainer.ok()) {
    std::cerr << trainer.status().ToString() << "\n";
    return 1;
  }
  const double seconds = Seconds(t0);
  std::cout << json{{"rank", (*group)->rank()},
                    {"peak_bytes", ProcStatusBytes("VmHWM") - base},
                    {"live_peak_bytes", common::CountingCpuAllocator::Get().peak() - live_base},
                    {"seconds", seconds}}
                   .dump()
            << "\n";
  return 0;
}

}  // namespace

int BenchLoading(const LoadingBenchOptions& o) {
  if (o.child) return LoadingChild(o);
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_bench_loading_" + std::to_string(::getpid()));
  const common::ModelConfig config = LoadingModelConfig(o.layers);
  int64_t parameters = 0;
  {
    std::cerr << "loading: writing the model to " << dir.string() << " ...\n";
    auto model = common::Model::InitRandom(config, 0);
    if (!model.ok() || !(*model)->Save(dir.string()).ok()) {
      std::cerr << "loading: cannot write the model under " << dir.string() << "\n";
      fs::remove_all(dir);
      return 1;
    }
    parameters = (*model)->NumParameters();
  }
  std::vector<json> rows;
  for (int world : {2, 4}) {
    for (const char* impl : {"whole", "sharded"}) {
      const bool sharded = std::string(impl) == "sharded";
      auto plan = dist::PlanMemory(config, LoadingConfig(dir.string(), sharded), world, "cpu");
      json row = {{"bench", "loading"},
                  {"world_size", world},
                  {"impl", impl},
                  {"parameters", parameters},
                  {"predicted_load_bytes_per_rank",
                   plan.ok() ? plan->ModelState() + plan->load : int64_t{-1}}};
      int64_t peak = 0, live = 0;
      std::vector<double> seconds;
      for (int rep = 0; rep < std::max(1, o.reps); ++rep) {
        std::cerr << "loading: " << world << " ranks, " << impl << ", run " << rep + 1 << " ...\n";
        const std::vector<json> ranks =
            RunRankProcesses(world, "bench loading --child --world_size " + std::to_string(world) +
                                        " --impl " + impl + " --out " + dir.string());
        if (static_cast<int>(ranks.size()) != world) {
          std::cerr << "loading: a rank of " << world << " ranks, " << impl << " failed\n";
          fs::remove_all(dir);
          return 1;
        }
        double slowest = 0;
        for (const json& r : ranks) {
          peak = std::max(peak, r["peak_bytes"].get<int64_t>());
          live = std::max(live, r["live_peak_bytes"].get<int64_t>());
          slowest = std::max(slowest, r["seconds"].get<double>());
        }
        seconds.push_back(slowest);
      }
      const Timing t = Summarize(seconds);
      row["peak_bytes_per_rank"] = peak;
      row["live_peak_bytes_per_rank"] = live;
      row["seconds"] = t.median;
      row["seconds_min"] = t.min;
      row["seconds_max"] = t.max;
      rows.push_back(row);
    }
  }
  fs::remove_all(dir);
  // Each sharded row against the whole row of its world size, measured in the same run.
  for (json& r : rows) {
    for (const json& w : rows) {
      if (r["impl"] == "sharded" && w["impl"] == "whole" && w["world_size"] == r["world_size"]) {
        r["peak_vs_whole"] =
            r["peak_bytes_per_rank"].get<double>() / w["peak_bytes_per_rank"].get<double>();
        r["seconds_vs_whole"] = r["seconds"].get<double>() / w["seconds"].get<double>();
      }
    }
    r["live_peak_vs_predicted"] = r["live_peak_bytes_per_rank"].get<double>() /
                                  r["predicted_load_bytes_per_rank"].get<double>();
  }
  if (o.json) {
    for (const json& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  auto mib = [](const json& v) { return v.get<double>() / 1048576.0; };
  std::cout << "loading: a model of " << parameters << " parameters (" << std::setprecision(2)
            << std::fixed << 4.0 * parameters / (1 << 30)
            << " GiB in fp32) loaded by full_shard ranks, Gloo on loopback; peak = resident set "
               "above the one before loading, max over ranks and runs; seconds: median of "
            << std::max(1, o.reps) << "\n"
            << std::left << std::setw(6) << "ranks" << std::setw(9) << "impl" << std::right
            << std::setw(11) << "peak MiB" << std::setw(11) << "live MiB" << std::setw(11)
            << "plan MiB" << std::setw(10) << "seconds" << std::setw(14) << "peak vs whole"
            << std::setw(13) << "s vs whole\n";
  for (const json& r : rows) {
    std::cout << std::left << std::setw(6) << r["world_size"].get<int>() << std::setw(9)
              << r["impl"].get<std::string>() << std::right << std::setprecision(1) << std::setw(11)
              << mib(r["peak_bytes_per_rank"]) << std::setw(11)
              << mib(r["live_peak_bytes_per_rank"]) << std::setw(11)
              << mib(r["predicted_load_bytes_per_rank"]) << std::setprecision(2) << std::setw(10)
              << r["seconds"].get<double>();
    if (r.contains("peak_vs_whole")) {
      std::cout << std::setw(14) << r["peak_vs_whole"].get<double>() << std::setw(12)
                << r["seconds_vs_whole"].get<double>();
    }
    std::cout << "\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
