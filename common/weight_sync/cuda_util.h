// CUDA runtime helpers of the GPU weight-sync backends (NCCL, CUDA IPC): errors as Status, a
// stream wait with a deadline, and a device's identity. Internal to common/weight_sync/; built
// only where CUDA's runtime is found (target grpo_cuda_sync).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <string>

#include "common/status.h"

namespace grpo::common {

// Unavailable("<what>: CUDA error <name> (<text>)").
Status CudaError(cudaError_t e, const std::string& what);

#define GRPO_CUDA_RETURN(expr, what)                                                    \
  do {                                                                                  \
    cudaError_t grpo_cuda_err_ = (expr);                                                \
    if (grpo_cuda_err_ != cudaSuccess) return ::grpo::common::CudaError(grpo_cuda_err_, \
                                                                        what);          \
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

}  // namespace grpo::common
