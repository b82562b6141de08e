// StepOptimizer: how an optimizer step's gradient becomes every rank's new weights, by `fsdp`
// mode (README "Learner ranks", docs/ARCHITECTURE.md "Sharding"). ReplicatedAdamW (no_shard,
// and every mode at one rank, where sharding is the identity) sums the whole gradient over the
// ranks with an all-reduce and runs AdamW on the whole model on every rank.
// distributed::ShardedAdamW (shard_grad_op, ZeRO-2) keeps 1/world_size of the gradient and of
// AdamW's state on each rank: reduce-scatter during backward, AdamW on the shard, all-gather of
// the weights.
//
// The trainer's calls, in order, per step: ZeroGrad; for each micro-batch position of the step
// (on every rank, whichever rank back-propagates it) BeforeBackward and AfterBackward around the
// backward on the rank that runs it, then
// AfterMicroBatch everywhere; then ReduceGradients, ScaleGradients, ClipGradNorm, Step. Every
// call that takes `where` or `what` may run a collective and must then be made on every rank;
// a failed collective's Status names it: the implementation's collective followed by `where`
// ("all-reduce of the gradients" + " of step 3"), or `what` whole.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/model/safetensors.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"
#include "learner/optimizer.h"

namespace grpo::learner {

class StepOptimizer {
 public:
  virtual ~StepOptimizer() = default;

  // This rank is about to back-propagate a micro-batch (collectives may run during it).
  virtual void BeforeBackward(const std::string& where) = 0;
  // This rank's backward of a micro-batch is done: its gradient is in the parameters' .grad, or
  // already reduced (sharded).
  virtual Status AfterBackward(const std::string& where) = 0;
  // Micro-batch `position` (1-based) of the open step is done, here or on another rank.
  virtual Status AfterMicroBatch(int64_t position, const std::string& where) = 0;
  // The step (of `micro_batches` positions) is complete: sums what is not summed yet.
  virtual Status ReduceGradients(int64_t micro_batches, const std::string& where) = 0;
  // Multiplies the step's summed gradient by `scale`.
  virtual void ScaleGradients(double scale) = 0;
  // The summed gradient's L2 norm over the whole model; clips it as torch's clip_grad_norm_
  // does when max_norm > 0 (optimizer.h ClipGradNorm).
  virtual StatusOr<double> ClipGradNorm(double max_norm, const std::string& where) = 0;
  // AdamW with learning rate `lr`; every rank's parameters hold the new weights after.
  virtual Status Step(double lr, const std::string& where) = 0;
  // Drops the open step's gradient (all of it; no collective).
  virtual void ZeroGrad() = 0;
  virtual int64_t step_count() const = 0;

  // The whole state named as AdamW::StateDict ("exp_avg.<param>", "exp_avg_sq.<param>",
  // "step"), on rank 0; other ranks get an empty list. Sharded: a collective (every rank calls
  // it) that assembles the whole state on rank 0 for the checkpoint.
  virtual StatusOr<common::NamedTensors> StateDict(const std::string& what) = 0;
  // Restores a whole state (StateDict's output) on this rank alone; InvalidArgument naming the
  // tensor on a missing name or a shape mismatch, and then nothing changed. Sharded: this rank
  // keeps its shard, and rank 0 the whole state until SyncFromRankZero hands it out.
  virtual Status LoadStateDict(const common::NamedTensors& state) = 0;
  // Rank 0's optimizer state into every rank's (at start, and after rank 0 restored a
  // checkpoint). Sharded: each rank takes its shard of a state rank 0 restored; without one,
  // each rank's shard is already its own.
  virtual Status SyncFromRankZero(const std::string& what) = 0;

  // Bytes of gradient and AdamW state resident on this rank now (the benchmark's model state,
  // less the parameters).
  virtual int64_t ResidentBytes() const = 0;
};

// The StepOptimizer of `fsdp` at `ranks`' world size over `params` (borrowed: shared storage,
// the fp32 master with bf16); `compute` are the tensors backward accumulates into, in the same
// order (the bf16 copy's parameters, or `params`' own). Unimplemented for full_shard at several
// ranks (not built yet).
StatusOr<std::unique_ptr<StepOptimizer>> MakeStepOptimizer(const common::FsdpSpec& fsdp,
                                                           common::NamedTensors params,
                                                           std::vector<at::Tensor> compute,
                                                           AdamWOptions options,
                                                           distributed::Collectives* ranks);

}  // namespace grpo::learner
