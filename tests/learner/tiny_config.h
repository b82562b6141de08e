// The tiny learner job the learner and services tests share: a generation batch of 2 groups of
// 2 completions, one optimizer step per batch, max_staleness at its default (1).
#pragma once

#include <filesystem>

#include "common/config.h"

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

}  // namespace grpo::testing
