// The tiny preset with random weights for the generator's tests. N(0, 0.02) layers barely move
// the residual stream, so its tied LM head mostly predicts the last input token again; the
// layers' weights are scaled up (x10) so that a token depends on the whole context, through the
// keys/values.
#pragma once

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/model/model.h"
#include "common/model/model_config.h"

namespace grpo::rollout {

inline constexpr double kLayerScale = 10.0;

inline std::shared_ptr<const common::Model> ScaledTinyModel(uint64_t seed) {
  auto config = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(config.ok());
  auto model = common::Model::InitRandom(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  at::NoGradGuard no_grad;
  for (auto& [name, t] : (*model)->NamedParameters()) {
    if (name.find("layers.") != std::string::npos && name.find("norm") == std::string::npos) {
      t.mul_(kLayerScale);
    }
  }
  return std::shared_ptr<const common::Model>(std::move(model).value());
}

}  // namespace grpo::rollout
