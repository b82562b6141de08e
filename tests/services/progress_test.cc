// The `grpo submit --follow` progress line: expected strings and ETAs worked out by hand.
#include "services/cli/progress.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace grpo::services {
namespace {

JobProgress At(int64_t step, int64_t max_steps, int64_t trained = 0, int64_t total = 40) {
  JobProgress p;
  p.step = step;
  p.max_steps = max_steps;
  p.trained = trained;
  p.total = total;
  return p;
}

TEST(Progress, FractionIsStepsOverMaxStepsClamped) {
  EXPECT_DOUBLE_EQ(ProgressFraction(At(0, 10)), 0.0);
  EXPECT_DOUBLE_EQ(ProgressFraction(At(4, 10)), 0.4);
  EXPECT_DOUBLE_EQ(ProgressFraction(At(12, 10)), 1.0);
  EXPECT_DOUBLE_EQ(ProgressFraction(At(3, 0)), 0.0);  // no bound known: no progress claimed
}

TEST(Progress, DurationsAsMinutesSecondsOrHours) {
  EXPECT_EQ(FormatDuration(0), "0:00");
  EXPECT_EQ(FormatDuration(59.4), "0:59");
  EXPECT_EQ(FormatDuration(59.6), "1:00");
  EXPECT_EQ(FormatDuration(754), "12:34");
  EXPECT_EQ(FormatDuration(3600 + 2 * 60 + 3), "1:02:03");
  EXPECT_EQ(FormatDuration(-1), "--:--");
  EXPECT_EQ(FormatDuration(std::numeric_limits<double>::infinity()), "--:--");
}

TEST(Progress, EtaExtrapolatesTheRateSinceTheWatchBegan) {
  // 0 -> 4 of 10 steps in 20 s: 0.2 steps/s, 6 steps left -> 30 s.
  EXPECT_DOUBLE_EQ(*EstimateSecondsLeft(At(0, 10), 0, At(4, 10), 20), 30.0);
  // Joined at step 5 (t = 100 s): 5 -> 8 in 30 s is 0.1 steps/s, 2 left -> 20 s.
  EXPECT_DOUBLE_EQ(*EstimateSecondsLeft(At(5, 10), 100, At(8, 10), 130), 20.0);
  EXPECT_FALSE(EstimateSecondsLeft(At(3, 10), 0, At(3, 10), 50).has_value());  // no progress
  EXPECT_DOUBLE_EQ(*EstimateSecondsLeft(At(3, 10), 0, At(10, 10), 50), 0.0);   // done
}

TEST(Progress, LineShowsBarPromptsStepRewardAndEta) {
  JobProgress now = At(6, 10, 24, 40);
  now.pass = 1;
  now.reward = -3.2149;
  // 60% of a 10-cell bar = 6 cells; elapsed 12 s; 0 -> 6 steps in 12 s, 4 left -> 8 s.
  EXPECT_EQ(ProgressLine(At(0, 10), 0, now, 12, 10),
            "[######----]  60% | step 6/10 | prompts 24/40 (pass 2) | reward -3.21 | 0:12 | "
            "ETA 0:08");
  // Before any progress: empty bar, no reward yet, unknown ETA.
  EXPECT_EQ(ProgressLine(At(0, 10), 0, At(0, 10, 0, 40), 3, 4),
            "[----]   0% | step 0/10 | prompts 0/40 (pass 1) | 0:03 | ETA --:--");
}

}  // namespace
}  // namespace grpo::services
