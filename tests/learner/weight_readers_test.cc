// learner::WeightReaders (`weight_publish: stream`): what a Serve hands to the readers queued
// when it starts, in order and to each; a reader that leaves; one that comes during a Serve
// waits for the next; deadlines, cancellation and Close; a producer that puts the wrong number
// of tensors, or fails.
#include "learner/weight_readers.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "common/cancel_token.h"

namespace grpo::learner {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Three tensors of known values: t<i> holds i * 10 + 0, 1, 2, ...
std::vector<std::pair<std::string, at::Tensor>> Policy() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int i = 0; i < 3; ++i) {
    out.emplace_back("t" + std::to_string(i), at::arange(4 + i, at::kFloat) + 10.0 * i);
  }
  return out;
}

WeightProducer Produce(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  return [tensors](const WeightPut& put) {
    for (const auto& [name, t] : tensors) put(name, t);
    return Status::OK();
  };
}

// What one reader saw: every piece's fields, its tensor copied.
struct Seen {
  std::vector<int64_t> versions;
  std::vector<std::string> names;
  std::vector<size_t> indices, counts;
  std::vector<at::Tensor> tensors;
  WeightSink Sink(int stop_after = -1) {
    return [this, stop_after](const WeightPiece& p) {
      if (stop_after >= 0 && static_cast<int>(names.size()) == stop_after) return false;
      versions.push_back(p.version);
      names.push_back(p.name);
      indices.push_back(p.index);
      counts.push_back(p.count);
      tensors.push_back(p.tensor.clone());
      return true;
    };
  }
};

// Starts a Read (for a version after `after_version`) on another thread and waits until it is
// queued.
std::future<Status> ReadAsync(WeightReaders& readers, const WeightSink& sink,
                              Clock::time_point deadline, const common::CancelToken* cancel,
                              int64_t after_version = -1) {
  auto f = std::async(std::launch::async, [&readers, &sink, deadline, cancel, after_version] {
    return readers.Read(sink, deadline, cancel, after_version);
  });
  const auto end = Clock::now() + 10s;
  while (readers.waiting(after_version + 1) == 0 && Clock::now() < end) {
    std::this_thread::sleep_for(1ms);
  }
  return f;
}

// A producer that only notes it ran.
WeightProducer NoteRun(bool* ran) {
  return [ran](const WeightPut&) {
    *ran = true;
    return Status::OK();
  };
}

TEST(WeightReaders, ServeWithNobodyWaitingRunsNothing) {
  WeightReaders readers(nullptr);
  bool ran = false;
  EXPECT_TRUE(readers.Serve(3, 1, NoteRun(&ran)).ok());
  EXPECT_FALSE(ran);
}

TEST(WeightReaders, EveryQueuedReaderGetsEveryTensorInOrder) {
  std::atomic<int> wakes{0};
  WeightReaders readers([&] { ++wakes; });
  Seen a, b;
  const WeightSink sa = a.Sink(), sb = b.Sink();
  auto fa = ReadAsync(readers, sa, Clock::now() + 30s, nullptr);
  // b queues behind a; wait until both are queued (the wake-up counts them).
  auto fb =
      std::async(std::launch::async, [&] { return readers.Read(sb, Clock::now() + 30s, nullptr); });
  const auto end = Clock::now() + 10s;
  while (wakes.load() < 2 && Clock::now() < end) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(wakes.load(), 2);
  const auto policy = Policy();
  ASSERT_TRUE(readers.Serve(7, 3, Produce(policy)).ok());
  ASSERT_TRUE(fa.get().ok());
  ASSERT_TRUE(fb.get().ok());
  for (Seen* s : {&a, &b}) {
    EXPECT_EQ(s->versions, (std::vector<int64_t>{7, 7, 7}));
    EXPECT_EQ(s->names, (std::vector<std::string>{"t0", "t1", "t2"}));
    EXPECT_EQ(s->indices, (std::vector<size_t>{0, 1, 2}));
    EXPECT_EQ(s->counts, (std::vector<size_t>{3, 3, 3}));
    ASSERT_EQ(s->tensors.size(), 3u);
    // t1 = 10, 11, 12, 13, 14 (by hand).
    EXPECT_TRUE(at::equal(s->tensors[1], at::tensor({10.f, 11.f, 12.f, 13.f, 14.f})));
    EXPECT_TRUE(at::equal(s->tensors[2], policy[2].second));
  }
  EXPECT_EQ(readers.waiting(0), 0u);
}

// A non-contiguous tensor reaches the sink contiguous, with its values.
TEST(WeightReaders, PiecesAreContiguous) {
  WeightReaders readers(nullptr);
  const at::Tensor m = at::arange(6, at::kFloat).view({2, 3});
  const at::Tensor t = m.t();  // [[0, 3], [1, 4], [2, 5]]
  ASSERT_FALSE(t.is_contiguous());
  bool contiguous = false;
  at::Tensor got;
  const WeightSink sink = [&](const WeightPiece& p) {
    contiguous = p.tensor.is_contiguous();
    got = p.tensor.clone();
    return true;
  };
  auto f = ReadAsync(readers, sink, Clock::now() + 30s, nullptr);
  ASSERT_TRUE(readers.Serve(1, 1, Produce({{"m", t}})).ok());
  ASSERT_TRUE(f.get().ok());
  EXPECT_TRUE(contiguous);
  EXPECT_TRUE(at::equal(got, at::tensor({0.f, 3.f, 1.f, 4.f, 2.f, 5.f}).view({3, 2})));
}

// A reader whose sink refuses the second piece gets no more and hears Cancelled; the other
// reader of the same Serve gets everything, and the Serve is OK.
TEST(WeightReaders, AReaderThatLeavesGetsNoMoreAndTheOthersGoOn) {
  std::atomic<int> wakes{0};
  WeightReaders readers([&] { ++wakes; });
  Seen leaving, staying;
  const WeightSink sl = leaving.Sink(/*stop_after=*/1), ss = staying.Sink();
  auto fl =
      std::async(std::launch::async, [&] { return readers.Read(sl, Clock::now() + 30s, nullptr); });
  auto fs =
      std::async(std::launch::async, [&] { return readers.Read(ss, Clock::now() + 30s, nullptr); });
  const auto end = Clock::now() + 10s;
  while (wakes.load() < 2 && Clock::now() < end) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(readers.Serve(2, 3, Produce(Policy())).ok());
  const Status l = fl.get();
  EXPECT_EQ(l.code(), StatusCode::kCancelled) << l.ToString();
  EXPECT_EQ(leaving.names, (std::vector<std::string>{"t0"}));
  EXPECT_TRUE(fs.get().ok());
  EXPECT_EQ(staying.names.size(), 3u);
}

// A reader that queues while a Serve runs is not served by it (it would miss the pieces
// already handed out) but by the next one.
TEST(WeightReaders, AReaderQueuedDuringAServeWaitsForTheNext) {
  WeightReaders readers(nullptr);
  Seen first, late;
  const WeightSink sf = first.Sink(), sl = late.Sink();
  auto ff = ReadAsync(readers, sf, Clock::now() + 30s, nullptr);
  std::future<Status> fl;
  const auto policy = Policy();
  ASSERT_TRUE(readers
                  .Serve(4, 3,
                         [&](const WeightPut& put) {
                           put(policy[0].first, policy[0].second);
                           fl = ReadAsync(readers, sl, Clock::now() + 30s, nullptr);
                           put(policy[1].first, policy[1].second);
                           put(policy[2].first, policy[2].second);
                           return Status::OK();
                         })
                  .ok());
  ASSERT_TRUE(ff.get().ok());
  EXPECT_EQ(first.names.size(), 3u);
  EXPECT_TRUE(late.names.empty());
  EXPECT_EQ(readers.waiting(0), 1u);
  ASSERT_TRUE(readers.Serve(5, 3, Produce(policy)).ok());
  ASSERT_TRUE(fl.get().ok());
  EXPECT_EQ(late.versions, (std::vector<int64_t>{5, 5, 5}));
}

// A weight-sync group waits for the version after the one it sent: a Serve of that version
// leaves it queued, the next one serves it.
TEST(WeightReaders, AReaderAfterAVersionWaitsForANewerOne) {
  WeightReaders readers(nullptr);
  Seen s;
  const WeightSink sink = s.Sink();
  auto f = ReadAsync(readers, sink, Clock::now() + 30s, nullptr, /*after_version=*/4);
  ASSERT_EQ(readers.waiting(5), 1u);
  EXPECT_EQ(readers.waiting(4), 0u);
  bool ran = false;
  ASSERT_TRUE(readers.Serve(4, 3, NoteRun(&ran)).ok());
  EXPECT_FALSE(ran);  // nobody wanted version 4
  EXPECT_EQ(readers.waiting(5), 1u);
  ASSERT_TRUE(readers.Serve(5, 3, Produce(Policy())).ok());
  ASSERT_TRUE(f.get().ok());
  EXPECT_EQ(s.versions, (std::vector<int64_t>{5, 5, 5}));
}

TEST(WeightReaders, DeadlineCancelAndCloseEndAWaitThatNoServeTook) {
  WeightReaders readers(nullptr);
  Seen s;
  const WeightSink sink = s.Sink();
  const auto t0 = Clock::now();
  const Status late = readers.Read(sink, t0 + 100ms, nullptr);
  EXPECT_EQ(late.code(), StatusCode::kDeadlineExceeded) << late.ToString();
  EXPECT_GE(Clock::now() - t0, 100ms);
  EXPECT_EQ(readers.waiting(0), 0u);  // it left the queue

  common::CancelToken cancel;
  auto fc = ReadAsync(readers, sink, Clock::now() + 30s, &cancel);
  cancel.Cancel();
  EXPECT_EQ(fc.get().code(), StatusCode::kCancelled);
  EXPECT_EQ(readers.waiting(0), 0u);

  auto fx = ReadAsync(readers, sink, Clock::now() + 30s, nullptr);
  readers.Close();
  EXPECT_EQ(fx.get().code(), StatusCode::kUnavailable);
  EXPECT_EQ(readers.Read(sink, Clock::now() + 30s, nullptr).code(), StatusCode::kUnavailable);
  EXPECT_TRUE(s.names.empty());
}

// More or fewer tensors than announced fail every reader with Internal; a producer's own
// error reaches every reader as it is.
TEST(WeightReaders, AProducerThatBreaksTheCountOrFailsFailsEveryReader) {
  WeightReaders readers(nullptr);
  Seen s;
  const WeightSink sink = s.Sink();
  const auto policy = Policy();
  struct Case {
    size_t count;
    WeightProducer produce;
    StatusCode code;
  } cases[] = {
      {2, Produce(policy), StatusCode::kInternal},  // one more than announced
      {4, Produce(policy), StatusCode::kInternal},  // one fewer
      {3, [](const WeightPut&) { return Status::Aborted("rank 1 left"); }, StatusCode::kAborted},
  };
  for (const Case& c : cases) {
    auto f = ReadAsync(readers, sink, Clock::now() + 30s, nullptr);
    const Status served = readers.Serve(1, c.count, c.produce);
    EXPECT_EQ(served.code(), c.code) << served.ToString();
    EXPECT_EQ(f.get().code(), c.code);
  }
}

}  // namespace
}  // namespace grpo::learner
