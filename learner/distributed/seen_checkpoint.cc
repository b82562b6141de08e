#include "learner/distributed/seen_checkpoint.h"

#include "common/logging.h"
#include "common/sha256.h"

namespace grpo::learner::distributed {

std::function<bool(int rank)> TEST_weight_files_probe;

StatusOr<int64_t> ReadShardsWhereSeen(
    Collectives& ranks, const StepOptimizer::WeightFiles& root,
    const common::ModelWeights::Shapes& shapes,
    const std::function<Status(const common::ModelWeights&)>& read, const at::TensorOptions& flag,
    const std::string& fallback, const std::string& what) {
  const bool is_root = ranks.rank() == 0;
  // The checkpoint's directory, the file that fingerprints it and the fingerprint, as one string.
  std::string said;
  if (is_root) said = root.files->dir() + '\n' + root.fingerprint_file + '\n' + root.fingerprint;
  RETURN_IF_ERROR(BroadcastString(ranks, &said, what + " (the checkpoint's name)"));
  Status mine = Status::OK();
  if (!is_root) {
    mine = [&]() -> Status {
      const size_t a = said.find('\n'), b = said.find('\n', a + 1);
      if (a == std::string::npos || b == std::string::npos) {
        return Status::Internal("malformed checkpoint name from rank 0");
      }
      const std::string dir = said.substr(0, a), file = said.substr(a + 1, b - a - 1);
      ASSIGN_OR_RETURN(const std::string sum, common::Sha256File(dir + "/" + file));
      if (sum != said.substr(b + 1) ||
          (TEST_weight_files_probe && !TEST_weight_files_probe(ranks.rank()))) {
        return Status::NotFound(dir + " is not the checkpoint rank 0 restored");
      }
      ASSIGN_OR_RETURN(auto files, common::ModelWeights::Open(dir, shapes, "a checkpoint"));
      return read(*files);
    }();
  }
  std::vector<at::Tensor> blind = {at::full({1}, mine.ok() ? 0.0 : 1.0, flag)};
  RETURN_IF_ERROR(ranks.AllReduceSum(blind, what + " (who read its shard)"));
  const int64_t missed = static_cast<int64_t>(blind[0].item<double>());
  if (missed > 0 && is_root) {
    GRPO_LOG_WARN("{} of {} learner ranks do not see {} (output_dir is not shared): {}", missed,
                  ranks.world_size(), root.files->dir(), fallback);
  }
  if (missed > 0 && !mine.ok()) {
    GRPO_LOG_WARN("learner rank {} does not read its shard of rank 0's checkpoint: {}",
                  ranks.rank(), mine.ToString());
  }
  return missed;
}

}  // namespace grpo::learner::distributed
