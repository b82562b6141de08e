// Helpers shared by the weight-sync tests: a layout with several dtypes and odd sizes, bit-exact
// comparison, and running one function per rank on its own thread.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/model/safetensors.h"

namespace grpo::testing {

// Bucket size for the layout below: not a divisor of any tensor's size, so buckets split
// tensors unevenly, and smaller than "big" (1.2 MB) so that one spans many buckets.
inline constexpr int64_t kOddBucketBytes = 40'000;

// F32, BF16 and I64 tensors of odd sizes, interleaved, plus an empty one and a scalar; values
// from `seed` (zeros when `zeros`).
inline common::NamedTensors MakeLayout(uint64_t seed, bool zeros) {
  at::manual_seed(seed);
  auto f32 = [&](std::vector<int64_t> shape) {
    return zeros ? at::zeros(shape, at::kFloat) : at::randn(shape, at::kFloat);
  };
  auto bf16 = [&](std::vector<int64_t> shape) {
    return zeros ? at::zeros(shape, at::kBFloat16) : at::randn(shape, at::kFloat).to(at::kBFloat16);
  };
  auto i64 = [&](std::vector<int64_t> shape) {
    return zeros ? at::zeros(shape, at::kLong)
                 : at::randint(-(int64_t{1} << 62), int64_t{1} << 62, shape, at::kLong);
  };
  return {
      {"embed.weight", f32({7, 13})},
      {"layers.0.attn.bf16", bf16({5, 1001})},
      {"step", i64({3})},
      {"big", f32({300'001})},
      {"scalar", f32({})},
      {"empty", f32({0, 4})},
      {"layers.1.bf16", bf16({17})},
      {"ids", i64({1000, 3})},
      {"tail", f32({9999})},
  };
}

// Same names, shapes, dtypes and bytes (of any tensors: the bytes are compared in row-major order).
inline ::testing::AssertionResult BitEqual(const common::NamedTensors& a,
                                           const common::NamedTensors& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "different counts";
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor x = a[i].second.contiguous();
    const at::Tensor y = b[i].second.contiguous();
    if (a[i].first != b[i].first || x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) {
      return ::testing::AssertionFailure() << "layout differs at " << a[i].first;
    }
    if (x.nbytes() > 0 && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) {
      return ::testing::AssertionFailure() << "bytes of '" << a[i].first << "' differ";
    }
  }
  return ::testing::AssertionSuccess();
}

// Runs fn(rank) for every rank in `ranks` on its own thread and joins them all.
inline void RunRanks(const std::vector<int>& ranks, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r : ranks) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

inline std::vector<int> AllRanks(int world_size) {
  std::vector<int> r(world_size);
  for (int i = 0; i < world_size; ++i) r[i] = i;
  return r;
}

}  // namespace grpo::testing
