// Wire-level inputs shared by the tests that drive a LearnerServer over gRPC.
#pragma once

#include <cstdint>
#include <string>

#include "common/rollout_types.h"
#include "grpo/v1/learner.pb.h"
#include "services/convert.h"
#include "tests/learner/tiny_config.h"

namespace grpo::services::testing {

// A well-formed group for the tiny model (vocab 259) under `lease`, from worker "w1":
// 2 completions of 3 tokens with behaviour log-probs, one reward each.
// `incarnation` is the learner's (RegisterResponse.learner_incarnation / incarnation()).
inline v1::RolloutGroup TinyGroup(const v1::Lease& lease, int64_t policy_version, double reward0,
                                  double reward1, const std::string& incarnation) {
  v1::RolloutGroup out;
  ToProto(grpo::testing::TinyRolloutGroup(lease.prompt_id(), lease.lease_id(), policy_version,
                                          reward0, reward1, incarnation),
          &out);
  out.set_worker_id("w1");
  return out;
}

}  // namespace grpo::services::testing
