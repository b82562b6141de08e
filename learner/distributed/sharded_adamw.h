// ShardedAdamW: `fsdp: shard_grad_op` (ZeRO-2, Rajbhandari et al. 2020) over the learner's
// ranks (docs/ARCHITECTURE.md "Sharding"). The parameters are laid out as consecutive flat
// buckets (at most `bucket_bytes` each, a larger tensor alone) and every bucket is cut into
// world_size equal chunks (the last padded with zeros): rank r owns chunk r of every bucket,
// so each rank holds 1/world_size of the model's gradient and of AdamW's two moments, whatever
// the layer sizes.
//
//  - After this rank's backward of a micro-batch, each bucket's gradient is reduce-scattered
//    (summed over the ranks, each keeping its chunk) and added into the rank's fp32 gradient
//    shard, and the parameters' .grad are freed: between micro-batches and between steps only
//    the shard is resident. Micro-batches are dealt round-robin, so the ranks back-propagate
//    one micro-batch each per round of world_size positions, and reduce-scatter together; a
//    rank with none in a (partial) round joins with zeros at the round's end.
//  - The step: the gradient norm is an all-reduce of the shards' squared norms; AdamW (the
//    same elementwise update as optimizer.h AdamW, with the same state) runs on the owned chunk
//    of the weights, and each bucket's updated chunks are all-gathered into every rank's
//    parameters.
//
// Not yet: the reduce-scatter waits for the end of the micro-batch's backward (the whole
// gradient of one micro-batch exists on each rank until then; FSDP reduces layer by layer
// during backward), and the parameters themselves stay whole on every rank (full_shard).
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
  // InvalidArgument otherwise. `ranks` borrowed, world size >= 1.
  static StatusOr<std::unique_ptr<ShardedAdamW>> Create(common::NamedTensors params,
                                                        AdamWOptions options, Collectives* ranks,
                                                        int64_t bucket_bytes);

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
  int64_t ResidentBytes() const override;

  // Elements of this rank's shard (the sum of its chunks, padding included).
  int64_t shard_numel() const { return shard_numel_; }

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

  ShardedAdamW(common::NamedTensors params, AdamWOptions options, Collectives* ranks);
  // The bucket's elements as one flat buffer of world_size x chunk (zero padding) built from
  // each parameter's `source(i)` (an undefined tensor counts as zeros).
  template <typename Source>
  at::Tensor PackBucket(const Bucket& b, Source source) const;
  // Sums the round's gradients over the ranks into the shard: this rank's .grad (zeros when it
  // back-propagated nothing in the round), then frees .grad.
  Status ReduceRound(const std::string& where);

  common::NamedTensors params_;
  AdamWOptions options_;
  Collectives* ranks_;
  std::vector<Bucket> buckets_;
  int64_t shard_numel_ = 0;
  at::Tensor grad_shard_;  // fp32 [shard_numel_]: the step's summed gradient, this rank's part
  at::Tensor exp_avg_, exp_avg_sq_;  // fp32 [shard_numel_]
  int64_t step_ = 0;
  bool round_reduced_ = false;  // this rank reduce-scattered in the round now open
  // Rank 0 after LoadStateDict: the whole restored state, until SyncFromRankZero hands it out.
  common::NamedTensors pending_;
};

}  // namespace grpo::learner::distributed
