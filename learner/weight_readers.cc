#include "learner/weight_readers.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <utility>

namespace grpo::learner {

Status WeightReaders::Read(const WeightSink& sink, Clock::time_point deadline,
                           const common::CancelToken* cancel, int64_t after_version) {
  const common::CancelToken::Subscription wake = common::CancelToken::Watch(cancel, [this] {
    common::MutexLock lock(&mu_);
    cv_.NotifyAll();
  });
  Reader reader;
  reader.sink = &sink;
  reader.after_version = after_version;
  {
    common::MutexLock lock(&mu_);
    if (closed_) return Status::Unavailable("the learner is stopping");
    queued_.push_back(&reader);
  }
  if (wake_) wake_();
  common::MutexLock lock(&mu_);
  while (!reader.done) {
    if (!reader.taken) {
      const bool cancelled = common::CancelToken::Tripped(cancel);
      if (closed_ || cancelled || Clock::now() >= deadline) {
        queued_.erase(std::find(queued_.begin(), queued_.end(), &reader));
        if (closed_) return Status::Unavailable("the learner is stopping");
        if (cancelled) return Status::Cancelled("the reader went away");
        return Status::DeadlineExceeded(
            "the training thread did not stream the weights in time (a long step?)");
      }
      cv_.WaitUntil(&mu_, deadline);
    } else {
      cv_.Wait(&mu_);
    }
  }
  return reader.status;
}

size_t WeightReaders::waiting(int64_t version) const {
  common::MutexLock lock(&mu_);
  return static_cast<size_t>(std::count_if(
      queued_.begin(), queued_.end(), [&](const Reader* r) { return r->after_version < version; }));
}

Status WeightReaders::Serve(int64_t version, size_t count, const WeightProducer& produce) {
  std::vector<Reader*> readers;
  {
    common::MutexLock lock(&mu_);
    std::vector<Reader*> later;
    for (Reader* r : queued_) (r->after_version < version ? readers : later).push_back(r);
    queued_.swap(later);
    for (Reader* r : readers) r->taken = true;
  }
  if (readers.empty()) return Status::OK();
  size_t index = 0;
  Status order = Status::OK();
  Status produced = Status::OK();
  try {
    produced = produce([&](const std::string& name, const at::Tensor& tensor) {
      if (!order.ok()) return;
      if (index >= count) {
        order = Status::Internal("streamed weights: more than the " + std::to_string(count) +
                                 " tensors announced (at '" + name + "')");
        return;
      }
      const at::Tensor source = tensor.detach();
      const at::Tensor cpu = source.to(at::kCPU).contiguous();
      const WeightPiece piece{version, name, cpu, index, count, source};
      for (Reader* r : readers) {
        if (r->failed) continue;
        // Nothing a sink does reaches the producer: a gather joined by every rank must run
        // to its end. A sink that throws has failed its reader.
        try {
          r->failed = !(*r->sink)(piece);
        } catch (const std::exception&) {
          r->failed = true;
        }
      }
      ++index;
    });
  } catch (const c10::Error& e) {
    produced = Status::Internal(std::string("streamed weights: ") + e.what_without_backtrace());
  }
  if (order.ok() && produced.ok() && index != count) {
    order = Status::Internal("streamed weights: " + std::to_string(index) + " tensors of the " +
                             std::to_string(count) + " announced");
  }
  const Status status = !produced.ok() ? produced : order;
  {
    common::MutexLock lock(&mu_);
    for (Reader* r : readers) {
      r->status = r->failed && status.ok() ? Status::Cancelled("the reader went away") : status;
      r->done = true;
    }
  }
  cv_.NotifyAll();
  return status;
}

void WeightReaders::Close() {
  {
    common::MutexLock lock(&mu_);
    closed_ = true;
  }
  cv_.NotifyAll();
}

}  // namespace grpo::learner
