// learner::Learner without a gRPC server (issue 14 §1): the admission arithmetic and lease
// budget by hand, registration and heartbeats, the verdicts of the ingest policy, the job state
// machine, and a kill between accepting a group and checkpointing it.
#include "learner/learner.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/counting_allocator.h"
#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "learner/admission.h"
#include "learner/worker_registry.h"
#include "tests/learner/tiny_config.h"

namespace grpo::learner {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

template <typename F>
bool WaitFor(F f, std::chrono::milliseconds limit) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return f();
}

// TinyRolloutGroup under `lease`.
common::RolloutGroup TinyGroup(const common::PromptLease& lease, int64_t policy_version,
                               const std::string& incarnation, double r0 = 1, double r1 = 0) {
  return testing::TinyRolloutGroup(lease.prompt_id, lease.lease_id, policy_version, r0, r1,
                                   incarnation);
}

// A "killed" learner: never destroyed, as a SIGKILLed process runs no destructor, and kept
// reachable to the end of the test binary, since its memory is then the kernel's to free
// (LeakSanitizer reports only what nothing points to).
void Abandon(std::unique_ptr<Learner> killed) {
  static auto* graveyard = new std::vector<std::unique_ptr<Learner>>();
  graveyard->push_back(std::move(killed));
}

std::vector<std::string> Prompts(int n) {
  std::vector<std::string> lines;
  for (int i = 0; i < n; ++i) lines.push_back(R"({"prompt": "say )" + std::to_string(i) + R"("})");
  return lines;
}

class LearnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("learner_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    config_ = testing::TinyLearnerConfig(dir_);
  }
  void TearDown() override {
    learner_.reset();
    fs::remove_all(dir_);
  }

  std::unique_ptr<Learner> Make() {
    auto model = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
    EXPECT_TRUE(model.ok());
    auto l = Learner::Create(config_, std::move(model).value(), nullptr, options_);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return l.ok() ? std::move(l).value() : nullptr;
  }
  void Start() {
    learner_ = Make();
    ASSERT_NE(learner_, nullptr);
    ASSERT_TRUE(learner_->Start().ok());
  }
  common::Registration RegisterW1() {
    common::RegisterRequest r;
    r.worker_id = "w1";
    r.weight_sync_backend = "grpc";
    auto reg = learner_->Register(r);
    EXPECT_TRUE(reg.ok()) << reg.status().ToString();
    return *reg;
  }
  std::vector<common::PromptLease> Lease(int64_t n, std::chrono::milliseconds wait = 700ms) {
    auto r = learner_->LeasePrompts("w1", n, Clock::now() + wait, {});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->leases : std::vector<common::PromptLease>{};
  }

  // Leases two prompts and pushes their groups (one generation batch) at the published version.
  void PushOneBatch() {
    const std::vector<common::PromptLease> leases = Lease(2);
    ASSERT_EQ(leases.size(), 2u);
    PushTally tally;
    for (const auto& l : leases) {
      learner_->AcceptGroup(TinyGroup(l, learner_->published_version(), learner_->incarnation()),
                            {}, &tally);
    }
    ASSERT_EQ(tally.reply.accepted, 2);
  }
  // Starts a learner whose trainer `hold` (a StepHold, below) can hold, trains the first of a
  // 4-prompt pass's two batches, then holds the trainer and pushes the second: every prompt of
  // pass 0 is accepted.
  template <typename Hold>
  void TrainAPassHoldingItsLastBatch(Hold& hold) {
    options_.TEST_micro_batch_fault = hold.Hook();
    Start();
    RegisterW1();
    ASSERT_TRUE(learner_->AddDataset("k", Prompts(4)).ok());
    PushOneBatch();
    ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 30s));
    hold.hold = true;
    PushOneBatch();
  }
  // The files of `dir`, by name.
  static std::vector<std::string> FilesIn(const fs::path& dir) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }
  static std::string Bytes(const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  fs::path dir_;
  common::GrpoConfig config_;
  LearnerOptions options_;
  std::unique_ptr<Learner> learner_;
};

TEST(Admission, GenerationBatchArithmeticAndTheLeaseBudgetByHand) {
  common::GrpoConfig c;
  c.num_generations = 2;
  c.per_device_train_batch_size = 4;
  c.gradient_accumulation_steps = 2;  // steps_per_generation defaults to it
  c.num_iterations = 2;
  EXPECT_EQ(c.GenerationBatchSize(), 8);         // 4 x steps_per_generation 2
  EXPECT_EQ(c.GenerationBatchGroups(), 4);       // 8 completions / 2
  EXPECT_EQ(c.VersionsPerGenerationBatch(), 2);  // ceil(2 / 2) x 2 passes
  c.steps_per_generation = 3;
  c.num_iterations = 1;
  EXPECT_EQ(c.GenerationBatchGroups(), 6);       // 4 x 3 / 2
  EXPECT_EQ(c.VersionsPerGenerationBatch(), 2);  // ceil(3 / 2)
  c.num_generations = 16;
  EXPECT_EQ(c.GenerationBatchGroups(), 0);  // Validate refuses it; the Learner too

  LeaseBudgetInput in;
  in.batch_groups = 4;
  in.buffer_capacity = 8;
  in.max_staleness = 0;  // one batch may be in flight: 4 groups
  in.buffered = 1;
  in.leased_out = 2;
  EXPECT_EQ(LeaseBudget(in), 1);
  in.training = true;  // the batch in training is the one allowed
  EXPECT_EQ(LeaseBudget(in), 0);
  in.training = false;
  in.max_staleness = 2;  // three batches: 12 groups
  in.buffered = 3;
  EXPECT_EQ(LeaseBudget(in), 7);
  in.versions_per_batch = 2;  // 2 / 2 = one batch ahead: 8 groups
  EXPECT_EQ(LeaseBudget(in), 3);
  in.buffered = 8;  // a full buffer
  EXPECT_EQ(LeaseBudget(in), 0);
  // A worker one version behind (max_staleness 2, one version a batch): its groups may wait
  // one batch less, two batches of 4 = 8 groups; two behind: the next batch only; three: none
  // (every group of it would be stale).
  in.versions_per_batch = 1;
  in.buffered = 3;
  in.worker_lag = 1;
  EXPECT_EQ(LeaseBudget(in), 8 - 3 - 2);
  in.worker_lag = 2;
  EXPECT_EQ(LeaseBudget(in), 0);  // 4 - 3 - 2 < 0
  in.buffered = 0;
  in.leased_out = 0;
  EXPECT_EQ(LeaseBudget(in), 4);
  in.training = true;  // the next batch is the one in training
  EXPECT_EQ(LeaseBudget(in), 0);
  in.training = false;
  in.worker_lag = 3;
  EXPECT_EQ(LeaseBudget(in), 0);
  // A worker that says a version newer than the published one (a bogus hint, or a race with a
  // publish) gets an up-to-date worker's budget, never more: 3 batches of 4, not 8.
  in.buffer_capacity = 100;
  in.worker_lag = 0;
  EXPECT_EQ(LeaseBudget(in), 12);
  in.worker_lag = -5;
  EXPECT_EQ(LeaseBudget(in), 12);
}

TEST(WorkerRegistry, RanksStayDenseInRegistrationOrderAndRostersFollowTheBackend) {
  WorkerRegistry reg;
  const auto t0 = Clock::now();
  auto a = reg.Register("", "h", 1, "auto", "gloo", t0);
  EXPECT_EQ(a.worker_id, "worker-1");
  EXPECT_EQ(a.rank, 1);
  EXPECT_TRUE(a.is_new);
  reg.Register("worker-2", "h", 2, "gloo", "gloo", t0);  // takes the next generated id's name
  auto c = reg.Register("", "h", 3, "grpc", "grpc", t0);
  EXPECT_EQ(c.worker_id, "worker-3");  // worker-2 was taken
  EXPECT_EQ(c.rank, 3);
  auto d = reg.Register("d", "h", 4, "gloo", "gloo", t0 + 10s);
  EXPECT_EQ(d.rank, 4);
  auto again = reg.Register("worker-1", "h", 5, "auto", "nccl", t0 + 10s);
  EXPECT_FALSE(again.is_new);
  EXPECT_TRUE(again.backend_changed);
  EXPECT_EQ(again.rank, 1);
  EXPECT_EQ(reg.Members("gloo"), (std::vector<std::string>{"worker-2", "d"}));
  EXPECT_TRUE(reg.AnyAssigned({"nccl", "cuda_ipc"}));
  EXPECT_TRUE(reg.Heartbeat("worker-3", 7, t0 + 10s));
  EXPECT_FALSE(reg.Heartbeat("nobody", 7, t0 + 10s));
  // worker-2 was last seen at t0: dropped; d moves from rank 4 to 3, worker-3 from 3 to 2.
  EXPECT_EQ(reg.DropSilentSince(t0 + 5s), (std::vector<std::string>{"worker-2"}));
  EXPECT_EQ(reg.size(), 3);
  EXPECT_EQ(reg.Find("worker-1")->rank, 1);
  EXPECT_EQ(reg.Find("worker-3")->rank, 2);
  EXPECT_EQ(reg.Find("worker-3")->weight_version, 7);
  EXPECT_EQ(reg.Find("d")->rank, 3);
  EXPECT_EQ(reg.Members("gloo"), (std::vector<std::string>{"d"}));
  EXPECT_FALSE(reg.Contains("worker-2"));
  EXPECT_TRUE(reg.DropSilentSince(t0).empty());
}

// Issue 22 item 2: a worker that stalled a collective (no heartbeat since the cutoff) leaves
// the roster until its next heartbeat or Register; live ones and other backends stay.
TEST(WorkerRegistry, AStalledMemberLeavesTheRosterUntilItHeartbeatsAgain) {
  WorkerRegistry reg;
  const auto t0 = Clock::now();
  reg.Register("a", "h", 1, "gloo", "gloo", t0);
  reg.Register("b", "h", 2, "gloo", "gloo", t0);
  reg.Register("c", "h", 3, "gloo", "gloo", t0);
  EXPECT_TRUE(reg.Heartbeat("a", 1, t0 + 4s));  // a and c heartbeat; b is stopped
  EXPECT_TRUE(reg.Heartbeat("c", 1, t0 + 4s));
  EXPECT_EQ(reg.SuspendSilentSince({"a", "b", "c"}, t0 + 3s), (std::vector<std::string>{"b"}));
  EXPECT_EQ(reg.Members("gloo"), (std::vector<std::string>{"a", "c"}));
  EXPECT_TRUE(reg.Find("b")->suspended);
  EXPECT_EQ(reg.size(), 3);  // still registered: its leases and rank stay
  // Suspending again changes nothing and names nobody.
  EXPECT_TRUE(reg.SuspendSilentSince({"a", "b", "c"}, t0 + 3s).empty());
  EXPECT_TRUE(reg.Heartbeat("b", 1, t0 + 9s));
  EXPECT_EQ(reg.Members("gloo"), (std::vector<std::string>{"a", "b", "c"}));
  // A Register ends a suspension too.
  EXPECT_EQ(reg.SuspendSilentSince({"c"}, t0 + 5s), (std::vector<std::string>{"c"}));
  reg.Register("c", "h", 4, "gloo", "gloo", t0 + 10s);
  EXPECT_EQ(reg.Members("gloo"), (std::vector<std::string>{"a", "b", "c"}));
}

TEST_F(LearnerTest, RegistrationHeartbeatsAndBadLeaseCalls) {
  Start();
  common::RegisterRequest r;
  r.weight_sync_backend = "grpc";
  auto first = learner_->Register(r);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->worker_id, "worker-1");
  EXPECT_EQ(first->rank, 1);
  EXPECT_EQ(first->world_size, 2);
  EXPECT_EQ(first->group_epoch, 2);  // epoch 1 ended: the group gained a rank
  EXPECT_EQ(first->weight_sync_backend, "grpc");
  EXPECT_EQ(first->learner_incarnation, learner_->incarnation());
  const common::Registration w1 = RegisterW1();
  EXPECT_EQ(w1.rank, 2);
  EXPECT_EQ(w1.group_epoch, 3);
  r.worker_id = "w1";
  auto again = learner_->Register(r);  // the same worker again: same rank, same epoch
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->rank, 2);
  EXPECT_EQ(again->group_epoch, 3);

  common::HeartbeatRequest hb;
  hb.worker_id = "w1";
  auto beat = learner_->Heartbeat(hb);
  ASSERT_TRUE(beat.ok());
  EXPECT_EQ(beat->group_epoch, 3);
  EXPECT_FALSE(beat->shutdown);
  hb.worker_id = "nobody";
  EXPECT_EQ(learner_->Heartbeat(hb).status().code(), StatusCode::kNotFound);

  const auto soon = Clock::now() + 1s;
  EXPECT_EQ(learner_->LeasePrompts("nobody", 1, soon, {}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(learner_->LeasePrompts("", 1, soon, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(learner_->LeasePrompts("w1", 0, soon, {}).status().code(),
            StatusCode::kInvalidArgument);
  auto none = learner_->LeasePrompts("w1", 5, soon, {});  // no dataset yet
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->leases.empty());
  EXPECT_EQ(none->retry_after_ms, kDefaultLeaseRetryAfter.count());
}

// max_staleness 1, one version per batch, 2 groups per batch: 2 x 2 = 4 groups may be out.
TEST_F(LearnerTest, TheLeaseBudgetBoundsWhatIsOut) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(10)).ok());
  EXPECT_EQ(Lease(100).size(), 4u);
  const auto t0 = Clock::now();
  EXPECT_TRUE(Lease(100, 700ms).empty());  // a long poll until 500 ms before the deadline
  EXPECT_GE(Clock::now() - t0, 150ms);
  EXPECT_EQ(learner_->TEST_ledger().Counts()->leased, 4);
}

// A dataset of one batch: each pass is one step. A lease asked while the pass's last batch is
// pushed (nothing queued, the next pass not started yet) waits for the next pass and takes its
// prompts, instead of an empty reply that sends the worker to sleep for retry_after_ms: on a
// small dataset that sleep was most of a step (`grpo demo`: 0.27 s a pass against 0.04 s a
// step). The ledger says which pass the leases are of.
TEST_F(LearnerTest, ALeaseAskedAtAPasssEndTakesTheNextPasssPrompts) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(2)).ok());
  for (int pass = 0; pass < 3; ++pass) {
    SCOPED_TRACE("pass " + std::to_string(pass));
    const std::vector<common::PromptLease> leases = Lease(2, 5s);
    ASSERT_EQ(leases.size(), 2u);
    EXPECT_EQ(learner_->TEST_ledger().Counts()->pass, pass);
    PushTally tally;
    for (const auto& l : leases) {
      learner_->AcceptGroup(TinyGroup(l, learner_->published_version(), learner_->incarnation()),
                            {}, &tally);
    }
    ASSERT_EQ(tally.reply.accepted, 2);
  }
}

// The step that trains a pass's last batch starts the next pass as it ends (housekeeping at
// once, not kHousekeepInterval after the last): measured from the step's end, the next pass's
// prompts are queued within a fraction of that interval, with no lease asking for them.
TEST_F(LearnerTest, TheStepThatEndsAPassStartsTheNextOne) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(2)).ok());
  PushOneBatch();
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 30s));
  const auto stepped = Clock::now();
  ASSERT_TRUE(WaitFor([&] { return learner_->TEST_ledger().Counts()->queued == 2; }, 10s));
  EXPECT_LT(Clock::now() - stepped, kHousekeepInterval / 2);
  EXPECT_EQ(learner_->TEST_ledger().Counts()->pass, 1);
}

// Holds the trainer inside the micro-batches of every step from Hold() until Release(): the
// learner's training thread (which also runs housekeeping) stays in that step.
struct StepHold {
  std::atomic<bool> hold{false};
  std::atomic<bool> entered{false};
  std::function<Status(int64_t)> Hook() {
    return [this](int64_t) {
      while (hold.load()) {
        entered = true;
        std::this_thread::sleep_for(1ms);
      }
      return Status::OK();
    };
  }
};

// A pass whose prompts are all accepted starts the next one before its last batch trains: the
// workers generate the next pass's first groups while that batch trains. A pass of 2 batches;
// the second is pushed while the trainer is held, so its step cannot end: the next pass's 4
// prompts are queued anyway, and the held step is still the second.
TEST_F(LearnerTest, APassWhosePromptsAreAllAcceptedStartsTheNextBeforeItsLastBatchTrains) {
  StepHold hold;
  TrainAPassHoldingItsLastBatch(hold);
  if (HasFatalFailure()) return;
  EXPECT_TRUE(WaitFor(
      [&] {
        auto c = learner_->TEST_ledger().Counts();
        return c.ok() && c->pass == 1 && c->queued == 4;
      },
      5s))
      << "pass 1 did not start while pass 0's last batch was held";
  EXPECT_EQ(learner_->Snapshot().global_step, 1);
  ASSERT_TRUE(WaitFor([&] { return hold.entered.load(); }, 10s));
  hold.hold = false;
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 2; }, 30s));
  // Pass 0's two steps trained its 4 prompts, each once.
  auto trainings = learner_->TEST_ledger().Trainings();
  ASSERT_TRUE(trainings.ok());
  ASSERT_EQ(trainings->size(), 4u);
  for (const auto& t : *trainings) EXPECT_EQ(t.pass, 0) << t.prompt_id;
}

// ... unless the buffered batches already take the job to max_steps: then no next pass is
// generated only to be dropped. max_steps 2: the second batch is the job's last.
TEST_F(LearnerTest, NoNextPassWhenTheBufferedBatchesReachMaxSteps) {
  config_.max_steps = 2;
  StepHold hold;
  TrainAPassHoldingItsLastBatch(hold);
  if (HasFatalFailure()) return;
  // Housekeeping ran before the held step was taken (a batch was ready): it left pass 0 open.
  ASSERT_TRUE(WaitFor([&] { return hold.entered.load(); }, 10s));
  EXPECT_EQ(learner_->TEST_ledger().Counts()->pass, 0);
  hold.hold = false;
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().state == JobState::kDone; }, 30s));
  EXPECT_EQ(learner_->TEST_ledger().Counts()->pass, 0);
  EXPECT_EQ(learner_->Snapshot().global_step, 2);
}

// A worker that says it starts its groups with an older version than the published one gets the
// budget of groups that much staler: at version 1 with max_staleness 1 and batches of 2 groups,
// a worker still at 0 may fill the next batch only (2 groups), one at 1 two batches (4).
TEST_F(LearnerTest, ALaggingWorkersLeaseBudgetCountsItsLag) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(12)).ok());
  PushOneBatch();
  ASSERT_TRUE(WaitFor([&] { return learner_->published_version() == 1; }, 30s));
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 10s));
  const auto lease = [&](int64_t max, int64_t worker_version) {
    auto r = learner_->LeasePrompts("w1", max, Clock::now() + 2s, {}, worker_version);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->leases.size() : 0u;
  };
  // Up to date: 2 (of 4, or of 2 while the step's batch still trains).
  EXPECT_EQ(lease(2, /*worker_version=*/1), 2u);
  // Behind: the next batch is the 2 out. Answered at once, not long-polled (1.5 s here): it
  // should take version 1 first.
  const auto t0 = Clock::now();
  EXPECT_EQ(lease(100, /*worker_version=*/0), 0u);
  EXPECT_LT(Clock::now() - t0, 500ms) << "a worker behind the published version was long-polled";
  EXPECT_EQ(lease(100, /*worker_version=*/1), 2u) << "two batches' share, 2 already out";
}

TEST_F(LearnerTest, TheIngestPolicysVerdicts) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(10)).ok());
  const std::vector<common::PromptLease> leases = Lease(4);
  ASSERT_EQ(leases.size(), 4u);
  const std::string inc = learner_->incarnation();
  PushTally tally;
  common::PromptLease bogus = leases[0];
  bogus.lease_id = "not-a-lease";
  learner_->AcceptGroup(TinyGroup(bogus, 0, inc), {}, &tally);
  learner_->AcceptGroup(TinyGroup(leases[0], 0, "another-learner"), {}, &tally);
  learner_->AcceptGroup(TinyGroup(leases[1], 5, inc), {}, &tally);  // a version not published
  EXPECT_EQ(tally.reply.accepted, 0);
  EXPECT_EQ(tally.reply.rejected, 3);
  EXPECT_EQ(tally.reply.rejected_by_reason["unknown_lease"], 1);
  EXPECT_EQ(tally.reply.rejected_by_reason["unknown_policy"], 2);
  EXPECT_EQ(tally.reply.messages.size(), 3u);
  // unknown_policy released both leases: they are queued again.
  EXPECT_EQ(learner_->TEST_ledger().Counts()->leased, 2);
  // Two good groups make a generation batch: one optimizer step.
  PushTally good;
  learner_->AcceptGroup(TinyGroup(leases[2], 0, inc), {}, &good);
  learner_->AcceptGroup(TinyGroup(leases[3], 0, inc, 0, 1), {}, &good);
  EXPECT_EQ(good.reply.accepted, 2);
  EXPECT_EQ(good.reply.rejected, 0);
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 30s));
  EXPECT_TRUE(WaitFor([&] { return learner_->published_version() == 1; }, 10s));
  // The lease was completed: a second push of it is unknown_lease.
  PushTally twice;
  learner_->AcceptGroup(TinyGroup(leases[2], 0, inc), {}, &twice);
  EXPECT_EQ(twice.reply.rejected_by_reason["unknown_lease"], 1);
  EXPECT_EQ(learner_->RefusedCounts()["unknown_policy"], 2);
}

// A group the worker could not generate (RolloutGroup::failure: its environment failed) gives
// its lease back: refused as worker_failed, the prompt queued again at once (not when the lease
// expires) with its attempts unchanged, and never rejected for it, however often it fails
// (kMaxBadGroupAttempts bounds bad groups, not failures). A failure under a lease that is not
// the prompt's current one touches nothing.
TEST_F(LearnerTest, AFailedGroupGivesItsLeaseBackAtOnceAndNeverRejectsThePrompt) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(2)).ok());
  const std::string inc = learner_->incarnation();
  for (int round = 0; round < kMaxBadGroupAttempts + 2; ++round) {
    const std::vector<common::PromptLease> leases = Lease(2);
    ASSERT_EQ(leases.size(), 2u) << "round " << round << ": the prompts were not queued again";
    EXPECT_EQ(learner_->TEST_ledger().Counts()->leased, 2);
    PushTally tally;
    for (const common::PromptLease& l : leases) {
      common::RolloutGroup failed;
      failed.lease_id = l.lease_id;
      failed.prompt_id = l.prompt_id;
      failed.policy_incarnation = inc;
      failed.failure = "UNAVAILABLE: episode 0 of turns: reset: connection refused";
      learner_->AcceptGroup(failed, {}, &tally);
    }
    EXPECT_EQ(tally.reply.accepted, 0);
    EXPECT_EQ(tally.reply.rejected_by_reason["worker_failed"], 2);
    ASSERT_FALSE(tally.reply.messages.empty());
    EXPECT_NE(tally.reply.messages[0].find("connection refused"), std::string::npos);
    const auto counts = learner_->TEST_ledger().Counts();
    EXPECT_EQ(counts->queued, 2) << "round " << round;
    EXPECT_EQ(counts->leased, 0);
    EXPECT_EQ(counts->rejected, 0);
    for (const common::PromptLease& l : leases) {
      EXPECT_EQ(learner_->TEST_ledger().GetPrompt(l.prompt_id)->attempts, 0);
    }
  }
  // Under a lease that is no longer the prompt's: unknown_lease, the ledger untouched.
  const std::vector<common::PromptLease> leases = Lease(1);
  ASSERT_EQ(leases.size(), 1u);
  common::RolloutGroup stale;
  stale.lease_id = "an-old-lease";
  stale.prompt_id = leases[0].prompt_id;
  stale.policy_incarnation = inc;
  stale.failure = "DEADLINE_EXCEEDED: step";
  PushTally tally;
  learner_->AcceptGroup(stale, {}, &tally);
  EXPECT_EQ(tally.reply.rejected_by_reason["unknown_lease"], 1);
  EXPECT_EQ(learner_->TEST_ledger().Counts()->leased, 1);
  EXPECT_EQ(learner_->RefusedCounts()["worker_failed"], 2 * (kMaxBadGroupAttempts + 2));
}

// A group whose prompt itself failed on the worker (RolloutGroup::prompt_failed: too long with
// truncate_prompt=reject) would fail on every worker: the prompt is REJECTED at once, with the
// failure as its reason, instead of being leased again forever (which held the pass boundary).
TEST_F(LearnerTest, AGroupWhosePromptFailedRejectsThePromptAtOnce) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(2)).ok());
  const std::vector<common::PromptLease> leases = Lease(2);
  ASSERT_EQ(leases.size(), 2u);
  common::RolloutGroup failed;
  failed.lease_id = leases[0].lease_id;
  failed.prompt_id = leases[0].prompt_id;
  failed.policy_incarnation = learner_->incarnation();
  failed.failure = "INVALID_ARGUMENT: prompt 0: 300 tokens > max_prompt_length 256";
  failed.prompt_failed = true;
  PushTally tally;
  learner_->AcceptGroup(failed, {}, &tally);
  EXPECT_EQ(tally.reply.rejected_by_reason["prompt_failed"], 1);
  const auto counts = learner_->TEST_ledger().Counts();
  EXPECT_EQ(counts->rejected, 1);
  EXPECT_EQ(counts->leased, 1);
  EXPECT_EQ(counts->queued, 0);
  const auto record = learner_->TEST_ledger().GetPrompt(leases[0].prompt_id);
  ASSERT_TRUE(record.ok());
  EXPECT_EQ(record->state, PromptState::kRejected);
  EXPECT_NE(record->reject_reason.find("max_prompt_length 256"), std::string::npos)
      << record->reject_reason;
}

// Dynamic sampling (learner/dynamic_sampling.h): groups whose rewards are all equal are
// filtered at ingest (FILTERED in the ledger, counted, not buffered), their lease budget goes to
// more prompts, and the batch that fills up says what it cost.
TEST_F(LearnerTest, DynamicSamplingFiltersGroupsWithoutASignalAndLeasesMore) {
  config_.dynamic_sampling = true;
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(6)).ok());
  const std::vector<common::PromptLease> leases = Lease(100);
  ASSERT_EQ(leases.size(), 4u);  // the budget: two batches of two groups (max_staleness 1)
  const std::string inc = learner_->incarnation();
  PushTally tally;
  learner_->AcceptGroup(TinyGroup(leases[0], 0, inc, 1, 1), {}, &tally);  // all right
  learner_->AcceptGroup(TinyGroup(leases[1], 0, inc, 0, 0), {}, &tally);  // all wrong
  EXPECT_EQ(tally.reply.filtered, 2);
  EXPECT_EQ(tally.reply.accepted, 0);
  EXPECT_EQ(tally.reply.rejected, 0);
  for (int i : {0, 1}) {
    auto r = learner_->TEST_ledger().GetPrompt(leases[i].prompt_id);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->state, PromptState::kFiltered) << leases[i].prompt_id;
  }
  EXPECT_EQ(learner_->metrics().groups_filtered->Value(), 2);
  EXPECT_EQ(learner_->Snapshot().filtered, 2);
  // Their budget is free: two more prompts go out, and no filtered one is among them.
  const std::vector<common::PromptLease> more = Lease(100);
  ASSERT_EQ(more.size(), 2u);
  for (const auto& l : more) {
    EXPECT_NE(l.prompt_id, leases[0].prompt_id);
    EXPECT_NE(l.prompt_id, leases[1].prompt_id);
  }
  // Two groups with a signal fill the batch: one step, which says 2 were filtered for it and
  // ceil((2 + 2) / 2) = 2 batches' worth of groups arrived.
  PushTally good;
  learner_->AcceptGroup(TinyGroup(leases[2], 0, inc, 1, 0), {}, &good);
  learner_->AcceptGroup(TinyGroup(leases[3], 0, inc, 0, 1), {}, &good);
  EXPECT_EQ(good.reply.accepted, 2);
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 30s));
  const auto metrics = learner_->Snapshot().last_metrics;
  EXPECT_EQ(metrics.at("dynamic_sampling/groups_filtered"), 2);
  EXPECT_EQ(metrics.at("dynamic_sampling/num_gen_batches"), 2);
  EXPECT_EQ(metrics.at("dynamic_sampling/short_batch"), 0);
  EXPECT_EQ(metrics.at("frac_reward_zero_std"), 0) << "only groups with a signal were trained";
  EXPECT_EQ(learner_->metrics().short_batches->Value(), 0);
}

// max_num_gen_batches 1: once a batch's worth of groups arrived (one trained, one filtered), the
// learner trains the one it has instead of waiting for more.
TEST_F(LearnerTest, AfterMaxNumGenBatchesTheBatchTrainsShort) {
  config_.dynamic_sampling = true;
  config_.max_num_gen_batches = 1;
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(4)).ok());
  const std::vector<common::PromptLease> leases = Lease(2);
  ASSERT_EQ(leases.size(), 2u);
  const std::string inc = learner_->incarnation();
  PushTally tally;
  learner_->AcceptGroup(TinyGroup(leases[0], 0, inc, 1, 0), {}, &tally);
  EXPECT_FALSE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 300ms))
      << "one group of a batch of two, nothing filtered: no step yet";
  learner_->AcceptGroup(TinyGroup(leases[1], 0, inc, 0.5, 0.5), {}, &tally);
  EXPECT_EQ(tally.reply.accepted, 1);
  EXPECT_EQ(tally.reply.filtered, 1);
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 30s));
  const auto metrics = learner_->Snapshot().last_metrics;
  EXPECT_EQ(metrics.at("dynamic_sampling/short_batch"), 1);
  EXPECT_EQ(metrics.at("dynamic_sampling/groups_filtered"), 1);
  EXPECT_EQ(metrics.at("dynamic_sampling/num_gen_batches"), 1);
  EXPECT_EQ(learner_->metrics().short_batches->Value(), 1);
  auto trainings = learner_->TEST_ledger().Trainings();
  ASSERT_TRUE(trainings.ok());
  ASSERT_EQ(trainings->size(), 2u);
  for (const auto& t : *trainings) {
    EXPECT_EQ(t.filtered, t.prompt_id == leases[1].prompt_id) << t.prompt_id;
    if (!t.filtered) {
      EXPECT_EQ(t.step, 1);
    }
  }
}

TEST_F(LearnerTest, TheJobStateMachine) {
  config_.max_steps = 1;
  Start();
  EXPECT_EQ(learner_->Snapshot().state, JobState::kWaitingForData);
  auto sub = learner_->Subscribe();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(4)).ok());
  ASSERT_TRUE(WaitFor([&] { return learner_->job_state() == JobState::kRunning; }, 10s));
  const std::vector<common::PromptLease> leases = Lease(2);
  ASSERT_EQ(leases.size(), 2u);
  PushTally tally;
  for (const auto& l : leases) {
    learner_->AcceptGroup(TinyGroup(l, 0, learner_->incarnation()), {}, &tally);
  }
  ASSERT_TRUE(learner_->WaitForJobEnd(30s));
  const JobSnapshot done = learner_->Snapshot();
  EXPECT_EQ(done.state, JobState::kDone);
  EXPECT_EQ(done.message, "max_steps reached");
  EXPECT_EQ(done.global_step, 1);
  EXPECT_EQ(done.max_steps, 1);
  EXPECT_EQ(done.workers, 1);
  EXPECT_EQ(done.trained, 2);  // the two groups the step holds (its checkpoint was saved)
  // The events said so, in order: running, the step (with metrics), done.
  std::deque<JobEvent> events, more;
  ASSERT_TRUE(WaitFor(
      [&] {
        (void)learner_->NextEvents(*sub, 10ms, nullptr, &more);
        events.insert(events.end(), more.begin(), more.end());
        more.clear();
        return !events.empty() && events.back().job.state == JobState::kDone;
      },
      10s));
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.front().job.state, JobState::kRunning);
  bool step_event = false;
  for (const auto& e : events) step_event = step_event || (e.step == 1 && !e.metrics.empty());
  EXPECT_TRUE(step_event);
  // After the end: nothing more is leased, heartbeats say shut down, a cancel changes nothing.
  auto after = learner_->LeasePrompts("w1", 2, Clock::now() + 1s, {});
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->job_done);
  common::HeartbeatRequest hb;
  hb.worker_id = "w1";
  EXPECT_TRUE(learner_->Heartbeat(hb)->shutdown);
  learner_->Cancel("too late");
  EXPECT_EQ(learner_->job_state(), JobState::kDone);
  learner_->Unsubscribe(sub);
}

TEST_F(LearnerTest, ACancelEndsTheJobAndIsTerminal) {
  Start();
  RegisterW1();
  learner_->Cancel("");
  EXPECT_EQ(learner_->job_state(), JobState::kCancelled);
  EXPECT_EQ(learner_->Snapshot().message, "cancelled by a client");
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(2)).ok());
  EXPECT_TRUE(learner_->LeasePrompts("w1", 2, Clock::now() + 1s, {})->job_done);
}

// A learner killed after it accepted a group (the prompt is TRAINED: accepted) and before any
// checkpoint holds it: the next learner on the same directory gives the prompt back.
TEST_F(LearnerTest, AKillBetweenAcceptAndCheckpointRequeuesTheGroup) {
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(3)).ok());
  const std::vector<common::PromptLease> leases = Lease(1);
  ASSERT_EQ(leases.size(), 1u);
  PushTally tally;
  learner_->AcceptGroup(TinyGroup(leases[0], 0, learner_->incarnation()), {}, &tally);
  ASSERT_EQ(tally.reply.accepted, 1);  // one of a batch of two: buffered, not trained
  auto accepted = learner_->TEST_ledger().GetPrompt(leases[0].prompt_id);
  ASSERT_TRUE(accepted.ok());
  EXPECT_EQ(accepted->state, PromptState::kTrained);
  // The kill: the threads stop and the process ends without its job-end bookkeeping (a
  // killed process runs no destructor, so the object is never destroyed).
  ASSERT_TRUE(learner_->Stop(/*checkpoint=*/false).ok());
  Abandon(std::move(learner_));
  std::unique_ptr<Learner> next = Make();
  ASSERT_NE(next, nullptr);
  auto back = next->TEST_ledger().GetPrompt(leases[0].prompt_id);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->state, PromptState::kQueued);
  const auto counts = next->TEST_ledger().Counts();
  EXPECT_EQ(counts->queued, 3);
  EXPECT_EQ(counts->trained, 0);
  EXPECT_EQ(next->Snapshot().global_step, 0);
}

// README "Batch dumps": a restarted learner redoes the steps after its checkpoint, so the dead
// learner's dumps of those steps go when it restores (a reader would otherwise see a step of the
// dead learner, or rows twice); the steps its checkpoint holds are history and stay untouched.
TEST_F(LearnerTest, ARestartRemovesTheDumpsOfStepsItsCheckpointDoesNotHold) {
  const fs::path dumps = dir_ / "dumps";
  config_.dump_batches_dir = dumps.string();
  config_.save_steps = 2;
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(10)).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    PushOneBatch();
    ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == step; }, 30s)) << step;
  }
  ASSERT_EQ(FilesIn(dumps),
            (std::vector<std::string>{"step-00000001.safetensors", "step-00000002.safetensors",
                                      "step-00000003.safetensors"}));
  const std::string step1 = Bytes(dumps / "step-00000001.safetensors");
  const std::string step2 = Bytes(dumps / "step-00000002.safetensors");
  // The kill after step 3, before its checkpoint (as in AKillBetweenAcceptAndCheckpoint...).
  ASSERT_TRUE(learner_->Stop(/*checkpoint=*/false).ok());
  Abandon(std::move(learner_));
  std::unique_ptr<Learner> next = Make();
  ASSERT_NE(next, nullptr);
  ASSERT_EQ(next->Snapshot().global_step, 2);  // restored checkpoint-2
  EXPECT_EQ(FilesIn(dumps),
            (std::vector<std::string>{"step-00000001.safetensors", "step-00000002.safetensors"}));
  EXPECT_EQ(Bytes(dumps / "step-00000001.safetensors"), step1);
  EXPECT_EQ(Bytes(dumps / "step-00000002.safetensors"), step2);
}

// A learner stopped (SIGTERM) inside an optimizer step takes the step short and saves it: the
// step is in the history, so its dump is `step-<8 digits>.safetensors` with the rows it took.
TEST_F(LearnerTest, AStopInsideAStepDumpsTheFlushedStep) {
  const fs::path dumps = dir_ / "dumps";
  config_.dump_batches_dir = dumps.string();
  config_.gradient_accumulation_steps = 2;  // a step is two generation batches of one
  config_.steps_per_generation = 1;         // micro-batch (2 groups of 2) each
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(4)).ok());
  PushOneBatch();
  // Trained into the open step 1 (the ledger records its groups under the step to come).
  ASSERT_TRUE(WaitFor(
      [&] {
        auto trainings = learner_->TEST_ledger().Trainings();
        return trainings.ok() && trainings->size() == 2u;
      },
      30s));
  EXPECT_EQ(learner_->Snapshot().global_step, 0);
  ASSERT_TRUE(learner_->Stop(/*checkpoint=*/true).ok());
  EXPECT_EQ(learner_->Snapshot().global_step, 1);
  EXPECT_TRUE(fs::exists(dir_ / "checkpoint-1"));
  ASSERT_EQ(FilesIn(dumps), (std::vector<std::string>{"step-00000001.safetensors"}));
  auto f = common::SafetensorsFile::Open((dumps / "step-00000001.safetensors").string());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto ids = (*f)->Get("completion_ids");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(0), 4);  // the 2 groups of 2 it took
  EXPECT_EQ(nlohmann::json::parse((*f)->metadata().at("metrics"))["micro_batches"], 1);
}

// ---------------------------------------------------------------------------------------------
// weight_publish: stream (README "Weight sync"): no copy of the weights is kept; GetWeights
// readers are served by the training thread from the policy itself.

// Every tensor a ReadWeights hands out, copied, and the versions it named.
struct ReadResult {
  Status status;
  std::vector<int64_t> versions;
  common::NamedTensors tensors;
};
ReadResult ReadAll(Learner& learner, int64_t min_version) {
  ReadResult r;
  r.status = learner.ReadWeights(min_version, nullptr, "", [&](const WeightPiece& p) {
    r.versions.push_back(p.version);
    r.tensors.emplace_back(p.name, p.tensor.clone());
    return true;
  });
  return r;
}

// The snapshot a learner publishes at Start is a whole copy of the model in the CPU
// allocator's live bytes (the counter sees it); a streaming learner holds nothing for it, and
// serving a reader allocates nothing either (the CPU policy's own tensors are handed out).
TEST_F(LearnerTest, AStreamingLearnerKeepsNoCopyOfItsWeights) {
  auto model = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
  ASSERT_TRUE(model.ok());
  int64_t whole = 0;
  for (const at::Tensor& p : (*model)->Parameters()) whole += p.nbytes();
  for (const std::string mode : {"snapshot", "stream"}) {
    SCOPED_TRACE(mode);
    config_ = testing::TinyLearnerConfig(dir_ / mode);
    config_.weight_publish = mode;
    learner_ = Make();
    ASSERT_NE(learner_, nullptr);
    common::CountingScope counting;
    common::CountingCpuAllocator& allocator = common::CountingCpuAllocator::Get();
    const int64_t before = allocator.Reset();
    ASSERT_TRUE(learner_->Start().ok());
    const int64_t held = allocator.live() - before;
    const int64_t reading = allocator.Reset();
    int64_t pieces = 0;
    ASSERT_TRUE(learner_
                    ->ReadWeights(0, nullptr, "",
                                  [&](const WeightPiece&) {
                                    ++pieces;
                                    return true;
                                  })
                    .ok());
    const int64_t read_peak = allocator.peak() - reading;
    EXPECT_EQ(pieces, static_cast<int64_t>((*model)->NamedParameters().size()));
    if (mode == "snapshot") {
      EXPECT_GE(held, whole);
    } else {
      EXPECT_LT(held, whole / 10) << "the whole weights are " << whole << " bytes";
      EXPECT_LT(read_peak, whole / 10);
    }
    learner_.reset();
  }
}

// What a streaming learner serves is what a snapshot learner of the same run publishes: the
// initial model at version 0 (a fresh model of the same seed), and after a step the same
// trained weights, bit for bit, at version 1.
TEST_F(LearnerTest, StreamedWeightsEqualTheSnapshotsOfTheSameRun) {
  auto fresh = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
  ASSERT_TRUE(fresh.ok());
  std::map<std::string, ReadResult> at0, at1;
  for (const std::string mode : {"snapshot", "stream"}) {
    SCOPED_TRACE(mode);
    config_ = testing::TinyLearnerConfig(dir_ / mode);
    config_.weight_publish = mode;
    Start();
    at0[mode] = ReadAll(*learner_, 0);
    RegisterW1();
    ASSERT_TRUE(learner_->AddDataset("k", Prompts(4)).ok());
    PushOneBatch();
    ASSERT_TRUE(WaitFor([&] { return learner_->published_version() == 1; }, 30s));
    at1[mode] = ReadAll(*learner_, 1);
    learner_.reset();
  }
  const auto initial = (*fresh)->NamedParameters();
  for (const std::string mode : {"snapshot", "stream"}) {
    SCOPED_TRACE(mode);
    ASSERT_TRUE(at0[mode].status.ok()) << at0[mode].status.ToString();
    ASSERT_TRUE(at1[mode].status.ok()) << at1[mode].status.ToString();
    ASSERT_EQ(at0[mode].tensors.size(), initial.size());
    for (size_t i = 0; i < initial.size(); ++i) {
      EXPECT_EQ(at0[mode].tensors[i].first, initial[i].first);
      EXPECT_TRUE(at::equal(at0[mode].tensors[i].second, initial[i].second)) << initial[i].first;
      EXPECT_EQ(at0[mode].versions[i], 0);
      EXPECT_EQ(at1[mode].versions[i], 1);
    }
  }
  const auto& snap = at1["snapshot"].tensors;
  const auto& streamed = at1["stream"].tensors;
  ASSERT_EQ(snap.size(), streamed.size());
  int moved = 0;
  for (size_t i = 0; i < snap.size(); ++i) {
    EXPECT_EQ(streamed[i].first, snap[i].first);
    EXPECT_TRUE(at::equal(streamed[i].second, snap[i].second)) << snap[i].first;
    if (!at::equal(snap[i].second, initial[i].second)) ++moved;
  }
  EXPECT_GT(moved, 0) << "the step must have changed the weights compared";
}

// With weight_sync_steps 2 the weights after step 1 are no published version. A reader that
// asks then, with no batch ready to train, gets step 1 published and served (it may be the
// worker that would fill the next batch); the learner does not wait for step 2.
TEST_F(LearnerTest, AStreamingLearnerPublishesForAReaderWhenNoBatchIsReady) {
  config_.weight_publish = "stream";
  config_.weight_sync_steps = 2;
  Start();
  RegisterW1();
  ASSERT_TRUE(learner_->AddDataset("k", Prompts(4)).ok());
  PushOneBatch();
  ASSERT_TRUE(WaitFor([&] { return learner_->Snapshot().global_step == 1; }, 30s));
  EXPECT_EQ(learner_->published_version(), 0);
  const ReadResult r = ReadAll(*learner_, 0);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_FALSE(r.versions.empty());
  EXPECT_EQ(r.versions.front(), 1);
  EXPECT_EQ(learner_->published_version(), 1);
  // Those are the policy's weights now (training is idle).
  const auto live = learner_->policy().NamedParameters();
  ASSERT_EQ(r.tensors.size(), live.size());
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_TRUE(at::equal(r.tensors[i].second, live[i].second)) << live[i].first;
  }
}

}  // namespace
}  // namespace grpo::learner
