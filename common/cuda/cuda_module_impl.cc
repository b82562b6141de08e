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

// The NCCL or CUDA IPC backend (`Options` with its `Create`) on CUDA device `device`.
template <typename Options, StatusOr<std::unique_ptr<WeightSync>> (*Create)(
                                c10::intrusive_ptr<c10d::Store>, int, int, int64_t, const Options&)>
StatusOr<std::unique_ptr<WeightSync>> DeviceWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                       int rank, int world_size, int64_t epoch,
                                                       const WeightSyncOptions& sync, int device) {
  Options options;
  options.sync = sync;
  options.device = device;
  return Create(std::move(store), rank, world_size, epoch, options);
}

c10::intrusive_ptr<c10d::Backend> NcclBackend(c10::intrusive_ptr<c10d::Store> store, int rank,
                                              int world_size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(std::move(store), rank, world_size, options);
}

const CudaModule kModule = [] {
  CudaModule m;
  m.create_nccl_weight_sync = &DeviceWeightSync<NcclWeightSyncOptions, &CreateNcclWeightSync>;
  m.create_cuda_ipc_weight_sync =
      &DeviceWeightSync<CudaIpcWeightSyncOptions, &CreateCudaIpcWeightSync>;
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
