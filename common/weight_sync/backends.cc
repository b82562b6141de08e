#include "common/weight_sync/backends.h"

#include <charconv>
#include <utility>

#include "common/cuda/cuda_module.h"
#include "common/weight_sync/gloo_weight_sync.h"

namespace grpo::common {

bool WeightSyncBackendBuilt(std::string_view backend) {
  if (backend == kBackendGloo) {
#ifdef GRPO_HAVE_GLOO
    return true;
#else
    return false;
#endif
  }
  if (backend == kBackendNccl || backend == kBackendCudaIpc) return Cuda() != nullptr;
  return false;
}

WeightSyncFactory BuiltinWeightSyncFactory(WeightSyncBackendOptions options) {
  return [options = std::move(options)](
             std::string_view backend, c10::intrusive_ptr<c10d::Store> store, int rank,
             int world_size, int64_t epoch) -> StatusOr<std::unique_ptr<WeightSync>> {
    if (backend != kBackendGloo && backend != kBackendNccl && backend != kBackendCudaIpc) {
      return Status::InvalidArgument("'" + std::string(backend) +
                                     "' is not a weight-sync group backend");
    }
    if (!WeightSyncBackendBuilt(backend)) {
      if (backend == kBackendGloo) {
        return Status::Unimplemented(
            "gloo weight sync is not built into this binary (libgloo-dev, GRPO_WITH_GLOO)");
      }
      return Status::Unimplemented(std::string(backend) +
                                   " weight sync needs the CUDA module (CUDA runtime and NCCL, "
                                   "GRPO_WITH_NCCL), which this process does not have: " +
                                   CudaModuleState());
    }
    WeightSyncOptions sync;
    sync.timeout = options.timeout;
    sync.bucket_bytes = options.bucket_bytes;
    if (backend == kBackendGloo) {
      GlooWeightSyncOptions gloo;
      gloo.sync = sync;
      gloo.hostname = options.hostname;
      return CreateGlooWeightSync(std::move(store), rank, world_size, epoch, gloo);
    }
    const CudaModule* cuda = Cuda();
    if (backend == kBackendNccl) {
      return cuda->create_nccl_weight_sync(std::move(store), rank, world_size, epoch, sync,
                                           options.cuda_device);
    }
    sync.bucket_bytes = options.ipc_bucket_bytes;
    return cuda->create_cuda_ipc_weight_sync(std::move(store), rank, world_size, epoch, sync,
                                             options.cuda_device);
  };
}

int CudaOrdinal(const std::string& device) {
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) != 0) return -1;
  int n = -1;
  const char* b = device.data() + 5;
  const char* e = device.data() + device.size();
  auto [p, ec] = std::from_chars(b, e, n);
  return ec == std::errc() && p == e && b != e ? n : -1;
}

SyncEndpoint LocalSyncEndpoint(const std::string& device) {
  SyncEndpoint e;
  const int ordinal = CudaOrdinal(device);
  if (ordinal < 0) return e;
  e.cuda = true;
  if (const CudaModule* cuda = Cuda()) {
    if (StatusOr<std::string> uuid = cuda->device_uuid(ordinal); uuid.ok()) e.gpu_uuid = *uuid;
  }
  return e;
}

}  // namespace grpo::common
