// Training checkpoints: `<output_dir>/checkpoint-<step>/` holding
//   model.safetensors + config.json   (Hugging Face layout: loads in Model::Load and HF tools)
//   optimizer.safetensors             (AdamW moments and step)
//   trainer_state.json                (global step, policy version, RNG state, schedule)
//   tokenizer files                   (copied from the model directory when present)
//   SHA256SUMS                        (`sha256sum -c` format, over every other file)
// written to a temporary directory, fsynced and renamed, then `<output_dir>/latest` (a file
// holding the directory name) is replaced the same way. Loading verifies the checksums; a
// corrupt or partial checkpoint is refused and the previous one is used.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "learner/grpo_trainer.h"

namespace grpo::learner {

inline constexpr const char* kLatestFile = "latest";

// Saves the trainer's current state; returns the checkpoint directory. Files named in
// `tokenizer_dir` (tokenizer.json, tokenizer_config.json ...) are copied when they exist.
// Rank 0 writes; with a sharded optimizer every other rank calls JoinSaveCheckpoint at the
// same time. A sharded AdamW state is written by each rank, its own shard
// (`optimizer-rank-<r>-of-<N>.safetensors`, distributed/state_shards.h) into rank 0's
// directory, when every rank sees it (a probe); otherwise (ranks that do not share output_dir)
// it is gathered and written whole by rank 0 (`optimizer.safetensors`). full_shard's weights
// are gathered a unit at a time, and rank 0 holds them whole on the CPU while it writes the
// Hugging Face model.safetensors.
StatusOr<std::string> SaveCheckpoint(GrpoTrainer& trainer, const std::string& output_dir,
                                     const std::string& tokenizer_dir);
// A rank > 0's part of rank 0's SaveCheckpoint into `output_dir` (rank 0's, as this rank sees
// it): its collectives, in the same order. A failure of rank 0's checkpoint is not this rank's:
// OK then.
Status JoinSaveCheckpoint(GrpoTrainer& trainer, const std::string& output_dir);
// Tests: whether learner rank `rank` sees rank 0's checkpoint directory (the probe's answer
// replaced), to exercise the fallback for ranks that do not share output_dir.
extern std::function<bool(int rank)> TEST_state_shard_probe;

// DataLoss naming the file when a checksum does not match or a file is missing;
// NotFound when `dir` has no SHA256SUMS (a partial checkpoint).
Status VerifyCheckpoint(const std::string& dir);

// Checkpoint directories under output_dir, newest (highest step) first.
std::vector<std::string> ListCheckpoints(const std::string& output_dir);

// Removes checkpoint directories beyond the newest `keep` (0 = none removed); the one `latest`
// names is always kept. Returns the directories removed; a directory that cannot be removed is
// logged and left (the next call tries again).
std::vector<std::string> PruneCheckpoints(const std::string& output_dir, int64_t keep);

// Restores model weights, optimizer state, counters and RNG state from the newest valid
// checkpoint (the one `latest` names, else the highest step); invalid ones are skipped with a
// warning naming them. Returns the directory used; NotFound when there is none.
StatusOr<std::string> RestoreLatestCheckpoint(GrpoTrainer& trainer, const std::string& output_dir);

// Restores from one checkpoint directory (verified first). full_shard: each rank keeps its
// shard of the weights and rank 0 the whole until GrpoTrainer::SyncFromRankZero. An AdamW state
// in per-rank shards of any world size is assembled whole by an optimizer that holds it whole,
// and read run by run by each rank of a sharded one (in GrpoTrainer::SyncFromRankZero).
Status RestoreCheckpoint(GrpoTrainer& trainer, const std::string& dir);

}  // namespace grpo::learner
