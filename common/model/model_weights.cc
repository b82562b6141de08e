#include "common/model/model_weights.h"

#include <filesystem>
#include <set>
#include <sstream>

#include "common/logging.h"

namespace grpo::common {
namespace {

std::string DtypeName(at::ScalarType t) {
  StatusOr<std::string> name = SafetensorsDtypeName(t);
  return name.ok() ? *name : std::string(c10::toString(t));
}

}  // namespace

StatusOr<std::shared_ptr<const ModelWeights>> ModelWeights::Open(const std::string& dir,
                                                                 const Shapes& expected,
                                                                 const std::string& what) {
  namespace fs = std::filesystem;
  std::shared_ptr<ModelWeights> w(new ModelWeights());
  w->dir_ = dir;
  ASSIGN_OR_RETURN(w->checkpoint_, SafetensorsCheckpoint::Open(dir));
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  std::error_code ec;
  const std::string weights_desc =
      fs::exists(index_path, ec) ? index_path : (fs::path(dir) / "model.safetensors").string();
  std::set<std::string> names;
  for (const auto& [name, shape] : expected) {
    names.insert(name);
    const SafetensorInfo* info = w->checkpoint_->Find(name);
    if (info == nullptr) {
      return Status::NotFound(weights_desc + ": tensor '" + name + "' is missing (" + what + ")");
    }
    const std::string file = w->checkpoint_->FileOf(name);
    if (info->dtype != at::kFloat && info->dtype != at::kHalf && info->dtype != at::kBFloat16 &&
        info->dtype != at::kDouble) {
      return Status::InvalidArgument(
          file + ": tensor '" + name + "': dtype " + DtypeName(info->dtype) +
          " is not supported for weights (expected F32, F16, BF16 or F64)");
    }
    if (info->shape != shape) {
      return Status::InvalidArgument(file + ": tensor '" + name + "': shape " +
                                     ShapeString(info->shape) + " does not match " +
                                     ShapeString(shape) + " implied by config.json");
    }
  }
  int unexpected = 0;
  for (const auto& name : w->checkpoint_->Names()) {
    if (names.count(name) == 0) {
      // Tied checkpoints sometimes carry lm_head.weight; old Llama ones rotary inv_freq.
      GRPO_LOG_DEBUG("{}: ignoring unexpected tensor '{}'", dir, name);
      ++unexpected;
    }
  }
  if (unexpected > 0) GRPO_LOG_WARN("{}: ignored {} unexpected tensor(s)", dir, unexpected);
  return std::shared_ptr<const ModelWeights>(std::move(w));
}

StatusOr<at::Tensor> ModelWeights::Read(const std::string& name, const at::Device& device,
                                        at::ScalarType dtype) const {
  ASSIGN_OR_RETURN(at::Tensor t, checkpoint_->Get(name));
  try {
    return t.to(device, dtype).contiguous();
  } catch (const c10::Error& e) {
    return Status::Internal(checkpoint_->FileOf(name) + ": tensor '" + name +
                            "': " + e.what_without_backtrace());
  }
}

Status ModelWeights::ReadRange(const std::string& name, int64_t first, at::Tensor& out) const {
  const SafetensorInfo* info = checkpoint_->Find(name);
  if (info == nullptr) return Status::NotFound(dir_ + ": no tensor '" + name + "'");
  int64_t numel = 1;
  for (int64_t d : info->shape) numel *= d;
  const int64_t count = out.numel();
  if (first < 0 || count > numel - first || out.dim() != 1 || !out.is_contiguous()) {
    return Status::InvalidArgument(checkpoint_->FileOf(name) + ": tensor '" + name +
                                   "': elements [" + std::to_string(first) + ", " +
                                   std::to_string(first + count) + ") of " + std::to_string(numel) +
                                   " into a 1-D contiguous tensor");
  }
  if (count == 0) return Status::OK();
  try {
    auto view = checkpoint_->View(name);
    if (view.ok()) {
      // Straight from the mapped file into `out`, converted on the way: no copy of the tensor;
      // then its pages leave the resident set (a rank holds its shard, not the file's pages).
      out.copy_(view->narrow(0, first, count));
      const uint64_t size = view->element_size();
      checkpoint_->DoneReading(name, first * size, (first + count) * size);
    } else if (view.status().code() == StatusCode::kFailedPrecondition) {
      // Bytes not aligned to the dtype (a file whose header length is not a multiple of 8):
      // through a copy of the whole tensor.
      ASSIGN_OR_RETURN(at::Tensor whole, checkpoint_->Get(name));
      out.copy_(whole.reshape({-1}).narrow(0, first, count));
    } else {
      return view.status();
    }
    return Status::OK();
  } catch (const c10::Error& e) {
    return Status::Internal(checkpoint_->FileOf(name) + ": tensor '" + name +
                            "': " + e.what_without_backtrace());
  }
}

}  // namespace grpo::common
