// Multi-turn rows for the tests of Generator::Continue and ContinueStream (turn_cache_test,
// turn_stream_test): generator options whose turns end at different lengths, six rows of two
// prompts that end after different turns, and the observation appended after each turn.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "rollout/generator.h"

namespace grpo::rollout {

inline constexpr int64_t kMaxNew = 10;

// Turns end on about a sixth of the vocabulary, so their lengths differ (and some hit kMaxNew).
inline GeneratorOptions TurnOptions(int64_t stop_check_interval, double repetition_penalty) {
  GeneratorOptions o;
  o.num_generations = 1;
  o.max_completion_length = kMaxNew;
  o.seed = 99;
  o.stop_check_interval = stop_check_interval;
  o.sampling.repetition_penalty = repetition_penalty;
  for (int32_t t = 0; t < 259; t += 6) o.eos_token_ids.push_back(t);
  return o;
}

// Observation of row r after turn t: 1 to 7 tokens, different per row and turn.
inline std::vector<int32_t> Observation(size_t r, int64_t t) {
  std::vector<int32_t> ids;
  const int64_t n = 1 + static_cast<int64_t>((3 * r + 5 * t) % 7);
  for (int64_t j = 0; j < n; ++j) ids.push_back(static_cast<int32_t>(100 + 11 * r + 7 * t + j));
  return ids;
}

struct TurnRow {
  std::vector<int32_t> context;
  int64_t seed_index = 0, generation = 0;
  int64_t last_turn = 0;  // the row ends after this turn
  int64_t turn = 0;       // its next
};

// Six rows of two prompts (lengths 5 and 9) ending after turns 0, 1, 2, 2, 3 and 3. With
// `groups`, the rows of one prompt (seed index r % 2) start from the same ids, as a group's G
// episodes do; without, every row's ids differ.
inline std::vector<TurnRow> SixRows(bool groups = false) {
  std::vector<TurnRow> rows;
  const std::vector<int64_t> last = {0, 1, 2, 2, 3, 3};
  for (size_t r = 0; r < last.size(); ++r) {
    TurnRow x;
    const int n = r % 2 == 0 ? 5 : 9;
    const size_t salt = groups ? r % 2 : r;
    for (int i = 0; i < n; ++i) {
      x.context.push_back(static_cast<int32_t>((17 * i + 3 * salt) % 250));
    }
    x.seed_index = static_cast<int64_t>(r % 2);
    x.generation = static_cast<int64_t>(r / 2);
    x.last_turn = last[r];
    rows.push_back(std::move(x));
  }
  return rows;
}

}  // namespace grpo::rollout
