// The weight-sync backends built into this binary, behind one factory: what the learner's
// publisher (learner/weight_publisher.h) and a worker's group receiver
// (rollout/group_weight_receiver.h) take, so that a backend is configuration, not code.
// Target grpo_weight_sync_backends: Gloo when its headers were found (GRPO_WITH_GLOO); NCCL and
// CUDA IPC when the process has the CUDA module (common/cuda/cuda_module.h; GRPO_WITH_NCCL
// builds it where CUDA's runtime and NCCL are found).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/status.h"
#include "common/weight_sync/group.h"
#include "common/weight_sync/weight_sync.h"

namespace grpo::common {

// Creates this rank's member of a group: (backend, store of the group's epoch, rank, world,
// epoch). The store is the caller's, already scoped to the group (GroupPrefix).
using WeightSyncFactory = std::function<StatusOr<std::unique_ptr<WeightSync>>(
    std::string_view backend, c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
    int64_t epoch)>;

struct WeightSyncBackendOptions {
  std::chrono::milliseconds timeout = kDefaultBroadcastTimeout;  // of every collective
  std::string hostname;  // gloo: the address this rank listens on (empty: the hostname)
  int cuda_device = 0;   // nccl, cuda_ipc: this rank's CUDA device ordinal
  int64_t bucket_bytes = kDefaultBucketBytes;  // gloo, nccl
  int64_t ipc_bucket_bytes = 256ll << 20;      // cuda_ipc (kDefaultCudaIpcBucketBytes)
};

// True when `backend` (gloo, nccl, cuda_ipc) is in this process: gloo built in, nccl and
// cuda_ipc with the CUDA module.
bool WeightSyncBackendBuilt(std::string_view backend);

// The factory of the built-in backends; Unimplemented for a backend that is not here (say
// which option builds it, or why the CUDA module is not loaded), InvalidArgument for a name
// that is not a group backend.
WeightSyncFactory BuiltinWeightSyncFactory(WeightSyncBackendOptions options);

// Where this process computes, for AssignBackend: `device` as common/model/device.h resolves it
// ("cpu", "cuda:N"). A CUDA device's UUID needs the CUDA module; without it the UUID is empty
// and AssignBackend never sees two ends on one GPU.
SyncEndpoint LocalSyncEndpoint(const std::string& device);

// The CUDA ordinal of "cuda" / "cuda:N" (0 for "cuda"); -1 for anything else.
int CudaOrdinal(const std::string& device);

}  // namespace grpo::common
