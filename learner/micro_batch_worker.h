// MicroBatchWorker: one persistent thread that runs a job (a micro-batch's forward and
// backward) while its owner runs another: GrpoTrainer's `micro_batch_threads` 2 (README,
// "Two micro-batches at once"). The thread lives as long as the worker: a thread started per
// job pays libtorch's and the allocator's first-use costs every time (a probe: 21-36 ms a
// pair of the demo's micro-batches against 18-19 ms with a kept thread). The thread runs its
// ops with one intra-op thread.
#pragma once

#include <functional>
#include <thread>

#include "common/mutex.h"

namespace grpo::learner {

class MicroBatchWorker {
 public:
  MicroBatchWorker();
  // Waits for a running job, then ends the thread.
  ~MicroBatchWorker();
  MicroBatchWorker(const MicroBatchWorker&) = delete;
  MicroBatchWorker& operator=(const MicroBatchWorker&) = delete;

  // Starts `job` on the worker's thread. One job at a time: the previous one must have been
  // waited for (Wait). `job` must not throw (catch inside; the trainer's jobs return a Status).
  void Run(std::function<void()> job);
  // Returns once the job handed to Run has ended; at once when none is running.
  void Wait();

 private:
  void Loop();

  common::Mutex mu_;
  common::CondVar cv_;
  std::function<void()> job_ GRPO_GUARDED_BY(mu_);
  bool busy_ GRPO_GUARDED_BY(mu_) = false;
  bool stop_ GRPO_GUARDED_BY(mu_) = false;
  bool started_ GRPO_GUARDED_BY(mu_) = false;  // the thread has set its intra-op threads
  std::thread thread_;
};

}  // namespace grpo::learner
