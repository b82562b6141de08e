// The tiny preset with random weights for the generator's tests, and the log-probs a full
// forward gives a sequence. N(0, 0.02) layers barely move the residual stream, so its tied LM
// head mostly predicts the last input token again; the layers' weights are scaled up (x10) so
// that a token depends on the whole context, through the keys/values.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

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

// log_softmax of a full forward (no KV cache) at every completion token of prompt + completion:
// the reference for behaviour log-probs.
inline std::vector<double> TeacherForced(const common::Model& model,
                                         const std::vector<int32_t>& prompt,
                                         const std::vector<int32_t>& completion) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> seq(prompt.begin(), prompt.end());
  seq.insert(seq.end(), completion.begin(), completion.end());
  at::Tensor ids = at::tensor(seq, at::kLong).unsqueeze(0);
  at::Tensor logp = at::log_softmax(
      model.Logits(model.ForwardHidden(ids, at::ones_like(ids))[0]).to(at::kDouble), -1);
  std::vector<double> out;
  const int64_t p = static_cast<int64_t>(prompt.size());
  for (size_t j = 0; j < completion.size(); ++j) {
    out.push_back(logp[p + static_cast<int64_t>(j) - 1][completion[j]].item<double>());
  }
  return out;
}

}  // namespace grpo::rollout
