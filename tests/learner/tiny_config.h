// The tiny learner job the learner and services tests share: a generation batch of 2 groups of
// 2 completions, one optimizer step per batch, max_staleness at its default (1).
#pragma once

#include <filesystem>
#include <string>

#include "common/config.h"
#include "common/rollout_types.h"

namespace grpo::testing {

inline common::GrpoConfig TinyLearnerConfig(const std::filesystem::path& dir) {
  common::GrpoConfig c;
  c.output_dir = dir.string();
  c.num_generations = 2;
  c.per_device_train_batch_size = 4;  // generation batch = 2 groups of 2 -> one step
  c.gradient_accumulation_steps = 1;
  c.max_prompt_length = 32;
  c.max_completion_length = 8;
  c.learning_rate = 1e-2;
  c.lr_scheduler_type = "constant";
  c.max_steps = 100;
  c.save_steps = 0;
  c.lease_seconds = 60;
  return c;
}

// A well-formed group for the tiny model (vocab 259) under (prompt_id, lease_id): 2 completions
// of 3 tokens with behaviour log-probs, one reward each. `incarnation` is the learner's.
inline common::RolloutGroup TinyRolloutGroup(const std::string& prompt_id,
                                             const std::string& lease_id, int64_t policy_version,
                                             double reward0, double reward1,
                                             const std::string& incarnation) {
  common::RolloutGroup g;
  g.policy_incarnation = incarnation;
  g.prompt_id = prompt_id;
  g.lease_id = lease_id;
  g.policy_version = policy_version;
  g.prompt_ids = {115, 97, 121};
  for (double r : {reward0, reward1}) {
    common::Completion c;
    c.token_ids = {104, 105, 258};
    c.logprobs = {-1.5f, -2.0f, -0.5f};
    c.rewards = {r};
    g.completions.push_back(c);
  }
  return g;
}

}  // namespace grpo::testing
