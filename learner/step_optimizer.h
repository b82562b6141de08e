// StepOptimizer: how an optimizer step's gradient becomes every rank's new weights, by `fsdp`
// mode (README "Learner ranks", docs/ARCHITECTURE.md "Sharding"). ReplicatedAdamW (no_shard,
// and every mode at one rank, where sharding is the identity) sums the whole gradient over the
// ranks with an all-reduce and runs AdamW on the whole model on every rank.
// distributed::ShardedAdamW (shard_grad_op, ZeRO-2) keeps 1/world_size of the gradient and of
// AdamW's state on each rank: reduce-scatter during backward, AdamW on the shard, all-gather of
// the weights; beside a compute copy (bf16, or offload) it keeps 1/world_size of the fp32 master
// too, and the master model's parameters hold nothing (ShardsParameters).
// distributed::FullShardAdamW (full_shard, ZeRO-3) keeps 1/world_size of the parameters too: the
// model's units are gathered around each use (common/model/parameter_gate.h) and the parameters
// are whole nowhere between uses (ShardsParameters).
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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/model/model.h"
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
  // Bytes of parameter values resident on this rank now (whole: the model's; full_shard: the
  // rank's fp32 shard and the units gathered now).
  virtual int64_t ResidentParameterBytes() const = 0;

  // --- Parameters sharded over the ranks (full_shard; shard_grad_op's fp32 master beside a
  // compute copy). The others keep the defaults.
  // True when the policy's parameter tensors hold no values between uses: whoever reads or
  // writes the whole weights goes through GatherWeights and LoadWeights.
  virtual bool ShardsParameters() const { return false; }
  // Runs forward(0) .. forward(own - 1), this rank's no-grad forwards of the policy (old
  // log-probs). Sharded: every rank then makes the collectives of `all` forwards (the most any
  // rank runs), joining those it does not run, and each forward's gathered units are released
  // after it. A libtorch error of `forward` propagates.
  virtual Status RunNoGradForwards(int64_t own, int64_t all,
                                   const std::function<void(int64_t)>& forward,
                                   const std::string& where) {
    for (int64_t i = 0; i < own; ++i) forward(i);
    return Status::OK();
  }
  // The first failure of a collective this optimizer made inside a forward or backward, where
  // it could only throw it as c10::Error (full_shard's gate), with its own code (Unavailable,
  // DeadlineExceeded, Aborted); cleared by the call and by ZeroGrad. OK when none.
  virtual Status TakeGateError() { return Status::OK(); }
  // Sharded only (Unimplemented otherwise), collectives: the whole weights (fp32, on the CPU,
  // named and ordered as Model::NamedParameters) on rank 0, or on every rank with
  // `every_rank`; other ranks get an empty list. One unit is gathered at a time.
  virtual StatusOr<common::NamedTensors> GatherWeights(const std::string& what, bool every_rank) {
    (void)what;
    (void)every_rank;
    return Status::Unimplemented("GatherWeights: the parameters are not sharded");
  }
  // As GatherWeights without holding them: each unit's parameters are handed to `put` (on rank
  // 0, or every rank with `every_rank`; fp32 views of the gathered unit, valid during the call)
  // as the unit is gathered, and freed before the next. After a failed `put` this rank puts no
  // more but joins the remaining gathers (the other ranks do not know) and returns that error.
  virtual Status StreamWeights(const std::string& what, bool every_rank,
                               const common::Model::WeightPut& put) {
    (void)what;
    (void)every_rank;
    (void)put;
    return Status::Unimplemented("StreamWeights: the parameters are not sharded");
  }
  // Sharded only (Unimplemented otherwise), no collective: whole weights (every parameter by its
  // name, of its shape; InvalidArgument naming the tensor otherwise, and then nothing changed)
  // into this rank's shard; rank 0 keeps them until SyncFromRankZero hands them out.
  virtual Status LoadWeights(const common::NamedTensors& weights) {
    (void)weights;
    return Status::Unimplemented("LoadWeights: the parameters are not sharded");
  }
  // Sharded only (Unimplemented otherwise), no collective: this rank's shard of the weights in
  // `files` (a checkpoint's, checked against the parameters), read from them, never whole. Rank 0
  // keeps `files` until SyncFromRankZero has every rank that sees the same checkpoint (the
  // SHA-256 of `dir/fingerprint_file` is `fingerprint`) read its own there; if any cannot, rank 0
  // reads the weights a unit at a time and hands each rank its chunk.
  struct WeightFiles {
    std::shared_ptr<const common::ModelWeights> files;
    std::string fingerprint_file, fingerprint;
  };
  virtual Status LoadWeightsFrom(WeightFiles files) {
    (void)files;
    return Status::Unimplemented("LoadWeightsFrom: the parameters are not sharded");
  }

  // --- Per-rank checkpoint shards of a sharded AdamW state (distributed/state_shards.h).
  // A run of one parameter's flattened elements whose AdamW moments this rank holds.
  struct StatePiece {
    std::string param;
    int64_t offset = 0;  // in the parameter, flattened
    int64_t numel = 0;
    at::Tensor moments[2];  // 1-D views of exp_avg, exp_avg_sq in this rank's state (numel)
  };
  // This rank's runs, in a fixed order, when the AdamW state is sharded over the ranks (every
  // element of every parameter in exactly one rank's runs); empty when each rank holds the
  // whole state (then a checkpoint holds it whole, in optimizer.safetensors). The views read
  // and overwrite the live state.
  virtual std::vector<StatePiece> StatePieces() { return {}; }
  // AdamW's step count, after the runs were overwritten from a checkpoint.
  virtual void SetStepCount(int64_t step) { (void)step; }
  // Rank 0: a checkpoint directory of per-rank shard files that GrpoTrainer::SyncFromRankZero
  // hands out (each rank reads its own runs there); empty when none.
  std::string pending_state_shards;
  // Rank 0: a whole optimizer.safetensors of a sharded state (ranks that did not share
  // output_dir when it was saved) that SyncFromRankZero hands out a parameter at a time; empty
  // when none.
  std::string pending_state_file;
};

// Whether the trainer keeps the fp32 master weights (its policy model, their gradient and
// AdamW's state) on the host while a compute copy on `device` runs every forward and backward:
// `offload` beside no_shard or shard_grad_op with the model on a GPU (ZeRO-Offload: the
// optimizer on the host, the parameters whole on the GPU). full_shard offload keeps its shards
// on the host instead (GatesParameters). Tests: TEST_host_master_on_cpu makes the CPU count as a
// device here, the master and its compute copy then both in host memory.
bool HostsMaster(const common::FsdpSpec& fsdp, const at::Device& device);
extern bool TEST_host_master_on_cpu;
// Where the policy is loaded to train on `device`: the host when it is the master there
// (HostsMaster: the GPU never holds it whole in fp32), else `device`.
at::Device MasterHome(const common::FsdpSpec& fsdp, const at::Device& device);

// Whether MakeStepOptimizer's choice for `fsdp` at `world_size` ranks with the model on `device`
// is full_shard's gate (FullShardAdamW: it fills the parameters, a unit at a time): full_shard at
// several ranks, or offload on a GPU. Then a deferred model (Model::LoadDeferred) is read a
// shard a rank; otherwise whole.
bool GatesParameters(const common::FsdpSpec& fsdp, int world_size, const at::Device& device);

// Whether MakeStepOptimizer's choice keeps the fp32 master as each rank's chunks beside a whole
// compute copy on `device` (ShardedAdamW: shard_grad_op at several ranks with `bf16`, or with
// the master on the host, HostsMaster). Then a deferred policy (Model::LoadDeferred) is read
// whole in the compute dtype for the copy and a chunk a rank for the master: no rank holds the
// whole fp32 model.
bool ShardsMasterBesideCopy(const common::FsdpSpec& fsdp, int world_size, bool bf16,
                            const at::Device& device);

// The StepOptimizer of `fsdp` at `ranks`' world size over `params` (borrowed: shared storage,
// the fp32 master with bf16); `compute` are the tensors backward accumulates into, in the same
// order (the bf16 copy's parameters, or `params`' own). full_shard at several ranks shards
// `model` (borrowed, whose parameters `params` are; fp32), sets itself as the parameter gate of
// `compute_model` (borrowed: the bf16 copy whose parameters `compute` are) or, without one, of
// `model`, and is a collective (rank 0's weights are broadcast while they are cut into shards,
// or each rank reads its own from a deferred `model`'s files).
// `offload` with `model` on a GPU: full_shard with its shards on the host, at any world size
// (the one-GPU case included). The other modes offload with the master on the host
// (HostsMaster): `params` and `model` are then host tensors, `compute` the GPU copy's, and the
// gradients' collectives run on the compute copy's device; InvalidArgument for them with a
// master on a GPU.
StatusOr<std::unique_ptr<StepOptimizer>> MakeStepOptimizer(
    const common::FsdpSpec& fsdp, common::NamedTensors params, std::vector<at::Tensor> compute,
    AdamWOptions options, distributed::Collectives* ranks, common::Model* model = nullptr,
    common::Model* compute_model = nullptr);

}  // namespace grpo::learner
