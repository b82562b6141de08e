#include "learner/distributed/trainer_rank.h"

#include "common/logging.h"
#include "learner/checkpoint.h"
#include "learner/distributed/group_codec.h"
#include "learner/grpo_trainer.h"

namespace grpo::learner::distributed {

std::string EncodeCommand(RankCommand command, const std::vector<common::RolloutGroup>& groups) {
  std::string out(1, static_cast<char>(command));
  if (command == RankCommand::kTrain) out += EncodeGroups(groups);
  return out;
}

Status ServeRankZero(RankGroup& group, GrpoTrainer& trainer) {
  const std::string me = "learner rank " + std::to_string(group.rank());
  while (true) {
    StatusOr<std::string> next = group.Next();
    if (!next.ok()) return next.status();
    const std::string& bytes = *next;
    if (bytes.empty()) return Status::DataLoss(me + ": an empty command from rank 0");
    switch (static_cast<RankCommand>(bytes[0])) {
      case RankCommand::kSync:
        RETURN_IF_ERROR(trainer.SyncFromRankZero());
        GRPO_LOG_INFO("{}: at rank 0's step {}", me, trainer.global_step());
        break;
      case RankCommand::kTrain: {
        ASSIGN_OR_RETURN(const std::vector<common::RolloutGroup> groups,
                         DecodeGroups(bytes.substr(1)));
        ASSIGN_OR_RETURN(const GenerationBatchResult result, trainer.TrainGenerationBatch(groups));
        GRPO_LOG_INFO("{}: trained {} groups, {} steps, now at step {}", me, result.groups_trained,
                      result.steps.size(), trainer.global_step());
        break;
      }
      case RankCommand::kFlush:
        RETURN_IF_ERROR(trainer.FlushPartialStep().status());
        break;
      case RankCommand::kCheckpoint:
        // Rank 0 writes the checkpoint; each rank writes its shard of a sharded AdamW state
        // into it (or, output_dir not shared, it is gathered there), and full_shard's weights
        // are gathered there.
        RETURN_IF_ERROR(JoinSaveCheckpoint(trainer, trainer.config().output_dir));
        break;
      case RankCommand::kPublish:
        // Sharded parameters: rank 0 publishes the weights, gathered a unit (or bucket) at a
        // time.
        RETURN_IF_ERROR(trainer.optimizer()
                            .GatherWeights("gather of the weights to publish at step " +
                                               std::to_string(trainer.global_step()),
                                           /*every_rank=*/false)
                            .status());
        break;
      case RankCommand::kStop:
        GRPO_LOG_INFO("{}: rank 0 ended the job at step {}", me, trainer.global_step());
        return Status::OK();
      default:
        return Status::DataLoss(me + ": unknown command " +
                                std::to_string(static_cast<int>(bytes[0])) + " from rank 0");
    }
  }
}

}  // namespace grpo::learner::distributed
