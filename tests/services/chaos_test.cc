// Chaos with real processes (issue 12 "Prove it"): a `grpo learner`, three `grpo rollout`
// workers and `grpo submit` on loopback; faults drawn from a fixed seed (GRPO_CHAOS_SEED) for
// GRPO_CHAOS_SECONDS or until the job's GRPO_CHAOS_STEPS are done (defaults 90 s, 600 steps; the
// soak, chaos_soak_test, 1200 s and 9000 steps): learner SIGKILL (also right after a pass
// boundary), learner SIGTERM, worker SIGKILL and SIGTERM (each restarted under its old
// worker id), and worker SIGSTOP for longer than its leases and the weight-sync deadline (with
// episodes against `grpo env-server`: its SIGKILL and its SIGSTOP past the step deadline). Two
// workers take their weights over a Gloo group, one over GetWeights (issue 22's harness). Then
// the job must finish, and the
// invariants are checked from what the processes left behind, read independently of the code
// under test: the batch dumps of the final history (which prompts each optimizer step trained,
// with which policy version and learner incarnation), the ledger file (SQLite, read-only) and
// the checkpoints (their SHA256SUMS). RankChaosTest does the same for a learner group of two
// ranks whose ranks are killed and stopped.
#include <sys/wait.h>

#include <random>
#include <regex>

#include "learner/checkpoint.h"
#include "tests/services/fault_util.h"
#include "tests/services/history_check.h"
#include "tests/services/http_test_util.h"

namespace {

using namespace grpo::testing::faults;  // NOLINT: the shared fixture and helpers
using grpo::testing::ReservedPort;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::stoll(v) : fallback;
}

// One value of the learner's /metrics text (`series` as printed, labels included); nullopt
// when the scrape fails or the series is absent.
std::optional<double> MetricValue(int metrics_port, const std::string& series) {
  auto r = grpo::testing::HttpGet(static_cast<uint16_t>(metrics_port), "/metrics", 2000);
  if (!r || r->status != 200) return std::nullopt;
  const size_t at = r->body.find("\n" + series + " ");
  if (at == std::string::npos) return std::nullopt;
  return std::stod(r->body.substr(at + 1 + series.size() + 1));
}

// The longest weight-sync round any learner log reports, committed ("broadcast over gloo ...
// in X s") or failed ("failed after X s", timed from the start of the phase that failed: the join
// or the broadcast, each bounded by one deadline), in seconds; and how many rounds failed.
struct SyncRounds {
  double longest = 0;
  int failed = 0;
};
SyncRounds ReadSyncRounds(const std::string& log) {
  SyncRounds out;
  static const std::regex kRound(
      R"((broadcast over gloo \(epoch [0-9]+\) in|weight sync at epoch [0-9]+ failed after) ([0-9.]+) s)");
  for (auto it = std::sregex_iterator(log.begin(), log.end(), kRound); it != std::sregex_iterator();
       ++it) {
    out.longest = std::max(out.longest, std::stod((*it)[2].str()));
    if ((*it)[1].str().find("failed") != std::string::npos) ++out.failed;
  }
  return out;
}

class ChaosTest : public FaultToleranceTest {
 protected:
  static constexpr int kPrompts = 10;  // 5 optimizer steps per pass
  static constexpr double kLeaseSeconds = 3;
  static constexpr int kMaxStaleness = 2;
  static constexpr int kWorkers = 3;
  static constexpr int kGlooWorkers = 2;  // workers a and b; c takes GetWeights
  // The weight-sync deadline: above the heartbeat interval (2 s) plus a rendezvous, below a
  // SIGSTOP's length.
  static constexpr double kWeightSyncSeconds = 5;
  static constexpr auto kStopFor = milliseconds(8000);

  std::vector<std::string> LearnerConfig(int64_t max_steps) const {
    std::vector<std::string> args = {"--lease_seconds",
                                     std::to_string(kLeaseSeconds),
                                     "--max_steps",
                                     std::to_string(max_steps),
                                     "--save_steps",
                                     "3",
                                     "--save_total_limit",
                                     "2",
                                     "--max_staleness",
                                     std::to_string(kMaxStaleness),
                                     "--weight_sync_hostname",
                                     "127.0.0.1",
                                     "--weight_sync_timeout_seconds",
                                     std::to_string(kWeightSyncSeconds)};
    if (in_flight_) {
      args.insert(args.end(), {"--partial_rollouts", "true", "--continuous_batching", "true"});
    }
    if (episodes_) {
      // Multi-turn episodes of the built-in "turns" task (an "ok" from the user after each
      // turn, 3 turns): the random policy ends a turn (<|im_end|>) about once in 259 tokens, so
      // about 1 episode in 6 gets a second turn within 48 tokens. With env_faults_ the same task
      // served by `grpo env-server`, each reset and step under a deadline shorter than a stop.
      const std::string env =
          env_faults_ ? "grpc:127.0.0.1:" + std::to_string(env_port_->port()) : "builtin:turns";
      args.insert(args.end(), {"--env", env, "--max_turns", "3", "--reward_funcs", "env",
                               "--max_completion_length", "48"});
      if (env_faults_) {
        args.insert(args.end(),
                    {"--env_step_timeout_seconds", std::to_string(kEnvStepTimeoutSeconds)});
      }
    }
    if (streamed_) args.insert(args.end(), {"--weight_publish", "stream"});
    if (dynamic_sampling_) {
      // A 0/1 reward that two completions of the tiny model often share: with dynamic sampling
      // about half the groups are filtered (a byte in a-m among 8 random ones: p ~ 0.34, so
      // two completions agree with p ~ 0.55 at the start).
      args.insert(args.end(), {"--dynamic_sampling", "true", "--reward_funcs", "format"});
    }
    return args;
  }

  // `grpo env-server --task turns` on the test's reserved environment port (the same across
  // its restarts, as a Service's address would be).
  void StartEnvServer() {
    if (env_port_ == nullptr) env_port_ = std::make_unique<ReservedPort>();
    ASSERT_GT(env_port_->port(), 0);
    env_name_ = "env." + std::to_string(++env_servers_);
    ASSERT_GT(children_->Spawn(
                  env_name_, {GrpoBin(), "--log_level", "info", "env-server", "--task", "turns",
                              "--host", "127.0.0.1", "--port", std::to_string(env_port_->port())}),
              0);
    const json line = children_->FirstLine(env_name_, kStartTimeout);
    ASSERT_TRUE(line.is_object() && line.value("port", 0) == env_port_->port())
        << env_name_ << " did not start:\n"
        << Tail(children_->Err(env_name_));
  }

  // Worker `w` (0..kWorkers-1) again under its worker id; a new process name each time.
  void SpawnWorker(int w, int port) {
    const std::string id = std::string("worker-") + static_cast<char>('a' + w);
    const std::string name = id + "." + std::to_string(++spawned_[id]);
    worker_names_[w] = name;
    std::vector<std::string> extra;
    if (w < kGlooWorkers) {
      extra = {"--weight_sync_backend",         "gloo",
               "--weight_sync_hostname",        "127.0.0.1",
               "--weight_sync_timeout_seconds", std::to_string(kWeightSyncSeconds)};
    }
    if (dynamic_sampling_) {
      extra.insert(extra.end(), {"--reward_options", R"({"format": {"pattern": "[a-m]"}})"});
    }
    StartWorker(name, port, extra, id);
  }

  int StartLearnerIncarnation(int port, int64_t max_steps) {
    learner_name_ = "learner." + std::to_string(++learners_);
    const int bound = StartLearner(learner_name_, port, LearnerConfig(max_steps));
    metrics_ports_[learner_name_] = metrics_port_;
    return bound;
  }

  // Reads the running learner's refusals of groups of another incarnation and its longest
  // state-lock hold (each only grows during an incarnation: the last scrape before it ends is
  // its figure).
  void ScrapeLearner() {
    const int port = metrics_ports_[learner_name_];
    if (auto v = MetricValue(port, R"(grpo_groups_rejected_total{reason="unknown_policy"})")) {
      unknown_policy_[learner_name_] = *v;
    }
    if (auto v = MetricValue(port, "grpo_learner_lock_max_hold_seconds")) {
      lock_hold_[learner_name_] = *v;
    }
    if (auto v = MetricValue(port, R"(grpo_groups_rejected_total{reason="worker_failed"})")) {
      worker_failed_[learner_name_] = *v;
    }
  }

  int64_t JobPass() {
    std::string error;
    const auto ledger = ReadLedger(out_dir() / "ledger.sqlite", &error);
    return ledger ? ledger->job_pass : -1;
  }

  // Runs the chaos for `chaos_seconds` (or until the job's max_steps are done), then lets the
  // job finish and checks every invariant.
  void RunChaos(uint64_t seed, int64_t chaos_seconds, int64_t max_steps);

  bool dynamic_sampling_ = false;
  bool in_flight_ = false;  // partial_rollouts + continuous_batching
  bool episodes_ = false;   // multi-turn episodes (env builtin:turns)
  bool streamed_ = false;   // weight_publish stream
  // With episodes_: the environment served by `grpo env-server`, which the chaos also kills
  // (restarted after a pause) and stops past its step deadline.
  bool env_faults_ = false;
  static constexpr int kEnvStepTimeoutSeconds = 2;
  static constexpr auto kEnvStopFor = milliseconds(4000);

  // In-flight weight updates: in every step's dump each completion token's version is one the
  // learner had published when the step trained (step s trains at version s - 1), at most
  // max_staleness behind it, never decreasing along its completion, and its row's
  // policy_version is its oldest token's (with episodes, at most that: the group's is its
  // oldest turn's, and an episode may start after a sibling). Returns the rows whose tokens span
  // two versions.
  int64_t ExpectTokenVersionsHold(int64_t max_steps) {
    int64_t spanning = 0;
    for (int64_t step = 1; step <= max_steps; ++step) {
      const auto dump = ReadSafetensors(DumpPath(dump_dir(), step));
      if (!dump) {
        ADD_FAILURE() << "no dump of step " << step;
        continue;
      }
      const auto it = dump->find("token_versions");
      if (it == dump->end()) continue;  // no row of this step carried per-token versions
      const grpo::testing::DumpTensor& tv = it->second;
      const grpo::testing::DumpTensor& pv = dump->at("policy_version");
      const int64_t rows = tv.shape.at(0), cols = tv.shape.at(1);
      const int64_t trained_at = step - 1;
      const auto env_mask = dump->find("env_mask");
      for (int64_t r = 0; r < rows; ++r) {
        int64_t lo = -1, hi = -1;
        for (int64_t k = 0; k < cols; ++k) {
          const int64_t v = tv.ints[r * cols + k];
          if (v < 0) break;  // past the row's tokens
          // An episode's turn is sampled by one version: a newer one starts at an environment
          // token (which carries the next turn's version).
          if (episodes_ && hi >= 0 && v != hi) {
            const bool at_env_token =
                env_mask != dump->end() && env_mask->second.floats.at(r * cols + k) == 0.0;
            EXPECT_TRUE(at_env_token)
                << "step " << step << " row " << r << ": a turn mixes versions at token " << k;
          }
          EXPECT_LE(v, trained_at) << "step " << step << " row " << r << " token " << k;
          EXPECT_LE(trained_at - v, kMaxStaleness)
              << "step " << step << " row " << r << " token " << k;
          EXPECT_GE(v, hi) << "step " << step << " row " << r << " token " << k;
          if (lo < 0) lo = v;
          hi = v;
        }
        if (lo >= 0 && episodes_) {
          EXPECT_LE(pv.ints.at(r), lo) << "step " << step << " row " << r;
        } else if (lo >= 0) {
          EXPECT_EQ(pv.ints.at(r), lo) << "step " << step << " row " << r;
        }
        spanning += hi > lo ? 1 : 0;
      }
    }
    return spanning;
  }
  // The rows of the final history's dumps with an environment token: episodes stepped and
  // answered at least once.
  int64_t RowsWithObservations(int64_t max_steps) {
    int64_t answered = 0;
    for (int64_t step = 1; step <= max_steps; ++step) {
      const auto dump = ReadSafetensors(DumpPath(dump_dir(), step));
      if (!dump || !dump->count("env_mask")) continue;
      const grpo::testing::DumpTensor& mask = dump->at("env_mask");
      const grpo::testing::DumpTensor& real = dump->at("completion_mask");
      const int64_t rows = mask.shape.at(0), cols = mask.shape.at(1);
      for (int64_t r = 0; r < rows; ++r) {
        bool observed = false;
        for (int64_t k = 0; k < cols; ++k) {
          const double is_real = real.floats.empty() ? static_cast<double>(real.ints[r * cols + k])
                                                     : real.floats[r * cols + k];
          observed = observed || (is_real != 0 && mask.floats[r * cols + k] == 0);
        }
        answered += observed ? 1 : 0;
      }
    }
    return answered;
  }

  std::string learner_name_;
  int learners_ = 0;
  std::map<std::string, int> spawned_;
  std::string worker_names_[kWorkers];
  std::map<std::string, int> metrics_ports_;      // by learner process name
  std::map<std::string, double> unknown_policy_;  // refusals, by learner process name
  std::map<std::string, double> lock_hold_;       // seconds, by learner process name
  std::map<std::string, double> worker_failed_;   // failed groups refused, by learner process
  std::unique_ptr<ReservedPort> env_port_;
  std::string env_name_;
  int env_servers_ = 0;
};

void ChaosTest::RunChaos(uint64_t seed, int64_t chaos_seconds, int64_t max_steps) {
  WriteDataset(dir_ / "data.jsonl", kPrompts);
  if (env_faults_) {
    ASSERT_NO_FATAL_FAILURE(StartEnvServer());
  }
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
    ScrapeLearner();
    const int fault = std::uniform_int_distribution<int>(0, env_faults_ ? 11 : 9)(rng);
    const int w = std::uniform_int_distribution<int>(0, kWorkers - 1)(rng);
    if (fault == 10) {
      // Down for 0.5-3 s: the resets and steps in that time fail (Unavailable).
      injected["environment server SIGKILL"] += 1;
      children_->Kill(env_name_);
      std::this_thread::sleep_for(milliseconds(std::uniform_int_distribution<int>(500, 3000)(rng)));
      ASSERT_NO_FATAL_FAILURE(StartEnvServer());
    } else if (fault == 11) {
      injected["environment server SIGSTOP past its step deadline"] += 1;
      children_->Signal(env_name_, SIGSTOP);
      std::this_thread::sleep_for(kEnvStopFor);
      children_->Signal(env_name_, SIGCONT);
    } else if (fault == 0) {
      injected["learner SIGKILL"] += 1;
      children_->Kill(learner_name_);
      restart_learner();
    } else if (fault == 1) {
      // Right after a pass boundary: wait (up to 20 s) for the ledger's pass to move.
      const int64_t pass = JobPass();
      const bool moved = WaitUntil([&] { return JobPass() > pass; }, seconds(20), milliseconds(5));
      injected[moved ? "learner SIGKILL at a pass boundary" : "learner SIGKILL"] += 1;
      ScrapeLearner();
      children_->Kill(learner_name_);
      restart_learner();
    } else if (fault == 2) {
      injected["learner SIGTERM"] += 1;
      ScrapeLearner();
      children_->Signal(learner_name_, SIGTERM);
      if (!children_->Wait(learner_name_, seconds(60)).has_value()) {
        ADD_FAILURE() << "the learner did not stop on SIGTERM\n"
                      << Logs({learner_name_}) << children_->Stacks(learner_name_);
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
                      << Logs({worker_names_[w]}) << children_->Stacks(worker_names_[w]);
        children_->Kill(worker_names_[w]);
      }
      SpawnWorker(w, port);
    } else {
      injected[w < kGlooWorkers ? "worker SIGSTOP past its leases (gloo)"
                                : "worker SIGSTOP past its leases (grpc)"] += 1;
      children_->Signal(worker_names_[w], SIGSTOP);
      std::this_thread::sleep_for(kStopFor);
      children_->Signal(worker_names_[w], SIGCONT);
    }
  }
  std::string summary;
  for (const auto& [what, n] : injected) summary += "  " + what + ": " + std::to_string(n) + "\n";
  std::cerr << "chaos (seed " << seed << ", " << chaos_seconds << " s, " << learners_
            << " learner processes" << (finished_early ? ", the job ended during it" : "") << "):\n"
            << summary;

  // The job finishes with every process up.
  std::optional<int> code = learner_exit;
  for (auto end = std::chrono::steady_clock::now() + seconds(480);
       !code && std::chrono::steady_clock::now() < end;) {
    ScrapeLearner();
    code = children_->Wait(learner_name_, seconds(1));
  }
  ASSERT_TRUE(code.has_value()) << "the job did not finish\n" << Logs({learner_name_});
  EXPECT_EQ(*code, 0) << Logs({learner_name_});
  for (const auto& name : worker_names_) {
    auto wc = children_->Wait(name, seconds(30));
    std::string stacks;
    if (!wc) {
      stacks = children_->Stacks(name);  // where it hangs, for the message below
      children_->Signal(name, SIGTERM);
      wc = children_->Wait(name, seconds(30));
    }
    EXPECT_EQ(wc, std::optional<int>(0)) << Logs({name}) << stacks;
  }

  // Issue 22 items 1, 2 and 6: per learner process, the groups refused as unknown_policy (of
  // weights it did not publish) are at most those in flight when the one before it ended: a
  // round of kPromptsPerStep groups per worker, twice over for a push that was retried. The
  // longest weight-sync round, committed or failed, is one deadline: a stopped worker costs its
  // group no more. The longest hold of the learner's state lock is reported.
  const double refusal_bound = 2.0 * kWorkers * kPromptsPerStep;
  double refused_total = 0, longest_hold = 0;
  SyncRounds rounds;
  std::cerr << "per learner process: unknown_policy refusals, longest state-lock hold (s), "
               "longest weight-sync round (s), failed rounds\n";
  for (int i = 1; i <= learners_; ++i) {
    const std::string name = "learner." + std::to_string(i);
    const SyncRounds r = ReadSyncRounds(ReadFile(children_->Err(name)));
    rounds.longest = std::max(rounds.longest, r.longest);
    rounds.failed += r.failed;
    refused_total += unknown_policy_[name];
    longest_hold = std::max(longest_hold, lock_hold_[name]);
    std::cerr << "  " << name << ": " << unknown_policy_[name] << ", " << lock_hold_[name] << ", "
              << r.longest << ", " << r.failed << "\n";
    EXPECT_LE(unknown_policy_[name], refusal_bound)
        << name << " refused more groups of another learner's weights than were in flight\n"
        << Logs({name});
  }
  std::cerr << "unknown_policy refusals in all: " << refused_total
            << "; longest state-lock hold: " << longest_hold
            << " s; longest weight-sync round: " << rounds.longest << " s (" << rounds.failed
            << " failed rounds)\n";
  EXPECT_LE(rounds.longest, kWeightSyncSeconds + 1.5)
      << "a weight-sync round outlasted its deadline (a stalled worker held the group)";

  // The latest checkpoint is the final step and verifies.
  const std::string latest = [&] {
    const std::string s = ReadFile(out_dir() / "latest");
    return s.substr(0, s.find('\n'));
  }();
  ASSERT_EQ(latest, "checkpoint-" + std::to_string(max_steps));
  EXPECT_TRUE(grpo::learner::VerifyCheckpoint((out_dir() / latest).string()).ok());
  EXPECT_LE(grpo::learner::ListCheckpoints(out_dir().string()).size(), 2u) << "save_total_limit";

  // The final history: the dumps, the ledger's trainings and its passes agree (exactly once per
  // pass, only the live learner's weights within max_staleness).
  const int64_t passes_done = ExpectHistoryHolds(out_dir(), dump_dir(), max_steps, kPrompts,
                                                 kMaxStaleness, dynamic_sampling_);
  EXPECT_GE(passes_done, 2) << "the run should cross several pass boundaries";
  if (in_flight_) {
    const int64_t spanning = ExpectTokenVersionsHold(max_steps);
    std::cerr << "rows whose tokens span two policy versions: " << spanning << "\n";
    EXPECT_GT(spanning, 0) << "no completion took a new policy in flight: the test showed nothing";
  }
  if (env_faults_) {
    // The groups the environment's faults failed gave their leases back (refused as
    // worker_failed, never trained: the history above holds); without one the faults missed.
    double failed = 0;
    for (const auto& [name, n] : worker_failed_) failed += n;
    std::cerr << "groups failed by the environment and given back: " << failed << "\n";
    EXPECT_GT(failed, 0) << "no environment fault failed a group: the test showed nothing";
  }
  if (episodes_) {
    const int64_t answered = RowsWithObservations(max_steps);
    std::cerr << "trained rows with an environment observation: " << answered << "\n";
    EXPECT_GT(answered, 0) << "no episode got past its first turn: the test showed nothing";
  }
  if (dynamic_sampling_) {
    std::string error;
    int filtered = 0, trained = 0;
    for (const Training& t : ReadTrainings(out_dir() / "ledger.sqlite", &error)) {
      ++(t.filtered ? filtered : trained);
    }
    std::cerr << "the ledger's final history: " << trained << " groups trained, " << filtered
              << " filtered, over " << passes_done << " completed passes\n";
  }
}

TEST_F(ChaosTest, RandomFaultsLoseNothingTrainNothingTwiceAndTheJobFinishes) {
  RunChaos(static_cast<uint64_t>(EnvInt("GRPO_CHAOS_SEED", 12)), EnvInt("GRPO_CHAOS_SECONDS", 90),
           EnvInt("GRPO_CHAOS_STEPS", 600));
}

// Issue 23: dynamic sampling under the same faults. About half the groups are filtered; a
// filtered prompt is done with its pass untrained, so the invariants read: every prompt trained
// or filtered once per completed pass, never both, never twice; no trained group with equal
// rewards; restarts undo filterings after their checkpoint as they undo trainings.
TEST_F(ChaosTest, DynamicSamplingUnderRandomFaultsFiltersWithoutLosingOrRepeating) {
  dynamic_sampling_ = true;
  RunChaos(static_cast<uint64_t>(EnvInt("GRPO_CHAOS_SEED", 5)), EnvInt("GRPO_CHAOS_DS_SECONDS", 45),
           EnvInt("GRPO_CHAOS_DS_STEPS", 200));
}

// Issue 26: in-flight weight updates (partial_rollouts) with continuous batching under the same
// faults: besides the invariants above, every token's own version is within max_staleness of the
// step that trained it.
TEST_F(ChaosTest, InFlightUpdatesUnderRandomFaultsKeepEveryTokenWithinStaleness) {
  in_flight_ = true;
  RunChaos(static_cast<uint64_t>(EnvInt("GRPO_CHAOS_SEED", 7)), EnvInt("GRPO_CHAOS_IF_SECONDS", 45),
           EnvInt("GRPO_CHAOS_IF_STEPS", 200));
}

// Issue 26 with multi-turn episodes: the same faults with in-flight updates and continuous
// batching over episodes of the built-in "turns" task (StreamEpisodes: a newer policy taken
// between two turns), so a group's turns may be of two versions; every token's own version is
// within max_staleness of the step that trained it, and a version changes only between turns.
TEST_F(ChaosTest,
       MultiTurnEpisodesWithInFlightUpdatesUnderRandomFaultsKeepEveryTokenWithinStaleness) {
  in_flight_ = true;
  episodes_ = true;
  RunChaos(static_cast<uint64_t>(EnvInt("GRPO_CHAOS_SEED", 7)), EnvInt("GRPO_CHAOS_EP_SECONDS", 45),
           EnvInt("GRPO_CHAOS_EP_STEPS", 400));
}

// Hardening: the same episodes against an environment server that the chaos also kills
// (restarted on its address after 0.5-3 s) and stops for longer than a step's deadline. A group
// whose episode's reset or step failed gives its lease back (worker_failed) and its prompt is
// trained later, once; the job finishes.
TEST_F(ChaosTest, EnvironmentServerFaultsInMultiTurnEpisodesLoseNothingTrainNothingTwice) {
  in_flight_ = true;
  episodes_ = true;
  env_faults_ = true;
  RunChaos(static_cast<uint64_t>(EnvInt("GRPO_CHAOS_SEED", 7)),
           EnvInt("GRPO_CHAOS_ENV_SECONDS", 45), EnvInt("GRPO_CHAOS_ENV_STEPS", 400));
}

// Issue 21 item 3: the weights streamed by the training thread (weight_publish stream), with no
// snapshot, to the gloo groups and GetWeights, under the same faults: a killed or stopped
// worker costs a stream one deadline, and every invariant holds.
TEST_F(ChaosTest, StreamedWeightsUnderRandomFaultsLoseNothingTrainNothingTwice) {
  streamed_ = true;
  RunChaos(static_cast<uint64_t>(EnvInt("GRPO_CHAOS_SEED", 7)), EnvInt("GRPO_CHAOS_ST_SECONDS", 45),
           EnvInt("GRPO_CHAOS_ST_STEPS", 200));
}

// Issue 21 item 5: a learner group of two ranks (launched as torchrun does: RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) under rank faults, one after another: rank 1 SIGKILLed, rank 1
// SIGSTOPped past the collectives' deadline, rank 0 SIGKILLed. Each time the survivor ends on
// its own (rank 0 exits 1 naming what failed: at once for a dead rank, at the deadline for a
// stopped one; rank 1 once rank 0's store is gone), the test restarts the whole group as an
// orchestrator would (the stopped rank is killed first), and the job resumes from rank 0's last
// checkpoint. The worker runs throughout. Then the job finishes, and the final history holds as
// in the chaos test above: rank 0's batch dumps, the ledger and the checkpoints say that every
// prompt was trained once per pass, within max_staleness, by the weights of the group that
// trained it.
class RankChaosTest : public FaultToleranceTest {
 protected:
  static constexpr int kPrompts = 8;  // 2 ranks x 1 micro-batch of 2 prompts: 2 steps a pass
  static constexpr int kMaxSteps = 14;
  static constexpr int kMaxStaleness = 2;
  static constexpr int kRankTimeoutSeconds = 6;

  std::string RankName(int rank) const {
    return "rank" + std::to_string(rank) + "." + std::to_string(groups_);
  }

  // Starts the next incarnation of the group, rank 1 first (it waits for rank 0's store), with
  // rank 0 serving on `port`; returns rank 0's bound port (0 on failure).
  int StartGroup(int port) {
    ++groups_;
    master_port_ = std::make_unique<ReservedPort>();  // a fresh rendezvous for each group
    std::vector<std::string> extra = {"--max_steps",
                                      std::to_string(kMaxSteps),
                                      "--save_steps",
                                      "2",
                                      "--max_staleness",
                                      std::to_string(kMaxStaleness),
                                      "--rank_timeout_seconds",
                                      std::to_string(kRankTimeoutSeconds)};
    extra.insert(extra.end(), mode_flags_.begin(), mode_flags_.end());
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(master_port_->port()).c_str(), 1);
    ::setenv("RANK", "1", 1);
    int bound = 0;
    std::vector<std::string> rank1 = extra;
    rank1.insert(rank1.end(), rank1_flags_.begin(), rank1_flags_.end());
    std::vector<std::string> args = LearnerArgs(port, rank1);
    if (!rank1_hides_.empty()) {
      // A mount namespace of its own, with an empty tmpfs over the directory.
      args.insert(args.begin(),
                  {"/usr/bin/unshare", "-m", "/bin/sh", "-c",
                   "mount -t tmpfs grpo-hidden \"$0\" && exec \"$@\"", rank1_hides_.string()});
    }
    if (children_->Spawn(RankName(1), args) > 0) {
      ::setenv("RANK", "0", 1);
      bound = StartLearner(RankName(0), port, extra);
    } else {
      ADD_FAILURE() << "fork failed";
    }
    for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
    return bound;
  }

  // Waits until this group's rank 1 has trained up to step `step` (its log's "now at step N").
  bool WaitForStep(int64_t step) {
    static const std::regex kNow("now at step ([0-9]+)");
    return WaitUntil(
        [&] {
          const std::string log = ReadFile(children_->Err(RankName(1)));
          int64_t last = -1;
          for (auto it = std::sregex_iterator(log.begin(), log.end(), kNow);
               it != std::sregex_iterator(); ++it) {
            last = std::stoll((*it)[1].str());
          }
          return last >= step;
        },
        seconds(120), milliseconds(50));
  }

  std::string GroupLogs() { return Logs({RankName(0), RankName(1), "worker-a"}); }

  // The faults, one group after another, and the final history (the tests below).
  void RunFaults();

  // Every rank at full_shard, reading the tiny model that `grpo init-model` writes to `model`.
  void UseFullShardFrom(const fs::path& model) {
    int rc = -1;
    grpo::testing::RunCommand(GrpoBin() + " init-model --preset tiny --seed 3 --out " +
                                  model.string() + " >" + (dir_ / "init.out").string() + " 2>&1",
                              &rc);
    ASSERT_EQ(rc, 0) << ReadFile(dir_ / "init.out");
    mode_flags_ = {"--fsdp", "full_shard", "--model_name_or_path", model.string()};
  }

  int groups_ = 0;
  std::unique_ptr<ReservedPort> master_port_;
  std::vector<std::string> mode_flags_;   // every rank's, beside the fixture's
  std::vector<std::string> rank1_flags_;  // rank 1's alone, after the others (they win)
  fs::path rank1_hides_;  // a directory rank 1 does not see (its mount namespace's own tmpfs)
};

TEST_F(RankChaosTest, KilledAndStoppedRanksRestartTheGroupAndLoseNothing) {
  ASSERT_NO_FATAL_FAILURE(RunFaults());
}

// The same faults at full_shard from a model directory: every group's ranks read only their
// shards of the model (sharded loading), and each restarted group's ranks read their shards of
// rank 0's last checkpoint (sharded resume: they share its output_dir, so none is handed out
// through rank 0).
TEST_F(RankChaosTest, FullShardRanksLoadAndResumeFromTheirShardsAndLoseNothing) {
  const fs::path model = dir_ / "model";
  ASSERT_NO_FATAL_FAILURE(UseFullShardFrom(model));
  ASSERT_NO_FATAL_FAILURE(RunFaults());
  for (int group = 1; group <= groups_; ++group) {
    for (int rank : {0, 1}) {
      const std::string log =
          ReadFile(children_->Err("rank" + std::to_string(rank) + "." + std::to_string(group)));
      EXPECT_NE(log.find("sharded loading: this rank reads only its shards of " + model.string()),
                std::string::npos)
          << "group " << group << " rank " << rank << "\n"
          << log;
      EXPECT_EQ(log.find("hands each rank its chunk"), std::string::npos)
          << "group " << group << " rank " << rank << "\n"
          << log;
    }
  }
  // Groups 2-4 resumed from a checkpoint (rank 0's log names it).
  for (int group = 2; group <= groups_; ++group) {
    EXPECT_NE(ReadFile(children_->Err("rank0." + std::to_string(group))).find("resumed from"),
              std::string::npos)
        << "group " << group;
  }
}

// The same faults where rank 1 does not see rank 0's output_dir, as a Kubernetes pod whose
// volume is not rank 0's: rank 1 runs in a mount namespace of its own in which that directory is
// an empty tmpfs (`unshare -m`, root; without the privilege for one, rank 1 gets an output_dir
// of its own instead, and still sees rank 0's checkpoints at their path). Every checkpoint's
// AdamW state goes through rank 0 a parameter at a time into one file, and every resumed group's
// rank 1 takes its runs of that state, and (hidden) its chunks of the weights, from rank 0.
// Nothing is lost or trained twice.
TEST_F(RankChaosTest, FullShardRanksThatDoNotShareOutputDirResumeThroughRankZero) {
  const fs::path model = dir_ / "model";
  ASSERT_NO_FATAL_FAILURE(UseFullShardFrom(model));
  int rc = -1;
  grpo::testing::RunCommand("/usr/bin/unshare -m /bin/true 2>&1", &rc);
  const bool hidden = rc == 0;
  if (hidden) {
    fs::create_directories(out_dir());  // the mount point, before rank 1 starts
    rank1_hides_ = out_dir();
  } else {
    rank1_flags_ = {"--output_dir", (dir_ / "rank1-output").string()};
  }
  std::cerr << (hidden ? "rank 1 in a mount namespace without rank 0's output_dir\n"
                       : "no mount namespace here: rank 1 on an output_dir of its own\n");
  ASSERT_NO_FATAL_FAILURE(RunFaults());
  for (int group = 1; group <= groups_; ++group) {
    EXPECT_NE(ReadFile(children_->Err("rank0." + std::to_string(group)))
                  .find("the AdamW state goes through rank 0, a parameter at a time"),
              std::string::npos)
        << "group " << group;
  }
  for (int group = 2; group <= groups_; ++group) {
    const std::string log0 = ReadFile(children_->Err("rank0." + std::to_string(group)));
    EXPECT_NE(log0.find("resumed from"), std::string::npos) << "group " << group;
    if (hidden) {
      EXPECT_NE(log0.find("rank 0 reads the weights and hands each rank its chunk"),
                std::string::npos)
          << "group " << group << "\n"
          << log0;
    }
  }
}

void RankChaosTest::RunFaults() {
  WriteDataset(dir_ / "data.jsonl", kPrompts);
  reserved_port_ = std::make_unique<ReservedPort>();
  const int port = reserved_port_->port();
  ASSERT_GT(port, 0);
  ASSERT_EQ(StartGroup(port), port);
  ASSERT_TRUE(Submit(port, dir_ / "data.jsonl"));
  StartWorker("worker-a", port);

  // 1. Rank 1 dies: rank 0's next collective fails at once (the connection closed).
  ASSERT_TRUE(WaitForStep(3)) << GroupLogs();
  children_->Kill(RankName(1));
  auto start = std::chrono::steady_clock::now();
  auto code = children_->Wait(RankName(0), seconds(60));
  ASSERT_TRUE(code.has_value()) << "rank 0 did not end after rank 1 died\n" << GroupLogs();
  EXPECT_EQ(*code, 1) << GroupLogs();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(kRankTimeoutSeconds + 20));
  const auto seconds_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  std::cerr << "rank 1 killed: rank 0 exited " << *code << " after " << seconds_since(start)
            << " s\n";
  std::string log0 = ReadFile(children_->Err(RankName(0)));
  EXPECT_NE(log0.find("a rank left the group"), std::string::npos) << log0;
  EXPECT_NE(log0.find("job failed"), std::string::npos) << log0;

  // 2. Rank 1 stops: rank 0 fails at the deadline; the orchestrator kills the stopped rank.
  ASSERT_EQ(StartGroup(port), port) << GroupLogs();
  ASSERT_TRUE(WaitForStep(6)) << GroupLogs();
  children_->Signal(RankName(1), SIGSTOP);
  start = std::chrono::steady_clock::now();
  code = children_->Wait(RankName(0), seconds(90));
  ASSERT_TRUE(code.has_value()) << "rank 0 did not end after rank 1 stopped\n" << GroupLogs();
  EXPECT_EQ(*code, 1) << GroupLogs();
  const double waited = seconds_since(start);
  std::cerr << "rank 1 stopped: rank 0 exited " << *code << " after " << waited << " s\n";
  EXPECT_GE(waited, kRankTimeoutSeconds - 1.0) << "rank 0 failed before the deadline";
  log0 = ReadFile(children_->Err(RankName(0)));
  EXPECT_NE(log0.find("a rank stalled"), std::string::npos) << log0;
  EXPECT_NE(log0.find("deadline rank_timeout_seconds"), std::string::npos) << log0;
  children_->Kill(RankName(1));
  ASSERT_TRUE(children_->Wait(RankName(1), seconds(30)).has_value());

  // 3. Rank 0 dies: rank 1 ends once rank 0's store is gone.
  ASSERT_EQ(StartGroup(port), port) << GroupLogs();
  ASSERT_TRUE(WaitForStep(9)) << GroupLogs();
  children_->Kill(RankName(0));
  start = std::chrono::steady_clock::now();
  code = children_->Wait(RankName(1), seconds(60));
  ASSERT_TRUE(code.has_value()) << "rank 1 did not end after rank 0 died\n" << GroupLogs();
  std::cerr << "rank 0 killed: rank 1 exited " << *code << " after " << seconds_since(start)
            << " s\n";
  EXPECT_EQ(*code, 1) << GroupLogs();

  // 4. The last group runs the job to max_steps; both ranks and the worker exit 0.
  ASSERT_EQ(StartGroup(port), port) << GroupLogs();
  code = children_->Wait(RankName(0), seconds(300));
  ASSERT_TRUE(code.has_value()) << "the job did not finish\n" << GroupLogs();
  EXPECT_EQ(*code, 0) << GroupLogs();
  EXPECT_EQ(children_->Wait(RankName(1), seconds(30)), std::optional<int>(0)) << GroupLogs();
  EXPECT_EQ(children_->Wait("worker-a", seconds(60)), std::optional<int>(0)) << GroupLogs();

  const std::string latest = [&] {
    const std::string s = ReadFile(out_dir() / "latest");
    return s.substr(0, s.find('\n'));
  }();
  ASSERT_EQ(latest, "checkpoint-" + std::to_string(kMaxSteps));
  EXPECT_TRUE(grpo::learner::VerifyCheckpoint((out_dir() / latest).string()).ok());
  const int64_t passes = ExpectHistoryHolds(out_dir(), dump_dir(), kMaxSteps, kPrompts,
                                            kMaxStaleness, /*dynamic_sampling=*/false,
                                            /*prompts_per_step=*/2 * kPromptsPerStep);
  std::cerr << groups_ << " groups; the final history: " << kMaxSteps << " steps, " << passes
            << " completed passes of " << kPrompts << " prompts\n";
  EXPECT_GE(passes, 3) << "the run should cross several pass boundaries";
}

}  // namespace
