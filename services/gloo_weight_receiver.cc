#include "services/gloo_weight_receiver.h"

#include <algorithm>
#include <exception>
#include <sstream>

#include "common/gloo_weight_sync.h"
#include "common/logging.h"

namespace grpo::services {
namespace {

using Clock = std::chrono::steady_clock;

// The worker ids of the roster's lines, in rank order (rank = index + 1).
std::vector<std::string> ParseRoster(const std::string &text) {
  std::vector<std::string> ids;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty())
      ids.push_back(line);
  }
  return ids;
}

} // namespace

GlooWeightReceiver::GlooWeightReceiver(std::shared_ptr<grpc::Channel> channel,
                                       std::string auth_token,
                                       GlooWeightReceiverOptions options)
    : channel_(channel), auth_token_(std::move(auth_token)),
      options_(std::move(options)),
      grpc_(std::move(channel), auth_token_, options_.chunk_bytes) {}

GlooWeightReceiver::~GlooWeightReceiver() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable())
    thread_.join();
}

void GlooWeightReceiver::SetGroup(const std::string &worker_id,
                                  int64_t group_epoch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_id_ == worker_id && epoch_ == group_epoch)
      return;
    worker_id_ = worker_id;
    epoch_ = group_epoch;
  }
  cv_.notify_all();
}

std::pair<int64_t, common::NamedTensors> GlooWeightReceiver::latest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {latest_version_, latest_};
}

bool GlooWeightReceiver::EpochIs(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(mu_);
  return !stop_ && epoch_ == epoch;
}

StatusOr<int64_t>
GlooWeightReceiver::Receive(int64_t min_version, common::Model &model,
                            std::chrono::milliseconds timeout) {
  if (!thread_.joinable()) {
    for (const auto &[name, t] : model.NamedParameters()) {
      layout_.push_back({name, t.sizes().vec(), t.scalar_type()});
    }
    thread_ = std::thread([this] { Loop(); });
  }
  int64_t version = -1;
  common::NamedTensors tensors;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::min(options_.version_wait, timeout), [&] {
      return latest_version_ >= min_version || !in_group_ || stop_;
    });
    if (latest_version_ >= min_version) {
      version = latest_version_;
      tensors = latest_;
    }
  }
  if (version >= 0) {
    RETURN_IF_ERROR(model.LoadStateFrom(tensors).WithContext(
        "weights of version " + std::to_string(version)));
    installs_from_gloo_ += 1;
    return version;
  }
  ASSIGN_OR_RETURN(version, grpc_.Receive(min_version, model, timeout));
  installs_from_grpc_ += 1;
  return version;
}

StatusOr<std::string> GlooWeightReceiver::WaitForKey(GrpcStore &store,
                                                     const std::string &key,
                                                     int64_t epoch) {
  while (true) {
    StatusOr<std::string> v = store.Get(key, kGlooStorePollInterval);
    if (v.ok() || v.status().code() != StatusCode::kDeadlineExceeded ||
        !EpochIs(epoch))
      return v;
  }
}

void GlooWeightReceiver::Loop() {
  common::GlooWeightSyncOptions sync_options;
  sync_options.sync.timeout = options_.timeout;
  sync_options.hostname = options_.hostname;
  int64_t done_epoch = 0; // the last epoch joined or given up on
  while (true) {
    int64_t epoch = 0;
    std::string id;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock,
               [&] { return stop_ || (epoch_ > 0 && epoch_ != done_epoch); });
      if (stop_)
        return;
      epoch = epoch_;
      id = worker_id_;
    }
    done_epoch = epoch;
    auto store =
        GrpcStore::Connect(channel_, auth_token_, epoch, options_.timeout);
    StatusOr<std::string> roster =
        WaitForKey(*store, kWeightSyncRosterKey, epoch);
    if (!roster.ok()) {
      if (roster.status().code() == StatusCode::kUnimplemented) {
        GRPO_LOG_WARN("gloo weight sync: the learner has no Store ({}); using "
                      "GetWeights only",
                      roster.status().ToString());
        return;
      }
      GRPO_LOG_DEBUG("gloo weight sync: no group at epoch {}: {}", epoch,
                     roster.status().ToString());
      continue;
    }
    const std::vector<std::string> ids = ParseRoster(*roster);
    const auto it = std::find(ids.begin(), ids.end(), id);
    if (it == ids.end())
      continue; // not in this epoch's group: wait for the next epoch
    const int rank = static_cast<int>(it - ids.begin()) + 1;
    const int world = static_cast<int>(ids.size()) + 1;
    auto created =
        common::CreateGlooWeightSync(store, rank, world, epoch, sync_options);
    if (!created.ok()) {
      GRPO_LOG_WARN("gloo weight sync: joining epoch {} as rank {}/{}: {}",
                    epoch, rank, world, created.status().ToString());
      continue;
    }
    std::unique_ptr<common::WeightSync> sync = std::move(created).value();
    groups_joined_ += 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_group_ = true;
    }
    GRPO_LOG_INFO("gloo weight sync: joined epoch {} as rank {}/{}", epoch,
                  rank, world);
    Status s;
    for (int64_t seq = 0; s.ok(); ++seq) {
      if (!EpochIs(epoch)) {
        s = Status::Aborted("the epoch changed or the receiver is stopping");
        break;
      }
      StatusOr<std::string> announced = WaitForKey(
          *store, kWeightSyncVersionKeyPrefix + std::to_string(seq), epoch);
      if (!announced.ok()) {
        s = announced.status();
        break;
      }
      common::NamedTensors fresh;
      try {
        fresh.reserve(layout_.size());
        for (const Slot &slot : layout_) {
          fresh.emplace_back(
              slot.name,
              at::empty(slot.shape, at::TensorOptions().dtype(slot.dtype)));
        }
      } catch (const std::exception &e) {
        s = Status::ResourceExhausted(
            std::string("gloo weight sync: allocating: ") + e.what());
        break;
      }
      s = sync->Begin(common::kAnyVersion);
      if (s.ok())
        s = sync->Broadcast(fresh);
      if (s.ok())
        s = sync->Commit();
      if (s.ok()) {
        versions_received_ += 1;
        {
          std::lock_guard<std::mutex> lock(mu_);
          latest_version_ = sync->committed_version();
          latest_ = std::move(fresh);
        }
        cv_.notify_all();
      }
    }
    sync->Abort();
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_group_ = false;
    }
    cv_.notify_all();
    GRPO_LOG_INFO("gloo weight sync: left epoch {}: {}", epoch, s.ToString());
  }
}

} // namespace grpo::services
