// The per-sample objective of each `loss_type` (docs/GRPO_SPEC.md "Per-token loss"): one
// function per objective behind one signature, in a table by name that also says how the
// objective aggregates, whether its gradient is a sum of per-token terms (which picks the fused
// LM-head path) and which metric it logs. ComputeGrpoLoss (learner/grpo_loss.h) applies the
// corrections, the KL term and the aggregation around it; nothing else branches on the type.
#pragma once

#include <ATen/ATen.h>

#include <span>
#include <string_view>

#include "common/status.h"
#include "learner/loss/aggregation.h"

namespace grpo::learner {

struct GrpoLossConfig;

// TRL `loss_type`.
enum class LossType { kGrpo, kBnpo, kDrGrpo, kDapo, kCispo, kSapo, kLuspo, kVespo };

// InvalidArgument naming the value and the choices.
StatusOr<LossType> ParseLossType(std::string_view name);
std::string_view LossTypeName(LossType t);

namespace loss {

// What an objective logs (TRL 1.16's names in docs/GRPO_SPEC.md "Metrics per optimizer step").
enum class ObjectiveMetric {
  kClipRatios,      // clip_ratio/low_mean, high_mean, region_mean
  kCispoClipRatio,  // cispo_clip_ratio
  kVespoPhi,        // vespo/phi_seq_mean
  kNone,            // sapo
};

// A micro-batch as an objective sees it, in the loss's dtype.
struct ObjectiveInputs {
  at::Tensor logp;        // [B, T] current log-probs, with grad; 0 at padding
  at::Tensor log_ratio;   // [B, T] logp - old per token, with grad; 0 at padding
  at::Tensor ratio;       // exp(log importance weight), with grad: [B, T] token level, [B, 1] GSPO
  at::Tensor advantages;  // [B, 1]
  at::Tensor mask;        // [B, T], 0/1
  at::Tensor is_weights;  // the IS correction's weights or undefined; read by folds_is_weights
};

struct ObjectiveTerms {
  at::Tensor per_token;  // broadcastable to [B, T]
  // Detached flags for the metric, [B, T] or [B, 1]: low/high for kClipRatios; high alone for
  // kCispoClipRatio.
  at::Tensor clip_low, clip_high;
  at::Tensor phi;  // [B, 1], kVespoPhi
};

struct Objective {
  LossType type;
  std::string_view name;
  Aggregation aggregation;
  // dL/dlogp_t depends on token t's own values only (with token-level importance sampling):
  // the fused per-chunk gradient is exact.
  bool token_separable;
  // The objective takes the IS weights itself (vespo: into its sequence weight), so they do not
  // multiply its per-token loss.
  bool folds_is_weights;
  ObjectiveMetric metric;
  std::string_view paper;  // for --help and docs
  ObjectiveTerms (*terms)(const GrpoLossConfig& config, const ObjectiveInputs& in);
};

const Objective& ObjectiveOf(LossType t);
std::span<const Objective> Objectives();

}  // namespace loss
}  // namespace grpo::learner
