// Generator::ContinueStream (rollout/generator.h): multi-turn rows that join and leave a running
// decode. The reference for every turn is Generator::Continue of that row alone, without a
// cache (its whole context prefilled), the path turn_cache_test checks; prefill counts are
// counted here by hand from the contexts and observations.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rollout/generator.h"
#include "tests/rollout/scaled_tiny_model.h"
#include "tests/rollout/turn_rows.h"

namespace grpo::rollout {
namespace {

using common::Completion;
using common::Model;

Continuation ContinuationOf(const TurnRow& row, size_t tag) {
  Continuation c{row.context, row.seed_index, row.generation, row.turn, kMaxNew};
  c.tag = static_cast<int64_t>(tag);
  return c;
}

// The reference turn: the row alone, its whole context prefilled.
Completion Alone(const Generator& gen, const Continuation& row) {
  auto r = gen.Continue({row});
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r->completions[0] : Completion{};
}

void ExpectSameTurn(const Completion& got, const Completion& want, const std::string& where) {
  EXPECT_EQ(got.token_ids, want.token_ids) << where;
  EXPECT_EQ(got.truncated, want.truncated) << where;
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << where;
  for (size_t t = 0; t < got.logprobs.size(); ++t) {
    EXPECT_NEAR(got.logprobs[t], want.logprobs[t], 1e-5) << where << " token " << t;
  }
}

struct Variant {
  int64_t stop_check_interval;
  double repetition_penalty;
  bool cache;
};

class TurnStreamRuns : public ::testing::TestWithParam<Variant> {};

// The rows play all their turns through one stream: row r starts on the r-th call of `take`
// (so rows join while others decode), and after each turn the row comes back with its
// observation r % 3 calls later (as an environment step that takes longer for some rows).
// Every turn equals the row's turn alone, the rows were in flight together and left one by one,
// and with the cache each later turn prefilled only its last token and its observation.
TEST_P(TurnStreamRuns, EveryTurnEqualsTheRowAloneWhateverJoinsOrLeaves) {
  const Variant v = GetParam();
  auto gen = Generator::Create(ScaledTinyModel(3), 1,
                               TurnOptions(v.stop_check_interval, v.repetition_penalty))
                 .value();
  std::vector<TurnRow> rows = SixRows();
  std::vector<int64_t> back_at(rows.size(), -1);  // the take call at which a row is offered
  for (size_t r = 0; r < rows.size(); ++r) back_at[r] = static_cast<int64_t>(r);
  std::map<size_t, Continuation> in_flight;  // tag -> the row as taken
  int64_t calls = 0, joined_while_decoding = 0, left_while_decoding = 0, turns = 0;
  int64_t expected_prefill = 0;
  TurnCache cache;
  TurnStream stream;
  stream.take = [&](bool idle) {
    std::vector<Continuation> out;
    for (size_t r = 0; r < rows.size(); ++r) {
      // Ended rows free their kept keys/values, as ProduceEpisodes does.
      if (rows[r].turn > rows[r].last_turn) cache.Release(rows[r].seed_index, rows[r].generation);
    }
    // Idle: nothing decodes, so the next row due comes now (the stream would end otherwise).
    int64_t due = -1;
    for (size_t r = 0; r < rows.size(); ++r) {
      if (back_at[r] >= 0 && (due < 0 || back_at[r] < due)) due = back_at[r];
    }
    if (idle && due > calls) calls = due;
    for (size_t r = 0; r < rows.size(); ++r) {
      if (back_at[r] < 0 || back_at[r] > calls) continue;
      back_at[r] = -1;
      out.push_back(ContinuationOf(rows[r], r));
      in_flight[r] = out.back();
      joined_while_decoding += idle ? 0 : 1;
      expected_prefill += rows[r].turn == 0 || !v.cache
                              ? static_cast<int64_t>(rows[r].context.size())
                              : 1 + static_cast<int64_t>(Observation(r, rows[r].turn - 1).size());
    }
    ++calls;
    return out;
  };
  stream.done = [&](StreamedTurn t) {
    const size_t r = static_cast<size_t>(t.tag);
    ASSERT_EQ(in_flight.count(r), 1u);
    const Continuation taken = in_flight[r];
    in_flight.erase(r);
    left_while_decoding += in_flight.empty() ? 0 : 1;
    ++turns;
    EXPECT_EQ(t.policy_version, 1);
    ExpectSameTurn(t.completion, Alone(*gen, taken),
                   "row " + std::to_string(r) + " turn " + std::to_string(taken.turn));
    // The row goes on from the reference's turn (the same ids when the test passes).
    TurnRow& row = rows[r];
    const Completion want = Alone(*gen, taken);
    row.context.insert(row.context.end(), want.token_ids.begin(), want.token_ids.end());
    const std::vector<int32_t> obs = Observation(r, row.turn);
    row.context.insert(row.context.end(), obs.begin(), obs.end());
    row.turn += 1;
    if (row.turn <= row.last_turn) back_at[r] = calls + static_cast<int64_t>(r % 3);
  };
  auto stats = gen->ContinueStream(stream, v.cache ? &cache : nullptr);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(turns, 1 + 2 + 3 + 3 + 4 + 4);
  EXPECT_EQ(stats->num_turns, turns);
  EXPECT_TRUE(in_flight.empty());
  // The stream showed something only if rows joined and left a running decode.
  EXPECT_GT(joined_while_decoding, 3);
  EXPECT_GT(left_while_decoding, 3);
  EXPECT_GE(stats->max_rows, 3);
  EXPECT_EQ(stats->num_prefill_tokens, expected_prefill);
  EXPECT_EQ(stats->num_cached_tokens > 0, v.cache);
  EXPECT_EQ(stats->num_switches, 0);
  if (v.cache) {
    // Every row ended and was released but those whose last turn was the stream's last calls.
    EXPECT_LE(cache.num_rows(), 2);
    EXPECT_EQ(cache.policy_version(), 1);
  }
}

INSTANTIATE_TEST_SUITE_P(StopWindowsPenaltyAndCache, TurnStreamRuns,
                         ::testing::Values(Variant{1, 1.0, true}, Variant{4, 1.0, true},
                                           Variant{3, 1.3, true}, Variant{1, 1.0, false}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return "interval" + std::to_string(info.param.stop_check_interval) +
                                  (info.param.repetition_penalty != 1.0 ? "_penalty" : "") +
                                  (info.param.cache ? "_cache" : "_nocache");
                         });

// A group's first turn taken together prefills its prompt once for its rows, as Continue's.
TEST(TurnStream, AGroupsFirstTurnSharesOnePrefill) {
  auto gen = Generator::Create(ScaledTinyModel(3), 1, TurnOptions(1, 1.0)).value();
  const std::vector<TurnRow> rows = SixRows(/*groups=*/true);
  bool given = false;
  std::map<int64_t, Completion> got;
  TurnStream stream;
  stream.take = [&](bool) {
    std::vector<Continuation> out;
    if (!given) {
      for (size_t r = 0; r < rows.size(); ++r) out.push_back(ContinuationOf(rows[r], r));
    }
    given = true;
    return out;
  };
  stream.done = [&](StreamedTurn t) { got[t.tag] = std::move(t.completion); };
  TurnCache cache;
  auto stats = gen->ContinueStream(stream, &cache);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  // Prompts of 5 and 9 ids, 3 rows each: 4 + 8 ids once, and each row's last prompt id.
  EXPECT_EQ(stats->num_prefill_tokens, (5 - 1) + (9 - 1) + 6);
  ASSERT_EQ(got.size(), rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    ExpectSameTurn(got[static_cast<int64_t>(r)], Alone(*gen, ContinuationOf(rows[r], r)),
                   "row " + std::to_string(r));
  }
  EXPECT_EQ(cache.num_rows(), 6);
}

// A newer policy installed while a row decodes: the row ends its turn on the version it started
// with, no row is taken until it has, and the next row's turn is the new policy's alone. The
// cache drops the rows of the old version.
TEST(TurnStream, ANewerPolicyWaitsForTheRowsInFlight) {
  GeneratorOptions o = TurnOptions(1, 1.0);
  o.eos_token_ids = {-1};  // every turn runs kMaxNew tokens
  std::shared_ptr<const Model> other = ScaledTinyModel(4);
  bool switched = false;
  Generator* self = nullptr;
  o.window_hook = [&](int64_t steps) {
    if (steps == 2 && !switched) {
      ASSERT_TRUE(self->SetPolicy(other, 2).ok());
      switched = true;
    }
  };
  auto gen = Generator::Create(ScaledTinyModel(3), 1, o).value();
  self = gen.get();
  GeneratorOptions plain = o;
  plain.window_hook = nullptr;
  auto old_gen = Generator::Create(ScaledTinyModel(3), 1, plain).value();
  auto new_gen = Generator::Create(other, 2, plain).value();

  const std::vector<TurnRow> rows = SixRows();
  const Continuation a = ContinuationOf(rows[0], 0), b = ContinuationOf(rows[1], 1);
  int64_t calls_after_switch_before_a = 0;
  bool a_done = false, b_given = false, a_given = false;
  std::map<int64_t, StreamedTurn> got;
  TurnStream stream;
  stream.take = [&](bool) {
    if (!a_given) {
      a_given = true;
      return std::vector<Continuation>{a};
    }
    if (switched && !a_done) ++calls_after_switch_before_a;
    if (switched && !b_given) {
      b_given = true;
      return std::vector<Continuation>{b};
    }
    return std::vector<Continuation>{};
  };
  stream.done = [&](StreamedTurn t) {
    a_done = a_done || t.tag == 0;
    got[t.tag] = std::move(t);
  };
  TurnCache cache;
  auto stats = gen->ContinueStream(stream, &cache);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(calls_after_switch_before_a, 0);
  EXPECT_EQ(stats->num_switches, 1);
  EXPECT_EQ(stats->max_rows, 1);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].policy_version, 1);
  EXPECT_EQ(got[1].policy_version, 2);
  ExpectSameTurn(got[0].completion, Alone(*old_gen, a), "row 0 on version 1");
  ExpectSameTurn(got[1].completion, Alone(*new_gen, b), "row 1 on version 2");
  EXPECT_EQ(cache.policy_version(), 2);
  EXPECT_EQ(cache.num_rows(), 1);  // row 1's: row 0's was of version 1
}

TEST(TurnStream, ABadRowEndsTheStreamNamingItsTag) {
  auto gen = Generator::Create(ScaledTinyModel(3), 1, TurnOptions(1, 1.0)).value();
  int64_t calls = 0;
  TurnStream stream;
  stream.take = [&](bool) {
    ++calls;
    Continuation good{{1, 2, 3}, 0, 0, 0, kMaxNew};
    Continuation bad{{4, 999}, 0, 1, 0, kMaxNew};
    bad.tag = 7;
    return calls == 1   ? std::vector<Continuation>{good}
           : calls == 2 ? std::vector<Continuation>{bad}
                        : std::vector<Continuation>{};
  };
  stream.done = [](StreamedTurn) {};
  auto stats = gen->ContinueStream(stream, nullptr);
  ASSERT_FALSE(stats.ok());
  EXPECT_EQ(stats.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(stats.status().message().find("continuation (tag 7): token id 999"), std::string::npos)
      << stats.status().ToString();

  TurnStream half;
  half.take = stream.take;
  auto refused = gen->ContinueStream(half, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::rollout
