// FakeWeightSync: WeightSync between threads of one process, for tests of callers. Peers of one
// group share a FakeWeightSyncHub; collectives copy bytes through it. The protocol (version
// agreement, layout check, checksum, deadlines, abort) is the real one (CollectiveWeightSync);
// only the transport is fake. CPU tensors only.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/weight_sync/weight_sync.h"

namespace grpo::common {

// The meeting point of the fake peers of every epoch of one group. Thread-safe.
class FakeWeightSyncHub {
 public:
  explicit FakeWeightSyncHub(int world_size) : world_size_(world_size) {}
  int world_size() const { return world_size_; }

  // Makes every pending and later collective of `epoch` fail with Aborted on every peer, as a
  // peer's crash does to a real group.
  void AbortEpoch(int64_t epoch) GRPO_EXCLUDES(mu_);

  // One collective (internal to the fake): `rank` contributes `mine` to the `seq`-th collective
  // of `epoch` and waits until `ready` rows are in (1 = broadcast from rank 0, world_size =
  // all-gather), then copies them to `rows`. DeadlineExceeded (and the epoch aborted) past
  // `deadline`; Aborted when the epoch is aborted.
  Status Exchange(int64_t epoch, int64_t seq, int rank, std::vector<uint8_t> mine, int ready,
                  std::chrono::steady_clock::time_point deadline,
                  std::vector<std::vector<uint8_t>>* rows) GRPO_EXCLUDES(mu_);

 private:
  struct Round {
    std::vector<std::vector<uint8_t>> rows;
    std::vector<bool> in;
    int arrived = 0;
    int departed = 0;
  };
  const int world_size_;
  mutable Mutex mu_;
  CondVar cv_;
  std::map<std::pair<int64_t, int64_t>, Round> rounds_ GRPO_GUARDED_BY(mu_);  // by (epoch, seq)
  std::set<int64_t> aborted_ GRPO_GUARDED_BY(mu_);
};

// A peer of `hub`'s group. InvalidArgument for a rank outside [0, world_size). No rendezvous:
// a peer that never joins shows as DeadlineExceeded at the first collective.
StatusOr<std::unique_ptr<WeightSync>> CreateFakeWeightSync(std::shared_ptr<FakeWeightSyncHub> hub,
                                                           int rank, int64_t epoch,
                                                           WeightSyncOptions options = {});

}  // namespace grpo::common
