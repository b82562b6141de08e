#include "learner/distributed/gathered_units.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <unordered_map>
#include <utility>

namespace grpo::learner::distributed {

namespace {

// Gives the storage behind `t` `bytes` bytes (fresh, uninitialised), or frees it with 0: the
// tensors that view it keep their shapes (FSDP's untyped_storage().resize_()).
void ResizeStorage(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == bytes) return;
  TORCH_CHECK(s->allocator() != nullptr, "full_shard: a unit's storage has no allocator");
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

}  // namespace

std::string UnitName(const common::Model& model, int unit) {
  if (unit == 0) return "the embedding";
  if (unit == model.NormUnit()) return "the final norm";
  if (unit == model.LmHeadUnit()) return "the lm_head";
  return "layer " + std::to_string(unit - 1);
}

GatheredUnits::GatheredUnits(common::Model* gated, Collectives* ranks, bool prefetch)
    : model_(gated),
      params_(gated->NamedParameters()),
      ranks_(ranks),
      device_opts_(at::TensorOptions().dtype(at::kFloat).device(gated->device())),
      prefetch_on_(prefetch) {}

GatheredUnits::~GatheredUnits() {
  if (model_->parameter_gate() == this) model_->SetParameterGate(nullptr);
}

int64_t GatheredUnits::LayOut() {
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].first] = i;
  const int64_t world = ranks_->world_size();
  int64_t shard_numel = 0;
  for (int u = 0; u < model_->NumUnits(); ++u) {
    Unit unit;
    for (const auto& [name, p] : model_->UnitParameters(u)) {
      unit.params.push_back(index.at(name));
      unit.offsets.push_back(unit.numel);
      unit.numel += p.numel();
    }
    unit.chunk = (unit.numel + world - 1) / world;
    unit.shard_offset = shard_numel;
    shard_numel += unit.chunk;
    units_.push_back(std::move(unit));
  }
  return shard_numel;
}

at::TensorOptions GatheredUnits::ShardOptions(const at::TensorOptions& opts,
                                              const at::Device& device, bool offload) {
  if (!offload || device.is_cpu()) return opts;
  return opts.device(at::kCPU).pinned_memory(device.is_cuda());
}

Status GatheredUnits::Shard(const common::ModelWeights* files,
                            const std::vector<at::Tensor>& values, const std::string& what) {
  at::NoGradGuard no_grad;
  const int64_t world = ranks_->world_size();
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    Unit& unit = units_[u];
    if (files != nullptr) {
      RETURN_IF_ERROR(ReadChunk(unit, *files));
    } else {
      // Rank 0's values of the unit, whole on every rank for a moment; each keeps its chunk.
      std::vector<at::Tensor> flat = {Pack(
          unit, [&](size_t i) { return values[i]; }, weight_shard_.options())};
      RETURN_IF_ERROR(ranks_->Broadcast(
          flat, "broadcast of rank 0's weights (" + UnitName(*model_, u) + ") for " + what));
      weight_shard_.narrow(0, unit.shard_offset, unit.chunk)
          .copy_(flat[0].narrow(0, ranks_->rank() * unit.chunk, unit.chunk));
    }
    // The gated parameters become views of the unit's buffer (each keeps its own version
    // counter: set_data keeps the tensor's), whose storage is then freed.
    unit.flat = at::empty({unit.chunk * world}, params_.front().second.options());
    for (size_t k = 0; k < unit.params.size(); ++k) {
      at::Tensor& p = params_[unit.params[k]].second;
      p.set_data(unit.flat.narrow(0, unit.offsets[k], p.numel()).view(p.sizes()));
    }
    Free(u);
  }
  model_->SetParameterGate(this);
  return Status::OK();
}

Status GatheredUnits::AgreeOnLoading(bool from_files, const std::string& who) {
  // Rank 0 says how it loads; a rank that loads otherwise would wait in collectives the others
  // never make.
  std::vector<at::Tensor> said = {at::full({1}, from_files ? 1.0 : 0.0, device_opts_)};
  RETURN_IF_ERROR(ranks_->Broadcast(said, "broadcast of how rank 0 loads " + who));
  if ((said[0].item<double>() != 0) != from_files) {
    return Status::FailedPrecondition(
        "full_shard: rank " + std::to_string(ranks_->rank()) +
        (from_files ? " reads its shards of " + who +
                          " from the model's files, but rank 0 broadcasts its weights"
                    : " waits for rank 0's weights of " + who +
                          ", but rank 0 reads its shards from the model's files") +
        " (every rank must load the model the same way: model_name_or_path on each)");
  }
  return Status::OK();
}

Status GatheredUnits::ReadChunk(const Unit& u, const common::ModelWeights& files) {
  // This rank's elements of the unit's flat layout, [lo, hi): of each parameter the part that
  // falls in it, read from the files into its place in the shard (the padding stays zero).
  const int64_t lo = ranks_->rank() * u.chunk, hi = lo + u.chunk;
  for (size_t k = 0; k < u.params.size(); ++k) {
    const auto& [name, p] = params_[u.params[k]];
    const int64_t begin = std::max(lo, u.offsets[k]);
    const int64_t end = std::min(hi, u.offsets[k] + p.numel());
    if (begin >= end) continue;
    at::Tensor into = weight_shard_.narrow(0, u.shard_offset + (begin - lo), end - begin);
    RETURN_IF_ERROR(files.ReadRange(name, begin - u.offsets[k], into));
  }
  return Status::OK();
}

at::Tensor GatheredUnits::ChunkToSend(const Unit& u) const {
  // This rank's chunk on the model's device (from the host with offload), in the dtype that
  // computes (bf16: half the bytes to send).
  return weight_shard_.narrow(0, u.shard_offset, u.chunk).to(u.flat.device(), u.flat.scalar_type());
}

void GatheredUnits::Allocate(int unit) {
  Unit& u = units_[unit];
  ResizeStorage(u.flat, static_cast<size_t>(u.flat.numel()) * u.flat.element_size());
  u.gathered = true;
  max_gathered_ = std::max(max_gathered_, ++gathered_now_);
  ++all_gathers_;
}

Status GatheredUnits::Gather(int unit, const std::string& what) {
  Unit& u = units_[unit];
  if (prefetch_.unit == unit) return FinishPrefetch();
  if (u.gathered) return Status::OK();
  at::NoGradGuard no_grad;
  Allocate(unit);
  return ranks_->AllGather(ChunkToSend(u), u.flat,
                           "all-gather of " + UnitName(*model_, unit) + what);
}

Status GatheredUnits::StartPrefetch(int unit, const std::string& what) {
  Unit& u = units_[unit];
  at::NoGradGuard no_grad;
  Allocate(unit);
  prefetch_.unit = unit;
  prefetch_.input = ChunkToSend(u);
  prefetch_.pending = ranks_->AllGatherAsync(
      prefetch_.input, u.flat, "all-gather of " + UnitName(*model_, unit) + " (prefetched)" + what);
  ++prefetches_;
  return Status::OK();
}

Status GatheredUnits::FinishPrefetch() {
  if (prefetch_.unit < 0) return Status::OK();
  Prefetch done = std::move(prefetch_);
  prefetch_ = Prefetch{};
  return done.pending->Wait();
}

int GatheredUnits::NextUnit(int unit, int last) const {
  const int norm = model_->NormUnit(), head = model_->LmHeadUnit();
  if (backward_order_) return unit > model_->LayerUnit(0) && unit <= norm ? unit - 1 : -1;
  if (unit == head && last == norm) return -1;  // the head ends the forward
  if (unit == norm) return head;
  return unit < norm ? unit + 1 : -1;  // the embedding or a layer: the next one
}

Status GatheredUnits::Use(int unit, const std::string& what) {
  // A unit held already (the head asked for again) costs nothing and predicts nothing.
  if (units_[unit].gathered && prefetch_.unit != unit) return Status::OK();
  const int last = last_used_;
  last_used_ = unit;
  // The final norm right after the head: the backward, which gathers the layers last to first.
  if (unit == model_->NormUnit() && last == model_->LmHeadUnit()) backward_order_ = true;
  if (prefetch_.unit >= 0 && prefetch_.unit != unit) {
    // Not the unit predicted (a path the prediction does not know): it stays gathered until
    // released; every rank took the same path, so the collectives still match.
    RETURN_IF_ERROR(FinishPrefetch());
  }
  RETURN_IF_ERROR(Gather(unit, what));
  const int next = prefetch_on_ ? NextUnit(unit, last) : -1;
  if (next >= 0 && !units_[next].gathered) RETURN_IF_ERROR(StartPrefetch(next, what));
  return Status::OK();
}

void GatheredUnits::Free(int unit) {
  Unit& u = units_[unit];
  if (prefetch_.unit == unit) {
    Status s = FinishPrefetch();  // its buffer is being written: not freed under it
    if (error_.ok() && !s.ok()) error_ = s;
  }
  ResizeStorage(u.flat, 0);
  if (u.gathered) --gathered_now_;
  u.gathered = false;
}

void GatheredUnits::ReleaseAll() {
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) Free(u);
  last_used_ = -1;
  backward_order_ = false;
}

void GatheredUnits::ThrowIfFailed(const Status& s) {
  if (s.ok()) return;
  if (error_.ok()) error_ = s;
  TORCH_CHECK(false, s.ToString());
}

Status GatheredUnits::TakeError() {
  Status s = error_;
  error_ = Status::OK();
  return s;
}

void GatheredUnits::Acquire(int unit) { ThrowIfFailed(Use(unit, where_)); }

void GatheredUnits::Release(int unit) { Free(unit); }

Status GatheredUnits::JoinNoGradForward(const std::string& where) {
  // ForwardHidden without grad: each unit used and released in turn; then LmHeadWeight (Use
  // prefetches as the forward's acquisitions do).
  for (int u = 0; u <= model_->NormUnit(); ++u) {
    RETURN_IF_ERROR(Use(u, where));
    Free(u);
  }
  RETURN_IF_ERROR(Use(model_->LmHeadUnit(), where));
  ReleaseAll();
  return Status::OK();
}

Status GatheredUnits::RunJoinedForwards(int64_t own, int64_t all,
                                        const std::function<void(int64_t)>& forward,
                                        const std::string& where) {
  where_ = where;
  for (int64_t i = 0; i < own; ++i) {
    try {
      forward(i);
    } catch (const c10::Error&) {
      // The gate threw its collective's failure (it cannot return one): that Status, with its
      // code, rather than the exception's text; any other libtorch error propagates.
      ReleaseAll();
      if (Status failed = TakeError(); !failed.ok()) return failed;
      throw;
    }
    ReleaseAll();  // the lm_head, which LmHeadWeight left gathered
    RETURN_IF_ERROR(TakeError());
  }
  for (int64_t i = own; i < all; ++i) RETURN_IF_ERROR(JoinNoGradForward(where));
  return Status::OK();
}

int64_t GatheredUnits::LargestUnitBytes() const {
  int64_t bytes = 0;
  for (const Unit& u : units_) {
    bytes = std::max(bytes,
                     u.chunk * ranks_->world_size() * static_cast<int64_t>(u.flat.element_size()));
  }
  return bytes;
}

}  // namespace grpo::learner::distributed
