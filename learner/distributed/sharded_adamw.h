// ShardedAdamW: `fsdp: shard_grad_op` (ZeRO-2, Rajbhandari et al. 2020) over the learner's
// ranks (docs/ARCHITECTURE.md "Sharding"). The parameters are laid out as consecutive flat
// buckets (at most `bucket_bytes` each, a larger tensor alone) and every bucket is cut into
// world_size equal chunks (the last padded with zeros): rank r owns chunk r of every bucket,
// so each rank holds 1/world_size of the model's gradient and of AdamW's two moments, whatever
// the layer sizes.
//
//  - During this rank's backward of a micro-batch, each parameter's gradient is moved, as soon
//    as autograd has accumulated it (a post-accumulate-grad hook on the tensor backward writes:
//    the bf16 copy's with bf16), into its bucket's flat fp32 buffer and its .grad freed; a
//    bucket whose gradients are all there is reduce-scattered at once (summed over the ranks,
//    each keeping its chunk, added into the rank's fp32 gradient shard) and its buffer freed.
//    Buckets are reduced in one fixed order, last to first (backward's order: the first
//    layers' gradients come last), so every rank makes the same collectives in the same order;
//    a bucket still incomplete (a parameter without a gradient) waits, and the end of the
//    backward reduces the rest. So the whole gradient never exists: a few buckets at a time.
//    Micro-batches are dealt round-robin, so the ranks back-propagate one micro-batch each per
//    round of world_size positions, and reduce-scatter together; a rank with none in a
//    (partial) round joins with zeros at the round's end.
//  - The step: the gradient norm is an all-reduce of the shards' squared norms; AdamW (the
//    same elementwise update as optimizer.h AdamW, with the same state) runs on the owned chunk
//    of the weights, and each bucket's updated chunks are all-gathered into every rank's
//    parameters.
//
// The parameters themselves stay whole on every rank (full_shard_adamw.h shards them).
//
// The fp32 master (ZeRO-2 with mixed precision, and ZeRO-Offload's partitioned optimizer) is
// sharded too whenever the compute tensors are not the parameters themselves: with `bf16` (a
// bf16 compute copy) and with the master on the host (offload on a GPU, step_optimizer.h
// HostsMaster). Each rank then keeps its chunk of every bucket of the fp32 weights beside its
// gradient and moments (16 bytes a parameter over the ranks), and the whole weights exist only
// in the compute copy: Create cuts the chunks from rank 0's weights (a collective: a bucket at
// a time, the compute copy filled from the same broadcast) and frees the master model's
// parameters, which keep their names and shapes and no memory (ShardsParameters: checkpoints
// and publishing gather the fp32 values a bucket at a time). The step updates the rank's chunk
// in place and all-gathers it in the compute dtype straight into the compute copy (bf16: half
// the bytes). A restore reads each rank's chunks from the checkpoint's files where the rank
// sees them (seen_checkpoint.h) and gathers the compute copies the same way; rank 0 broadcasts
// the weights a bucket at a time only to ranks that do not. Without either (fp32, no offload) the
// parameters are the compute tensors: whole on every rank, as ZeRO-2 keeps them.
//
// Offload (`fsdp: shard_grad_op offload` on a GPU; ZeRO-Offload): the master shard, the
// gradient shard and the moments live in page-locked host memory and `compute` is the GPU copy.
// The buckets are reduce-scattered and all-gathered on the GPU (NCCL); each reduced chunk is
// added into the gradient shard on the host, where the norm and AdamW run, and the updated
// chunk crosses to the GPU to be all-gathered into the copy.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_weights.h"
#include "common/model/safetensors.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"
#include "learner/optimizer.h"
#include "learner/step_optimizer.h"

namespace grpo::learner::distributed {

class ShardedAdamW final : public StepOptimizer {
 public:
  // `params` borrowed (shared storage), contiguous, of one floating dtype and device;
  // InvalidArgument otherwise. `compute`: the tensors backward accumulates into, one per
  // parameter in the same order and shapes: the parameters themselves (fp32 on the device), or
  // all of them another model's (a compute copy), and then the master is sharded (above): a
  // collective, after which `params` hold no memory. Their hooks are removed with the
  // optimizer. `ranks` borrowed, world size >= 1.
  // With the master sharded and `files` (a deferred policy's: Model::TakeDeferredWeights) each
  // rank reads its own chunks there, and its compute copy holds the weights already (every rank
  // must load the same way: FailedPrecondition otherwise); without, they are cut from rank 0's.
  static StatusOr<std::unique_ptr<ShardedAdamW>> Create(
      common::NamedTensors params, std::vector<at::Tensor> compute, AdamWOptions options,
      Collectives* ranks, int64_t bucket_bytes,
      std::shared_ptr<const common::ModelWeights> files = nullptr);
  ~ShardedAdamW() override;

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
  // With the master sharded (a compute copy): the fp32 weights are gathered a bucket at a time.
  bool ShardsParameters() const override { return master_.defined(); }
  StatusOr<common::NamedTensors> GatherWeights(const std::string& what, bool every_rank) override;
  Status StreamWeights(const std::string& what, bool every_rank,
                       const common::Model::WeightPut& put) override;
  Status LoadWeightsFrom(WeightFiles files) override;

 private:
  // A run of one parameter's elements inside this rank's chunk of a bucket.
  struct Piece {
    size_t param = 0;
    int64_t param_offset = 0;  // in the parameter, flattened
    int64_t chunk_offset = 0;  // in the chunk
    int64_t numel = 0;
  };
  struct Bucket {
    size_t first = 0, last = 0;          // parameters [first, last)
    int64_t numel = 0;                   // their elements
    int64_t chunk = 0;                   // ceil(numel / world_size): one rank's part
    int64_t shard_offset = 0;            // where this rank's chunk starts in the shard buffers
    std::vector<int64_t> param_offsets;  // of each parameter in the bucket, flattened
    std::vector<Piece> mine;             // this rank's chunk, piece by piece
  };

  // A bucket's state in the round being reduced.
  struct Pending {
    at::Tensor flat;     // world_size x chunk, fp32: its gradients so far (undefined: none yet)
    size_t arrived = 0;  // parameters whose gradient is in `flat`
    bool reduced = false;
  };
  class GradientReady;  // the post-accumulate-grad hook of one compute tensor

  ShardedAdamW(common::NamedTensors params, std::vector<at::Tensor> compute, AdamWOptions options,
               Collectives* ranks);
  // The hook: moves compute_[i]'s .grad into its bucket, frees it, reduces what is ready.
  void OnGradientReady(size_t i);
  // Reduce-scatters buckets from next_bucket_ down: those complete, or all with `all`.
  void ReduceReadyBuckets(bool all);
  // The bucket's elements as one flat buffer of world_size x chunk (zero padding) built from
  // each parameter's `source(i)` (an undefined tensor counts as zeros).
  template <typename Source>
  at::Tensor PackBucket(const Bucket& b, Source source) const;
  // Rank 0's fp32 value of parameter i into `into` (its place in a host flat buffer).
  using Fill = std::function<Status(size_t i, at::Tensor& into)>;
  // A collective, with the master sharded: rank 0's weights (`fill`, called on rank 0 alone)
  // broadcast a bucket at a time; each rank keeps its chunk in master_ and the whole bucket in
  // the compute copy. After a failed `fill` rank 0 broadcasts zeros for the rest (the others do
  // not know) and returns that error.
  Status HandOutWeights(const Fill& fill, const std::string& what);
  // A collective: rank 0's way of loading (from files, or broadcast) told to every rank;
  // FailedPrecondition on a rank whose own differs.
  Status AgreeOnLoading(bool from_files);
  // With the master sharded: this rank's chunks of every bucket, read from `files` (never whole).
  Status ReadMyChunks(const common::ModelWeights& files);
  // Every rank's `chunk` of bucket b (this rank's, fp32) all-gathered into every rank's
  // parameters, or with the master sharded into the compute copy, in its dtype (on the compute
  // device).
  Status GatherBucket(const Bucket& b, const at::Tensor& chunk, const std::string& what);
  // A collective, with the master sharded: every bucket's chunks into every compute copy.
  Status GatherComputeCopy(const std::string& what);
  // A collective, in SyncFromRankZero after rank 0's LoadWeightsFrom: each rank that sees
  // rank 0's checkpoint reads its chunks there and the compute copies are gathered from them;
  // if any rank does not, rank 0 reads the weights and broadcasts them a bucket at a time.
  Status HandOutWeightFiles(const std::string& what);
  // The bucket's values from `fill` as one host flat buffer of world_size x chunk.
  StatusOr<at::Tensor> FillBucket(const Bucket& b, const Fill& fill) const;
  // This rank's chunk of the bucket `flat` (whole: world_size x chunk) into master_, and the
  // whole of it into the compute copy.
  void TakeBucket(const Bucket& b, const at::Tensor& flat);
  // Ends the round: reduces every bucket not reduced yet (zeros for a rank that back-propagated
  // nothing in it); the first error of any of the round's collectives.
  Status ReduceRound(const std::string& where);
  // The round of world_size positions is over: ReduceRound unless this rank's backward did.
  Status EndRound(const std::string& where);
  void ResetRound();

  common::NamedTensors params_;
  std::vector<at::Tensor> compute_;
  AdamWOptions options_;
  Collectives* ranks_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // parameter -> bucket
  std::vector<Pending> pending_round_;
  std::vector<bool> arrived_;  // parameter's gradient in its bucket this round
  int64_t next_bucket_ = -1;   // the next bucket to reduce (they go last to first)
  std::string where_;          // names the collectives of the backward running now
  Status round_error_;         // the first failure of a collective in the round
  // fp32, the sum of this rank's chunks (padding included): the step's summed gradient, this
  // rank's part, and AdamW's moments for it.
  at::Tensor grad_shard_;
  at::Tensor exp_avg_, exp_avg_sq_;
  // fp32 on the compute tensors' device: the buckets of the reduce-scatters and all-gathers (on
  // the GPU beside a master on the host, step_optimizer.h HostsMaster).
  at::TensorOptions comm_;
  int64_t step_ = 0;
  bool round_reduced_ = false;  // this rank reduce-scattered in the round now open
  // Rank 0 after LoadStateDict: the whole restored state, until SyncFromRankZero hands it out.
  common::NamedTensors pending_;
  // With the master sharded: this rank's fp32 chunks of the weights, laid out as grad_shard_
  // (undefined otherwise: the parameters are whole); the compute copy's dtype on its device,
  // in which the step all-gathers the weights.
  at::Tensor master_;
  at::TensorOptions gather_;
  // Rank 0 after LoadWeightsFrom (several ranks): the checkpoint's files, until
  // SyncFromRankZero has the other ranks read their chunks there (HandOutWeightFiles).
  WeightFiles pending_files_;
};

}  // namespace grpo::learner::distributed
