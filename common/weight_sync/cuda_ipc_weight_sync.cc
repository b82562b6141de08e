#include "common/weight_sync/cuda_ipc_weight_sync.h"

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <charconv>
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

namespace grpo::common {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kAbortKey = "abort";
constexpr const char* kHandleKey = "handle";
constexpr auto kFirstPoll = std::chrono::microseconds(50);
constexpr auto kMaxPoll = std::chrono::microseconds(2000);

std::string WhatOf(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

std::string JoinInts(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

bool ParseInts(const std::string& s, std::vector<int64_t>* out) {
  out->clear();
  const char* p = s.data();
  const char* end = s.data() + s.size();
  while (p < end) {
    int64_t v = 0;
    auto [q, ec] = std::from_chars(p, end, v);
    if (ec != std::errc()) return false;
    out->push_back(v);
    p = q;
    if (p < end) {
      if (*p != ',') return false;
      ++p;
    }
  }
  return true;
}

class CudaIpcWeightSync final : public DeviceMemoryWeightSync {
 public:
  CudaIpcWeightSync(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int64_t epoch,
                    const CudaIpcWeightSyncOptions& options)
      : DeviceMemoryWeightSync(rank, world_size, epoch, options.sync, options.device),
        store_(std::move(store)) {}
  ~CudaIpcWeightSync() override { AbortBackend(); }

  Status Init(Clock::time_point deadline) {
    GRPO_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")");
    GRPO_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                     "cudaStreamCreate");
    ASSIGN_OR_RETURN(const std::string uuid, CudaDeviceUuid(device_));
    if (rank() == 0) {
      buffer_bytes_ = std::max<int64_t>(8, (options().bucket_bytes + 7) / 8 * 8);
      GRPO_CUDA_RETURN(cudaMalloc(&buffer_, buffer_bytes_), "cudaMalloc of the IPC buffer");
      cudaIpcMemHandle_t handle;
      GRPO_CUDA_RETURN(cudaIpcGetMemHandle(&handle, buffer_), "cudaIpcGetMemHandle");
      std::string value(reinterpret_cast<const char*>(&handle), sizeof(handle));
      value += std::to_string(buffer_bytes_);
      RETURN_IF_ERROR(Set(kHandleKey, value));
      RETURN_IF_ERROR(Set("join/0", "ok " + uuid));
      for (int r = 1; r < world_size(); ++r) {
        std::string joined;
        RETURN_IF_ERROR(WaitKey("join/" + std::to_string(r), &joined, deadline, "group join"));
        if (joined.rfind("ok ", 0) != 0) {
          return Status::Unavailable("rank " + std::to_string(r) + " could not join: " + joined);
        }
      }
      return Status::OK();
    }
    std::string value;
    RETURN_IF_ERROR(WaitKey(kHandleKey, &value, deadline, "the IPC handle"));
    Status s = OpenHandle(value);
    (void)Set("join/" + std::to_string(rank()), s.ok() ? "ok " + uuid : "error " + s.ToString());
    return s;
  }

 protected:
  const char* backend_name() const override { return "cuda_ipc"; }

  Status BroadcastBytes(void* data, int64_t bytes) override {
    RETURN_IF_ERROR(Ready());
    const auto deadline = Clock::now() + options().timeout;
    const std::string round = "c/" + std::to_string(round_++);
    if (rank() == 0) {
      if (bytes > buffer_bytes_) {
        return Status::Internal("a bucket of " + std::to_string(bytes) +
                                " bytes does not fit the IPC buffer of " +
                                std::to_string(buffer_bytes_));
      }
      GRPO_CUDA_RETURN(cudaMemcpyAsync(buffer_, data, bytes, cudaMemcpyDeviceToDevice, stream_),
                       "cudaMemcpyAsync into the IPC buffer");
      RETURN_IF_ERROR(WaitCudaStream(stream_, deadline, options().timeout, "IPC copy"));
      RETURN_IF_ERROR(Set(round, std::to_string(bytes)));
      RETURN_IF_ERROR(WaitForAcks(round, deadline));
      return DeleteKeys({round});
    }
    std::string offered;
    RETURN_IF_ERROR(WaitKey(round, &offered, deadline, "broadcast " + round));
    Status s = offered == std::to_string(bytes)
                   ? Status::OK()
                   : Status::Internal("the publisher broadcasts " + offered + " bytes, expected " +
                                      std::to_string(bytes));
    if (s.ok()) {
      const cudaError_t e =
          cudaMemcpyAsync(data, mapped_, bytes, cudaMemcpyDeviceToDevice, stream_);
      s = e == cudaSuccess ? WaitCudaStream(stream_, deadline, options().timeout, "IPC copy")
                           : CudaError(e, "cudaMemcpyAsync out of the IPC buffer");
    }
    return Ack(round, s);
  }

  Status AllGatherInt64(const std::vector<int64_t>& mine, std::vector<int64_t>* all) override {
    RETURN_IF_ERROR(Ready());
    const auto deadline = Clock::now() + options().timeout;
    const std::string round = "c/" + std::to_string(round_++);
    RETURN_IF_ERROR(Set(round + "/ag/" + std::to_string(rank()), JoinInts(mine)));
    all->clear();
    std::vector<std::string> keys;
    for (int r = 0; r < world_size(); ++r) {
      const std::string key = round + "/ag/" + std::to_string(r);
      keys.push_back(key);
      std::string text;
      std::vector<int64_t> row;
      RETURN_IF_ERROR(WaitKey(key, &text, deadline, "all-gather " + round));
      if (!ParseInts(text, &row) || row.size() != mine.size()) {
        return Status::Internal("all-gather " + round + ": rank " + std::to_string(r) + " sent '" +
                                text + "'");
      }
      all->insert(all->end(), row.begin(), row.end());
    }
    if (rank() != 0) return Ack(round, Status::OK());
    RETURN_IF_ERROR(WaitForAcks(round, deadline));
    return DeleteKeys(keys);
  }

  Status Synchronize() override {
    RETURN_IF_ERROR(Ready());
    return WaitCudaStream(stream_, Clock::now() + options().timeout, options().timeout, "copies");
  }

  void AbortBackend() override {
    if (torn_down_) return;
    torn_down_ = true;
    if (store_) {
      try {
        store_->set(kAbortKey, std::vector<uint8_t>{'1'});
      } catch (const std::exception&) {
        // The store is gone too (the epoch ended): peers learn from their deadline or epoch.
      }
    }
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (mapped_ != nullptr) cudaIpcCloseMemHandle(mapped_);
    mapped_ = nullptr;
    if (buffer_ != nullptr) cudaFree(buffer_);
    buffer_ = nullptr;
    FreeStaging();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

 private:
  Status Ready() override {
    if (torn_down_ || stream_ == nullptr) return Status::Aborted("cuda_ipc group is gone");
    GRPO_CUDA_RETURN(cudaSetDevice(device_), "cudaSetDevice");
    return Status::OK();
  }

  Status OpenHandle(const std::string& value) {
    cudaIpcMemHandle_t handle;
    if (value.size() <= sizeof(handle)) {
      return Status::Internal("the IPC handle key holds " + std::to_string(value.size()) +
                              " bytes");
    }
    std::memcpy(&handle, value.data(), sizeof(handle));
    const std::string size = value.substr(sizeof(handle));
    auto [p, ec] = std::from_chars(size.data(), size.data() + size.size(), buffer_bytes_);
    if (ec != std::errc() || buffer_bytes_ <= 0) {
      return Status::Internal("the IPC handle key has a bad size '" + size + "'");
    }
    GRPO_CUDA_RETURN(cudaIpcOpenMemHandle(&mapped_, handle, cudaIpcMemLazyEnablePeerAccess),
                     "cudaIpcOpenMemHandle (ranks must be different processes on GPUs that "
                     "can map each other's memory)");
    return Status::OK();
  }

  Status Set(const std::string& key, const std::string& value) {
    try {
      store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    } catch (const std::exception& e) {
      return Status::Unavailable("store set '" + key + "': " + WhatOf(e));
    }
    return Status::OK();
  }

  // Polls for `key` (with backoff) until it is set, a peer aborts or `deadline` passes.
  Status WaitKey(const std::string& key, std::string* value, Clock::time_point deadline,
                 const std::string& what) {
    auto poll = kFirstPoll;
    for (;;) {
      try {
        if (store_->check({key})) {
          const std::vector<uint8_t> v = store_->get(key);
          value->assign(v.begin(), v.end());
          return Status::OK();
        }
        if (store_->check({kAbortKey})) return Status::Aborted(what + ": a peer aborted the group");
      } catch (const std::exception& e) {
        return Status::Unavailable(what + ": store: " + WhatOf(e));
      }
      if (Clock::now() >= deadline) {
        return Status::DeadlineExceeded(what + ": '" + key + "' not set within " +
                                        std::to_string(options().timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(poll);
      poll = std::min<std::chrono::microseconds>(poll * 2, kMaxPoll);
    }
  }

  // A receiver reports how its part of `round` went; a failure also ends the call.
  Status Ack(const std::string& round, const Status& s) {
    Status set = Set(round + "/done/" + std::to_string(rank()), s.ok() ? "ok" : s.ToString());
    return s.ok() ? set : s;
  }

  Status WaitForAcks(const std::string& round, Clock::time_point deadline) {
    std::vector<std::string> keys;
    for (int r = 1; r < world_size(); ++r) {
      const std::string key = round + "/done/" + std::to_string(r);
      std::string ack;
      RETURN_IF_ERROR(WaitKey(key, &ack, deadline, round));
      if (ack != "ok") {
        return Status::Unavailable("rank " + std::to_string(r) + " failed " + round + ": " + ack);
      }
      keys.push_back(key);
    }
    return DeleteKeys(keys);
  }

  Status DeleteKeys(const std::vector<std::string>& keys) {
    try {
      for (const std::string& k : keys) store_->deleteKey(k);
    } catch (const std::exception& e) {
      return Status::Unavailable("store delete: " + WhatOf(e));
    }
    return Status::OK();
  }

  c10::intrusive_ptr<c10d::Store> store_;
  bool torn_down_ = false;
  int64_t round_ = 0;       // collectives so far (the same count on every rank)
  void* buffer_ = nullptr;  // rank 0: the exported buffer
  void* mapped_ = nullptr;  // receivers: rank 0's buffer, mapped
  int64_t buffer_bytes_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<WeightSync>> CreateCudaIpcWeightSync(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int64_t epoch,
    const CudaIpcWeightSyncOptions& options) {
  if (!store) return Status::InvalidArgument("cuda_ipc weight sync needs a store");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " outside world of " +
                                   std::to_string(world_size));
  }
  if (options.sync.bucket_bytes <= 0) return Status::InvalidArgument("bucket_bytes must be > 0");
  if (options.sync.timeout.count() <= 0) return Status::InvalidArgument("timeout must be > 0");
  int devices = 0;
  if (cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    return CudaError(e, "cudaGetDeviceCount");
  }
  if (options.device < 0 || options.device >= devices) {
    return Status::InvalidArgument("CUDA device " + std::to_string(options.device) +
                                   " does not exist (" + std::to_string(devices) + " visible)");
  }
  const auto deadline = Clock::now() + options.sync.timeout;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
      "grpo/weight_sync/" + std::to_string(epoch) + "/ipc", std::move(store));
  auto sync = std::make_unique<CudaIpcWeightSync>(prefixed, rank, world_size, epoch, options);
  Status s = sync->Init(deadline);
  if (!s.ok()) {
    sync->Abort();
    return s.WithContext("cuda_ipc weight sync (epoch " + std::to_string(epoch) + ", rank " +
                         std::to_string(rank) + "/" + std::to_string(world_size) + ") join");
  }
  return std::unique_ptr<WeightSync>(std::move(sync));
}

}  // namespace grpo::common
