// The epoch store (InMemoryEpochStore, C10dEpochStore), the group keys and the backend rule
// (AssignBackend) of common/weight_sync/ (issue 14 §3, issue 15 §2). Expected values are
// written out by hand from the contracts in the headers.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <vector>

#include "common/weight_sync/backends.h"
#include "common/weight_sync/epoch_store.h"
#include "common/weight_sync/group.h"
#include "tests/common/weight_sync_test_util.h"

namespace grpo::common {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(InMemoryEpochStore, SetGetAddCheckDeleteAndCompareSetInOneEpoch) {
  InMemoryEpochStore store;
  const int64_t e = store.epoch();
  EXPECT_EQ(e, 1);
  ASSERT_TRUE(store.Set(e, "a", "xy").ok());
  EXPECT_EQ(*store.Get(e, "a", 1s), "xy");
  EXPECT_EQ(*store.Add(e, "n", 2), 2);
  EXPECT_EQ(*store.Add(e, "n", 3), 5);
  EXPECT_EQ(*store.Get(e, "n", 1s), "5");
  EXPECT_EQ(store.Add(e, "a", 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(*store.Check(e, {"a", "n"}));
  EXPECT_FALSE(*store.Check(e, {"a", "missing"}));
  EXPECT_EQ(*store.NumKeys(e), 2);
  EXPECT_TRUE(*store.Delete(e, "a"));
  EXPECT_FALSE(*store.Delete(e, "a"));
  // compareSet: an absent key matches an empty `expected`; a mismatch returns what is stored.
  bool swapped = false;
  EXPECT_EQ(*store.CompareSet(e, "c", "", "v1", &swapped), "v1");
  EXPECT_TRUE(swapped);
  EXPECT_EQ(*store.CompareSet(e, "c", "nope", "v2", &swapped), "v1");
  EXPECT_FALSE(swapped);
  EXPECT_EQ(*store.CompareSet(e, "absent", "x", "y", &swapped), "x");
  EXPECT_FALSE(swapped);
  EXPECT_FALSE(*store.Check(e, {"absent"}));
  EXPECT_EQ(store.Set(e, "", "v").code(), StatusCode::kInvalidArgument);
}

TEST(InMemoryEpochStore, GetWaitsForASetAndTimesOutWithoutOne) {
  InMemoryEpochStore store;
  auto later = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(150ms);
    return store.Set(1, "k", "v");
  });
  const auto t0 = Clock::now();
  StatusOr<std::string> v = store.Get(1, "k", 5s);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, "v");
  EXPECT_GE(Clock::now() - t0, 100ms);
  EXPECT_LT(Clock::now() - t0, 4s);
  ASSERT_TRUE(later.get().ok());
  const auto t1 = Clock::now();
  EXPECT_EQ(store.Get(1, "never", 300ms).status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_GE(Clock::now() - t1, 250ms);
  EXPECT_LT(Clock::now() - t1, 3s);
}

TEST(InMemoryEpochStore, AnEpochEndsForWaitersAndKeepsNoKeys) {
  InMemoryEpochStore store;
  ASSERT_TRUE(store.Set(1, "old", "x").ok());
  auto waiter = std::async(std::launch::async, [&] { return store.Get(1, "never", 10s); });
  std::this_thread::sleep_for(100ms);
  const auto t0 = Clock::now();
  EXPECT_TRUE(store.AdvanceFrom(1));
  EXPECT_FALSE(store.AdvanceFrom(1));  // a second report of the same failure changes nothing
  const Status w = waiter.get().status();
  EXPECT_EQ(w.code(), StatusCode::kFailedPrecondition) << w.ToString();
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_EQ(store.epoch(), 2);
  EXPECT_EQ(store.Set(1, "a", "b").code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(*store.Check(2, {"old"}));
  EXPECT_EQ(store.Advance(), 3);
  EXPECT_EQ(store.NumKeys(2).status().code(), StatusCode::kFailedPrecondition);
}

TEST(InMemoryEpochStore, StopAndCancellationEndWaits) {
  InMemoryEpochStore store;
  CancelToken gone;
  auto cancelled = std::async(std::launch::async,
                              [&] { return store.GetUnlessCancelled(1, "never", 10s, &gone); });
  auto stopped = std::async(std::launch::async, [&] { return store.Get(1, "never", 10s); });
  std::this_thread::sleep_for(100ms);
  gone.Cancel();
  EXPECT_EQ(cancelled.get().status().code(), StatusCode::kCancelled);
  store.Stop();
  EXPECT_EQ(stopped.get().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(store.Set(1, "a", "b").code(), StatusCode::kUnavailable);
}

TEST(InMemoryEpochStore, OneEpochHoldsAtMostTheKeyLimit) {
  InMemoryEpochStore store;
  for (size_t i = 0; i < kMaxEpochStoreKeys; ++i) {
    ASSERT_TRUE(store.Set(1, "k" + std::to_string(i), "").ok());
  }
  EXPECT_EQ(store.Set(1, "one-more", "").code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(store.Set(1, "k0", "overwrite").ok());  // an existing key is not a new one
  store.Advance();
  EXPECT_TRUE(store.Set(2, "one-more", "").ok());
}

TEST(C10dEpochStore, CarriesC10dCallsToOneEpochAndThrowsItsErrors) {
  auto store = std::make_shared<InMemoryEpochStore>();
  auto c10d = c10::make_intrusive<C10dEpochStore>(store, 1, 500ms);
  c10d->set("a", {'x', 'y'});
  EXPECT_EQ(*store->Get(1, "a", 1s), "xy");
  EXPECT_EQ(c10d->add("n", 4), 4);
  EXPECT_TRUE(c10d->check({"a", "n"}));
  EXPECT_EQ(c10d->getNumKeys(), 2);
  EXPECT_EQ(c10d->compareSet("a", {'x', 'y'}, {'z'}), (std::vector<uint8_t>{'z'}));
  EXPECT_TRUE(c10d->deleteKey("a"));
  const auto t0 = Clock::now();
  EXPECT_THROW(c10d->get("never"), c10::Error);  // waits the store's 500 ms
  EXPECT_GE(Clock::now() - t0, 400ms);
  EXPECT_THROW(c10d->wait({"never"}, 200ms), c10::Error);
  store->Advance();
  EXPECT_THROW(c10d->set("b", {'1'}), c10::Error);  // its epoch is over
}

// A real c10d consumer on the adapter: a Gloo group of three ranks (threads) rendezvouses on
// one epoch of the learner's store, scoped by the group prefix, and broadcasts a layout.
TEST(C10dEpochStore, AGlooGroupFormsAndBroadcastsOverIt) {
  if (!WeightSyncBackendBuilt(kBackendGloo)) GTEST_SKIP() << "gloo is not built";
  auto store = std::make_shared<InMemoryEpochStore>();
  WeightSyncBackendOptions o;
  o.timeout = 20s;
  o.hostname = "127.0.0.1";
  o.bucket_bytes = testing::kOddBucketBytes;
  WeightSyncFactory factory = BuiltinWeightSyncFactory(o);
  const NamedTensors sent = testing::MakeLayout(5, false);
  std::vector<NamedTensors> got(3);
  std::vector<Status> status(3);
  testing::RunRanks({0, 1, 2}, [&](int rank) {
    auto scoped = c10::make_intrusive<c10d::PrefixStore>(
        GroupPrefix(kBackendGloo), c10::make_intrusive<C10dEpochStore>(store, 1, 20s));
    auto sync = factory(kBackendGloo, scoped, rank, 3, 1);
    if (!sync.ok()) {
      status[rank] = sync.status();
      return;
    }
    got[rank] = rank == 0 ? sent : testing::MakeLayout(0, true);
    Status s = (*sync)->Begin(rank == 0 ? 9 : kAnyVersion);
    if (s.ok()) s = (*sync)->Broadcast(got[rank]);
    if (s.ok()) s = (*sync)->Commit();
    if (s.ok() && (*sync)->committed_version() != 9) s = Status::Internal("wrong version");
    status[rank] = s;
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].ToString();
    EXPECT_TRUE(testing::BitEqual(got[r], sent)) << "rank " << r;
  }
}

TEST(WeightSyncGroup, KeysAndRosterHaveOneSpelling) {
  EXPECT_EQ(RosterKey("gloo"), "grpo/gloo/roster");
  EXPECT_EQ(VersionKey("nccl", 12), "grpo/nccl/version/12");
  EXPECT_EQ(GroupPrefix("cuda_ipc"), "grpo/cuda_ipc/group");
  EXPECT_EQ(FormatRoster({"w-1", "w-3"}), "w-1\nw-3\n");
  EXPECT_EQ(ParseRoster("w-1\n\nw-3\n"), (std::vector<std::string>{"w-1", "w-3"}));
  EXPECT_TRUE(ParseRoster("").empty());
  EXPECT_EQ(CudaOrdinal("cuda"), 0);
  EXPECT_EQ(CudaOrdinal("cuda:3"), 3);
  EXPECT_EQ(CudaOrdinal("cpu"), -1);
  EXPECT_EQ(CudaOrdinal("cuda:"), -1);
  EXPECT_EQ(CudaOrdinal("cuda:1x"), -1);
  EXPECT_FALSE(LocalSyncEndpoint("cpu").cuda);
}

// Issue 22 item 1: an announcement names the learner incarnation beside the version, and an
// older learner's bare version still reads.
TEST(WeightSyncGroup, AVersionAnnouncementCarriesItsLearnerIncarnation) {
  EXPECT_EQ(FormatVersionAnnouncement({804, "9f3a1c"}), "804 9f3a1c");
  EXPECT_EQ(FormatVersionAnnouncement({7, ""}), "7");
  const auto a = ParseVersionAnnouncement("804 9f3a1c");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->version, 804);
  EXPECT_EQ(a->incarnation, "9f3a1c");
  const auto bare = ParseVersionAnnouncement("12");
  ASSERT_TRUE(bare.has_value());
  EXPECT_EQ(bare->version, 12);
  EXPECT_EQ(bare->incarnation, "");
  EXPECT_EQ(a->stream_group_bytes, 0);
  for (const char* bad :
       {"", " 12", "x12", "12 ", "12 a b", "-3 a", "99999999999999999999 a",
        "9999999999999999999 a", "12 a stream 99999999999999999999", "12 a stream", "12 a stream 0",
        "12 a stream -4", "12 a stream 4 x", "12  stream 4", "12 a streams 4"}) {
    EXPECT_FALSE(ParseVersionAnnouncement(bad).has_value()) << "'" << bad << "'";
  }
}

// A streamed version (weight_publish: stream) says so, with the byte cap of its groups: its
// receivers make the learner's Broadcast calls from their layout.
TEST(WeightSyncGroup, AStreamedVersionsAnnouncementCarriesItsGroupCap) {
  VersionAnnouncement streamed{805, "9f3a1c"};
  streamed.stream_group_bytes = 16777216;
  EXPECT_EQ(FormatVersionAnnouncement(streamed), "805 9f3a1c stream 16777216");
  const auto a = ParseVersionAnnouncement("805 9f3a1c stream 16777216");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->version, 805);
  EXPECT_EQ(a->incarnation, "9f3a1c");
  EXPECT_EQ(a->stream_group_bytes, 16777216);
}

// StreamGrouping by hand, cap 100: 30 + 50 share a group; 40 would make 120, so it starts the
// next; 100 (at the cap) goes alone and ends that group; even an empty tensor after it starts
// another, which 10 joins.
TEST(WeightSyncGroup, StreamGroupingSharesUpToTheCapAndSendsALargeTensorAlone) {
  StreamGrouping g(100);
  std::vector<std::pair<bool, bool>> got;  // (the group before is complete, alone)
  for (int64_t bytes : {30, 50, 40, 100, 0, 10}) {
    const bool complete = g.Add(bytes);
    got.emplace_back(complete, g.Alone());
  }
  const std::vector<std::pair<bool, bool>> want = {{false, false}, {false, false}, {true, false},
                                                   {true, true},   {true, false},  {false, false}};
  EXPECT_EQ(got, want);
}

// The rule of AssignBackend, case by case (group.h).
TEST(WeightSyncGroup, AssignBackendServesWhatTheTwoEndsCan) {
  const SyncEndpoint cpu;
  const SyncEndpoint gpu_a{true, "GPU-a"}, gpu_b{true, "GPU-b"};
  auto all = [](std::string_view) { return true; };
  auto no_cuda = [](std::string_view b) { return b == kBackendGloo; };
  auto nothing = [](std::string_view) { return false; };
  struct Case {
    std::string asked;
    SyncEndpoint learner, worker;
    std::function<bool(std::string_view)> built;
    std::string want;
    bool note;
  };
  const std::vector<Case> cases = {
      {"grpc", gpu_a, gpu_a, all, "grpc", false},
      {"", cpu, cpu, all, "grpc", false},
      {"gloo", gpu_a, gpu_b, all, "gloo", false},
      {"gloo", cpu, cpu, nothing, "grpc", true},
      {"nccl", gpu_a, gpu_b, all, "nccl", false},
      {"nccl", gpu_a, gpu_a, all, "cuda_ipc", true},  // NCCL refuses two ranks on one GPU
      {"nccl", cpu, gpu_b, all, "grpc", true},
      {"nccl", gpu_a, cpu, all, "grpc", true},
      {"nccl", gpu_a, gpu_b, no_cuda, "grpc", true},
      {"cuda_ipc", gpu_a, gpu_a, all, "cuda_ipc", false},
      {"cuda_ipc", gpu_a, gpu_b, all, "grpc", true},
      {"auto", gpu_a, gpu_a, all, "cuda_ipc", true},
      {"auto", gpu_a, gpu_b, all, "nccl", true},
      {"auto", gpu_a, cpu, all, "gloo", true},
      {"auto", cpu, gpu_a, all, "gloo", true},
      {"auto", cpu, cpu, all, "gloo", true},
      {"auto", gpu_a, gpu_b, no_cuda, "gloo", true},
      {"auto", cpu, cpu, nothing, "grpc", true},
      {"auto", SyncEndpoint{true, ""}, SyncEndpoint{true, ""}, all, "nccl", true},  // unknown
      {"carrier-pigeon", cpu, cpu, all, "grpc", true},
  };
  for (const Case& c : cases) {
    const BackendAssignment a = AssignBackend(c.asked, c.learner, c.worker, c.built);
    EXPECT_EQ(a.backend, c.want) << c.asked << " " << c.learner.gpu_uuid << " -> "
                                 << c.worker.gpu_uuid << ": " << a.note;
    EXPECT_EQ(!a.note.empty(), c.note) << c.asked << ": '" << a.note << "'";
  }
}

}  // namespace
}  // namespace grpo::common
