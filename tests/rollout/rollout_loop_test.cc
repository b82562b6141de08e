// RolloutLoop (rollout/rollout_loop.h) through FakeLearnerLink and FakeWeightReceiver: the
// worker's loop without a gRPC server. Expected ids are the byte tokenizer's bytes written out
// by hand, rewards -|target - completion tokens| (the length reward), counts from the script of
// each test.
#include "rollout/rollout_loop.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "common/metrics/metrics.h"
#include "common/model/model_config.h"
#include "rollout/env/turns_task.h"
#include "rollout/fake_learner_link.h"
#include "tests/rollout/scaled_tiny_model.h"

namespace grpo::rollout {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

constexpr int64_t kTargetLength = 3;
constexpr int kGenerations = 4;
const char* kPromptRow = R"({"prompt": "Say hi."})";
const char* kMessagesRow = R"({"messages": [{"role": "user", "content": "Hi"}]})";

std::shared_ptr<const common::Model> TinyModel(uint64_t seed) {
  auto config = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(config.ok());
  auto model = common::Model::InitRandom(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::shared_ptr<const common::Model>(std::move(model).value());
}

json LearnerConfig() {
  return {{"num_generations", kGenerations},  {"max_prompt_length", 64},
          {"max_completion_length", 6},       {"reward_funcs", json::array({"length"})},
          {"per_device_train_batch_size", 8}, {"seed", 7}};
}

// A learner with `rows`, the tiny model as version 1, and the config above.
struct Fixture {
  FakeLearnerLink learner;
  FakeWeightReceiver receiver{&learner};
  explicit Fixture(std::vector<std::string> rows) {
    learner.rows = std::move(rows);
    learner.model = TinyModel(11);
    learner.config_json = LearnerConfig().dump();
  }
};

RolloutLoopOptions Options(const std::atomic<bool>* stop = nullptr) {
  RolloutLoopOptions o;
  o.prompts_per_lease = 2;
  o.reward_options = {{"length", {{"target_length", kTargetLength}}}};
  o.backoff.initial = milliseconds(2);
  o.backoff.max = milliseconds(20);
  o.stop = stop;
  return o;
}

std::unique_ptr<RolloutLoop> MakeLoop(Fixture& f, RolloutLoopOptions o) {
  auto loop = RolloutLoop::Create(std::move(o), &f.learner, &f.receiver);
  EXPECT_TRUE(loop.ok()) << loop.status().ToString();
  return std::move(loop).value();
}

std::vector<int32_t> Bytes(const std::string& s) {
  std::vector<int32_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

bool SameParameters(const common::Model& a, const common::Model& b) {
  const auto pa = a.NamedParameters(), pb = b.NamedParameters();
  if (pa.size() != pb.size()) return false;
  for (size_t i = 0; i < pa.size(); ++i) {
    const at::Tensor x = pa[i].second.contiguous(), y = pb[i].second.contiguous();
    if (pa[i].first != pb[i].first || x.nbytes() != y.nbytes() ||
        std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

// A generator window hook that publishes version 2 (other weights) at the learner at the third
// decode step and holds the decoding thread there until *loop installed it (the heartbeat reports
// it, the in-flight fetcher receives it; 30 s at most): *installed says whether it did.
std::function<void(int64_t)> PublishVersion2AtStep3(Fixture& f, RolloutLoop** loop,
                                                    std::atomic<bool>* installed) {
  auto waited = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<const common::Model> v2 = TinyModel(22);
  return [&f, loop, installed, waited, v2](int64_t steps) {
    if (steps != 3 || waited->exchange(true)) return;
    {
      common::MutexLock lock(&f.learner.mu);
      f.learner.version = 2;
      f.learner.model = v2;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((*loop)->policy_version() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    *installed = (*loop)->policy_version() == 2;
  };
}

// Runs a loop over `f` (Options()) while PublishVersion2AtStep3 publishes version 2 during its
// first generation: its stats (nullopt, with the failure added, when Run failed), and in
// *installed whether it took version 2 while generating.
std::optional<WorkerStats> RunWithVersion2AtStep3(Fixture& f, bool* installed) {
  RolloutLoopOptions o = Options();
  RolloutLoop* loop = nullptr;
  std::atomic<bool> took{false};
  o.generator_window_hook = PublishVersion2AtStep3(f, &loop, &took);
  auto owned = MakeLoop(f, o);
  loop = owned.get();
  const Status s = loop->Run();
  *installed = took.load();
  if (!s.ok()) {
    ADD_FAILURE() << s.ToString();
    return std::nullopt;
  }
  return loop->stats();
}

TEST(RolloutLoop, RegistersTakesWeightsAndPushesScoredGroupsUnderTheirLeases) {
  Fixture f({kPromptRow, kMessagesRow});
  auto loop = MakeLoop(f, Options());
  ASSERT_TRUE(loop->Run().ok());

  ASSERT_NE(loop->policy(), nullptr);
  EXPECT_TRUE(SameParameters(*loop->policy(), *f.learner.model));
  EXPECT_EQ(loop->policy_version(), 1);
  EXPECT_EQ(loop->worker_id(), "worker-1");
  EXPECT_EQ(loop->rank(), 1);
  EXPECT_EQ(loop->config().num_generations, kGenerations);

  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.registers.size(), 1u);
  EXPECT_EQ(f.learner.registers[0].weight_sync_backend, "fake");
  EXPECT_EQ(f.learner.registers[0].worker_id, "");
  EXPECT_GT(f.learner.registers[0].pid, 0);
  EXPECT_EQ(f.learner.weights_served, std::vector<int64_t>{1});
  ASSERT_EQ(f.learner.pushed.size(), 2u);
  std::map<std::string, const common::RolloutGroup*> by_lease;
  for (const auto& g : f.learner.pushed) by_lease[g.lease_id] = &g;
  ASSERT_EQ(by_lease.count("lease-0"), 1u);
  ASSERT_EQ(by_lease.count("lease-1"), 1u);
  EXPECT_EQ(by_lease["lease-0"]->prompt_id, "prompt-0");
  EXPECT_EQ(by_lease["lease-1"]->prompt_id, "prompt-1");
  EXPECT_EQ(by_lease["lease-0"]->prompt_ids, Bytes("Say hi."));
  std::vector<int32_t> chatml = {257};  // <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
  for (int32_t b : Bytes("user\nHi")) chatml.push_back(b);
  chatml.push_back(258);
  chatml.push_back('\n');
  chatml.push_back(257);
  for (int32_t b : Bytes("assistant\n")) chatml.push_back(b);
  EXPECT_EQ(by_lease["lease-1"]->prompt_ids, chatml);
  for (size_t i = 0; i < f.learner.pushed.size(); ++i) {
    const common::RolloutGroup& g = f.learner.pushed[i];
    EXPECT_EQ(f.learner.pushed_worker_ids[i], "worker-1");
    EXPECT_EQ(g.policy_version, 1);
    EXPECT_EQ(g.policy_incarnation, "inc-1");
    ASSERT_EQ(g.completions.size(), static_cast<size_t>(kGenerations));
    for (const auto& c : g.completions) {
      ASSERT_GE(c.token_ids.size(), 1u);
      ASSERT_LE(c.token_ids.size(), 6u);
      ASSERT_EQ(c.rewards.size(), 1u);
      const double n = static_cast<double>(c.token_ids.size());
      EXPECT_EQ(c.rewards[0], std::optional<double>(-std::abs(kTargetLength - n)));
    }
  }
  const WorkerStats st = loop->stats();
  EXPECT_EQ(st.registrations, 1);
  EXPECT_EQ(st.rounds, 1);
  EXPECT_EQ(st.leases, 2);
  EXPECT_EQ(st.groups_pushed, 2);
  EXPECT_EQ(st.groups_accepted, 2);
  EXPECT_EQ(st.weight_fetches, 1);
  EXPECT_EQ(st.prompts_failed, 0);
}

// Rows that do not parse (no prompt, not JSON, an empty prompt) are skipped: their leases expire
// (the learner checks rows at submission). A prompt that cannot be generated from (too long
// with truncate_prompt=reject) is pushed as its failure with prompt_failed: the learner rejects
// it. Per call (RunRound) and streamed (RunStream).
void RunWithBadPrompts(bool continuous) {
  Fixture f({R"({"prompt": "This prompt is far longer than sixteen bytes."})",
             R"({"question": "no prompt key"})", "not json", R"({"prompt": ""})", kPromptRow});
  json config = LearnerConfig();
  config["truncate_prompt"] = "reject";
  config["max_prompt_length"] = 16;
  config["continuous_batching"] = continuous;
  f.learner.config_json = config.dump();
  f.learner.leases_per_call = 5;
  auto o = Options();
  o.prompts_per_lease = 5;
  auto loop = MakeLoop(f, o);
  ASSERT_TRUE(loop->Run().ok());
  EXPECT_EQ(loop->stats().prompts_failed, 4);
  EXPECT_EQ(loop->stats().leases, 5);
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), 2u);
  std::map<std::string, const common::RolloutGroup*> by_lease;
  for (const common::RolloutGroup& g : f.learner.pushed) by_lease[g.lease_id] = &g;
  ASSERT_EQ(by_lease.count("lease-0"), 1u);
  EXPECT_TRUE(by_lease["lease-0"]->prompt_failed);
  EXPECT_NE(by_lease["lease-0"]->failure.find("max_prompt_length 16"), std::string::npos)
      << by_lease["lease-0"]->failure;
  EXPECT_TRUE(by_lease["lease-0"]->completions.empty());
  ASSERT_EQ(by_lease.count("lease-4"), 1u);
  EXPECT_TRUE(by_lease["lease-4"]->failure.empty());
  EXPECT_EQ(by_lease["lease-4"]->completions.size(), static_cast<size_t>(kGenerations));
}

TEST(RolloutLoop, BadPromptsAreSkippedAndCounted) { RunWithBadPrompts(/*continuous=*/false); }

TEST(RolloutLoop, StreamedBadPromptsAreSkippedAndCounted) {
  RunWithBadPrompts(/*continuous=*/true);
}

TEST(RolloutLoop, NewerPolicyVersionIsFetchedBeforeTheNextRound) {
  Fixture f({kPromptRow, kMessagesRow, kPromptRow, kMessagesRow});
  const std::shared_ptr<const common::Model> v2 = TinyModel(22);
  f.learner.after_push = [v2](FakeLearnerLink& l) {
    if (l.version == 1) {
      l.version = 2;
      l.model = v2;
    }
  };
  auto loop = MakeLoop(f, Options());
  ASSERT_TRUE(loop->Run().ok());
  EXPECT_TRUE(SameParameters(*loop->policy(), *v2));
  EXPECT_EQ(loop->policy_version(), 2);
  EXPECT_EQ(loop->stats().weight_fetches, 2);
  common::MutexLock lock(&f.learner.mu);
  EXPECT_EQ(f.learner.weights_served, (std::vector<int64_t>{1, 2}));
  ASSERT_EQ(f.learner.pushed.size(), 4u);
  const std::vector<int64_t> want = {1, 1, 2, 2};
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(f.learner.pushed[i].policy_version, want[i]) << i;
  // A round takes the newest weights after it leases: it does not say a version of its own.
  for (const auto& ask : f.learner.lease_asks) {
    EXPECT_EQ(ask.weight_version, -1);
    EXPECT_TRUE(ask.long_poll);
  }
}

// partial_rollouts: the generator's window hook publishes version 2 at the learner at the first
// call's third decode step and holds the call there until the loop has installed it (the
// heartbeat reports it, the in-flight fetcher receives it), so the switch lands at that window.
// Tokens 0-2 are version 1's, the rest version 2's; the groups keep 1.
TEST(RolloutLoop, PartialRolloutsTakeNewerWeightsWhileGenerating) {
  Fixture f({kPromptRow, kMessagesRow});
  json config = LearnerConfig();
  config["partial_rollouts"] = true;
  config["max_completion_length"] = 12;
  config["max_staleness"] = 4;
  f.learner.config_json = config.dump();
  f.learner.leases_per_call = 2;
  bool installed = false;
  const std::optional<WorkerStats> stats = RunWithVersion2AtStep3(f, &installed);
  ASSERT_TRUE(stats.has_value());
  ASSERT_TRUE(installed) << "version 2 was not installed while the first call generated";
  EXPECT_EQ(stats->weight_fetches, 2);
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), 2u);
  int switched = 0;
  for (const common::RolloutGroup& g : f.learner.pushed) {
    EXPECT_EQ(g.policy_version, 1);
    for (const common::Completion& c : g.completions) {
      if (c.token_ids.size() <= 3) continue;  // ended before the switch
      ASSERT_EQ(c.token_versions.size(), c.token_ids.size());
      for (size_t j = 0; j < c.token_ids.size(); ++j) {
        EXPECT_EQ(c.token_versions[j], j < 3 ? 1 : 2) << "token " << j;
      }
      ++switched;
    }
  }
  EXPECT_GT(switched, 0) << "every completion ended within three tokens: the test shows nothing";
}

// continuous_batching: every group is pushed once, scored, under its lease; the prompts come in
// leases of at most prompts_per_lease (the groups decoding at once; GenerateStream's own test
// checks that bound).
TEST(RolloutLoop, ContinuousBatchingPushesEveryGroupOnceUnderItsLease) {
  const std::vector<std::string> rows = {kPromptRow,   kMessagesRow, kPromptRow,
                                         kMessagesRow, kPromptRow,   kMessagesRow};
  Fixture f(rows);
  json config = LearnerConfig();
  config["continuous_batching"] = true;
  config["max_completion_length"] = 12;
  f.learner.config_json = config.dump();
  auto loop = MakeLoop(f, Options());  // prompts_per_lease 2
  ASSERT_TRUE(loop->Run().ok());
  EXPECT_GE(loop->stats().rounds, 3);
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), rows.size());
  std::map<std::string, int> pushes;
  for (const common::RolloutGroup& g : f.learner.pushed) {
    ++pushes[g.lease_id];
    EXPECT_EQ(g.prompt_id, "prompt-" + g.lease_id.substr(6));
    EXPECT_EQ(g.policy_version, 1);
    ASSERT_EQ(g.completions.size(), static_cast<size_t>(kGenerations));
    for (const auto& c : g.completions) {
      ASSERT_EQ(c.rewards.size(), 1u);
      const double n = static_cast<double>(c.token_ids.size());
      EXPECT_EQ(c.rewards[0], std::optional<double>(-std::abs(kTargetLength - n)));
      EXPECT_TRUE(c.token_versions.empty());
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(pushes["lease-" + std::to_string(i)], 1);
  EXPECT_EQ(loop->stats().groups_pushed, static_cast<int64_t>(rows.size()));
}

// The learner's config for multi-turn episodes streamed across leases: continuous_batching with
// the built-in "turns" environment, 2 turns an episode, scored by the environment's reward.
std::string StreamedEpisodesConfig(int64_t sessions, int64_t max_completion_length) {
  json config = LearnerConfig();
  config["continuous_batching"] = true;
  config["env"] = "builtin:turns";
  config["max_turns"] = 2;
  config["env_max_concurrency"] = sessions;
  config["max_completion_length"] = max_completion_length;
  config["reward_funcs"] = json::array({"env"});
  return config.dump();
}

// Multi-turn episodes (the built-in "turns" environment) with continuous_batching: the worker
// streams its episodes (StreamEpisodes) and pushes every group once, under its lease, each
// episode's model turns (env_mask 1) alternating with the environment's "ok" turns (env_mask 0),
// scored by the environment's reward: 1/3 per stepped turn (the rows ask for the task's
// default 3 turns; max_turns 2 ends each episode after its second).
TEST(RolloutLoop, ContinuousBatchingStreamsMultiTurnEpisodesAndPushesEachGroupOnce) {
  const std::vector<std::string> rows(6, kMessagesRow);
  Fixture f(rows);
  // Two groups of 4 at once; a turn of the random policy ends about 1 in 259.
  f.learner.config_json = StreamedEpisodesConfig(/*sessions=*/8, /*max_completion_length=*/600);
  RolloutLoopOptions o = Options();
  o.reward_options.clear();
  auto loop = MakeLoop(f, o);
  const Status s = loop->Run();
  ASSERT_TRUE(s.ok()) << s.ToString();
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), rows.size());
  std::map<std::string, int> pushes;
  int64_t env_tokens = 0;
  for (const common::RolloutGroup& g : f.learner.pushed) {
    ++pushes[g.lease_id];
    EXPECT_EQ(g.policy_version, 1);
    ASSERT_EQ(g.completions.size(), static_cast<size_t>(kGenerations));
    for (const auto& c : g.completions) {
      ASSERT_EQ(c.env_mask.size(), c.token_ids.size());
      int64_t model_turns = 0;  // runs of env_mask 1
      for (size_t t = 0; t < c.env_mask.size(); ++t) {
        env_tokens += c.env_mask[t] == 0 ? 1 : 0;
        model_turns += c.env_mask[t] == 1 && (t == 0 || c.env_mask[t - 1] == 0) ? 1 : 0;
      }
      // A turn cut by the budget (the episode's tokens reach 600) is not stepped; a turn whose
      // observation would not fit was stepped, and ends the episode truncated below 600.
      const bool cut = c.truncated && c.env_mask.back() == 1 && c.token_ids.size() == 600u;
      const int64_t stepped = model_turns - (cut ? 1 : 0);
      ASSERT_EQ(c.rewards.size(), 1u);
      ASSERT_TRUE(c.rewards[0].has_value());
      EXPECT_NEAR(*c.rewards[0], static_cast<double>(stepped) / kDefaultTaskTurns, 1e-12);
    }
  }
  EXPECT_GT(env_tokens, 0);  // some episode had an observation: the stream ran turns
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(pushes["lease-" + std::to_string(i)], 1);
  EXPECT_EQ(loop->stats().groups_pushed, static_cast<int64_t>(rows.size()));
  EXPECT_EQ(loop->stats().episodes, static_cast<int64_t>(rows.size()) * kGenerations);
}

// An environment that is down for some rows (reset: Unavailable): each of their groups is
// pushed with its failure and no completions under its lease, which gives the lease back at
// once (RolloutGroup::failure; the learner queues the prompt again), and the next lease waits
// the backoff (300 ms here, jittered by at most 20%) instead of asking again at once; the other
// rows' groups are generated and pushed as usual. Per call (RunRound) and streamed.
void RunWithAnEnvironmentDownForTheFirstLease(bool continuous) {
  const std::string down = R"({"messages": [{"role": "user", "content": "Hi"}], "down": true})";
  const std::vector<std::string> rows = {down, down, kMessagesRow, kMessagesRow};
  Fixture f(rows);
  json config = LearnerConfig();
  config["env"] = "builtin:flaky";
  config["max_turns"] = 1;
  config["env_max_concurrency"] = 8;  // both groups of a lease at once
  config["max_completion_length"] = 8;
  config["reward_funcs"] = json::array({"env"});
  config["continuous_batching"] = continuous;
  f.learner.config_json = config.dump();
  std::vector<std::chrono::steady_clock::time_point> leased_at;  // of each lease that leased
  {
    common::MutexLock lock(&f.learner.mu);
    f.learner.after_lease = [&leased_at](FakeLearnerLink&) {
      leased_at.push_back(std::chrono::steady_clock::now());
    };
  }
  RolloutLoopOptions o = Options();
  o.reward_options.clear();
  o.backoff.initial = milliseconds(300);
  o.backoff.max = milliseconds(600);
  o.make_environment = [](const common::GrpoConfig&) -> StatusOr<std::unique_ptr<Environment>> {
    return std::unique_ptr<Environment>(std::make_unique<FunctionEnvironment>(
        "flaky",
        [](const json& row, uint64_t, json&) -> StatusOr<EnvObservation> {
          if (row.value("down", false)) return Status::Unavailable("environment down");
          return EnvObservation{};
        },
        [](const std::string&, json&) -> StatusOr<EnvObservation> {
          EnvObservation obs;
          obs.done = true;
          obs.reward = 1.0;
          return obs;
        }));
  };
  auto loop = MakeLoop(f, o);
  const Status s = loop->Run();
  ASSERT_TRUE(s.ok()) << s.ToString();
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), rows.size());
  std::map<std::string, const common::RolloutGroup*> by_lease;
  for (const common::RolloutGroup& g : f.learner.pushed) by_lease[g.lease_id] = &g;
  for (int i = 0; i < 4; ++i) {
    const std::string lease = "lease-" + std::to_string(i);
    ASSERT_EQ(by_lease.count(lease), 1u) << lease;
    const common::RolloutGroup& g = *by_lease[lease];
    EXPECT_EQ(g.prompt_id, "prompt-" + std::to_string(i));
    EXPECT_EQ(g.policy_incarnation, "inc-1");
    if (i < 2) {  // the environment was down for it
      EXPECT_TRUE(g.completions.empty()) << lease;
      EXPECT_NE(g.failure.find("environment down"), std::string::npos) << g.failure;
    } else {
      EXPECT_TRUE(g.failure.empty()) << lease << ": " << g.failure;
      ASSERT_EQ(g.completions.size(), static_cast<size_t>(kGenerations)) << lease;
      for (const auto& c : g.completions) ASSERT_EQ(c.rewards.size(), 1u);
    }
  }
  EXPECT_EQ(loop->stats().prompts_failed, 2);
  // The last rows were leased after the backoff: at least 240 ms after the first lease. (A
  // stream may lease one more row before it learns that the first groups failed: a failed
  // episode frees its session before its group is handed back.)
  ASSERT_GE(leased_at.size(), 2u);
  EXPECT_GE(leased_at.back() - leased_at.front(), milliseconds(240));
}

TEST(RolloutLoop, GroupsAnEnvironmentFailedGiveTheirLeasesBackAndTheNextLeaseWaits) {
  RunWithAnEnvironmentDownForTheFirstLease(/*continuous=*/false);
}

TEST(RolloutLoop, StreamedGroupsAnEnvironmentFailedGiveTheirLeasesBackAndTheNextLeaseWaits) {
  RunWithAnEnvironmentDownForTheFirstLease(/*continuous=*/true);
}

// Multi-turn episodes streamed without partial_rollouts: version 2 is published while the first
// groups play; no group starts after the worker learns of it until its groups in flight are
// done, then the stream ends and the next one takes version 2, so every turn of a group is
// sampled by the weights of its policy_version: each model token's behaviour log-prob equals a
// full forward's under that version's model (teacher forcing), never the other's.
TEST(RolloutLoop, StreamedEpisodesWithoutPartialRolloutsNeverMixVersionsInAGroup) {
  const std::vector<std::string> rows(8, kMessagesRow);
  Fixture f(rows);
  f.learner.config_json =  // one group at a time
      StreamedEpisodesConfig(/*sessions=*/4, /*max_completion_length=*/300);
  std::shared_ptr<const common::Model> v1 = f.learner.model, v2 = TinyModel(22);
  RolloutLoopOptions o = Options();
  o.reward_options.clear();
  auto published = std::make_shared<std::atomic<bool>>(false);
  o.generator_window_hook = [&f, v2, published](int64_t steps) {
    if (steps < 30 || published->exchange(true)) return;
    common::MutexLock lock(&f.learner.mu);
    f.learner.version = 2;
    f.learner.model = v2;
  };
  auto loop = MakeLoop(f, o);
  const Status s = loop->Run();
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(published->load());
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), rows.size());
  std::map<int64_t, int> by_version;
  for (const common::RolloutGroup& g : f.learner.pushed) {
    ++by_version[g.policy_version];
    ASSERT_TRUE(g.policy_version == 1 || g.policy_version == 2) << g.policy_version;
    const common::Model& model = g.policy_version == 1 ? *v1 : *v2;
    const common::Model& other = g.policy_version == 1 ? *v2 : *v1;
    for (const auto& c : g.completions) {
      const std::vector<double> want = TeacherForced(model, g.prompt_ids, c.token_ids);
      const std::vector<double> not_want = TeacherForced(other, g.prompt_ids, c.token_ids);
      double worst = 0.0, closest_other = 1e9;
      for (size_t t = 0; t < c.token_ids.size(); ++t) {
        if (c.env_mask[t] == 0) continue;
        worst = std::max(worst, std::abs(c.logprobs[t] - want[t]));
        closest_other = std::min(closest_other, std::abs(c.logprobs[t] - not_want[t]));
      }
      EXPECT_LT(worst, 1e-4) << "lease " << g.lease_id << ", version " << g.policy_version;
      EXPECT_GT(closest_other, 0.0) << "lease " << g.lease_id;
    }
  }
  EXPECT_GE(by_version[1], 1);
  EXPECT_GE(by_version[2], 1);  // the groups leased after the stream ended took version 2
  EXPECT_EQ(loop->stats().weight_fetches, 2);
}

// Rows 0 and 2 may run 3 tokens, 1 and 3 the job's 12 (a random policy hardly ever stops).
const std::vector<std::string> kShortLongRows = {
    R"({"prompt": "short", "max_completion_length": 3})", R"({"prompt": "long"})",
    R"({"prompt": "short", "max_completion_length": 3})", R"({"prompt": "long"})"};

// The learner's config for kShortLongRows.
std::string ShortLongConfig(bool continuous) {
  json config = LearnerConfig();
  config["continuous_batching"] = continuous;
  config["max_completion_length"] = 12;
  return config.dump();
}

// A row's own max_completion_length bounds its group's completions, one call per lease or
// continuous; the other rows run to the job's 12 tokens.
TEST(RolloutLoop, ARowsOwnBudgetBoundsItsGroupInBothModes) {
  for (const bool continuous : {false, true}) {
    const std::vector<std::string>& rows = kShortLongRows;
    Fixture f(rows);
    f.learner.config_json = ShortLongConfig(continuous);
    auto loop = MakeLoop(f, Options());
    ASSERT_TRUE(loop->Run().ok());
    common::MutexLock lock(&f.learner.mu);
    ASSERT_EQ(f.learner.pushed.size(), rows.size());
    size_t longest_short = 0, longest_long = 0;
    for (const common::RolloutGroup& g : f.learner.pushed) {
      const bool is_short = std::stoi(g.prompt_id.substr(7)) % 2 == 0;  // "prompt-<row>"
      for (const auto& c : g.completions) {
        (is_short ? longest_short : longest_long) =
            std::max(is_short ? longest_short : longest_long, c.token_ids.size());
      }
    }
    EXPECT_EQ(longest_short, 3u) << "continuous " << continuous;
    EXPECT_GT(longest_long, 3u) << "continuous " << continuous;
  }
}

// continuous_batching: a lease asked while rows decode (a short group left beside a long one)
// is answered at once, without the learner's long poll for budget, for which the rows would wait;
// one asked while nothing decodes may wait.
TEST(RolloutLoop, AStreamLeasesWithoutALongPollWhileRowsDecode) {
  const std::vector<std::string>& rows = kShortLongRows;
  Fixture f(rows);
  f.learner.config_json = ShortLongConfig(/*continuous=*/true);
  auto loop = MakeLoop(f, Options());  // prompts_per_lease 2, the fake leases 2 a call
  ASSERT_TRUE(loop->Run().ok());
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), rows.size());
  const auto& asks = f.learner.lease_asks;
  ASSERT_GE(asks.size(), 2u);
  EXPECT_TRUE(asks.front().long_poll) << "the first lease, nothing decoding, may long-poll";
  // The short group leaves at its 3rd token while the long one decodes: the next lease is asked
  // while rows decode.
  EXPECT_FALSE(asks[1].long_poll) << "a lease asked while the long group decodes was long-polled";
  // Each says the version its groups start with: the fake learner's 1, installed first.
  for (const auto& ask : asks) EXPECT_EQ(ask.weight_version, 1);
}

// continuous_batching: a stream with nothing decoding that waits for leases while the learner
// publishes a newer version starts no prompt with its old one. The fake learner publishes
// version 2 at the first groups' push, adds two rows and has no budget for the next lease (whose
// answer says 2): the next groups are version 2's, and every lease after that answer says so.
TEST(RolloutLoop, AnIdleStreamWaitingForLeasesStartsNothingWithWeightsOlderThanTheLearners) {
  Fixture f({kPromptRow, kPromptRow});
  json config = LearnerConfig();
  config["continuous_batching"] = true;
  config["max_completion_length"] = 6;
  f.learner.config_json = config.dump();
  const std::shared_ptr<const common::Model> v2 = TinyModel(22);
  {
    common::MutexLock lock(&f.learner.mu);
    f.learner.job_done_when_empty = false;  // the stream waits for leases
    f.learner.after_push = [v2](FakeLearnerLink& l) {
      if (l.pushed.size() == 2 && l.version == 1) {
        l.version = 2;
        l.model = v2;
        l.rows.push_back(kPromptRow);
        l.rows.push_back(kMessagesRow);
        l.empty_leases_next = 1;
        l.lease_asks.clear();  // from here on
      }
      if (l.pushed.size() == 4) l.job_done_when_empty = true;
    };
  }
  auto loop = MakeLoop(f, Options());  // prompts_per_lease 2
  ASSERT_TRUE(loop->Run().ok());
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), 4u);
  for (const common::RolloutGroup& g : f.learner.pushed) {
    const bool later = g.lease_id == "lease-2" || g.lease_id == "lease-3";
    EXPECT_EQ(g.policy_version, later ? 2 : 1) << g.lease_id;
  }
  ASSERT_FALSE(f.learner.lease_asks.empty());
  // The first ask after the push may still be the old stream's (its answer says version 2).
  for (size_t i = 1; i < f.learner.lease_asks.size(); ++i) {
    EXPECT_EQ(f.learner.lease_asks[i].weight_version, 2) << "ask " << i;
  }
}

// continuous_batching with a newer version published at the stream's third decode step (held
// there until the worker installed it): without partial_rollouts each group is of one version
// (those in flight finish with 1, later ones start with 2); with it, the groups in flight switch
// and record version 2 from their fourth window on (sooner for a group that entered later).
void RunStreamWithAnUpdate(bool partial) {
  const std::vector<std::string> rows = {kPromptRow, kMessagesRow, kPromptRow, kMessagesRow};
  Fixture f(rows);
  json config = LearnerConfig();
  config["continuous_batching"] = true;
  config["partial_rollouts"] = partial;
  config["max_completion_length"] = 12;
  config["max_staleness"] = 4;
  f.learner.config_json = config.dump();
  bool installed = false;
  ASSERT_TRUE(RunWithVersion2AtStep3(f, &installed).has_value());
  ASSERT_TRUE(installed) << "version 2 was not installed while the stream decoded";
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), rows.size());
  int mixed = 0, of_version_2 = 0;
  for (const common::RolloutGroup& g : f.learner.pushed) {
    of_version_2 += g.policy_version == 2;
    for (const common::Completion& c : g.completions) {
      if (c.token_versions.empty()) continue;
      ASSERT_TRUE(partial) << "a group mixes versions without partial_rollouts";
      ASSERT_EQ(g.policy_version, 1);
      ASSERT_EQ(c.token_versions.size(), c.token_ids.size());
      // Version 1 up to the switch (after the third window for the groups that entered first,
      // sooner for a later one), version 2 after it.
      EXPECT_EQ(c.token_versions.front(), 1);
      EXPECT_EQ(c.token_versions.back(), 2);
      EXPECT_TRUE(std::is_sorted(c.token_versions.begin(), c.token_versions.end()));
      EXPECT_LE(std::count(c.token_versions.begin(), c.token_versions.end(), 1), 3);
      ++mixed;
    }
  }
  if (partial) {
    EXPECT_GT(mixed, 0) << "no completion was in flight at the update";
  }
  EXPECT_GT(of_version_2, 0) << "no group started after the update";
}

TEST(RolloutLoop, ContinuousBatchingDrainsBeforeANewVersionWithoutPartialRollouts) {
  RunStreamWithAnUpdate(/*partial=*/false);
}

TEST(RolloutLoop, ContinuousBatchingSwitchesTheGroupsInFlightWithPartialRollouts) {
  RunStreamWithAnUpdate(/*partial=*/true);
}

TEST(RolloutLoop, AfterALearnerRestartItRegistersAgainAndTagsGroupsWithTheNewWeights) {
  Fixture f({kPromptRow, kMessagesRow, kPromptRow, kMessagesRow});
  f.learner.version = 3;
  const std::shared_ptr<const common::Model> restored = TinyModel(33);
  f.learner.after_push = [restored](FakeLearnerLink& l) {
    if (l.incarnation == "inc-1") {
      l.incarnation = "inc-2";
      l.version = 1;
      l.model = restored;
      l.unknown_worker = true;
    }
  };
  auto loop = MakeLoop(f, Options());
  ASSERT_TRUE(loop->Run().ok());
  EXPECT_TRUE(SameParameters(*loop->policy(), *restored));
  EXPECT_EQ(loop->policy_version(), 1);
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.registers.size(), 2u);
  EXPECT_EQ(f.learner.registers[1].worker_id, "worker-1");  // registers again under its id
  EXPECT_EQ(f.learner.weights_served, (std::vector<int64_t>{3, 1}));
  ASSERT_EQ(f.learner.pushed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(f.learner.pushed[i].policy_version, i < 2 ? 3 : 1) << i;
    EXPECT_EQ(f.learner.pushed[i].policy_incarnation, i < 2 ? "inc-1" : "inc-2") << i;
  }
}

// Issue 22 item 1: groups refused as unknown_policy (weights the learner did not publish, here
// a version above its own) make the worker take the learner's weights before it generates
// again, instead of regenerating with them until the learner passes that version.
TEST(RolloutLoop, GroupsRefusedAsUnknownPolicyMakeItTakeTheLearnersWeights) {
  Fixture f({kPromptRow, kMessagesRow, kPromptRow, kMessagesRow});
  f.learner.version = 5;
  const std::shared_ptr<const common::Model> v4 = TinyModel(44);
  f.learner.on_push = [&f, v4](const std::vector<common::RolloutGroup>& groups) {
    PushReply r;
    f.learner.mu.AssertHeld();  // on_push runs under mu
    if (f.learner.version == 5) {
      // The learner turns out to be at 4: version 5 is not one it published.
      f.learner.version = 4;
      f.learner.model = v4;
      r.rejected = static_cast<int64_t>(groups.size());
      r.rejected_by_reason["unknown_policy"] = r.rejected;
    } else {
      r.accepted = static_cast<int64_t>(groups.size());
    }
    return StatusOr<PushReply>(r);
  };
  auto loop = MakeLoop(f, Options());
  ASSERT_TRUE(loop->Run().ok());
  EXPECT_EQ(loop->policy_version(), 4);
  EXPECT_TRUE(SameParameters(*loop->policy(), *v4));
  common::MutexLock lock(&f.learner.mu);
  EXPECT_EQ(f.learner.weights_served, (std::vector<int64_t>{5, 4}));
  ASSERT_EQ(f.learner.pushed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(f.learner.pushed[i].policy_version, i < 2 ? 5 : 4) << i;
  }
}

// The incarnation a group carries is the one whose weights generated it, as the receiver
// reported it, not the one the worker registered with.
TEST(RolloutLoop, GroupsCarryTheIncarnationThatPublishedTheirWeights) {
  Fixture f({kPromptRow, kMessagesRow});
  class OtherLearnersWeights final : public WeightReceiver {
   public:
    explicit OtherLearnersWeights(FakeLearnerLink* l) : inner_(l) {}
    StatusOr<ReceivedVersion> Receive(int64_t min_version, common::Model& model,
                                      std::chrono::milliseconds timeout) override {
      ASSIGN_OR_RETURN(ReceivedVersion v, inner_.Receive(min_version, model, timeout));
      v.incarnation = "inc-0";  // a learner process the worker never registered with
      return v;
    }
    std::string backend() const override { return "fake"; }

   private:
    FakeWeightReceiver inner_;
  } receiver(&f.learner);
  RolloutLoopOptions o = Options();
  o.max_rounds = 1;
  auto loop = RolloutLoop::Create(std::move(o), &f.learner, &receiver);
  ASSERT_TRUE(loop.ok()) << loop.status().ToString();
  ASSERT_TRUE((*loop)->Run().ok());
  common::MutexLock lock(&f.learner.mu);
  ASSERT_FALSE(f.learner.pushed.empty());
  for (const auto& g : f.learner.pushed) EXPECT_EQ(g.policy_incarnation, "inc-0");
}

TEST(RolloutLoop, RetriesUnavailableCallsWithBackoff) {
  Fixture f({kPromptRow, kMessagesRow});
  f.learner.unavailable_first_n = 4;
  auto loop = MakeLoop(f, Options());
  ASSERT_TRUE(loop->Run().ok());
  EXPECT_GE(loop->stats().rpc_retries, 4);
  common::MutexLock lock(&f.learner.mu);
  EXPECT_EQ(f.learner.pushed.size(), 2u);
  EXPECT_EQ(f.learner.registers.size(), 1u);
}

TEST(RolloutLoop, RejectedGroupsAreCountedAndAFailedPushDropsItsGroupsNotTheLoop) {
  Fixture f({kPromptRow, kMessagesRow, kPromptRow});
  f.learner.on_push =
      [calls = 0](const std::vector<common::RolloutGroup>& groups) mutable -> StatusOr<PushReply> {
    if (++calls == 1) {  // the first round's 2 groups: 1 accepted, 1 stale
      PushReply r;
      r.accepted = 1;
      r.rejected = 1;
      r.rejected_by_reason["stale"] = 1;
      return r;
    }
    return Status::InvalidArgument("not retryable");  // the second round's 1 group is lost
  };
  auto loop = MakeLoop(f, Options());
  ASSERT_TRUE(loop->Run().ok());
  const WorkerStats st = loop->stats();
  EXPECT_EQ(st.rounds, 2);
  EXPECT_EQ(st.groups_pushed, 2);
  EXPECT_EQ(st.groups_accepted, 1);
  EXPECT_EQ(st.groups_rejected, 1);
  EXPECT_EQ(st.groups_dropped, 1);
  common::MutexLock lock(&f.learner.mu);
  EXPECT_EQ(f.learner.push_calls, 2);  // InvalidArgument is not retried
}

// Throws RewardError(kTimeout): what a remote function whose RPC missed its deadline does.
class TimingOutReward final : public RewardFunction {
 public:
  std::string name() const override { return "judge"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>&) const override {
    throw RewardError(RewardErrorKind::kTimeout, "Score deadline exceeded");
  }
};

TEST(RolloutLoop, RewardFailuresAreCountedByTheirKindInStatsAndMetrics) {
  Fixture f({kPromptRow, kMessagesRow});
  json config = LearnerConfig();
  config["reward_funcs"] = json::array({"length", "judge"});
  f.learner.config_json = config.dump();
  common::Registry registry;
  auto o = Options();
  o.metrics_registry = &registry;
  o.make_rewards = [](const common::GrpoConfig& c) -> StatusOr<std::unique_ptr<RewardRunner>> {
    EXPECT_EQ(c.reward_funcs, (std::vector<std::string>{"length", "judge"}));
    auto length = MakeRewardFunction("length", {{"target_length", kTargetLength}});
    if (!length.ok()) return length.status();
    return RewardRunner::Create({std::move(length).value(), std::make_shared<TimingOutReward>()});
  };
  auto loop = MakeLoop(f, o);
  ASSERT_TRUE(loop->Run().ok());
  EXPECT_EQ(loop->stats().reward_timeouts, 2);  // one per group
  EXPECT_EQ(loop->stats().reward_errors, 0);
  const std::string text = registry.Expose();
  EXPECT_NE(text.find("grpo_rollout_reward_errors_total{reward_fn=\"judge\",kind=\"timeout\"} 2\n"),
            std::string::npos)
      << text;
  // Every (function, kind) series exists from the start; only judge's timeouts moved.
  for (const char* zero :
       {"{reward_fn=\"judge\",kind=\"error\"} 0\n", "{reward_fn=\"length\",kind=\"error\"} 0\n",
        "{reward_fn=\"length\",kind=\"timeout\"} 0\n"}) {
    EXPECT_NE(text.find(std::string("grpo_rollout_reward_errors_total") + zero), std::string::npos)
        << zero << text;
  }
  EXPECT_NE(text.find("grpo_rollout_groups_pushed_total 2\n"), std::string::npos) << text;
  common::MutexLock lock(&f.learner.mu);
  ASSERT_EQ(f.learner.pushed.size(), 2u);
  for (const auto& c : f.learner.pushed[0].completions) {
    ASSERT_EQ(c.rewards.size(), 2u);
    EXPECT_TRUE(c.rewards[0].has_value());
    EXPECT_FALSE(c.rewards[1].has_value());  // the failed function gives null
  }
}

TEST(RolloutLoop, HeartbeatsCarryTheVersionAndStopReturnsPromptlyWhileWaiting) {
  Fixture f({});
  f.learner.job_done_when_empty = false;
  f.learner.retry_after_ms = 60000;
  std::atomic<bool> stop{false};
  auto loop = MakeLoop(f, Options(&stop));
  Status result = Status::Internal("not returned");
  std::thread t([&] { result = loop->Run(); });
  for (int i = 0; i < 250; ++i) {
    {
      common::MutexLock lock(&f.learner.mu);
      if (f.learner.lease_calls > 0 && f.learner.heartbeats.size() >= 2) break;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  const auto t0 = std::chrono::steady_clock::now();
  stop = true;
  t.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  EXPECT_TRUE(result.ok()) << result.ToString();
  common::MutexLock lock(&f.learner.mu);
  ASSERT_GE(f.learner.heartbeats.size(), 2u);
  EXPECT_EQ(f.learner.heartbeats.back().worker_id, "worker-1");
  EXPECT_EQ(f.learner.heartbeats.back().weight_version, 1);
}

TEST(RolloutLoop, HeartbeatShutdownEndsTheLoop) {
  Fixture f({});
  f.learner.job_done_when_empty = false;
  f.learner.shutdown = true;
  auto loop = MakeLoop(f, Options());
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(loop->Run().ok());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
}

TEST(RolloutLoop, CreateChecksItsArguments) {
  FakeLearnerLink learner;
  FakeWeightReceiver receiver(&learner);
  EXPECT_EQ(RolloutLoop::Create(Options(), nullptr, &receiver).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RolloutLoop::Create(Options(), &learner, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  auto o = Options();
  o.prompts_per_lease = -1;
  EXPECT_EQ(RolloutLoop::Create(o, &learner, &receiver).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::rollout
