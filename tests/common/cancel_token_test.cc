// common::CancelToken: a tripped token wakes the waits that watch it, once, without polling;
// a subscription that ended is never run; racing subscriptions and a cancel lose no wake-up.
#include "common/cancel_token.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "common/mutex.h"

namespace grpo::common {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

TEST(CancelToken, CancelRunsEachLiveWakeUpOnceAndIgnoresEndedOnes) {
  CancelToken token;
  int a = 0, b = 0, ended = 0;
  CancelToken::Subscription sa = CancelToken::Watch(&token, [&] { ++a; });
  CancelToken::Subscription sb = CancelToken::Watch(&token, [&] { ++b; });
  {
    CancelToken::Subscription gone = CancelToken::Watch(&token, [&] { ++ended; });
  }
  EXPECT_FALSE(token.cancelled());
  token.Cancel();
  token.Cancel();  // a second cancel changes nothing
  EXPECT_TRUE(token.cancelled());
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(ended, 0);
}

TEST(CancelToken, WatchingATrippedTokenWakesAtOnceAndANullTokenNever) {
  CancelToken token;
  token.Cancel();
  int woke = 0;
  CancelToken::Subscription s = CancelToken::Watch(&token, [&] { ++woke; });
  EXPECT_EQ(woke, 1);
  int never = 0;
  CancelToken::Subscription none = CancelToken::Watch(nullptr, [&] { ++never; });
  EXPECT_EQ(never, 0);
}

TEST(CancelToken, AMovedSubscriptionStaysRegisteredUntilItsLastOwnerEnds) {
  CancelToken token;
  int woke = 0;
  CancelToken::Subscription outer;
  {
    CancelToken::Subscription inner = CancelToken::Watch(&token, [&] { ++woke; });
    outer = std::move(inner);
  }
  token.Cancel();
  EXPECT_EQ(woke, 1);
}

// The pattern the learner's waits use: a condition variable under the waiter's mutex, woken by
// the token. The wait's own deadline is a minute away, so only the wake-up can end it.
TEST(CancelToken, AWaitOnACondVarEndsWhenTheTokenIsTripped) {
  for (int trial = 0; trial < 20; ++trial) {
    CancelToken token;
    Mutex mu;
    CondVar cv;
    std::atomic<bool> waiting{false};
    Clock::duration took{};
    std::thread waiter([&] {
      CancelToken::Subscription wake = CancelToken::Watch(&token, [&] {
        MutexLock lock(&mu);
        cv.NotifyAll();
      });
      MutexLock lock(&mu);
      const auto deadline = Clock::now() + 60s;
      waiting = true;
      while (!token.cancelled()) {
        if (!cv.WaitUntil(&mu, deadline)) break;
      }
      took = Clock::now() - deadline + 60s;
    });
    while (!waiting) std::this_thread::yield();
    // Trip it at once on even trials (the race between the check and the wait), later on odd.
    if (trial % 2 == 1) std::this_thread::sleep_for(2ms);
    token.Cancel();
    waiter.join();
    EXPECT_LT(took, 10s) << "trial " << trial << ": the wait ran to its deadline";
  }
}

// Subscriptions made on several threads while another thread cancels: each one, made before the
// cancel or after it, has run exactly once when the cancel has returned; subscriptions made and
// ended meanwhile never run after their end.
TEST(CancelToken, ConcurrentSubscriptionsAndACancelLoseNoWakeUp) {
  constexpr int kThreads = 4, kKept = 64;
  for (int round = 0; round < 50; ++round) {
    CancelToken token;
    std::atomic<bool> go{false}, cancel_returned{false};
    std::atomic<int> after_end{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        std::vector<std::atomic<int>> runs(kKept);
        std::vector<CancelToken::Subscription> kept;
        while (!go) std::this_thread::yield();
        for (int i = 0; i < kKept; ++i) {
          kept.push_back(CancelToken::Watch(&token, [&runs, i] { ++runs[i]; }));
          std::atomic<bool> ended{false};
          {
            CancelToken::Subscription churn = CancelToken::Watch(&token, [&] {
              if (ended) ++after_end;
            });
          }
          ended = true;
        }
        while (!cancel_returned) std::this_thread::yield();
        for (int i = 0; i < kKept; ++i) EXPECT_EQ(runs[i].load(), 1) << "subscription " << i;
      });
    }
    go = true;
    token.Cancel();
    cancel_returned = true;
    for (auto& t : threads) t.join();
    EXPECT_EQ(after_end.load(), 0);
  }
}

}  // namespace
}  // namespace grpo::common
