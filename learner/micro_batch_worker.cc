#include "learner/micro_batch_worker.h"

#include <ATen/Parallel.h>

#include <utility>

namespace grpo::learner {

MicroBatchWorker::MicroBatchWorker() {
  // at::set_num_threads also stores the value new threads start with: the owner's is put back
  // once the worker has set its own.
  const int owner_threads = at::get_num_threads();
  thread_ = std::thread([this] { Loop(); });
  {
    common::MutexLock lock(&mu_);
    while (!started_) cv_.Wait(&mu_);
  }
  at::set_num_threads(owner_threads);
}

MicroBatchWorker::~MicroBatchWorker() {
  {
    common::MutexLock lock(&mu_);
    while (busy_) cv_.Wait(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  thread_.join();
}

void MicroBatchWorker::Run(std::function<void()> job) {
  {
    common::MutexLock lock(&mu_);
    while (busy_) cv_.Wait(&mu_);  // the owner waits first; this only guards misuse
    job_ = std::move(job);
    busy_ = true;
  }
  cv_.NotifyAll();
}

void MicroBatchWorker::Wait() {
  common::MutexLock lock(&mu_);
  while (busy_) cv_.Wait(&mu_);
}

void MicroBatchWorker::Loop() {
  // The intra-op setting is this thread's own (OpenMP's and MKL's per-thread values): the
  // worker and its owner each compute on one core.
  at::set_num_threads(1);
  {
    common::MutexLock lock(&mu_);
    started_ = true;
  }
  cv_.NotifyAll();
  for (;;) {
    std::function<void()> job;
    {
      common::MutexLock lock(&mu_);
      while (!busy_ && !stop_) cv_.Wait(&mu_);
      if (stop_ && !busy_) return;
      job = std::move(job_);
    }
    job();
    {
      common::MutexLock lock(&mu_);
      job_ = nullptr;
      busy_ = false;
    }
    cv_.NotifyAll();
  }
}

}  // namespace grpo::learner
