// ParameterGate: lets whoever owns a Model's parameter values keep them elsewhere between uses
// (full_shard: 1/world_size on each learner rank, learner/distributed/full_shard_adamw.h). The
// model calls it around each use of a unit's parameters in its whole-sequence forward
// (Model::ForwardHidden) and backward; with no gate set (the default) the model calls nothing
// and runs exactly as without one. Units are Model's (Model::NumUnits, Model::UnitParameters):
// the embedding (with the tied lm_head), one per decoder layer, the final norm and an untied
// lm_head.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace grpo::common {

// Called from the thread that runs the forward and its backward (autograd's, on the CPU the
// same); one forward at a time. Errors (a failed collective) are thrown as c10::Error, as
// libtorch's are, so that they leave a forward or an autograd backward at once.
class ParameterGate {
 public:
  virtual ~ParameterGate() = default;
  // The unit's parameter tensors hold their values until Release(unit). A unit already
  // acquired stays as it is (no collective).
  virtual void Acquire(int unit) = 0;
  // The unit's values may be dropped (its tensors keep their shapes, not their memory).
  virtual void Release(int unit) = 0;
  // The gradient of one backward of the unit, computed by the model itself: `grads` in the order
  // of Model::UnitParameters(unit), an undefined tensor for zeros. They are not added to the
  // parameters' .grad: the gate takes them.
  virtual void TakeGradients(int unit, const std::vector<at::Tensor>& grads) = 0;
};

// A tensor of `sizes` that holds no memory: a storage of 0 bytes that keeps its allocator, as
// a gated parameter between uses, or one whose values are not loaded yet (Model::LoadDeferred).
// Whoever fills it gives its storage bytes first (full_shard's gate); nothing may read it before.
inline at::Tensor UnallocatedTensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

}  // namespace grpo::common
