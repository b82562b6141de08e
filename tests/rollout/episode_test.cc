// Multi-turn episodes (rollout/env/episode.h) on the tiny model with the byte tokenizer (ids 0-255
// are the bytes, 257 <|im_start|>, 258 <|im_end|>). The observation renderer here is written out
// by hand (ChatML), and every expected token run is built from it and from Generate, an
// independent path (one prefill expanded to the group's rows), not from the episode loop.
#include "rollout/env/episode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "tests/rollout/scaled_tiny_model.h"

namespace grpo::rollout {
namespace {

using common::ChatMessage;
using nlohmann::json;

constexpr int32_t kImStart = 257, kImEnd = 258;

std::vector<int32_t> Bytes(const std::string& s) {
  std::vector<int32_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

// ChatML: "\n" after a closed turn (else <|im_end|>\n), each message, the assistant header.
std::vector<int32_t> HandRendered(const std::vector<ChatMessage>& messages, bool closed) {
  std::vector<int32_t> ids;
  if (!closed) ids.push_back(kImEnd);
  ids.push_back('\n');
  for (const ChatMessage& m : messages) {
    ids.push_back(kImStart);
    for (int32_t b : Bytes(m.role + "\n" + m.content)) ids.push_back(b);
    ids.push_back(kImEnd);
    ids.push_back('\n');
  }
  ids.push_back(kImStart);
  for (int32_t b : Bytes("assistant\n")) ids.push_back(b);
  return ids;
}

std::shared_ptr<const common::Model> TinyModel(uint64_t seed = 5) {
  auto config = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(config.ok());
  auto model = common::Model::InitRandom(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::shared_ptr<const common::Model>(std::move(model).value());
}

struct Fixture {
  common::ByteTokenizer tokenizer;
  std::unique_ptr<Generator> generator;
  Prompt prompt;

  // Turns end on <|im_end|> or on any byte below 96 (about a third of the draws of a random
  // policy), so episodes have several short turns.
  explicit Fixture(int64_t max_completion_length = 120, int64_t g = 3) {
    GeneratorOptions o;
    o.num_generations = g;
    o.max_prompt_length = 64;
    o.max_completion_length = max_completion_length;
    o.seed = 11;
    o.eos_token_ids = {kImEnd};
    for (int32_t b = 0; b < 96; ++b) o.eos_token_ids.push_back(b);
    generator = Generator::Create(TinyModel(), 3, o, &tokenizer).value();
    prompt.text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    prompt.ids = tokenizer.Encode(prompt.text).value();
    prompt.row = json{{"answer", 4}};
  }

  EpisodeOptions Options(int64_t max_turns) const {
    EpisodeOptions e;
    e.max_turns = max_turns;
    e.max_concurrent_sessions = 2;
    e.end_of_turn_id = kImEnd;
    e.render = [](const std::vector<ChatMessage>& m,
                  bool closed) -> StatusOr<std::vector<int32_t>> {
      return HandRendered(m, closed);
    };
    return e;
  }
};

// A model turn ends at a stop token (kept) or the budget; runs of env_mask split the turns.
struct TokenRun {
  bool model = true;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
};
std::vector<TokenRun> Runs(const common::Completion& c) {
  std::vector<TokenRun> runs;
  EXPECT_EQ(c.env_mask.size(), c.token_ids.size());
  EXPECT_EQ(c.logprobs.size(), c.token_ids.size());
  for (size_t t = 0; t < c.token_ids.size(); ++t) {
    const bool model = c.env_mask[t] == 1;
    if (runs.empty() || runs.back().model != model) runs.push_back({model, {}, {}});
    runs.back().ids.push_back(c.token_ids[t]);
    runs.back().logprobs.push_back(c.logprobs[t]);
  }
  return runs;
}

FunctionEnvironment EchoEnvironment(std::vector<std::string>* actions, std::mutex* mu) {
  return FunctionEnvironment(
      "echo",
      [](const json&, uint64_t, json& state) -> StatusOr<EnvObservation> {
        state = 0;
        return EnvObservation{};
      },
      [actions, mu](const std::string& action, json& state) -> StatusOr<EnvObservation> {
        state = state.get<int>() + 1;
        {
          std::lock_guard<std::mutex> lock(*mu);
          actions->push_back(action);
        }
        EnvObservation obs;
        obs.messages = {{"tool", "turn " + std::to_string(state.get<int>())}};
        obs.reward = 0.5;
        return obs;
      });
}

TEST(Episodes, TurnsAlternateWithTheObservationsRenderedIdsAndTheFirstTurnIsGenerates) {
  Fixture f;
  std::vector<std::string> actions;
  std::mutex mu;
  FunctionEnvironment env = EchoEnvironment(&actions, &mu);
  EpisodeCounts counts;
  auto result =
      ProduceEpisodes(*f.generator, nullptr, env, f.Options(3), {{&f.prompt, 7}}, &counts);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_EQ(result->groups.size(), 1u);
  ASSERT_TRUE(result->groups[0].group.ok()) << result->groups[0].group.status().ToString();
  const common::RolloutGroup& group = *result->groups[0].group;
  EXPECT_EQ(group.prompt_ids, f.prompt.ids);
  EXPECT_EQ(group.policy_version, 3);
  ASSERT_EQ(group.completions.size(), 3u);

  // Generate's completions of the same prompt and seed index: the episodes' first turns.
  auto single = f.generator->Generate({f.prompt.ids}, {7});
  ASSERT_TRUE(single.ok());
  const auto& first_turns = single->groups[0]->completions;

  int64_t env_tokens = 0, model_turns = 0, cut_turns = 0;
  for (size_t k = 0; k < 3; ++k) {
    const common::Completion& c = group.completions[k];
    const std::vector<TokenRun> runs = Runs(c);
    ASSERT_FALSE(runs.empty());
    EXPECT_TRUE(runs[0].model);
    EXPECT_EQ(runs[0].ids, first_turns[k].token_ids) << "episode " << k;
    int turn = 0;
    for (size_t r = 0; r < runs.size(); ++r) {
      if (runs[r].model) {
        ++turn;
        ++model_turns;
        continue;
      }
      // After model turn `turn`: the tool message "turn <turn>", closed or not by the model.
      const bool closed = runs[r - 1].ids.back() == kImEnd;
      EXPECT_EQ(runs[r].ids, HandRendered({{"tool", "turn " + std::to_string(turn)}}, closed))
          << "episode " << k << " observation " << turn;
      EXPECT_EQ(runs[r].logprobs, std::vector<float>(runs[r].ids.size(), 0.0f));
      env_tokens += static_cast<int64_t>(runs[r].ids.size());
    }
    // Three turns unless the 120-token budget ran out; an observation is never the last run.
    EXPECT_TRUE(runs.back().model);
    EXPECT_TRUE(turn == 3 || c.truncated) << "episode " << k << ": " << turn << " turns";
    EXPECT_LE(c.token_ids.size(), 120u);
    // A turn cut by the budget ends without a stop token and is never stepped.
    const int32_t last = runs.back().ids.back();
    if (last != kImEnd && last >= 96) ++cut_turns;
  }
  EXPECT_EQ(counts.episodes, 3);
  EXPECT_EQ(counts.turns, model_turns);
  EXPECT_EQ(counts.observation_tokens, env_tokens);
  EXPECT_EQ(counts.max_turns + counts.length_truncated, 3);
  EXPECT_GT(counts.max_turns, 0) << "no episode reached its third turn: the test shows little";
  // The environment saw each stepped turn's text: its bytes without the special tokens.
  EXPECT_EQ(static_cast<int64_t>(actions.size()), model_turns - cut_turns);
}

TEST(Episodes, EachTurnContinuesFromTheWholeEpisodeSoFar) {
  Fixture f;
  std::vector<std::string> actions;
  std::mutex mu;
  FunctionEnvironment env = EchoEnvironment(&actions, &mu);
  auto result = ProduceEpisodes(*f.generator, nullptr, env, f.Options(3), {{&f.prompt, 7}});
  ASSERT_TRUE(result.ok());
  const common::RolloutGroup& group = *result->groups[0].group;
  for (size_t k = 0; k < group.completions.size(); ++k) {
    const std::vector<TokenRun> runs = Runs(group.completions[k]);
    std::vector<int32_t> context = f.prompt.ids;
    int64_t turn = 0;
    for (const TokenRun& run : runs) {
      if (run.model) {
        // Generated alone from that context with that turn's stream, it is the same turn.
        Continuation c{context, 7, static_cast<int64_t>(k), turn,
                       120 - static_cast<int64_t>(context.size() - f.prompt.ids.size())};
        auto alone = f.generator->Continue({c});
        ASSERT_TRUE(alone.ok());
        EXPECT_EQ(alone->completions[0].token_ids, run.ids) << "episode " << k << " turn " << turn;
        ++turn;
      }
      context.insert(context.end(), run.ids.begin(), run.ids.end());
    }
  }
}

TEST(Episodes, DoneEndsTheEpisodeAndTheEnvRewardIsTheSumOfItsSteps) {
  Fixture f;
  FunctionEnvironment env(
      "two_steps",
      [](const json&, uint64_t, json& state) -> StatusOr<EnvObservation> {
        state = 0;
        EnvObservation obs;
        obs.reward = 0.25;
        return obs;
      },
      [](const std::string&, json& state) -> StatusOr<EnvObservation> {
        state = state.get<int>() + 1;
        EnvObservation obs;
        obs.reward = state.get<int>() == 1 ? 1.0 : 2.0;
        obs.done = state.get<int>() == 2;
        obs.metadata = json{{"steps", state}};
        if (!obs.done) obs.messages = {{"user", "again"}};
        return obs;
      });
  auto runner =
      RewardRunner::Create(
          {std::shared_ptr<const RewardFunction>(MakeRewardFunction("env").value().release())})
          .value();
  EpisodeCounts counts;
  auto result =
      ProduceEpisodes(*f.generator, runner.get(), env, f.Options(5), {{&f.prompt, 1}}, &counts);
  ASSERT_TRUE(result.ok());
  const common::RolloutGroup& group = *result->groups[0].group;
  for (const common::Completion& c : group.completions) {
    const std::vector<TokenRun> runs = Runs(c);
    if (c.truncated) continue;   // the budget ran out before the environment said done
    ASSERT_EQ(runs.size(), 3u);  // turn, "again", turn
    ASSERT_EQ(c.rewards.size(), 1u);
    ASSERT_TRUE(c.rewards[0].has_value());
    EXPECT_DOUBLE_EQ(*c.rewards[0], 0.25 + 1.0 + 2.0);
  }
  EXPECT_EQ(counts.done + counts.length_truncated, 3);
  EXPECT_GT(counts.done, 0);
}

TEST(Episodes, AnObservationThatWouldOverflowTheBudgetEndsTheEpisodeTruncatedUnappended) {
  Fixture f(/*max_completion_length=*/40);
  FunctionEnvironment env(
      "verbose",
      [](const json&, uint64_t, json&) -> StatusOr<EnvObservation> { return EnvObservation{}; },
      [](const std::string&, json&) -> StatusOr<EnvObservation> {
        EnvObservation obs;
        obs.messages = {{"tool", std::string(50, 'x')}};
        return obs;
      });
  EpisodeCounts counts;
  auto result =
      ProduceEpisodes(*f.generator, nullptr, env, f.Options(4), {{&f.prompt, 2}}, &counts);
  ASSERT_TRUE(result.ok());
  for (const common::Completion& c : result->groups[0].group->completions) {
    EXPECT_TRUE(c.truncated);
    EXPECT_EQ(Runs(c).size(), 1u);  // the first turn only
    EXPECT_EQ(c.env_mask, std::vector<uint8_t>(c.token_ids.size(), 1));
  }
  EXPECT_EQ(counts.length_truncated, 3);
  EXPECT_EQ(counts.observation_tokens, 0);
}

// Resets fail (Unavailable) for rows with "fail": true; a step ends the episode.
FunctionEnvironment FlakyEnvironment() {
  return FunctionEnvironment(
      "flaky",
      [](const json& row, uint64_t, json&) -> StatusOr<EnvObservation> {
        if (row.value("fail", false)) return Status::Unavailable("connection reset");
        return EnvObservation{};
      },
      [](const std::string&, json&) -> StatusOr<EnvObservation> {
        EnvObservation obs;
        obs.done = true;
        return obs;
      });
}

TEST(Episodes, AFailingEnvironmentFailsItsGroupWithTheErrorKindCounted) {
  Fixture f;
  FunctionEnvironment env = FlakyEnvironment();
  Prompt bad = f.prompt;
  bad.row = json{{"fail", true}};
  EpisodeCounts counts;
  auto result = ProduceEpisodes(*f.generator, nullptr, env, f.Options(2),
                                {{&f.prompt, 1}, {&bad, 2}}, &counts);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->groups[0].group.ok());
  ASSERT_FALSE(result->groups[1].group.ok());
  EXPECT_EQ(result->groups[1].group.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(result->groups[1].group.status().message().find("connection reset"), std::string::npos);
  // The fixture's bound (2 sessions) is below num_generations (3): the bad group's episodes start
  // one by one, and the first one's failure stops the other two before they reset.
  EXPECT_EQ(counts.errors["unavailable"], 1);
  EXPECT_EQ(counts.stopped, 2);
  EXPECT_EQ(counts.done, 3);

  // With room for every session at once, every episode resets, and each failure is counted.
  EpisodeOptions all_at_once = f.Options(2);
  all_at_once.max_concurrent_sessions = 6;
  EpisodeCounts together;
  result = ProduceEpisodes(*f.generator, nullptr, env, all_at_once, {{&f.prompt, 1}, {&bad, 2}},
                           &together);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->groups[0].group.ok());
  EXPECT_FALSE(result->groups[1].group.ok());
  EXPECT_EQ(together.errors["unavailable"], 3);
  EXPECT_EQ(together.stopped, 0);
  EXPECT_EQ(together.done, 3);
}

// An environment that allows `capacity` sessions at once, as an OpenEnv server allows
// max_concurrent_envs (more fail with ResourceExhausted); it records the most held at once.
// Each episode ends after two steps.
class CappedEnvironment final : public Environment {
 public:
  explicit CappedEnvironment(int capacity) : capacity_(capacity) {}
  std::string name() const override { return "capped"; }
  int most_held() const { return most_held_.load(); }

  StatusOr<std::unique_ptr<EnvSession>> Open() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (held_ >= capacity_) {
      return Status::ResourceExhausted("the environment holds " + std::to_string(held_) +
                                       " sessions, its capacity");
    }
    ++held_;
    most_held_.store(std::max(most_held_.load(), held_));
    return std::unique_ptr<EnvSession>(new Session(this));
  }

 private:
  class Session final : public EnvSession {
   public:
    explicit Session(CappedEnvironment* env) : env_(env) {}
    ~Session() override {
      std::lock_guard<std::mutex> lock(env_->mu_);
      --env_->held_;
    }
    StatusOr<EnvObservation> Reset(const json&, uint64_t,
                                   std::chrono::steady_clock::time_point) override {
      return EnvObservation{};
    }
    StatusOr<EnvObservation> Step(const std::string&,
                                  std::chrono::steady_clock::time_point) override {
      EnvObservation obs;
      obs.done = ++steps_ == 2;
      if (!obs.done) obs.messages = {{"user", "once more"}};
      return obs;
    }

   private:
    CappedEnvironment* env_;
    int steps_ = 0;
  };

  const int capacity_;
  std::mutex mu_;
  int held_ = 0;
  std::atomic<int> most_held_{0};
};

// The model's tokens of each completion of each group (env tokens included: they depend on the
// turns only).
std::vector<std::vector<std::vector<int32_t>>> Tokens(const ProduceResult& r) {
  std::vector<std::vector<std::vector<int32_t>>> out;
  for (const ProducedGroup& g : r.groups) {
    out.emplace_back();
    if (!g.group.ok()) continue;
    for (const common::Completion& c : g.group->completions) out.back().push_back(c.token_ids);
  }
  return out;
}

// Two prompts x 3 episodes against an environment of 2 sessions with env_max_concurrency 2: the
// episodes start as sessions end, never more than 2 held, and every one runs; each episode is
// the one a single wave of all 6 (bound 6, unlimited environment) gives: its sampler streams
// depend on its prompt, generation and turn only.
TEST(Episodes, AtMostTheBoundsSessionsAreHeldAndLaterEpisodesWaitForOne) {
  Fixture f;
  CappedEnvironment env(2);
  EpisodeCounts counts;
  auto waves = ProduceEpisodes(*f.generator, nullptr, env, f.Options(4),
                               {{&f.prompt, 1}, {&f.prompt, 2}}, &counts);
  ASSERT_TRUE(waves.ok()) << waves.status().ToString();
  ASSERT_EQ(waves->groups.size(), 2u);
  for (const ProducedGroup& g : waves->groups) {
    ASSERT_TRUE(g.group.ok()) << g.group.status().ToString();
    EXPECT_EQ(g.group->completions.size(), 3u);
  }
  EXPECT_TRUE(counts.errors.empty());
  EXPECT_EQ(counts.episodes, 6);
  EXPECT_EQ(counts.done + counts.length_truncated, 6);
  EXPECT_EQ(env.most_held(), 2);

  CappedEnvironment roomy(100);
  EpisodeOptions one_wave = f.Options(4);
  one_wave.max_concurrent_sessions = 6;
  auto together =
      ProduceEpisodes(*f.generator, nullptr, roomy, one_wave, {{&f.prompt, 1}, {&f.prompt, 2}});
  ASSERT_TRUE(together.ok()) << together.status().ToString();
  EXPECT_EQ(roomy.most_held(), 6);
  EXPECT_EQ(Tokens(*waves), Tokens(*together));
}

// A reset refused at capacity (ResourceExhausted) is tried again in a new session until the
// reset's deadline: two refusals and the episodes run; refused every time, the group fails with
// it once the deadline has passed.
TEST(Episodes, AResetRefusedAtCapacityIsTriedAgainUntilItsDeadline) {
  Fixture f;
  auto refusals = std::make_shared<std::atomic<int>>(2);
  FunctionEnvironment lagging(
      "lagging",
      [refusals](const json&, uint64_t, json&) -> StatusOr<EnvObservation> {
        if (refusals->fetch_sub(1) > 0) return Status::ResourceExhausted("at capacity");
        return EnvObservation{};
      },
      [](const std::string&, json&) -> StatusOr<EnvObservation> {
        EnvObservation obs;
        obs.done = true;
        return obs;
      });
  EpisodeCounts counts;
  auto result =
      ProduceEpisodes(*f.generator, nullptr, lagging, f.Options(2), {{&f.prompt, 1}}, &counts);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->groups[0].group.ok()) << result->groups[0].group.status().ToString();
  EXPECT_TRUE(counts.errors.empty());
  EXPECT_EQ(counts.done, 3);

  auto resets = std::make_shared<std::atomic<int>>(0);
  FunctionEnvironment full(
      "full",
      [resets](const json&, uint64_t, json&) -> StatusOr<EnvObservation> {
        resets->fetch_add(1);
        return Status::ResourceExhausted("at capacity");
      },
      [](const std::string&, json&) -> StatusOr<EnvObservation> { return EnvObservation{}; });
  EpisodeOptions o = f.Options(2);
  o.step_timeout = std::chrono::milliseconds(300);
  const auto t0 = std::chrono::steady_clock::now();
  result = ProduceEpisodes(*f.generator, nullptr, full, o, {{&f.prompt, 1}});
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(result.ok());
  ASSERT_FALSE(result->groups[0].group.ok());
  EXPECT_EQ(result->groups[0].group.status().code(), StatusCode::kResourceExhausted);
  // Back-offs of 10, 20, 40 and 80 ms fit before the 300 ms deadline, the next (160) does not:
  // at least 150 ms of sleep, and each of the two episodes started reset more than once.
  EXPECT_GE(waited, 0.15);
  EXPECT_GT(resets->load(), 2);
}

// num_generations (3) fits in the bound (4): a group starts whole or waits, so the second group
// waits for the first to end even with one session free (its first turn prefills its prompt
// once for all three).
TEST(Episodes, AGroupThatFitsInTheBoundStartsWhole) {
  Fixture f;
  CappedEnvironment env(100);
  EpisodeOptions o = f.Options(4);
  o.max_concurrent_sessions = 4;
  auto result = ProduceEpisodes(*f.generator, nullptr, env, o, {{&f.prompt, 1}, {&f.prompt, 2}});
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  for (const ProducedGroup& g : result->groups) EXPECT_TRUE(g.group.ok());
  EXPECT_EQ(env.most_held(), 3);
}

// The first step of all fails: its group fails, and its two other episodes are stepped no more.
TEST(Episodes, AFailedEpisodeStopsTheOtherEpisodesOfItsGroup) {
  Fixture f;
  auto steps = std::make_shared<std::atomic<int>>(0);
  FunctionEnvironment env(
      "fails_once",
      [](const json&, uint64_t, json&) -> StatusOr<EnvObservation> { return EnvObservation{}; },
      [steps](const std::string&, json&) -> StatusOr<EnvObservation> {
        if (steps->fetch_add(1) == 0) return Status::Unavailable("gone");
        EnvObservation obs;
        obs.messages = {{"user", "go on"}};
        return obs;
      });
  EpisodeOptions o = f.Options(4);
  o.max_concurrent_sessions = 1;  // steps in order: the first stepped episode fails
  EpisodeCounts counts;
  auto result = ProduceEpisodes(*f.generator, nullptr, env, o, {{&f.prompt, 1}}, &counts);
  ASSERT_TRUE(result.ok());
  ASSERT_FALSE(result->groups[0].group.ok());
  EXPECT_EQ(result->groups[0].group.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(counts.errors["unavailable"], 1);
  // The siblings were stepped in the same round at most, then stopped (or cut by the budget).
  EXPECT_LE(steps->load(), 3);
  EXPECT_EQ(counts.stopped + counts.length_truncated, 2);
  EXPECT_EQ(counts.done + counts.max_turns, 0);
}

// Resets that show messages: episode 0 of a group none, the others a seed-dependent user turn.
FunctionEnvironment GreetingEnvironment(std::vector<uint64_t>* seeds, std::mutex* mu) {
  return FunctionEnvironment(
      "greeting",
      [seeds, mu](const json&, uint64_t seed, json&) -> StatusOr<EnvObservation> {
        std::lock_guard<std::mutex> lock(*mu);
        seeds->push_back(seed);
        EnvObservation obs;
        if (seed % 7 != 0) obs.messages = {{"user", "hello " + std::to_string(seed % 7)}};
        return obs;
      },
      [](const std::string&, json&) -> StatusOr<EnvObservation> {
        EnvObservation obs;
        obs.done = true;
        return obs;
      });
}

TEST(Episodes, AResetObservationIsShownAfterThePromptAsEnvironmentTokens) {
  Fixture f;
  std::vector<uint64_t> seeds;
  std::mutex mu;
  FunctionEnvironment env = GreetingEnvironment(&seeds, &mu);
  EpisodeOptions o = f.Options(2);
  o.generation_tail = Bytes("\n");
  o.generation_tail.push_back(kImStart);
  for (int32_t b : Bytes("assistant\n")) o.generation_tail.push_back(b);
  EpisodeCounts counts;
  auto result = ProduceEpisodes(*f.generator, nullptr, env, o, {{&f.prompt, 7}}, &counts);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_TRUE(result->groups[0].group.ok()) << result->groups[0].group.status().ToString();
  const common::RolloutGroup& group = *result->groups[0].group;
  // The prompt ends at the user turn's <|im_end|>: "\n<|im_start|>assistant\n" moved into each
  // episode.
  const std::vector<int32_t> cut = [&] {
    std::vector<int32_t> ids = Bytes("");
    ids.push_back(kImStart);
    for (int32_t b : Bytes("user\nHi")) ids.push_back(b);
    ids.push_back(kImEnd);
    return ids;
  }();
  EXPECT_EQ(group.prompt_ids, cut);
  int64_t env_tokens = 0;
  bool some_shown = false;
  for (int64_t k = 0; k < 3; ++k) {
    const common::Completion& c = group.completions[k];
    const std::vector<TokenRun> runs = Runs(c);
    ASSERT_GE(runs.size(), 2u) << "episode " << k;
    ASSERT_FALSE(runs[0].model) << "episode " << k;
    const uint64_t seed = EpisodeSeed(42, 7, k);  // EpisodeOptions' default seed
    const std::vector<int32_t> want =
        seed % 7 == 0 ? o.generation_tail
                      : HandRendered({{"user", "hello " + std::to_string(seed % 7)}}, true);
    some_shown = some_shown || seed % 7 != 0;
    EXPECT_EQ(runs[0].ids, want) << "episode " << k;
    EXPECT_EQ(runs[0].logprobs, std::vector<float>(want.size(), 0.0f));
    env_tokens += static_cast<int64_t>(want.size());
    // The first turn continues from prompt + reset tokens: generated alone, it is the same.
    std::vector<int32_t> context = cut;
    context.insert(context.end(), want.begin(), want.end());
    auto alone = f.generator->Continue(
        {Continuation{context, 7, k, 0, 120 - static_cast<int64_t>(want.size())}});
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(runs[1].ids, alone->completions[0].token_ids) << "episode " << k;
    EXPECT_LE(c.token_ids.size(), 120u);
  }
  EXPECT_TRUE(some_shown);
  EXPECT_EQ(counts.observation_tokens, env_tokens);
  EXPECT_EQ(seeds.size(), 3u);
}

TEST(Episodes, AResetObservationNeedsAChatPromptAndRoomForATurn) {
  std::vector<uint64_t> seeds;
  std::mutex mu;
  FunctionEnvironment env = GreetingEnvironment(&seeds, &mu);
  std::vector<int32_t> tail = Bytes("\n");
  tail.push_back(kImStart);
  for (int32_t b : Bytes("assistant\n")) tail.push_back(b);
  {  // A "prompt" string row that does not end with the generation prompt.
    Fixture f;
    f.prompt.ids = Bytes("Say hi:");
    EpisodeOptions o = f.Options(2);
    o.generation_tail = tail;
    auto result = ProduceEpisodes(*f.generator, nullptr, env, o, {{&f.prompt, 7}});
    ASSERT_TRUE(result.ok());
    ASSERT_FALSE(result->groups[0].group.ok());
    EXPECT_EQ(result->groups[0].group.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(result->groups[0].group.status().message().find("\"messages\""), std::string::npos)
        << result->groups[0].group.status().ToString();
  }
  {  // No generation prompt ids given: refused, not shown wrong.
    Fixture f;
    auto result = ProduceEpisodes(*f.generator, nullptr, env, f.Options(2), {{&f.prompt, 7}});
    ASSERT_TRUE(result.ok());
    ASSERT_FALSE(result->groups[0].group.ok());
  }
  {  // A budget the reset observation fills: no room for a model turn.
    Fixture f(/*max_completion_length=*/20);
    EpisodeOptions o = f.Options(2);
    o.generation_tail = tail;
    auto result = ProduceEpisodes(*f.generator, nullptr, env, o, {{&f.prompt, 7}});
    ASSERT_TRUE(result.ok());
    ASSERT_FALSE(result->groups[0].group.ok());
    EXPECT_NE(result->groups[0].group.status().message().find("leaves no room"), std::string::npos)
        << result->groups[0].group.status().ToString();
  }
}

// Environment steps overlapped with generation (overlap_env_steps). Every episode is done at
// its third step; episode `slow_seed`'s first step (or with `at_reset` its reset) waits until
// `others` other episodes are done, or until `wait` has passed: `opened_by_others` says which.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  int others_done = 0;
  bool opened_by_others = false;
};

FunctionEnvironment GatedEnvironment(uint64_t slow_seed, int others, std::chrono::milliseconds wait,
                                     std::shared_ptr<Gate> gate, bool at_reset = false) {
  const auto hold = [others, wait, gate] {
    std::unique_lock<std::mutex> lock(gate->mu);
    gate->opened_by_others =
        gate->cv.wait_for(lock, wait, [&] { return gate->others_done >= others; });
  };
  return FunctionEnvironment(
      "gated",
      [slow_seed, at_reset, hold](const json&, uint64_t seed,
                                  json& state) -> StatusOr<EnvObservation> {
        state = {{"step", 0}, {"slow", seed == slow_seed}};
        if (at_reset && seed == slow_seed) hold();
        return EnvObservation{};
      },
      [at_reset, hold, gate](const std::string&, json& state) -> StatusOr<EnvObservation> {
        const int step = state["step"].get<int>() + 1;
        state["step"] = step;
        const bool slow = state["slow"].get<bool>();
        EnvObservation obs;
        obs.done = step == 3;
        if (!obs.done) obs.messages = {{"user", "go on"}};
        if (slow && step == 1 && !at_reset) {
          hold();
        } else if (!slow && obs.done) {
          std::lock_guard<std::mutex> lock(gate->mu);
          gate->others_done += 1;
          gate->cv.notify_all();
        }
        return obs;
      });
}

// Two prompts x 3 episodes, all admitted at once, the first episode of the second prompt with a
// slow first step (or reset), which waits for `others` episodes to be done. Waiting, nothing
// else goes on while it runs (a turn waits for every step, a wave for every reset), so it waits
// out its 300 ms; overlapped, the others play meanwhile. Each episode samples from its own
// streams: the tokens are the same either way.
void CheckASlowCallHoldsUpOnlyItsOwn(bool at_reset, int others) {
  Fixture f(400, 3);  // turns stop a third of the time: 3 turns never fill 400 tokens
  const std::vector<ProduceInput> inputs = {{&f.prompt, 1}, {&f.prompt, 2}};
  EpisodeOptions o = f.Options(4);
  o.max_concurrent_sessions = 6;
  const uint64_t slow = EpisodeSeed(o.seed, 2, 0);

  auto waited_gate = std::make_shared<Gate>();
  FunctionEnvironment waited_env =
      GatedEnvironment(slow, others, std::chrono::milliseconds(300), waited_gate, at_reset);
  EpisodeCounts waited_counts;
  auto waited = ProduceEpisodes(*f.generator, nullptr, waited_env, o, inputs, &waited_counts);
  ASSERT_TRUE(waited.ok()) << waited.status().ToString();
  EXPECT_FALSE(waited_gate->opened_by_others);
  EXPECT_EQ(waited_gate->others_done, 5);
  EXPECT_EQ(waited_counts.done, 6);
  EXPECT_EQ(waited_counts.turns, 18);
  // The loop was blocked on the slow call (its 300 ms) with nothing to decode.
  EXPECT_GE(waited_counts.env_wait_seconds, 0.25);

  o.overlap_env_steps = true;
  auto gate = std::make_shared<Gate>();
  FunctionEnvironment env =
      GatedEnvironment(slow, others, std::chrono::seconds(60), gate, at_reset);
  EpisodeCounts counts;
  auto overlapped = ProduceEpisodes(*f.generator, nullptr, env, o, inputs, &counts);
  ASSERT_TRUE(overlapped.ok()) << overlapped.status().ToString();
  EXPECT_TRUE(gate->opened_by_others);
  EXPECT_EQ(counts.done, 6);
  EXPECT_EQ(counts.turns, 18);
  EXPECT_EQ(counts.observation_tokens, waited_counts.observation_tokens);
  for (const ProducedGroup& g : overlapped->groups) {
    ASSERT_TRUE(g.group.ok()) << g.group.status().ToString();
    EXPECT_EQ(g.group->policy_version, 3);
  }
  EXPECT_EQ(Tokens(*overlapped), Tokens(*waited));
}

// The slow step waits for the five other episodes: they play all their turns meanwhile.
TEST(Episodes, WithOverlappedStepsASlowStepHoldsUpItsOwnEpisodeOnly) {
  CheckASlowCallHoldsUpOnlyItsOwn(/*at_reset=*/false, /*others=*/5);
}

// The slow reset waits for the first group's three episodes (its own group waits for it): the
// first group plays while the second resets.
TEST(Episodes, WithOverlappedStepsASlowResetHoldsUpItsOwnGroupOnly) {
  CheckASlowCallHoldsUpOnlyItsOwn(/*at_reset=*/true, /*others=*/3);
}

// Sessions told apart by their reset seed: the first step of `failing` fails at once; the first
// steps of `waiting` block until the failing session is closed (the episode loop has taken its
// failure), at most 60 s; every other step answers at once, done at the third.
class FailWhileSiblingsStepEnvironment final : public Environment {
 public:
  FailWhileSiblingsStepEnvironment(uint64_t failing, std::vector<uint64_t> waiting)
      : failing_(failing), waiting_(std::move(waiting)) {}
  std::string name() const override { return "fails_while_siblings_step"; }
  int steps() const { return steps_.load(); }
  bool waited_out() const { return waited_out_.load(); }

  StatusOr<std::unique_ptr<EnvSession>> Open() override {
    return std::unique_ptr<EnvSession>(new Session(this));
  }

 private:
  class Session final : public EnvSession {
   public:
    explicit Session(FailWhileSiblingsStepEnvironment* env) : env_(env) {}
    ~Session() override {
      if (seed_ != env_->failing_) return;
      std::lock_guard<std::mutex> lock(env_->mu_);
      env_->failing_closed_ = true;
      env_->cv_.notify_all();
    }
    StatusOr<EnvObservation> Reset(const json&, uint64_t seed,
                                   std::chrono::steady_clock::time_point) override {
      seed_ = seed;
      return EnvObservation{};
    }
    StatusOr<EnvObservation> Step(const std::string&,
                                  std::chrono::steady_clock::time_point) override {
      env_->steps_.fetch_add(1);
      ++step_;
      if (seed_ == env_->failing_) return Status::Unavailable("gone");
      const auto& w = env_->waiting_;
      if (step_ == 1 && std::find(w.begin(), w.end(), seed_) != w.end()) {
        std::unique_lock<std::mutex> lock(env_->mu_);
        if (!env_->cv_.wait_for(lock, std::chrono::seconds(60),
                                [&] { return env_->failing_closed_; })) {
          env_->waited_out_.store(true);
        }
      }
      EnvObservation obs;
      obs.done = step_ == 3;
      if (!obs.done) obs.messages = {{"user", "go on"}};
      return obs;
    }

   private:
    FailWhileSiblingsStepEnvironment* env_;
    uint64_t seed_ = 0;
    int step_ = 0;
  };

  const uint64_t failing_;
  const std::vector<uint64_t> waiting_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool failing_closed_ = false;
  std::atomic<int> steps_{0};
  std::atomic<bool> waited_out_{false};
};

// With overlap, a step that fails fails its group while its siblings' steps are still running
// (their sessions are closed once those steps are back, and nothing of the group goes on), and
// the other group plays on.
TEST(Episodes, WithOverlappedStepsAFailedStepStopsItsGroupWhileItsSiblingsStep) {
  Fixture f(400, 3);
  EpisodeOptions o = f.Options(4);
  o.max_concurrent_sessions = 6;
  o.overlap_env_steps = true;
  FailWhileSiblingsStepEnvironment env(EpisodeSeed(o.seed, 2, 0),
                                       {EpisodeSeed(o.seed, 2, 1), EpisodeSeed(o.seed, 2, 2)});
  EpisodeCounts counts;
  auto result =
      ProduceEpisodes(*f.generator, nullptr, env, o, {{&f.prompt, 1}, {&f.prompt, 2}}, &counts);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_FALSE(env.waited_out());
  ASSERT_TRUE(result->groups[0].group.ok()) << result->groups[0].group.status().ToString();
  EXPECT_EQ(result->groups[0].group->completions.size(), 3u);
  ASSERT_FALSE(result->groups[1].group.ok());
  EXPECT_EQ(result->groups[1].group.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(counts.errors["unavailable"], 1);
  EXPECT_EQ(counts.done, 3);     // the first group's
  EXPECT_EQ(counts.stopped, 2);  // the siblings, stopped while they stepped
  // The first group's 9 steps and the second group's 3 first ones; nothing after the failure.
  EXPECT_EQ(env.steps(), 12);
}

// StreamEpisodes with a feed of 4 prompts and sessions for one group at a time (3 episodes, 3
// sessions): a group is taken only when sessions are free, and handed back as soon as its
// episodes end, before the next is taken; every group equals ProduceEpisodes' for the same
// seed index (its own sampler streams), its feedback is 0.5 per stepped turn (the environment's
// reward), and the counts handed back with the groups add up to the stream's.
TEST(Episodes, AStreamTakesGroupsAsSessionsFreeUpAndHandsEachBackWhenItEnds) {
  Fixture f;
  std::mutex mu;
  std::vector<std::string> actions;
  FunctionEnvironment env = EchoEnvironment(&actions, &mu);
  EpisodeOptions o = f.Options(3);
  o.max_concurrent_sessions = 3;
  const std::vector<int64_t> seeds = {4, 1, 3, 2};
  std::vector<std::string> events;  // "take <tag>" and "done <tag>" in order
  std::vector<EpisodeGroup> done(seeds.size());
  size_t given = 0;
  int64_t idle_calls = 0, max_room = 0;
  EpisodeFeed feed;
  feed.take = [&](int64_t room, bool idle) {
    idle_calls += idle ? 1 : 0;
    max_room = std::max(max_room, room);
    std::vector<FedPrompt> out;
    for (int64_t k = 0; k < room && given < seeds.size(); ++k, ++given) {
      out.push_back({{&f.prompt, seeds[given]}, static_cast<int64_t>(given)});
      events.push_back("take " + std::to_string(given));
    }
    return out;
  };
  feed.done = [&](EpisodeGroup g) {
    events.push_back("done " + std::to_string(g.tag));
    done[static_cast<size_t>(g.tag)] = std::move(g);
  };
  auto stats = StreamEpisodes(*f.generator, env, o, feed);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(events, (std::vector<std::string>{"take 0", "done 0", "take 1", "done 1", "take 2",
                                              "done 2", "take 3", "done 3"}));
  EXPECT_EQ(max_room, 1);
  EXPECT_GE(idle_calls, 1);  // the last call, answered with nothing, ended the stream

  std::vector<ProduceInput> inputs;
  for (int64_t seed : seeds) inputs.push_back({&f.prompt, seed});
  auto batch = ProduceEpisodes(*f.generator, nullptr, env, o, inputs);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  EpisodeCounts total;
  int64_t tokens = 0;
  for (size_t i = 0; i < seeds.size(); ++i) {
    const EpisodeGroup& g = done[i];
    ASSERT_TRUE(g.produced.group.ok()) << g.produced.group.status().ToString();
    ASSERT_TRUE(batch->groups[i].group.ok());
    ASSERT_EQ(g.produced.group->completions.size(), 3u);
    EXPECT_EQ(g.produced.group->policy_version, 3);
    EXPECT_FALSE(g.prompt_refused);
    ASSERT_EQ(g.feedback.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      const common::Completion& c = g.produced.group->completions[k];
      EXPECT_EQ(c.token_ids, batch->groups[i].group->completions[k].token_ids)
          << "group " << i << " episode " << k;
      EXPECT_TRUE(c.token_versions.empty()) << "a group of one version records none";
      int64_t stepped = 0;  // model turns, but one cut by the budget
      for (const TokenRun& r : Runs(c)) stepped += r.model ? 1 : 0;
      if (c.truncated && c.env_mask.back() == 1) stepped -= 1;
      ASSERT_TRUE(g.feedback[k].reward.has_value());
      EXPECT_DOUBLE_EQ(*g.feedback[k].reward, 0.5 * static_cast<double>(stepped));
      for (int32_t m : c.env_mask) tokens += m;
    }
    total.episodes += g.counts.episodes;
    total.turns += g.counts.turns;
  }
  EXPECT_EQ(total.episodes, 12);
  EXPECT_EQ(stats->counts.episodes, 0);  // every episode's group was handed back with its count
  EXPECT_EQ(stats->num_completion_tokens, tokens);
  EXPECT_GE(total.turns, 12);
}

// An idle `take` may block (a worker long-polls the learner for leases), so the stream calls it
// idle only when nothing is in flight: every group it took was handed back. Here sessions are
// free for two groups and the feed gives one prompt a call, so the first group's episodes are
// ready to decode (their resets back) while room is left: that call must not be idle. Until
// 2026-12-07 it was (only steps, resets and admission counted), and a worker blocked in its
// lease call with its groups unplayed until their leases expired.
TEST(Episodes, AStreamAsksIdleOnlyWhenEveryGroupItTookIsHandedBack) {
  Fixture f;
  std::mutex mu;
  std::vector<std::string> actions;
  FunctionEnvironment env = EchoEnvironment(&actions, &mu);
  EpisodeOptions o = f.Options(2);
  o.max_concurrent_sessions = 6;
  int64_t given = 0, handed_back = 0, idle_calls = 0;
  EpisodeFeed feed;
  feed.take = [&](int64_t room, bool idle) {
    EXPECT_GE(room, 1);
    std::vector<FedPrompt> out;
    if (idle) {
      ++idle_calls;
      EXPECT_EQ(given, handed_back)
          << "an idle call with groups in flight (call " << idle_calls << ")";
    }
    if (given < 4) {
      out.push_back({{&f.prompt, given}, given});
      ++given;
    }
    return out;
  };
  feed.done = [&](EpisodeGroup g) {
    EXPECT_TRUE(g.produced.group.ok()) << g.produced.group.status().ToString();
    ++handed_back;
  };
  auto stats = StreamEpisodes(*f.generator, env, o, feed);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(given, 4);
  EXPECT_EQ(handed_back, 4);
  EXPECT_GE(idle_calls, 2);  // the first call, and the last (answered with nothing)
}

TEST(Episodes, AStreamRefusesAFeedWithoutBothFunctionsAndFailsABadPromptAlone) {
  Fixture f;
  FunctionEnvironment env = EchoEnvironment(nullptr, nullptr);
  EpisodeFeed half;
  half.take = [](int64_t, bool) { return std::vector<FedPrompt>{}; };
  auto refused = StreamEpisodes(*f.generator, env, f.Options(2), half);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);

  std::mutex mu;
  std::vector<std::string> actions;
  FunctionEnvironment echo = EchoEnvironment(&actions, &mu);
  Prompt empty;
  bool given = false;
  std::vector<EpisodeGroup> done;
  EpisodeFeed feed;
  feed.take = [&](int64_t, bool) {
    std::vector<FedPrompt> out;
    if (!given) out = {{{&empty, 1}, 7}, {{&f.prompt, 2}, 8}};
    given = true;
    return out;
  };
  feed.done = [&](EpisodeGroup g) { done.push_back(std::move(g)); };
  EpisodeOptions o = f.Options(2);
  o.max_concurrent_sessions = 6;  // room for 2 groups in one take
  ASSERT_TRUE(StreamEpisodes(*f.generator, echo, o, feed).ok());
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].tag, 7);  // failed at once
  EXPECT_TRUE(done[0].prompt_refused);
  ASSERT_FALSE(done[0].produced.group.ok());
  EXPECT_NE(done[0].produced.group.status().message().find("prompt (tag 7): empty prompt"),
            std::string::npos)
      << done[0].produced.group.status().ToString();
  EXPECT_EQ(done[1].tag, 8);
  EXPECT_TRUE(done[1].produced.group.ok()) << done[1].produced.group.status().ToString();
}

// A stream whose first group fails at its first reset while its other episodes wait for a
// session (num_generations 3 over 2 sessions: two reset at once, both fail): the group goes back
// failed with the reset's error, its third episode never starts, and the next groups run; every
// episode of the failed group is counted once, as an error or as stopped.
TEST(Episodes, AStreamHandsBackAGroupThatFailedBeforeAllItsEpisodesStarted) {
  Fixture f;
  FunctionEnvironment env = FlakyEnvironment();
  Prompt bad = f.prompt;
  bad.row = json{{"fail", true}};
  std::vector<FedPrompt> queue = {{{&bad, 1}, 0}, {{&f.prompt, 2}, 1}, {{&f.prompt, 3}, 2}};
  std::vector<EpisodeGroup> done;
  EpisodeFeed feed;
  feed.take = [&](int64_t room, bool) {
    std::vector<FedPrompt> out;
    while (room-- > 0 && !queue.empty()) {
      out.push_back(queue.front());
      queue.erase(queue.begin());
    }
    return out;
  };
  feed.done = [&](EpisodeGroup g) { done.push_back(std::move(g)); };
  auto stats = StreamEpisodes(*f.generator, env, f.Options(2), feed);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  ASSERT_EQ(done.size(), 3u);
  EpisodeCounts total = stats->counts;
  for (const EpisodeGroup& g : done) {
    total.stopped += g.counts.stopped;
    total.done += g.counts.done;
    for (const auto& [kind, n] : g.counts.errors) total.errors[kind] += n;
    if (g.tag == 0) {
      ASSERT_FALSE(g.produced.group.ok());
      EXPECT_EQ(g.produced.group.status().code(), StatusCode::kUnavailable);
    } else {
      EXPECT_TRUE(g.produced.group.ok()) << g.produced.group.status().ToString();
    }
  }
  // Two reset at once and fail; the third never starts. A failure taken while the other reset
  // is still out stops that one (its failure, back later, is dropped): 1 or 2 errors, by timing.
  EXPECT_GE(total.errors["unavailable"], 1);
  EXPECT_EQ(total.errors["unavailable"] + total.stopped, 3);
  EXPECT_EQ(total.done, 6);
}

// A newer policy installed while the first turns decode (version 3 -> 4, as a worker's in-flight
// fetcher does with partial_rollouts), in turns and in a stream (overlap_env_steps). A turn keeps
// the policy it started with, so a group whose turns used both records each token's version
// (Completion::token_versions): a model token that of its turn, and its log-prob is a full
// forward's of the episode so far under that version's model (teacher forcing), not the
// other's; an environment token that of the next model turn (the last one's when none follows),
// so versions never go down; the group's policy_version is its oldest token's.
void CheckTokenVersionsAcrossAnUpdate(bool overlap) {
  Fixture f;
  const std::shared_ptr<const common::Model> v3 = TinyModel(), v4 = TinyModel(6);
  GeneratorOptions go = f.generator->options();
  Generator* generator = nullptr;
  bool switched = false;
  go.window_hook = [&](int64_t steps) {
    if (steps < 2 || switched) return;
    switched = true;
    ASSERT_TRUE(generator->SetPolicy(v4, 4).ok());
  };
  auto owned = Generator::Create(v3, 3, go, &f.tokenizer);
  ASSERT_TRUE(owned.ok());
  generator = owned->get();
  std::vector<std::string> actions;
  std::mutex mu;
  FunctionEnvironment env = EchoEnvironment(&actions, &mu);
  EpisodeOptions o = f.Options(3);
  o.max_concurrent_sessions = 6;  // both groups at once
  o.overlap_env_steps = overlap;
  auto result = ProduceEpisodes(*generator, nullptr, env, o, {{&f.prompt, 1}, {&f.prompt, 2}});
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  ASSERT_TRUE(switched);
  int mixed = 0;
  for (const ProducedGroup& produced : result->groups) {
    ASSERT_TRUE(produced.group.ok()) << produced.group.status().ToString();
    const common::RolloutGroup& g = *produced.group;
    std::set<int64_t> versions;  // of the group's model tokens
    for (const common::Completion& c : g.completions) {
      if (c.token_versions.empty()) continue;
      ASSERT_EQ(c.token_versions.size(), c.token_ids.size());
      const std::vector<double> under3 = TeacherForced(*v3, g.prompt_ids, c.token_ids);
      const std::vector<double> under4 = TeacherForced(*v4, g.prompt_ids, c.token_ids);
      // Each run of env_mask: [begin, end).
      std::vector<std::pair<size_t, size_t>> runs;
      for (size_t t = 0; t < c.token_ids.size(); ++t) {
        if (t == 0 || c.env_mask[t] != c.env_mask[t - 1]) runs.push_back({t, t});
        runs.back().second = t + 1;
      }
      for (size_t r = 0; r < runs.size(); ++r) {
        const auto [begin, end] = runs[r];
        const bool model = c.env_mask[begin] == 1;
        // A model run's own version; an environment run's, the next model run's (else the last).
        const size_t from = model ? r : (r + 1 < runs.size() ? r + 1 : r - 1);
        const int64_t want = c.token_versions[runs[from].first];
        ASSERT_TRUE(want == 3 || want == 4) << want;
        double worst = 0.0, other = 0.0;
        for (size_t t = begin; t < end; ++t) {
          EXPECT_EQ(c.token_versions[t], want) << "token " << t << " of run " << r;
          if (!model) continue;
          const double own = want == 3 ? under3[t] : under4[t];
          const double not_own = want == 3 ? under4[t] : under3[t];
          worst = std::max(worst, std::abs(c.logprobs[t] - own));
          other = std::max(other, std::abs(c.logprobs[t] - not_own));
        }
        if (!model) continue;
        versions.insert(want);
        EXPECT_LT(worst, 1e-4) << "run " << r << " against its version " << want;
        EXPECT_GT(other, 1e-3) << "run " << r << " as likely under the other version";
      }
      EXPECT_TRUE(std::is_sorted(c.token_versions.begin(), c.token_versions.end()));
      ++mixed;
    }
    if (versions.empty()) continue;  // a group of one version
    EXPECT_EQ(g.policy_version, *versions.begin());
    EXPECT_EQ(versions, (std::set<int64_t>{3, 4}))
        << "a group records token versions only when its turns used two";
  }
  EXPECT_GT(mixed, 0) << "no group took turns of both versions: the test shows little";
  EXPECT_EQ(result->policy_version, 3);
}

TEST(Episodes, TurnsOfTwoVersionsRecordEachTokensVersion) {
  CheckTokenVersionsAcrossAnUpdate(/*overlap=*/false);
}

TEST(Episodes, StreamedTurnsOfTwoVersionsRecordEachTokensVersion) {
  CheckTokenVersionsAcrossAnUpdate(/*overlap=*/true);
}

TEST(Episodes, EpisodeSeedsDependOnRowAndGenerationOnly) {
  EXPECT_EQ(EpisodeSeed(1, 2, 3), EpisodeSeed(1, 2, 3));
  EXPECT_NE(EpisodeSeed(1, 2, 3), EpisodeSeed(1, 2, 4));
  EXPECT_NE(EpisodeSeed(1, 2, 3), EpisodeSeed(1, 3, 3));
  EXPECT_NE(EpisodeSeed(1, 2, 3), EpisodeSeed(2, 2, 3));
}

TEST(Episodes, OptionsAreChecked) {
  Fixture f;
  FunctionEnvironment env = EchoEnvironment(nullptr, nullptr);
  EpisodeOptions o = f.Options(0);
  auto result = ProduceEpisodes(*f.generator, nullptr, env, o, {{&f.prompt, 1}});
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("max_turns"), std::string::npos);
}

}  // namespace
}  // namespace grpo::rollout
