// Per-rank checkpoint shards of a sharded AdamW state (docs/ARCHITECTURE.md "Sharding"): each
// rank writes the runs of the parameters' flattened AdamW moments it holds (StepOptimizer::
// StatePieces) to `optimizer-rank-<r>-of-<N>.safetensors` in the checkpoint directory, as 1-D
// fp32 tensors named `exp_avg.<param>@<offset>` and `exp_avg_sq.<param>@<offset>`, with the
// step count and the world size in the header's metadata. No rank holds more than its own state
// while a checkpoint is saved, and the ranks write at once. A job restored at any world size
// reads, from every file, the runs that overlap its own (the layout carries the offsets, so the
// bucket or unit cuts of the saving world size do not matter); an optimizer that holds the
// state whole (one rank, no_shard) assembles it from the runs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/model/safetensors.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"
#include "learner/step_optimizer.h"

namespace grpo::learner::distributed {

// "optimizer-rank-00002-of-00004.safetensors".
std::string StateShardFileName(int rank, int world_size);

// Writes this rank's runs of `optimizer` and its step count to `path` through `path.tmp` +
// fsync + rename; on the CPU, whatever the state's device.
Status WriteStateShard(StepOptimizer& optimizer, const std::string& path, int rank, int world_size);

// The shard files of one checkpoint directory, memory-mapped and indexed by parameter.
class StateShards {
 public:
  // NotFound when `dir` has no shard file; DataLoss naming the file when one of the N files of
  // its world size is missing, a file of another world size is there, or a file is malformed.
  static StatusOr<std::unique_ptr<StateShards>> Open(const std::string& dir);

  int world_size() const { return world_size_; }
  int64_t step() const { return step_; }
  // Copies elements [offset, offset + out.numel()) of parameter `param`'s flattened moment
  // `which` (0: exp_avg, 1: exp_avg_sq) into `out` (1-D, any device) from every run that
  // overlaps them; DataLoss naming the parameter when the runs do not cover them all.
  Status Read(const std::string& param, int which, int64_t offset, at::Tensor out) const;

 private:
  struct Run {
    int64_t offset = 0, numel = 0;
    const common::SafetensorsFile* file = nullptr;
  };
  int world_size_ = 0;
  int64_t step_ = 0;
  std::vector<std::unique_ptr<common::SafetensorsFile>> files_;
  std::map<std::string, std::vector<Run>> runs_;  // by parameter, sorted by offset
};

// Overwrites every run of `optimizer` from `shards`, and its step count.
Status LoadStateShards(const StateShards& shards, StepOptimizer& optimizer);

// The whole state of `params` from `shards`, named and shaped as AdamW::StateDict
// ("exp_avg.<param>", "exp_avg_sq.<param>", "step"), for an optimizer that holds it whole.
StatusOr<common::NamedTensors> WholeStateFromShards(const StateShards& shards,
                                                    const common::NamedTensors& params);

// A collective: the shards of rank 0's `optimizer.pending_state_shards` (cleared after) are
// read by every rank, each its own runs; a rank that cannot read them fails every rank
// (DataLoss, naming it). Nothing happens when rank 0 has none.
Status HandOutStateShards(StepOptimizer& optimizer, Collectives& ranks, const std::string& what);

// Ranks that do not share output_dir (no shard files): the whole state in one file at `path`,
// named as AdamW::StateDict names it, written by rank 0 a parameter at a time. A collective:
// each moment of each parameter of `params` (the model's, in its order) is put together on every
// rank from the ranks' runs (an all-reduce of a buffer of the parameter's size, zeros but for
// each rank's own runs) and rank 0 writes it (through `path.tmp`): no rank holds more than one
// moment of one parameter beside its shard. Every rank makes every collective whatever rank 0's
// writes do; rank 0 returns its write's error after them (others ignore `path`).
Status WriteStateThroughRankZero(StepOptimizer& optimizer, const common::NamedTensors& params,
                                 Collectives& ranks, const std::string& path,
                                 const std::string& what);

// A collective, the other way: rank 0's `optimizer.pending_state_file` (cleared after) is read
// by rank 0 a moment of a parameter at a time and broadcast, each rank keeping its own runs, and
// the step count set on every rank. Nothing happens when rank 0 has none. DataLoss on every rank
// when rank 0 cannot read it (a missing or misshapen tensor is found before anything changes).
Status HandOutStateFile(StepOptimizer& optimizer, const common::NamedTensors& params,
                        Collectives& ranks, const std::string& what);

}  // namespace grpo::learner::distributed
