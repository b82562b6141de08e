// The dataset row schema, defined once: what one line of a JSON Lines dataset must hold, and the
// prompt text it stands for. The learner checks every line against it when a dataset is
// submitted (learner/prompt_ledger.h); the rollout pipeline builds prompts with it
// (rollout/produce.h: the rollout workers, `grpo train-local`, `grpo generate`), so a row the
// ledger accepts is a row a worker can generate from.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"

namespace grpo::common {

// The prompt text of `row`, a JSON object with
//   "prompt": a non-empty string, used as it is; or
//   "messages": a non-empty array of {"role", "content"} objects (string values; role one of
//     system, user, assistant, tool), formatted with the ChatML template and the generation
//     prompt (common/tokenizer/chat_template.h).
// When both keys are present both must be valid, and "prompt" is used. Other keys (e.g.
// "answer") are for reward functions and are not looked at. InvalidArgument saying what is
// wrong otherwise (not an object, neither key, an empty prompt, no messages, a malformed
// message or an unknown role). Thread-safe.
StatusOr<std::string> PromptText(const nlohmann::json& row);

// The row's own completion budget: its optional "max_completion_length", a positive integer
// (as vLLM's per-request max_tokens: a row may ask for less than the job's max_completion_length,
// which still caps it); 0 when absent. InvalidArgument naming the key otherwise. Thread-safe.
StatusOr<int64_t> RowCompletionBudget(const nlohmann::json& row);

// OK when PromptText(row) and RowCompletionBudget(row) are; the first error otherwise.
Status ValidateDatasetRow(const nlohmann::json& row);

}  // namespace grpo::common
