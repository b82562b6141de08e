#include "rollout/produce.h"

#include <chrono>
#include <utility>

#include "common/tokenizer/dataset_row.h"

namespace grpo::rollout {

StatusOr<Prompt> PreparePrompt(nlohmann::json row, const common::Tokenizer& tokenizer) {
  ASSIGN_OR_RETURN(std::string text, common::PromptText(row));
  ASSIGN_OR_RETURN(const int64_t budget, common::RowCompletionBudget(row));
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer.Encode(text));
  return Prompt{std::move(text), std::move(ids), std::move(row), budget};
}

StatusOr<Prompt> PreparePromptFromJson(std::string_view row_json,
                                       const common::Tokenizer& tokenizer) {
  nlohmann::json row;
  try {
    row = nlohmann::json::parse(row_json);
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(std::string("row is not valid JSON (") + e.what() + ")");
  }
  return PreparePrompt(std::move(row), tokenizer);
}

StatusOr<ProduceResult> Produce(const Generator& generator, const RewardRunner* rewards,
                                const std::vector<ProduceInput>& inputs) {
  ProduceResult out;
  if (inputs.empty()) {
    out.policy_version = generator.policy_version();
    return out;
  }
  std::vector<std::vector<int32_t>> ids;
  std::vector<int64_t> seeds, budgets;
  ids.reserve(inputs.size());
  seeds.reserve(inputs.size());
  for (const ProduceInput& in : inputs) {
    if (in.prompt == nullptr) return Status::InvalidArgument("Produce: an input has no prompt");
    ids.push_back(in.prompt->ids);
    seeds.push_back(in.seed_index);
    budgets.push_back(CompletionBudget(*in.prompt, generator.options().max_completion_length));
  }
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(GenerateResult generated, generator.Generate(ids, seeds, budgets));
  out.generate_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.policy_version = generated.policy_version;
  out.num_prompts_truncated = generated.num_prompts_truncated;
  out.num_prompts_failed = generated.num_prompts_failed;
  out.num_completion_tokens = generated.num_completion_tokens;
  out.groups.reserve(inputs.size());
  for (size_t i = 0; i < generated.groups.size(); ++i) {
    ProducedGroup produced{std::move(generated.groups[i]), false, {}};
    produced.prompt_failed = !produced.group.ok();  // Generate fails a group for its prompt only
    if (produced.group.ok()) {
      common::RolloutGroup& group = *produced.group;
      group.policy_version = generated.policy_version;
      produced.prompt_truncated = group.prompt_ids.size() < inputs[i].prompt->ids.size();
      if (rewards != nullptr) {
        produced.rewards =
            rewards->ScoreGroup(group, inputs[i].prompt->text, inputs[i].prompt->row);
      }
    }
    out.groups.push_back(std::move(produced));
  }
  return out;
}

}  // namespace grpo::rollout
