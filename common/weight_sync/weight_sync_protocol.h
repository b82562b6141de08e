// The backend-independent half of WeightSync: the bucket plan, the layout fingerprint, the
// checksum, and CollectiveWeightSync, which runs the Begin/Broadcast/Commit protocol on top of
// a few collective primitives a backend provides (Gloo, NCCL, the in-process fake).
// Internal to the weight-sync backends; callers use common/weight_sync/weight_sync.h.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/model/safetensors.h"
#include "common/status.h"
#include "common/weight_sync/weight_sync.h"

namespace grpo::common {

// `bytes` bytes of tensor `tensor`, starting at byte `tensor_offset`, live at `bucket_offset`
// of a bucket.
struct BucketPiece {
  int64_t tensor = 0;
  int64_t tensor_offset = 0;
  int64_t bucket_offset = 0;
  int64_t bytes = 0;
};

// One flat buffer: a run of bytes of tensors of one dtype.
struct Bucket {
  at::ScalarType dtype = at::kByte;
  int64_t bytes = 0;
  std::vector<BucketPiece> pieces;
  // One piece covering the whole bucket: the collective runs on the tensor's own memory.
  bool zero_copy() const { return pieces.size() == 1; }
};

// Groups tensors by dtype (in order of first appearance), concatenates each group's bytes in
// order and cuts them into buckets of `bucket_bytes` (rounded up to a multiple of 8); a tensor
// may span buckets. Empty tensors get no piece. Deterministic: every rank computes the same
// plan from the same layout.
std::vector<Bucket> PlanBuckets(const NamedTensors& tensors, int64_t bucket_bytes);

// 64-bit FNV-1a of every tensor's name, dtype and shape, in order.
uint64_t LayoutFingerprint(const NamedTensors& tensors);

// A fast 64-bit checksum of `bytes` bytes continuing from `seed` (not cryptographic: catches
// corruption and misordering, not adversaries).
uint64_t ChecksumBytes(const void* data, int64_t bytes, uint64_t seed);

// Runs the protocol of common/weight_sync/weight_sync.h over a backend's primitives. Each primitive
// is one collective bounded by options().timeout; when one fails the group is aborted
// (AbortBackend) and every later call returns Aborted. Not thread-safe (see WeightSync).
class CollectiveWeightSync : public WeightSync {
 public:
  Status Begin(int64_t version) final;
  Status Broadcast(NamedTensors& tensors) final;
  Status Commit() final;
  void Abort() final;

  int rank() const final { return rank_; }
  int world_size() const final { return world_size_; }
  int64_t epoch() const final { return epoch_; }
  int64_t version() const final { return version_; }
  int64_t committed_version() const final { return committed_version_; }
  bool aborted() const final { return state_ == State::kAborted; }

 protected:
  CollectiveWeightSync(int rank, int world_size, int64_t epoch, WeightSyncOptions options);

  const WeightSyncOptions& options() const { return options_; }
  // A short label for messages ("gloo", "nccl", "fake").
  virtual const char* backend_name() const = 0;

  // Broadcasts `bytes` bytes at `data` (backend memory) from rank 0 to every rank, in place.
  virtual Status BroadcastBytes(void* data, int64_t bytes) = 0;
  // Every rank contributes `mine` (the same length everywhere); `all` gets world_size() rows
  // of that length, in rank order. Host memory.
  virtual Status AllGatherInt64(const std::vector<int64_t>& mine, std::vector<int64_t>* all) = 0;
  // OK when `t`'s memory can take part in BroadcastBytes/CopyBytes (CPU or device memory).
  virtual Status CheckTensorMemory(const std::string& name, const at::Tensor& t) = 0;
  // A scratch buffer of at least `bytes` bytes in backend memory; owned by the backend and
  // valid until the next call.
  virtual StatusOr<uint8_t*> Staging(int64_t bytes) = 0;
  // Copies within backend memory, ordered before the next primitive.
  virtual Status CopyBytes(void* dst, const void* src, int64_t bytes) = 0;
  // Waits (against the deadline) for copies still in flight; a no-op for synchronous backends.
  virtual Status Synchronize() = 0;
  // Called once per Broadcast, after the layout check and before the first byte moves: a GPU
  // backend waits here for work that libtorch queued on its own stream (the tensors' last
  // writes, or their allocation from memory freed there), since the backend's stream is not
  // ordered after libtorch's.
  virtual Status PrepareMemory() { return Status::OK(); }
  // True when the bytes are readable by the host (so Commit can checksum them).
  virtual bool host_memory() const = 0;
  // Tears the backend down; must be idempotent. Called by Abort() and on any primitive's
  // failure; derived destructors call it too.
  virtual void AbortBackend() = 0;

 private:
  enum class State { kIdle, kBegun, kAborted };
  // Aborts the group and returns `status` with this group's context.
  Status Fail(const Status& status, const char* what);
  Status RequireLive() const;
  Status BroadcastBuckets(NamedTensors& tensors);

  const int rank_;
  const int world_size_;
  const int64_t epoch_;
  const WeightSyncOptions options_;
  State state_ = State::kIdle;
  int64_t version_ = -1;
  int64_t committed_version_ = -1;
  int64_t bytes_ = 0;      // bytes broadcast since Begin
  uint64_t checksum_ = 0;  // of those bytes, when verify_checksum and host_memory()
};

// The memory primitives of a backend that works on CPU tensors (Gloo, the fake): a growable
// host staging buffer, memcpy, nothing to synchronise, checksummable bytes.
class HostMemoryWeightSync : public CollectiveWeightSync {
 protected:
  using CollectiveWeightSync::CollectiveWeightSync;

  Status CheckTensorMemory(const std::string& name, const at::Tensor& t) override;
  StatusOr<uint8_t*> Staging(int64_t bytes) override;
  Status CopyBytes(void* dst, const void* src, int64_t bytes) override;
  Status Synchronize() override { return Status::OK(); }
  bool host_memory() const override { return true; }

 private:
  std::vector<uint8_t> staging_;
};

}  // namespace grpo::common
