// The long-tail workload of `grpo bench long_tail` and grpo_gpu_bench (rollout/bench/long_tail.h):
// its decode steps, updates and drains on a shape small enough to follow by hand. 4 groups of one
// row, 2 decoding at once; group 0 may run 8 tokens, groups 1-3 run 2 (no stop id). Every row's
// tokens: 8 + 3 x 2 = 14 in every mode.
//   continuous: g0 + g1 from step 1; g1 leaves after step 2, g2 runs steps 3-4, g3 steps 5-6, g0
//     ends at step 8: 8 steps.
//   rounds: g0 + g1 for 8 steps, then g2 + g3 for 2: 10 steps.
//   continuous, a version every 3 steps, drained: the version of step 3 stops admission (g2 is
//     in); g0 ends at step 8; the stream takes the newest version, admits g3 (steps 9-10) and the
//     version of step 9 drains again: 10 steps, 3 updates, 2 drains.
//   in flight: the versions of steps 3 and 6 are taken at the next step; nothing drains: 8 steps,
//     2 updates.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "rollout/bench/long_tail.h"

namespace grpo::rollout::bench {
namespace {

LongTailShape Shape() {
  LongTailShape s;
  s.groups = 4;
  s.in_flight = 2;
  s.num_generations = 1;
  s.prompt_tokens = 3;
  s.short_tokens = 2;
  s.long_tokens = 8;
  s.long_every = 4;
  return s;
}

std::shared_ptr<const common::Model> Tiny() {
  auto config = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(config.ok());
  auto model = common::Model::InitRandom(*config, 3);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::shared_ptr<const common::Model>(std::move(model).value());
}

LongTailRun RunMode(const LongTailMode& mode) {
  const auto policy = Tiny();
  const auto prompts = LongTailPrompts(4, 3, policy->config().vocab_size, 5);
  auto run = RunLongTail(policy, Shape(), mode, prompts);
  EXPECT_TRUE(run.ok()) << run.status().ToString();
  return run.ok() ? *run : LongTailRun{};
}

TEST(LongTailBenchTest, ContinuousBatchingAdmitsAsGroupsLeave) {
  const LongTailRun r = RunMode({"continuous", true, 0, false, true});
  EXPECT_EQ(r.tokens, 14);
  EXPECT_EQ(r.decode_steps, 8);
  EXPECT_EQ(r.row_steps, 14);  // a row decodes until its last token, then leaves
  EXPECT_EQ(r.updates, 0);
  EXPECT_EQ(r.drains, 0);
}

TEST(LongTailBenchTest, RoundsAdmitOnlyWhenNothingDecodes) {
  const LongTailRun r = RunMode({"rounds", false, 0, false, true});
  EXPECT_EQ(r.tokens, 14);
  EXPECT_EQ(r.decode_steps, 10);
  EXPECT_EQ(r.row_steps, 14);
}

TEST(LongTailBenchTest, AStreamWithoutInFlightUpdatesDrainsForEachVersion) {
  const LongTailRun r = RunMode({"drain", true, 3, false, true});
  EXPECT_EQ(r.tokens, 14);
  EXPECT_EQ(r.decode_steps, 10);
  EXPECT_EQ(r.updates, 3);
  EXPECT_EQ(r.drains, 2);
  EXPECT_EQ(r.recompute_tokens, 0);
}

TEST(LongTailBenchTest, InFlightUpdatesKeepTheStreamFull) {
  for (bool recompute : {true, false}) {
    SCOPED_TRACE(recompute ? "recompute" : "keep");
    const LongTailRun r = RunMode({"in_flight", true, 3, true, recompute});
    EXPECT_EQ(r.tokens, 14);
    EXPECT_EQ(r.decode_steps, 8);
    EXPECT_EQ(r.updates, 2);
    EXPECT_EQ(r.switches, 2);
    EXPECT_EQ(r.drains, 0);
    if (recompute) {
      EXPECT_GT(r.recompute_tokens, 0);
    } else {
      EXPECT_EQ(r.recompute_tokens, 0);
    }
  }
}

TEST(LongTailBenchTest, PromptsForAnotherShapeAreRefused) {
  const auto policy = Tiny();
  const auto prompts = LongTailPrompts(3, 3, policy->config().vocab_size, 5);
  auto run = RunLongTail(policy, Shape(), {"continuous", true, 0, false, true}, prompts);
  ASSERT_FALSE(run.ok());
  EXPECT_EQ(run.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::rollout::bench
