// The CUDA module: everything of ours that needs libtorch's CUDA part, CUDA's runtime or NCCL
// (the NCCL and CUDA IPC weight syncs, c10d's ProcessGroupNCCL), behind a table of functions.
//
// Why a module: the `grpo` binary links libtorch without its CUDA part. Loading libtorch_cuda and
// the CUDA libraries it needs (cuBLAS, cuDNN, cuSPARSE, cuFFT, NCCL ...) cost every process
// 0.14 s of CPU and 355 MB of mapped pages at start, on machines that have no GPU to use them:
// the demo's learner and workers start side by side on a laptop, and every test starts a few.
// On a machine with an NVIDIA device, main() loads libgrpo_cuda.so (which links all of libtorch)
// before anything asks libtorch about CUDA: libtorch decides once, at the first question, whether
// CUDA exists in the process, so a module loaded after that would find CUDA off for good.
//
// Test and benchmark programs link all of libtorch and the module's code (target
// grpo_cuda_linked) instead: Cuda() is then the linked table, with nothing loaded.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/status.h"
#include "common/weight_sync/weight_sync.h"

namespace grpo::common {

// Bumped whenever CudaModule changes: the loader passes it to the module's entry, which refuses
// a loader built from other sources.
inline constexpr int kCudaModuleAbi = 1;

struct CudaModule {
  // common/weight_sync/nccl_weight_sync.h and cuda_ipc_weight_sync.h, on CUDA device `device`.
  StatusOr<std::unique_ptr<WeightSync>> (*create_nccl_weight_sync)(
      c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int64_t epoch,
      const WeightSyncOptions& sync, int device) = nullptr;
  StatusOr<std::unique_ptr<WeightSync>> (*create_cuda_ipc_weight_sync)(
      c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int64_t epoch,
      const WeightSyncOptions& sync, int device) = nullptr;
  // "GPU-xxxxxxxx-...", as nvidia-smi -L prints it.
  StatusOr<std::string> (*device_uuid)(int device) = nullptr;
  // c10d's ProcessGroupNCCL over `store` (communicators made at the first collective); throws
  // what its constructor throws.
  c10::intrusive_ptr<c10d::Backend> (*create_nccl_backend)(
      c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
      std::chrono::milliseconds timeout) = nullptr;
};

// The module of this process: the linked one, else the one LoadCudaModule loaded; nullptr when
// neither (a CPU-only process).
const CudaModule* Cuda();

// main()'s decision, from GRPO_CUDA:
// - unset or "auto": load the module when this machine has an NVIDIA device (/dev/nvidiactl or
//   /proc/driver/nvidia/gpus); a module that fails to load is a warning on stderr, and the
//   process runs on the CPU;
// - "1" / "on": load it, and an error when it cannot be loaded;
// - "0" / "off": do not.
// The module is GRPO_CUDA_MODULE when set, else libgrpo_cuda.so beside the executable or in
// ../lib/grpo/ from it. Call it first thing, before anything touches libtorch's CUDA state.
Status LoadCudaModule();

// One line for logs and `grpo --version`: whether the module is here, where from, and why not.
std::string CudaModuleState();

// For the linked module's static registration (cuda_module_impl.cc); not for other callers.
void RegisterLinkedCudaModule(const CudaModule* module);

}  // namespace grpo::common
