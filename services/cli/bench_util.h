// Helpers shared by the `grpo bench` benchmarks (services/cli/cli_bench.cc and
// services/cli/bench_*.cc): timing, the bench model, one learner step.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/model/model.h"
#include "common/status.h"
#include "learner/distributed/rank_group.h"

namespace grpo::services::bench {

using Clock = std::chrono::steady_clock;

inline constexpr int64_t kPromptLen = 64;         // docs/BENCHMARKS.md: prompt 64 tokens
inline constexpr int64_t kCompletionLen = 128;    // completion 128 tokens
inline constexpr int64_t kBenchGenerations = 16;  // G of learner_step / decode

inline double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Timing {
  double median = 0, min = 0, max = 0;
};

// Median, min and max of `samples` (not empty).
inline Timing Summarize(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return {samples[samples.size() / 2], samples.front(), samples.back()};
}

// One warm-up call, then `reps` timed calls.
template <typename Fn>
Timing TimeIt(int reps, Fn fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    fn();
    t.push_back(Seconds(t0));
  }
  return Summarize(std::move(t));
}

// The bench model of docs/BENCHMARKS.md (preset "bench", seed 0); `layers` > 0 overrides its depth.
std::unique_ptr<common::Model> BenchModel(int64_t layers = 0);

// Random prompt + completion ids [n, kPromptLen + kCompletionLen].
at::Tensor RandomIds(int64_t n, int64_t vocab, uint64_t seed);
// n prompts of `len` ids (<= kPromptLen + kCompletionLen): the first `len` of RandomIds' rows.
std::vector<std::vector<int32_t>> RandomPrompts(int64_t n, int64_t len, int64_t vocab,
                                                uint64_t seed);

// One GrpoTrainer optimizer step on the bench model, as `grpo bench learner_step`: G=16
// completions of one prompt (64 + 128 tokens), micro-batches of `micro`; `reps` after a warm-up.
// With `peak_mib`, also the peak resident set during the timed steps minus the resident set
// after the warm-up step (model, optimizer state and gradients exist by then), in MiB.
Timing LearnerStepTiming(int reps, int64_t micro, bool gradient_checkpointing = false,
                         double* peak_mib = nullptr, int64_t layers = 0);

// grpo bench weight_sync | ingest | e2e (services/cli/bench_weight_sync.cc, bench_ingest.cc,
// bench_e2e.cc).
struct ServiceBenchOptions {
  bool json = false;
  int reps = 5;
  int64_t micro = 4;    // learner step micro-batch
  int64_t workers = 0;  // 0 = the bench's default
  int64_t steps = 0;    // e2e: optimizer steps per run with num_iterations 1; 0 = default
  int64_t groups = 0;   // ingest: groups per worker per repetition; 0 = default
};
int BenchWeightSync(const ServiceBenchOptions& o);
int BenchIngest(const ServiceBenchOptions& o);
int BenchE2e(const ServiceBenchOptions& o);
// grpo bench long_tail_e2e (services/cli/bench_long_tail_e2e.cc): `steps` per run (default 16).
int BenchLongTailE2e(const ServiceBenchOptions& o);

// grpo bench episodes (services/cli/bench_episodes.cc).
struct EpisodesBenchOptions {
  bool json = false;
  int reps = 5;
  bool fast = false;      // the tiny model only
  int64_t max_turns = 0;  // 0 = 4
};
int BenchEpisodes(const EpisodesBenchOptions& o);
// grpo bench episode_stream (bench_episodes.cc): the tiny model's episodes of 16 prompts, one
// ProduceEpisodes call per lease of 2 against one StreamEpisodes call (continuous_batching).
int BenchEpisodeStream(const EpisodesBenchOptions& o);

// grpo bench partial_rollouts (services/cli/bench_partial_rollouts.cc): a Generate call with no
// in-flight update, one that recomputes the KV cache and one that keeps it.
int BenchPartialRollouts(bool as_json, int reps);
// grpo bench long_tail (services/cli/bench_long_tail.cc): 64 groups, every 8th 8x longer, at most
// 8 decoding; rounds (admit only when idle) against continuous batching, and the learner's
// updates drained or taken in flight (rollout/bench/long_tail.h).
int BenchLongTail(bool as_json, int reps);

// A field of /proc/self/status ("VmRSS", "VmHWM") in bytes; 0 when absent.
int64_t ProcStatusBytes(const char* key);

// The most anonymous memory the process held while it lived: the resident set less the pages
// of files (libtorch's code, which the ranks of a host share and the kernel can drop when
// memory is short), RssAnon read every millisecond by a thread of its own. The
// kernel keeps no peak of it (VmHWM counts the pages of files too); anonymous memory hardly
// shrinks here (the malloc and MappedCpuAllocator keep what is freed), so a millisecond's
// sampling misses little of it.
class AnonymousPeak {
 public:
  AnonymousPeak();
  ~AnonymousPeak();
  AnonymousPeak(const AnonymousPeak&) = delete;
  AnonymousPeak& operator=(const AnonymousPeak&) = delete;
  // Stops sampling; the peak in bytes.
  int64_t Stop();
  // The anonymous resident bytes now.
  static int64_t Now();

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> peak_{0};
  std::thread sampler_;
};

// A free TCP port on loopback (0 when none could be had): a rendezvous for ranks as processes.
int FreePort();

// `world` ranks as processes of this binary, each run with `args` after it and the variables
// torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port); the last JSON object
// each printed on stdout, in rank order, or an empty vector when any failed.
std::vector<nlohmann::json> RunRankProcesses(int world, const std::string& args);

// The child's side of RunRankProcesses: the group of torchrun's variables, joined within 300 s;
// the status of the variables or of the join otherwise.
StatusOr<std::unique_ptr<learner::distributed::RankGroup>> JoinRankProcesses();

// grpo bench sharding (services/cli/bench_sharding.cc): the learner at world size 1, 2 and 4 for
// each fsdp mode, each rank a process of this binary (`--child`).
struct ShardingBenchOptions {
  bool json = false;
  int reps = 5;
  bool child = false;    // internal: one rank of one configuration
  int world_size = 1;    // internal (child)
  std::string fsdp;      // internal (child)
  bool bf16 = false;     // internal (child)
  std::string out_path;  // internal (child): rank 0's final weights
  double beta = 0;       // != 0: every row with a reference model (a copy of the policy)
};
int BenchSharding(const ShardingBenchOptions& o);

// grpo bench loading (services/cli/bench_loading.cc): full_shard ranks as processes of this
// binary load a model of 1.4 GB (fp32) from its files, each reading its shards (sharded loading)
// against the whole model on every rank with rank 0's broadcast, at 2 and 4 ranks.
struct LoadingBenchOptions {
  bool json = false;
  int reps = 5;
  int64_t layers = 0;     // decoder layers (0: 16)
  bool child = false;     // internal: one rank of one configuration
  int world_size = 1;     // internal (child)
  std::string impl;       // internal (child): sharded | whole
  std::string model_dir;  // internal (child)
};
int BenchLoading(const LoadingBenchOptions& o);

}  // namespace grpo::services::bench
