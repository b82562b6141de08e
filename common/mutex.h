// The project's mutex, its scoped lock and its condition variable: std::mutex and
// std::condition_variable under the thread-safety annotations of common/thread_annotations.h,
// so that clang checks every GRPO_GUARDED_BY member is touched with its lock held. Header only.
//
//   mutable common::Mutex mu_;
//   int64_t epoch_ GRPO_GUARDED_BY(mu_) = 1;
//   ...
//   common::MutexLock lock(&mu_);
//   while (epoch_ == seen) cv_.WaitUntil(&mu_, deadline);  // a loop, not a predicate lambda:
//                                                          // the analysis sees the lock held
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "common/thread_annotations.h"

namespace grpo::common {

class GRPO_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() GRPO_ACQUIRE() {
    mu_.lock();
    NoteAcquired();
  }
  void Unlock() GRPO_RELEASE() {
    NoteReleasing();
    mu_.unlock();
  }
  // Tells the analysis the lock is held where it cannot see it (a callback run under it).
  void AssertHeld() const GRPO_ASSERT_CAPABILITY(this) {}

  // Opt-in (off by default; costs two clock reads per hold when on; call it before other
  // threads use the mutex): from now on, record the
  // longest time one holder kept the lock. A CondVar wait ends a hold and starts a new one.
  void TrackHoldTime() { track_ = true; }
  // The longest hold since TrackHoldTime, in seconds (0 when off). Any thread.
  double max_hold_seconds() const { return static_cast<double>(max_hold_ns_.load()) * 1e-9; }

 private:
  friend class CondVar;
  void NoteAcquired() {
    if (track_) held_since_ = std::chrono::steady_clock::now();
  }
  void NoteReleasing() {
    if (!track_) return;
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - held_since_)
                           .count();
    int64_t seen = max_hold_ns_.load();
    while (ns > seen && !max_hold_ns_.compare_exchange_weak(seen, ns)) {
    }
  }

  std::mutex mu_;
  std::atomic<bool> track_{false};
  std::chrono::steady_clock::time_point held_since_;  // written and read by the holder only
  std::atomic<int64_t> max_hold_ns_{0};
};

// Holds `mu` for its scope.
class GRPO_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) GRPO_ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() GRPO_RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// Waits release `mu` while blocked and hold it again on return (spurious wake-ups included:
// wait in a loop over the condition).
class CondVar {
 public:
  void Wait(Mutex* mu) GRPO_REQUIRES(mu) {
    mu->NoteReleasing();
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
    mu->NoteAcquired();
  }
  // False when `deadline` passed.
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline)
      GRPO_REQUIRES(mu) {
    mu->NoteReleasing();
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool woke = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    mu->NoteAcquired();
    return woke;
  }
  // False when `timeout` passed.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& timeout) GRPO_REQUIRES(mu) {
    return WaitUntil(mu, std::chrono::steady_clock::now() + timeout);
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace grpo::common
