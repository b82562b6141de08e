// CUDA runtime helpers of the GPU weight-sync backends (NCCL, CUDA IPC): errors as Status, a
// stream wait with a deadline, and a device's identity. Internal to common/weight_sync/; built
// only where CUDA's runtime is found (target grpo_cuda_sync).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <string>

#include "common/status.h"
#include "common/weight_sync/weight_sync_protocol.h"

namespace grpo::common {

// Unavailable("<what>: CUDA error <name> (<text>)").
Status CudaError(cudaError_t e, const std::string& what);

#define GRPO_CUDA_RETURN(expr, what)                                                           \
  do {                                                                                         \
    cudaError_t grpo_cuda_err_ = (expr);                                                       \
    if (grpo_cuda_err_ != cudaSuccess) return ::grpo::common::CudaError(grpo_cuda_err_, what); \
  } while (0)

// Polls `stream` until its work is done: DeadlineExceeded past `deadline`. `also` (may be
// empty) runs at every poll; its error ends the wait (NCCL checks its communicator there).
Status WaitCudaStream(cudaStream_t stream, std::chrono::steady_clock::time_point deadline,
                      std::chrono::milliseconds timeout, const std::string& what,
                      const std::function<Status()>& also = {});

// OK when `ptr` is device memory of GPU `device` (or managed memory).
Status CheckCudaPointer(const void* ptr, int device, const std::string& name);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it.
StatusOr<std::string> CudaDeviceUuid(int device);

// The memory primitives of a backend whose bytes live in CUDA device memory of one GPU (NCCL,
// CUDA IPC): tensors checked to be on `device`, a growable device staging buffer, copies on the
// backend's stream, libtorch's stream waited for before bytes move; no host checksum. The
// derived backend creates stream_, says when it can take calls (Ready) and waits for its stream
// (Synchronize), and frees the staging buffer when it tears down (FreeStaging).
class DeviceMemoryWeightSync : public CollectiveWeightSync {
 protected:
  DeviceMemoryWeightSync(int rank, int world_size, int64_t epoch, WeightSyncOptions options,
                         int device)
      : CollectiveWeightSync(rank, world_size, epoch, options), device_(device) {}

  Status CheckTensorMemory(const std::string& name, const at::Tensor& t) override;
  StatusOr<uint8_t*> Staging(int64_t bytes) override;
  Status CopyBytes(void* dst, const void* src, int64_t bytes) override;
  Status PrepareMemory() override;
  bool host_memory() const override { return false; }
  // OK when the group can take calls; makes `device_` current.
  virtual Status Ready() = 0;
  void FreeStaging();

  const int device_;
  cudaStream_t stream_ = nullptr;

 private:
  uint8_t* staging_ = nullptr;
  int64_t staging_bytes_ = 0;
};

}  // namespace grpo::common
