// WeightReceiver: where a rollout worker gets a policy version's weights from. Implementations:
// services::GrpcWeightReceiver (the learner's chunked GetWeights stream, the fallback that always
// works) and rollout::GroupWeightReceiver (the learner's weight-sync group: Gloo, NCCL or CUDA
// IPC, rollout/group_weight_receiver.h). Header only and free of gRPC.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/model/model.h"
#include "common/status.h"

namespace grpo::rollout {

// Deadline for receiving every tensor of one policy version.
inline constexpr std::chrono::milliseconds kDefaultWeightReceiveTimeout{300000};

// What the learner said of this worker's weight-sync group at its last Register/Heartbeat.
struct GroupMembership {
  std::string worker_id;
  int64_t epoch = 0;  // 0: not registered yet
  // The backend the learner assigned at Register (common/weight_sync/group.h AssignBackend);
  // empty from a learner that does not assign (then: the one the worker asked for).
  std::string backend;
  // The learner process that answered (its incarnation; empty from an older learner). Epochs
  // and versions are that process's: a restarted learner numbers both anew.
  std::string learner_incarnation;
};

// A policy version as a receiver installed it: its number and the incarnation of the learner
// process that published it (empty when the source does not say: an older learner).
struct ReceivedVersion {
  int64_t version = -1;
  std::string incarnation;
};

// Not thread-safe: one Receive at a time (a worker's main loop calls it between rounds).
class WeightReceiver {
 public:
  virtual ~WeightReceiver() = default;

  // Overwrites every parameter of `model` with the policy of version >= `min_version` (the
  // source's current one) and returns that version with the incarnation that published it.
  // Never a version of a learner incarnation other than the membership's (SetGroup), where the
  // receiver knows it. `model` must be a fresh instance that no Generator uses yet: on error it
  // holds an unspecified mix and is discarded by the caller. Unavailable / DeadlineExceeded are
  // worth retrying; DataLoss (malformed stream) and InvalidArgument (names or shapes that do
  // not fit `model`) are not.
  virtual StatusOr<ReceivedVersion> Receive(int64_t min_version, common::Model& model,
                                            std::chrono::milliseconds timeout) = 0;

  // "grpc", "gloo", "nccl", "cuda_ipc", "auto": what the worker asks for on Register.
  virtual std::string backend() const = 0;

  // The worker's id, the weight-sync group epoch and the backend the learner assigned, after
  // every Register and Heartbeat. Called from the worker's heartbeat thread too: receivers that
  // use it make it thread-safe.
  virtual void SetGroup(const GroupMembership& /*membership*/) {}
};

}  // namespace grpo::rollout
