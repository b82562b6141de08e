#include "common/weight_sync/backends.h"

#include <charconv>
#include <utility>

#include "common/weight_sync/gloo_weight_sync.h"
#ifdef GRPO_HAVE_CUDA_SYNC
#include "common/weight_sync/cuda_ipc_weight_sync.h"
#include "common/weight_sync/cuda_util.h"
#include "common/weight_sync/nccl_weight_sync.h"
#endif

namespace grpo::common {

bool WeightSyncBackendBuilt(std::string_view backend) {
  if (backend == kBackendGloo) {
#ifdef GRPO_HAVE_GLOO
    return true;
#else
    return false;
#endif
  }
  if (backend == kBackendNccl || backend == kBackendCudaIpc) {
#ifdef GRPO_HAVE_CUDA_SYNC
    return true;
#else
    return false;
#endif
  }
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
      return Status::Unimplemented(
          std::string(backend) + " weight sync is not built into this binary (" +
          (backend == kBackendGloo ? "libgloo-dev, GRPO_WITH_GLOO"
                                   : "CUDA runtime and NCCL, GRPO_WITH_NCCL") +
          ")");
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
#ifdef GRPO_HAVE_CUDA_SYNC
    if (backend == kBackendNccl) {
      NcclWeightSyncOptions nccl;
      nccl.sync = sync;
      nccl.device = options.cuda_device;
      return CreateNcclWeightSync(std::move(store), rank, world_size, epoch, nccl);
    }
    CudaIpcWeightSyncOptions ipc;
    ipc.sync = sync;
    ipc.sync.bucket_bytes = options.ipc_bucket_bytes;
    ipc.device = options.cuda_device;
    return CreateCudaIpcWeightSync(std::move(store), rank, world_size, epoch, ipc);
#else
    return Status::Internal("unreachable");
#endif
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
#ifdef GRPO_HAVE_CUDA_SYNC
  if (StatusOr<std::string> uuid = CudaDeviceUuid(ordinal); uuid.ok()) e.gpu_uuid = *uuid;
#endif
  return e;
}

}  // namespace grpo::common
