// EpochStore: the rendezvous key-value store of the weight-sync groups (docs/ARCHITECTURE.md
// "Weight sync"), shaped like c10d's HashStore (values are bytes, ADD keeps a decimal integer,
// GET waits for its key with a deadline) but keyed by a group epoch: the keys of one epoch are
// dead once the epoch is over, and every call names the epoch it belongs to, so groups of
// different epochs never mix. No protobuf: the learner serves InMemoryEpochStore in-process
// and to workers over its Store RPC (services/grpc_store.h implements this interface on the
// worker's side); C10dEpochStore lends either one to c10d (Gloo's and NCCL's rendezvous).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "common/cancel_token.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace grpo::common {

// A GET without a timeout waits this long (c10d's Store::kDefaultTimeout); no wait is longer
// than kMaxEpochStoreTimeout.
inline constexpr std::chrono::milliseconds kDefaultEpochStoreTimeout{300'000};
inline constexpr std::chrono::milliseconds kMaxEpochStoreTimeout{3'600'000};
// Keys one epoch may hold (a misbehaving client cannot grow the learner without bound).
inline constexpr size_t kMaxEpochStoreKeys = 1 << 16;

// Errors of every call: FailedPrecondition when `epoch` is not the store's current one (or
// ended while a GET waited: Register again), Unavailable when the store is shutting down,
// InvalidArgument for an empty key. Implementations are thread-safe.
class EpochStore {
 public:
  virtual ~EpochStore() = default;

  // Waits up to `timeout` (capped at kMaxEpochStoreTimeout) for `key`: its value, or
  // DeadlineExceeded.
  virtual StatusOr<std::string> Get(int64_t epoch, const std::string& key,
                                    std::chrono::milliseconds timeout) = 0;
  virtual Status Set(int64_t epoch, const std::string& key, const std::string& value) = 0;
  // Adds `delta` to the decimal integer at `key` (absent = 0) and returns the sum;
  // InvalidArgument when the key holds something else. ResourceExhausted past
  // kMaxEpochStoreKeys (Set and CompareSet too).
  virtual StatusOr<int64_t> Add(int64_t epoch, const std::string& key, int64_t delta) = 0;
  // True when every key is set (no wait).
  virtual StatusOr<bool> Check(int64_t epoch, const std::vector<std::string>& keys) = 0;
  // True when the key existed.
  virtual StatusOr<bool> Delete(int64_t epoch, const std::string& key) = 0;
  virtual StatusOr<int64_t> NumKeys(int64_t epoch) = 0;
  // c10d compareSet: stores `desired` when the current value equals `expected` (an absent key
  // counts as equal to an empty `expected`). Returns the value stored now (`expected` when the
  // key is absent and was not set); *swapped says whether it was set.
  virtual StatusOr<std::string> CompareSet(int64_t epoch, const std::string& key,
                                           const std::string& expected, const std::string& desired,
                                           bool* swapped) = 0;
};

// The learner's store: the keys of the current epoch only (older ones are dropped when the
// epoch advances), and the epoch itself, which starts at 1. Waiting GETs wake when their key
// is set, when the epoch advances (FailedPrecondition) and at Stop (Unavailable).
class InMemoryEpochStore final : public EpochStore {
 public:
  InMemoryEpochStore() = default;

  int64_t epoch() const GRPO_EXCLUDES(mu_);
  // Ends epoch `from` when it is still the current one (a failed group of that epoch; several
  // callers may report the same failure): true when this call advanced it.
  bool AdvanceFrom(int64_t from) GRPO_EXCLUDES(mu_);
  // Ends the current epoch (the roster changed) and returns the new one.
  int64_t Advance() GRPO_EXCLUDES(mu_);
  // Every waiting and later GET returns Unavailable.
  void Stop() GRPO_EXCLUDES(mu_);

  // Get that also gives up (Cancelled) the moment `cancel` (may be null) is tripped: the Store
  // RPC's client went away or its deadline passed.
  StatusOr<std::string> GetUnlessCancelled(int64_t epoch, const std::string& key,
                                           std::chrono::milliseconds timeout,
                                           const CancelToken* cancel) GRPO_EXCLUDES(mu_);

  StatusOr<std::string> Get(int64_t epoch, const std::string& key,
                            std::chrono::milliseconds timeout) override GRPO_EXCLUDES(mu_);
  Status Set(int64_t epoch, const std::string& key, const std::string& value) override
      GRPO_EXCLUDES(mu_);
  StatusOr<int64_t> Add(int64_t epoch, const std::string& key, int64_t delta) override
      GRPO_EXCLUDES(mu_);
  StatusOr<bool> Check(int64_t epoch, const std::vector<std::string>& keys) override
      GRPO_EXCLUDES(mu_);
  StatusOr<bool> Delete(int64_t epoch, const std::string& key) override GRPO_EXCLUDES(mu_);
  StatusOr<int64_t> NumKeys(int64_t epoch) override GRPO_EXCLUDES(mu_);
  StatusOr<std::string> CompareSet(int64_t epoch, const std::string& key,
                                   const std::string& expected, const std::string& desired,
                                   bool* swapped) override GRPO_EXCLUDES(mu_);

 private:
  // OK when `epoch` is current and the store is running.
  Status CheckEpochLocked(int64_t epoch, const std::string& key, bool key_needed) const
      GRPO_REQUIRES(mu_);
  Status CheckRoomLocked(const std::string& key) const GRPO_REQUIRES(mu_);

  mutable Mutex mu_;
  CondVar cv_;
  int64_t epoch_ GRPO_GUARDED_BY(mu_) = 1;
  std::map<std::string, std::string> kv_ GRPO_GUARDED_BY(mu_);  // the current epoch's keys
  bool stopping_ GRPO_GUARDED_BY(mu_) = false;
};

// A c10d::Store over one epoch of an EpochStore, for Gloo's and NCCL's rendezvous. The c10d
// calls throw c10::Error carrying the Status text (c10d's contract). Thread-safe as the
// EpochStore is; clone() shares it (libtorch 2.x clones a store for each thread that uses it).
class C10dEpochStore final : public c10d::Store {
 public:
  C10dEpochStore(std::shared_ptr<EpochStore> store, int64_t epoch,
                 std::chrono::milliseconds timeout);

  int64_t epoch() const { return epoch_; }
  EpochStore& store() const { return *store_; }

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;  // waits up to getTimeout()
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  // One deadline for all keys (c10d semantics); kNoTimeout means the store's timeout.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  c10::intrusive_ptr<c10d::Store> clone() override;

 private:
  const std::shared_ptr<EpochStore> store_;
  const int64_t epoch_;
};

}  // namespace grpo::common
