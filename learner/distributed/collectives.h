// Collectives: what the trainer needs of the learner's rank group (docs/ARCHITECTURE.md
// "Learner ranks"): sums and maxima over ranks, a broadcast from rank 0, and ZeRO's
// reduce-scatter and all-gather over flat buffers, each
// bounded by the group's deadline and named, so that a failure says which collective of which
// step failed. Three implementations: SingleRank (the identity: world size 1 costs nothing),
// the c10d group of real processes (rank_group.h), and an in-process fake for tests whose
// ranks are threads and whose faults are injected (FakeRankGroup below).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace grpo::learner::distributed {

// An all-gather started by AllGatherAsync: Wait() blocks until it is done (or failed, with the
// errors of the synchronous collectives) and must be called once before `output` is read.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual Status Wait() = 0;
};

// Errors of every collective: DeadlineExceeded when a peer did not join within the deadline
// (stopped, or still computing past it), Unavailable when a peer left (died, closed the group),
// Aborted once the group has failed (every later collective fails at once: a group that lost a
// rank is not used again). Messages name `what` and the rank.
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Elementwise sum over the ranks, in place; every rank passes tensors of the same shapes and
  // dtypes in the same order. Contiguous tensors on one device.
  virtual Status AllReduceSum(std::vector<at::Tensor>& tensors, const std::string& what) = 0;
  // Elementwise maximum, as AllReduceSum.
  virtual Status AllReduceMax(std::vector<at::Tensor>& tensors, const std::string& what) = 0;
  // Rank 0's tensors into every other rank's (same shapes), in place.
  virtual Status Broadcast(std::vector<at::Tensor>& tensors, const std::string& what) = 0;
  // ZeRO's pair, over flat contiguous tensors of one dtype and device whose `input` (of
  // ReduceScatterSum) or `output` (of AllGather) has world_size x n elements and the other n.
  // ReduceScatterSum: `output` = slice [rank n, (rank + 1) n) of the elementwise sum of every
  // rank's `input`. AllGather: `output` = every rank's `input`, in rank order.
  virtual Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output,
                                  const std::string& what) = 0;
  virtual Status AllGather(const at::Tensor& input, at::Tensor& output,
                           const std::string& what) = 0;
  // AllGather started now and waited for later, so that compute runs meanwhile (full_shard's
  // prefetch of the next unit). It takes its place in the order of collectives when it starts:
  // the collectives issued after it match the other ranks' issued after theirs. `input` and
  // `output` must stay alive until Wait(). The default runs the all-gather at once (the
  // in-process fakes, SingleRank): the same results, no overlap.
  virtual std::unique_ptr<PendingCollective> AllGatherAsync(const at::Tensor& input,
                                                            at::Tensor& output,
                                                            const std::string& what);
};

// The identity: world size 1, rank 0; every collective returns at once (tests derive from it
// to observe one collective).
class SingleRank : public Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status AllReduceSum(std::vector<at::Tensor>&, const std::string&) override {
    return Status::OK();
  }
  Status AllReduceMax(std::vector<at::Tensor>&, const std::string&) override {
    return Status::OK();
  }
  Status Broadcast(std::vector<at::Tensor>&, const std::string&) override { return Status::OK(); }
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output,
                          const std::string&) override {
    output.copy_(input);
    return Status::OK();
  }
  Status AllGather(const at::Tensor& input, at::Tensor& output, const std::string&) override {
    output.copy_(input);
    return Status::OK();
  }
};

// Sums `tensors` over the ranks in buckets of at most `bucket_bytes` (each bucket one flat
// buffer, one collective: DDP's bucketing, 25 MiB by default there too), so a model of many
// small tensors costs few collectives and the extra memory is one bucket, not a model.
// Tensors of one dtype and device; with `through` (another device: the GPU beside a master on
// the host) each bucket is summed there and copied back.
Status BucketedAllReduceSum(Collectives& collectives, const std::vector<at::Tensor>& tensors,
                            int64_t bucket_bytes, const std::string& what,
                            std::optional<at::Device> through = std::nullopt);
// Rank 0's `*text` into every rank's (its length, then, unless it is empty, its bytes; the other
// ranks' own text is ignored).
Status BroadcastString(Collectives& collectives, std::string* text, const std::string& what);
// Rank 0's values of `tensors` into every rank's, in buckets as BucketedAllReduceSum.
Status BucketedBroadcast(Collectives& collectives, const std::vector<at::Tensor>& tensors,
                         int64_t bucket_bytes, const std::string& what);
inline constexpr int64_t kDefaultBucketBytes = 25 << 20;

// A group of `world_size` in-process ranks for tests: Rank(r) is rank r's Collectives, to be
// used from one thread per rank. Collectives match by call order, as c10d's do. A rank that
// does not join within `timeout` makes the others fail with DeadlineExceeded; FailRank(r)
// makes rank r leave (its peers' pending and later collectives fail with Unavailable).
class FakeRankGroup {
 public:
  FakeRankGroup(int world_size, std::chrono::milliseconds timeout);
  ~FakeRankGroup();
  Collectives& Rank(int r);
  int world_size() const { return world_size_; }
  void FailRank(int r);

 private:
  class Member;
  enum class Op { kSum, kMax, kBroadcast, kReduceScatter, kAllGather };
  Status Join(int rank, Op op, std::vector<at::Tensor>& tensors, const std::string& what);

  const int world_size_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Member>> members_;
  mutable common::Mutex mu_;
  common::CondVar cv_;
  // The collective being assembled: the tensors each rank passed (null = not joined yet); for
  // kReduceScatter and kAllGather, {input, output}.
  std::vector<std::vector<at::Tensor>*> joined_ GRPO_GUARDED_BY(mu_);
  int64_t generation_ GRPO_GUARDED_BY(mu_) = 0;  // collectives completed (names a round)
  int left_rank_ GRPO_GUARDED_BY(mu_) = -1;      // a rank that left, or -1
  bool failed_ GRPO_GUARDED_BY(mu_) = false;
  std::string failure_ GRPO_GUARDED_BY(mu_);
};

}  // namespace grpo::learner::distributed
