// Elastic workers with real processes (issue 22 item 9): a `grpo learner` whose Gloo group goes
// from 2 workers to 4 (new processes join) to 1 (others leave by SIGTERM, one is SIGKILLed in
// the middle of the run), and a late joiner. Each phase waits for the learner to form the
// group of that size. The job must never stall for more than one weight-sync deadline, every
// group must have a new epoch, the late joiner must catch up (GetWeights, then the group) and
// push groups that train, and the ledger's guarantees must hold on the final history
// (tests/services/history_check.h).
#include <regex>

#include "tests/services/fault_util.h"
#include "tests/services/history_check.h"

namespace {

using namespace grpo::testing::faults;  // NOLINT: the shared fixture and helpers
using Clock = std::chrono::steady_clock;

constexpr int kPrompts = 10;
constexpr int64_t kMaxStaleness = 2;
constexpr double kLeaseSeconds = 3;
constexpr double kWeightSyncSeconds = 5;

class ElasticWorkersTest : public FaultToleranceTest {
 protected:
  // Steps as the learner reports them (GetJob), polled; records the longest time between two
  // changes of global_step.
  int64_t Step() {
    auto job = GetJob(*stub_);
    if (job) {
      const auto now = Clock::now();
      if (job->global_step() != last_step_) {
        if (last_step_ >= 0) longest_gap_ = std::max(longest_gap_, now - last_change_);
        last_step_ = job->global_step();
        last_change_ = now;
      }
    }
    return last_step_;
  }
  // Polls Step() until it reaches `step` (false after `limit`).
  bool WaitForStep(int64_t step, std::chrono::seconds limit) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end) {
      if (Step() >= step) return true;
      std::this_thread::sleep_for(milliseconds(100));
    }
    return false;
  }
  void Gloo(const std::string& name, int port) {
    StartWorker(name, port,
                {"--weight_sync_backend", "gloo", "--weight_sync_hostname", "127.0.0.1"});
  }

  // The (ranks, epoch) of every Gloo group the learner formed so far, from its log.
  std::vector<std::pair<int, int64_t>> GroupsFormed() {
    static const std::regex kFormed(
        R"(gloo weight-sync group of ([0-9]+) ranks at epoch ([0-9]+))");
    const std::string log = ReadFile(children_->Err("learner"));
    std::vector<std::pair<int, int64_t>> formed;
    for (auto it = std::sregex_iterator(log.begin(), log.end(), kFormed);
         it != std::sregex_iterator(); ++it) {
      formed.emplace_back(std::stoi((*it)[1].str()), std::stoll((*it)[2].str()));
    }
    return formed;
  }
  // Waits (polling the steps too) until the learner forms a Gloo group of `ranks` ranks after
  // the first `after` groups.
  bool WaitForGroup(int ranks, size_t after, std::chrono::seconds limit) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end) {
      Step();
      const auto formed = GroupsFormed();
      for (size_t i = after; i < formed.size(); ++i) {
        if (formed[i].first == ranks) return true;
      }
      std::this_thread::sleep_for(milliseconds(100));
    }
    return false;
  }
  std::unique_ptr<grpo::v1::LearnerService::Stub> stub_;
  int64_t last_step_ = -1;
  Clock::time_point last_change_;
  Clock::duration longest_gap_{0};
};

TEST_F(ElasticWorkersTest, WorkersJoinAndLeaveMidRunWithoutStallingTheJob) {
  // More than any run of this test takes: the test ends the job (CancelJob) once every phase
  // is done, so the job outlasts them at any pace (400 steps of the tiny model used to; they
  // took 11 s once a pass's end no longer cost the workers a retry sleep).
  constexpr int64_t kMaxSteps = 1'000'000;
  // Steps trained after the late joiner is in the group, before the job is ended: enough for
  // it to lease, generate and push groups that train.
  constexpr int64_t kStepsWithTheLateJoiner = 40;
  WriteDataset(dir_ / "data.jsonl", kPrompts);
  const int port =
      StartLearner("learner", 0,
                   {"--lease_seconds", std::to_string(kLeaseSeconds), "--max_steps",
                    std::to_string(kMaxSteps), "--save_steps", "10", "--max_staleness",
                    std::to_string(kMaxStaleness), "--weight_sync_hostname", "127.0.0.1",
                    "--weight_sync_timeout_seconds", std::to_string(kWeightSyncSeconds)});
  ASSERT_GT(port, 0);
  stub_ = Stub(port);
  ASSERT_TRUE(Submit(port, dir_ / "data.jsonl"));

  // 2 workers (a group of 3 ranks with the learner's), then 4 (5 ranks).
  Gloo("w1", port);
  Gloo("w2", port);
  ASSERT_TRUE(WaitForGroup(3, 0, seconds(120))) << Logs({"learner", "w1", "w2"});
  Gloo("w3", port);
  Gloo("w4", port);
  ASSERT_TRUE(WaitForGroup(5, 0, seconds(120))) << Logs({"learner", "w3", "w4"});
  // One dies without a word (its leases wait for their deadline, the group for one deadline at
  // most), two leave by SIGTERM: one is left (2 ranks).
  size_t seen = GroupsFormed().size();
  children_->Kill("w2");
  ASSERT_TRUE(WaitForGroup(4, seen, seconds(120))) << Logs({"learner"});
  seen = GroupsFormed().size();
  children_->Signal("w3", SIGTERM);
  children_->Signal("w4", SIGTERM);
  EXPECT_EQ(children_->Wait("w3", seconds(60)), std::optional<int>(0)) << Logs({"w3"});
  EXPECT_EQ(children_->Wait("w4", seconds(60)), std::optional<int>(0)) << Logs({"w4"});
  ASSERT_TRUE(WaitForGroup(2, seen, seconds(120))) << Logs({"learner", "w1"});
  // A late joiner: the policy is many versions ahead of anything it has (3 ranks again).
  const int64_t joined_at = Step();
  seen = GroupsFormed().size();
  Gloo("w5", port);
  ASSERT_TRUE(WaitForGroup(3, seen, seconds(120))) << Logs({"learner", "w5"});
  const int64_t grouped_at = Step();
  ASSERT_TRUE(WaitForStep(grouped_at + kStepsWithTheLateJoiner, seconds(120)))
      << Logs({"learner", "w1", "w5"});
  {
    grpo::v1::CancelJobRequest req;
    req.set_reason("every phase done");
    grpo::v1::Job job;
    ASSERT_TRUE(stub_->CancelJob(Ctx().get(), req, &job).ok());
  }
  const auto code = [&]() -> std::optional<int> {
    const auto end = Clock::now() + seconds(300);
    while (Clock::now() < end) {
      Step();
      if (auto c = children_->Wait("learner", milliseconds(100))) return c;
    }
    return std::nullopt;
  }();
  ASSERT_TRUE(code.has_value()) << "the job did not finish\n" << Logs({"learner", "w1", "w5"});
  EXPECT_EQ(*code, 0) << Logs({"learner"});
  for (const char* w : {"w1", "w5"}) {
    EXPECT_EQ(children_->Wait(w, seconds(60)), std::optional<int>(0)) << Logs({w});
  }

  // Never stalled for more than one deadline (plus a step's own time on a loaded machine).
  const double gap = std::chrono::duration<double>(longest_gap_).count();
  std::cerr << "longest time between two optimizer steps: " << gap << " s\n";
  EXPECT_LT(gap, kWeightSyncSeconds + 3.0);

  // Each group the learner formed has an epoch of its own, later than the one before it.
  const auto formed = GroupsFormed();
  for (size_t i = 1; i < formed.size(); ++i) {
    EXPECT_GT(formed[i].second, formed[i - 1].second) << "group " << i << " reused an epoch";
  }

  // The late joiner took a recent version, then generated groups that were accepted.
  const std::string w5 = ReadFile(children_->Err("w5"));
  static const std::regex kReceived(R"(policy version ([0-9]+) \(learner [0-9a-f?]+\) received)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(w5, m, kReceived)) << Logs({"w5"});
  EXPECT_GE(std::stoll(m[1].str()), joined_at - 1) << "its first weights were not the learner's";
  static const std::regex kExit(R"(groups pushed \(([0-9]+) accepted)");
  ASSERT_TRUE(std::regex_search(w5, m, kExit)) << Logs({"w5"});
  EXPECT_GT(std::stoll(m[1].str()), 0) << "the late joiner's groups never trained";

  // The job's last step is its latest checkpoint's.
  const std::string latest = [&] {
    const std::string l = ReadFile(out_dir() / "latest");
    return l.substr(0, l.find('\n'));
  }();
  ASSERT_EQ(latest.rfind("checkpoint-", 0), 0u) << latest;
  const int64_t last_step = std::stoll(latest.substr(std::string("checkpoint-").size()));
  EXPECT_GE(last_step, grouped_at + kStepsWithTheLateJoiner);
  ExpectHistoryHolds(out_dir(), dump_dir(), last_step, kPrompts, kMaxStaleness);
}

}  // namespace
