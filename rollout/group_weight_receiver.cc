#include "rollout/group_weight_receiver.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "common/logging.h"
#include "common/weight_sync/group.h"

namespace grpo::rollout {
namespace {

// The group backend a membership names: the learner's assignment, or (from a learner that does
// not assign) the requested one when it is a group backend. Empty: no group.
std::string GroupBackendOf(const GroupMembership& m, const std::string& requested) {
  const std::string& b = m.backend.empty() ? requested : m.backend;
  const auto& all = common::GroupBackends();
  return std::find(all.begin(), all.end(), b) != all.end() ? b : std::string();
}

}  // namespace

GroupWeightReceiver::GroupWeightReceiver(std::shared_ptr<common::EpochStore> store,
                                         std::unique_ptr<WeightReceiver> fallback,
                                         common::WeightSyncFactory factory,
                                         GroupWeightReceiverOptions options)
    : store_(std::move(store)),
      fallback_(std::move(fallback)),
      factory_(std::move(factory)),
      options_(std::move(options)) {}

GroupWeightReceiver::~GroupWeightReceiver() {
  {
    common::MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void GroupWeightReceiver::SetGroup(const GroupMembership& membership) {
  {
    common::MutexLock lock(&mu_);
    if (membership_.worker_id == membership.worker_id && membership_.epoch == membership.epoch &&
        membership_.backend == membership.backend &&
        membership_.learner_incarnation == membership.learner_incarnation) {
      return;
    }
    if (membership_.learner_incarnation != membership.learner_incarnation) {
      // Another learner process: what the group gave us is of the one the worker left.
      latest_version_ = -1;
      latest_incarnation_.clear();
      latest_.clear();
    }
    membership_ = membership;
  }
  fallback_->SetGroup(membership);
  cv_.NotifyAll();
}

std::string GroupWeightReceiver::assigned_backend() const {
  common::MutexLock lock(&mu_);
  if (membership_.epoch == 0) return "";
  const std::string b = GroupBackendOf(membership_, options_.requested_backend);
  return b.empty() ? std::string(common::kBackendGrpc) : b;
}

std::pair<int64_t, common::NamedTensors> GroupWeightReceiver::latest() const {
  common::MutexLock lock(&mu_);
  return {latest_version_, latest_};
}

bool GroupWeightReceiver::StillServing(const GroupMembership& m) const {
  common::MutexLock lock(&mu_);
  return !stop_ && membership_.epoch == m.epoch &&
         membership_.learner_incarnation == m.learner_incarnation;
}

bool GroupWeightReceiver::UsableLocked(int64_t min_version) const {
  // A kept version of another incarnation never counts (SetGroup clears it; this holds it
  // against a thread that kept one just before the membership moved).
  return latest_version_ >= min_version && latest_incarnation_ == membership_.learner_incarnation;
}

StatusOr<ReceivedVersion> GroupWeightReceiver::Receive(int64_t min_version, common::Model& model,
                                                       std::chrono::milliseconds timeout) {
  if (!thread_.joinable()) {
    for (const auto& [name, t] : model.NamedParameters()) {
      layout_.push_back({name, t.sizes().vec(), t.scalar_type()});
    }
    thread_ = std::thread([this] { Loop(); });
  }
  ReceivedVersion got;
  common::NamedTensors tensors;
  {
    common::MutexLock lock(&mu_);
    // As wait_for with a predicate: one deadline from when the lock is held.
    const auto deadline =
        std::chrono::steady_clock::now() + std::min(options_.version_wait, timeout);
    while (!UsableLocked(min_version) && in_group_ && !stop_) {
      if (!cv_.WaitUntil(&mu_, deadline)) break;
    }
    if (UsableLocked(min_version)) {
      got = {latest_version_, latest_incarnation_};
      tensors = latest_;
    }
  }
  if (got.version >= 0) {
    RETURN_IF_ERROR(model.LoadStateFrom(tensors).WithContext("weights of version " +
                                                             std::to_string(got.version)));
    installs_from_group_ += 1;
    return got;
  }
  ASSIGN_OR_RETURN(got, fallback_->Receive(min_version, model, timeout));
  installs_from_fallback_ += 1;
  return got;
}

StatusOr<std::string> GroupWeightReceiver::WaitForKey(const std::string& key,
                                                      const GroupMembership& m) {
  while (true) {
    StatusOr<std::string> v = store_->Get(m.epoch, key, kGroupStorePollInterval);
    if (v.ok() || v.status().code() != StatusCode::kDeadlineExceeded || !StillServing(m)) {
      return v;
    }
  }
}

void GroupWeightReceiver::Loop() {
  // The last (incarnation, epoch) served or given up on: a restarted learner numbers its
  // epochs anew, so an epoch number alone does not name a group.
  std::pair<std::string, int64_t> done{"", 0};
  while (true) {
    GroupMembership m;
    {
      common::MutexLock lock(&mu_);
      while (!stop_ && !(membership_.epoch > 0 && std::make_pair(membership_.learner_incarnation,
                                                                 membership_.epoch) != done)) {
        cv_.Wait(&mu_);
      }
      if (stop_) return;
      m = membership_;
    }
    done = {m.learner_incarnation, m.epoch};
    const std::string backend = GroupBackendOf(m, options_.requested_backend);
    if (backend.empty()) continue;  // the learner assigned GetWeights
    Status s = ServeEpoch(m, backend);
    if (s.code() == StatusCode::kUnimplemented) {
      GRPO_LOG_WARN("{} weight sync: {}; using GetWeights only", backend, s.ToString());
      return;
    }
  }
}

Status GroupWeightReceiver::ServeEpoch(const GroupMembership& m, const std::string& backend) {
  const int64_t epoch = m.epoch;
  StatusOr<std::string> roster = WaitForKey(common::RosterKey(backend), m);
  if (!roster.ok()) {
    GRPO_LOG_DEBUG("{} weight sync: no group at epoch {}: {}", backend, epoch,
                   roster.status().ToString());
    return roster.status();
  }
  const std::vector<std::string> ids = common::ParseRoster(*roster);
  const auto it = std::find(ids.begin(), ids.end(), m.worker_id);
  if (it == ids.end()) return Status::OK();  // not in this epoch's group: wait for the next
  const int rank = static_cast<int>(it - ids.begin()) + 1;
  const int world = static_cast<int>(ids.size()) + 1;
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(
      common::GroupPrefix(backend),
      c10::make_intrusive<common::C10dEpochStore>(store_, epoch, options_.timeout));
  auto created = factory_(backend, group_store, rank, world, epoch);
  if (!created.ok()) {
    GRPO_LOG_WARN("{} weight sync: joining epoch {} as rank {}/{}: {}", backend, epoch, rank, world,
                  created.status().ToString());
    return created.status();
  }
  std::unique_ptr<common::WeightSync> sync = std::move(created).value();
  groups_joined_ += 1;
  {
    common::MutexLock lock(&mu_);
    in_group_ = true;
  }
  GRPO_LOG_INFO("{} weight sync: joined epoch {} as rank {}/{}", backend, epoch, rank, world);
  const at::Device device =
      backend == common::kBackendGloo ? at::Device(at::kCPU) : options_.device;
  Status s;
  for (int64_t seq = 0; s.ok(); ++seq) {
    if (!StillServing(m)) {
      s = Status::Aborted("the epoch or the learner changed, or the receiver is stopping");
      break;
    }
    StatusOr<std::string> announced = WaitForKey(common::VersionKey(backend, seq), m);
    if (!announced.ok()) {
      s = announced.status();
      break;
    }
    const std::optional<common::VersionAnnouncement> a =
        common::ParseVersionAnnouncement(*announced);
    if (!a) {
      s = Status::DataLoss("malformed version announcement '" + *announced + "'");
      break;
    }
    // Empty on either side: an older learner, which does not say.
    const std::string incarnation = a->incarnation.empty() ? m.learner_incarnation : a->incarnation;
    if (!m.learner_incarnation.empty() && incarnation != m.learner_incarnation) {
      s = Status::Aborted("version " + std::to_string(a->version) + " announced by learner " +
                          incarnation + ", registered with " + m.learner_incarnation);
      break;
    }
    common::NamedTensors fresh;
    try {
      fresh.reserve(layout_.size());
      for (const Slot& slot : layout_) {
        fresh.emplace_back(
            slot.name, at::empty(slot.shape, at::TensorOptions().dtype(slot.dtype).device(device)));
      }
    } catch (const std::exception& e) {
      s = Status::ResourceExhausted(backend + " weight sync: allocating: " + e.what());
      break;
    }
    s = sync->Begin(common::kAnyVersion);
    if (s.ok() && a->stream_group_bytes > 0) {
      // A streamed version (weight_publish: stream): the learner sends the tensors as its ranks
      // gather them, in the groups both ends derive from the layout.
      s = common::BroadcastInStreamGroups(*sync, fresh, a->stream_group_bytes);
    } else if (s.ok()) {
      s = sync->Broadcast(fresh);
    }
    if (s.ok()) s = sync->Commit();
    if (s.ok()) {
      versions_received_ += 1;
      {
        common::MutexLock lock(&mu_);
        // Kept only while the membership is still this incarnation's (it may have moved while
        // the collective ran).
        if (membership_.learner_incarnation == incarnation) {
          latest_version_ = sync->committed_version();
          latest_incarnation_ = incarnation;
          latest_ = std::move(fresh);
        }
      }
      cv_.NotifyAll();
    }
  }
  sync->Abort();
  {
    common::MutexLock lock(&mu_);
    in_group_ = false;
  }
  cv_.NotifyAll();
  GRPO_LOG_INFO("{} weight sync: left epoch {}: {}", backend, epoch, s.ToString());
  return s;
}

}  // namespace grpo::rollout
