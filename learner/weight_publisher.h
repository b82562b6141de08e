// WeightPublisher: the learner's end of one backend's weight-sync group (docs/ARCHITECTURE.md
// "Weight sync"). The learner is rank 0; the workers assigned to the backend are ranks 1..N in
// roster order. Each round (the learner's weight-sync thread calls Sync) it (re)forms the group
// when the epoch changed, writes the roster, and broadcasts the newest published version:
// announce it (version and incarnation) under VersionKey, then Begin/Broadcast/Commit. Any failure
// aborts the group and ends its epoch in the store, so every member (the other backends' too)
// rebuilds under a new one; a worker that missed a version fetches it with GetWeights. The backend
// is a factory argument (common/weight_sync/backends.h): Gloo, NCCL and CUDA IPC run the same code
// here. No gRPC: the store is the learner's InMemoryEpochStore.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/cancel_token.h"
#include "common/model/safetensors.h"
#include "common/status.h"
#include "common/weight_sync/backends.h"
#include "common/weight_sync/epoch_store.h"
#include "common/weight_sync/group.h"
#include "common/weight_sync/weight_sync.h"
#include "learner/weight_readers.h"

namespace grpo::learner {

// One published policy version, immutable once published. `tensors` are CPU (GetWeights,
// Gloo); `device_tensors` are the same values on the learner's GPU when the policy lives on
// one (NCCL, CUDA IPC), else empty.
struct WeightSnapshot {
  int64_t version = 0;
  // The learner process that publishes it (Learner::incarnation()); announced with the version
  // so that a receiver never takes it for another incarnation's version of the same number.
  std::string incarnation;
  common::NamedTensors tensors;
  common::NamedTensors device_tensors;
};

// A streamed version's tensors share a Broadcast up to this many bytes (common::StreamGrouping):
// one gloo bucket, the copy a publisher holds at most while a version streams.
inline constexpr int64_t kStreamGroupBytes = common::kDefaultBucketBytes;

// Not thread-safe: one thread (the learner's weight-sync thread) drives a publisher.
class WeightPublisher {
 public:
  // `backend` is gloo, nccl or cuda_ipc; `factory` creates rank 0 of it.
  // `stream_group_bytes`: the cap of a streamed version's groups (announced with it).
  WeightPublisher(std::string backend, std::shared_ptr<common::InMemoryEpochStore> store,
                  common::WeightSyncFactory factory, std::chrono::milliseconds timeout,
                  int64_t stream_group_bytes = kStreamGroupBytes);
  ~WeightPublisher();

  const std::string& backend() const { return backend_; }

  // One round. `members`: the worker ids assigned to this backend, in rank order (empty: the
  // group is torn down). Broadcasts `weights` when it is newer than the last version this
  // group committed (GPU backends: when it has device_tensors). OK when nothing was to be done or
  // the version was committed; the error of a failed join or broadcast otherwise (the group is then
  // aborted and its epoch ended).
  Status Sync(const std::vector<std::string>& members,
              const std::shared_ptr<const WeightSnapshot>& weights);

  // --- A streamed version (weight_publish: stream; learner/weight_readers.h).
  // One round of a streaming group's thread: (re)forms the group for `members` and, when one is
  // live, waits in `readers` (until `deadline`, or `cancel` trips; may be null) for the version
  // after the one it sent, queued before that version is published so that the publish serves
  // it. The serving (training) thread then runs this publisher's sink, StreamPiece, while this
  // thread waits (the publisher is never touched by both at once). *waited: the round waited
  // there (false: no group, or `readers` closed). The error of a failed join or stream (the
  // group is then aborted and its epoch ended), else OK; a serve that failed midway (its
  // producer) aborts the group left inside the version.
  Status StreamRound(const std::vector<std::string>& members, WeightReaders& readers,
                     const std::string& incarnation, std::chrono::steady_clock::time_point deadline,
                     const common::CancelToken* cancel, bool* waited);
  // The last version this group committed (-1: none).
  int64_t last_sent() const { return last_sent_; }

  // Tears the group down (peers see their next collective fail).
  void Close();

  // Versions committed to a group, and failed joins/broadcasts (each ended an epoch). Safe to
  // read from any thread; a peer can hold a version before Sync has counted it.
  int64_t syncs() const { return syncs_.load(); }
  int64_t failures() const { return failures_.load(); }
  // The epoch of the live group, 0 when none.
  int64_t group_epoch() const;
  // Seconds the last committed broadcast took (announce to Commit).
  double last_sync_seconds() const { return last_sync_seconds_; }

 private:
  Status Fail(int64_t epoch, const Status& s, const char* what);
  // The group part of Sync and StreamRound: (re)forms the group for `members`. True when a
  // group is live; the error of a failed join (the epoch then ended).
  StatusOr<bool> Form(const std::vector<std::string>& members);
  // One tensor of a version streamed to the live group, as WeightReaders hands it out: the
  // first piece announces the version (`stream <stream_group_bytes>`) and begins it; the tensors
  // go in the groups of common::StreamGrouping (small ones copied into the group being
  // filled, a large one sent from its memory at once), of the CPU tensor for gloo, of the
  // producer's device tensor for GPU backends; the last piece sends the rest and commits. A
  // failure aborts the group and ends its epoch, as Sync's.
  Status StreamPiece(const WeightPiece& piece, const std::string& incarnation);
  // A stream that ended before its last piece: the group, left inside a version, is aborted
  // and its epoch ended with `why`. Nothing when no version is open.
  void AbortOpenStream(const Status& why);

  const std::string backend_;
  const std::shared_ptr<common::InMemoryEpochStore> store_;
  const common::WeightSyncFactory factory_;
  const std::chrono::milliseconds timeout_;
  const int64_t stream_group_bytes_;
  std::unique_ptr<common::WeightSync> sync_;
  c10::intrusive_ptr<c10d::Store> group_store_;  // of sync_'s epoch, scoped to GroupPrefix
  std::vector<std::string> roster_;              // sync_'s members
  int64_t formed_epoch_ = 0;                     // the epoch of the last group formed
  int64_t seq_ = 0;                              // versions announced in sync_'s epoch
  // The streamed version begun and not committed (its groups' Broadcasts over *sync_).
  std::optional<common::StreamGroupBroadcast> stream_;
  int64_t last_sent_ = -1;
  std::atomic<int64_t> syncs_{0};
  std::atomic<int64_t> failures_{0};
  double last_sync_seconds_ = 0;
  // Of the blocking phase in progress (the join, or the version's broadcast): what a failure's
  // log line times, each phase being bounded by one deadline.
  std::chrono::steady_clock::time_point phase_start_;
};

}  // namespace grpo::learner
