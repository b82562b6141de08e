// GroupWeightReceiver: a rollout worker's end of the learner's weight-sync group, for any
// group backend (docs/ARCHITECTURE.md "Weight sync"). A background thread joins the group of
// the current epoch through the learner's EpochStore (its rank is its line in the backend's
// roster, common/weight_sync/group.h), receives every version the learner broadcasts into
// fresh tensors and keeps the latest, tagged with the learner incarnation that announced it.
// Receive installs that one when it is new enough and of the membership's incarnation, and
// otherwise falls back to the `fallback` receiver (GetWeights). A membership of another
// incarnation (the learner restarted) discards the kept version and ends the group served: a
// version of a learner the worker has left is never delivered (its numbers restart). A failed
// collective or a new epoch makes the thread leave the group and rejoin at the next epoch. The
// backend is the one the learner assigned at Register (SetGroup); the transport is a factory
// argument (common/weight_sync/backends.h), so Gloo, NCCL and CUDA IPC share this code. No gRPC.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/model/safetensors.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/weight_sync/backends.h"
#include "common/weight_sync/epoch_store.h"
#include "common/weight_sync/weight_sync.h"
#include "rollout/weight_receiver.h"

namespace grpo::rollout {

// Receive waits this long for the group's copy of a version before it uses the fallback.
inline constexpr std::chrono::milliseconds kDefaultGroupVersionWait{10'000};
// The background thread's store waits (roster, next version) re-check the epoch this often.
inline constexpr std::chrono::milliseconds kGroupStorePollInterval{1000};

struct GroupWeightReceiverOptions {
  // What the worker asks for at Register: gloo, nccl, cuda_ipc or auto (backend()).
  std::string requested_backend = "gloo";
  // Deadline of the rendezvous and of each collective (the learner's weight_sync_timeout).
  std::chrono::milliseconds timeout = common::kDefaultBroadcastTimeout;
  std::chrono::milliseconds version_wait = kDefaultGroupVersionWait;
  // Where the GPU backends (nccl, cuda_ipc) receive: this worker's CUDA device. Gloo receives
  // into CPU tensors.
  at::Device device = at::kCPU;
};

// Receive: one caller at a time (the worker's main thread). SetGroup and the counters: any
// thread. The destructor stops the thread (within options.timeout at worst).
class GroupWeightReceiver final : public WeightReceiver {
 public:
  GroupWeightReceiver(std::shared_ptr<common::EpochStore> store,
                      std::unique_ptr<WeightReceiver> fallback, common::WeightSyncFactory factory,
                      GroupWeightReceiverOptions options = {});
  ~GroupWeightReceiver() override;
  GroupWeightReceiver(const GroupWeightReceiver&) = delete;
  GroupWeightReceiver& operator=(const GroupWeightReceiver&) = delete;

  // The group's latest version when >= min_version and of the membership's incarnation (waits
  // up to version_wait while in a group), else the fallback's Receive. Errors as the fallback /
  // Model::LoadStateFrom.
  StatusOr<ReceivedVersion> Receive(int64_t min_version, common::Model& model,
                                    std::chrono::milliseconds timeout) override GRPO_EXCLUDES(mu_);
  std::string backend() const override { return options_.requested_backend; }
  void SetGroup(const GroupMembership& membership) override GRPO_EXCLUDES(mu_);

  // The backend of the group the thread serves ("" before the first Register; "grpc" when the
  // learner assigned no group).
  std::string assigned_backend() const GRPO_EXCLUDES(mu_);
  int64_t versions_received() const { return versions_received_.load(); }  // over the group
  int64_t installs_from_group() const { return installs_from_group_.load(); }
  int64_t installs_from_fallback() const { return installs_from_fallback_.load(); }
  int64_t groups_joined() const { return groups_joined_.load(); }
  // The last version kept from the group (-1 when none: none received, or the membership moved
  // to another learner incarnation since) and its tensors (never written again).
  std::pair<int64_t, common::NamedTensors> latest() const GRPO_EXCLUDES(mu_);

 private:
  struct Slot {
    std::string name;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
  };

  void Loop() GRPO_EXCLUDES(mu_);
  // Serves one epoch's group: joins when this worker is on the roster, then receives until a
  // collective fails, the epoch or incarnation changes, a version of another incarnation is
  // announced, or stop. The reason it left.
  Status ServeEpoch(const GroupMembership& m, const std::string& backend) GRPO_EXCLUDES(mu_);
  // Polls `key` at m's epoch until set, the membership changes or stop: the value or the last
  // error.
  StatusOr<std::string> WaitForKey(const std::string& key, const GroupMembership& m)
      GRPO_EXCLUDES(mu_);
  // The kept version is >= min_version and of the membership's incarnation.
  bool UsableLocked(int64_t min_version) const GRPO_REQUIRES(mu_);
  // The membership is still m's epoch of m's learner incarnation, and not stopping.
  bool StillServing(const GroupMembership& m) const GRPO_EXCLUDES(mu_);

  const std::shared_ptr<common::EpochStore> store_;
  const std::unique_ptr<WeightReceiver> fallback_;  // main thread (Receive) only
  const common::WeightSyncFactory factory_;
  const GroupWeightReceiverOptions options_;
  std::vector<Slot> layout_;  // set by the first Receive, before the thread starts
  std::thread thread_;

  mutable common::Mutex mu_;
  common::CondVar cv_;
  GroupMembership membership_ GRPO_GUARDED_BY(mu_);
  bool stop_ GRPO_GUARDED_BY(mu_) = false;
  bool in_group_ GRPO_GUARDED_BY(mu_) = false;
  int64_t latest_version_ GRPO_GUARDED_BY(mu_) = -1;
  std::string latest_incarnation_ GRPO_GUARDED_BY(mu_);  // the learner that announced latest_
  common::NamedTensors latest_ GRPO_GUARDED_BY(mu_);

  std::atomic<int64_t> versions_received_{0}, installs_from_group_{0}, installs_from_fallback_{0},
      groups_joined_{0};
};

}  // namespace grpo::rollout
