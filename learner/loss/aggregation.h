// How a micro-batch's per-token losses become its loss, and how a step's accumulated gradient is
// divided (docs/GRPO_SPEC.md "Aggregation"): the one home of every step divisor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "common/status.h"

namespace grpo::learner {

// The per-step divisors of docs/GRPO_SPEC.md "Aggregation": the same for every micro-batch of a
// step.
struct LossNormaliser {
  // kStepTokens: completion tokens of the whole optimizer step (all its micro-batches, on every
  // learner rank). Must be > 0. The trainer passes 1 (the micro-batch loss is then the plain
  // masked sum) and divides the step's gradient by StepGradientScale instead, because the step's
  // tokens are known only when it ends.
  double step_completion_tokens = 0.0;
  // The other aggregations: the micro-batch loss is divided by this (the step's micro-batches
  // over all learner ranks).
  int64_t gradient_accumulation_steps = 1;
  // The entropy bonus (loss/entropy_bonus.h) is multiplied by this so that it is TRL's after the
  // step's StepGradientScale: the step's completion tokens for kStepTokens (whose micro-batch
  // losses are plain sums until the step ends), else 1.
  double entropy_bonus_scale = 1.0;
};

namespace loss {

// TRL 1.16's aggregations, by the loss types that use them.
enum class Aggregation {
  kSequenceMean,  // grpo, sapo: mean over sequences of each one's token mean, / GA
  kTokenMean,     // bnpo: masked tokens of the micro-batch, / GA
  kMaxLength,     // dr_grpo: / (B x max_completion_length x GA)
  kStepTokens,    // dapo, cispo, vespo: / the step's completion tokens
  kSequenceSum,   // luspo: mean over sequences of each one's token sum, / GA
};

// InvalidArgument naming the bad divisor for `a`.
Status CheckNormaliser(Aggregation a, const LossNormaliser& n);

// The micro-batch loss from `masked` = per-token loss x mask ([B, T], 0 at padding), `mask` and
// its per-row token counts `seq_tokens` ([B, 1], clamped to >= 1).
at::Tensor AggregateMicroBatch(Aggregation a, const at::Tensor& masked, const at::Tensor& mask,
                               const at::Tensor& seq_tokens, int64_t max_completion_length,
                               const LossNormaliser& n);

// What the trainer multiplies a step's accumulated gradient (and loss) by before clipping:
// kStepTokens, 1 / max(1, step_tokens); the others divided each micro-batch by
// `step_micro_batches` (the configured GA x world size), so a step of `taken` micro-batches (a
// flushed partial one) is rescaled by step_micro_batches / taken.
double StepGradientScale(Aggregation a, double step_tokens, int64_t step_micro_batches,
                         int64_t taken);

}  // namespace loss
}  // namespace grpo::learner
