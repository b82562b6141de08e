// Chaos with real processes (issue 12 "Prove it"): a `grpo learner`, three `grpo rollout`
// workers and `grpo submit` on loopback; faults drawn from a fixed seed (GRPO_CHAOS_SEED) for
// GRPO_CHAOS_SECONDS or until the job's GRPO_CHAOS_STEPS are done (defaults 90 s, 600 steps; the
// soak, chaos_soak_test, 1200 s and 9000 steps): learner SIGKILL (also right after a pass
// boundary), learner SIGTERM, worker SIGKILL and SIGTERM (each restarted under its old
// worker id), and worker SIGSTOP for longer than its leases. Then the job must finish, and the
// invariants are checked from what the processes left behind, read independently of the code
// under test: the batch dumps of the final history (which prompts each optimizer step trained,
// with which policy version and learner incarnation), the ledger file (SQLite, read-only) and
// the checkpoints (their SHA256SUMS).
#include <sys/wait.h>

#include <random>
#include <regex>

#include "learner/checkpoint.h"
#include "tests/services/fault_util.h"

namespace {

using namespace grpo::testing::faults;  // NOLINT: the shared fixture and helpers

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::stoll(v) : fallback;
}

// The ledger's record of trainings: (prompt marker, pass, step), read with SQLite's C API.
struct Training {
  std::string marker;
  int64_t pass = 0, step = 0;
};

std::vector<Training> ReadTrainings(const fs::path& ledger, std::string* error) {
  std::vector<Training> out;
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(ledger.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK) {
    *error = "open " + ledger.string();
    sqlite3_close(db);
    return out;
  }
  sqlite3_stmt* st = nullptr;
  const char* sql =
      "SELECT p.row_json, t.pass, t.step FROM trainings t JOIN prompts p ON p.id = t.prompt_id";
  if (sqlite3_prepare_v2(db, sql, -1, &st, nullptr) != SQLITE_OK) {
    *error = sqlite3_errmsg(db);
  } else {
    const std::regex marker("item [0-9][0-9]");
    while (sqlite3_step(st) == SQLITE_ROW) {
      const std::string row(reinterpret_cast<const char*>(sqlite3_column_text(st, 0)));
      std::smatch m;
      Training t;
      t.marker = std::regex_search(row, m, marker) ? m.str() : "?";
      t.pass = sqlite3_column_int64(st, 1);
      t.step = sqlite3_column_int64(st, 2);
      out.push_back(t);
    }
  }
  sqlite3_finalize(st);
  sqlite3_close(db);
  return out;
}

// One step's dump: the marker, policy version and policy incarnation of each row, and the
// incarnation of the learner that trained it.
struct StepDump {
  std::vector<std::string> markers;
  std::vector<int64_t> versions, incarnations;
  int64_t learner_incarnation = 0;
};

std::optional<StepDump> ReadStep(const fs::path& dump_dir, int64_t step, std::string* error) {
  const auto dump = ReadSafetensors(DumpPath(dump_dir, step));
  if (!dump) {
    *error = "no readable dump of step " + std::to_string(step);
    return std::nullopt;
  }
  for (const char* name : {"prompt_ids", "prompt_mask", "policy_version", "policy_incarnation",
                           "learner_incarnation"}) {
    if (dump->count(name) == 0) {
      *error = "step " + std::to_string(step) + ": no tensor " + name;
      return std::nullopt;
    }
  }
  StepDump out;
  const auto& ids = dump->at("prompt_ids");
  const auto& mask = dump->at("prompt_mask");
  const int64_t rows = ids.shape.at(0), cols = ids.shape.at(1);
  for (int64_t r = 0; r < rows; ++r) {
    std::string text;
    for (int64_t c = 0; c < cols; ++c) {
      const bool real =
          mask.floats.empty() ? mask.ints[r * cols + c] != 0 : mask.floats[r * cols + c] != 0;
      const int64_t id = ids.ints[r * cols + c];
      if (real && id >= 0 && id < 256) text.push_back(static_cast<char>(id));
    }
    const size_t at = text.find("item ");
    out.markers.push_back(at == std::string::npos ? "?" : text.substr(at, 7));
  }
  out.versions = dump->at("policy_version").ints;
  out.incarnations = dump->at("policy_incarnation").ints;
  out.learner_incarnation = dump->at("learner_incarnation").ints.at(0);
  return out;
}

class ChaosTest : public FaultToleranceTest {
 protected:
  static constexpr int kPrompts = 10;  // 5 optimizer steps per pass
  static constexpr double kLeaseSeconds = 3;
  static constexpr int kMaxStaleness = 2;
  static constexpr int kWorkers = 3;

  std::vector<std::string> LearnerConfig(int64_t max_steps) const {
    return {"--lease_seconds",    std::to_string(kLeaseSeconds),
            "--max_steps",        std::to_string(max_steps),
            "--save_steps",       "3",
            "--save_total_limit", "2",
            "--max_staleness",    std::to_string(kMaxStaleness)};
  }

  // Worker `w` (0..kWorkers-1) again under its worker id; a new process name each time.
  void SpawnWorker(int w, int port) {
    const std::string id = std::string("worker-") + static_cast<char>('a' + w);
    const std::string name = id + "." + std::to_string(++spawned_[id]);
    worker_names_[w] = name;
    StartWorker(name, port, {}, id);
  }

  int StartLearnerIncarnation(int port, int64_t max_steps) {
    learner_name_ = "learner." + std::to_string(++learners_);
    return StartLearner(learner_name_, port, LearnerConfig(max_steps));
  }

  int64_t JobPass() {
    std::string error;
    const auto ledger = ReadLedger(out_dir() / "ledger.sqlite", &error);
    return ledger ? ledger->job_pass : -1;
  }

  std::string learner_name_;
  int learners_ = 0;
  std::map<std::string, int> spawned_;
  std::string worker_names_[kWorkers];
};

TEST_F(ChaosTest, RandomFaultsLoseNothingTrainNothingTwiceAndTheJobFinishes) {
  const int64_t chaos_seconds = EnvInt("GRPO_CHAOS_SECONDS", 90);
  const int64_t max_steps = EnvInt("GRPO_CHAOS_STEPS", 600);
  const uint64_t seed = static_cast<uint64_t>(EnvInt("GRPO_CHAOS_SEED", 12));
  WriteDataset(dir_ / "data.jsonl", kPrompts);
  const int port = StartLearnerIncarnation(0, max_steps);
  ASSERT_GT(port, 0);
  ASSERT_TRUE(Submit(port, dir_ / "data.jsonl"));
  for (int w = 0; w < kWorkers; ++w) SpawnWorker(w, port);

  std::mt19937_64 rng(seed);
  std::map<std::string, int> injected;
  const auto restart_learner = [&] {
    ASSERT_EQ(StartLearnerIncarnation(port, max_steps), port) << Logs({learner_name_});
  };
  const auto chaos_end = std::chrono::steady_clock::now() + seconds(chaos_seconds);
  bool finished_early = false;
  std::optional<int> learner_exit;  // set when the job ended during the chaos
  while (std::chrono::steady_clock::now() < chaos_end && !HasFatalFailure()) {
    std::this_thread::sleep_for(milliseconds(std::uniform_int_distribution<int>(1500, 4000)(rng)));
    learner_exit = children_->Wait(learner_name_, milliseconds(0));
    if (learner_exit.has_value()) {
      finished_early = true;  // the job ended (max_steps) during the chaos
      break;
    }
    const int fault = std::uniform_int_distribution<int>(0, 9)(rng);
    const int w = std::uniform_int_distribution<int>(0, kWorkers - 1)(rng);
    if (fault == 0) {
      injected["learner SIGKILL"] += 1;
      children_->Kill(learner_name_);
      restart_learner();
    } else if (fault == 1) {
      // Right after a pass boundary: wait (up to 20 s) for the ledger's pass to move.
      const int64_t pass = JobPass();
      const bool moved = WaitUntil([&] { return JobPass() > pass; }, seconds(20), milliseconds(5));
      injected[moved ? "learner SIGKILL at a pass boundary" : "learner SIGKILL"] += 1;
      children_->Kill(learner_name_);
      restart_learner();
    } else if (fault == 2) {
      injected["learner SIGTERM"] += 1;
      children_->Signal(learner_name_, SIGTERM);
      if (!children_->Wait(learner_name_, seconds(60)).has_value()) {
        ADD_FAILURE() << "the learner did not stop on SIGTERM\n" << Logs({learner_name_});
        children_->Kill(learner_name_);
      }
      restart_learner();
    } else if (fault <= 5) {
      injected["worker SIGKILL"] += 1;
      children_->Kill(worker_names_[w]);
      SpawnWorker(w, port);
    } else if (fault <= 7) {
      injected["worker SIGTERM"] += 1;
      children_->Signal(worker_names_[w], SIGTERM);
      if (!children_->Wait(worker_names_[w], seconds(60)).has_value()) {
        ADD_FAILURE() << worker_names_[w] << " did not stop on SIGTERM\n"
                      << Logs({worker_names_[w]});
        children_->Kill(worker_names_[w]);
      }
      SpawnWorker(w, port);
    } else {
      injected["worker SIGSTOP past its leases"] += 1;
      children_->Signal(worker_names_[w], SIGSTOP);
      std::this_thread::sleep_for(milliseconds(static_cast<int64_t>(kLeaseSeconds * 1000) + 1500));
      children_->Signal(worker_names_[w], SIGCONT);
    }
  }
  std::string summary;
  for (const auto& [what, n] : injected) summary += "  " + what + ": " + std::to_string(n) + "\n";
  std::cerr << "chaos (seed " << seed << ", " << chaos_seconds << " s, " << learners_
            << " learner processes" << (finished_early ? ", the job ended during it" : "") << "):\n"
            << summary;

  // The job finishes with every process up.
  const auto code = learner_exit ? learner_exit : children_->Wait(learner_name_, seconds(480));
  ASSERT_TRUE(code.has_value()) << "the job did not finish\n" << Logs({learner_name_});
  EXPECT_EQ(*code, 0) << Logs({learner_name_});
  for (const auto& name : worker_names_) {
    auto wc = children_->Wait(name, seconds(30));
    if (!wc) {
      children_->Signal(name, SIGTERM);
      wc = children_->Wait(name, seconds(30));
    }
    EXPECT_EQ(wc, std::optional<int>(0)) << Logs({name});
  }

  // The latest checkpoint is the final step and verifies.
  const std::string latest = [&] {
    const std::string s = ReadFile(out_dir() / "latest");
    return s.substr(0, s.find('\n'));
  }();
  ASSERT_EQ(latest, "checkpoint-" + std::to_string(max_steps));
  EXPECT_TRUE(grpo::learner::VerifyCheckpoint((out_dir() / latest).string()).ok());
  EXPECT_LE(grpo::learner::ListCheckpoints(out_dir().string()).size(), 2u) << "save_total_limit";

  // The final history, from the dumps: every row's weights were published by the learner that
  // trained it, within max_staleness.
  std::map<std::string, int> trained;                     // marker -> sequences
  std::map<int64_t, std::multiset<std::string>> by_step;  // step -> markers (one per prompt)
  for (int64_t step = 1; step <= max_steps; ++step) {
    std::string error;
    const auto d = ReadStep(dump_dir(), step, &error);
    ASSERT_TRUE(d.has_value()) << error;
    ASSERT_NE(d->learner_incarnation, 0) << "step " << step;
    for (size_t r = 0; r < d->markers.size(); ++r) {
      EXPECT_EQ(d->incarnations[r], d->learner_incarnation)
          << "step " << step << " row " << r << ": weights of another learner process";
      const int64_t staleness = (step - 1) - d->versions[r];
      EXPECT_GE(staleness, 0) << "step " << step << " row " << r << ": version " << d->versions[r]
                              << " not published before the step";
      EXPECT_LE(staleness, kMaxStaleness) << "step " << step << " row " << r;
      ++trained[d->markers[r]];
      if (r % kGenerations == 0) by_step[step].insert(d->markers[r]);
    }
  }
  // Every prompt trained once per completed pass, and at most once in the last one.
  std::string error;
  const auto ledger = ReadLedger(out_dir() / "ledger.sqlite", &error);
  ASSERT_TRUE(ledger.has_value()) << error;
  const int64_t passes_done = ledger->job_pass;
  int64_t total = 0;
  for (int i = 0; i < kPrompts; ++i) {
    const int times = trained[Marker(i)] / kGenerations;
    EXPECT_EQ(trained[Marker(i)] % kGenerations, 0) << Marker(i);
    EXPECT_GE(times, passes_done) << Marker(i) << " missed a completed pass";
    EXPECT_LE(times, passes_done + 1) << Marker(i) << " trained twice in a pass";
    total += times;
  }
  // At most a full batch per step (the trainer may refuse a group that went stale in the buffer;
  // its prompt is then trained later in its pass).
  EXPECT_LE(total, max_steps * kPromptsPerStep);
  EXPECT_GE(total, kPrompts * passes_done);
  EXPECT_EQ(trained.size(), static_cast<size_t>(kPrompts)) << "an unknown prompt was trained";
  EXPECT_GE(passes_done, 2) << "the run should cross several pass boundaries";
  for (const auto& [id, row] : ledger->prompts) EXPECT_NE(row.state, "REJECTED") << id;

  // The ledger's record agrees with the dumps step by step, one training per (prompt, pass),
  // passes 0, 1, ... in order for each prompt.
  const auto trainings = ReadTrainings(out_dir() / "ledger.sqlite", &error);
  ASSERT_TRUE(error.empty()) << error;
  std::map<int64_t, std::multiset<std::string>> ledger_by_step;
  std::map<std::string, std::set<int64_t>> passes_of;
  for (const Training& t : trainings) {
    ledger_by_step[t.step].insert(t.marker);
    EXPECT_TRUE(passes_of[t.marker].insert(t.pass).second) << t.marker << " pass " << t.pass;
  }
  EXPECT_EQ(ledger_by_step, by_step);
  for (const auto& [marker, passes] : passes_of) {
    EXPECT_EQ(static_cast<int64_t>(passes.size()), *passes.rbegin() + 1)
        << marker << " skipped a pass";
  }
}

}  // namespace
