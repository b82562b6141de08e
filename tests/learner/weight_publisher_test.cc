// The learner's WeightPublisher and the workers' GroupWeightReceiver together, in one process,
// without gRPC (issue 14 §3, issue 15 §2): the learner's InMemoryEpochStore directly, and the
// in-process fake backend (the real Begin/Broadcast/Commit protocol over a fake transport)
// through the same factory argument that takes Gloo, NCCL or CUDA IPC in production.
#include "learner/weight_publisher.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/cancel_token.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/weight_sync/fake_weight_sync.h"
#include "common/weight_sync/group.h"
#include "rollout/group_weight_receiver.h"
#include "tests/common/weight_sync_test_util.h"

namespace grpo::learner {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kTimeout = 1500ms;

// One fake hub per epoch (the world size of the group formed in it).
class FakeGroups {
 public:
  common::WeightSyncFactory Factory() {
    return [this](std::string_view, c10::intrusive_ptr<c10d::Store>, int rank, int world,
                  int64_t epoch) -> StatusOr<std::unique_ptr<common::WeightSync>> {
      std::shared_ptr<common::FakeWeightSyncHub> hub;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto& h = hubs_[epoch];
        if (!h) h = std::make_shared<common::FakeWeightSyncHub>(world);
        hub = h;
      }
      common::WeightSyncOptions o;
      o.timeout = kTimeout;
      return common::CreateFakeWeightSync(hub, rank, epoch, o);
    };
  }

 private:
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<common::FakeWeightSyncHub>> hubs_;
};

// A rejecting fallback: a test that reaches it did not get its weights over the group.
class NoFallback final : public rollout::WeightReceiver {
 public:
  StatusOr<rollout::ReceivedVersion> Receive(int64_t, common::Model&,
                                             std::chrono::milliseconds) override {
    calls += 1;
    return Status::Unavailable("no GetWeights in this test");
  }
  std::string backend() const override { return "grpc"; }
  int calls = 0;
};

std::unique_ptr<common::Model> TinyModel(uint64_t seed) {
  auto config = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(config.ok());
  auto model = common::Model::InitRandom(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::move(model).value();
}

// A snapshot of `model`'s parameters, each + `shift` (so every version has other bytes).
std::shared_ptr<const WeightSnapshot> Snapshot(const common::Model& model, int64_t version,
                                               float shift) {
  auto snap = std::make_shared<WeightSnapshot>();
  snap->version = version;
  for (const auto& [name, t] : model.NamedParameters()) {
    snap->tensors.emplace_back(name, (t.detach() + shift).contiguous());
  }
  return snap;
}

template <typename F>
bool WaitFor(F f, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return f();
}

struct Worker {
  std::string id;
  NoFallback* fallback = nullptr;  // owned by receiver
  std::unique_ptr<rollout::GroupWeightReceiver> receiver;
};

Worker MakeWorker(const std::string& id, std::shared_ptr<common::InMemoryEpochStore> store,
                  FakeGroups& groups, const std::string& requested = "gloo") {
  Worker w;
  w.id = id;
  auto fallback = std::make_unique<NoFallback>();
  w.fallback = fallback.get();
  rollout::GroupWeightReceiverOptions o;
  o.requested_backend = requested;
  o.timeout = kTimeout;
  o.version_wait = 5s;
  w.receiver = std::make_unique<rollout::GroupWeightReceiver>(store, std::move(fallback),
                                                              groups.Factory(), o);
  return w;
}

// The publisher's thread: rounds until `done`.
class PublisherThread {
 public:
  PublisherThread(WeightPublisher& p, std::function<std::vector<std::string>()> members,
                  std::function<std::shared_ptr<const WeightSnapshot>()> weights)
      : thread_([&p, this, members, weights] {
          while (!stop_) {
            (void)p.Sync(members(), weights());
            std::this_thread::sleep_for(5ms);
          }
        }) {}
  ~PublisherThread() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A group's thread with weight_publish stream, as the learner's: StreamRound until destroyed,
// each round queued until served (the destructor's cancel ends a wait no Serve took).
class StreamingGroupThread {
 public:
  StreamingGroupThread(WeightPublisher& p, WeightReaders& readers, std::vector<std::string> members)
      : thread_([&p, &readers, members, this] {
          while (!stop_) {
            bool waited = false;
            const Status s =
                p.StreamRound(members, readers, "inc-1", Clock::now() + 60s, &cancel_, &waited);
            if (!s.ok()) failed_ += 1;
            if (!waited) std::this_thread::sleep_for(5ms);
          }
        }) {}
  ~StreamingGroupThread() {
    stop_ = true;
    cancel_.Cancel();
    thread_.join();
  }
  int failed() const { return failed_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> failed_{0};
  common::CancelToken cancel_;
  std::thread thread_;  // last: it starts once the members above exist
};

// What a Serve of `snap` hands out: its tensors in order.
WeightProducer From(const std::shared_ptr<const WeightSnapshot>& snap) {
  return [snap](const WeightPut& put) {
    for (const auto& [name, t] : snap->tensors) put(name, t);
    return Status::OK();
  };
}

// A gloo publisher over the fakes with two workers registered in its first epoch, of learner
// "inc-1" (as StreamingGroupThread announces), each receiver's thread started by a first,
// failing Receive (it takes the model's layout), for the streamed tests.
struct TwoWorkers {
  explicit TwoWorkers(const std::string& second, int64_t stream_group_bytes = kStreamGroupBytes)
      : publisher("gloo", store, groups.Factory(), kTimeout, stream_group_bytes),
        a(MakeWorker("w-a", store, groups)),
        b(MakeWorker(second, store, groups)) {
    epoch = store->Advance();
    for (Worker* w : {&a, &b}) w->receiver->SetGroup({w->id, epoch, "gloo", "inc-1"});
    EXPECT_FALSE(a.receiver->Receive(0, *model_a, 1ms).ok());
    EXPECT_FALSE(b.receiver->Receive(0, *model_b, 1ms).ok());
  }
  std::shared_ptr<common::InMemoryEpochStore> store =
      std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  WeightPublisher publisher;
  std::unique_ptr<common::Model> base = TinyModel(1), model_a = TinyModel(2),
                                 model_b = TinyModel(3);
  Worker a, b;
  int64_t epoch = 0;
};

TEST(WeightPublisher, TwoReceiversGetEachVersionBitEqualAndInstallIt) {
  auto store = std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  WeightPublisher publisher("gloo", store, groups.Factory(), kTimeout);
  auto base = TinyModel(1);
  std::mutex mu;
  std::shared_ptr<const WeightSnapshot> current = Snapshot(*base, 1, 0.5f);
  Worker a = MakeWorker("w-a", store, groups), b = MakeWorker("w-b", store, groups);
  const int64_t epoch = store->Advance();  // the workers registered
  for (Worker* w : {&a, &b}) w->receiver->SetGroup({w->id, epoch, "gloo", ""});
  // The first Receive starts the thread (it needs the model's layout); the group has nothing
  // yet, so a short call falls back (and this fallback refuses).
  auto model_a = TinyModel(2), model_b = TinyModel(3);
  EXPECT_FALSE(a.receiver->Receive(0, *model_a, 1ms).ok());
  EXPECT_FALSE(b.receiver->Receive(0, *model_b, 1ms).ok());
  PublisherThread run(
      publisher,
      [] {
        return std::vector<std::string>{"w-a", "w-b"};
      },
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        return current;
      });
  for (Worker* w : {&a, &b}) {
    ASSERT_TRUE(WaitFor([&] { return w->receiver->latest().first == 1; }, 10s)) << w->id;
    EXPECT_TRUE(testing::BitEqual(w->receiver->latest().second, current->tensors));
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    current = Snapshot(*base, 2, -0.25f);
  }
  StatusOr<rollout::ReceivedVersion> got = a.receiver->Receive(2, *model_a, 10s);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->version, 2);
  EXPECT_TRUE(testing::BitEqual(model_a->NamedParameters(), current->tensors));
  EXPECT_EQ(a.receiver->installs_from_group(), 1);
  ASSERT_TRUE(WaitFor([&] { return b.receiver->latest().first == 2; }, 10s));
  // A receiver holds version 2 once Commit is through on its side, which can be before the
  // publisher's Sync returns and counts it.
  ASSERT_TRUE(WaitFor([&] { return publisher.syncs() >= 2; }, 10s));
  EXPECT_EQ(publisher.syncs(), 2);
  EXPECT_EQ(publisher.failures(), 0);
  EXPECT_EQ(publisher.group_epoch(), epoch);
  EXPECT_EQ(a.receiver->assigned_backend(), "gloo");
  EXPECT_EQ(a.receiver->groups_joined(), 1);
}

// weight_publish stream: no snapshot; the group waits as a reader of the learner's
// WeightReaders for the version after the one it sent, and each Serve (the training thread)
// hands it the weights a tensor at a time, sent in the groups of StreamGrouping (the
// announcement carries their cap, so the receivers make the same calls). Each receiver holds
// each version bit for bit. The cap here, 20,000 bytes, makes every kind of group of the tiny
// model: the embedding (259 x 64 x 4 = 66,304 bytes) and the MLP matrices (176 x 64 x 4 =
// 45,056) alone, and the norms and attention matrices (64 x 64 x 4 = 16,384) shared.
TEST(WeightPublisher, AStreamedVersionReachesEachReceiverATensorAtATime) {
  TwoWorkers t("w-b", /*stream_group_bytes=*/20000);
  const common::Model& base = *t.base;
  Worker &a = t.a, &b = t.b;
  WeightPublisher& publisher = t.publisher;
  WeightReaders readers(nullptr);
  StreamingGroupThread group(publisher, readers, {"w-a", "w-b"});
  for (int64_t v : {1, 2}) {
    const auto snap = Snapshot(base, v, 0.5f * static_cast<float>(v));
    ASSERT_TRUE(WaitFor([&] { return readers.waiting(v); }, 10s)) << v;
    ASSERT_TRUE(readers.Serve(v, snap->tensors.size(), From(snap)).ok());
    for (Worker* w : {&a, &b}) {
      ASSERT_TRUE(WaitFor([&] { return w->receiver->latest().first == v; }, 10s)) << w->id;
      EXPECT_TRUE(testing::BitEqual(w->receiver->latest().second, snap->tensors)) << w->id;
    }
  }
  ASSERT_TRUE(WaitFor([&] { return publisher.syncs() >= 2; }, 10s));
  EXPECT_EQ(publisher.syncs(), 2);
  EXPECT_EQ(publisher.failures(), 0);
  EXPECT_EQ(publisher.last_sent(), 2);
  EXPECT_EQ(group.failed(), 0);
  EXPECT_EQ(a.fallback->calls + b.fallback->calls, 2);  // the two 1 ms calls above only
}

// A receiver lost while a version streams fails its group's broadcast within one deadline:
// the group is given up (the epoch ends, as with snapshots) and the Serve goes on; another
// reader of the same Serve (a GetWeights call) gets the whole version.
TEST(WeightPublisher, ALostReceiverFailsItsGroupsStreamAndTheOtherReadersGetTheVersion) {
  TwoWorkers t("w-lost");
  const common::Model& base = *t.base;
  Worker& lost = t.b;
  WeightPublisher& publisher = t.publisher;
  WeightReaders readers(nullptr);
  StreamingGroupThread group(publisher, readers, {"w-a", "w-lost"});
  const auto v1 = Snapshot(base, 1, 0);
  ASSERT_TRUE(WaitFor([&] { return readers.waiting(1); }, 10s));
  ASSERT_TRUE(readers.Serve(1, v1->tensors.size(), From(v1)).ok());
  ASSERT_TRUE(WaitFor([&] { return lost.receiver->latest().first == 1; }, 10s));
  lost.receiver.reset();  // the process is gone; the learner has not noticed yet
  ASSERT_TRUE(WaitFor([&] { return readers.waiting(2); }, 10s));
  size_t pieces = 0;
  const WeightSink get_weights = [&](const WeightPiece&) {
    ++pieces;
    return true;
  };
  auto other = std::async(std::launch::async,
                          [&] { return readers.Read(get_weights, Clock::now() + 30s, nullptr); });
  const auto v2 = Snapshot(base, 2, 1);
  const auto t0 = Clock::now();
  // Serve once the GetWeights reader is queued beside the group (both want version 2).
  ASSERT_TRUE(WaitFor([&] { return readers.waiting(2) == 2; }, 10s));
  const Status served = readers.Serve(2, v2->tensors.size(), From(v2));
  EXPECT_TRUE(served.ok()) << served.ToString();
  EXPECT_LT(Clock::now() - t0, kTimeout * 3);  // one deadline, not a hang
  EXPECT_TRUE(other.get().ok());
  EXPECT_EQ(pieces, v2->tensors.size());
  // The failure ended the epoch (the thread then tries the same roster again, in vain).
  ASSERT_TRUE(WaitFor([&] { return publisher.failures() >= 1 && group.failed() >= 1; }, 10s));
  EXPECT_GE(t.store->epoch(), t.epoch + 1);
}

// A producer that fails mid-version (a rank's gather) leaves the group inside it: the group is
// aborted and its epoch ended, and no receiver keeps the half-sent version.
TEST(WeightPublisher, AStreamWhoseProducerFailsMidVersionAbortsTheGroup) {
  TwoWorkers t("w-b");
  WeightReaders readers(nullptr);
  StreamingGroupThread group(t.publisher, readers, {"w-a", "w-b"});
  const auto v1 = Snapshot(*t.base, 1, 0);
  ASSERT_TRUE(WaitFor([&] { return readers.waiting(1) == 1; }, 10s));
  const Status served = readers.Serve(1, v1->tensors.size(), [&](const WeightPut& put) {
    put(v1->tensors[0].first, v1->tensors[0].second);
    return Status::Aborted("rank 1 left the gather");
  });
  EXPECT_EQ(served.code(), StatusCode::kAborted);
  ASSERT_TRUE(WaitFor([&] { return t.publisher.failures() == 1; }, 10s));
  EXPECT_GE(t.store->epoch(), t.epoch + 1);
  EXPECT_EQ(t.a.receiver->latest().first, -1);
  EXPECT_EQ(t.b.receiver->latest().first, -1);
}

TEST(WeightPublisher, ALostReceiverEndsTheEpochAndTheOtherRejoinsTheNext) {
  auto store = std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  WeightPublisher publisher("gloo", store, groups.Factory(), kTimeout);
  auto base = TinyModel(1);
  Worker a = MakeWorker("w-a", store, groups), lost = MakeWorker("w-lost", store, groups);
  const int64_t epoch = store->Advance();
  auto model_a = TinyModel(2), model_lost = TinyModel(3);
  for (Worker* w : {&a, &lost}) w->receiver->SetGroup({w->id, epoch, "gloo", ""});
  (void)a.receiver->Receive(0, *model_a, 1ms);
  (void)lost.receiver->Receive(0, *model_lost, 1ms);
  ASSERT_TRUE(publisher.Sync({"w-a", "w-lost"}, Snapshot(*base, 1, 0)).ok());
  ASSERT_TRUE(WaitFor([&] { return lost.receiver->latest().first == 1; }, 10s));
  lost.receiver.reset();  // the process is gone; the learner has not noticed yet
  const auto t0 = Clock::now();
  const Status s = publisher.Sync({"w-a", "w-lost"}, Snapshot(*base, 2, 1));
  EXPECT_FALSE(s.ok());
  EXPECT_LT(Clock::now() - t0, kTimeout * 3);  // one deadline, not a hang
  EXPECT_EQ(publisher.failures(), 1);
  EXPECT_EQ(store->epoch(), epoch + 1);  // the failure ended the epoch
  EXPECT_EQ(publisher.group_epoch(), 0);
  // The learner drops the lost worker; the survivor hears the new epoch (heartbeat) and the
  // next version reaches it there.
  a.receiver->SetGroup({"w-a", epoch + 1, "gloo", ""});
  auto snap3 = Snapshot(*base, 3, 2);
  PublisherThread run(
      publisher, [] { return std::vector<std::string>{"w-a"}; }, [&] { return snap3; });
  ASSERT_TRUE(WaitFor([&] { return a.receiver->latest().first == 3; }, 10s));
  StatusOr<rollout::ReceivedVersion> got = a.receiver->Receive(3, *model_a, 10s);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->version, 3);
  EXPECT_TRUE(testing::BitEqual(model_a->NamedParameters(), snap3->tensors));
  EXPECT_EQ(a.receiver->groups_joined(), 2);
  EXPECT_EQ(a.fallback->calls, 1);  // only the first, layout-taking call
}

TEST(WeightPublisher, ANewRosterInTheSameEpochMovesTheGroupToTheNextEpoch) {
  auto store = std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  WeightPublisher publisher("gloo", store, groups.Factory(), kTimeout);
  auto base = TinyModel(1);
  Worker a = MakeWorker("w-a", store, groups);
  const int64_t epoch = store->Advance();
  a.receiver->SetGroup({"w-a", epoch, "gloo", ""});
  auto model = TinyModel(2);
  (void)a.receiver->Receive(0, *model, 1ms);
  ASSERT_TRUE(publisher.Sync({"w-a"}, Snapshot(*base, 1, 0)).ok());
  EXPECT_EQ(*store->Get(epoch, common::RosterKey("gloo"), 1s), "w-a\n");
  EXPECT_EQ(*store->Get(epoch, common::VersionKey("gloo", 0), 1s), "1");
  // Another roster without a new epoch would reuse the group's keys: the publisher ends the
  // epoch instead, and forms the group in the next one.
  ASSERT_TRUE(publisher.Sync({"w-a", "w-b"}, Snapshot(*base, 1, 0)).ok());
  EXPECT_EQ(store->epoch(), epoch + 1);
  EXPECT_EQ(publisher.group_epoch(), 0);
  // No members: nothing is formed, nothing fails.
  ASSERT_TRUE(publisher.Sync({}, Snapshot(*base, 2, 0)).ok());
  EXPECT_EQ(publisher.failures(), 0);
}

TEST(WeightPublisher, AGpuBackendSkipsAVersionWithoutADeviceCopy) {
  auto store = std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  WeightPublisher publisher("nccl", store, groups.Factory(), kTimeout);
  auto base = TinyModel(1);
  Worker a = MakeWorker("w-a", store, groups, "auto");
  const int64_t epoch = store->Advance();
  a.receiver->SetGroup({"w-a", epoch, "nccl", ""});
  auto model = TinyModel(2);
  (void)a.receiver->Receive(0, *model, 1ms);
  // Formed, but a CPU-only snapshot is not sent (the worker takes GetWeights for it).
  ASSERT_TRUE(publisher.Sync({"w-a"}, Snapshot(*base, 1, 0)).ok());
  EXPECT_EQ(publisher.syncs(), 0);
  EXPECT_EQ(publisher.group_epoch(), epoch);
  EXPECT_EQ(a.receiver->assigned_backend(), "nccl");
  EXPECT_EQ(a.receiver->backend(), "auto");
}

TEST(GroupWeightReceiver, AWorkerAssignedGrpcJoinsNoGroupAndFallsBackAtOnce) {
  auto store = std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  Worker a = MakeWorker("w-a", store, groups, "nccl");
  a.receiver->SetGroup({"w-a", store->Advance(), "grpc", ""});
  auto model = TinyModel(2);
  const auto t0 = Clock::now();
  EXPECT_FALSE(a.receiver->Receive(0, *model, 10s).ok());  // the fallback's refusal
  EXPECT_LT(Clock::now() - t0, 3s);                        // no version_wait (5 s) without a group
  EXPECT_EQ(a.fallback->calls, 1);
  EXPECT_EQ(a.receiver->assigned_backend(), "grpc");
  EXPECT_EQ(a.receiver->groups_joined(), 0);
}

// GetWeights from the learner that answers now: loads `tensors` as `version` of `incarnation`.
class ServingFallback final : public rollout::WeightReceiver {
 public:
  ServingFallback(common::NamedTensors tensors, int64_t version, std::string incarnation)
      : tensors_(std::move(tensors)), version_(version), incarnation_(std::move(incarnation)) {}
  StatusOr<rollout::ReceivedVersion> Receive(int64_t min_version, common::Model& model,
                                             std::chrono::milliseconds) override {
    calls += 1;
    if (version_ < min_version) return Status::Unavailable("not there yet");
    RETURN_IF_ERROR(model.LoadStateFrom(tensors_));
    return rollout::ReceivedVersion{version_, incarnation_};
  }
  std::string backend() const override { return "grpc"; }
  int calls = 0;

 private:
  common::NamedTensors tensors_;
  int64_t version_;
  std::string incarnation_;
};

// Issue 22 item 1, the race of the chaos harness through the fakes: the worker's group
// receiver holds version 804 of the dead learner A; the worker registers with the restarted
// learner B at version 800 (its epochs numbered anew: the same epoch number here). Receive(800)
// must give B's 800 (GetWeights), never A's 804, which B would refuse as unknown_policy forever.
TEST(GroupWeightReceiver, AVersionOfALearnerTheWorkerLeftIsNeverDelivered) {
  auto store = std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  auto base = TinyModel(3);
  auto dead = std::make_shared<WeightSnapshot>(*Snapshot(*base, 804, 1.0f));
  dead->incarnation = "A";
  const auto restored = Snapshot(*base, 800, 2.0f);  // B's weights, other bytes

  auto fallback = std::make_unique<ServingFallback>(restored->tensors, 800, "B");
  ServingFallback* served = fallback.get();
  rollout::GroupWeightReceiverOptions o;
  o.timeout = kTimeout;
  o.version_wait = 5s;
  rollout::GroupWeightReceiver receiver(store, std::move(fallback), groups.Factory(), o);
  receiver.SetGroup({"a", store->epoch(), "gloo", "A"});
  auto first = TinyModel(5);
  (void)receiver.Receive(0, *first, 1ms);  // starts the thread (GetWeights answers meanwhile)
  {
    WeightPublisher publisher("gloo", store, groups.Factory(), kTimeout);
    PublisherThread thread(
        publisher, [] { return std::vector<std::string>{"a"}; }, [&] { return dead; });
    ASSERT_TRUE(WaitFor([&] { return receiver.latest().first == 804; }, 10s));
  }  // A dies

  receiver.SetGroup({"a", store->epoch(), "gloo", "B"});
  EXPECT_EQ(receiver.latest().first, -1) << "A's version is kept after the worker left A";
  auto model = TinyModel(6);
  const int calls_before = served->calls;
  StatusOr<rollout::ReceivedVersion> got = receiver.Receive(800, *model, 2s);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->version, 800);
  EXPECT_EQ(got->incarnation, "B");
  EXPECT_EQ(served->calls, calls_before + 1);
  EXPECT_TRUE(grpo::testing::BitEqual(model->NamedParameters(), restored->tensors));
}

// A broadcast announced by another incarnation than the worker's membership is not taken, even
// over the store of the epoch the worker was told to join.
TEST(GroupWeightReceiver, ABroadcastAnnouncedByAnotherIncarnationIsNotKept) {
  auto store = std::make_shared<common::InMemoryEpochStore>();
  FakeGroups groups;
  auto base = TinyModel(3);
  auto other = std::make_shared<WeightSnapshot>(*Snapshot(*base, 5, 1.0f));
  other->incarnation = "A";
  Worker a = MakeWorker("a", store, groups);
  a.receiver->SetGroup({"a", store->epoch(), "gloo", "B"});
  auto model = TinyModel(5);
  (void)a.receiver->Receive(0, *model, 1ms);
  WeightPublisher publisher("gloo", store, groups.Factory(), kTimeout);
  PublisherThread thread(
      publisher, [] { return std::vector<std::string>{"a"}; }, [&] { return other; });
  // The receiver joins, reads the announcement and leaves instead of receiving.
  ASSERT_TRUE(WaitFor([&] { return a.receiver->groups_joined() >= 1; }, 10s));
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(a.receiver->versions_received(), 0);
  EXPECT_EQ(a.receiver->latest().first, -1);
}

}  // namespace
}  // namespace grpo::learner
