#include "services/blocking_calls.h"

namespace grpo::services {

bool CallThreads::TryRun(std::function<void()> body) {
  JoinFinished();
  common::MutexLock lock(&mu_);
  if (RunningLocked() >= max_threads_) return false;
  const int64_t id = next_id_++;
  std::thread thread;
  try {
    thread = std::thread([this, id, body = std::move(body)]() mutable {
      body();
      body = nullptr;  // the captures die before the thread counts as finished
      common::MutexLock lock(&mu_);
      finished_.push_back(id);
      idle_cv_.NotifyAll();
    });
  } catch (const std::system_error&) {
    return false;  // the system has no thread for it (ulimit -u, memory): refused as busy
  }
  // (the new thread cannot record itself finished before mu_ is released)
  threads_.emplace(id, std::move(thread));
  return true;
}

void CallThreads::JoinFinished() {
  std::vector<std::thread> done;
  {
    common::MutexLock lock(&mu_);
    for (int64_t id : finished_) {
      auto it = threads_.find(id);
      done.push_back(std::move(it->second));
      threads_.erase(it);
    }
    finished_.clear();
  }
  for (std::thread& t : done) t.join();  // each has returned its body: only its exit is left
}

void CallThreads::Drain() {
  {
    common::MutexLock lock(&mu_);
    while (RunningLocked() > 0) idle_cv_.Wait(&mu_);
  }
  JoinFinished();
}

int64_t CallThreads::running() const {
  common::MutexLock lock(&mu_);
  return RunningLocked();
}

grpc::Status CallThreadsExhausted(const char* rpc) {
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      std::string(rpc) +
                          ": every call thread of the learner is busy (config key "
                          "grpc_max_threads); retry");
}

}  // namespace grpo::services
