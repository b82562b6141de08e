// AdamW (decoupled weight decay, Loshchilov & Hutter; the same update as torch.optim.AdamW),
// gradient-norm clipping and the learning-rate schedules of Hugging Face `transformers`
// (constant, linear and cosine with linear warmup). State is plain tensors, so that it saves
// to safetensors and a resumed run continues bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/model/safetensors.h"
#include "common/status.h"

namespace grpo::learner {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// Not thread-safe; the training thread owns it. Parameters are borrowed (shared storage).
class AdamW {
 public:
  AdamW(common::NamedTensors params, AdamWOptions options);

  // One update of every parameter that has a gradient, with learning rate `lr`. Parameters
  // without a gradient are skipped (their moments stay as they were).
  void Step(double lr);
  // Zeroes the gradients in place, keeping their memory: the next backward accumulates into
  // it, so every micro-batch of every step has the same peak (a freed gradient would make the
  // first micro-batch cheaper than the rest, and cost fresh page faults each step).
  void ZeroGrad();
  int64_t step_count() const { return step_; }

  // State as named tensors: "exp_avg.<param>", "exp_avg_sq.<param>" and "step" ([] int64).
  common::NamedTensors StateDict() const;
  // Restores StateDict() output; InvalidArgument naming the tensor on a missing name or a
  // shape mismatch, and then nothing changed.
  Status LoadStateDict(const common::NamedTensors& state);

 private:
  common::NamedTensors params_;
  AdamWOptions options_;
  std::vector<at::Tensor> exp_avg_;
  std::vector<at::Tensor> exp_avg_sq_;
  int64_t step_ = 0;
};

// One AdamW update (torch.optim.AdamW's, `step` 1-based, the step being taken) of `p` in place
// with gradient `g` and moments `exp_avg`, `exp_avg_sq` (updated in place): AdamW::Step's
// update of one parameter, and the sharded optimizers' of one chunk. Same shapes and dtype.
void AdamWUpdate(at::Tensor& p, const at::Tensor& g, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                 const AdamWOptions& options, double lr, int64_t step);

// AdamW state named as StateDict names it (the checkpoint's optimizer.safetensors):
// "exp_avg.<param>", "exp_avg_sq.<param>" for each of `params` in order, then "step".
common::NamedTensors NameAdamWState(const common::NamedTensors& params,
                                    const std::vector<at::Tensor>& exp_avg,
                                    const std::vector<at::Tensor>& exp_avg_sq, int64_t step);

// AdamW state (StateDict's names) matched to `params`: each parameter's two moments, checked to
// have its shape, and the step. InvalidArgument naming the tensor on a missing name or a shape
// mismatch. The pointers point into `state`.
struct AdamWStateView {
  std::vector<const at::Tensor*> exp_avg, exp_avg_sq;  // one per parameter
  int64_t step = 0;
};
StatusOr<AdamWStateView> MatchAdamWState(const common::NamedTensors& state,
                                         const common::NamedTensors& params);

// Scales every gradient by min(1, max_norm / (total_norm + 1e-6)) as torch's
// clip_grad_norm_ does, and returns the total L2 norm before clipping. max_norm <= 0 only
// measures.
double ClipGradNorm(const std::vector<at::Tensor>& params, double max_norm);

enum class LrSchedule { kConstant, kLinear, kCosine };
StatusOr<LrSchedule> ParseLrSchedule(std::string_view name);

// The learning rate for optimizer step `step` (0-based, the step about to be taken) of
// `total_steps`, with `warmup_steps` of linear warmup from 0 (transformers'
// get_{constant,linear,cosine}_schedule_with_warmup).
double LearningRateAt(LrSchedule schedule, double base_lr, int64_t step, int64_t warmup_steps,
                      int64_t total_steps);

}  // namespace grpo::learner
