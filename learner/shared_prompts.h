// A micro-batch's rows grouped by their prompt, so the learner's forward computes each prompt
// once for all the completions that continue it (Model::ForwardSharedPrefix) instead of once
// per row: a GRPO group's G rows share theirs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace grpo::learner {

struct SharedPrompts {
  at::Tensor ids;   // [U, P] int64, the distinct prompts LEFT-padded to P; undefined: none shared
  at::Tensor mask;  // [U, P] int64, 1 real, 0 pad
  at::Tensor rows;  // [b] int64: row r's prompt in `ids`
  int64_t distinct() const { return ids.defined() ? ids.size(0) : 0; }
};

// The distinct prompts of rows [begin, end) of `prompts` (the same vector, or equal tokens, is
// one prompt), in order of first use, padded to `padded_length` (>= the longest). Undefined
// tensors when every row's prompt is its own (sharing would gain nothing) or one is empty.
SharedPrompts GroupPrompts(const std::vector<const std::vector<int32_t>*>& prompts, int64_t begin,
                           int64_t end, int64_t padded_length);

}  // namespace grpo::learner
