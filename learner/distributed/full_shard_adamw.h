// FullShardAdamW: `fsdp: full_shard` (ZeRO-3, Rajbhandari et al. 2020; PyTorch's FSDP) over the
// learner's ranks (docs/ARCHITECTURE.md "Sharding"). The model's units (Model::NumUnits: the
// embedding with a tied lm_head, each decoder layer, the final norm, an untied lm_head) are each
// laid out as one flat buffer cut into world_size equal chunks (the last padded with zeros): rank
// r keeps chunk r of every unit as its fp32 master weights, with the gradient and AdamW's two
// moments for it, so each rank holds 1/world_size of the whole model state plus padding.
//
//  - Between uses a unit's parameter tensors keep their shapes and hold no memory: they are views
//    of the unit's flat buffer, whose storage is resized to 0 bytes (as FSDP's
//    `untyped_storage().resize_(0)`). As the model's ParameterGate, Acquire all-gathers the
//    unit's chunks into that storage and Release frees it again: ForwardHidden gathers one unit
//    at a time (the embedding, each layer, the final norm) and LmHeadWeight the lm_head's, which
//    stays gathered until the end of the micro-batch's backward (its backward needs it).
//  - Backward gathers each decoder layer and the final norm again, once, also when gradient
//    checkpointing recomputes the layer from that same gather; the model differentiates the unit
//    and hands its gradient to TakeGradients, which reduce-scatters it at once (one flat buffer
//    per unit) into this rank's gradient shard. The embedding's and lm_head's gradients, which
//    autograd accumulates into .grad, are reduce-scattered after the backward (AfterBackward).
//  - Prefetch (FSDP's forward and backward prefetch): each use of a unit starts the all-gather
//    of the unit used next (Collectives::AllGatherAsync), so that it runs while this one
//    computes: in a forward the next layer, after the final norm the lm_head; in a backward
//    (the final norm used right after the lm_head) the layer before. The first gather of each
//    pass and the backward's first (the final norm) are not ahead of their use. So a unit and
//    the next are whole at once, and during a backward with the lm_head: three units. Off
//    (`fsdp_prefetch: false`), each gather waits and at most two units are whole.
//  - Every rank makes the same collectives in the same order: a micro-batch's are those of one
//    forward and backward, whatever its data; micro-batches are dealt round-robin and a rank
//    with none in a (partial) round joins the round's collectives with zeros at its end, as
//    ShardedAdamW does; no-grad forwards are joined the same way (RunNoGradForwards).
//  - The step: the gradient norm is an all-reduce of the shards' squared norms, and AdamW
//    (optimizer.h AdamWUpdate) updates the rank's chunk of each unit in place. Nothing is
//    all-gathered after the step: the next forward gathers the new weights.
//
// Mixed precision (`bf16`, as FSDP's MixedPrecision with param_dtype bf16 and reduce_dtype
// fp32): the gate sits on the bf16 compute copy. The shards stay the fp32 master weights; a
// gather casts this rank's chunk to bf16 and all-gathers that (half the bytes), the unit's bf16
// gradient is reduce-scattered in fp32 into the fp32 gradient shard, and the master model's
// parameters hold no memory at all: GatherWeights gathers the fp32 values. No bf16 copy lives
// between uses, so the model state per rank is the fp32 case's.
//
// Offload (`fsdp: full_shard offload` on a GPU; ZeRO-Offload's optimizer on the host, with
// ZeRO-3's parameters): the four shards live in page-locked host memory. A gather copies this
// rank's chunk to the GPU (cast to the compute dtype) and all-gathers it there; a gradient is
// reduce-scattered on the GPU and its chunk added to the host's gradient shard; the norm and
// AdamW run on the host. The GPU holds no model state between uses, only the units gathered for
// the micro-batch running. At one rank this is the one-GPU ZeRO-Offload: the trainer uses it
// for `offload` whatever the world size.
//
// One forward at a time. A failed collective of the gate is thrown as c10::Error whose message
// is the collective's Status (the trainer returns it as Internal); the group is then not used
// again.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/safetensors.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"
#include "learner/distributed/gathered_units.h"
#include "learner/optimizer.h"
#include "learner/step_optimizer.h"

namespace grpo::learner::distributed {

class FullShardAdamW final : public StepOptimizer, public GatheredUnits {
 public:
  // Shards `model` (borrowed; fp32, contiguous parameters on one device: InvalidArgument
  // otherwise) over `ranks` (borrowed) and sets itself as the gate of the model that computes:
  // `compute` (borrowed: `model`'s lower-precision copy, the same parameters in one floating
  // dtype) when given, else `model` (unset when destroyed, the parameters then left without
  // values). A collective: every rank's shard is cut from rank 0's weights, or, when `model`
  // is deferred (Model::LoadDeferred, on every rank), read by each rank from the model's files:
  // its own chunk of each unit, the whole model nowhere (sharded loading).
  // With `offload` and the model on a GPU, the shards (fp32 master, gradient, AdamW's moments)
  // live in page-locked host memory and AdamW steps there (on the CPU `offload` changes nothing).
  static StatusOr<std::unique_ptr<FullShardAdamW>> Create(common::Model* model,
                                                          AdamWOptions options, Collectives* ranks,
                                                          common::Model* compute = nullptr,
                                                          bool offload = false,
                                                          bool prefetch = true);
  ~FullShardAdamW() override;

  // StepOptimizer.
  void BeforeBackward(const std::string& where) override;
  Status AfterBackward(const std::string& where) override;
  Status AfterMicroBatch(int64_t position, const std::string& where) override;
  Status ReduceGradients(int64_t micro_batches, const std::string& where) override;
  void ScaleGradients(double scale) override;
  StatusOr<double> ClipGradNorm(double max_norm, const std::string& where) override;
  Status Step(double lr, const std::string& where) override;
  void ZeroGrad() override;
  int64_t step_count() const override { return step_; }
  StatusOr<common::NamedTensors> StateDict(const std::string& what) override;
  Status LoadStateDict(const common::NamedTensors& state) override;
  Status SyncFromRankZero(const std::string& what) override;
  std::vector<StatePiece> StatePieces() override;
  void SetStepCount(int64_t step) override { step_ = step; }
  int64_t ResidentBytes() const override;
  int64_t ResidentParameterBytes() const override;
  bool ShardsParameters() const override { return true; }
  Status RunNoGradForwards(int64_t own, int64_t all, const std::function<void(int64_t)>& forward,
                           const std::string& where) override;
  Status TakeGateError() override { return TakeError(); }
  StatusOr<common::NamedTensors> GatherWeights(const std::string& what, bool every_rank) override;
  Status StreamWeights(const std::string& what, bool every_rank,
                       const common::Model::WeightPut& put) override;
  Status LoadWeights(const common::NamedTensors& weights) override;
  Status LoadWeightsFrom(WeightFiles files) override;

  // ParameterGate (Acquire and Release: GatheredUnits').
  void TakeGradients(int unit, const std::vector<at::Tensor>& grads) override;

 private:
  FullShardAdamW(common::Model* model, AdamWOptions options, Collectives* ranks, bool prefetch);
  // SyncFromRankZero's part for a checkpoint rank 0 restored from its files (LoadWeightsFrom):
  // every rank that sees the same checkpoint reads its own chunks there; if any does not, rank 0
  // reads the weights a unit at a time and hands each rank its chunk.
  Status HandOutWeightFiles(const std::string& what);
  // Rank 0's values of every parameter, `fill(i, into)` of params_[i] into its place in its
  // unit's flat buffer (rank 0 only), broadcast a unit at a time; each rank keeps its chunk of
  // each in `shard`.
  using Fill = std::function<Status(size_t i, at::Tensor& into)>;
  Status HandOut(at::Tensor& shard, const Fill& fill, const std::string& what);
  // Sums `flat` (chunk x world_size, this rank's contribution) over the ranks into this rank's
  // gradient shard.
  Status ReduceScatter(int unit, const at::Tensor& flat, const std::string& what);
  // The units whose gradient autograd leaves in .grad (the embedding's, the untied lm_head's),
  // in the fixed order they are reduced after a backward.
  std::vector<int> AutogradUnits() const;
  // Reduce-scatters the embedding's and lm_head's gradients from .grad (zeros with `zeros`) and
  // releases every unit: the end of a micro-batch's backward.
  Status FinishBackward(bool zeros);
  // The collectives of one training micro-batch this rank does not run, with zero gradients.
  Status JoinMicroBatch(const std::string& where);
  // The round of world_size positions is over: JoinMicroBatch unless this rank's backward ran.
  Status EndRound(const std::string& where);
  // model_ (GatheredUnits'): the compute copy, or the fp32 model itself; weight_shard_ the fp32
  // master weights; device_opts_ the gradients' before their reduce.
  AdamWOptions options_;
  std::vector<int> backward_units_;  // TakeGradients per unit in the running backward
  bool round_reduced_ = false;       // this rank ran a backward in the round now open
  // fp32, beside weight_shard_ and laid out as it: the step's summed gradient, AdamW's moments.
  at::Tensor grad_shard_, exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
  // Rank 0 after LoadStateDict / LoadWeights: the whole restored state and weights, until
  // SyncFromRankZero hands them out.
  common::NamedTensors pending_state_, pending_weights_;
  // Rank 0 after LoadWeightsFrom: the checkpoint's files, until SyncFromRankZero.
  WeightFiles pending_files_;
};

}  // namespace grpo::learner::distributed
