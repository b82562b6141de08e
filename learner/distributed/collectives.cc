#include "learner/distributed/collectives.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstring>

namespace grpo::learner::distributed {

namespace {

class DonePending final : public PendingCollective {
 public:
  explicit DonePending(Status status) : status_(std::move(status)) {}
  Status Wait() override { return status_; }

 private:
  Status status_;
};

}  // namespace

std::unique_ptr<PendingCollective> Collectives::AllGatherAsync(const at::Tensor& input,
                                                               at::Tensor& output,
                                                               const std::string& what) {
  return std::make_unique<DonePending>(AllGather(input, output, what));
}

namespace {

// Buckets of consecutive tensors holding at most `bucket_bytes` each (a larger tensor alone).
std::vector<std::vector<at::Tensor>> Buckets(const std::vector<at::Tensor>& tensors,
                                             int64_t bucket_bytes) {
  std::vector<std::vector<at::Tensor>> buckets;
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
    if (buckets.empty() || (bytes + n > bucket_bytes && !buckets.back().empty())) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(t);
    bytes += n;
  }
  return buckets;
}

// Runs `op` on each bucket flattened into one buffer (on `through` when given), then copies the
// buffer back.
template <typename Op>
Status OverBuckets(const std::vector<at::Tensor>& tensors, int64_t bucket_bytes, Op op,
                   std::optional<at::Device> through = std::nullopt) {
  at::NoGradGuard no_grad;
  for (const std::vector<at::Tensor>& bucket : Buckets(tensors, bucket_bytes)) {
    std::vector<at::Tensor> flat_views;
    for (const at::Tensor& t : bucket) flat_views.push_back(t.reshape({-1}));
    std::vector<at::Tensor> flat = {
        bucket.size() == 1 && bucket[0].is_contiguous() ? flat_views[0] : at::cat(flat_views)};
    if (through.has_value() && flat[0].device() != *through) flat[0] = flat[0].to(*through);
    RETURN_IF_ERROR(op(flat));
    if (flat[0].data_ptr() == bucket[0].data_ptr()) continue;  // reduced in place
    int64_t at_elem = 0;
    for (const at::Tensor& t : bucket) {
      const int64_t n = t.numel();
      t.copy_(flat[0].narrow(0, at_elem, n).view(t.sizes()));
      at_elem += n;
    }
  }
  return Status::OK();
}

}  // namespace

Status BucketedAllReduceSum(Collectives& collectives, const std::vector<at::Tensor>& tensors,
                            int64_t bucket_bytes, const std::string& what,
                            std::optional<at::Device> through) {
  if (collectives.world_size() == 1 || tensors.empty()) return Status::OK();
  return OverBuckets(
      tensors, bucket_bytes,
      [&](std::vector<at::Tensor>& flat) { return collectives.AllReduceSum(flat, what); }, through);
}

Status BroadcastString(Collectives& collectives, std::string* text, const std::string& what) {
  const bool root = collectives.rank() == 0;
  std::vector<at::Tensor> head = {
      at::tensor(std::vector<int64_t>{root ? static_cast<int64_t>(text->size()) : 0}, at::kLong)};
  RETURN_IF_ERROR(collectives.Broadcast(head, what + " (its length)"));
  if (head[0].item<int64_t>() == 0) {  // every rank knows: no second broadcast
    text->clear();
    return Status::OK();
  }
  std::vector<at::Tensor> bytes = {at::zeros({head[0].item<int64_t>()}, at::kByte)};
  if (root) std::memcpy(bytes[0].data_ptr<uint8_t>(), text->data(), text->size());
  RETURN_IF_ERROR(collectives.Broadcast(bytes, what));
  text->assign(reinterpret_cast<const char*>(bytes[0].data_ptr<uint8_t>()),
               static_cast<size_t>(bytes[0].numel()));
  return Status::OK();
}

Status BucketedBroadcast(Collectives& collectives, const std::vector<at::Tensor>& tensors,
                         int64_t bucket_bytes, const std::string& what) {
  if (collectives.world_size() == 1 || tensors.empty()) return Status::OK();
  return OverBuckets(tensors, bucket_bytes, [&](std::vector<at::Tensor>& flat) {
    return collectives.Broadcast(flat, what);
  });
}

// ---------------------------------------------------------------------------------------------
// FakeRankGroup

class FakeRankGroup::Member final : public Collectives {
 public:
  Member(FakeRankGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }
  Status AllReduceSum(std::vector<at::Tensor>& tensors, const std::string& what) override {
    return group_->Join(rank_, Op::kSum, tensors, what);
  }
  Status AllReduceMax(std::vector<at::Tensor>& tensors, const std::string& what) override {
    return group_->Join(rank_, Op::kMax, tensors, what);
  }
  Status Broadcast(std::vector<at::Tensor>& tensors, const std::string& what) override {
    return group_->Join(rank_, Op::kBroadcast, tensors, what);
  }
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output,
                          const std::string& what) override {
    std::vector<at::Tensor> pair = {input, output};
    return group_->Join(rank_, Op::kReduceScatter, pair, what);
  }
  Status AllGather(const at::Tensor& input, at::Tensor& output, const std::string& what) override {
    std::vector<at::Tensor> pair = {input, output};
    return group_->Join(rank_, Op::kAllGather, pair, what);
  }

 private:
  FakeRankGroup* const group_;
  const int rank_;
};

FakeRankGroup::FakeRankGroup(int world_size, std::chrono::milliseconds timeout)
    : world_size_(world_size), timeout_(timeout) {
  for (int r = 0; r < world_size; ++r) members_.push_back(std::make_unique<Member>(this, r));
  common::MutexLock lock(&mu_);
  joined_.assign(world_size, nullptr);
}

FakeRankGroup::~FakeRankGroup() = default;

Collectives& FakeRankGroup::Rank(int r) { return *members_.at(r); }

void FakeRankGroup::FailRank(int r) {
  common::MutexLock lock(&mu_);
  if (!failed_) {
    failed_ = true;
    left_rank_ = r;
    failure_ = "rank " + std::to_string(r) + " left the group";
  }
  cv_.NotifyAll();
}

Status FakeRankGroup::Join(int rank, Op op, std::vector<at::Tensor>& tensors,
                           const std::string& what) {
  common::MutexLock lock(&mu_);
  const std::string who = "rank " + std::to_string(rank) + ": " + what;
  if (failed_) {
    return left_rank_ >= 0 ? Status::Unavailable(who + ": " + failure_)
                           : Status::Aborted(who + ": the group failed earlier (" + failure_ + ")");
  }
  joined_[rank] = &tensors;
  if (std::all_of(joined_.begin(), joined_.end(), [](const auto* t) { return t != nullptr; })) {
    at::NoGradGuard no_grad;
    if (op == Op::kReduceScatter || op == Op::kAllGather) {
      // {input, output} of every rank; n = the slice of one rank.
      const int64_t n =
          op == Op::kReduceScatter ? (*joined_[0])[1].numel() : (*joined_[0])[0].numel();
      for (int r = 0; r < world_size_; ++r) {
        at::Tensor out = (*joined_[r])[1];
        if (op == Op::kAllGather) {
          for (int q = 0; q < world_size_; ++q) out.narrow(0, q * n, n).copy_((*joined_[q])[0]);
          continue;
        }
        at::Tensor acc = (*joined_[0])[0].narrow(0, r * n, n).clone();
        for (int q = 1; q < world_size_; ++q) acc.add_((*joined_[q])[0].narrow(0, r * n, n));
        out.copy_(acc);
      }
      tensors.clear();  // every rank's result is in place: nothing below
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (op == Op::kBroadcast) {
        for (int r = 1; r < world_size_; ++r) (*joined_[r])[i].copy_((*joined_[0])[i]);
        continue;
      }
      at::Tensor acc = (*joined_[0])[i].clone();
      for (int r = 1; r < world_size_; ++r) {
        acc = op == Op::kSum ? acc + (*joined_[r])[i] : at::maximum(acc, (*joined_[r])[i]);
      }
      for (int r = 0; r < world_size_; ++r) (*joined_[r])[i].copy_(acc);
    }
    joined_.assign(world_size_, nullptr);
    ++generation_;
    cv_.NotifyAll();
    return Status::OK();
  }
  const int64_t mine = generation_;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (generation_ == mine && !failed_) {
    if (!cv_.WaitUntil(&mu_, deadline) && generation_ == mine && !failed_) {
      int missing = 0;
      while (missing < world_size_ && joined_[missing] != nullptr) ++missing;
      failed_ = true;
      failure_ = "rank " + std::to_string(missing) + " did not join " + what + " within " +
                 std::to_string(timeout_.count()) + " ms";
      cv_.NotifyAll();
      return Status::DeadlineExceeded(who + ": " + failure_);
    }
  }
  if (generation_ != mine) return Status::OK();
  joined_[rank] = nullptr;
  return left_rank_ >= 0 ? Status::Unavailable(who + ": " + failure_)
                         : Status::DeadlineExceeded(who + ": " + failure_);
}

}  // namespace grpo::learner::distributed
