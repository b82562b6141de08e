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
// The parameters themselves stay whole on every rank (full_shard_adamw.h shards them), and so
// does the fp32 master with bf16.
//
// Offload (`fsdp: shard_grad_op offload` on a GPU; ZeRO-Offload): `params` are the fp32 master
// on the host and `compute` the GPU copy's. The buckets are reduce-scattered and all-gathered on
// the GPU (NCCL); each reduced chunk is added into the gradient shard on the host, where the norm
// and AdamW run, and the gathered weights are copied into the host master (the trainer then
// refreshes the GPU copy from it).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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
  // parameter in the same order and shapes (the parameters themselves in fp32); their hooks
  // are removed with the optimizer. `ranks` borrowed, world size >= 1.
  static StatusOr<std::unique_ptr<ShardedAdamW>> Create(common::NamedTensors params,
                                                        std::vector<at::Tensor> compute,
                                                        AdamWOptions options, Collectives* ranks,
                                                        int64_t bucket_bytes);
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
};

}  // namespace grpo::learner::distributed
