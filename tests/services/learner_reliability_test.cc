// Issue 12 against an in-process LearnerServer: each test reproduces one broken invariant of
// the issue (it failed before the fix) and checks the state the ledger, the checkpoints and the
// wire must show instead. Expectations are derived from the inputs (how many prompts, which
// were pushed, what the batch size makes trainable), never from the learner's own output.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "learner/checkpoint.h"
#include "services/learner_client.h"
#include "tests/services/learner_fixture.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using learner::PromptState;
using std::chrono::milliseconds;
using testing::kCallTimeout;
using testing::LearnerServiceTest;

class LearnerReliabilityTest : public LearnerServiceTest {
 protected:
  // Ledger trainings of `prompt_id`, by pass.
  std::multiset<int64_t> TrainedPasses(const std::string& prompt_id) {
    std::multiset<int64_t> passes;
    auto t = server_->TEST_ledger().Trainings();
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    if (t.ok()) {
      for (const auto& r : *t) {
        if (r.prompt_id == prompt_id) passes.insert(r.pass);
      }
    }
    return passes;
  }

  // One SubmitDataset stream of `lines` in one message; `last` marks it final.
  grpc::Status RawSubmit(const std::vector<std::string>& lines, bool last, int64_t total_lines,
                         const std::string& key = "") {
    auto ctx = Ctx();
    v1::SubmitDatasetResponse response;
    auto writer = stub_->SubmitDataset(ctx.get(), &response);
    v1::SubmitDatasetRequest msg;
    msg.set_idempotency_key(key);
    for (const auto& l : lines) msg.add_lines(l);
    msg.set_last(last);
    msg.set_total_lines(total_lines);
    writer->Write(msg);
    writer->WritesDone();
    return writer->Finish();
  }

  std::map<std::string, int64_t> Refused() { return server_->RefusedCounts(); }
};

// --- Item 3: groups of weights this learner did not publish.

TEST_F(LearnerReliabilityTest, GroupOfADeadLearnersWeightsIsRefusedAsUnknownPolicyAndRequeued) {
  StartServer();
  Submit(Prompts(4));
  const auto leases = Lease(2);
  ASSERT_EQ(leases.leases_size(), 2);
  ASSERT_FALSE(server_->incarnation().empty());
  EXPECT_EQ(leases.learner_incarnation(), server_->incarnation());
  // Tagged with another learner process's incarnation (the version number exists here too).
  v1::RolloutGroup dead = Group(leases.leases(0));
  dead.set_policy_incarnation("0123456789abcdef");
  // A version above anything this learner published ("negative staleness").
  v1::RolloutGroup ahead = Group(leases.leases(1));
  ahead.set_policy_version(server_->published_version() + 7);
  const auto ack = Push({dead, ahead});
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected_by_reason().at("unknown_policy"), 2);
  EXPECT_EQ(Refused()["unknown_policy"], 2);
  // Both prompts go back to the queue at once (their leases are released), untrained.
  EXPECT_EQ(StateOf(leases.leases(0).prompt_id()), PromptState::kQueued);
  EXPECT_EQ(StateOf(leases.leases(1).prompt_id()), PromptState::kQueued);
  EXPECT_EQ(server_->metrics().groups_rejected->Value({"unknown_policy"}), 2);
}

TEST_F(LearnerReliabilityTest, ARestartedLearnerHasANewIncarnationAndRefusesTheOldOnesGroups) {
  config_.save_steps = 1;
  StartServer();
  Submit(Prompts(6));
  const std::string first = server_->incarnation();
  const auto leases = Lease(3);
  ASSERT_EQ(Push({Group(leases.leases(0)), Group(leases.leases(1))}).accepted(), 2);
  ASSERT_TRUE(WaitFor([&] { return fs::exists(dir_ / "latest"); }));
  // Generated with the old learner's version-1 weights, pushed after the restart.
  v1::RolloutGroup late = Group(leases.leases(2));
  ASSERT_TRUE(server_->Stop(/*checkpoint=*/false).ok());
  server_.reset();
  StartServer();
  EXPECT_NE(server_->incarnation(), first);
  EXPECT_EQ(server_->published_version(), late.policy_version());  // same number, other learner
  const auto ack = Push({late});
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected_by_reason().at("unknown_policy"), 1);
}

// --- Item 4: groups still buffered when the job ends.

TEST_F(LearnerReliabilityTest, GroupsBufferedWhenTheJobEndsAreQueuedAgainNotLeftTrained) {
  config_.max_steps = 1;  // one batch of 2 groups
  StartServer();
  Submit(Prompts(4));
  const auto leases = Lease(4);
  ASSERT_EQ(leases.leases_size(), 4);
  std::vector<v1::RolloutGroup> groups;
  for (const auto& l : leases.leases()) groups.push_back(Group(l));
  const auto ack = Push(groups);
  ASSERT_TRUE(server_->WaitForJobEnd(milliseconds(20'000)));
  EXPECT_EQ(server_->job_state(), JobState::kDone);
  // The first two trained step 1 (the batch is taken in arrival order); the other two were
  // accepted into the buffer (or refused once the job had ended) but never trained.
  int trained = 0, queued = 0;
  for (int i = 0; i < 4; ++i) {
    const std::string& id = leases.leases(i).prompt_id();
    const PromptState state = StateOf(id);
    if (i < 2) {
      EXPECT_EQ(state, PromptState::kTrained) << id;
      EXPECT_EQ(TrainedPasses(id), (std::multiset<int64_t>{0})) << id;
      ++trained;
    } else {
      EXPECT_EQ(state, PromptState::kQueued) << id << " was never trained";
      EXPECT_TRUE(TrainedPasses(id).empty()) << id;
      ++queued;
    }
  }
  EXPECT_EQ(trained + queued, 4);
  EXPECT_EQ(server_->TEST_ledger().Counts()->accepted, 0);
  EXPECT_GE(ack.accepted(), 2);
}

// --- Item 5: a dataset is committed whole or not at all.

TEST_F(LearnerReliabilityTest, AnUploadWithoutItsFinalMessageStoresNothing) {
  StartServer();
  grpc::Status s = RawSubmit(Prompts(5), /*last=*/false, 0, "k");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_NE(s.error_message().find("nothing stored"), std::string::npos) << s.error_message();
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 0);
  // A final message that miscounts the lines stores nothing either.
  s = RawSubmit(Prompts(5), /*last=*/true, 7, "k");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 0);
  // The same key is still free: the complete upload is stored once.
  s = RawSubmit(Prompts(5), /*last=*/true, 5, "k");
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 5);
}

TEST_F(LearnerReliabilityTest, ALineThatIsNotUtf8RefusesTheWholeDatasetNamingTheLine) {
  StartServer();
  auto lines = Prompts(6);
  lines[3] = std::string("{\"prompt\": \"caf\xe9\"}");  // Latin-1, not UTF-8
  grpc::Status s = RawSubmit(lines, true, 6);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("line 4"), std::string::npos) << s.error_message();
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 0);
}

TEST_F(LearnerReliabilityTest, BlankLinesCountAgainstTheSizeLimit) {
  options_.max_dataset_bytes = 1000;
  StartServer();
  // 10 real lines of ~20 bytes and 900 blank ones: 1100+ bytes with their newlines.
  auto lines = Prompts(10);
  lines.insert(lines.end(), 900, "");
  grpc::Status s = RawSubmit(lines, true, static_cast<int64_t>(lines.size()));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 0);
}

TEST_F(LearnerReliabilityTest, ClientUploadCutByItsDeadlineStoresNothingAndARetryStoresItOnce) {
  StartServer();
  auto client = ConnectLearner("127.0.0.1:" + std::to_string(server_->port()), "");
  ASSERT_TRUE(client.ok());
  std::stringstream data;
  for (int i = 0; i < 200'000; ++i) data << R"({"prompt": "say )" << i << "\"}\n";
  const std::string text = data.str();
  {
    // The deadline passes mid-upload: the first half goes out, then the client stalls past its
    // deadline before the rest and the message marked last. (A 1 ms deadline on the whole
    // upload raced on a loaded machine: every message could reach the learner before it
    // fired.)
    auto ctx = Ctx(milliseconds(500));
    v1::SubmitDatasetResponse response;
    auto writer = stub_->SubmitDataset(ctx.get(), &response);
    v1::SubmitDatasetRequest half;
    half.set_name("big");
    std::istringstream lines(text);
    std::string line;
    for (int i = 0; i < 100'000 && std::getline(lines, line); ++i) half.add_lines(line);
    EXPECT_TRUE(writer->Write(half));
    std::this_thread::sleep_for(milliseconds(1000));
    v1::SubmitDatasetRequest rest;
    while (std::getline(lines, line)) rest.add_lines(line);
    rest.set_last(true);
    rest.set_total_lines(200'000);
    (void)writer->Write(rest);  // the call is over: this write fails or is dropped
    writer->WritesDone();
    const grpc::Status cut = writer->Finish();
    EXPECT_EQ(cut.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << cut.error_message();
  }
  // Give a commit that would (wrongly) still happen time to land.
  std::this_thread::sleep_for(milliseconds(1500));
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 0);
  // Without a key the client derives it from the content: the retry and a resubmission of the
  // same file add the dataset once.
  std::istringstream retry(text);
  auto second = SubmitLines(*client, retry, "", "big", 60);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_TRUE(second->created());
  EXPECT_EQ(second->prompt_count(), 200'000);
  std::istringstream again(text);
  auto third = SubmitLines(*client, again, "", "big", 60);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_FALSE(third->created());
  EXPECT_EQ(third->dataset_id(), second->dataset_id());
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 200'000);
}

// --- Item 6: a finite but huge reward is bad input for its group, not the end of the job.

TEST_F(LearnerReliabilityTest, AHugeFiniteRewardIsRefusedAndTheJobTrainsOn) {
  StartServer();
  Submit(Prompts(4));
  const auto leases = Lease(2);
  const auto ack = Push({Group(leases.leases(0), 1e308, 0.0), Group(leases.leases(1))});
  EXPECT_EQ(ack.accepted(), 1);
  EXPECT_EQ(ack.rejected_by_reason().at("reward_out_of_range"), 1);
  EXPECT_EQ(StateOf(leases.leases(0).prompt_id()), PromptState::kQueued);
  // The job goes on: one more well-formed group completes the batch and a step is taken.
  const auto more = Lease(1);
  ASSERT_EQ(more.leases_size(), 1);
  ASSERT_EQ(Push({Group(more.leases(0))}).accepted(), 1);
  ASSERT_TRUE(WaitFor([&] { return server_->published_version() >= 1; }));
  EXPECT_EQ(server_->job_state(), JobState::kRunning);
}

// --- Item 7 (checkpoint part): a failed checkpoint is retried; the job does not fail.

TEST_F(LearnerReliabilityTest, AFailedCheckpointIsRetriedAtTheNextBatchAndTheJobGoesOn) {
  config_.save_steps = 1;
  std::atomic<bool> disk_full{true};
  options_.TEST_checkpoint_fault = [&](int64_t) {
    return disk_full ? Status::ResourceExhausted("No space left on device") : Status::OK();
  };
  StartServer();
  Submit(Prompts(8));
  auto batch = [&] {
    const auto l = Lease(2);
    ASSERT_EQ(l.leases_size(), 2);
    ASSERT_EQ(Push({Group(l.leases(0)), Group(l.leases(1))}).accepted(), 2);
  };
  batch();
  ASSERT_TRUE(WaitFor([&] { return server_->metrics().checkpoint_failures->Value() >= 1; }));
  EXPECT_EQ(server_->job_state(), JobState::kRunning);
  EXPECT_FALSE(fs::exists(dir_ / "checkpoint-1"));
  disk_full = false;
  batch();
  ASSERT_TRUE(WaitFor([&] { return fs::exists(dir_ / "checkpoint-2" / "SHA256SUMS"); }));
  EXPECT_EQ(server_->job_state(), JobState::kRunning);
  EXPECT_TRUE(learner::VerifyCheckpoint((dir_ / "checkpoint-2").string()).ok());
}

// --- A batch that fails in its second optimizer step: its first step is in the weights, its
// groups are QUEUED again, so the stop must not save that state (they would train twice).

TEST_F(LearnerReliabilityTest, ABatchFailingInItsSecondStepLeavesNoCheckpointOfItsFirst) {
  config_.steps_per_generation = 2;  // 4 groups of 2 per batch, 2 micro-batches -> 2 steps
  // No periodic checkpoint: the stop's is the only one (before the fix it saved checkpoint-3).
  config_.save_steps = 0;
  std::atomic<bool> fail{false};
  // Micro-batches of the failing call: 0 (step 1), 1 (step 2, which fails).
  std::atomic<int64_t> calls{0};
  options_.TEST_micro_batch_fault = [&](int64_t micro_batch) {
    if (micro_batch == 0) calls.fetch_add(1);
    return fail && micro_batch == 1 ? Status::Internal("injected: device lost") : Status::OK();
  };
  StartServer();
  Submit(Prompts(8));
  {
    const auto first = Lease(4);
    ASSERT_EQ(first.leases_size(), 4);
    std::vector<v1::RolloutGroup> groups;
    for (const auto& lease : first.leases()) groups.push_back(Group(lease));
    ASSERT_EQ(Push(groups).accepted(), 4);
  }  // steps 1 and 2
  ASSERT_TRUE(WaitFor([&] { return server_->published_version() >= 2; }));
  fail = true;
  const auto second = Lease(4);
  ASSERT_EQ(second.leases_size(), 4);
  std::vector<v1::RolloutGroup> groups;
  for (const auto& lease : second.leases()) groups.push_back(Group(lease));
  ASSERT_EQ(Push(groups).accepted(), 4);
  ASSERT_TRUE(WaitFor([&] { return server_->job_state() == JobState::kFailed; }));
  EXPECT_EQ(calls.load(), 2);
  // The job failed in this process, not for good: `grpo learner` exits 1 for its orchestrator
  // to restart it, and the job resumes. Workers are told the learner is shutting down (wait and
  // reconnect), never that the job ended (exit): before the fix the heartbeat said shutdown and
  // the worker of a learner group whose rank died left for good.
  {
    v1::HeartbeatRequest hb;
    hb.set_worker_id("w1");
    v1::HeartbeatResponse beat;
    grpc::Status s = stub_->Heartbeat(Ctx().get(), hb, &beat);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_FALSE(beat.shutdown());
    v1::LeasePromptsRequest req;
    req.set_worker_id("w1");
    req.set_max_prompts(1);
    v1::LeasePromptsResponse leased;
    s = stub_->LeasePrompts(Ctx().get(), req, &leased);
    EXPECT_FALSE(s.ok() && leased.job_done()) << "a failed learner ended the job for workers";
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    const auto ack = Push({Group(second.leases(0))});
    EXPECT_EQ(ack.rejected_by_reason().count("job_ended"), 0u);
    EXPECT_EQ(ack.rejected_by_reason().count("learner_stopping"), 1u);
  }
  ASSERT_TRUE(server_->Stop(/*checkpoint=*/true).ok());
  // Step 3 was taken with two of the failed batch's groups: no checkpoint may hold it (and the
  // weights of step 2 are gone).
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_NE(entry.path().filename().string().rfind("checkpoint-", 0), 0u) << entry.path();
  }
  for (const auto& lease : second.leases()) {
    EXPECT_EQ(StateOf(lease.prompt_id()), PromptState::kQueued) << lease.prompt_id();
    EXPECT_TRUE(TrainedPasses(lease.prompt_id()).empty()) << lease.prompt_id();
  }
}

// --- Item 11: liveness.

TEST_F(LearnerReliabilityTest, AWorkerLeasingWhileTheLearnerStopsIsToldToRetryNotThatTheJobEnded) {
  config_.max_staleness = 0;  // after one batch is out, the next lease call long-polls
  StartServer();
  Submit(Prompts(8));
  ASSERT_EQ(Lease(2).leases_size(), 2);
  auto polling = std::async(std::launch::async, [&] {
    v1::LeasePromptsRequest req;
    req.set_worker_id("w1");
    req.set_max_prompts(1);
    v1::LeasePromptsResponse resp;
    grpc::Status s = stub_->LeasePrompts(Ctx().get(), req, &resp);
    return std::make_pair(s, resp);
  });
  std::this_thread::sleep_for(milliseconds(500));  // the call is in its long poll
  ASSERT_TRUE(server_->Stop(/*checkpoint=*/false).ok());
  const auto [status, resp] = polling.get();
  EXPECT_FALSE(status.ok() && resp.job_done()) << "a stopping learner ended the job for workers";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
}

TEST_F(LearnerReliabilityTest, AWorkerRegisteringAgainUnderItsIdGetsItsDeadProcesssLeasesBack) {
  StartServer();
  Submit(Prompts(4));
  const auto leases = Lease(3, "w-crashy");
  ASSERT_EQ(leases.leases_size(), 3);
  // The process restarts and registers under the same id: its old leases go back at once,
  // not after lease_seconds (60 s here).
  RegisterWorker("w-crashy");
  for (const auto& l : leases.leases()) {
    EXPECT_EQ(StateOf(l.prompt_id()), PromptState::kQueued) << l.prompt_id();
  }
  EXPECT_EQ(server_->TEST_ledger().Counts()->leased, 0);
  // A group under a dead lease is refused.
  const auto ack = Push({Group(leases.leases(0))});
  EXPECT_EQ(ack.rejected_by_reason().at("unknown_lease"), 1);
}

TEST_F(LearnerReliabilityTest, OnlyTheLastSaveTotalLimitCheckpointsAreKept) {
  config_.save_steps = 1;
  config_.save_total_limit = 2;
  StartServer();
  Submit(Prompts(8));
  for (int b = 0; b < 4; ++b) {
    const auto l = Lease(2);
    ASSERT_EQ(l.leases_size(), 2);
    ASSERT_EQ(Push({Group(l.leases(0)), Group(l.leases(1))}).accepted(), 2);
    ASSERT_TRUE(WaitFor([&, b] {
      return fs::exists(dir_ / ("checkpoint-" + std::to_string(b + 1)) / "SHA256SUMS");
    }));
  }
  ASSERT_TRUE(WaitFor([&] { return !fs::exists(dir_ / "checkpoint-2"); }));
  std::vector<std::string> left;
  for (const auto& d : learner::ListCheckpoints(dir_.string())) {
    left.push_back(fs::path(d).filename().string());
  }
  EXPECT_EQ(left, (std::vector<std::string>{"checkpoint-4", "checkpoint-3"}));
}

}  // namespace
}  // namespace grpo::services
