#include "learner/distributed/sharded_adamw.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "common/model/parameter_gate.h"
#include "learner/distributed/seen_checkpoint.h"
#include "learner/distributed/shard_norm.h"

namespace grpo::learner::distributed {

class ShardedAdamW::GradientReady final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradientReady(ShardedAdamW* owner, size_t i) : owner_(owner), i_(i) {}
  void operator()(const torch::autograd::Variable&) override { owner_->OnGradientReady(i_); }

 private:
  ShardedAdamW* owner_;
  size_t i_;
};

ShardedAdamW::ShardedAdamW(common::NamedTensors params, std::vector<at::Tensor> compute,
                           AdamWOptions options, Collectives* ranks)
    : params_(std::move(params)), compute_(std::move(compute)), options_(options), ranks_(ranks) {}

ShardedAdamW::~ShardedAdamW() {
  for (const at::Tensor& c : compute_) torch::autograd::impl::set_post_acc_grad_hooks(c, nullptr);
}

StatusOr<std::unique_ptr<ShardedAdamW>> ShardedAdamW::Create(
    common::NamedTensors params, std::vector<at::Tensor> compute, AdamWOptions options,
    Collectives* ranks, int64_t bucket_bytes, std::shared_ptr<const common::ModelWeights> files) {
  if (ranks == nullptr || ranks->world_size() < 1) {
    return Status::InvalidArgument("ShardedAdamW: no rank group");
  }
  if (params.empty()) return Status::InvalidArgument("ShardedAdamW: no parameters");
  if (bucket_bytes <= 0) return Status::InvalidArgument("ShardedAdamW: bucket_bytes must be > 0");
  const at::Tensor& first = params.front().second;
  for (const auto& [name, p] : params) {
    if (!p.is_contiguous() || p.scalar_type() != first.scalar_type() ||
        p.device() != first.device() || !at::isFloatingType(p.scalar_type())) {
      return Status::InvalidArgument("ShardedAdamW: parameter '" + name +
                                     "' is not contiguous floating point of the first's dtype "
                                     "and device");
    }
  }
  if (compute.size() != params.size()) {
    return Status::InvalidArgument("ShardedAdamW: " + std::to_string(compute.size()) +
                                   " compute tensors for " + std::to_string(params.size()) +
                                   " parameters");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (compute[i].sizes() != params[i].second.sizes()) {
      return Status::InvalidArgument("ShardedAdamW: the compute tensor of '" + params[i].first +
                                     "' has another shape");
    }
  }
  std::unique_ptr<ShardedAdamW> s(
      new ShardedAdamW(std::move(params), std::move(compute), options, ranks));
  const int64_t world = ranks->world_size();
  const int64_t rank = ranks->rank();
  const int64_t element = static_cast<int64_t>(first.element_size());
  for (size_t i = 0; i < s->params_.size(); ++i) {
    const int64_t n = s->params_[i].second.numel();
    if (s->buckets_.empty() ||
        ((s->buckets_.back().numel + n) * element > bucket_bytes && s->buckets_.back().numel > 0)) {
      Bucket b;
      b.first = i;
      s->buckets_.push_back(b);
    }
    Bucket& b = s->buckets_.back();
    b.param_offsets.push_back(b.numel);
    b.numel += n;
    b.last = i + 1;
  }
  int64_t shard_numel = 0;  // elements of this rank's shard: the sum of its chunks
  for (Bucket& b : s->buckets_) {
    b.chunk = (b.numel + world - 1) / world;
    b.shard_offset = shard_numel;
    shard_numel += b.chunk;
    const int64_t lo = rank * b.chunk, hi = std::min(b.numel, lo + b.chunk);
    for (size_t i = b.first; i < b.last; ++i) {
      const int64_t p0 = b.param_offsets[i - b.first];
      const int64_t p1 = p0 + s->params_[i].second.numel();
      const int64_t a = std::max(lo, p0), z = std::min(hi, p1);
      if (a < z) b.mine.push_back({i, a - p0, a - lo, z - a});
    }
  }
  for (size_t b = 0; b < s->buckets_.size(); ++b) {
    for (size_t i = s->buckets_[b].first; i < s->buckets_[b].last; ++i) s->bucket_of_.push_back(b);
  }
  s->pending_round_.resize(s->buckets_.size());
  s->arrived_.assign(s->params_.size(), false);
  s->next_bucket_ = static_cast<int64_t>(s->buckets_.size()) - 1;
  for (size_t i = 0; i < s->compute_.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(s->compute_[i],
                                                   std::make_unique<GradientReady>(s.get(), i));
  }
  // The compute tensors are the parameters (fp32 on the device), or all another model's: then
  // the master is sharded too.
  size_t same = 0;
  for (size_t i = 0; i < s->params_.size(); ++i) {
    same += s->compute_[i].is_same(s->params_[i].second) ? 1 : 0;
  }
  if (same != 0 && same != s->params_.size()) {
    return Status::InvalidArgument(
        "ShardedAdamW: some compute tensors are the parameters and some are not");
  }
  if (same != 0 && files != nullptr) {
    return Status::InvalidArgument(
        "ShardedAdamW: the parameters compute, so they are read whole, not from files");
  }
  const at::Device compute_device = s->compute_.front().device();
  // With the master on the host beside a GPU (offload) the shards are page-locked, so that
  // copies to and from the GPU are DMA.
  const auto opts = first.options().requires_grad(false).pinned_memory(first.device().is_cpu() &&
                                                                       compute_device.is_cuda());
  s->grad_shard_ = at::zeros({shard_numel}, opts);
  s->comm_ = first.options().requires_grad(false).device(compute_device);
  s->exp_avg_ = at::zeros({shard_numel}, opts);
  s->exp_avg_sq_ = at::zeros({shard_numel}, opts);
  if (same == 0) {
    s->master_ = at::zeros({shard_numel}, opts);
    s->gather_ = s->comm_.dtype(s->compute_.front().scalar_type());
    at::NoGradGuard no_grad;
    RETURN_IF_ERROR(s->AgreeOnLoading(files != nullptr));
    if (files != nullptr) {
      // Sharded loading: this rank's chunks from the files (the compute copy was read whole).
      RETURN_IF_ERROR(s->ReadMyChunks(*files));
    } else {
      // Rank 0's weights: each rank's chunks and every rank's compute copy (the ranks' own
      // weights are not used: as the trainer's broadcast of rank 0's weights would do).
      RETURN_IF_ERROR(s->HandOutWeights(
          [&](size_t i, at::Tensor& into) {
            into.copy_(s->params_[i].second.reshape({-1}));
            return Status::OK();
          },
          "broadcast of rank 0's weights for shard_grad_op"));
    }
    // The fp32 values are the shards now: the master's parameters keep their names and shapes
    // (checkpoints, the plan), not their memory.
    const at::TensorOptions master_opts = s->params_.front().second.options();
    for (auto& [name, p] : s->params_) {
      p.set_data(common::UnallocatedTensor(p.sizes(), master_opts));
    }
  }
  return s;
}

Status ShardedAdamW::AgreeOnLoading(bool from_files) {
  // Rank 0 says how it loads; a rank that loads otherwise would wait in collectives the others
  // never make.
  std::vector<at::Tensor> said = {at::full({1}, from_files ? 1.0 : 0.0, comm_)};
  RETURN_IF_ERROR(ranks_->Broadcast(said, "broadcast of how rank 0 loads the policy"));
  if ((said[0].item<double>() != 0) == from_files) return Status::OK();
  return Status::FailedPrecondition(
      "shard_grad_op: rank " + std::to_string(ranks_->rank()) +
      (from_files ? " reads its chunks of the master from the model's files, but rank 0 "
                    "broadcasts its weights"
                  : " waits for rank 0's weights, but rank 0 reads its chunks from the model's "
                    "files") +
      " (every rank must load the model the same way: model_name_or_path on each)");
}

Status ShardedAdamW::ReadMyChunks(const common::ModelWeights& files) {
  for (const Bucket& b : buckets_) {
    for (const Piece& piece : b.mine) {
      at::Tensor into = master_.narrow(0, b.shard_offset + piece.chunk_offset, piece.numel);
      RETURN_IF_ERROR(files.ReadRange(params_[piece.param].first, piece.param_offset, into));
    }
  }
  return Status::OK();
}

Status ShardedAdamW::GatherBucket(const Bucket& b, const at::Tensor& chunk,
                                  const std::string& what) {
  const at::TensorOptions into = master_.defined() ? gather_ : comm_;
  at::Tensor whole = at::empty({b.chunk * ranks_->world_size()}, into);
  RETURN_IF_ERROR(
      ranks_->AllGather(chunk.to(into.device(), into.dtype().toScalarType()), whole, what));
  for (size_t i = b.first; i < b.last; ++i) {
    at::Tensor& param = master_.defined() ? compute_[i] : params_[i].second;
    param.copy_(whole.narrow(0, b.param_offsets[i - b.first], param.numel()).view(param.sizes()));
  }
  return Status::OK();
}

Status ShardedAdamW::GatherComputeCopy(const std::string& what) {
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const Bucket& b = buckets_[k];
    RETURN_IF_ERROR(GatherBucket(b, master_.narrow(0, b.shard_offset, b.chunk),
                                 what + " (bucket " + std::to_string(k + 1) + " of " +
                                     std::to_string(buckets_.size()) + ")"));
  }
  return Status::OK();
}

StatusOr<at::Tensor> ShardedAdamW::FillBucket(const Bucket& b, const Fill& fill) const {
  at::Tensor flat = at::zeros({b.chunk * ranks_->world_size()}, at::kFloat);
  for (size_t i = b.first; i < b.last; ++i) {
    at::Tensor into = flat.narrow(0, b.param_offsets[i - b.first], params_[i].second.numel());
    RETURN_IF_ERROR(fill(i, into));
  }
  return flat;
}

void ShardedAdamW::TakeBucket(const Bucket& b, const at::Tensor& flat) {
  master_.narrow(0, b.shard_offset, b.chunk)
      .copy_(flat.narrow(0, ranks_->rank() * b.chunk, b.chunk));
  for (size_t i = b.first; i < b.last; ++i) {
    at::Tensor& c = compute_[i];
    c.copy_(flat.narrow(0, b.param_offsets[i - b.first], c.numel()).view(c.sizes()));
  }
}

Status ShardedAdamW::HandOutWeights(const Fill& fill, const std::string& what) {
  at::NoGradGuard no_grad;
  const bool root = ranks_->rank() == 0;
  Status filled = Status::OK();
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const Bucket& b = buckets_[k];
    std::vector<at::Tensor> flat(1);
    if (root && filled.ok()) {
      StatusOr<at::Tensor> values = FillBucket(b, fill);
      if (values.ok()) {
        flat[0] = values->to(comm_.device());
      } else {
        filled = values.status();
      }
    }
    if (!flat[0].defined()) flat[0] = at::zeros({b.chunk * ranks_->world_size()}, comm_);
    RETURN_IF_ERROR(ranks_->Broadcast(flat, what + " (bucket " + std::to_string(k + 1) + " of " +
                                                std::to_string(buckets_.size()) + ")"));
    TakeBucket(b, flat[0]);
  }
  return filled;
}

template <typename Source>
at::Tensor ShardedAdamW::PackBucket(const Bucket& b, Source source) const {
  at::Tensor flat = at::zeros({b.chunk * ranks_->world_size()}, grad_shard_.options());
  for (size_t i = b.first; i < b.last; ++i) {
    const at::Tensor t = source(i);
    if (!t.defined()) continue;
    flat.narrow(0, b.param_offsets[i - b.first], t.numel()).copy_(t.reshape({-1}));
  }
  return flat;
}

void ShardedAdamW::OnGradientReady(size_t i) {
  at::NoGradGuard no_grad;
  const at::Tensor& c = compute_[i];
  const at::Tensor grad = c.grad();
  if (!grad.defined()) return;
  const size_t b = bucket_of_[i];
  const Bucket& bucket = buckets_[b];
  Pending& p = pending_round_[b];
  if (p.reduced) {  // cannot happen with one accumulation per tensor per backward
    if (round_error_.ok()) {
      round_error_ = Status::Internal("gradient of '" + params_[i].first +
                                      "' arrived after its bucket was reduced" + where_);
    }
  } else {
    const int64_t padded = bucket.chunk * ranks_->world_size();
    if (!p.flat.defined() && bucket.last - bucket.first == 1 && grad.numel() == padded &&
        grad.scalar_type() == grad_shard_.scalar_type() && grad.device() == comm_.device() &&
        grad.is_contiguous()) {
      p.flat = grad.view({-1});  // a tensor alone that needs no padding: no copy
    } else {
      if (!p.flat.defined()) p.flat = at::zeros({padded}, comm_);
      p.flat.narrow(0, bucket.param_offsets[i - bucket.first], grad.numel())
          .add_(grad.reshape({-1}));
    }
    if (!arrived_[i]) {
      arrived_[i] = true;
      ++p.arrived;
    }
  }
  c.mutable_grad().reset();  // in its bucket now
  ReduceReadyBuckets(/*all=*/false);
}

void ShardedAdamW::ReduceReadyBuckets(bool all) {
  at::NoGradGuard no_grad;
  for (; next_bucket_ >= 0; --next_bucket_) {
    const Bucket& b = buckets_[next_bucket_];
    Pending& p = pending_round_[next_bucket_];
    if (!all && p.arrived < b.last - b.first) return;
    if (!p.flat.defined()) p.flat = at::zeros({b.chunk * ranks_->world_size()}, comm_);
    at::Tensor summed = at::empty({b.chunk}, comm_);
    // After a failure the group is not used again: its later collectives fail at once.
    Status s = ranks_->ReduceScatterSum(p.flat, summed, "reduce-scatter of the gradients" + where_);
    if (s.ok()) {
      grad_shard_.narrow(0, b.shard_offset, b.chunk).add_(summed.to(grad_shard_.device()));
    } else if (round_error_.ok()) {
      round_error_ = s;
    }
    p.flat.reset();
    p.reduced = true;
  }
}

void ShardedAdamW::ResetRound() {
  for (Pending& p : pending_round_) p = Pending{};
  arrived_.assign(params_.size(), false);
  next_bucket_ = static_cast<int64_t>(buckets_.size()) - 1;
}

Status ShardedAdamW::ReduceRound(const std::string& where) {
  at::NoGradGuard no_grad;
  where_ = where;
  // A gradient autograd did not hand to the hook (none expected) joins its bucket here.
  for (size_t i = 0; i < compute_.size(); ++i) {
    if (compute_[i].grad().defined()) OnGradientReady(i);
  }
  ReduceReadyBuckets(/*all=*/true);
  // With bf16 the master's .grad was never written; in fp32 the hook freed it.
  for (auto& [name, p] : params_) p.mutable_grad().reset();
  ResetRound();
  round_reduced_ = true;
  Status s = round_error_;
  round_error_ = Status::OK();
  return s;
}

void ShardedAdamW::BeforeBackward(const std::string& where) { where_ = where; }

Status ShardedAdamW::AfterBackward(const std::string& where) { return ReduceRound(where); }

Status ShardedAdamW::EndRound(const std::string& where) {
  // A rank that back-propagated nothing in the round joins with zeros.
  if (!round_reduced_) RETURN_IF_ERROR(ReduceRound(where));
  round_reduced_ = false;
  return Status::OK();
}

Status ShardedAdamW::AfterMicroBatch(int64_t position, const std::string& where) {
  if (position % ranks_->world_size() != 0) return Status::OK();
  return EndRound(where);
}

Status ShardedAdamW::ReduceGradients(int64_t micro_batches, const std::string& where) {
  // A partial last round (a flushed step) ends here; a full one ended in AfterMicroBatch.
  if (micro_batches % ranks_->world_size() == 0) return Status::OK();
  return EndRound(where);
}

void ShardedAdamW::ScaleGradients(double scale) {
  at::NoGradGuard no_grad;
  grad_shard_.mul_(scale);
}

StatusOr<double> ShardedAdamW::ClipGradNorm(double max_norm, const std::string& where) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (const Bucket& b : buckets_) chunks.emplace_back(b.shard_offset, b.chunk);
  return ClipShardedGradNorm(grad_shard_, chunks, max_norm, ranks_, where);
}

Status ShardedAdamW::Step(double lr, const std::string& where) {
  at::NoGradGuard no_grad;
  ++step_;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const Bucket& b = buckets_[k];
    // This rank's chunk of the weights, updated as AdamW::Step updates a parameter: the master's
    // own chunk in place, or a copy cut from the whole parameters.
    at::Tensor p;
    if (master_.defined()) {
      p = master_.narrow(0, b.shard_offset, b.chunk);
    } else {
      p = at::zeros({b.chunk}, grad_shard_.options());
      for (const Piece& piece : b.mine) {
        p.narrow(0, piece.chunk_offset, piece.numel)
            .copy_(params_[piece.param].second.reshape({-1}).narrow(0, piece.param_offset,
                                                                    piece.numel));
      }
    }
    const at::Tensor g = grad_shard_.narrow(0, b.shard_offset, b.chunk);
    at::Tensor m = exp_avg_.narrow(0, b.shard_offset, b.chunk);
    at::Tensor v = exp_avg_sq_.narrow(0, b.shard_offset, b.chunk);
    AdamWUpdate(p, g, m, v, options_, lr, step_);
    RETURN_IF_ERROR(GatherBucket(b, p, "all-gather of the weights" + where));
  }
  return Status::OK();
}

void ShardedAdamW::ZeroGrad() {
  at::NoGradGuard no_grad;
  grad_shard_.zero_();
  for (auto& [name, p] : params_) p.mutable_grad().reset();
  for (const at::Tensor& c : compute_) c.mutable_grad().reset();
  ResetRound();
  round_error_ = Status::OK();
  round_reduced_ = false;
}

StatusOr<common::NamedTensors> ShardedAdamW::StateDict(const std::string& what) {
  at::NoGradGuard no_grad;
  const bool root = ranks_->rank() == 0;
  std::vector<at::Tensor> avg(params_.size()), sq(params_.size());
  for (auto [shard, out] : {std::pair{&exp_avg_, &avg}, std::pair{&exp_avg_sq_, &sq}}) {
    for (const Bucket& b : buckets_) {
      at::Tensor whole = at::empty({b.chunk * ranks_->world_size()}, grad_shard_.options());
      RETURN_IF_ERROR(ranks_->AllGather(shard->narrow(0, b.shard_offset, b.chunk), whole, what));
      if (!root) continue;
      for (size_t i = b.first; i < b.last; ++i) {
        const at::Tensor& p = params_[i].second;
        (*out)[i] =
            whole.narrow(0, b.param_offsets[i - b.first], p.numel()).view(p.sizes()).clone();
      }
    }
  }
  if (!root) return common::NamedTensors{};
  return NameAdamWState(params_, avg, sq, step_);
}

Status ShardedAdamW::LoadStateDict(const common::NamedTensors& state) {
  ASSIGN_OR_RETURN(const AdamWStateView view, MatchAdamWState(state, params_));
  std::vector<at::Tensor> avg, sq;  // on the parameters' device and dtype
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].second;
    avg.push_back(view.exp_avg[i]->to(p.device(), p.scalar_type()));
    sq.push_back(view.exp_avg_sq[i]->to(p.device(), p.scalar_type()));
  }
  common::NamedTensors whole = NameAdamWState(params_, avg, sq, view.step);  // StateDict's order
  at::NoGradGuard no_grad;
  for (auto [shard, which] : {std::pair{&exp_avg_, 0}, std::pair{&exp_avg_sq_, 1}}) {
    for (const Bucket& b : buckets_) {
      for (const Piece& piece : b.mine) {
        shard->narrow(0, b.shard_offset + piece.chunk_offset, piece.numel)
            .copy_(whole[2 * piece.param + which].second.reshape({-1}).narrow(0, piece.param_offset,
                                                                              piece.numel));
      }
    }
  }
  step_ = view.step;
  if (ranks_->rank() == 0) pending_ = std::move(whole);
  return Status::OK();
}

Status ShardedAdamW::SyncFromRankZero(const std::string& what) {
  at::NoGradGuard no_grad;
  const bool root = ranks_->rank() == 0;
  // What rank 0 restored: its state whole; its weights, in their files (the master sharded).
  const bool weights = root && pending_files_.files != nullptr;
  std::vector<at::Tensor> head = {at::tensor(
      std::vector<int64_t>{root && !pending_.empty() ? 1 : 0, weights ? 1 : 0, step_}, at::kLong)};
  RETURN_IF_ERROR(ranks_->Broadcast(head, what + " (step)"));
  const int64_t* h = head[0].data_ptr<int64_t>();
  step_ = h[2];
  if (h[1] != 0) RETURN_IF_ERROR(HandOutWeightFiles(what + " (weights)"));
  if (h[0] == 0) return Status::OK();  // no state restored: every shard is its rank's own
  // Rank 0's restored state, bucket by bucket: each rank keeps its chunk.
  for (auto [shard, which] : {std::pair{&exp_avg_, 0}, std::pair{&exp_avg_sq_, 1}}) {
    for (const Bucket& b : buckets_) {
      std::vector<at::Tensor> flat = {PackBucket(
          b, [&](size_t i) { return root ? pending_[2 * i + which].second : at::Tensor(); })};
      RETURN_IF_ERROR(ranks_->Broadcast(flat, what));
      const int64_t lo = ranks_->rank() * b.chunk;
      shard->narrow(0, b.shard_offset, b.chunk).copy_(flat[0].narrow(0, lo, b.chunk));
    }
  }
  pending_.clear();
  return Status::OK();
}

std::vector<StepOptimizer::StatePiece> ShardedAdamW::StatePieces() {
  std::vector<StatePiece> out;
  for (const Bucket& b : buckets_) {
    for (const Piece& piece : b.mine) {
      const int64_t at_shard = b.shard_offset + piece.chunk_offset;
      out.push_back({params_[piece.param].first,
                     piece.param_offset,
                     piece.numel,
                     {exp_avg_.narrow(0, at_shard, piece.numel),
                      exp_avg_sq_.narrow(0, at_shard, piece.numel)}});
    }
  }
  return out;
}

int64_t ShardedAdamW::ResidentBytes() const {
  int64_t bytes = grad_shard_.nbytes() + exp_avg_.nbytes() + exp_avg_sq_.nbytes();
  for (const auto& [name, p] : params_) {
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  for (size_t i = 0; i < compute_.size(); ++i) {
    const at::Tensor& c = compute_[i];
    if (c.grad().defined() && !c.is_same(params_[i].second)) bytes += c.grad().nbytes();
  }
  for (const Pending& p : pending_round_) {
    if (p.flat.defined()) bytes += p.flat.nbytes();
  }
  return bytes;
}

int64_t ShardedAdamW::ResidentParameterBytes() const {
  if (master_.defined()) return master_.nbytes();  // the parameters hold no memory
  int64_t bytes = 0;
  for (const auto& [name, p] : params_) bytes += p.nbytes();
  return bytes;
}

Status ShardedAdamW::StreamWeights(const std::string& what, bool every_rank,
                                   const common::Model::WeightPut& put) {
  if (!master_.defined()) {
    return Status::Unimplemented("StreamWeights: the parameters are whole on every rank");
  }
  at::NoGradGuard no_grad;
  const bool keep = every_rank || ranks_->rank() == 0;
  Status put_status = Status::OK();
  // The fp32 master, a bucket at a time (not the compute copy: with bf16 it would round it),
  // gathered where the collectives run.
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const Bucket& b = buckets_[k];
    at::Tensor whole = at::empty({b.chunk * ranks_->world_size()}, comm_);
    RETURN_IF_ERROR(
        ranks_->AllGather(master_.narrow(0, b.shard_offset, b.chunk).to(comm_.device()), whole,
                          "all-gather of the weights (bucket " + std::to_string(k + 1) + " of " +
                              std::to_string(buckets_.size()) + ") for " + what));
    if (!keep) continue;
    for (size_t i = b.first; i < b.last && put_status.ok(); ++i) {
      const auto& [name, p] = params_[i];
      put_status =
          put(name, whole.narrow(0, b.param_offsets[i - b.first], p.numel()).view(p.sizes()));
    }
  }
  return put_status;
}

StatusOr<common::NamedTensors> ShardedAdamW::GatherWeights(const std::string& what,
                                                           bool every_rank) {
  std::vector<at::Tensor> values(params_.size());
  size_t next = 0;  // StreamWeights puts the parameters in their order
  RETURN_IF_ERROR(StreamWeights(what, every_rank, [&](const std::string&, const at::Tensor& t) {
    values[next++] = t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    return Status::OK();
  }));
  common::NamedTensors out;
  if (!every_rank && ranks_->rank() != 0) return out;
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back(params_[i].first, values[i]);
  return out;
}

Status ShardedAdamW::LoadWeightsFrom(WeightFiles files) {
  if (!master_.defined()) {
    return Status::Unimplemented("LoadWeightsFrom: the parameters are whole on every rank");
  }
  if (files.files == nullptr) return Status::InvalidArgument("LoadWeightsFrom: no files");
  at::NoGradGuard no_grad;
  RETURN_IF_ERROR(ReadMyChunks(*files.files));
  // Alone, the chunks are the weights; otherwise every rank's compute copy is gathered from every
  // rank's chunks in SyncFromRankZero, once the others have read theirs.
  if (ranks_->world_size() == 1) return GatherComputeCopy("the restored weights");
  if (ranks_->rank() == 0) pending_files_ = std::move(files);
  return Status::OK();
}

Status ShardedAdamW::HandOutWeightFiles(const std::string& what) {
  WeightFiles files = std::move(pending_files_);
  pending_files_ = WeightFiles{};
  common::ModelWeights::Shapes shapes;
  for (const auto& [name, p] : params_) shapes.emplace_back(name, p.sizes().vec());
  ASSIGN_OR_RETURN(
      const int64_t missed,
      ReadShardsWhereSeen(
          *ranks_, files, shapes,
          [&](const common::ModelWeights& seen) { return ReadMyChunks(seen); }, comm_,
          "shard_grad_op: rank 0 reads the weights and broadcasts them, a bucket at a time", what));
  // Every rank's compute copy is every rank's chunks, gathered in its dtype (as after a step).
  if (missed == 0) return GatherComputeCopy("all-gather of " + what);
  return HandOutWeights(
      [&](size_t i, at::Tensor& into) { return files.files->ReadRange(params_[i].first, 0, into); },
      what);
}

}  // namespace grpo::learner::distributed
