// WeightReaders: the readers of a learner that streams its weights (`weight_publish: stream`,
// docs/ARCHITECTURE.md "Weight sync"). No copy of the weights is kept: a GetWeights call queues
// a sink here and waits; the training thread, between steps, reads the policy a tensor at a time
// (with full_shard, every rank gathers one unit at a time) and hands each tensor to every queued
// sink before it reads the next. The memory a publish costs is one tensor (one unit with
// full_shard), whatever the model's size, and nothing between publishes.
//
//   reader thread (GetWeights)            training thread
//   Read(sink, deadline, cancel)  ----->  waiting(v) -> Serve(v, count, produce)
//     waits until served                    produce(put): put(name, tensor) per tensor
//                                            each put: sink(piece) of every queued reader
//
// A sink runs on the training thread and holds training up while it runs (a GetWeights client
// that stops reading holds it up until its call's deadline or cancellation ends the write).
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/cancel_token.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace grpo::learner {

// One tensor of a streamed version, valid during the sink's call only: `tensor` contiguous on
// the CPU, `source` as the producer put it (on the policy's device: what a GPU weight-sync
// group sends). `index` counts from 0 to `count` - 1 in Model::NamedParameters order.
struct WeightPiece {
  int64_t version = 0;
  const std::string& name;
  const at::Tensor& tensor;
  size_t index = 0;
  size_t count = 0;
  const at::Tensor& source = tensor;
};
// Takes one piece; false when the reader went away (it gets no more pieces).
using WeightSink = std::function<bool(const WeightPiece&)>;
// Hands each tensor of the policy to `put` (name, tensor on any device), in order.
using WeightPut = std::function<void(const std::string& name, const at::Tensor& tensor)>;
using WeightProducer = std::function<Status(const WeightPut& put)>;

class WeightReaders {
 public:
  using Clock = std::chrono::steady_clock;

  // `wake` is called (without this object's lock) when a reader is queued: it wakes the
  // training thread.
  explicit WeightReaders(std::function<void()> wake) : wake_(std::move(wake)) {}
  WeightReaders(const WeightReaders&) = delete;
  WeightReaders& operator=(const WeightReaders&) = delete;

  // Reader side. Queues `sink` for a version newer than `after_version` (-1: any) and waits
  // until a Serve has handed it every piece (OK), or the Serve failed (its error), or the sink
  // returned false (Cancelled). While no Serve has taken it yet: DeadlineExceeded at
  // `deadline`, Cancelled when `cancel` (may be null) trips, Unavailable after Close; the reader
  // then leaves the queue. Once a Serve took it, it waits for that Serve to end (a sink that
  // sees the cancellation should return false). A weight-sync group waits here for each next
  // version, its last one as `after_version`.
  Status Read(const WeightSink& sink, Clock::time_point deadline, const common::CancelToken* cancel,
              int64_t after_version = -1) GRPO_EXCLUDES(mu_);

  // Training thread.
  // How many readers wait now that a Serve of `version` would serve.
  size_t waiting(int64_t version) const GRPO_EXCLUDES(mu_);
  // Serves the readers queued now for `version` (readers queued meanwhile, or for a newer
  // version, wait for a later Serve): runs `produce`, handing each tensor it puts to every one
  // of them as the piece `index` of `count` of `version`, copied to the CPU (contiguous) once
  // for all of them. A tensor beyond `count` or fewer than `count` tensors fail every reader
  // with Internal. Returns produce's status, or that Internal; OK when nobody was waiting
  // (produce is not run).
  Status Serve(int64_t version, size_t count, const WeightProducer& produce) GRPO_EXCLUDES(mu_);
  // Readers not yet served, and every later Read, get Unavailable.
  void Close() GRPO_EXCLUDES(mu_);

 private:
  struct Reader {
    const WeightSink* sink = nullptr;
    int64_t after_version = -1;
    bool taken = false;   // by a Serve
    bool done = false;    // the Serve ended; status is its answer
    bool failed = false;  // the sink returned false
    Status status;
  };

  const std::function<void()> wake_;
  mutable common::Mutex mu_;
  common::CondVar cv_;
  std::vector<Reader*> queued_ GRPO_GUARDED_BY(mu_);
  bool closed_ GRPO_GUARDED_BY(mu_) = false;
};

}  // namespace grpo::learner
