// ModelWeights: the weights of a Hugging Face model directory (`model.safetensors`, or the
// shards of `model.safetensors.index.json`), checked against the parameters a config.json implies
// before a value is read, then read whole (Model::Load) or a flat range of one parameter at a
// time: full_shard's sharded loading, where each learner rank reads only its chunk of every unit
// and no rank holds the whole model (learner/distributed/full_shard_adamw.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/model/safetensors.h"
#include "common/status.h"

namespace grpo::common {

class ModelWeights {
 public:
  // The expected parameters: Hugging Face names and shapes.
  using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

  // Opens `dir`'s weights and checks every expected parameter is there, in F32, F16, BF16 or F64,
  // with its shape; tensors nobody expects (a tied checkpoint's lm_head.weight, old Llama's rotary
  // inv_freq) are ignored with a warning. Errors name the file and the tensor: NotFound (no
  // weights file, a missing tensor), InvalidArgument (shape, or a dtype that is not floating).
  // `what` names the checkpoint's origin in errors (config.json's model_type).
  static StatusOr<std::shared_ptr<const ModelWeights>> Open(const std::string& dir,
                                                            const Shapes& expected,
                                                            const std::string& what);

  const std::string& dir() const { return dir_; }
  // Parameter `name`, whole, converted to `dtype` on `device` (contiguous).
  StatusOr<at::Tensor> Read(const std::string& name, const at::Device& device,
                            at::ScalarType dtype) const;
  // Elements [first, first + out.numel()) of parameter `name` in row-major order, converted into
  // `out` (contiguous, 1-D; any floating dtype and device). Reads only those bytes of the file
  // (no copy of the whole tensor). InvalidArgument for a range past the tensor's end.
  Status ReadRange(const std::string& name, int64_t first, at::Tensor& out) const;

 private:
  ModelWeights() = default;
  std::string dir_;
  std::unique_ptr<SafetensorsCheckpoint> checkpoint_;
};

}  // namespace grpo::common
