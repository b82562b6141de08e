// The gRPC weight path of a rollout worker: LearnerService.GetWeights streams a policy version as
// chunks of its tensors; WeightAssembler puts them back together and GrpcWeightReceiver loads
// them into a fresh Model. MakeWeightReceiver builds a worker's receiver for its
// weight_sync_backend (a group receiver over the learner's Store RPC, GetWeights behind it).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "common/model/safetensors.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "rollout/group_weight_receiver.h"
#include "rollout/weight_receiver.h"

namespace grpo::services {

// Reassembles one GetWeights stream. Chunks of different tensors may interleave and a tensor's
// chunks may come in any order; the first chunk of a tensor (in stream order) must carry its
// name, dtype, shape and tensor_bytes, and later ones the same name, version and incarnation. Data
// is little-endian, as in safetensors. Not thread-safe.
class WeightAssembler {
 public:
  // DataLoss naming the tensor for: a version or learner-incarnation change mid-stream, a chunk out
  // of the tensor's bounds, bytes received twice (count beyond tensor_bytes), tensor_bytes that do
  // not match shape x dtype, an unknown dtype, or a chunk after `last`.
  Status Add(const v1::WeightChunk& chunk);
  // After the stream ended: the tensors in order of first appearance, with the version.
  // DataLoss when `last` never came or a tensor is incomplete.
  StatusOr<common::NamedTensors> Finish();

  int64_t version() const { return version_; }
  // The learner_incarnation that published the version (WeightChunk.incarnation).
  const std::string& incarnation() const { return incarnation_; }
  int64_t bytes_received() const { return bytes_received_; }

 private:
  struct Partial {
    at::Tensor tensor;     // CPU, contiguous, its final dtype and shape
    int64_t received = 0;  // bytes copied in so far
  };

  int64_t version_ = -1;  // -1 = no chunk yet
  std::string incarnation_;
  bool last_seen_ = false;
  int64_t bytes_received_ = 0;
  std::vector<std::string> order_;
  std::map<std::string, Partial> tensors_;
};

// Deadline for one GetWeights stream (every chunk of one version).
inline constexpr std::chrono::milliseconds kDefaultGetWeightsTimeout =
    rollout::kDefaultWeightReceiveTimeout;

// Thread-compatible (one Receive at a time). The channel is shared; `auth_token` (may be empty)
// travels with every call.
class GrpcWeightReceiver final : public rollout::WeightReceiver {
 public:
  // chunk_bytes: requested chunk size; 0 = the learner's default.
  GrpcWeightReceiver(std::shared_ptr<grpc::Channel> channel, std::string auth_token,
                     int64_t chunk_bytes = 0);

  // Streams GetWeights(min_version) under `timeout`, reassembles and Model::LoadStateFrom's;
  // the version with the incarnation its chunks carry (the learner that serves it now).
  // gRPC errors keep their code (Unavailable etc.); see WeightAssembler and LoadStateFrom.
  StatusOr<rollout::ReceivedVersion> Receive(int64_t min_version, common::Model& model,
                                             std::chrono::milliseconds timeout) override;
  std::string backend() const override { return "grpc"; }
  // Remembers the learner incarnation registered with: its requests say whose numbering
  // min_version is in (GetWeightsRequest.incarnation).
  void SetGroup(const rollout::GroupMembership& membership) override;

  int64_t last_bytes() const { return last_bytes_; }  // bytes of the last successful Receive

 private:
  std::unique_ptr<v1::LearnerService::Stub> stub_;
  const std::string auth_token_;
  const int64_t chunk_bytes_;
  int64_t last_bytes_ = 0;
  common::Mutex mu_;  // SetGroup may come from the worker's heartbeat thread
  std::string registered_with_ GRPO_GUARDED_BY(mu_);
};

// How a worker's group receiver joins the learner's weight-sync groups.
struct WeightGroupOptions {
  // Deadline of the rendezvous and of each collective (the learner's weight_sync_timeout).
  std::chrono::milliseconds timeout = common::kDefaultBroadcastTimeout;
  // Receive waits this long for the group's copy of a version before it uses GetWeights.
  std::chrono::milliseconds version_wait = rollout::kDefaultGroupVersionWait;
  std::string hostname;  // gloo: the address this rank listens on (empty: the hostname)
};

// The receiver of a worker whose weight_sync_backend is `backend`: "grpc" is a
// GrpcWeightReceiver; gloo, nccl, cuda_ipc and auto are a rollout::GroupWeightReceiver over the
// learner's Store RPC (GrpcEpochStore) with the built-in backends, receiving on `device` (the
// GPU backends) and falling back to GetWeights. InvalidArgument for another name.
StatusOr<std::unique_ptr<rollout::WeightReceiver>> MakeWeightReceiver(
    std::shared_ptr<grpc::Channel> channel, const std::string& auth_token,
    const std::string& backend, int64_t chunk_bytes, const WeightGroupOptions& group,
    const at::Device& device);

}  // namespace grpo::services
