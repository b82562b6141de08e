// learner/dynamic_sampling.h: which groups carry a learning signal (DAPO's filter: rewards not
// all equal, judged as TRL's frac_reward_zero_std judges a std to be zero) and how a generation
// batch's fill is counted. Every expected verdict below is worked out by hand in its comment.
#include "learner/dynamic_sampling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace grpo::learner {
namespace {

using Rewards = std::vector<std::optional<double>>;

common::RolloutGroup Group(const std::vector<Rewards>& per_completion) {
  common::RolloutGroup g;
  g.prompt_id = "p";
  for (const Rewards& r : per_completion) {
    common::Completion c;
    c.token_ids = {1};
    c.rewards = r;
    g.completions.push_back(c);
  }
  return g;
}

constexpr auto kSum = MultiObjectiveAggregation::kSumThenNormalize;
constexpr auto kGdpo = MultiObjectiveAggregation::kNormalizeThenSum;
const std::optional<double> kNull = std::nullopt;

TEST(GroupHasSignalTest, AllEqualRewardsHaveNoneOneDifferentHas) {
  // DAPO's case: every completion right (1) or every one wrong (0).
  EXPECT_FALSE(GroupHasSignal(Group({{1.0}, {1.0}, {1.0}, {1.0}}), {}, kSum));
  EXPECT_FALSE(GroupHasSignal(Group({{0.0}, {0.0}, {0.0}, {0.0}}), {}, kSum));
  EXPECT_TRUE(GroupHasSignal(Group({{0.0}, {0.0}, {1.0}, {0.0}}), {}, kSum));
}

TEST(GroupHasSignalTest, AStdAtTorchIscloseZeroIsZero) {
  // Two values a and a + d: unbiased std = |d| / sqrt(2). d = 1e-8 -> 7.07e-9 <= 1e-8: zero;
  // d = 2e-8 -> 1.41e-8 > 1e-8: a signal.
  EXPECT_FALSE(GroupHasSignal(Group({{0.5}, {0.5 + 1e-8}}), {}, kSum));
  EXPECT_TRUE(GroupHasSignal(Group({{0.5}, {0.5 + 2e-8}}), {}, kSum));
}

TEST(GroupHasSignalTest, WeightsMakeTheTotalsThatAreCompared) {
  // Two functions, rewards (1, 0) and (0, 2). Weights 1, 1: totals 1 and 2 (differ). Weights
  // 2, 1: totals 2 and 2 (equal: no signal).
  const auto g = Group({{1.0, 0.0}, {0.0, 2.0}});
  EXPECT_TRUE(GroupHasSignal(g, {}, kSum));
  EXPECT_FALSE(GroupHasSignal(g, {2.0, 1.0}, kSum));
  // GDPO normalises each function within the group first: both functions vary, a signal.
  EXPECT_TRUE(GroupHasSignal(g, {2.0, 1.0}, kGdpo));
}

TEST(GroupHasSignalTest, NullRewardsCountAsZeroAndUnscorableCompletionsAreLeftOut) {
  // Totals: (null, 1) -> 1; (1, null) -> 1; equal. (null, null) is unscorable, not a 0.
  EXPECT_FALSE(GroupHasSignal(Group({{kNull, 1.0}, {1.0, kNull}, {kNull, kNull}}), {}, kSum));
  // (null, 0) -> 0 against (1, 0) -> 1: a signal.
  EXPECT_TRUE(GroupHasSignal(Group({{kNull, 0.0}, {1.0, 0.0}}), {}, kSum));
  // One scorable completion: no std (fewer than two values).
  EXPECT_FALSE(GroupHasSignal(Group({{3.0}, {kNull}, {kNull}}), {}, kSum));
}

TEST(GroupHasSignalTest, DroppedCompletionsAreLeftOut) {
  // An infinite reward drops its completion (as ComputeAdvantages does): the rest are equal.
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(GroupHasSignal(Group({{1.0}, {1.0}, {-inf}}), {}, kSum));
  EXPECT_TRUE(GroupHasSignal(Group({{1.0}, {2.0}, {inf}}), {}, kSum));
}

TEST(GroupHasSignalTest, GdpoLooksAtEachFunctionOverItsNonNullValues) {
  // Function 0: 1, 1 (constant); function 1: null, 5 (one value): no std anywhere.
  EXPECT_FALSE(GroupHasSignal(Group({{1.0, kNull}, {1.0, 5.0}}), {}, kGdpo));
  // Function 1 gains a second, different value: 5, 6.
  EXPECT_TRUE(GroupHasSignal(Group({{1.0, 6.0}, {1.0, 5.0}}), {}, kGdpo));
  // Every function constant within the group: no signal.
  EXPECT_FALSE(GroupHasSignal(Group({{1.0, 0.0}, {1.0, 0.0}}), {}, kGdpo));
}

TEST(BatchFillCounterTest, AShortBatchIsDueAfterMaxBatchesWorthOfGroups) {
  // 4 groups a batch, at most 2 batches' worth (8 groups) per batch.
  BatchFillCounter fill(4, 2);
  for (int i = 0; i < 5; ++i) fill.AddFiltered();
  EXPECT_FALSE(fill.ShortBatchDue(2));  // 5 + 2 = 7 < 8
  EXPECT_TRUE(fill.ShortBatchDue(3));   // 5 + 3 = 8
  EXPECT_FALSE(fill.ShortBatchDue(0));  // nothing to train
  EXPECT_FALSE(fill.ShortBatchDue(4));  // a full batch is not short
  const BatchFill f = fill.Take(3);
  EXPECT_EQ(f.groups_filtered, 5);
  EXPECT_EQ(f.num_gen_batches, 2);  // ceil(8 / 4)
  EXPECT_TRUE(f.short_batch);
  EXPECT_EQ(fill.filtered(), 0);
  // A full batch with one filtered group: 5 arrived for 4, ceil(5 / 4) = 2 batches' worth.
  fill.AddFiltered();
  const BatchFill g = fill.Take(4);
  EXPECT_EQ(g.groups_filtered, 1);
  EXPECT_EQ(g.num_gen_batches, 2);
  EXPECT_FALSE(g.short_batch);
  // Nothing filtered: one batch.
  EXPECT_EQ(fill.Take(4).num_gen_batches, 1);
}

TEST(BatchFillCounterTest, ZeroMeansNoLimit) {
  BatchFillCounter fill(4, 0);
  for (int i = 0; i < 1000; ++i) fill.AddFiltered();
  EXPECT_FALSE(fill.ShortBatchDue(3));
}

}  // namespace
}  // namespace grpo::learner
