// Fault tolerance with real processes (issue 5 §9): `grpo learner` and `grpo rollout` workers on
// loopback, killed with SIGKILL mid-run, and bad input sent to a real learner over the wire.
// Expectations come from the datasets written here: which prompts exist, how many generations each
// gets, how many optimizer steps a pass takes. Every process started here is killed and reaped
// (tests/services/process_util.h).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sqlite3.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "grpo/v1/learner.grpc.pb.h"
#include "tests/services/fault_util.h"
#include "tests/services/http_test_util.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace {

using namespace grpo::testing::faults;  // NOLINT: the shared fixture and helpers
// A worker that dies holding leases loses nothing: its leases expire after lease_seconds, the other
// worker leases those prompts again, and the pass trains every prompt exactly once.
TEST_F(FaultToleranceTest, KilledWorkersLeasesExpireAndEveryPromptTrainsOnce) {
  constexpr int kPrompts = 6;
  constexpr int kSteps = kPrompts / kPromptsPerStep;  // one pass
  WriteDataset(dir_ / "data.jsonl", kPrompts);
  const int port = StartLearner(
      "learner", 0,
      {"--lease_seconds", "2", "--max_steps", std::to_string(kSteps), "--save_steps", "0"});
  ASSERT_GT(port, 0);
  ASSERT_TRUE(Submit(port, dir_ / "data.jsonl"));
  auto stub = Stub(port);

  // The doomed worker leases the whole dataset in one call; it is frozen while it generates (before
  // it can push) and then killed.
  StartWorker("doomed", port, {"--prompts_per_lease", std::to_string(kPrompts)});
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto job = GetJob(*stub);
        return job && job->prompts().leased() == kPrompts;
      },
      kStartTimeout, milliseconds(2)))
      << Logs({"learner", "doomed"});
  ASSERT_TRUE(children_->Signal("doomed", SIGSTOP));
  std::this_thread::sleep_for(milliseconds(1000));  // anything already sent has arrived
  auto job = GetJob(*stub);
  ASSERT_TRUE(job.has_value());
  ASSERT_EQ(job->prompts().trained(), 0)
      << "the doomed worker pushed before it was frozen; the test needs it to "
         "hold its leases\n"
      << Logs({"learner", "doomed"});
  ASSERT_EQ(job->prompts().leased(), kPrompts);
  children_->Kill("doomed");

  StartWorker("survivor", port);
  const auto learner_exit = children_->Wait("learner", kJobTimeout);
  ASSERT_TRUE(learner_exit.has_value()) << "the job did not finish\n"
                                        << Logs({"learner", "survivor"});
  EXPECT_EQ(*learner_exit, 0) << Logs({"learner", "survivor"});
  EXPECT_EQ(children_->Wait("survivor", seconds(30)), std::optional<int>(0))
      << Logs({"learner", "survivor"});

  // The pass: steps 1..kSteps trained each prompt once (kGenerations sequences), no more steps.
  ExpectEachPromptTrainedOnce(SequencesByMarker(dump_dir(), kSteps), kPrompts);
  EXPECT_FALSE(fs::exists(DumpPath(dump_dir(), kSteps + 1)));

  // The ledger: pass 0 finished with the job (max_steps is one pass, so no pass 1 was started:
  // every prompt is TRAINED in pass 0), none rejected, and every prompt was first leased by the
  // doomed worker, so each carries at least one expired lease.
  std::string error;
  const auto ledger = ReadLedger(out_dir() / "ledger.sqlite", &error);
  ASSERT_TRUE(ledger.has_value()) << error;
  EXPECT_EQ(ledger->job_pass, 0);
  ASSERT_EQ(ledger->prompts.size(), static_cast<size_t>(kPrompts));
  for (const auto& [id, row] : ledger->prompts) {
    EXPECT_EQ(row.pass, 0) << id;
    EXPECT_EQ(row.state, "TRAINED") << id;
    EXPECT_NE(row.state, "REJECTED") << id;
    EXPECT_GE(row.attempts, 1) << id << ": the doomed worker's lease should have expired";
  }
}

// The learner scenario of the two tests below. A learner trains one pass of kPrompts prompts with
// two workers and a checkpoint every step; it is frozen at a moment when `latest` names a
// checkpoint, and killed with SIGKILL. With `crash_before_publish` the ledger is then made to
// hold what a crash between PromptLedger::MarkTrained (step S+1's groups recorded as trained)
// and checkpoint S+1 leaves: one more prompt recorded as trained at step S+1, which no saved
// weights hold. The restart must roll that back (PromptLedger::RollbackTo). A new learner starts on
// the same port and output_dir; the workers, which retry on their own, reconnect; the job runs to
// max_steps. Every prompt of the pass must be trained exactly once over the final history: the dead
// learner's steps up to the checkpoint, then the new learner's.
class LearnerRestartTest : public FaultToleranceTest {
 protected:
  static constexpr int kPrompts = 12;
  static constexpr int kSteps = kPrompts / kPromptsPerStep;  // one pass

  std::string Latest() {
    const std::string latest = ReadFile(out_dir() / "latest");
    return latest.substr(0, latest.find('\n'));
  }
  // What MarkTrained(step) writes for a prompt not trained yet, done by hand on the dead
  // learner's ledger. False when no queued pass-0 prompt is left.
  static bool RecordTrainedAt(const fs::path& ledger, int64_t step, std::string* error) {
    sqlite3* db = nullptr;
    if (sqlite3_open(ledger.c_str(), &db) != SQLITE_OK) {
      *error = "open " + ledger.string();
      sqlite3_close(db);
      return false;
    }
    const std::string s = std::to_string(step);
    const std::string sql =
        "BEGIN; "
        "CREATE TEMP TABLE pick AS SELECT id FROM prompts WHERE state = 'QUEUED' AND pass = 0 "
        "ORDER BY seq LIMIT 1; "
        "INSERT INTO trainings (prompt_id, pass, step) SELECT id, 0, " +
        s +
        " FROM pick; "
        "UPDATE prompts SET state = 'TRAINED', trained_step = " +
        s +
        ", trained_passes = 1 "
        "WHERE id IN (SELECT id FROM pick); "
        "COMMIT;";
    char* msg = nullptr;
    const bool ok = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &msg) == SQLITE_OK;
    if (!ok) *error = msg ? msg : "exec";
    sqlite3_free(msg);
    const bool changed = ok && sqlite3_total_changes(db) > 0;
    sqlite3_close(db);
    if (ok && !changed) *error = "no queued pass-0 prompt left";
    return changed;
  }

  void RunScenario(bool crash_before_publish) {
    WriteDataset(dir_ / "data.jsonl", kPrompts);
    const std::vector<std::string> config = {
        "--lease_seconds", "4", "--max_steps", std::to_string(kSteps), "--save_steps", "1"};
    const int port = StartLearner("learner", 0, config);
    ASSERT_GT(port, 0);
    ASSERT_TRUE(Submit(port, dir_ / "data.jsonl"));
    StartWorker("worker-a", port);
    StartWorker("worker-b", port);

    const auto armed = [&] {
      const std::string latest = Latest();
      return !latest.empty() && fs::exists(out_dir() / latest / "trainer_state.json");
    };
    ASSERT_TRUE(WaitUntil(
        [&] {
          if (!armed()) return false;
          children_->Signal("learner", SIGSTOP);
          // Still true while frozen: no later checkpoint is half-written.
          if (armed()) return true;
          children_->Signal("learner", SIGCONT);
          return false;
        },
        kJobTimeout, milliseconds(5)))
        << Logs({"learner", "worker-a", "worker-b"});
    children_->Kill("learner");

    // What survived: the checkpoint `latest` names, and (pass 0 still open) a ledger whose prompts
    // were not all accepted yet, so the restart has pass-0 work left.
    const std::string latest = Latest();
    const json state = json::parse(ReadFile(out_dir() / latest / "trainer_state.json"), nullptr,
                                   /*allow_exceptions=*/false);
    ASSERT_TRUE(state.is_object() && state.contains("global_step")) << latest;
    const int64_t resumed_step = state["global_step"].get<int64_t>();
    ASSERT_EQ(latest, "checkpoint-" + std::to_string(resumed_step));
    ASSERT_GE(resumed_step, 1);
    ASSERT_LT(resumed_step, kSteps) << "the learner finished before it could be killed";
    std::string error;
    auto ledger = ReadLedger(out_dir() / "ledger.sqlite", &error);
    ASSERT_TRUE(ledger.has_value()) << error;
    ASSERT_EQ(ledger->job_pass, 0) << "killed too late: every prompt was already accepted";
    if (crash_before_publish) {
      ASSERT_TRUE(RecordTrainedAt(out_dir() / "ledger.sqlite", resumed_step + 1, &error)) << error;
    }
    // Steps after the checkpoint were the dead learner's: the restarted learner removes their
    // dumps and redoes them. Its steps up to the checkpoint are history.
    std::map<int64_t, std::string> kept;
    for (int64_t step = 1; step <= resumed_step; ++step) {
      kept[step] = ReadFile(DumpPath(dump_dir(), step));
      ASSERT_FALSE(kept[step].empty()) << "no dump of checkpointed step " << step;
    }
    const auto dead = ReadSafetensors(DumpPath(dump_dir(), resumed_step));
    ASSERT_TRUE(dead.has_value());
    const int64_t dead_incarnation = dead->at("learner_incarnation").ints.at(0);

    ASSERT_EQ(StartLearner("learner-restarted", port, config), port);
    const auto exit_code = children_->Wait("learner-restarted", kJobTimeout);
    ASSERT_TRUE(exit_code.has_value()) << "the restarted job did not finish\n"
                                       << Logs({"learner-restarted", "worker-a", "worker-b"});
    EXPECT_EQ(*exit_code, 0) << Logs({"learner-restarted"});
    const std::string log = ReadFile(children_->Err("learner-restarted"));
    // The workers came back by themselves: only their groups can have trained the steps after the
    // checkpoint (checked below). One of them may have missed the job's end while it was backing
    // off; it keeps retrying and must still stop cleanly on SIGTERM.
    for (const std::string w : {"worker-a", "worker-b"}) {
      auto code = children_->Wait(w, seconds(10));
      if (!code) {
        children_->Signal(w, SIGTERM);
        code = children_->Wait(w, seconds(30));
      }
      EXPECT_EQ(code, std::optional<int>(0)) << Logs({w});
    }

    // Resumed at the checkpoint's step, not 0: the log says so, the checkpointed steps' dumps were
    // not rewritten, and the job ended at max_steps.
    EXPECT_NE(log.find("resumed from " + (out_dir() / latest).string() + " at step " +
                       std::to_string(resumed_step)),
              std::string::npos)
        << Tail(children_->Err("learner-restarted"));
    for (const auto& [step, bytes] : kept) {
      EXPECT_EQ(ReadFile(DumpPath(dump_dir(), step)), bytes) << "step " << step << " was retrained";
    }
    // Every step after the checkpoint is the restarted learner's: no dump of the dead one's is
    // left.
    for (int64_t step = resumed_step + 1; step <= kSteps; ++step) {
      const auto redone = ReadSafetensors(DumpPath(dump_dir(), step));
      ASSERT_TRUE(redone.has_value()) << "no dump of step " << step;
      EXPECT_NE(redone->at("learner_incarnation").ints.at(0), dead_incarnation) << "step " << step;
    }
    const json final_state = json::parse(
        ReadFile(out_dir() / ("checkpoint-" + std::to_string(kSteps)) / "trainer_state.json"),
        nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(final_state.is_object());
    EXPECT_EQ(final_state.value("global_step", -1), kSteps);

    // Nothing lost, nothing doubled: over steps 1..kSteps each prompt trained exactly once.
    ExpectEachPromptTrainedOnce(SequencesByMarker(dump_dir(), kSteps), kPrompts);
    EXPECT_FALSE(fs::exists(DumpPath(dump_dir(), kSteps + 1)));
    ledger = ReadLedger(out_dir() / "ledger.sqlite", &error);
    ASSERT_TRUE(ledger.has_value()) << error;
    EXPECT_EQ(ledger->job_pass, 0);  // the job is one pass: it ended with pass 0
    EXPECT_EQ(ledger->prompts.size(), static_cast<size_t>(kPrompts));
    for (const auto& [id, row] : ledger->prompts) EXPECT_EQ(row.state, "TRAINED") << id;
  }
};

TEST_F(LearnerRestartTest, KilledLearnerResumesFromItsCheckpointAndTrainsEveryPromptOnce) {
  RunScenario(/*crash_before_publish=*/false);
}

TEST_F(LearnerRestartTest, CrashBetweenLedgerAndCheckpointLosesNothingAndTrainsNothingTwice) {
  RunScenario(/*crash_before_publish=*/true);
}

// --- Bad input on the wire against one real learner process (no workers): each call is refused the
// documented way, and afterwards the learner still answers Health and GetJob.

class LearnerWireTest : public ::testing::Test {
 protected:
  static constexpr int kPrompts = 8;
  static constexpr double kLeaseSeconds = 3;

  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("fault_tolerance_wire_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    fs::create_directories(*dir_);
    std::ofstream(*dir_ / "token") << kToken << "\n";
    WriteDataset(*dir_ / "data.jsonl", kPrompts);
    children_ = new Children(*dir_);
    children_->Spawn("learner", {GrpoBin(),
                                 "learner",
                                 "--output_dir",
                                 (*dir_ / "out").string(),
                                 "--grpc_port",
                                 "0",
                                 "--metrics_port",
                                 "0",
                                 "--auth_token_file",
                                 (*dir_ / "token").string(),
                                 "--num_generations",
                                 std::to_string(kGenerations),
                                 "--per_device_train_batch_size",
                                 std::to_string(kBatchSequences),
                                 "--max_completion_length",
                                 "8",
                                 "--reward_funcs",
                                 "length",
                                 "--lease_seconds",
                                 std::to_string(kLeaseSeconds),
                                 "--max_steps",
                                 "1000",
                                 "--save_steps",
                                 "0",
                                 "--linger_seconds",
                                 "0"});
    const json line = children_->FirstLine("learner", kStartTimeout);
    if (line.is_object() && line.contains("port")) {
      port_ = line["port"].get<int>();
      metrics_port_ = line.value("metrics_port", 0);
    }
  }
  static void TearDownTestSuite() {
    delete children_;
    children_ = nullptr;
    fs::remove_all(*dir_);
    delete dir_;
  }

  void SetUp() override {
    ASSERT_GT(port_, 0) << "the learner did not start:\n" << Tail(children_->Err("learner"));
    stub_ = Stub(port_);
    if (!submitted_) {
      v1::SubmitDatasetResponse resp;
      auto ctx = Ctx();
      auto writer = stub_->SubmitDataset(ctx.get(), &resp);
      v1::SubmitDatasetRequest req;
      std::ifstream in(*dir_ / "data.jsonl");
      for (std::string line; std::getline(in, line);) req.add_lines(line);
      req.set_last(true);
      req.set_total_lines(req.lines_size());
      ASSERT_TRUE(writer->Write(req));
      writer->WritesDone();
      const grpc::Status s = writer->Finish();
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_EQ(resp.prompt_count(), kPrompts);
      submitted_ = true;
    }
  }

  // The learner still serves: Health says SERVING, GetJob answers, the process is alive.
  void ExpectStillServing() {
    EXPECT_TRUE(HealthServing(port_)) << Tail(children_->Err("learner"));
    auto job = GetJob(*stub_);
    ASSERT_TRUE(job.has_value()) << Tail(children_->Err("learner"));
    EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
    EXPECT_EQ(job->prompts().queued() + job->prompts().leased() + job->prompts().trained() +
                  job->prompts().rejected(),
              kPrompts);
  }

  v1::Lease LeaseOne(const std::string& worker) {
    if (registered_.insert(worker).second) {
      // The learner leases only to registered workers, and groups carry its incarnation.
      v1::RegisterRequest reg;
      reg.set_worker_id(worker);
      v1::RegisterResponse r;
      const grpc::Status rs = stub_->Register(Ctx().get(), reg, &r);
      EXPECT_TRUE(rs.ok()) << rs.error_message();
      incarnation_ = r.learner_incarnation();
    }
    v1::LeasePromptsRequest req;
    req.set_worker_id(worker);
    req.set_max_prompts(1);
    v1::LeasePromptsResponse resp;
    const grpc::Status s = stub_->LeasePrompts(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.leases_size(), 1);
    return resp.leases_size() > 0 ? resp.leases(0) : v1::Lease();
  }

  // A group the tiny model accepts under `lease`: 2 completions of byte tokens (the bytes of "hi"
  // and the end token 258), behaviour log-probs, one reward each.
  v1::RolloutGroup WellFormedGroup(const v1::Lease& lease, const std::string& worker) {
    v1::RolloutGroup g;
    g.set_policy_incarnation(incarnation_);
    g.set_worker_id(worker);
    g.set_lease_id(lease.lease_id());
    g.set_prompt_id(lease.prompt_id());
    g.set_policy_version(0);
    for (int id : {'s', 'a', 'y'}) g.add_prompt_ids(id);
    for (double reward : {1.0, 0.0}) {
      v1::Completion* c = g.add_completions();
      for (int id : {int{'h'}, int{'i'}, 258}) c->add_token_ids(id);
      for (float lp : {-1.5f, -2.0f, -0.5f}) c->add_logprobs(lp);
      c->set_text("hi");
      c->add_rewards()->set_value(reward);
    }
    return g;
  }

  grpc::Status Push(const std::vector<v1::RolloutGroup>& groups, v1::PushRolloutsResponse* ack,
                    const std::string& token = kToken) {
    auto ctx = Ctx(token);
    auto writer = stub_->PushRollouts(ctx.get(), ack);
    for (const auto& g : groups) {
      if (!writer->Write(g)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // grpo_groups_rejected_total{reason="<reason>"} on the learner's /metrics (-1 if absent).
  double RejectedMetric(const std::string& reason) {
    auto r = grpo::testing::HttpGet(static_cast<uint16_t>(metrics_port_), "/metrics");
    if (!r || r->status != 200) return -1;
    const std::string prefix = "grpo_groups_rejected_total{reason=\"" + reason + "\"} ";
    const size_t at = r->body.find("\n" + prefix);
    if (at == std::string::npos) return -1;
    return std::stod(r->body.substr(at + 1 + prefix.size()));
  }

  // The ledger row of `prompt_id`, read from the file while the learner runs (WAL readers do not
  // block the writer).
  std::optional<LedgerRow> LedgerRowOf(const std::string& prompt_id) {
    std::string error;
    auto ledger = ReadLedger(*dir_ / "out" / "ledger.sqlite", &error);
    EXPECT_TRUE(ledger.has_value()) << error;
    if (!ledger || !ledger->prompts.count(prompt_id)) return std::nullopt;
    return ledger->prompts.at(prompt_id);
  }

  static inline fs::path* dir_ = nullptr;
  static inline Children* children_ = nullptr;
  static inline int port_ = 0;
  static inline int metrics_port_ = 0;
  static inline bool submitted_ = false;
  std::unique_ptr<v1::LearnerService::Stub> stub_;
  std::set<std::string> registered_;  // worker ids registered by this test
  std::string incarnation_;           // the learner's, from Register
};

TEST_F(LearnerWireTest, WrongOrMissingTokenIsUnauthenticated) {
  v1::Job job;
  EXPECT_EQ(stub_->GetJob(Ctx("not-the-token").get(), v1::GetJobRequest(), &job).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(stub_->GetJob(Ctx("").get(), v1::GetJobRequest(), &job).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  v1::LeasePromptsRequest req;
  req.set_worker_id("intruder");
  req.set_max_prompts(kPrompts);
  v1::LeasePromptsResponse leased;
  EXPECT_EQ(stub_->LeasePrompts(Ctx("not-the-token").get(), req, &leased).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(leased.leases_size(), 0);
  v1::PushRolloutsResponse ack;
  EXPECT_EQ(Push({WellFormedGroup(v1::Lease(), "intruder")}, &ack, "not-the-token").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  ExpectStillServing();
  auto after = GetJob(*stub_);
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->prompts().trained(), 0) << "an unauthenticated push changed the ledger";
}

TEST_F(LearnerWireTest, MessageOverTheReceiveLimitIsResourceExhausted) {
  const auto before = GetJob(*stub_);
  ASSERT_TRUE(before.has_value());
  v1::SubmitDatasetResponse resp;
  auto ctx = Ctx();
  auto writer = stub_->SubmitDataset(ctx.get(), &resp);
  v1::SubmitDatasetRequest req;
  req.set_idempotency_key("too-big");
  // One well-formed JSON line whose message is 1 MiB over the learner's limit.
  req.add_lines(R"({"prompt": ")" + std::string(kLearnerMaxMessageBytes + (1u << 20), 'x') +
                R"("})");
  writer->Write(req);
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ExpectStillServing();
  const auto after = GetJob(*stub_);
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->prompts().queued() + after->prompts().leased(),
            before->prompts().queued() + before->prompts().leased())
      << "nothing of the refused dataset may be stored";
}

TEST_F(LearnerWireTest, TokensOutsideTheVocabularyAreRefusedWithTheirReasonAndRequeued) {
  const double counted_before = RejectedMetric("token_out_of_vocab");
  const v1::Lease a = LeaseOne("w-vocab");
  const v1::Lease b = LeaseOne("w-vocab");
  v1::RolloutGroup bad_completion = WellFormedGroup(a, "w-vocab");
  bad_completion.mutable_completions(1)->set_token_ids(0, kVocabSize);  // one past the last id
  v1::RolloutGroup bad_prompt = WellFormedGroup(b, "w-vocab");
  bad_prompt.set_prompt_ids(1, -1);
  v1::PushRolloutsResponse ack;
  const grpc::Status s = Push({bad_completion, bad_prompt}, &ack);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected(), 2);
  EXPECT_EQ(ack.rejected_by_reason().count("token_out_of_vocab")
                ? ack.rejected_by_reason().at("token_out_of_vocab")
                : 0,
            2);
  ASSERT_EQ(ack.messages_size(), 2);
  EXPECT_NE(ack.messages(0).find(std::to_string(kVocabSize)), std::string::npos) << ack.messages(0);
  EXPECT_NE(ack.messages(1).find("-1"), std::string::npos) << ack.messages(1);
  EXPECT_EQ(RejectedMetric("token_out_of_vocab"), counted_before + 2);
  // A bad group is a worker bug, not a bad prompt: both prompts are queued again.
  for (const v1::Lease* l : {&a, &b}) {
    auto row = LedgerRowOf(l->prompt_id());
    ASSERT_TRUE(row.has_value()) << l->prompt_id();
    EXPECT_EQ(row->state, "QUEUED") << l->prompt_id();
  }
  ExpectStillServing();
}

TEST_F(LearnerWireTest, GroupUnderAnUnknownLeaseIsRefusedAndCounted) {
  const double counted_before = RejectedMetric("unknown_lease");
  const v1::Lease real = LeaseOne("w-unknown");
  v1::Lease forged = real;
  forged.set_lease_id(std::string(32, '0'));
  v1::PushRolloutsResponse ack;
  const grpc::Status s = Push({WellFormedGroup(forged, "w-unknown")}, &ack);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected(), 1);
  EXPECT_EQ(ack.rejected_by_reason().count("unknown_lease")
                ? ack.rejected_by_reason().at("unknown_lease")
                : 0,
            1);
  EXPECT_EQ(RejectedMetric("unknown_lease"), counted_before + 1);
  // The real lease is untouched by the forged push.
  auto row = LedgerRowOf(real.prompt_id());
  ASSERT_TRUE(row.has_value());
  EXPECT_EQ(row->state, "LEASED");
  ExpectStillServing();
}

TEST_F(LearnerWireTest, GroupUnderAnExpiredLeaseIsRefusedAndCounted) {
  const double counted_before = RejectedMetric("expired_lease");
  const v1::Lease lease = LeaseOne("w-late");
  std::this_thread::sleep_for(milliseconds(static_cast<int64_t>(kLeaseSeconds * 1000) + 700));
  v1::PushRolloutsResponse ack;
  const grpc::Status s = Push({WellFormedGroup(lease, "w-late")}, &ack);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected(), 1);
  EXPECT_EQ(ack.rejected_by_reason().count("expired_lease")
                ? ack.rejected_by_reason().at("expired_lease")
                : 0,
            1);
  EXPECT_EQ(RejectedMetric("expired_lease"), counted_before + 1);
  auto row = LedgerRowOf(lease.prompt_id());
  ASSERT_TRUE(row.has_value());
  EXPECT_NE(row->state, "TRAINED");
  ExpectStillServing();
}

TEST_F(LearnerWireTest, AfterBadInputAWellFormedGroupIsStillAccepted) {
  const v1::Lease lease = LeaseOne("w-good");
  v1::PushRolloutsResponse ack;
  const grpc::Status s = Push({WellFormedGroup(lease, "w-good")}, &ack);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(ack.accepted(), 1) << (ack.messages_size() ? ack.messages(0) : "");
  EXPECT_EQ(ack.rejected(), 0);
  auto row = LedgerRowOf(lease.prompt_id());
  ASSERT_TRUE(row.has_value());
  EXPECT_EQ(row->state, "TRAINED");
  ExpectStillServing();
}

}  // namespace
