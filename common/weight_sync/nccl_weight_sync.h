// NcclWeightSync: WeightSync between GPUs through the NCCL API directly
// (docs/ARCHITECTURE.md "Weight sync"). The communicator is non-blocking
// (ncclCommInitRankConfig with blocking = 0); every collective is waited for against its
// deadline by polling ncclCommGetAsyncError and cudaStreamQuery, and ncclCommAbort tears the
// group down on a timeout, so a dead peer costs one deadline, not a hang. The NCCL unique id
// travels through the c10d Store under "grpo/weight_sync/<epoch>/". Needs no CUDA libtorch:
// tensors only lend their data_ptr(), which must point to CUDA device (or managed) memory of
// `device`; the tensor's own device field is not consulted (a CPU-only libtorch can describe
// device memory with at::from_blob). Built only where CUDA and NCCL are found (target
// grpo_nccl_sync).
#pragma once

#include <cstdint>
#include <memory>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/status.h"
#include "common/weight_sync/weight_sync.h"

namespace grpo::common {

struct NcclWeightSyncOptions {
  WeightSyncOptions sync;  // verify_checksum is ignored: the bytes stay on the device
  int device = 0;          // CUDA device ordinal of this rank
};

// Joins the group: rank 0 publishes an NCCL unique id on `store`, every rank creates its
// communicator. DeadlineExceeded (communicator aborted) when the group is not complete within
// options.sync.timeout; Unavailable for CUDA/NCCL failures (no device, init error);
// InvalidArgument for a bad rank/world/option.
StatusOr<std::unique_ptr<WeightSync>> CreateNcclWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                           int rank, int world_size, int64_t epoch,
                                                           const NcclWeightSyncOptions& options);

}  // namespace grpo::common
