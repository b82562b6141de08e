// Whether every learner rank sees the checkpoint rank 0 restored, at a restore of sharded
// weights (StepOptimizer::LoadWeightsFrom: full_shard's shards, shard_grad_op's sharded
// master): each rank that sees it reads its own shard there, never the whole model; when one
// does not (output_dir not shared between machines), the optimizer has rank 0 read the
// weights and hand them out instead.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>

#include "common/model/model_weights.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"
#include "learner/step_optimizer.h"

namespace grpo::learner::distributed {

// Tests: whether a rank > 0 sees the checkpoint rank 0 restored (null: the fingerprint decides),
// as ranks on machines that do not share output_dir.
extern std::function<bool(int rank)> TEST_weight_files_probe;

// A collective. Rank 0's checkpoint (`root`: rank 0's, ignored elsewhere) is named to every
// rank; each rank > 0 that sees the same checkpoint (the SHA-256 of its fingerprint file is
// rank 0's) opens it, checked against `shapes`, and `read`s its shard there. Returns how many
// ranks could not, the same on every rank (0: every shard is read), and then logs on rank 0
// which checkpoint and why, with `fallback` (how rank 0 hands the weights out instead).
// `flag`: the options of the one-element all-reduce that counts them (the group's device).
StatusOr<int64_t> ReadShardsWhereSeen(
    Collectives& ranks, const StepOptimizer::WeightFiles& root,
    const common::ModelWeights::Shapes& shapes,
    const std::function<Status(const common::ModelWeights&)>& read, const at::TensorOptions& flag,
    const std::string& fallback, const std::string& what);

}  // namespace grpo::learner::distributed
