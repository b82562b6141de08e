#include "common/weight_sync/epoch_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <utility>

namespace grpo::common {
namespace {

using Clock = std::chrono::steady_clock;

// c10d reports failures by throwing.
template <typename T>
T ValueOrThrow(StatusOr<T> v) {
  TORCH_CHECK(v.ok(), "grpo store: ", v.status().ToString());
  return std::move(v).value();
}

std::vector<uint8_t> ToBytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string FromBytes(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// InMemoryEpochStore

int64_t InMemoryEpochStore::epoch() const {
  MutexLock lock(&mu_);
  return epoch_;
}

bool InMemoryEpochStore::AdvanceFrom(int64_t from) {
  {
    MutexLock lock(&mu_);
    if (epoch_ != from) return false;
    epoch_ += 1;
    kv_.clear();
  }
  cv_.NotifyAll();
  return true;
}

int64_t InMemoryEpochStore::Advance() {
  int64_t now;
  {
    MutexLock lock(&mu_);
    now = ++epoch_;
    kv_.clear();
  }
  cv_.NotifyAll();
  return now;
}

void InMemoryEpochStore::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.NotifyAll();
}

Status InMemoryEpochStore::CheckEpochLocked(int64_t epoch, const std::string& key,
                                            bool key_needed) const {
  if (epoch != epoch_) {
    return Status::FailedPrecondition("Store: group_epoch " + std::to_string(epoch) +
                                      " is not the current " + std::to_string(epoch_) +
                                      ": Register again");
  }
  if (stopping_) return Status::Unavailable("the learner is shutting down");
  if (key_needed && key.empty()) return Status::InvalidArgument("Store: empty key");
  return Status::OK();
}

Status InMemoryEpochStore::CheckRoomLocked(const std::string& key) const {
  if (kv_.size() >= kMaxEpochStoreKeys && kv_.count(key) == 0) {
    return Status::ResourceExhausted("Store: too many keys (" + std::to_string(kMaxEpochStoreKeys) +
                                     ") in one epoch");
  }
  return Status::OK();
}

StatusOr<std::string> InMemoryEpochStore::Get(int64_t epoch, const std::string& key,
                                              std::chrono::milliseconds timeout) {
  return GetUnlessCancelled(epoch, key, timeout, nullptr);
}

StatusOr<std::string> InMemoryEpochStore::GetUnlessCancelled(int64_t epoch, const std::string& key,
                                                             std::chrono::milliseconds timeout,
                                                             const CancelToken* cancel) {
  timeout = std::clamp(timeout, std::chrono::milliseconds(0), kMaxEpochStoreTimeout);
  const auto deadline = Clock::now() + timeout;
  const CancelToken::Subscription wake = CancelToken::Watch(cancel, [this] {
    MutexLock lock(&mu_);
    cv_.NotifyAll();
  });
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckEpochLocked(epoch, key, true));
  while (true) {
    if (epoch != epoch_) {
      return Status::FailedPrecondition("Store: group_epoch " + std::to_string(epoch) +
                                        " ended while waiting for '" + key + "'");
    }
    if (stopping_) return Status::Unavailable("the learner is shutting down");
    if (auto it = kv_.find(key); it != kv_.end()) return it->second;
    if (CancelToken::Tripped(cancel)) {
      return Status::Cancelled("Store: the caller went away");
    }
    if (Clock::now() >= deadline) {
      return Status::DeadlineExceeded("Store: key '" + key + "' not set within " +
                                      std::to_string(timeout.count()) + " ms");
    }
    cv_.WaitUntil(&mu_, deadline);
  }
}

Status InMemoryEpochStore::Set(int64_t epoch, const std::string& key, const std::string& value) {
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckEpochLocked(epoch, key, true));
    RETURN_IF_ERROR(CheckRoomLocked(key));
    kv_[key] = value;
  }
  cv_.NotifyAll();
  return Status::OK();
}

StatusOr<int64_t> InMemoryEpochStore::Add(int64_t epoch, const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckEpochLocked(epoch, key, true));
    RETURN_IF_ERROR(CheckRoomLocked(key));
    if (auto it = kv_.find(key); it != kv_.end()) {
      const std::string& v = it->second;
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
      if (ec != std::errc() || p != v.data() + v.size()) {
        return Status::InvalidArgument("Store ADD: key '" + key + "' does not hold an integer");
      }
    }
    value += delta;
    kv_[key] = std::to_string(value);
  }
  cv_.NotifyAll();
  return value;
}

StatusOr<bool> InMemoryEpochStore::Check(int64_t epoch, const std::vector<std::string>& keys) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckEpochLocked(epoch, "", false));
  for (const auto& k : keys) {
    if (kv_.count(k) == 0) return false;
  }
  return true;
}

StatusOr<bool> InMemoryEpochStore::Delete(int64_t epoch, const std::string& key) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckEpochLocked(epoch, key, true));
  return kv_.erase(key) > 0;
}

StatusOr<int64_t> InMemoryEpochStore::NumKeys(int64_t epoch) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckEpochLocked(epoch, "", false));
  return static_cast<int64_t>(kv_.size());
}

StatusOr<std::string> InMemoryEpochStore::CompareSet(int64_t epoch, const std::string& key,
                                                     const std::string& expected,
                                                     const std::string& desired, bool* swapped) {
  std::string now;
  bool matches = false;
  {
    MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckEpochLocked(epoch, key, true));
    auto it = kv_.find(key);
    matches = it == kv_.end() ? expected.empty() : it->second == expected;
    if (matches) {
      RETURN_IF_ERROR(CheckRoomLocked(key));
      kv_[key] = desired;
      now = desired;
    } else {
      now = it == kv_.end() ? expected : it->second;
    }
  }
  if (matches) cv_.NotifyAll();
  if (swapped != nullptr) *swapped = matches;
  return now;
}

// ---------------------------------------------------------------------------------------------
// C10dEpochStore

C10dEpochStore::C10dEpochStore(std::shared_ptr<EpochStore> store, int64_t epoch,
                               std::chrono::milliseconds timeout)
    : c10d::Store(timeout), store_(std::move(store)), epoch_(epoch) {}

c10::intrusive_ptr<c10d::Store> C10dEpochStore::clone() {
  return c10::make_intrusive<C10dEpochStore>(store_, epoch_, timeout_);
}

void C10dEpochStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  const Status s = store_->Set(epoch_, key, FromBytes(value));
  TORCH_CHECK(s.ok(), "grpo store: ", s.ToString());
}

std::vector<uint8_t> C10dEpochStore::compareSet(const std::string& key,
                                                const std::vector<uint8_t>& expected,
                                                const std::vector<uint8_t>& desired) {
  bool swapped = false;
  return ToBytes(ValueOrThrow(
      store_->CompareSet(epoch_, key, FromBytes(expected), FromBytes(desired), &swapped)));
}

std::vector<uint8_t> C10dEpochStore::get(const std::string& key) {
  return ToBytes(ValueOrThrow(store_->Get(epoch_, key, timeout_)));
}

int64_t C10dEpochStore::add(const std::string& key, int64_t value) {
  return ValueOrThrow(store_->Add(epoch_, key, value));
}

bool C10dEpochStore::deleteKey(const std::string& key) {
  return ValueOrThrow(store_->Delete(epoch_, key));
}

bool C10dEpochStore::check(const std::vector<std::string>& keys) {
  return ValueOrThrow(store_->Check(epoch_, keys));
}

int64_t C10dEpochStore::getNumKeys() { return ValueOrThrow(store_->NumKeys(epoch_)); }

void C10dEpochStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void C10dEpochStore::wait(const std::vector<std::string>& keys,
                          const std::chrono::milliseconds& timeout) {
  const auto total = timeout == kNoTimeout ? timeout_ : timeout;
  const auto deadline = Clock::now() + total;
  for (const auto& key : keys) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    TORCH_CHECK(left.count() > 0, "grpo store: wait for '", key, "' timed out after ",
                total.count(), " ms");
    (void)ValueOrThrow(store_->Get(epoch_, key, left));
  }
}

}  // namespace grpo::common
