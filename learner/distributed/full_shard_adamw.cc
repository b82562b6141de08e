#include "learner/distributed/full_shard_adamw.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>
#include <utility>

#include "learner/distributed/seen_checkpoint.h"
#include "learner/distributed/shard_norm.h"

namespace grpo::learner::distributed {

FullShardAdamW::FullShardAdamW(common::Model* model, AdamWOptions options, Collectives* ranks,
                               bool prefetch)
    : GatheredUnits(model, ranks, prefetch), options_(options) {}

FullShardAdamW::~FullShardAdamW() = default;

StatusOr<std::unique_ptr<FullShardAdamW>> FullShardAdamW::Create(common::Model* model,
                                                                 AdamWOptions options,
                                                                 Collectives* ranks,
                                                                 common::Model* compute,
                                                                 bool offload, bool prefetch) {
  if (ranks == nullptr || ranks->world_size() < 1) {
    return Status::InvalidArgument("FullShardAdamW: no rank group");
  }
  if (model == nullptr) return Status::InvalidArgument("FullShardAdamW: no model");
  common::Model* gated = compute != nullptr ? compute : model;
  if (gated->parameter_gate() != nullptr) {
    return Status::InvalidArgument("FullShardAdamW: the model already has a parameter gate");
  }
  common::NamedTensors master = model->NamedParameters();
  for (const auto& [name, p] : master) {
    if (!p.is_contiguous() || p.scalar_type() != at::kFloat || p.device() != model->device()) {
      return Status::InvalidArgument("FullShardAdamW: parameter '" + name +
                                     "' is not contiguous fp32 on the model's device");
    }
  }
  if (compute != nullptr) {
    const common::NamedTensors copy = compute->NamedParameters();
    const at::ScalarType dtype = copy.empty() ? at::kFloat : copy.front().second.scalar_type();
    bool same = copy.size() == master.size() && at::isFloatingType(dtype);
    for (size_t i = 0; same && i < copy.size(); ++i) {
      const at::Tensor& c = copy[i].second;
      same = copy[i].first == master[i].first && c.sizes() == master[i].second.sizes() &&
             c.scalar_type() == dtype && c.is_contiguous() && c.device() == model->device();
    }
    if (!same) {
      return Status::InvalidArgument(
          "FullShardAdamW: the compute copy's parameters are not the model's, contiguous in one "
          "floating dtype on its device");
    }
  }
  std::unique_ptr<FullShardAdamW> s(new FullShardAdamW(gated, options, ranks, prefetch));
  const int64_t shard_numel = s->LayOut();
  const auto opts = master.front().second.options().requires_grad(false);
  // Offload (ZeRO-Offload's optimizer on the host, here with ZeRO-3's parameters): the shards
  // on the host.
  const auto state_opts = ShardOptions(opts, model->device(), offload);
  s->weight_shard_ = at::zeros({shard_numel}, state_opts);
  s->grad_shard_ = at::zeros({shard_numel}, state_opts);
  s->exp_avg_ = at::zeros({shard_numel}, state_opts);
  s->exp_avg_sq_ = at::zeros({shard_numel}, state_opts);
  s->backward_units_.assign(s->units_.size(), 0);
  // Where the shards' values come from: a deferred model's files, each rank reading only its
  // own chunk of each unit (sharded loading: no rank holds the whole model), or rank 0's
  // weights, broadcast a unit at a time. The compute copy of a deferred model is one too.
  const std::shared_ptr<const common::ModelWeights> files = model->TakeDeferredWeights();
  if (compute != nullptr) (void)compute->TakeDeferredWeights();
  RETURN_IF_ERROR(s->AgreeOnLoading(files != nullptr, "the policy"));
  {
    std::vector<at::Tensor> values;  // rank 0's fp32 weights, without files
    if (files == nullptr) {
      for (const auto& [name, p] : master) values.push_back(p);
    }
    master.clear();  // not a reference more to a unit's memory than Shard frees
    RETURN_IF_ERROR(s->Shard(files.get(), values, "full_shard"));
  }
  if (compute != nullptr) {
    // The fp32 master's values are the shards now: its parameters keep their shapes (names and
    // shapes for checkpoints), not their memory.
    at::NoGradGuard no_grad;
    for (auto& [name, p] : model->NamedParameters()) {
      p.set_data(common::UnallocatedTensor(p.sizes(), opts));
    }
  }
  return s;
}

Status FullShardAdamW::ReduceScatter(int unit, const at::Tensor& flat, const std::string& what) {
  const Unit& u = units_[unit];
  at::Tensor summed = at::empty({u.chunk}, flat.options());
  RETURN_IF_ERROR(ranks_->ReduceScatterSum(
      flat, summed, "reduce-scatter of " + UnitName(*model_, unit) + "'s gradient" + what));
  grad_shard_.narrow(0, u.shard_offset, u.chunk).add_(summed.to(grad_shard_.device()));
  return Status::OK();
}

void FullShardAdamW::TakeGradients(int unit, const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  const Unit& u = units_[unit];
  TORCH_CHECK(grads.size() == u.params.size(), "full_shard: ", grads.size(), " gradients for ",
              u.params.size(), " parameters of ", UnitName(*model_, unit));
  std::vector<at::Tensor> by_param(params_.size());
  for (size_t k = 0; k < u.params.size(); ++k) by_param[u.params[k]] = grads[k];
  const at::Tensor flat = Pack(
      u, [&](size_t i) { return by_param[i]; }, device_opts_);
  ++backward_units_[unit];
  ThrowIfFailed(ReduceScatter(unit, flat, where_));
}

std::vector<int> FullShardAdamW::AutogradUnits() const {
  std::vector<int> out;
  if (model_->LmHeadUnit() != 0) out.push_back(model_->LmHeadUnit());
  out.push_back(0);
  return out;
}

Status FullShardAdamW::FinishBackward(bool zeros) {
  at::NoGradGuard no_grad;
  Status status = TakeError();
  for (int unit : AutogradUnits()) {
    const Unit& u = units_[unit];
    const at::Tensor flat = Pack(
        u, [&](size_t i) { return zeros ? at::Tensor() : params_[i].second.grad(); }, device_opts_);
    for (size_t i : u.params) params_[i].second.mutable_grad().reset();
    Status s = ReduceScatter(unit, flat, where_);
    if (status.ok()) status = s;
  }
  ReleaseAll();
  if (!zeros && status.ok()) {
    // Every decoder layer and the final norm handed its gradient over exactly once: otherwise
    // this rank's collectives no longer match the others'.
    for (int u = model_->LayerUnit(0); u <= model_->NormUnit(); ++u) {
      if (backward_units_[u] != 1) {
        status = Status::Internal("full_shard: the backward" + where_ + " reduced " +
                                  UnitName(*model_, u) + "'s gradient " +
                                  std::to_string(backward_units_[u]) + " times, not once");
        break;
      }
    }
  }
  std::fill(backward_units_.begin(), backward_units_.end(), 0);
  round_reduced_ = true;
  return status;
}

Status FullShardAdamW::JoinMicroBatch(const std::string& where) {
  where_ = where;
  // The forward: as JoinNoGradForward, but the lm_head stays gathered through the backward.
  for (int u = 0; u <= model_->NormUnit(); ++u) {
    RETURN_IF_ERROR(Use(u, where));
    Free(u);
  }
  RETURN_IF_ERROR(Use(model_->LmHeadUnit(), where));
  // The backward: the final norm and the layers, last to first, each gathered and reduced.
  for (int u = model_->NormUnit(); u >= model_->LayerUnit(0); --u) {
    RETURN_IF_ERROR(Use(u, where));
    const Unit& unit = units_[u];
    RETURN_IF_ERROR(
        ReduceScatter(u, at::zeros({unit.chunk * ranks_->world_size()}, device_opts_), where));
    Free(u);
  }
  return FinishBackward(/*zeros=*/true);
}

Status FullShardAdamW::RunNoGradForwards(int64_t own, int64_t all,
                                         const std::function<void(int64_t)>& forward,
                                         const std::string& where) {
  return RunJoinedForwards(own, all, forward, where);
}

void FullShardAdamW::BeforeBackward(const std::string& where) {
  where_ = where;
  std::fill(backward_units_.begin(), backward_units_.end(), 0);
}

Status FullShardAdamW::AfterBackward(const std::string& where) {
  where_ = where;
  return FinishBackward(/*zeros=*/false);
}

Status FullShardAdamW::EndRound(const std::string& where) {
  Status s = round_reduced_ ? Status::OK() : JoinMicroBatch(where);
  round_reduced_ = false;
  return s;
}

Status FullShardAdamW::AfterMicroBatch(int64_t position, const std::string& where) {
  if (position % ranks_->world_size() != 0) return Status::OK();
  return EndRound(where);
}

Status FullShardAdamW::ReduceGradients(int64_t micro_batches, const std::string& where) {
  // A partial last round (a flushed step) ends here; a full one ended in AfterMicroBatch.
  if (micro_batches % ranks_->world_size() == 0) return Status::OK();
  return EndRound(where);
}

void FullShardAdamW::ScaleGradients(double scale) {
  at::NoGradGuard no_grad;
  grad_shard_.mul_(scale);
}

StatusOr<double> FullShardAdamW::ClipGradNorm(double max_norm, const std::string& where) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (const Unit& u : units_) chunks.emplace_back(u.shard_offset, u.chunk);
  return ClipShardedGradNorm(grad_shard_, chunks, max_norm, ranks_, where);
}

Status FullShardAdamW::Step(double lr, const std::string&) {
  at::NoGradGuard no_grad;
  ++step_;
  for (const Unit& u : units_) {  // the padding stays zero: its gradient and moments are
    at::Tensor p = weight_shard_.narrow(0, u.shard_offset, u.chunk);
    at::Tensor m = exp_avg_.narrow(0, u.shard_offset, u.chunk);
    at::Tensor v = exp_avg_sq_.narrow(0, u.shard_offset, u.chunk);
    AdamWUpdate(p, grad_shard_.narrow(0, u.shard_offset, u.chunk), m, v, options_, lr, step_);
  }
  return Status::OK();
}

void FullShardAdamW::ZeroGrad() {
  at::NoGradGuard no_grad;
  grad_shard_.zero_();
  for (auto& [name, p] : params_) p.mutable_grad().reset();
  ReleaseAll();
  std::fill(backward_units_.begin(), backward_units_.end(), 0);
  round_reduced_ = false;
  error_ = Status::OK();
}

StatusOr<common::NamedTensors> FullShardAdamW::StateDict(const std::string& what) {
  at::NoGradGuard no_grad;
  const bool root = ranks_->rank() == 0;
  std::vector<at::Tensor> avg(params_.size()), sq(params_.size());
  for (auto [shard, out] : {std::pair{&exp_avg_, &avg}, std::pair{&exp_avg_sq_, &sq}}) {
    for (const Unit& u : units_) {
      at::Tensor whole = at::empty({u.chunk * ranks_->world_size()}, weight_shard_.options());
      RETURN_IF_ERROR(ranks_->AllGather(shard->narrow(0, u.shard_offset, u.chunk), whole, what));
      if (!root) continue;
      for (size_t k = 0; k < u.params.size(); ++k) {
        const at::Tensor& p = params_[u.params[k]].second;
        (*out)[u.params[k]] = whole.narrow(0, u.offsets[k], p.numel()).view(p.sizes()).clone();
      }
    }
  }
  if (!root) return common::NamedTensors{};
  return NameAdamWState(params_, avg, sq, step_);
}

Status FullShardAdamW::LoadStateDict(const common::NamedTensors& state) {
  ASSIGN_OR_RETURN(const AdamWStateView view, MatchAdamWState(state, params_));
  std::vector<at::Tensor> avg, sq;
  for (size_t i = 0; i < params_.size(); ++i) {
    avg.push_back(view.exp_avg[i]->to(weight_shard_.device(), at::kFloat));
    sq.push_back(view.exp_avg_sq[i]->to(weight_shard_.device(), at::kFloat));
  }
  at::NoGradGuard no_grad;
  const int64_t rank = ranks_->rank();
  for (const Unit& u : units_) {
    const auto opts = weight_shard_.options();
    exp_avg_.narrow(0, u.shard_offset, u.chunk)
        .copy_(Pack(
                   u, [&](size_t i) { return avg[i]; }, opts)
                   .narrow(0, rank * u.chunk, u.chunk));
    exp_avg_sq_.narrow(0, u.shard_offset, u.chunk)
        .copy_(Pack(
                   u, [&](size_t i) { return sq[i]; }, opts)
                   .narrow(0, rank * u.chunk, u.chunk));
  }
  step_ = view.step;
  // For SyncFromRankZero to hand out (in StateDict's order); alone, this rank holds it all.
  if (rank == 0 && ranks_->world_size() > 1) {
    pending_state_ = NameAdamWState(params_, avg, sq, step_);
  }
  return Status::OK();
}

Status FullShardAdamW::LoadWeights(const common::NamedTensors& weights) {
  std::unordered_map<std::string, const at::Tensor*> given;
  for (const auto& [name, t] : weights) given[name] = &t;
  std::vector<at::Tensor> values;
  for (const auto& [name, p] : params_) {
    auto it = given.find(name);
    if (it == given.end()) return Status::InvalidArgument("LoadWeights: '" + name + "' missing");
    if (!it->second->defined() || !at::isFloatingType(it->second->scalar_type()) ||
        it->second->sizes() != p.sizes()) {
      return Status::InvalidArgument("LoadWeights: '" + name +
                                     "' is not a float tensor of the parameter's shape");
    }
    values.push_back(it->second->to(weight_shard_.device(), at::kFloat));
  }
  if (given.size() != params_.size()) {
    return Status::InvalidArgument("LoadWeights: tensors that are not parameters of the model");
  }
  at::NoGradGuard no_grad;
  const int64_t rank = ranks_->rank();
  for (const Unit& u : units_) {
    weight_shard_.narrow(0, u.shard_offset, u.chunk)
        .copy_(Pack(
                   u, [&](size_t i) { return values[i]; }, weight_shard_.options())
                   .narrow(0, rank * u.chunk, u.chunk));
  }
  if (rank == 0 && ranks_->world_size() > 1) {
    pending_weights_.clear();
    for (size_t i = 0; i < params_.size(); ++i) {
      pending_weights_.emplace_back(params_[i].first, values[i]);
    }
  }
  return Status::OK();
}

Status FullShardAdamW::LoadWeightsFrom(WeightFiles files) {
  if (files.files == nullptr) return Status::InvalidArgument("LoadWeightsFrom: no files");
  at::NoGradGuard no_grad;
  for (const Unit& u : units_) RETURN_IF_ERROR(ReadChunk(u, *files.files));
  if (ranks_->rank() == 0 && ranks_->world_size() > 1) {
    pending_weights_.clear();
    pending_files_ = std::move(files);
  }
  return Status::OK();
}

Status FullShardAdamW::HandOutWeightFiles(const std::string& what) {
  // Every other rank reads its chunks where it sees the same checkpoint, a shared output_dir;
  // a rank on another machine without one does not.
  WeightFiles files = std::move(pending_files_);
  pending_files_ = WeightFiles{};
  ASSIGN_OR_RETURN(
      const int64_t missed,
      ReadShardsWhereSeen(
          *ranks_, files, model_->ParameterShapes(),
          [&](const common::ModelWeights& seen) -> Status {
            for (const Unit& u : units_) RETURN_IF_ERROR(ReadChunk(u, seen));
            return Status::OK();
          },
          device_opts_,
          "full_shard: rank 0 reads the weights and hands each rank its chunk, a unit at a time",
          what));
  if (missed == 0) return Status::OK();
  return HandOut(
      weight_shard_,
      [&](size_t i, at::Tensor& into) { return files.files->ReadRange(params_[i].first, 0, into); },
      what);
}

Status FullShardAdamW::HandOut(at::Tensor& shard, const Fill& fill, const std::string& what) {
  const bool root = ranks_->rank() == 0;
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) {
    const Unit& unit = units_[u];
    std::vector<at::Tensor> flat = {
        at::zeros({unit.chunk * ranks_->world_size()}, shard.options())};
    for (size_t k = 0; root && k < unit.params.size(); ++k) {
      at::Tensor into = flat[0].narrow(0, unit.offsets[k], params_[unit.params[k]].second.numel());
      RETURN_IF_ERROR(fill(unit.params[k], into));
    }
    RETURN_IF_ERROR(ranks_->Broadcast(flat, what + " (" + UnitName(*model_, u) + ")"));
    shard.narrow(0, unit.shard_offset, unit.chunk)
        .copy_(flat[0].narrow(0, ranks_->rank() * unit.chunk, unit.chunk));
  }
  return Status::OK();
}

Status FullShardAdamW::SyncFromRankZero(const std::string& what) {
  at::NoGradGuard no_grad;
  const bool root = ranks_->rank() == 0;
  // What rank 0 restored: its state whole, its weights whole (1) or in their files (2).
  const int64_t weights = !root                             ? 0
                          : pending_files_.files != nullptr ? 2
                          : !pending_weights_.empty()       ? 1
                                                            : 0;
  std::vector<at::Tensor> head = {at::tensor(
      std::vector<int64_t>{root && !pending_state_.empty() ? 1 : 0, weights, step_}, at::kLong)};
  RETURN_IF_ERROR(ranks_->Broadcast(head, what + " (step)"));
  const int64_t* h = head[0].data_ptr<int64_t>();
  step_ = h[2];
  // Rank 0's restored weights and state, a unit at a time: each rank keeps its chunk. Without
  // them every shard is already its rank's part of rank 0's (Create cut them from its weights).
  auto hand_out = [&](at::Tensor& shard, const common::NamedTensors& whole, size_t stride,
                      size_t which) {
    return HandOut(
        shard,
        [&](size_t i, at::Tensor& into) {
          into.copy_(whole[stride * i + which].second.reshape({-1}));
          return Status::OK();
        },
        what);
  };
  if (h[1] == 1) RETURN_IF_ERROR(hand_out(weight_shard_, pending_weights_, 1, 0));
  if (h[1] == 2) RETURN_IF_ERROR(HandOutWeightFiles(what));
  if (h[0] != 0) {
    RETURN_IF_ERROR(hand_out(exp_avg_, pending_state_, 2, 0));
    RETURN_IF_ERROR(hand_out(exp_avg_sq_, pending_state_, 2, 1));
  }
  pending_state_.clear();
  pending_weights_.clear();
  return Status::OK();
}

// This rank's chunk [rank x chunk, (rank + 1) x chunk) of each unit's flat buffer, cut at its
// parameters' bounds (the padding at the end of the last chunk belongs to no parameter).
std::vector<StepOptimizer::StatePiece> FullShardAdamW::StatePieces() {
  std::vector<StatePiece> out;
  const int64_t rank = ranks_->rank();
  for (const Unit& u : units_) {
    const int64_t lo = rank * u.chunk, hi = lo + u.chunk;
    for (size_t k = 0; k < u.params.size(); ++k) {
      const int64_t begin = u.offsets[k], end = begin + params_[u.params[k]].second.numel();
      const int64_t a = std::max(lo, begin), b = std::min(hi, end);
      if (a >= b) continue;
      const int64_t at_shard = u.shard_offset + (a - lo);
      out.push_back(
          {params_[u.params[k]].first,
           a - begin,
           b - a,
           {exp_avg_.narrow(0, at_shard, b - a), exp_avg_sq_.narrow(0, at_shard, b - a)}});
    }
  }
  return out;
}

Status FullShardAdamW::StreamWeights(const std::string& what, bool every_rank,
                                     const common::Model::WeightPut& put) {
  at::NoGradGuard no_grad;
  const bool keep = every_rank || ranks_->rank() == 0;
  Status put_status = Status::OK();
  // The fp32 master weights, a unit at a time (not the compute copy's: with bf16 it would round
  // them).
  for (int unit = 0; unit < static_cast<int>(units_.size()); ++unit) {
    const Unit& u = units_[unit];
    at::Tensor whole = at::empty({u.chunk * ranks_->world_size()}, weight_shard_.options());
    RETURN_IF_ERROR(ranks_->AllGather(weight_shard_.narrow(0, u.shard_offset, u.chunk), whole,
                                      "all-gather of " + UnitName(*model_, unit) + " for " + what));
    if (!keep) continue;
    for (size_t k = 0; k < u.params.size() && put_status.ok(); ++k) {
      const auto& [name, p] = params_[u.params[k]];
      put_status = put(name, whole.narrow(0, u.offsets[k], p.numel()).view(p.sizes()));
    }
  }
  return put_status;
}

StatusOr<common::NamedTensors> FullShardAdamW::GatherWeights(const std::string& what,
                                                             bool every_rank) {
  std::vector<at::Tensor> values(params_.size());
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index[params_[i].first] = i;
  RETURN_IF_ERROR(
      StreamWeights(what, every_rank, [&](const std::string& name, const at::Tensor& t) {
        values[index.at(name)] = t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
        return Status::OK();
      }));
  common::NamedTensors out;
  if (!every_rank && ranks_->rank() != 0) return out;
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back(params_[i].first, values[i]);
  return out;
}

int64_t FullShardAdamW::ResidentBytes() const {
  int64_t bytes = grad_shard_.nbytes() + exp_avg_.nbytes() + exp_avg_sq_.nbytes();
  for (const auto& [name, p] : params_) {
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  return bytes;
}

int64_t FullShardAdamW::ResidentParameterBytes() const {
  int64_t bytes = weight_shard_.nbytes();
  for (const Unit& u : units_) bytes += static_cast<int64_t>(u.flat.storage().nbytes());
  return bytes;
}

}  // namespace grpo::learner::distributed
