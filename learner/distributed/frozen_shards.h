// FrozenShards: the reference model (beta != 0) under full_shard (docs/ARCHITECTURE.md
// "Sharding"), as DeepSpeed's ZeRO-3 shards a frozen model: the policy's layout (GatheredUnits),
// each rank keeping 1/world_size of every unit in the reference's own dtype (the compute dtype:
// bf16 with `bf16`), one unit gathered at a time for the no-grad forwards of the reference
// log-probs. Nothing is trained: no gradient, no optimizer state. With `offload` and the model on
// a GPU the shard lives in page-locked host memory, each chunk copied to the GPU for its gather.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"
#include "learner/distributed/gathered_units.h"

namespace grpo::learner::distributed {

class FrozenShards final : public GatheredUnits {
 public:
  // A collective over `ranks` (borrowed). `model` (borrowed, the reference): contiguous
  // parameters of one floating dtype on one device, whole on every rank (rank 0's values are
  // broadcast, a unit at a time, and each rank keeps its chunk) or deferred on every rank
  // (Model::LoadDeferred: each rank reads only its own chunks from the files); InvalidArgument
  // otherwise, FailedPrecondition when the ranks load it differently. Sets itself as the
  // model's gate: its tensors hold no values between uses, and the model's forwards must run
  // through RunNoGradForwards.
  static StatusOr<std::unique_ptr<FrozenShards>> Create(common::Model* model, Collectives* ranks,
                                                        bool offload, bool prefetch);

  // `forward(i)` for i < own (each a no-grad forward of the reference), then the collectives of
  // `all - own` more: every rank passes the same `all`. A failed collective: its Status; a
  // libtorch error of `forward` propagates.
  Status RunNoGradForwards(int64_t own, int64_t all, const std::function<void(int64_t)>& forward,
                           const std::string& where) {
    return RunJoinedForwards(own, all, forward, where);
  }

  // ParameterGate: a backward through the frozen reference is a bug; throws c10::Error.
  void TakeGradients(int unit, const std::vector<at::Tensor>& grads) override;

  // Bytes the reference holds on this rank between uses: its shard (on the host with offload).
  int64_t ShardBytes() const { return static_cast<int64_t>(weight_shard_.nbytes()); }

 private:
  FrozenShards(common::Model* model, Collectives* ranks, bool prefetch)
      : GatheredUnits(model, ranks, prefetch) {}
};

}  // namespace grpo::learner::distributed
