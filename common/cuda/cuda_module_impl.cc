// The CUDA module's table (common/cuda/cuda_module.h), built twice: as libgrpo_cuda.so, which
// the `grpo` binary loads on a machine with an NVIDIA device (the exported grpo_cuda_module), and
// as objects linked into test and benchmark programs (GRPO_CUDA_MODULE_LINKED: registered as
// the program starts).
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <utility>

#include "common/cuda/cuda_module.h"
#include "common/weight_sync/cuda_ipc_weight_sync.h"
#include "common/weight_sync/cuda_util.h"
#include "common/weight_sync/nccl_weight_sync.h"

namespace grpo::common {
namespace {

StatusOr<std::unique_ptr<WeightSync>> NcclWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                     int rank, int world_size, int64_t epoch,
                                                     const WeightSyncOptions& sync, int device) {
  NcclWeightSyncOptions options;
  options.sync = sync;
  options.device = device;
  return CreateNcclWeightSync(std::move(store), rank, world_size, epoch, options);
}

StatusOr<std::unique_ptr<WeightSync>> CudaIpcWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                        int rank, int world_size, int64_t epoch,
                                                        const WeightSyncOptions& sync, int device) {
  CudaIpcWeightSyncOptions options;
  options.sync = sync;
  options.device = device;
  return CreateCudaIpcWeightSync(std::move(store), rank, world_size, epoch, options);
}

c10::intrusive_ptr<c10d::Backend> NcclBackend(c10::intrusive_ptr<c10d::Store> store, int rank,
                                              int world_size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(std::move(store), rank, world_size, options);
}

const CudaModule kModule = [] {
  CudaModule m;
  m.create_nccl_weight_sync = &NcclWeightSync;
  m.create_cuda_ipc_weight_sync = &CudaIpcWeightSync;
  m.device_uuid = &CudaDeviceUuid;
  m.create_nccl_backend = &NcclBackend;
  return m;
}();

#ifdef GRPO_CUDA_MODULE_LINKED
const bool kRegistered = [] {
  RegisterLinkedCudaModule(&kModule);
  return true;
}();
#endif

}  // namespace
}  // namespace grpo::common

// The loader's entry (dlsym): the table, or nullptr when the loader was built against another
// CudaModule.
extern "C" __attribute__((visibility("default"))) const grpo::common::CudaModule* grpo_cuda_module(
    int abi) {
  return abi == grpo::common::kCudaModuleAbi ? &grpo::common::kModule : nullptr;
}
