#include "common/weight_sync/fake_weight_sync.h"

#include <cstring>
#include <string>

#include "common/weight_sync/weight_sync_protocol.h"

namespace grpo::common {

void FakeWeightSyncHub::AbortEpoch(int64_t epoch) {
  {
    MutexLock lock(&mu_);
    aborted_.insert(epoch);
  }
  cv_.NotifyAll();
}

Status FakeWeightSyncHub::Exchange(int64_t epoch, int64_t seq, int rank, std::vector<uint8_t> mine,
                                   int ready, std::chrono::steady_clock::time_point deadline,
                                   std::vector<std::vector<uint8_t>>* rows) {
  MutexLock lock(&mu_);
  const auto key = std::make_pair(epoch, seq);
  Round& round = rounds_[key];
  if (round.rows.empty()) {
    round.rows.resize(world_size_);
    round.in.assign(world_size_, false);
  }
  round.rows[rank] = std::move(mine);
  round.in[rank] = true;
  ++round.arrived;
  cv_.NotifyAll();
  // Rows 0..ready-1 must be in: rank 0's for a broadcast, everyone's for an all-gather.
  auto done = [&] {
    for (int r = 0; r < ready; ++r) {
      if (!round.in[r]) return false;
    }
    return true;
  };
  while (!done() && aborted_.count(epoch) == 0) {
    if (!cv_.WaitUntil(&mu_, deadline)) break;  // timed out: the checks below tell why
  }
  if (!done()) {
    if (aborted_.count(epoch) && std::chrono::steady_clock::now() < deadline) {
      return Status::Aborted("a peer aborted the group");
    }
    aborted_.insert(epoch);
    cv_.NotifyAll();
    std::string missing;
    for (int r = 0; r < ready; ++r) {
      if (round.in[r]) continue;
      if (!missing.empty()) missing += ',';
      missing += std::to_string(r);
    }
    return Status::DeadlineExceeded("collective " + std::to_string(seq) +
                                    " timed out waiting for rank(s) " + missing);
  }
  rows->assign(round.rows.begin(), round.rows.begin() + ready);
  if (++round.departed == world_size_) rounds_.erase(key);
  return Status::OK();
}

namespace {

class FakeWeightSync final : public HostMemoryWeightSync {
 public:
  FakeWeightSync(std::shared_ptr<FakeWeightSyncHub> hub, int rank, int64_t epoch,
                 WeightSyncOptions options)
      : HostMemoryWeightSync(rank, hub->world_size(), epoch, options), hub_(std::move(hub)) {}
  ~FakeWeightSync() override = default;  // nothing to tear down but the hub's rounds

 protected:
  const char* backend_name() const override { return "fake"; }

  Status BroadcastBytes(void* data, int64_t bytes) override {
    std::vector<uint8_t> mine;
    if (rank() == 0) mine.assign(static_cast<uint8_t*>(data), static_cast<uint8_t*>(data) + bytes);
    std::vector<std::vector<uint8_t>> rows;
    RETURN_IF_ERROR(Exchange(std::move(mine), 1, &rows));
    if (rank() != 0) {
      if (static_cast<int64_t>(rows[0].size()) != bytes) {
        return Status::Internal("broadcast of " + std::to_string(rows[0].size()) +
                                " bytes into a buffer of " + std::to_string(bytes));
      }
      std::memcpy(data, rows[0].data(), bytes);
    }
    return Status::OK();
  }

  Status AllGatherInt64(const std::vector<int64_t>& mine, std::vector<int64_t>* all) override {
    std::vector<uint8_t> bytes(mine.size() * sizeof(int64_t));
    std::memcpy(bytes.data(), mine.data(), bytes.size());
    std::vector<std::vector<uint8_t>> rows;
    RETURN_IF_ERROR(Exchange(std::move(bytes), world_size(), &rows));
    all->assign(mine.size() * world_size(), 0);
    for (int r = 0; r < world_size(); ++r) {
      if (rows[r].size() != mine.size() * sizeof(int64_t)) {
        return Status::Internal("all-gather rows of different lengths");
      }
      std::memcpy(all->data() + r * mine.size(), rows[r].data(), rows[r].size());
    }
    return Status::OK();
  }

  void AbortBackend() override { hub_->AbortEpoch(epoch()); }

 private:
  Status Exchange(std::vector<uint8_t> mine, int ready, std::vector<std::vector<uint8_t>>* rows) {
    const auto deadline = std::chrono::steady_clock::now() + options().timeout;
    return hub_->Exchange(epoch(), seq_++, rank(), std::move(mine), ready, deadline, rows);
  }

  std::shared_ptr<FakeWeightSyncHub> hub_;
  int64_t seq_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<WeightSync>> CreateFakeWeightSync(std::shared_ptr<FakeWeightSyncHub> hub,
                                                           int rank, int64_t epoch,
                                                           WeightSyncOptions options) {
  if (!hub) return Status::InvalidArgument("fake weight sync needs a hub");
  if (rank < 0 || rank >= hub->world_size()) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " outside world of " +
                                   std::to_string(hub->world_size()));
  }
  if (options.bucket_bytes <= 0) return Status::InvalidArgument("bucket_bytes must be > 0");
  return std::unique_ptr<WeightSync>(
      std::make_unique<FakeWeightSync>(std::move(hub), rank, epoch, options));
}

}  // namespace grpo::common
