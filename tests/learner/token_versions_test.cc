// Per-token policy versions (Completion::token_versions, in-flight weight updates): what a group
// must carry on arrival (learner/group_check.h, reason token_versions), each case built by hand.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "learner/group_check.h"

namespace grpo::learner {
namespace {

using common::Completion;
using common::GroupRefusal;
using common::RolloutGroup;

GroupLimits Limits() {
  GroupLimits l;
  l.num_generations = 2;
  l.vocab_size = 100;
  l.max_completion_length = 16;
  l.reward_funcs = 1;
  l.policy_version = 9;  // the learner's
  l.max_staleness = 3;
  return l;
}

// Generated from version 7; completion 1 switched to 8 after two tokens, in flight.
RolloutGroup Group() {
  RolloutGroup g;
  g.prompt_id = "q";
  g.prompt_ids = {1, 2};
  g.policy_version = 7;
  Completion plain;
  plain.token_ids = {5, 6};
  plain.rewards = {1.0};
  Completion switched;
  switched.token_ids = {5, 6, 7, 8};
  switched.token_versions = {7, 7, 8, 8};
  switched.rewards = {0.0};
  g.completions = {plain, switched};
  return g;
}

std::string Refused(const RolloutGroup& g) {
  GroupRefusal reason = GroupRefusal::kStale;
  const Status s = CheckGroup(g, Limits(), &reason);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(reason, GroupRefusal::kTokenVersions) << s.ToString();
  EXPECT_NE(s.message().find("completion 1"), std::string::npos) << s.message();
  return s.message();
}

TEST(TokenVersionCheck, NonDecreasingVersionsFromTheGroupsToTheLearnersPass) {
  RolloutGroup g = Group();
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());
  g.completions[1].token_versions = {7, 8, 9, 9};  // up to the learner's own
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());
}

TEST(TokenVersionCheck, ImpossibleVersionsAreRefusedNamingTheToken) {
  RolloutGroup g = Group();
  g.completions[1].token_versions = {7, 7, 8};
  EXPECT_NE(Refused(g).find("4 token ids but 3 token versions"), std::string::npos);
  g.completions[1].token_versions = {6, 7, 8, 8};  // older than the group says
  EXPECT_NE(Refused(g).find("token 0 was sampled by version 6, outside [7, 9]"), std::string::npos);
  g.completions[1].token_versions = {7, 8, 7, 8};  // going back
  EXPECT_NE(Refused(g).find("token 2 was sampled by version 7, outside [8, 9]"), std::string::npos);
  g.completions[1].token_versions = {7, 7, 8, 10};  // newer than the learner
  EXPECT_NE(Refused(g).find("token 3 was sampled by version 10, outside [8, 9]"),
            std::string::npos);
}

}  // namespace
}  // namespace grpo::learner
