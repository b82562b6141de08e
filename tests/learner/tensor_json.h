// Tensors as JSON for the Python references (tests/reference/*.py), shared by the loss tests.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>

namespace grpo::testing {

// NaN -> null (a reward function's "no reward"), +-inf -> "inf" / "-inf".
inline nlohmann::json Num(double v) {
  if (std::isnan(v)) return nullptr;
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

// A 1-D tensor as a list of Num, higher ranks as nested lists.
inline nlohmann::json ToJson(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kDouble).contiguous();
  nlohmann::json out = nlohmann::json::array();
  if (c.dim() == 1) {
    for (int64_t i = 0; i < c.size(0); ++i) out.push_back(Num(c[i].item<double>()));
  } else {
    for (int64_t i = 0; i < c.size(0); ++i) out.push_back(ToJson(c[i]));
  }
  return out;
}

}  // namespace grpo::testing
