#include "learner/shared_prompts.h"

#include <ATen/ATen.h>

namespace grpo::learner {

SharedPrompts GroupPrompts(const std::vector<const std::vector<int32_t>*>& prompts, int64_t begin,
                           int64_t end, int64_t padded_length) {
  std::vector<const std::vector<int32_t>*> distinct;
  std::vector<int64_t> rows;
  rows.reserve(end - begin);
  for (int64_t i = begin; i < end; ++i) {
    const std::vector<int32_t>* p = prompts[i];
    int64_t u = static_cast<int64_t>(distinct.size()) - 1;
    // A group's rows are next to each other: the last prompt first, then the others.
    for (; u >= 0; --u) {
      if (distinct[u] == p || *distinct[u] == *p) break;
    }
    if (u < 0) {
      u = static_cast<int64_t>(distinct.size());
      distinct.push_back(p);
    }
    rows.push_back(u);
  }
  SharedPrompts out;
  const int64_t n = static_cast<int64_t>(distinct.size()), len = padded_length;
  if (n == end - begin) return out;
  for (const auto* p : distinct) {
    if (p->empty()) return out;  // a prefix ends in a real token
  }
  std::vector<int64_t> ids(n * len, 0), mask(n * len, 0);
  for (int64_t u = 0; u < n; ++u) {
    const std::vector<int32_t>& p = *distinct[u];
    const int64_t off = len - static_cast<int64_t>(p.size());
    for (size_t t = 0; t < p.size(); ++t) {
      ids[u * len + off + t] = p[t];
      mask[u * len + off + t] = 1;
    }
  }
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  out.ids = at::from_blob(ids.data(), {n, len}, i64).clone();
  out.mask = at::from_blob(mask.data(), {n, len}, i64).clone();
  out.rows = at::from_blob(rows.data(), {end - begin}, i64).clone();
  return out;
}

}  // namespace grpo::learner
