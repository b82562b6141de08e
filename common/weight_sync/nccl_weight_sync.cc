#include "common/weight_sync/nccl_weight_sync.h"

#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "common/weight_sync/cuda_util.h"
#include "common/weight_sync/weight_sync_protocol.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "NcclWeightSync needs NCCL >= 2.14 (non-blocking communicators, ncclCommGetAsyncError)"
#endif

namespace grpo::common {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollInterval = std::chrono::microseconds(20);
constexpr const char* kUniqueIdKey = "nccl_unique_id";

Status NcclError(ncclResult_t r, ncclComm_t comm, const std::string& what) {
  std::string m = what + ": NCCL " + ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last) m += std::string(" (") + last + ")";
  }
  return Status::Unavailable(m);
}

std::string Ms(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

// Polls a non-blocking communicator until its pending call (init, or the enqueueing of a
// collective) has finished. DeadlineExceeded past `deadline`; the caller aborts the comm.
Status WaitComm(ncclComm_t comm, Clock::time_point deadline, std::chrono::milliseconds timeout,
                const std::string& what) {
  for (;;) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) return NcclError(r, comm, what);
    if (async == ncclSuccess) return Status::OK();
    if (async != ncclInProgress) return NcclError(async, comm, what);
    if (Clock::now() >= deadline) {
      return Status::DeadlineExceeded(what + " still in progress after " + Ms(timeout));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

// Waits for `stream`'s work, watching the communicator for asynchronous errors (a peer's
// failure) meanwhile. DeadlineExceeded past `deadline`.
Status WaitStream(ncclComm_t comm, cudaStream_t stream, Clock::time_point deadline,
                  std::chrono::milliseconds timeout, const std::string& what) {
  return WaitCudaStream(stream, deadline, timeout, what, [&]() -> Status {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) return NcclError(r, comm, what);
    if (async != ncclSuccess && async != ncclInProgress) return NcclError(async, comm, what);
    return Status::OK();
  });
}

// Issues an NCCL call on a non-blocking communicator and waits until it is enqueued.
template <typename Call>
Status Enqueue(ncclComm_t comm, Clock::time_point deadline, std::chrono::milliseconds timeout,
               const std::string& what, Call call) {
  const ncclResult_t r = call();
  if (r == ncclInProgress) return WaitComm(comm, deadline, timeout, what);
  if (r != ncclSuccess) return NcclError(r, comm, what);
  return Status::OK();
}

class NcclWeightSync final : public DeviceMemoryWeightSync {
 public:
  NcclWeightSync(int rank, int world_size, int64_t epoch, const NcclWeightSyncOptions& options)
      : DeviceMemoryWeightSync(rank, world_size, epoch, options.sync, options.device) {}

  ~NcclWeightSync() override {
    if (comm_ != nullptr) {
      // Orderly teardown: flush, then free; abort if the flush does not finish in time.
      cudaSetDevice(device_);
      const auto deadline = Clock::now() + options().timeout;
      Status s = Enqueue(comm_, deadline, options().timeout, "ncclCommFinalize",
                         [&] { return ncclCommFinalize(comm_); });
      if (s.ok()) {
        ncclCommDestroy(comm_);
        comm_ = nullptr;
      } else {
        GRPO_LOG_WARN("nccl weight sync teardown: {}; aborting", s.ToString());
      }
    }
    AbortBackend();
  }

  // Creates the stream, the scratch buffers and the communicator. The comm is aborted when it
  // is not ready by `deadline`.
  Status Init(const ncclUniqueId& id, Clock::time_point deadline) {
    GRPO_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")");
    GRPO_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                     "cudaStreamCreate");
    const size_t ints = kMaxInts * static_cast<size_t>(world_size());
    GRPO_CUDA_RETURN(cudaMalloc(&dev_ints_, (kMaxInts + ints) * sizeof(int64_t)), "cudaMalloc");
    GRPO_CUDA_RETURN(cudaMallocHost(&host_ints_, (kMaxInts + ints) * sizeof(int64_t)),
                     "cudaMallocHost");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const std::string what = "ncclCommInitRankConfig (rank " + std::to_string(rank()) + "/" +
                             std::to_string(world_size()) + ", epoch " + std::to_string(epoch()) +
                             ")";
    ncclResult_t r = ncclCommInitRankConfig(&comm_, world_size(), id, rank(), &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      Status s = NcclError(r, comm_, what);
      AbortBackend();
      return s;
    }
    Status s = WaitComm(comm_, deadline, options().timeout, what);
    if (!s.ok()) AbortBackend();
    return s;
  }

 protected:
  const char* backend_name() const override { return "nccl"; }

  Status BroadcastBytes(void* data, int64_t bytes) override {
    RETURN_IF_ERROR(Ready());
    const auto deadline = Clock::now() + options().timeout;
    const std::string what = "ncclBroadcast of " + std::to_string(bytes) + " bytes";
    RETURN_IF_ERROR(Enqueue(comm_, deadline, options().timeout, what, [&] {
      return ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclUint8, 0, comm_, stream_);
    }));
    return WaitStream(comm_, stream_, deadline, options().timeout, what);
  }

  Status AllGatherInt64(const std::vector<int64_t>& mine, std::vector<int64_t>* all) override {
    RETURN_IF_ERROR(Ready());
    const size_t n = mine.size();
    if (n > kMaxInts) return Status::Internal("all-gather of more than kMaxInts values");
    const auto deadline = Clock::now() + options().timeout;
    int64_t* dev_send = dev_ints_;
    int64_t* dev_recv = dev_ints_ + kMaxInts;
    std::memcpy(host_ints_, mine.data(), n * sizeof(int64_t));
    GRPO_CUDA_RETURN(
        cudaMemcpyAsync(dev_send, host_ints_, n * sizeof(int64_t), cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync H2D");
    const std::string what = "ncclAllGather";
    RETURN_IF_ERROR(Enqueue(comm_, deadline, options().timeout, what, [&] {
      return ncclAllGather(dev_send, dev_recv, n, ncclInt64, comm_, stream_);
    }));
    const size_t total = n * static_cast<size_t>(world_size());
    GRPO_CUDA_RETURN(cudaMemcpyAsync(host_ints_ + kMaxInts, dev_recv, total * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, stream_),
                     "cudaMemcpyAsync D2H");
    RETURN_IF_ERROR(WaitStream(comm_, stream_, deadline, options().timeout, what));
    all->assign(host_ints_ + kMaxInts, host_ints_ + kMaxInts + total);
    return Status::OK();
  }

  Status Synchronize() override {
    RETURN_IF_ERROR(Ready());
    return WaitStream(comm_, stream_, Clock::now() + options().timeout, options().timeout,
                      "copies");
  }

  void AbortBackend() override {
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);  // also stops kernels of this comm still waiting on peers
      comm_ = nullptr;
    }
    FreeStaging();
    if (dev_ints_ != nullptr) cudaFree(dev_ints_);
    dev_ints_ = nullptr;
    if (host_ints_ != nullptr) cudaFreeHost(host_ints_);
    host_ints_ = nullptr;
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

 private:
  static constexpr size_t kMaxInts = 8;  // longest all-gather row of the protocol

  Status Ready() override {
    if (comm_ == nullptr) return Status::Aborted("nccl communicator is gone");
    GRPO_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    return Status::OK();
  }

  ncclComm_t comm_ = nullptr;
  int64_t* dev_ints_ = nullptr;   // [kMaxInts send | kMaxInts * world recv]
  int64_t* host_ints_ = nullptr;  // pinned, same layout
};

}  // namespace

StatusOr<std::unique_ptr<WeightSync>> CreateNcclWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                           int rank, int world_size, int64_t epoch,
                                                           const NcclWeightSyncOptions& options) {
  if (!store) return Status::InvalidArgument("nccl weight sync needs a store");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " outside world of " +
                                   std::to_string(world_size));
  }
  if (options.sync.bucket_bytes <= 0) return Status::InvalidArgument("bucket_bytes must be > 0");
  if (options.sync.timeout.count() <= 0) return Status::InvalidArgument("timeout must be > 0");
  const auto timeout = options.sync.timeout;
  const auto deadline = Clock::now() + timeout;

  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    return CudaError(e, "cudaGetDeviceCount");
  }
  if (options.device < 0 || options.device >= devices) {
    return Status::InvalidArgument("CUDA device " + std::to_string(options.device) +
                                   " does not exist (" + std::to_string(devices) + " visible)");
  }

  // The unique id: rank 0 makes it, everyone reads it from the store.
  ncclUniqueId id;
  const std::string key_what = "nccl unique id of epoch " + std::to_string(epoch);
  try {
    c10d::PrefixStore prefixed("grpo/weight_sync/" + std::to_string(epoch), std::move(store));
    if (rank == 0) {
      if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
        return NcclError(r, nullptr, "ncclGetUniqueId");
      }
      const auto* p = reinterpret_cast<const uint8_t*>(&id);
      prefixed.set(kUniqueIdKey, std::vector<uint8_t>(p, p + sizeof(id)));
    } else {
      prefixed.wait({kUniqueIdKey}, timeout);
      const std::vector<uint8_t> bytes = prefixed.get(kUniqueIdKey);
      if (bytes.size() != sizeof(id)) {
        return Status::Internal(key_what + " has " + std::to_string(bytes.size()) +
                                " bytes, expected " + std::to_string(sizeof(id)));
      }
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const std::string what = c10_error ? c10_error->what_without_backtrace() : e.what();
    if (Clock::now() >= deadline || what.find("imeout") != std::string::npos ||
        what.find("imed out") != std::string::npos) {
      return Status::DeadlineExceeded("waiting for the " + key_what + ": " + what);
    }
    return Status::Unavailable("exchanging the " + key_what + ": " + what);
  }

  auto sync = std::make_unique<NcclWeightSync>(rank, world_size, epoch, options);
  RETURN_IF_ERROR(sync->Init(id, deadline));
  return std::unique_ptr<WeightSync>(std::move(sync));
}

}  // namespace grpo::common
