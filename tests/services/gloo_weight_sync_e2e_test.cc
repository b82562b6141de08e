// The Gloo weight sync end to end: GrpcEpochStore against a real LearnerServer, then
// a learner and two RolloutWorkers (threads of this process) with
// weight_sync_backend "gloo" (or "auto", which the learner on the CPU assigns gloo) on loopback.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/weight_sync/epoch_store.h"
#include "rollout/group_weight_receiver.h"
#include "services/auth.h"
#include "services/convert.h"
#include "services/grpc_store.h"
#include "services/grpc_weight_receiver.h"
#include "services/learner_service.h"
#include "services/rollout_worker.h"
#include "tests/common/weight_sync_test_util.h"
#include "tests/learner/tiny_config.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kSyncTimeout = 3s;  // the learner's and the workers' collective deadline

// The shared tiny job over gRPC, with Gloo groups.
common::GrpoConfig TinyConfig(const fs::path &dir, int64_t max_steps) {
  common::GrpoConfig c = grpo::testing::TinyLearnerConfig(dir);
  c.grpc_port = 0;
  c.max_steps = max_steps;
  c.reward_funcs = {"length"};
  c.weight_sync_backend = "gloo";
  return c;
}

using grpo::testing::BitEqual;

template <typename Pred>
bool WaitFor(Pred pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

class GlooWeightSyncE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("gloo_e2e_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    workers_.clear();
    if (server_) (void)server_->Stop(false);
    server_.reset();
    fs::remove_all(dir_);
  }

  // `config_hostname` non-empty: the Gloo address comes from config key
  // weight_sync_hostname, not from LearnerServerOptions.
  void StartLearner(int64_t max_steps, std::chrono::milliseconds heartbeat_interval = 200ms,
                    const std::string &config_hostname = "") {
    auto model = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    LearnerServerOptions options;
    options.heartbeat_interval = heartbeat_interval;  // dropped after 5 missed heartbeats
    options.weight_sync_timeout = kSyncTimeout;
    common::GrpoConfig config = TinyConfig(dir_, max_steps);
    if (config_hostname.empty()) {
      options.weight_sync_hostname = "127.0.0.1";
    } else {
      config.weight_sync_hostname = config_hostname;
    }
    auto server = LearnerServer::Create(config, std::move(model).value(), nullptr, options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    ASSERT_TRUE(server_->Start().ok());
    channel_ = MakeChannel(address());
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }

  void SubmitPrompts(int n) {
    auto stub = v1::LearnerService::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::SubmitDatasetResponse response;
    auto writer = stub->SubmitDataset(&ctx, &response);
    v1::SubmitDatasetRequest req;
    req.set_name("e2e");
    for (int i = 0; i < n; ++i) req.add_lines(R"({"prompt": "say )" + std::to_string(i) + R"("})");
    req.set_last(true);
    req.set_total_lines(n);
    ASSERT_TRUE(writer->Write(req));
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  struct RunningWorker {
    std::atomic<bool> stop{false};
    rollout::GroupWeightReceiver *receiver = nullptr;  // owned by `worker`
    std::unique_ptr<RolloutWorker> worker;
    Status result;
    std::thread thread;
    ~RunningWorker() {
      stop = true;
      if (thread.joinable()) thread.join();
    }
  };

  RunningWorker &StartWorker(const std::string &hostname = "127.0.0.1",
                             const std::string &backend = "gloo") {
    auto rw = std::make_unique<RunningWorker>();
    RolloutWorkerOptions o;
    o.learner_address = address();
    o.config.weight_sync_backend = backend;
    o.prompts_per_lease = 2;
    o.reward_options = {{"length", {{"target_length", 3}}}};
    o.backoff.initial = 5ms;
    o.backoff.max = 50ms;
    o.stop = &rw->stop;
    RunningWorker *raw = rw.get();
    o.make_weight_receiver = [raw, hostname, backend](std::shared_ptr<grpc::Channel> channel) {
      WeightGroupOptions g;
      g.timeout = kSyncTimeout;
      g.hostname = hostname;
      auto r = MakeWeightReceiver(std::move(channel), "", backend, 0, g, at::kCPU);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      raw->receiver = dynamic_cast<rollout::GroupWeightReceiver *>(r->get());
      EXPECT_NE(raw->receiver, nullptr);
      return std::move(r).value();
    };
    auto w = RolloutWorker::Create(std::move(o));
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    rw->worker = std::move(w).value();
    rw->thread = std::thread([raw] { raw->result = raw->worker->Run(); });
    workers_.push_back(std::move(rw));
    return *workers_.back();
  }

  fs::path dir_;
  std::unique_ptr<LearnerServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::vector<std::unique_ptr<RunningWorker>> workers_;
};

TEST_F(GlooWeightSyncE2eTest, GrpcEpochStoreSetsGetsAddsAndSharesTheLearnersKeySpace) {
  StartLearner(100);
  const int64_t epoch = server_->group_epoch();
  auto store = c10::make_intrusive<common::C10dEpochStore>(
      GrpcEpochStore::Connect(channel_, "", 2s), epoch, 2s);
  store->set("a", {'x', 'y'});
  EXPECT_EQ(store->get("a"), (std::vector<uint8_t>{'x', 'y'}));
  EXPECT_EQ(store->add("n", 2), 2);
  EXPECT_EQ(store->add("n", 3), 5);
  EXPECT_TRUE(store->check({"a", "n"}));
  EXPECT_FALSE(store->check({"a", "missing"}));
  EXPECT_EQ(store->getNumKeys(), 2);
  // The learner's in-process store sees the same keys.
  auto local = c10::make_intrusive<common::C10dEpochStore>(server_->epoch_store(), epoch, 60s);
  EXPECT_EQ(local->get("a"), (std::vector<uint8_t>{'x', 'y'}));
  local->set("b", {'1'});
  store->wait({"a", "b"}, 1s);
  EXPECT_TRUE(store->deleteKey("b"));
  EXPECT_FALSE(store->check({"b"}));
  // compareSet: set when the current value matches.
  EXPECT_EQ(store->compareSet("a", {'x', 'y'}, {'z'}), (std::vector<uint8_t>{'z'}));
  EXPECT_EQ(store->compareSet("a", {'q'}, {'w'}), (std::vector<uint8_t>{'z'}));
}

TEST_F(GlooWeightSyncE2eTest, GrpcEpochStoreWaitForAMissingKeyFailsWithinItsDeadline) {
  StartLearner(100);
  const int64_t epoch = server_->group_epoch();
  auto grpc_store = GrpcEpochStore::Connect(channel_, "", 2s);
  auto store = c10::make_intrusive<common::C10dEpochStore>(grpc_store, epoch, 2s);
  auto start = Clock::now();
  EXPECT_THROW(store->wait({"never"}, 500ms), c10::Error);
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_GE(Clock::now() - start, 400ms);
  start = Clock::now();
  StatusOr<std::string> v = grpc_store->Get(epoch, "never", 300ms);
  EXPECT_EQ(v.status().code(), StatusCode::kDeadlineExceeded) << v.status().ToString();
  EXPECT_LT(Clock::now() - start, 2s);
  // get() waits the store's own timeout (2 s), not forever.
  start = Clock::now();
  EXPECT_THROW(store->get("never"), c10::Error);
  EXPECT_LT(Clock::now() - start, 5s);
}

TEST_F(GlooWeightSyncE2eTest, GrpcEpochStoreOfAPastEpochIsFailedPrecondition) {
  StartLearner(100);
  auto grpc_store = GrpcEpochStore::Connect(channel_, "", 1s);
  const Status s = grpc_store->Set(server_->group_epoch() + 7, "a", "b");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  auto store =
      c10::make_intrusive<common::C10dEpochStore>(grpc_store, server_->group_epoch() + 7, 1s);
  EXPECT_THROW(store->set("a", {'b'}), c10::Error);
}

// This machine's first IPv4 address that is not loopback, if it has one.
std::optional<std::string> NonLoopbackIpv4() {
  ifaddrs *ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (ifaddrs *i = ifs; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET ||
        (i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP))
      continue;
    char buf[INET_ADDRSTRLEN];
    const auto *a = reinterpret_cast<const sockaddr_in *>(i->ifa_addr);
    if (::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf))) found = buf;
  }
  ::freeifaddrs(ifs);
  return found;
}

// Listening TCP sockets (IPv4 or v4-mapped IPv6) whose local address is `ip`.
int ListenersOn(const std::string &ip) {
  in_addr a{};
  ::inet_pton(AF_INET, ip.c_str(), &a);
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08X", a.s_addr);  // /proc/net/tcp's byte order
  int n = 0;
  for (const char *table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream ss(line);
      std::string slot, local, remote, state;
      ss >> slot >> local >> remote >> state;
      const std::string addr = local.substr(0, local.find(':'));
      if (state == "0A" && (addr == hex || addr == "0000000000000000FFFF0000" + std::string(hex)))
        ++n;
    }
  }
  return n;
}

// Issue 12 item 10: without LearnerServerOptions::weight_sync_hostname the
// learner's Gloo rank listens on config key weight_sync_hostname. Here that is
// the machine's non-loopback address (its hostname resolves to loopback), so
// the learner's rank and the worker's (both in this process) listen there.
TEST_F(GlooWeightSyncE2eTest, LearnersGlooRankListensOnTheConfiguredHostname) {
  const auto ip = NonLoopbackIpv4();
  if (!ip) GTEST_SKIP() << "this machine has no non-loopback IPv4 address";
  const int before = ListenersOn(*ip);
  StartLearner(/*max_steps=*/100, 200ms, /*config_hostname=*/*ip);
  RunningWorker &a = StartWorker(*ip);
  ASSERT_TRUE(WaitFor([&] { return a.receiver && a.receiver->groups_joined() >= 1; }, 60s));
  RecordProperty("new_listeners_on_address", ListenersOn(*ip) - before);
  EXPECT_GE(ListenersOn(*ip) - before, 2) << "the learner's Gloo rank does not listen on " << *ip;
}

TEST_F(GlooWeightSyncE2eTest, TwoWorkersReceiveTheLatestVersionBitEqualOverGloo) {
  StartLearner(/*max_steps=*/6);
  RunningWorker &a = StartWorker();
  RunningWorker &b = StartWorker();
  // The group forms before there is data: six steps of the tiny model take well under the
  // rendezvous time, so a job started first could end before any worker joined.
  ASSERT_TRUE(WaitFor(
      [&] {
        return a.receiver && b.receiver && a.receiver->groups_joined() >= 1 &&
               b.receiver->groups_joined() >= 1;
      },
      60s));
  SubmitPrompts(64);
  ASSERT_TRUE(server_->WaitForJobEnd(120s));
  ASSERT_EQ(server_->job_state(), JobState::kDone);
  const int64_t latest = server_->published_version();
  ASSERT_GT(latest, 0);
  // The last version is broadcast after the job ended: both receivers get it.
  for (RunningWorker *w : {&a, &b}) {
    ASSERT_NE(w->receiver, nullptr);
    EXPECT_TRUE(WaitFor([&] { return w->receiver->latest().first == latest; }, 30s))
        << "worker got " << w->receiver->latest().first << ", learner published " << latest;
  }
  const common::NamedTensors learner_params = server_->policy().NamedParameters();
  for (RunningWorker *w : {&a, &b}) {
    EXPECT_TRUE(BitEqual(w->receiver->latest().second, learner_params));
    EXPECT_GE(w->receiver->versions_received(), 1);
    EXPECT_GE(w->receiver->groups_joined(), 1);
    std::printf(
        "worker: %lld versions over gloo, %lld installs from gloo, "
        "%lld from grpc\n",
        static_cast<long long>(w->receiver->versions_received()),
        static_cast<long long>(w->receiver->installs_from_group()),
        static_cast<long long>(w->receiver->installs_from_fallback()));
  }
  // The learner counts a sync when its Sync returns, which can be after the receivers hold it.
  EXPECT_TRUE(WaitFor([&] { return server_->group_syncs("gloo") >= 1; }, 10s));
  // A worker that generated with a later version took it from the group at
  // least once.
  EXPECT_GE(a.receiver->installs_from_group() + b.receiver->installs_from_group(), 1);
  for (RunningWorker *w : {&a, &b}) {
    w->thread.join();
    EXPECT_TRUE(w->result.ok()) << w->result.ToString();
  }
}

// Issue 15 §2: the learner assigns the backend at Register. On the CPU, auto is gloo; a GPU
// backend asked for by a CPU worker (or of a CPU learner) is refused with a reason and the
// worker takes GetWeights.
TEST_F(GlooWeightSyncE2eTest, RegisterAssignsTheBackendTheTwoEndsCanServe) {
  StartLearner(/*max_steps=*/100);
  auto stub = v1::LearnerService::NewStub(channel_);
  struct Case {
    std::string asked, device, want;
    bool note;
  };
  const std::vector<Case> cases = {
      {"gloo", "cpu", "gloo", false},    {"grpc", "cpu", "grpc", false},
      {"auto", "cpu", "gloo", true},     {"nccl", "cpu", "grpc", true},
      {"cuda_ipc", "cpu", "grpc", true}, {"nccl", "cuda:0", "grpc", true},
      {"auto", "cuda:0", "gloo", true},  {"", "", "grpc", false},
  };
  int n = 0;
  for (const Case &c : cases) {
    grpc::ClientContext ctx;
    v1::RegisterRequest req;
    req.set_worker_id("assign-" + std::to_string(n++));
    req.set_weight_sync_backend(c.asked);
    req.set_device(c.device);
    if (c.device != "cpu" && !c.device.empty()) req.set_gpu_uuid("GPU-not-the-learners");
    v1::RegisterResponse resp;
    ASSERT_TRUE(stub->Register(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.weight_sync_backend(), c.want) << c.asked << " on " << c.device;
    EXPECT_EQ(!resp.weight_sync_note().empty(), c.note)
        << c.asked << " on " << c.device << ": '" << resp.weight_sync_note() << "'";
  }
}

TEST_F(GlooWeightSyncE2eTest, AnAutoWorkerOnTheCpuReceivesOverTheGlooGroup) {
  StartLearner(/*max_steps=*/4);
  RunningWorker &a = StartWorker("127.0.0.1", "auto");
  ASSERT_TRUE(WaitFor([&] { return a.receiver && a.receiver->groups_joined() >= 1; }, 60s));
  EXPECT_EQ(a.receiver->assigned_backend(), "gloo");
  EXPECT_EQ(a.receiver->backend(), "auto");
  SubmitPrompts(32);
  ASSERT_TRUE(server_->WaitForJobEnd(120s));
  ASSERT_EQ(server_->job_state(), JobState::kDone);
  const int64_t latest = server_->published_version();
  ASSERT_TRUE(WaitFor([&] { return a.receiver->latest().first == latest; }, 30s))
      << "worker got " << a.receiver->latest().first << ", learner published " << latest;
  EXPECT_TRUE(BitEqual(a.receiver->latest().second, server_->policy().NamedParameters()));
  EXPECT_TRUE(WaitFor([&] { return server_->group_syncs("gloo") >= 1; }, 10s));
  a.thread.join();
  EXPECT_TRUE(a.result.ok()) << a.result.ToString();
}

TEST_F(GlooWeightSyncE2eTest, StoppedWorkerBumpsTheEpochAndTheOtherKeepsReceiving) {
  // Heartbeats drop a silent worker after 5 s: the broadcast notices first. The job has no
  // step limit that it could reach before the group is rebuilt (the tiny model trains ~100
  // steps/s); the test cancels it once the remaining worker receives at the new epoch.
  StartLearner(/*max_steps=*/1 << 30, /*heartbeat_interval=*/1000ms);
  SubmitPrompts(1024);
  RunningWorker &a = StartWorker();
  RunningWorker &victim = StartWorker();
  // Both are in the group and took a version over gloo.
  ASSERT_TRUE(WaitFor(
      [&] {
        return a.receiver && victim.receiver && a.receiver->versions_received() >= 1 &&
               victim.receiver->versions_received() >= 1;
      },
      60s));
  const int64_t epoch_before = server_->group_epoch();
  const int64_t failures_before = server_->group_sync_failures("gloo");
  const int64_t a_received_before = a.receiver->versions_received();
  // The victim stops and its receiver goes away (its gloo connections close).
  victim.stop = true;
  victim.thread.join();
  const auto t_stop = Clock::now();
  victim.worker.reset();
  // The group is rebuilt at a new epoch within a bounded time: either the next broadcast
  // fails within its deadline or the missed heartbeats drop the worker first (5 x 1 s),
  // whichever comes first; both bump the epoch.
  ASSERT_TRUE(WaitFor([&] { return server_->group_epoch() > epoch_before; }, kSyncTimeout + 8s));
  std::printf(
      "epoch %lld -> %lld %.2f s after the stop; broadcast failures "
      "%lld -> %lld\n",
      static_cast<long long>(epoch_before), static_cast<long long>(server_->group_epoch()),
      std::chrono::duration<double>(Clock::now() - t_stop).count(),
      static_cast<long long>(failures_before),
      static_cast<long long>(server_->group_sync_failures("gloo")));
  EXPECT_EQ(server_->job_state(), JobState::kRunning);
  // Training continues and the remaining worker keeps receiving over gloo at a
  // new epoch.
  ASSERT_TRUE(WaitFor(
      [&] {
        return a.receiver->groups_joined() >= 2 &&
               a.receiver->versions_received() > a_received_before;
      },
      60s))
      << "groups joined " << a.receiver->groups_joined();
  EXPECT_EQ(server_->job_state(), JobState::kRunning);
  {
    auto stub = v1::LearnerService::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::CancelJobRequest req;
    req.set_reason("test over");
    v1::Job job;
    ASSERT_TRUE(stub->CancelJob(&ctx, req, &job).ok());
  }
  ASSERT_TRUE(server_->WaitForJobEnd(60s));
  EXPECT_EQ(server_->job_state(), JobState::kCancelled);
  // (Bit equality of what a group delivers is TwoWorkersReceiveTheLatestVersionBitEqualOverGloo's.)
  EXPECT_GT(a.receiver->versions_received(), a_received_before);
  EXPECT_GE(a.receiver->groups_joined(), 2);
  a.thread.join();
  EXPECT_TRUE(a.result.ok()) << a.result.ToString();
}

}  // namespace
}  // namespace grpo::services
