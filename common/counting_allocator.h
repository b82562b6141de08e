// A counter over libtorch's CPU allocator: the live bytes of CPU tensors and their peak, which
// is what `grpo plan` predicts on the CPU (the resident set adds glibc's free blocks). Used by
// tests that bound what a code path allocates (the checkpoint and the weight stream of
// full_shard, the learner's published weights) and by `grpo bench sharding`. A ThreadCount
// also counts the allocations of one thread apart: a rank of ranks that are threads.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace grpo::common {

// What libtorch's CPU allocator has handed out and not taken back, and its peak since Reset:
// wraps the allocator in place while a CountingScope lives. Its pointers are simple (context =
// data, as libtorch's resizable storages require; the wrapped allocation is kept in a table until
// freed), and the counter outlives every scope: a tensor it handed out may be freed after.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static CountingCpuAllocator& Get() {
    static CountingCpuAllocator* const counter = new CountingCpuAllocator();
    return *counter;
  }
  void Wrap(c10::Allocator* inner) { inner_ = inner; }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    if (n == 0) return inner;
    void* data = inner.get();
    const c10::Device device = inner.device();
    std::lock_guard<std::mutex> lock(mu_);
    live_ += static_cast<int64_t>(n);
    peak_ = std::max(peak_, live_);
    const std::shared_ptr<Tally>& tally = ThreadTally();
    if (tally) {
      tally->live += static_cast<int64_t>(n);
      tally->peak = std::max(tally->peak, tally->live);
    }
    held_.emplace(data, Held{std::move(inner), static_cast<int64_t>(n), tally});
    return {data, data, &Free, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  // The bytes live now, the peak from now on.
  int64_t Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = live_;
    return live_;
  }
  int64_t live() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

  // The live bytes allocated by one thread (freed by any) and their peak, while the thread's
  // ThreadCount lives.
  struct Tally {
    int64_t live = 0, peak = 0;
  };
  static std::shared_ptr<Tally>& ThreadTally() {
    thread_local std::shared_ptr<Tally> tally;
    return tally;
  }
  std::mutex& mutex() { return mu_; }

 private:
  CountingCpuAllocator() = default;
  struct Held {
    c10::DataPtr inner;
    int64_t bytes = 0;
    std::shared_ptr<Tally> tally;  // the allocating thread's, if it counted
  };
  static void Free(void* data) {
    CountingCpuAllocator& self = Get();
    c10::DataPtr inner;  // freed after the lock
    std::lock_guard<std::mutex> lock(self.mu_);
    auto it = self.held_.find(data);
    if (it == self.held_.end()) return;
    self.live_ -= it->second.bytes;
    if (it->second.tally) it->second.tally->live -= it->second.bytes;
    inner = std::move(it->second.inner);
    self.held_.erase(it);
  }
  c10::Allocator* inner_ = nullptr;
  std::mutex mu_;
  std::map<void*, Held> held_;
  int64_t live_ = 0, peak_ = 0;
};

// Installs the counter over the CPU allocator for its lifetime (c10::SetCPUAllocator takes an
// allocator of a priority at least the current one's: each install and restore goes one up).
class CountingScope {
 public:
  CountingScope() : previous_(c10::GetCPUAllocator()) {
    CountingCpuAllocator::Get().Wrap(previous_);
    c10::SetCPUAllocator(&CountingCpuAllocator::Get(), ++priority_);
  }
  ~CountingScope() { c10::SetCPUAllocator(previous_, ++priority_); }
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;

 private:
  static inline uint8_t priority_ = 0;
  c10::Allocator* const previous_;
};

// Counts this thread's allocations apart while it lives (a CountingScope must be installed):
// live() and peak() are the bytes this thread allocated and not yet freed, and their peak since
// the count began.
class ThreadCount {
 public:
  ThreadCount() : tally_(std::make_shared<CountingCpuAllocator::Tally>()) {
    CountingCpuAllocator::ThreadTally() = tally_;
  }
  ~ThreadCount() { CountingCpuAllocator::ThreadTally().reset(); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;
  int64_t live() const {
    std::lock_guard<std::mutex> lock(CountingCpuAllocator::Get().mutex());
    return tally_->live;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(CountingCpuAllocator::Get().mutex());
    return tally_->peak;
  }
  // The peak from now on.
  void Reset() {
    std::lock_guard<std::mutex> lock(CountingCpuAllocator::Get().mutex());
    tally_->peak = tally_->live;
  }

 private:
  const std::shared_ptr<CountingCpuAllocator::Tally> tally_;
};

}  // namespace grpo::common
