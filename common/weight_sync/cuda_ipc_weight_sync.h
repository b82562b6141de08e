// CudaIpcWeightSync: WeightSync between processes on one GPU through CUDA IPC
// (docs/ARCHITECTURE.md "Weight sync"). NCCL refuses two ranks on one GPU, so a worker on the
// learner's own GPU gets each version this way, without a trip through host memory.
//
// Rank 0 owns one exported device buffer of options.sync.bucket_bytes (cudaMalloc +
// cudaIpcGetMemHandle); each receiver maps it once per group (cudaIpcOpenMemHandle). One
// collective is a numbered round on the store, under "grpo/weight_sync/<epoch>/ipc/":
//   broadcast  rank 0 copies the bytes into the buffer, waits for the copy, sets "c/<n>";
//              each receiver copies out of the mapping, waits, sets "c/<n>/done/<r>" ("ok" or
//              its error); rank 0 waits for every receiver before the buffer is reused;
//   all-gather each rank sets "c/<n>/ag/<r>", reads every rank's, and receivers ack as above.
// Rank 0 deletes a round's keys after the acks, so an epoch's key count stays bounded. Every
// wait has the deadline options.sync.timeout; an aborting rank sets "abort", which ends its
// peers' waits at once (Aborted). The protocol above it (Begin/Broadcast/Commit, the layout
// check, the version agreement) is CollectiveWeightSync's, the same as Gloo's and NCCL's;
// Commit compares bytes, not a checksum (the bytes stay on the device).
//
// Ranks must be different processes (CUDA cannot open its own process's IPC handle) on GPUs
// that can map each other's memory (the same GPU here). Built with the NCCL backend (target
// grpo_cuda_sync).
#pragma once

#include <cstdint>
#include <memory>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/status.h"
#include "common/weight_sync/weight_sync.h"

namespace grpo::common {

// IPC's default bucket: few store rounds per version (a 0.6B model in bf16 is 5 buckets).
inline constexpr int64_t kDefaultCudaIpcBucketBytes = 256ll << 20;

struct CudaIpcWeightSyncOptions {
  WeightSyncOptions sync;  // verify_checksum is ignored: the bytes stay on the device
  int device = 0;          // CUDA device ordinal of this rank
};

// Joins the group: rank 0 allocates and exports the buffer, every rank checks in; receivers map
// the buffer. DeadlineExceeded when the group is not complete within options.sync.timeout;
// Unavailable for CUDA failures (no device, a handle that does not open); InvalidArgument for a
// bad rank/world/option.
StatusOr<std::unique_ptr<WeightSync>> CreateCudaIpcWeightSync(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int64_t epoch,
    const CudaIpcWeightSyncOptions& options);

}  // namespace grpo::common
