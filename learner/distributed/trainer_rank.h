// What rank 0 (the service) tells the other learner ranks, and the loop by which a rank > 0
// (a trainer) does it (docs/ARCHITECTURE.md "Learner ranks"): every rank makes the same
// trainer calls in the same order, so every collective inside them is matched. Commands go over
// the rank group's store (RankGroup::Post / Next); the gradients over its collectives.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/rollout_types.h"
#include "common/status.h"
#include "learner/distributed/rank_group.h"

namespace grpo::learner {
class GrpoTrainer;
}

namespace grpo::learner::distributed {

enum class RankCommand : uint8_t {
  kSync = 1,        // GrpoTrainer::SyncFromRankZero (at start, after rank 0 restored a checkpoint)
  kTrain = 2,       // TrainGenerationBatch on the groups that follow
  kFlush = 3,       // FlushPartialStep
  kStop = 4,        // the job is over: leave the loop
  kCheckpoint = 5,  // rank 0 saves a checkpoint: join the gather of AdamW's state (sharded)
  kPublish = 6,     // rank 0 publishes the weights: join their gather (full_shard)
};

// The command's bytes; `groups` for kTrain.
std::string EncodeCommand(RankCommand command,
                          const std::vector<common::RolloutGroup>& groups = {});

// Rank 0's side: posts each command before making the same call on its own trainer.
class RankZeroLink {
 public:
  explicit RankZeroLink(RankGroup* group) : group_(group) {}
  Status Sync() { return group_->Post(EncodeCommand(RankCommand::kSync)); }
  Status Train(const std::vector<common::RolloutGroup>& groups) {
    return group_->Post(EncodeCommand(RankCommand::kTrain, groups));
  }
  Status Flush() { return group_->Post(EncodeCommand(RankCommand::kFlush)); }
  Status Stop() { return group_->Post(EncodeCommand(RankCommand::kStop)); }
  Status Checkpoint() { return group_->Post(EncodeCommand(RankCommand::kCheckpoint)); }
  Status Publish() { return group_->Post(EncodeCommand(RankCommand::kPublish)); }

 private:
  RankGroup* group_;
};

// The loop of a rank > 0: runs rank 0's commands on `trainer` (created with `group` as its
// ranks) until kStop (OK: the job ended) or until a command fails (its Status: a rank left or
// stalled, rank 0 is gone, a step failed). Logs each generation batch it trains.
Status ServeRankZero(RankGroup& group, GrpoTrainer& trainer);

}  // namespace grpo::learner::distributed
