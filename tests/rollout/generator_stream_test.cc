// Continuous batching (Generator::GenerateStream, rollout/generator.h): prompts enter while
// others decode and each group leaves when its own rows are done. The references: Generate on
// the prompt alone (the same sampler streams), and a full forward without a KV cache of each
// finished sequence under the policy its version names (the behaviour log-probs).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "rollout/generator.h"
#include "tests/rollout/scaled_tiny_model.h"

namespace grpo::rollout {
namespace {

using common::Model;

constexpr int64_t kG = 3, kMaxNew = 16, kSwitchAt = 6;

GeneratorOptions Options(bool partial) {
  GeneratorOptions o;
  o.num_generations = kG;
  o.max_completion_length = kMaxNew;
  o.seed = 99;
  // Many stop ids, so that rows end at lengths that differ (a random policy seldom picks one).
  for (int32_t t = 0; t < 48; ++t) o.eos_token_ids.push_back(t);
  o.stop_check_interval = 1;
  o.partial_rollouts = partial;
  return o;
}

const std::vector<std::vector<int32_t>> kPrompts = {
    {5, 17, 42, 99, 3}, {200, 11, 7}, {1, 2, 3, 4, 5, 6, 7, 8}, {77}, {120, 121, 122}, {9, 9}};

// A stream over kPrompts (tag = seed index = position), recording when each group entered and
// left in decode steps (window_hook counts them).
struct StreamRun {
  std::map<int64_t, StreamedGroup> groups;
  std::map<int64_t, int64_t> entered, left;  // tag -> steps done at that moment
  std::map<int64_t, int64_t> take_version;   // tag -> the version `take` was told
  StreamStats stats;
  int64_t busy_takes_with_prompts = 0;  // prompts admitted while others decoded
};

StreamRun Stream(GeneratorOptions options, int64_t max_prompts, std::shared_ptr<const Model> a,
                 std::shared_ptr<const Model> b = nullptr) {
  StreamRun run;
  int64_t steps = 0;
  Generator* self = nullptr;
  options.window_hook = [&](int64_t s) {
    steps = s;
    if (s == kSwitchAt && b != nullptr) {
      EXPECT_TRUE(self->SetPolicy(b, 5).ok());
    }
  };
  auto gen = Generator::Create(a, 4, options);
  EXPECT_TRUE(gen.ok()) << gen.status().ToString();
  self = gen->get();
  std::deque<int64_t> queue;
  for (int64_t i = 0; i < static_cast<int64_t>(kPrompts.size()); ++i) queue.push_back(i);
  GroupStream stream;
  stream.max_prompts = max_prompts;
  stream.take = [&](int64_t room, bool idle, int64_t version) {
    std::vector<StreamPrompt> out;
    while (room-- > 0 && !queue.empty()) {
      const int64_t i = queue.front();
      queue.pop_front();
      out.push_back({kPrompts[i], /*seed_index=*/i, /*tag=*/i});
      run.entered[i] = steps;
      run.take_version[i] = version;
    }
    if (!idle && !out.empty()) ++run.busy_takes_with_prompts;
    return out;
  };
  stream.done = [&](StreamedGroup g) {
    run.left[g.tag] = steps;
    run.groups.emplace(g.tag, std::move(g));
  };
  auto stats = (*gen)->GenerateStream(stream);
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
  if (stats.ok()) run.stats = *stats;
  return run;
}

int64_t LongestRow(const common::RolloutGroup& g) {
  size_t n = 0;
  for (const auto& c : g.completions) n = std::max(n, c.token_ids.size());
  return static_cast<int64_t>(n);
}

TEST(GenerateStream, AGroupAdmittedAmongOthersSamplesWhatGenerateSamplesForItsPromptAlone) {
  const auto a = ScaledTinyModel(1);
  const StreamRun run = Stream(Options(false), /*max_prompts=*/2, a);
  ASSERT_EQ(run.groups.size(), kPrompts.size());
  EXPECT_EQ(run.stats.num_groups, static_cast<int64_t>(kPrompts.size()));
  EXPECT_LE(run.stats.max_rows, 2 * kG);
  EXPECT_GE(run.busy_takes_with_prompts, 1) << "no prompt entered while others decoded";
  auto gen = Generator::Create(a, 4, Options(false));
  ASSERT_TRUE(gen.ok());
  int64_t tokens = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(kPrompts.size()); ++i) {
    const StreamedGroup& s = run.groups.at(i);
    ASSERT_TRUE(s.group.ok()) << s.group.status().ToString();
    EXPECT_EQ(s.group->policy_version, 4);
    auto alone = (*gen)->Generate({kPrompts[i]}, {i});
    ASSERT_TRUE(alone.ok());
    const common::RolloutGroup& want = *alone->groups[0];
    ASSERT_EQ(s.group->completions.size(), static_cast<size_t>(kG));
    for (int64_t k = 0; k < kG; ++k) {
      const common::Completion& c = s.group->completions[k];
      EXPECT_EQ(c.token_ids, want.completions[k].token_ids) << "prompt " << i << " row " << k;
      EXPECT_EQ(c.truncated, want.completions[k].truncated);
      EXPECT_TRUE(c.token_versions.empty());
      const std::vector<double> ref = TeacherForced(*a, kPrompts[i], c.token_ids);
      for (size_t j = 0; j < c.token_ids.size(); ++j) {
        EXPECT_NEAR(c.logprobs[j], ref[j], 1e-4) << "prompt " << i << " row " << k << " tok " << j;
      }
      tokens += static_cast<int64_t>(c.token_ids.size());
    }
  }
  EXPECT_EQ(run.stats.num_completion_tokens, tokens);
}

TEST(GenerateStream, AGroupLeavesWhenItsLongestRowEndsWhateverTheOthersDo) {
  const auto a = ScaledTinyModel(1);
  const StreamRun run = Stream(Options(false), /*max_prompts=*/3, a);
  ASSERT_EQ(run.groups.size(), kPrompts.size());
  std::vector<int64_t> lengths;
  for (const auto& [tag, s] : run.groups) {
    ASSERT_TRUE(s.group.ok());
    // One token a step from the step it entered: it leaves at the window of its longest row.
    EXPECT_EQ(run.left.at(tag) - run.entered.at(tag), LongestRow(*s.group)) << "group " << tag;
    lengths.push_back(LongestRow(*s.group));
  }
  // The stream is worth testing only when the groups' lengths differ.
  EXPECT_NE(*std::min_element(lengths.begin(), lengths.end()),
            *std::max_element(lengths.begin(), lengths.end()));
}

TEST(GenerateStream, WithoutPartialRolloutsANewPolicyWaitsUntilTheGroupsInFlightAreDone) {
  const auto a = ScaledTinyModel(1), b = ScaledTinyModel(2);
  const StreamRun run = Stream(Options(false), /*max_prompts=*/2, a, b);
  ASSERT_EQ(run.groups.size(), kPrompts.size());
  EXPECT_EQ(run.stats.num_drains, 1);
  EXPECT_EQ(run.stats.num_switches, 1);
  int64_t under_a = 0, under_b = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(kPrompts.size()); ++i) {
    const common::RolloutGroup& g = *run.groups.at(i).group;
    const bool old = g.policy_version == 4;
    (old ? under_a : under_b) += 1;
    EXPECT_EQ(run.take_version.at(i), g.policy_version) << "group " << i;
    if (!old) {
      EXPECT_EQ(g.policy_version, 5);
      EXPECT_GE(run.entered.at(i), kSwitchAt) << "group " << i << " entered before the update";
    }
    for (const common::Completion& c : g.completions) {
      EXPECT_TRUE(c.token_versions.empty()) << "a group of one version records none";
      const std::vector<double> ref = TeacherForced(old ? *a : *b, kPrompts[i], c.token_ids);
      for (size_t j = 0; j < c.token_ids.size(); ++j) {
        EXPECT_NEAR(c.logprobs[j], ref[j], 1e-4) << "group " << i << " token " << j;
      }
    }
  }
  EXPECT_GE(under_a, 1);
  EXPECT_GE(under_b, 1);
  // No group entered during the drain: every version-4 group left before a version-5 one came.
  int64_t last_old_left = 0, first_new_entered = 1 << 30;
  for (const auto& [tag, s] : run.groups) {
    if (s.group->policy_version == 4) last_old_left = std::max(last_old_left, run.left.at(tag));
    if (s.group->policy_version == 5) {
      first_new_entered = std::min(first_new_entered, run.entered.at(tag));
    }
  }
  EXPECT_LE(last_old_left, first_new_entered);
}

TEST(GenerateStream, WithPartialRolloutsTheRowsInFlightSwitchAndRecordEachTokensVersion) {
  const auto a = ScaledTinyModel(1), b = ScaledTinyModel(2);
  const StreamRun run = Stream(Options(true), /*max_prompts=*/2, a, b);
  ASSERT_EQ(run.groups.size(), kPrompts.size());
  EXPECT_EQ(run.stats.num_drains, 0);
  EXPECT_EQ(run.stats.num_switches, 1);
  int64_t straddled = 0;
  // The switch's recompute: each group in flight prefilled its prompt once for its rows still
  // decoding, then each row's tokens but its last (kSwitchAt - entered were sampled before).
  int64_t shared = 0, whole = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(kPrompts.size()); ++i) {
    const common::RolloutGroup& g = *run.groups.at(i).group;
    const int64_t entered = run.entered.at(i);
    EXPECT_EQ(g.policy_version, entered < kSwitchAt ? 4 : 5) << "group " << i;
    EXPECT_EQ(run.take_version.at(i), entered < kSwitchAt ? 4 : 5) << "group " << i;
    const bool mixed = entered < kSwitchAt && run.left.at(i) > kSwitchAt;
    straddled += mixed;
    const int64_t prompt = static_cast<int64_t>(kPrompts[i].size());
    bool decoding = false;
    for (const common::Completion& c : g.completions) {
      if (!mixed || static_cast<int64_t>(c.token_ids.size()) <= kSwitchAt - entered) continue;
      decoding = true;
      shared += kSwitchAt - entered - 1;
      whole += prompt + kSwitchAt - entered - 1;
    }
    if (decoding) shared += prompt;
    for (const common::Completion& c : g.completions) {
      const std::vector<double> ref_a = TeacherForced(*a, kPrompts[i], c.token_ids);
      const std::vector<double> ref_b = TeacherForced(*b, kPrompts[i], c.token_ids);
      if (mixed) {
        ASSERT_EQ(c.token_versions.size(), c.token_ids.size()) << "group " << i;
      }
      for (int64_t j = 0; j < static_cast<int64_t>(c.token_ids.size()); ++j) {
        // Token j of a group that entered at step e was sampled at step e + j.
        const bool new_weights = entered + j >= kSwitchAt;
        if (mixed) {
          EXPECT_EQ(c.token_versions[j], new_weights ? 5 : 4) << i << " token " << j;
        }
        EXPECT_NEAR(c.logprobs[j], (new_weights ? ref_b : ref_a)[j], 1e-4)
            << "group " << i << " token " << j;
      }
    }
  }
  EXPECT_GE(straddled, 1) << "no group was in flight at the update: the test shows little";
  EXPECT_EQ(run.stats.num_recompute_tokens, shared) << "the whole contexts: " << whole;
  EXPECT_LT(shared, whole);
  std::printf("recompute at the switch: %lld tokens prefilled, the whole contexts %lld\n",
              static_cast<long long>(shared), static_cast<long long>(whole));
}

TEST(GenerateStream, ABadPromptLeavesWithItsErrorAndTheOthersGoOnEachWithItsBudget) {
  auto gen = Generator::Create(ScaledTinyModel(1), 0, Options(false));
  ASSERT_TRUE(gen.ok());
  std::vector<StreamedGroup> out;
  bool given = false;
  GroupStream stream;
  stream.take = [&](int64_t, bool, int64_t) {
    if (given) return std::vector<StreamPrompt>{};
    given = true;
    return std::vector<StreamPrompt>{{{}, 0, 7},
                                     {{5, 6}, 1, 8},
                                     {{5, 100000}, 2, 9},
                                     {{5, 6}, 3, 10, /*max_new_tokens=*/kMaxNew + 1},
                                     {{5, 6}, 4, 11, /*max_new_tokens=*/2}};
  };
  stream.done = [&](StreamedGroup g) { out.push_back(std::move(g)); };
  auto stats = (*gen)->GenerateStream(stream);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  ASSERT_EQ(out.size(), 5u);
  std::map<int64_t, const StreamedGroup*> by_tag;
  for (const auto& g : out) by_tag[g.tag] = &g;
  EXPECT_EQ(by_tag.at(7)->group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(by_tag.at(9)->group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(by_tag.at(10)->group.status().code(), StatusCode::kInvalidArgument);
  // A budget of its own: no row longer than 2 tokens.
  ASSERT_TRUE(by_tag.at(11)->group.ok());
  for (const auto& c : by_tag.at(11)->group->completions) {
    ASSERT_LE(c.token_ids.size(), 2u);
    EXPECT_EQ(c.truncated, c.token_ids.back() >= 48) << "cut by its budget, or by a stop id";
  }
  ASSERT_TRUE(by_tag.at(8)->group.ok());
  EXPECT_EQ(by_tag.at(8)->group->completions.size(), static_cast<size_t>(kG));

  GroupStream incomplete;
  incomplete.take = stream.take;
  EXPECT_EQ((*gen)->GenerateStream(incomplete).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::rollout
