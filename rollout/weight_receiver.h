// WeightReceiver: where a rollout worker gets a policy version's weights from. Implementations:
// services::GrpcWeightReceiver (the learner's chunked GetWeights stream, the fallback that always
// works) and, later, a c10d receiver (Gloo on CPU, NCCL on GPU) beside the learner's WeightSync.
// Header only and free of gRPC, so a c10d receiver can live in rollout/.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "common/model.h"
#include "common/status.h"

namespace grpo::rollout {

// Deadline for receiving every tensor of one policy version.
inline constexpr std::chrono::milliseconds kDefaultWeightReceiveTimeout{300000};

// Not thread-safe: one Receive at a time (a worker's main loop calls it between rounds).
class WeightReceiver {
 public:
  virtual ~WeightReceiver() = default;

  // Overwrites every parameter of `model` with the policy of version >= `min_version` (the
  // source's current one) and returns that version. `model` must be a fresh instance that no
  // Generator uses yet: on error it holds an unspecified mix and is discarded by the caller.
  // Unavailable / DeadlineExceeded are worth retrying; DataLoss (malformed stream) and
  // InvalidArgument (names or shapes that do not fit `model`) are not.
  virtual StatusOr<int64_t> Receive(int64_t min_version, common::Model& model,
                                    std::chrono::milliseconds timeout) = 0;

  // "grpc", "gloo", "nccl": what to report in logs and on Register.
  virtual std::string backend() const = 0;

  // The worker's id and the weight-sync group epoch, after every Register and Heartbeat. Called
  // from the worker's heartbeat thread too: receivers that use it make it thread-safe.
  virtual void SetGroup(const std::string& /*worker_id*/, int64_t /*group_epoch*/) {}
};

}  // namespace grpo::rollout
