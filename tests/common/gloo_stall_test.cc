// GlooWeightSync against a peer process that is stopped (SIGSTOP) while its connections stay
// open (issue 22 item 2): rank 0 is this process, ranks 1 and 2 are this binary started again
// as children (GlooStallChild.DISABLED_Receive), meeting on a c10d TCPStore on loopback. The
// kernel keeps acknowledging a stopped peer's TCP traffic, so only the collective's deadline can
// end rank 0's wait: the group must fail within one deadline, not when the peer is continued.
// The same holds for a rank stopped during its join (GlooStallRendezvous, JoinGlooGroup).
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "common/weight_sync/gloo_weight_sync.h"
#include "common/weight_sync/weight_sync.h"
#include "tests/common/weight_sync_test_util.h"

extern char** environ;

namespace grpo::common {
namespace {

using grpo::testing::MakeLayout;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kDeadline = 2000ms;  // of every collective
constexpr auto kStop = 8s;          // how long rank 1 stays stopped
constexpr int kWorld = 3;
constexpr int kJoinOnly = -1;

GlooWeightSyncOptions Loopback() {
  GlooWeightSyncOptions o;
  o.hostname = "127.0.0.1";
  o.sync.timeout = kDeadline;
  o.sync.bucket_bytes = grpo::testing::kOddBucketBytes;
  return o;
}

// A receiver process: GRPO_STALL_RANK=<rank>, GRPO_STALL_PORT=<store port>.
class Child {
 public:
  // stop_after > 0: the child stops itself (SIGSTOP) after its stop_after-th store operation of
  // the join, then leaves; kJoinOnly: it joins and leaves; 0: it receives versions.
  Child(int rank, int port, int stop_after = 0) {
    const std::string env_rank = "GRPO_STALL_RANK=" + std::to_string(rank);
    const std::string env_port = "GRPO_STALL_PORT=" + std::to_string(port);
    const std::string env_stop = "GRPO_STALL_STOP_AFTER=" + std::to_string(stop_after);
    std::vector<char*> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
    envp.push_back(const_cast<char*>(env_rank.c_str()));
    envp.push_back(const_cast<char*>(env_port.c_str()));
    envp.push_back(const_cast<char*>(env_stop.c_str()));
    envp.push_back(nullptr);
    std::string self = "/proc/self/exe", filter = "--gtest_filter=GlooStallChild.DISABLED_Receive",
                also = "--gtest_also_run_disabled_tests";
    char* argv[] = {self.data(), filter.data(), also.data(), nullptr};
    EXPECT_EQ(posix_spawn(&pid_, "/proc/self/exe", nullptr, nullptr, argv, envp.data()), 0);
  }
  pid_t pid() const { return pid_; }
  // Its exit status within `limit` (0: it saw its group fail, as it should), -1 if still running.
  int Wait(std::chrono::milliseconds limit) {
    const auto end = Clock::now() + limit;
    while (pid_ > 0) {
      int status = 0;
      const pid_t got = waitpid(pid_, &status, WNOHANG);
      if (got == pid_) {
        pid_ = 0;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (Clock::now() > end) return -1;
      std::this_thread::sleep_for(20ms);
    }
    return -1;
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGCONT);
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

 private:
  pid_t pid_ = 0;
};

Status OneVersion(WeightSync& sync, int64_t version, NamedTensors& tensors) {
  RETURN_IF_ERROR(sync.Begin(version));
  RETURN_IF_ERROR(sync.Broadcast(tensors));
  return sync.Commit();
}

// The rendezvous store, served here on a free loopback port.
c10::intrusive_ptr<c10d::TCPStore> ServerStore() {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = 60s;
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
}

TEST(GlooStall, AStoppedButConnectedPeerCostsTheGroupOneDeadlineNotItsStop) {
  auto store = ServerStore();
  Child one(1, store->getPort()), two(2, store->getPort());
  // Both children are up before the rendezvous starts its deadline.
  store->wait({"ready/1", "ready/2"}, 120s);
  auto created = CreateGlooWeightSync(store, 0, kWorld, 1, Loopback());
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  std::unique_ptr<WeightSync> sync = std::move(created).value();
  NamedTensors sent = MakeLayout(7, false);
  ASSERT_TRUE(OneVersion(*sync, 1, sent).ok()) << "the group works before the stop";

  ASSERT_EQ(kill(one.pid(), SIGSTOP), 0);
  const auto start = Clock::now();
  const Status s = OneVersion(*sync, 2, sent);
  const auto failed_after = Clock::now() - start;
  std::thread resume([&] {
    std::this_thread::sleep_until(start + kStop);
    kill(one.pid(), SIGCONT);
  });
  EXPECT_FALSE(s.ok()) << "version 2 cannot commit without rank 1";
  EXPECT_LT(failed_after, kDeadline + 1500ms)
      << "rank 0 waited " << std::chrono::duration<double>(failed_after).count()
      << " s for a peer stopped for " << kStop.count() << " s";
  sync->Abort();
  // Rank 2 (running) sees its group end well before rank 1 is continued.
  EXPECT_EQ(two.Wait(kStop - 2s), 0) << "rank 2 did not leave the failed group in time";
  resume.join();
  EXPECT_EQ(one.Wait(30s), 0) << "rank 1 did not leave the failed group after SIGCONT";
}

// A c10d::Store that forwards to another and stops this process (SIGSTOP) after its
// `stop_after`-th set, get or wait: a rank stopped at a chosen point of gloo's rendezvous.
class StoppingStore final : public c10d::Store {
 public:
  StoppingStore(c10::intrusive_ptr<c10d::Store> inner, int stop_after)
      : c10d::Store(inner->getTimeout()), inner_(std::move(inner)), stop_after_(stop_after) {}
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::intrusive_ptr<Store>::reclaim_copy(this);
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    inner_->set(key, value);
    Count("set " + key);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    auto v = inner_->get(key);
    Count("get " + key);
    return v;
  }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override {
    inner_->wait(keys);
    Count("wait");
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
    Count("wait " + (keys.empty() ? std::string() : keys[0]));
  }

 private:
  void Count(const std::string& what) {
    const int op = ++ops_;
    if (op == stop_after_) {
      fprintf(stderr, "rank stops after store operation %d (%s)\n", op, what.c_str());
      raise(SIGSTOP);
    }
  }
  c10::intrusive_ptr<c10d::Store> inner_;
  const int stop_after_;
  std::atomic<int> ops_{0};
};

// A rank that stops at any point of its join (after its 1st, 2nd, ... store operation: the
// barrier's, then gloo's own) costs rank 0 at most one deadline: rank 0 joins (the stopped rank's
// side of the connection is the kernel's) or fails with DeadlineExceeded. Before the join had one
// deadline, 4 of these 8 points cost rank 0 10.0 s: gloo waits 5 times its timeout for a pair.
class GlooStallRendezvous : public ::testing::TestWithParam<int> {};

TEST_P(GlooStallRendezvous, ARankStoppedInItsJoinCostsTheOthersOneDeadline) {
  auto store = ServerStore();
  Child one(1, store->getPort(), GetParam()), two(2, store->getPort(), kJoinOnly);
  store->wait({"ready/1", "ready/2"}, 120s);
  const auto start = Clock::now();
  auto created = CreateGlooWeightSync(store, 0, kWorld, 1, Loopback());
  const auto took = Clock::now() - start;
  EXPECT_TRUE(created.ok() || created.status().code() == StatusCode::kDeadlineExceeded)
      << created.status().ToString();
  EXPECT_LT(took, kDeadline + 1500ms)
      << "rank 0 " << (created.ok() ? "joined" : "failed") << " after "
      << std::chrono::duration<double>(took).count() << " s: " << created.status().ToString();
  // So does rank 2, which joined as rank 0 did.
  EXPECT_NE(two.Wait(kDeadline + 2s), -1) << "rank 2 is still in its join";
  kill(one.pid(), SIGCONT);
}

INSTANTIATE_TEST_SUITE_P(StopPoints, GlooStallRendezvous, ::testing::Range(1, 9));

// The child: joins as GRPO_STALL_RANK and receives versions until its group fails; exit 0 then.
TEST(GlooStallChild, DISABLED_Receive) {
  const char* rank_env = std::getenv("GRPO_STALL_RANK");
  const char* port_env = std::getenv("GRPO_STALL_PORT");
  if (rank_env == nullptr || port_env == nullptr) GTEST_SKIP() << "run by GlooStall only";
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
  // As `grpo`'s main does: Gloo writes without MSG_NOSIGNAL, and rank 0 closes the group while
  // this rank is stopped, so its first write after SIGCONT would raise SIGPIPE.
  signal(SIGPIPE, SIG_IGN);
  const int rank = std::atoi(rank_env);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(std::atoi(port_env));
  so.isServer = false;
  so.timeout = 60s;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  store->set("ready/" + std::to_string(rank), std::vector<uint8_t>{1});
  const char* stop_env = std::getenv("GRPO_STALL_STOP_AFTER");
  const int stop_after = stop_env == nullptr ? 0 : std::atoi(stop_env);
  if (stop_after != 0) {
    // Whether the group forms depends on where the stopped rank stopped: nothing to expect.
    c10::intrusive_ptr<c10d::Store> joining = store;
    if (stop_after > 0) joining = c10::make_intrusive<StoppingStore>(store, stop_after);
    (void)CreateGlooWeightSync(joining, rank, kWorld, 1, Loopback());
    return;
  }
  auto created = CreateGlooWeightSync(store, rank, kWorld, 1, Loopback());
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NamedTensors into = MakeLayout(7, true);
  Status s;
  for (int v = 0; v < 1000 && s.ok(); ++v) s = OneVersion(**created, kAnyVersion, into);
  EXPECT_FALSE(s.ok());
}

}  // namespace
}  // namespace grpo::common
