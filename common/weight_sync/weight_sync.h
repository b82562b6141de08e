// WeightSync: the versioned weight broadcast from the learner (rank 0) to rollout workers
// (ranks 1..N-1), docs/ARCHITECTURE.md "Weight sync". Backends: GlooWeightSync (CPU, c10d),
// NcclWeightSync (GPU), FakeWeightSync (in-process, for tests of callers).
//
// One version: Begin(v) -> Broadcast(tensors) (one or more calls) -> Commit(). Every call is a
// collective: all ranks make the same calls in the same order. Each collective has a deadline
// (WeightSyncOptions::timeout); on a timeout or a lost peer the group aborts itself and every
// later call returns Aborted: the caller rebuilds the group with a new epoch, and a worker that
// missed a version fetches it over gRPC (GetWeights).
#pragma once

#include <chrono>
#include <cstdint>

#include "common/model/safetensors.h"
#include "common/status.h"

namespace grpo::common {

// The deadline of one collective (rendezvous included), like c10d's Store::kDefaultTimeout.
inline constexpr std::chrono::milliseconds kDefaultBroadcastTimeout{60'000};
// Flat-buffer size: tensors of one dtype are concatenated and cut into buckets of this many
// bytes, one collective per bucket (the last bucket of a dtype may be shorter).
inline constexpr int64_t kDefaultBucketBytes = 16ll << 20;
// Begin() on a receiver: accept whatever version the publisher offers.
inline constexpr int64_t kAnyVersion = -1;

struct WeightSyncOptions {
  std::chrono::milliseconds timeout = kDefaultBroadcastTimeout;
  int64_t bucket_bytes = kDefaultBucketBytes;  // > 0; rounded up to a multiple of 8
  // Commit() compares a 64-bit checksum of the bytes every rank sent/received (CPU backends;
  // costs one extra read of the weights).
  bool verify_checksum = true;
};

// Not thread-safe: one thread drives a WeightSync (Abort() included). The tensors passed to
// Broadcast are borrowed for the duration of the call.
class WeightSync {
 public:
  virtual ~WeightSync() = default;

  // Starts version `version`. Rank 0 (the publisher) passes the version it is about to send
  // (>= 0); receivers pass the version they expect or kAnyVersion. FailedPrecondition on every
  // rank when a receiver expected another version (the group stays usable).
  virtual Status Begin(int64_t version) = 0;

  // Rank 0 sends `tensors`; other ranks receive in place into their preallocated tensors, which
  // must have the same names, order, dtypes and shapes (checked on every rank first:
  // InvalidArgument on every rank when any rank differs; the group stays usable). Tensors must
  // be contiguous and in the backend's memory (CPU for Gloo/Fake, CUDA device for NCCL).
  virtual Status Broadcast(NamedTensors& tensors) = 0;

  // Ends the version: all ranks compare (version, bytes, checksum). OK on every rank when all
  // agree (then committed_version() == version()); DataLoss on every rank otherwise.
  virtual Status Commit() = 0;

  // Tears the group down locally; peers see their next collective fail. Idempotent. Every
  // later call returns Aborted.
  virtual void Abort() = 0;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual int64_t epoch() const = 0;
  // The version of the current Begin() (the publisher's); -1 before the first Begin.
  virtual int64_t version() const = 0;
  // The last version committed by this group; -1 when none.
  virtual int64_t committed_version() const = 0;
  virtual bool aborted() const = 0;
};

// How a streamed version's tensors share Broadcasts, the same at both ends: in order, a tensor of
// at least `cap` bytes is a group alone; a smaller one joins the group being filled while its
// bytes stay within `cap`, else it starts the next. Incremental: the learner learns each
// tensor's size as it is produced, a receiver from its layout.
class StreamGrouping {
 public:
  explicit StreamGrouping(int64_t cap) : cap_(cap) {}
  // The next tensor, of `bytes` bytes: true when the group being filled is complete before it
  // (it is then sent, and this tensor starts a new group).
  bool Add(int64_t bytes) {
    const bool alone = bytes >= cap_;
    const bool full = count_ > 0 && (alone || last_alone_ || sum_ + bytes > cap_);
    if (full) sum_ = count_ = 0;
    sum_ += bytes;
    ++count_;
    last_alone_ = alone;
    return full;
  }
  // The tensor just added can never share its group: send it at once.
  bool Alone() const { return last_alone_; }

 private:
  const int64_t cap_;
  int64_t sum_ = 0, count_ = 0;
  bool last_alone_ = false;
};

// The Broadcasts of a streamed version, one per StreamGrouping(cap) group: the calls both ends
// make, the learner as it produces each tensor, a receiver over its layout. A tensor alone in
// its group is broadcast at once from its own memory; the others are held until their group is
// complete. `copy_grouped` (the sender): a held tensor is a contiguous copy, since its producer
// may free it before the group goes; without it (a receiver) the held tensor is the layout's
// own, which the Broadcast fills.
class StreamGroupBroadcast {
 public:
  StreamGroupBroadcast(WeightSync& sync, int64_t cap, bool copy_grouped)
      : sync_(sync), grouping_(cap), copy_grouped_(copy_grouped) {}
  // The next tensor of the version.
  Status Put(const std::string& name, const at::Tensor& t) {
    if (grouping_.Add(static_cast<int64_t>(t.nbytes())) && !held_.empty()) {
      RETURN_IF_ERROR(sync_.Broadcast(held_));
      held_.clear();
    }
    if (grouping_.Alone()) {
      NamedTensors one{{name, copy_grouped_ ? t.contiguous() : t}};
      return sync_.Broadcast(one);
    }
    held_.emplace_back(name, copy_grouped_ ? t.contiguous().clone() : t);
    return Status::OK();
  }
  // After the version's last tensor: the group still held.
  Status Finish() {
    if (held_.empty()) return Status::OK();
    const Status s = sync_.Broadcast(held_);
    held_.clear();
    return s;
  }

 private:
  WeightSync& sync_;
  StreamGrouping grouping_;
  const bool copy_grouped_;
  NamedTensors held_;
};

// A streamed version with every tensor at hand (a receiver, whose tensors are its layout).
inline Status BroadcastInStreamGroups(WeightSync& sync, NamedTensors& tensors, int64_t cap) {
  StreamGroupBroadcast stream(sync, cap, /*copy_grouped=*/false);
  for (const auto& [name, t] : tensors) RETURN_IF_ERROR(stream.Put(name, t));
  return stream.Finish();
}

}  // namespace grpo::common
