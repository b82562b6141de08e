// The long-tail generation workload (issue 26, "the long tail"), shared by `grpo bench long_tail`
// (the CPU, the tiny model) and grpo_gpu_bench's long_tail row (CUDA, a Qwen3-0.6B shape): a
// worker's generation on a task whose completion lengths are skewed, every `long_every`th group
// allowed 8x the tokens of the others, with the learner's weight updates arriving every
// `update_every` decode steps. It measures what continuous batching and in-flight weight updates
// buy the worker where nothing else (a learner sharing the cores) hides it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/status.h"

namespace grpo::rollout::bench {

struct LongTailShape {
  int64_t groups = 64;    // prompts, one group of num_generations each
  int64_t in_flight = 8;  // groups decoding at once (GroupStream::max_prompts)
  int64_t num_generations = 8;
  int64_t prompt_tokens = 16;
  int64_t short_tokens = 32;  // a group's budget (no stop id: every row runs to it), or
  int64_t long_tokens = 256;  // this for every long_every-th group
  int64_t long_every = 8;
};

struct LongTailMode {
  std::string name;
  // Admit a prompt as soon as a group leaves (continuous_batching), or only when nothing
  // decodes (a worker's Generate call per lease).
  bool continuous = false;
  // A new policy version installed (Generator::SetPolicy, the same weights) every this many
  // decode steps, at the end of the stop-check window that reaches it; 0 = none.
  int64_t update_every = 0;
  // Take the update in flight (partial_rollouts): keys/values recomputed (`recompute_kv`) or
  // kept. Without it a continuous stream stops admitting until its groups in flight are done.
  bool partial_rollouts = false;
  bool recompute_kv = true;
};

struct LongTailRun {
  double seconds = 0;
  int64_t tokens = 0;  // completion tokens
  int64_t decode_steps = 0;
  int64_t row_steps = 0;  // rows decoding, summed over the decode steps
  int64_t updates = 0;    // versions installed
  int64_t switches = 0;   // versions the stream took (StreamStats::num_switches)
  int64_t drains = 0;     // admission paused for a newer version (StreamStats::num_drains)
  int64_t recompute_tokens = 0;

  double mean_rows() const {
    return decode_steps > 0 ? static_cast<double>(row_steps) / static_cast<double>(decode_steps)
                            : 0;
  }
};

// `n` prompts of `len` ids drawn uniformly from [0, vocab) with `seed`.
std::vector<std::vector<int32_t>> LongTailPrompts(int64_t n, int64_t len, int64_t vocab,
                                                  uint64_t seed);

// One pass over `prompts` (shape.groups of them) in `mode`, through a fresh Generator of
// `policy` (seed 11) and GenerateStream. Internal when a group failed or fewer came back.
StatusOr<LongTailRun> RunLongTail(std::shared_ptr<const common::Model> policy,
                                  const LongTailShape& shape, const LongTailMode& mode,
                                  const std::vector<std::vector<int32_t>>& prompts);

}  // namespace grpo::rollout::bench
