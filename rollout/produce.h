// The rollout pipeline, defined once for the rollout workers (rollout/rollout_loop.h),
// `grpo train-local` and `grpo generate`: a dataset row -> its prompt text (common::PromptText)
// -> token ids -> one Generator call for a batch of prompts -> each group scored by the
// RewardRunner. Plain structs; no gRPC.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/rollout_types.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "rollout/generator.h"
#include "rollout/reward.h"

namespace grpo::rollout {

// A dataset row made ready to generate from.
struct Prompt {
  std::string text;            // common::PromptText(row)
  std::vector<int32_t> ids;    // the tokenizer's ids of `text`, before any truncation
  nlohmann::json row;          // the whole row: RewardInput::row of its completions
  int64_t max_new_tokens = 0;  // the row's own "max_completion_length" (0: none)
};

// The completion budget of `prompt`'s rows: its own max_completion_length capped at the job's
// `max_completion_length`, or the job's when the row has none.
inline int64_t CompletionBudget(const Prompt& prompt, int64_t max_completion_length) {
  return prompt.max_new_tokens > 0 ? std::min(prompt.max_new_tokens, max_completion_length)
                                   : max_completion_length;
}

// Row -> text -> ids. InvalidArgument from the row schema (common/tokenizer/dataset_row.h), else
// the tokenizer's error.
StatusOr<Prompt> PreparePrompt(nlohmann::json row, const common::Tokenizer& tokenizer);
// The same from a row's JSON text (a dataset line, a lease's row_json); InvalidArgument when it
// is not JSON.
StatusOr<Prompt> PreparePromptFromJson(std::string_view row_json,
                                       const common::Tokenizer& tokenizer);

struct ProduceInput {
  const Prompt* prompt = nullptr;  // borrowed for the Produce call; not null
  // Seeds the group's samplers (Generator::Generate's prompt_indices): a group depends on its
  // prompt, its seed index and the policy only, not on the rest of the batch.
  int64_t seed_index = 0;
};

struct ProducedGroup {
  // The group (prompt_ids after truncation, num_generations completions with token ids, text,
  // behaviour log-probs, one reward per function of the runner, policy_version of the call's
  // snapshot), or the Generator's InvalidArgument for this prompt (empty, an id outside the
  // vocabulary, too long with truncate_prompt=reject). lease_id, prompt_id and
  // policy_incarnation are the caller's to set.
  StatusOr<common::RolloutGroup> group;
  bool prompt_truncated = false;  // cut from the left to max_prompt_length
  RewardCallReport rewards;       // of its ScoreGroup call; empty when it failed or no runner
  // The failure is the prompt's own (empty, an id outside the vocabulary, too long with
  // truncate_prompt=reject): generating it again would fail again. False for an episode's
  // environment failing, which may pass on another try.
  bool prompt_failed = false;
};

struct ProduceResult {
  int64_t policy_version = 0;         // the one snapshot every group was generated with
  std::vector<ProducedGroup> groups;  // one per input, in order
  int64_t num_prompts_truncated = 0;
  int64_t num_prompts_failed = 0;
  int64_t num_completion_tokens = 0;
  double generate_seconds = 0;  // the Generate call alone (not scoring)
};

// Generates the groups of all `inputs` in one Generator::Generate call, then scores each group
// that generated with `rewards` (null: not scored, Completion::rewards left empty). No inputs:
// no call, policy_version = generator.policy_version(). Whole-call errors are Generate's
// (InvalidArgument, Internal); per-prompt ones are in ProducedGroup::group. Thread-safe (as
// Generate and ScoreGroup are).
StatusOr<ProduceResult> Produce(const Generator& generator, const RewardRunner* rewards,
                                const std::vector<ProduceInput>& inputs);

}  // namespace grpo::rollout
