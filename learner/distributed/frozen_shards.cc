#include "learner/distributed/frozen_shards.h"

#include <ATen/ATen.h>

namespace grpo::learner::distributed {

StatusOr<std::unique_ptr<FrozenShards>> FrozenShards::Create(common::Model* model,
                                                             Collectives* ranks, bool offload,
                                                             bool prefetch) {
  if (ranks == nullptr || ranks->world_size() < 1) {
    return Status::InvalidArgument("FrozenShards: no rank group");
  }
  if (model == nullptr) return Status::InvalidArgument("FrozenShards: no model");
  if (model->parameter_gate() != nullptr) {
    return Status::InvalidArgument("FrozenShards: the model already has a parameter gate");
  }
  const common::NamedTensors params = model->NamedParameters();
  if (params.empty()) return Status::InvalidArgument("FrozenShards: a model without parameters");
  const at::ScalarType dtype = params.front().second.scalar_type();
  for (const auto& [name, p] : params) {
    if (!p.is_contiguous() || p.scalar_type() != dtype || !at::isFloatingType(dtype) ||
        p.device() != model->device()) {
      return Status::InvalidArgument("FrozenShards: parameter '" + name +
                                     "' is not contiguous in the model's floating dtype on its "
                                     "device");
    }
  }
  std::unique_ptr<FrozenShards> s(new FrozenShards(model, ranks, prefetch));
  const int64_t shard_numel = s->LayOut();
  s->weight_shard_ = at::zeros(
      {shard_numel},
      ShardOptions(params.front().second.options().requires_grad(false), model->device(), offload));
  const std::shared_ptr<const common::ModelWeights> files = model->TakeDeferredWeights();
  RETURN_IF_ERROR(s->AgreeOnLoading(files != nullptr, "the reference model"));
  std::vector<at::Tensor> values;  // rank 0's, without files
  if (files == nullptr) {
    for (const auto& [name, p] : params) values.push_back(p);
  }
  RETURN_IF_ERROR(s->Shard(files.get(), values, "the reference model"));
  return s;
}

void FrozenShards::TakeGradients(int unit, const std::vector<at::Tensor>&) {
  TORCH_CHECK(false, "the reference model is frozen: a backward reached ", UnitName(*model_, unit));
}

}  // namespace grpo::learner::distributed
