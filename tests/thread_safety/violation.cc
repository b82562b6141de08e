// The negative control of thread_safety_test: clang must reject this file, or the check of the
// production sources proves nothing. Never built into any target.
#include <cstdint>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace grpo::common {

class Violation {
 public:
  // Writes a GRPO_GUARDED_BY member without its lock.
  void Unlocked() { ++count_; }
  // Calls a GRPO_REQUIRES method without the lock.
  int64_t CallsLockedHelper() { return CountLocked(); }
  // Correct use, so that the analysis is seen to accept what is right.
  int64_t Locked() {
    MutexLock lock(&mu_);
    return CountLocked();
  }

 private:
  int64_t CountLocked() const GRPO_REQUIRES(mu_) { return count_; }

  mutable Mutex mu_;
  int64_t count_ GRPO_GUARDED_BY(mu_) = 0;
};

}  // namespace grpo::common
