// Generator::Continue with a TurnCache (rollout/generator.h): a multi-turn row's next turn starts
// from the keys/values of its earlier turns. The reference is the same Continue without a cache
// (the whole context prefilled every turn), run in lockstep on the same rows and seeds; the
// prefill counts are checked against the tokens each row appended, counted here by hand.
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "rollout/env/episode.h"
#include "rollout/generator.h"
#include "tests/rollout/scaled_tiny_model.h"
#include "tests/rollout/turn_rows.h"

namespace grpo::rollout {
namespace {

using common::Model;
using nlohmann::json;

// Runs the episodes turn by turn twice in lockstep, with `cache` and without, and checks that
// every turn is the same; `between(turn)` runs after each turn. Returns the cached run's
// per-turn results.
std::vector<ContinueResult> RunLockstep(const Generator& gen, TurnCache* cache,
                                        const std::function<void(int64_t)>& between = {},
                                        bool groups = false) {
  std::vector<TurnRow> episodes = SixRows(groups);
  std::vector<ContinueResult> turns;
  for (int64_t turn = 0;; ++turn) {
    std::vector<size_t> live;
    std::vector<Continuation> rows;
    for (size_t r = 0; r < episodes.size(); ++r) {
      const TurnRow& e = episodes[r];
      if (e.last_turn < turn) continue;
      live.push_back(r);
      rows.push_back({e.context, e.seed_index, e.generation, turn, kMaxNew});
    }
    if (rows.empty()) break;
    for (const TurnRow& e : episodes) {  // ended: its caller frees its row, as ProduceEpisodes does
      if (e.last_turn < turn && cache != nullptr) cache->Release(e.seed_index, e.generation);
    }
    auto kept = gen.Continue(rows, cache);
    auto again = gen.Continue(rows);
    EXPECT_TRUE(kept.ok()) << kept.status().ToString();
    EXPECT_TRUE(again.ok()) << again.status().ToString();
    if (!kept.ok() || !again.ok()) return turns;
    EXPECT_EQ(kept->policy_version, again->policy_version);
    EXPECT_EQ(kept->num_completion_tokens, again->num_completion_tokens);
    for (size_t j = 0; j < live.size(); ++j) {
      const common::Completion& a = kept->completions[j];
      const common::Completion& b = again->completions[j];
      EXPECT_EQ(a.token_ids, b.token_ids) << "episode " << live[j] << " turn " << turn;
      EXPECT_EQ(a.truncated, b.truncated) << "episode " << live[j] << " turn " << turn;
      EXPECT_EQ(a.logprobs.size(), b.logprobs.size());
      for (size_t t = 0; t < std::min(a.logprobs.size(), b.logprobs.size()); ++t) {
        EXPECT_NEAR(a.logprobs[t], b.logprobs[t], 1e-5)
            << "episode " << live[j] << " turn " << turn;
      }
      // The episode goes on from the reference's turn (the same ids when the test passes).
      TurnRow& e = episodes[live[j]];
      e.context.insert(e.context.end(), b.token_ids.begin(), b.token_ids.end());
      const std::vector<int32_t> obs = Observation(live[j], turn);
      e.context.insert(e.context.end(), obs.begin(), obs.end());
    }
    turns.push_back(std::move(kept).value());
    if (between) between(turn);
  }
  return turns;
}

// What each turn must prefill with the cache: whole prompts at turn 0; afterwards, per live row,
// its previous turn's last token (sampled, never fed) and the observation after it.
std::vector<int64_t> ExpectedPrefill() {
  const std::vector<TurnRow> episodes = SixRows();
  std::vector<int64_t> per_turn;
  for (int64_t turn = 0; turn <= 3; ++turn) {
    int64_t n = 0;
    for (size_t r = 0; r < episodes.size(); ++r) {
      if (episodes[r].last_turn < turn) continue;
      n += turn == 0 ? static_cast<int64_t>(episodes[r].context.size())
                     : 1 + static_cast<int64_t>(Observation(r, turn - 1).size());
    }
    per_turn.push_back(n);
  }
  return per_turn;
}

struct Variant {
  int64_t stop_check_interval;
  double repetition_penalty;
};

class TurnCacheLockstep : public ::testing::TestWithParam<Variant> {};

TEST_P(TurnCacheLockstep, KeptCacheTurnsEqualReprefilledTurnsAndPrefillOnlyWhatWasAppended) {
  auto gen =
      Generator::Create(ScaledTinyModel(3), 1,
                        TurnOptions(GetParam().stop_check_interval, GetParam().repetition_penalty))
          .value();
  TurnCache cache;
  std::vector<ContinueResult> turns = RunLockstep(*gen, &cache);
  ASSERT_EQ(turns.size(), 4u);
  const std::vector<int64_t> expected = ExpectedPrefill();
  int64_t lengths_seen = 0;
  for (size_t t = 0; t < turns.size(); ++t) {
    EXPECT_EQ(turns[t].num_prefill_tokens, expected[t]) << "turn " << t;
    EXPECT_EQ(turns[t].num_cached_tokens > 0, t > 0) << "turn " << t;
    for (const auto& c : turns[t].completions) lengths_seen |= 1 << c.token_ids.size();
  }
  // The test shows something only if turns have different lengths (stops inside windows).
  EXPECT_GE(__builtin_popcountll(lengths_seen), 3);
  // After the last turn the cache holds the last call's two rows, as a dense row each.
  EXPECT_EQ(cache.num_rows(), 2);
  EXPECT_EQ(cache.policy_version(), 1);
}

INSTANTIATE_TEST_SUITE_P(StopWindowsAndPenalty, TurnCacheLockstep,
                         ::testing::Values(Variant{1, 1.0}, Variant{4, 1.0}, Variant{3, 1.3}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return "interval" + std::to_string(info.param.stop_check_interval) +
                                  (info.param.repetition_penalty != 1.0 ? "_penalty" : "");
                         });

// A group's first turn: its episodes share one prompt, so its prefill runs once (all but the
// prompt's last token), and each row starts from it; the turns still equal whole prefills.
TEST(TurnCache, AGroupsFirstTurnPrefillsItsPromptOnceAndStillMatches) {
  auto gen = Generator::Create(ScaledTinyModel(3), 1, TurnOptions(1, 1.0)).value();
  TurnCache cache;
  std::vector<ContinueResult> turns = RunLockstep(*gen, &cache, {}, /*groups=*/true);
  ASSERT_EQ(turns.size(), 4u);
  // Prompts of 5 and 9 ids, 3 episodes each: 4 + 8 ids once, and each row's last prompt id.
  EXPECT_EQ(turns[0].num_prefill_tokens, (5 - 1) + (9 - 1) + 6);
  EXPECT_EQ(turns[0].num_cached_tokens, 0);
  // Later turns as without groups: each row's last sampled token and its observation.
  const std::vector<int64_t> expected = ExpectedPrefill();
  for (size_t t = 1; t < turns.size(); ++t) {
    EXPECT_EQ(turns[t].num_prefill_tokens, expected[t]) << "turn " << t;
  }
  // Rows of one prompt sampled different turns (their own streams), so the check compared six.
  EXPECT_NE(turns[0].completions[0].token_ids, turns[0].completions[2].token_ids);
}

TEST(TurnCache, APolicyChangeBetweenTurnsPrefillsEverythingAgainAndStillMatches) {
  auto gen = Generator::Create(ScaledTinyModel(3), 1, TurnOptions(1, 1.0)).value();
  std::shared_ptr<const Model> other = ScaledTinyModel(4);
  TurnCache cache;
  std::vector<ContinueResult> turns = RunLockstep(*gen, &cache, [&](int64_t turn) {
    if (turn == 1) {
      ASSERT_TRUE(gen->SetPolicy(other, 2).ok());
    }
  });
  ASSERT_EQ(turns.size(), 4u);
  EXPECT_EQ(turns[1].policy_version, 1);
  EXPECT_GT(turns[1].num_cached_tokens, 0);
  // Turn 2 ran on the new policy: nothing from version 1 was used.
  EXPECT_EQ(turns[2].policy_version, 2);
  EXPECT_EQ(turns[2].num_cached_tokens, 0);
  EXPECT_GT(turns[3].num_cached_tokens, 0);
  EXPECT_EQ(cache.policy_version(), 2);
}

TEST(TurnCache, KeepsRowsUntilReleasedAndCountsTheirBytes) {
  auto gen = Generator::Create(ScaledTinyModel(3), 1, TurnOptions(1, 1.0)).value();
  TurnCache cache;
  std::vector<Continuation> rows = {
      {{1, 2, 3}, 0, 0, 0, kMaxNew}, {{4, 5, 6, 7, 8}, 0, 1, 0, kMaxNew}, {{9}, 1, 0, 0, kMaxNew}};
  auto r = gen->Continue(rows, &cache);
  ASSERT_TRUE(r.ok());
  int64_t tokens = 0;  // context + completion without its last token, per row
  for (size_t i = 0; i < rows.size(); ++i) {
    tokens += static_cast<int64_t>(rows[i].context.size() + r->completions[i].token_ids.size()) - 1;
  }
  EXPECT_EQ(cache.num_rows(), 3);
  EXPECT_EQ(cache.num_tokens(), tokens);
  // tiny: 2 layers x (keys + values) x 2 KV heads x head_dim 16 x 4 bytes per token.
  EXPECT_EQ(cache.bytes(), tokens * 2 * 2 * 2 * 16 * 4);
  // A call with one of the rows replaces it and keeps the two others as they were.
  const int64_t row0_tokens =
      static_cast<int64_t>(rows[0].context.size() + r->completions[0].token_ids.size()) - 1;
  const int64_t row2_tokens =
      static_cast<int64_t>(rows[2].context.size() + r->completions[2].token_ids.size()) - 1;
  std::vector<Continuation> one = {rows[1]};
  one[0].context.insert(one[0].context.end(), r->completions[1].token_ids.begin(),
                        r->completions[1].token_ids.end());
  one[0].turn = 1;
  auto r2 = gen->Continue(one, &cache);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->num_cached_tokens, static_cast<int64_t>(one[0].context.size()) - 1);
  EXPECT_EQ(r2->num_prefill_tokens, 1);
  EXPECT_EQ(cache.num_rows(), 3);
  const int64_t row1_tokens =
      static_cast<int64_t>(one[0].context.size() + r2->completions[0].token_ids.size()) - 1;
  EXPECT_EQ(cache.num_tokens(), row0_tokens + row1_tokens + row2_tokens);
  // Release frees one row (an ended episode's); a key not held is nothing to free.
  cache.Release(0, 0);
  cache.Release(5, 5);
  EXPECT_EQ(cache.num_rows(), 2);
  EXPECT_EQ(cache.num_tokens(), row1_tokens + row2_tokens);
  EXPECT_EQ(cache.bytes(), (row1_tokens + row2_tokens) * 2 * 2 * 2 * 16 * 4);
  cache.Clear();
  EXPECT_EQ(cache.num_rows(), 0);
  EXPECT_EQ(cache.bytes(), 0);
  EXPECT_EQ(cache.policy_version(), -1);
}

// A bad row is refused before the cache is read: the rows it holds stay for the next call.
TEST(TurnCache, ARefusedRowLeavesTheCacheAsItWas) {
  auto gen = Generator::Create(ScaledTinyModel(3), 1, TurnOptions(1, 1.0)).value();
  TurnCache cache;
  ASSERT_TRUE(
      gen->Continue({{{1, 2, 3}, 0, 0, 0, kMaxNew}, {{4, 5}, 0, 1, 0, kMaxNew}}, &cache).ok());
  const int64_t tokens = cache.num_tokens();
  auto refused = gen->Continue({{{1, 2, 3}, 0, 0, 1, kMaxNew}, {{}, 0, 1, 1, kMaxNew}}, &cache);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("continuation 1: empty context"), std::string::npos);
  EXPECT_EQ(cache.num_rows(), 2);
  EXPECT_EQ(cache.num_tokens(), tokens);
}

TEST(TurnCache, AnEditedContextReusesOnlyTheCommonPrefixAndStillMatches) {
  auto gen = Generator::Create(ScaledTinyModel(3), 1, TurnOptions(1, 1.0)).value();
  TurnCache cache;
  Continuation row{{10, 20, 30, 40, 50, 60}, 0, 0, 0, kMaxNew};
  ASSERT_TRUE(gen->Continue({row}, &cache).ok());
  // The same key, a context that differs from position 3 on.
  row.context = {10, 20, 30, 41, 50, 60, 70};
  row.turn = 1;
  auto kept = gen->Continue({row}, &cache);
  auto again = gen->Continue({row});
  ASSERT_TRUE(kept.ok() && again.ok());
  EXPECT_EQ(kept->num_cached_tokens, 3);
  EXPECT_EQ(kept->num_prefill_tokens, 4);
  EXPECT_EQ(kept->completions[0].token_ids, again->completions[0].token_ids);
}

// ProduceEpisodes keeps the cache by default: its groups equal those of keep_kv_cache = false.
TEST(TurnCache, EpisodesWithTheKeptCacheEqualEpisodesThatPrefillEveryTurn) {
  common::ByteTokenizer tokenizer;
  GeneratorOptions o = TurnOptions(1, 1.0);
  o.num_generations = 4;
  o.max_completion_length = 60;
  auto gen = Generator::Create(ScaledTinyModel(3), 1, o, &tokenizer).value();
  // Ends after 2 to 4 steps (by the reset seed); observations of 1 + 2 * step + |action| % 3.
  FunctionEnvironment env(
      "lengths",
      [](const json&, uint64_t seed, json& state) -> StatusOr<EnvObservation> {
        state = {{"step", 0}, {"end", 2 + static_cast<int>(seed % 3)}};
        return EnvObservation{};
      },
      [](const std::string& action, json& state) -> StatusOr<EnvObservation> {
        const int step = state["step"].get<int>() + 1;
        state["step"] = step;
        EnvObservation obs;
        obs.done = step >= state["end"].get<int>();
        if (!obs.done) {
          obs.messages = {{"user", std::string(1 + 2 * step + action.size() % 3, 'o')}};
        }
        return obs;
      });
  Prompt prompt;
  prompt.text = "play";
  prompt.ids = {112, 108, 97, 121};
  EpisodeOptions e;
  e.max_turns = 5;
  e.max_concurrent_sessions = 1;
  e.end_of_turn_id = 258;
  e.render = [](const std::vector<common::ChatMessage>& m, bool) -> StatusOr<std::vector<int32_t>> {
    std::vector<int32_t> ids;
    for (unsigned char c : m[0].content) ids.push_back(c);
    return ids;
  };
  EpisodeCounts kept_counts, again_counts;
  auto kept = ProduceEpisodes(*gen, nullptr, env, e, {{&prompt, 0}, {&prompt, 1}}, &kept_counts);
  e.keep_kv_cache = false;
  auto again = ProduceEpisodes(*gen, nullptr, env, e, {{&prompt, 0}, {&prompt, 1}}, &again_counts);
  ASSERT_TRUE(kept.ok() && again.ok());
  EXPECT_GE(kept_counts.turns, 8 * 2);
  EXPECT_EQ(kept_counts.turns, again_counts.turns);
  EXPECT_EQ(kept_counts.done, again_counts.done);
  for (size_t g = 0; g < 2; ++g) {
    ASSERT_TRUE(kept->groups[g].group.ok() && again->groups[g].group.ok());
    const auto& a = kept->groups[g].group->completions;
    const auto& b = again->groups[g].group->completions;
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(a[k].token_ids, b[k].token_ids) << "group " << g << " episode " << k;
      EXPECT_EQ(a[k].env_mask, b[k].env_mask);
      ASSERT_EQ(a[k].logprobs.size(), b[k].logprobs.size());
      for (size_t t = 0; t < a[k].logprobs.size(); ++t) {
        EXPECT_NEAR(a[k].logprobs[t], b[k].logprobs[t], 1e-5);
      }
    }
  }
}

}  // namespace
}  // namespace grpo::rollout
