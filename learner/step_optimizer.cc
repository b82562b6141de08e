#include "learner/step_optimizer.h"

#include <ATen/core/grad_mode.h>

#include <utility>
#include <vector>

#include "learner/distributed/full_shard_adamw.h"
#include "learner/distributed/sharded_adamw.h"

namespace grpo::learner {

namespace {

// no_shard: every rank holds the whole gradient and the whole AdamW state (DDP). At one rank
// every collective is skipped, so the single-process step is the one it always was.
// With the master on the host (HostsMaster) the gradients are summed on `through`, the compute
// copy's device (NCCL there), a bucket at a time.
class ReplicatedAdamW final : public StepOptimizer {
 public:
  ReplicatedAdamW(common::NamedTensors params, AdamWOptions options,
                  distributed::Collectives* ranks, at::Device through)
      : params_(params), adamw_(std::move(params), options), ranks_(ranks), through_(through) {}

  void BeforeBackward(const std::string&) override {}
  Status AfterBackward(const std::string&) override { return Status::OK(); }
  Status AfterMicroBatch(int64_t, const std::string&) override { return Status::OK(); }

  Status ReduceGradients(int64_t, const std::string& where) override {
    if (ranks_->world_size() == 1) return Status::OK();
    // Every parameter takes part, with a zero gradient where this rank back-propagated nothing.
    std::vector<at::Tensor> grads;
    for (auto& [name, p] : params_) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      grads.push_back(p.grad());
    }
    return distributed::BucketedAllReduceSum(*ranks_, grads, distributed::kDefaultBucketBytes,
                                             "all-reduce of the gradients" + where, through_);
  }

  void ScaleGradients(double scale) override {
    at::NoGradGuard no_grad;
    for (auto& [name, p] : params_) {
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
    }
  }

  StatusOr<double> ClipGradNorm(double max_norm, const std::string&) override {
    return learner::ClipGradNorm(Tensors(), max_norm);
  }

  Status Step(double lr, const std::string&) override {
    adamw_.Step(lr);
    return Status::OK();
  }
  void ZeroGrad() override { adamw_.ZeroGrad(); }
  int64_t step_count() const override { return adamw_.step_count(); }

  StatusOr<common::NamedTensors> StateDict(const std::string&) override {
    if (ranks_->rank() != 0) return common::NamedTensors{};
    return adamw_.StateDict();
  }
  Status LoadStateDict(const common::NamedTensors& state) override {
    return adamw_.LoadStateDict(state);
  }

  Status SyncFromRankZero(const std::string& what) override {
    if (ranks_->world_size() == 1) return Status::OK();
    at::NoGradGuard no_grad;
    common::NamedTensors state = adamw_.StateDict();
    std::vector<at::Tensor> floats, others;
    for (auto& [name, t] : state) {
      t = t.contiguous().clone();
      (t.scalar_type() == at::kFloat ? floats : others).push_back(t);
    }
    RETURN_IF_ERROR(
        distributed::BucketedBroadcast(*ranks_, floats, distributed::kDefaultBucketBytes, what));
    RETURN_IF_ERROR(ranks_->Broadcast(others, what + " (step)"));
    return adamw_.LoadStateDict(state);
  }

  int64_t ResidentParameterBytes() const override {
    int64_t bytes = 0;
    for (const auto& [name, p] : params_) bytes += p.nbytes();
    return bytes;
  }

  int64_t ResidentBytes() const override {
    int64_t bytes = 0;
    for (const auto& [name, p] : params_) {
      if (p.grad().defined()) bytes += p.grad().nbytes();
    }
    for (const auto& [name, t] : adamw_.StateDict()) {
      if (name != "step") bytes += t.nbytes();  // the moments
    }
    return bytes;
  }

 private:
  std::vector<at::Tensor> Tensors() const {
    std::vector<at::Tensor> out;
    for (const auto& [name, p] : params_) out.push_back(p);
    return out;
  }

  common::NamedTensors params_;
  AdamW adamw_;
  distributed::Collectives* ranks_;
  at::Device through_;
};

}  // namespace

bool TEST_host_master_on_cpu = false;

bool HostsMaster(const common::FsdpSpec& fsdp, const at::Device& device) {
  return fsdp.offload && fsdp.mode != common::FsdpMode::kFullShard &&
         (!device.is_cpu() || TEST_host_master_on_cpu);
}

at::Device MasterHome(const common::FsdpSpec& fsdp, const at::Device& device) {
  return HostsMaster(fsdp, device) ? at::Device(at::kCPU) : device;
}

bool GatesParameters(const common::FsdpSpec& fsdp, int world_size, const at::Device& device) {
  const bool offload = fsdp.offload && !device.is_cpu();
  if (offload) return fsdp.mode == common::FsdpMode::kFullShard;  // else a host master
  return fsdp.mode == common::FsdpMode::kFullShard && world_size > 1;
}

bool ShardsMasterBesideCopy(const common::FsdpSpec& fsdp, int world_size, bool bf16,
                            const at::Device& device) {
  return fsdp.mode == common::FsdpMode::kShardGradOp && world_size > 1 &&
         (bf16 || HostsMaster(fsdp, device));
}

StatusOr<std::unique_ptr<StepOptimizer>> MakeStepOptimizer(
    const common::FsdpSpec& fsdp, common::NamedTensors params, std::vector<at::Tensor> compute,
    AdamWOptions options, distributed::Collectives* ranks, common::Model* model,
    common::Model* compute_model) {
  const int world = ranks->world_size();
  // Offload matters on a GPU only (on the CPU the host is the device): full_shard's shards then
  // live on the host, at any world size; the other modes get the master on the host from
  // GrpoTrainer::Create (HostsMaster), so their `params` are host tensors here.
  const bool offload = fsdp.offload && model != nullptr && !model->device().is_cpu();
  if (offload && fsdp.mode != common::FsdpMode::kFullShard) {
    return Status::InvalidArgument(
        "config key 'fsdp': " +
        std::string(fsdp.mode == common::FsdpMode::kNoShard ? "no_shard" : "shard_grad_op") +
        " offload needs the fp32 master on the host (GrpoTrainer::Create puts it there), not on " +
        model->device().str());
  }
  if ((world == 1 && !offload) || fsdp.mode == common::FsdpMode::kNoShard) {
    const at::Device through = compute.empty() ? at::Device(at::kCPU) : compute.front().device();
    return std::unique_ptr<StepOptimizer>(
        new ReplicatedAdamW(std::move(params), options, ranks, through));
  }
  if (fsdp.mode == common::FsdpMode::kShardGradOp) {
    // A deferred policy's files: each rank reads its chunks of the master there.
    ASSIGN_OR_RETURN(auto sharded, distributed::ShardedAdamW::Create(
                                       std::move(params), std::move(compute), options, ranks,
                                       distributed::kDefaultBucketBytes,
                                       model != nullptr ? model->TakeDeferredWeights() : nullptr));
    return std::unique_ptr<StepOptimizer>(std::move(sharded));
  }
  if (model == nullptr) {
    return Status::InvalidArgument("full_shard at several ranks needs the model it shards");
  }
  ASSIGN_OR_RETURN(auto full, distributed::FullShardAdamW::Create(
                                  model, options, ranks, compute_model, offload, fsdp.prefetch));
  return std::unique_ptr<StepOptimizer>(std::move(full));
}

}  // namespace grpo::learner
