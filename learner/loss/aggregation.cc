#include "learner/loss/aggregation.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace grpo::learner::loss {

Status CheckNormaliser(Aggregation a, const LossNormaliser& n) {
  if (a == Aggregation::kStepTokens) {
    if (!std::isfinite(n.step_completion_tokens) || n.step_completion_tokens <= 0.0) {
      return Status::InvalidArgument(
          "a token-sum loss (dapo, cispo, vespo) needs step_completion_tokens > 0, got " +
          std::to_string(n.step_completion_tokens));
    }
  } else if (n.gradient_accumulation_steps < 1) {
    return Status::InvalidArgument("gradient_accumulation_steps must be >= 1, got " +
                                   std::to_string(n.gradient_accumulation_steps));
  }
  return Status::OK();
}

at::Tensor AggregateMicroBatch(Aggregation a, const at::Tensor& masked, const at::Tensor& mask,
                               const at::Tensor& seq_tokens, int64_t max_completion_length,
                               const LossNormaliser& n) {
  const double ga = static_cast<double>(n.gradient_accumulation_steps);
  switch (a) {
    case Aggregation::kSequenceMean:
      return (masked.sum(1) / seq_tokens.squeeze(1)).mean() / ga;
    case Aggregation::kTokenMean:
      return masked.sum() / mask.sum().clamp_min(1.0) / ga;
    case Aggregation::kMaxLength:
      return masked.sum() / (static_cast<double>(masked.size(0)) *
                             static_cast<double>(max_completion_length) * ga);
    case Aggregation::kStepTokens:
      return masked.sum() / n.step_completion_tokens;
    case Aggregation::kSequenceSum:
      return masked.sum(1).mean() / ga;
  }
  return masked.sum();
}

double StepGradientScale(Aggregation a, double step_tokens, int64_t step_micro_batches,
                         int64_t taken) {
  if (a == Aggregation::kStepTokens) return 1.0 / std::max(1.0, step_tokens);
  return static_cast<double>(step_micro_batches) / static_cast<double>(std::max<int64_t>(1, taken));
}

}  // namespace grpo::learner::loss
