// The trainer tests' tiny model and groups (grpo_trainer_test, micro_batch_threads_test).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/rollout_types.h"

namespace grpo::learner::trainer_test {

inline std::unique_ptr<common::Model> TinyModel(uint64_t seed = 7) {
  auto cfg = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(cfg.ok());
  auto m = common::Model::InitRandom(*cfg, seed);
  EXPECT_TRUE(m.ok());
  return std::move(m).value();
}

// `groups` groups of G completions with varied lengths and rewards; prompt lengths vary too.
inline std::vector<common::RolloutGroup> MakeGroups(int groups, int G, uint32_t seed = 1,
                                                    int64_t version = 0) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, 255), plen(2, 6), clen(1, 9);
  std::uniform_real_distribution<double> rew(0.0, 1.0);
  std::vector<common::RolloutGroup> out;
  for (int g = 0; g < groups; ++g) {
    common::RolloutGroup rg;
    rg.prompt_id = "p" + std::to_string(g);
    rg.policy_version = version;
    for (int i = plen(rng); i > 0; --i) rg.prompt_ids.push_back(tok(rng));
    for (int j = 0; j < G; ++j) {
      common::Completion c;
      for (int i = clen(rng); i > 0; --i) c.token_ids.push_back(tok(rng));
      c.truncated = (j % 3 == 0);
      c.rewards = {rew(rng)};
      rg.completions.push_back(c);
    }
    out.push_back(rg);
  }
  return out;
}

}  // namespace grpo::learner::trainer_test
