// GatheredUnits: a model's units (Model::NumUnits: the embedding with a tied lm_head, each
// decoder layer, the final norm, an untied lm_head) sharded over the learner's ranks and gathered
// one at a time as the model's ParameterGate: FSDP's flat parameters (docs/ARCHITECTURE.md
// "Sharding"). What full_shard's optimizer (FullShardAdamW: the policy, with its gradient and
// AdamW shards) and the frozen reference model (FrozenShards) share.
//
//  - Each unit is laid out as one flat buffer cut into world_size equal chunks (the last padded
//    with zeros): rank r keeps chunk r of every unit in its weight shard (the sum of its chunks,
//    padding included), in the shard's dtype and on its device (the host with offload).
//  - Between uses a unit's parameter tensors keep their shapes and hold no memory: they are views
//    of the unit's flat buffer (the gated model's dtype and device), whose storage is resized to
//    0 bytes (as FSDP's `untyped_storage().resize_(0)`). Acquire all-gathers the unit's chunks
//    into that storage and Release frees it again.
//  - Prefetch (FSDP's forward and backward prefetch): each use of a unit starts the all-gather
//    of the unit used next (Collectives::AllGatherAsync), so that it runs while this one
//    computes: in a forward the next layer, after the final norm the lm_head; in a backward
//    (the final norm used right after the lm_head) the layer before. So a unit and the next are
//    whole at once. Off, each gather waits.
//  - Every rank makes the same collectives in the same order: a rank that runs fewer no-grad
//    forwards than another joins the rest (RunJoinedForwards), gathering what a forward gathers.
//
// One forward at a time. A failed collective of the gate is thrown as c10::Error whose message is
// the collective's Status (callers return it as Internal); the group is then not used again.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_weights.h"
#include "common/model/parameter_gate.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"

namespace grpo::learner::distributed {

// "the embedding", "layer 3", "the final norm", "the lm_head": a unit in collectives' names.
std::string UnitName(const common::Model& model, int unit);

class GatheredUnits : public common::ParameterGate {
 public:
  ~GatheredUnits() override;  // unsets itself as the model's gate

  // ParameterGate.
  void Acquire(int unit) override;
  void Release(int unit) override;

  // Observations for tests: all-gathers of units so far, and the most units gathered at once.
  int64_t all_gathers() const { return all_gathers_; }
  int64_t prefetches() const { return prefetches_; }
  int max_units_gathered() const { return max_gathered_; }
  // The largest unit's padded size in bytes (what one gathered unit costs).
  int64_t LargestUnitBytes() const;

 protected:
  struct Unit {
    std::vector<size_t> params;    // indices in params_
    std::vector<int64_t> offsets;  // of each in the flat buffer
    int64_t numel = 0;             // the parameters' elements
    int64_t chunk = 0;             // ceil(numel / world_size): one rank's part
    int64_t shard_offset = 0;      // where this rank's chunk starts in the shard buffers
    at::Tensor flat;  // [chunk x world_size], the gated dtype: the gated parameters' storage
    bool gathered = false;
  };

  // `gated` (borrowed): the model whose parameters the units' buffers hold; `ranks` borrowed.
  GatheredUnits(common::Model* gated, Collectives* ranks, bool prefetch);

  // Lays out the gated model's units; returns the weight shard's size in elements.
  int64_t LayOut();
  // Where a model on `device` keeps its shards: `opts` as given, or with `offload` off the CPU
  // in the host's memory, page-locked beside a GPU so that copies to and from it are DMA.
  static at::TensorOptions ShardOptions(const at::TensorOptions& opts, const at::Device& device,
                                        bool offload);
  // A collective: fills weight_shard_ (allocated by the caller, LayOut's size), a unit at a time,
  // from `files` (each rank reads its own chunks: sharded loading) or, without them, from rank
  // 0's `values` (in params_' order, whole on every rank until its unit is cut), broadcast
  // packed in the shard's dtype; makes each unit's gated parameters views of its buffer, frees
  // it, and sets this as the gated model's gate. `what` names the broadcasts.
  Status Shard(const common::ModelWeights* files, const std::vector<at::Tensor>& values,
               const std::string& what);
  // Rank 0's way of loading (from_files: each rank reads its shards from a deferred model's
  // files; else rank 0's weights are broadcast) told to every rank; FailedPrecondition on a rank
  // whose own differs. `who` names the caller in that error.
  Status AgreeOnLoading(bool from_files, const std::string& who);
  // This rank's chunk of the unit read from the files into weight_shard_.
  Status ReadChunk(const Unit& u, const common::ModelWeights& files);
  // The unit's elements from `source(i)` for each of its parameters (undefined = zeros) as one
  // flat buffer of chunk x world_size, zero padded.
  template <typename Source>
  at::Tensor Pack(const Unit& u, Source source, const at::TensorOptions& options) const {
    at::Tensor flat = at::zeros({u.chunk * ranks_->world_size()}, options);
    for (size_t k = 0; k < u.params.size(); ++k) {
      const at::Tensor t = source(u.params[k]);
      if (!t.defined()) continue;
      flat.narrow(0, u.offsets[k], t.numel()).copy_(t.reshape({-1}));
    }
    return flat;
  }

  // The gate's (and the joins') acquisition: the unit's values here (at once, or the prefetch of
  // it waited for; nothing if held), then the next unit's gather started so that it runs while
  // this one computes.
  Status Use(int unit, const std::string& what);
  void Free(int unit);
  void ReleaseAll();
  // The collectives of one no-grad forward this rank does not run.
  Status JoinNoGradForward(const std::string& where);
  // `forward(i)` for i < own, each one's gathered units released after it, then the collectives
  // of `all - own` forwards joined: every rank makes those of `all` (the most any rank runs).
  Status RunJoinedForwards(int64_t own, int64_t all, const std::function<void(int64_t)>& forward,
                           const std::string& where);
  // Throws the first error of the gate's collectives as c10::Error (the gate cannot return one).
  void ThrowIfFailed(const Status& s);
  Status TakeError();

  common::Model* model_;         // the gated one
  common::NamedTensors params_;  // model_'s, in NamedParameters' order
  Collectives* ranks_;
  std::vector<Unit> units_;
  std::string where_;  // names the gate's collectives of the forward or backward running now
  Status error_;       // the first failure of the gate's collectives since the last check
  at::TensorOptions device_opts_;  // fp32 on the gated model's device
  // This rank's chunks (padding included): on the model's device, or the host with offload.
  at::Tensor weight_shard_;

 private:
  // The unit's storage back, counted as gathered.
  void Allocate(int unit);
  // This rank's chunk of the unit as its all-gather sends it: on the gated model's device, in
  // its dtype.
  at::Tensor ChunkToSend(const Unit& u) const;
  Status Gather(int unit, const std::string& what);
  // The unit a forward or backward uses after `unit` (used after `last`), or -1.
  int NextUnit(int unit, int last) const;
  Status StartPrefetch(int unit, const std::string& what);
  Status FinishPrefetch();

  // The all-gather started ahead of its use (at most one), with the chunk it sends.
  struct Prefetch {
    int unit = -1;
    at::Tensor input;
    std::unique_ptr<PendingCollective> pending;
  };
  Prefetch prefetch_;
  int last_used_ = -1;           // the unit Use took last since the last ReleaseAll
  bool backward_order_ = false;  // the uses go the final norm, then the layers last to first
  bool prefetch_on_ = true;
  int64_t prefetches_ = 0;
  int64_t all_gathers_ = 0;
  int gathered_now_ = 0, max_gathered_ = 0;
};

}  // namespace grpo::learner::distributed
