// Wire-level inputs shared by the tests that drive a LearnerServer over gRPC.
#pragma once

#include <cstdint>
#include <string>

#include "common/rollout_types.h"
#include "grpo/v1/learner.pb.h"
#include "services/convert.h"

namespace grpo::services::testing {

// A well-formed group for the tiny model (vocab 259) under `lease`, from worker "w1":
// 2 completions of 3 tokens with behaviour log-probs, one reward each.
// `incarnation` is the learner's (RegisterResponse.learner_incarnation / incarnation()).
inline v1::RolloutGroup TinyGroup(const v1::Lease& lease, int64_t policy_version, double reward0,
                                  double reward1, const std::string& incarnation) {
  common::RolloutGroup g;
  g.policy_incarnation = incarnation;
  g.prompt_id = lease.prompt_id();
  g.lease_id = lease.lease_id();
  g.policy_version = policy_version;
  g.prompt_ids = {115, 97, 121};
  for (double r : {reward0, reward1}) {
    common::Completion c;
    c.token_ids = {104, 105, 258};
    c.logprobs = {-1.5f, -2.0f, -0.5f};
    c.rewards = {r};
    g.completions.push_back(c);
  }
  v1::RolloutGroup out;
  ToProto(g, &out);
  out.set_worker_id("w1");
  return out;
}

}  // namespace grpo::services::testing
