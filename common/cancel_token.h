// CancelToken: a flag that one thread trips (a gRPC reactor's OnCancel, a test) and that long
// waits elsewhere watch without polling. A wait registers a wake-up for as long as it waits,
// usually "take my mutex, notify my condition variable"; Cancel runs every registered wake-up.
// Header only.
//
//   common::CancelToken::Subscription wake =
//       common::CancelToken::Watch(cancel, [this] { common::MutexLock l(&mu_); cv_.NotifyAll(); });
//   common::MutexLock lock(&mu_);
//   while (!ready_ && !common::CancelToken::Tripped(cancel)) cv_.WaitUntil(&mu_, deadline);
//
// Why the wake-up takes the waiter's mutex: the waiter reads cancelled() and starts waiting
// under that mutex, so a Cancel that trips the flag and then takes the mutex to notify cannot
// fall between the two (no lost wake-up).
//
// Lock order: a wake-up runs with the token's own mutex held, so it may take the waiter's mutex,
// and a Subscription must not be destroyed, nor Watch called, with that mutex held (create it
// before the lock, let it end after). cancelled() takes no lock and may be called anywhere.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <utility>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace grpo::common {

class CancelToken {
 public:
  CancelToken() = default;
  CancelToken(const CancelToken&) = delete;
  CancelToken& operator=(const CancelToken&) = delete;

  // While alive, a Cancel runs its wake-up. Destroying it unregisters: once the destructor has
  // returned, the wake-up is not running and never will.
  class Subscription {
   public:
    Subscription() = default;
    Subscription(Subscription&& o) noexcept
        : token_(std::exchange(o.token_, nullptr)), id_(o.id_) {}
    Subscription& operator=(Subscription&& o) noexcept {
      if (this != &o) {
        Reset();
        token_ = std::exchange(o.token_, nullptr);
        id_ = o.id_;
      }
      return *this;
    }
    Subscription(const Subscription&) = delete;
    Subscription& operator=(const Subscription&) = delete;
    ~Subscription() { Reset(); }

   private:
    friend class CancelToken;
    Subscription(CancelToken* token, int64_t id) : token_(token), id_(id) {}
    void Reset() {
      if (token_ != nullptr) token_->Unregister(id_);
      token_ = nullptr;
    }
    CancelToken* token_ = nullptr;
    int64_t id_ = 0;
  };

  // Trips the flag (once; later calls do nothing) and runs every registered wake-up. Any thread.
  void Cancel() GRPO_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (cancelled_.exchange(true)) return;
    for (auto& [id, wake] : wakes_) wake();
  }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  // For a wait given a token that may be null (a caller that cannot be cancelled).
  static bool Tripped(const CancelToken* token) { return token != nullptr && token->cancelled(); }

  // Registers `wake` until the returned Subscription ends; runs it at once when the token is
  // already cancelled. A null token (a caller that cannot be cancelled) gives an empty
  // Subscription and never runs `wake`.
  [[nodiscard]] static Subscription Watch(const CancelToken* token, std::function<void()> wake) {
    if (token == nullptr) return {};
    // Registration changes only the wake-up list, never the flag: a waiter holds a const token.
    auto* t = const_cast<CancelToken*>(token);
    return t->Register(std::move(wake));
  }

 private:
  Subscription Register(std::function<void()> wake) GRPO_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (cancelled_.load()) wake();
    const int64_t id = next_id_++;
    wakes_.emplace(id, std::move(wake));
    return Subscription(this, id);
  }
  void Unregister(int64_t id) GRPO_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    wakes_.erase(id);
  }

  std::atomic<bool> cancelled_{false};
  Mutex mu_;
  std::map<int64_t, std::function<void()>> wakes_ GRPO_GUARDED_BY(mu_);
  int64_t next_id_ GRPO_GUARDED_BY(mu_) = 1;
};

}  // namespace grpo::common
