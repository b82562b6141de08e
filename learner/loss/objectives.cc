#include "learner/loss/objectives.h"

#include <ATen/core/grad_mode.h>

#include <array>
#include <cmath>
#include <string>

#include "common/loss_type_names.h"
#include "learner/grpo_loss.h"

namespace grpo::learner {
namespace loss {
namespace {

// PPO's clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo): -min(c1 A, c2 A) with
// c2 = clamp(ratio, 1 - epsilon, 1 + epsilon_high) and c1 = min(ratio, delta) (two-sided
// clipping) or the ratio; the clip flags on c1, as TRL 1.16.
ObjectiveTerms ClippedSurrogate(const GrpoLossConfig& c, const ObjectiveInputs& in) {
  const double lo = 1.0 - c.epsilon, hi = 1.0 + c.EpsilonHigh();
  const at::Tensor c2 = at::clamp(in.ratio, lo, hi);
  const at::Tensor c1 = c.delta ? at::clamp_max(in.ratio, *c.delta) : in.ratio;
  const at::Tensor& a = in.advantages;
  ObjectiveTerms t;
  t.per_token = -at::min(c1 * a, c2 * a);
  const at::Tensor r = c1.detach();
  t.clip_low = (r < lo) & (a < 0);
  t.clip_high = (r > hi) & (a > 0);
  return t;
}

// CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight clipped from above at
// epsilon_high and detached, times A and the log-prob: every token keeps a gradient.
ObjectiveTerms Cispo(const GrpoLossConfig& c, const ObjectiveInputs& in) {
  const double cap = c.EpsilonHigh();
  ObjectiveTerms t;
  t.per_token = -at::clamp_max(in.ratio, cap).detach() * in.advantages * in.logp;
  t.clip_high = (in.ratio.detach() > cap) & (in.advantages > 0);
  return t;
}

// SAPO (arXiv 2511.20347): a sigmoid gate in place of the hard clip,
// -sigmoid(tau (ratio - 1)) 4 / tau A, tau by the advantage's sign.
ObjectiveTerms Sapo(const GrpoLossConfig& c, const ObjectiveInputs& in) {
  const at::Tensor tau =
      at::where(in.advantages > 0, at::full({}, c.sapo_temperature_pos, in.advantages.options()),
                at::full({}, c.sapo_temperature_neg, in.advantages.options()));
  ObjectiveTerms t;
  t.per_token = -at::sigmoid(tau * (in.ratio - 1.0)) * 4.0 / tau * in.advantages;
  return t;
}

// VESPO (TRL `get_gamma_weights`): a detached per-sequence gamma weight of the sequence's
// importance ratio w = exp(sum_t (logp - old) [+ sum_t log w_is]),
// phi(w) = exp(lambda + k log w - lambda w), k and lambda by the advantage's sign; the loss is
// -phi A logp. Log-ratios are clamped to [-20, 20] per token and log w to [log 1e-8, 20].
ObjectiveTerms Vespo(const GrpoLossConfig& c, const ObjectiveInputs& in) {
  ObjectiveTerms t;
  {
    at::NoGradGuard no_grad;
    const double lower = std::log(1e-8);
    at::Tensor seq = (at::clamp(in.log_ratio.detach(), -20.0, 20.0) * in.mask).sum(1, true);
    if (in.is_weights.defined()) {
      seq = seq + at::clamp(at::log(in.is_weights), lower, 20.0).sum(1, true);
    }
    const at::Tensor log_w = at::clamp(seq, lower, 20.0);
    const at::Tensor nonneg = in.advantages >= 0;
    const auto opts = in.advantages.options();
    const at::Tensor k =
        at::where(nonneg, at::full({}, c.vespo_k_pos, opts), at::full({}, c.vespo_k_neg, opts));
    const at::Tensor lambda = at::where(nonneg, at::full({}, c.vespo_lambda_pos, opts),
                                        at::full({}, c.vespo_lambda_neg, opts))
                                  .clamp_min(1e-4);
    t.phi = at::nan_to_num(at::exp(lambda + k * log_w - lambda * at::exp(log_w)), 0.0, 0.0, 0.0);
  }
  t.per_token = -t.phi * in.advantages * in.logp;
  return t;
}

constexpr std::array<Objective, 8> kObjectives = {{
    {LossType::kGrpo, "grpo", Aggregation::kSequenceMean, true, false, ObjectiveMetric::kClipRatios,
     "DeepSeekMath, arXiv 2402.03300", ClippedSurrogate},
    {LossType::kBnpo, "bnpo", Aggregation::kTokenMean, true, false, ObjectiveMetric::kClipRatios,
     "TRL bnpo", ClippedSurrogate},
    {LossType::kDrGrpo, "dr_grpo", Aggregation::kMaxLength, true, false,
     ObjectiveMetric::kClipRatios, "Dr. GRPO, arXiv 2503.20783", ClippedSurrogate},
    {LossType::kDapo, "dapo", Aggregation::kStepTokens, true, false, ObjectiveMetric::kClipRatios,
     "DAPO, arXiv 2503.14476", ClippedSurrogate},
    {LossType::kCispo, "cispo", Aggregation::kStepTokens, true, false,
     ObjectiveMetric::kCispoClipRatio, "CISPO (MiniMax-M1), arXiv 2506.13585", Cispo},
    {LossType::kSapo, "sapo", Aggregation::kSequenceMean, true, false, ObjectiveMetric::kNone,
     "SAPO, arXiv 2511.20347", Sapo},
    {LossType::kLuspo, "luspo", Aggregation::kSequenceSum, true, false,
     ObjectiveMetric::kClipRatios, "LUSPO, arXiv 2602.05261", ClippedSurrogate},
    {LossType::kVespo, "vespo", Aggregation::kStepTokens, false, true, ObjectiveMetric::kVespoPhi,
     "VESPO, arXiv 2602.10693", Vespo},
}};

constexpr bool TableMatchesConfigNames() {
  if (kObjectives.size() != common::kLossTypeNames.size()) return false;
  for (size_t i = 0; i < kObjectives.size(); ++i) {
    if (kObjectives[i].name != common::kLossTypeNames[i]) return false;
    if (static_cast<size_t>(kObjectives[i].type) != i) return false;
  }
  return true;
}
static_assert(TableMatchesConfigNames(),
              "the objective table and common::kLossTypeNames must list the same loss types in "
              "the same order, indexed by LossType");

}  // namespace

const Objective& ObjectiveOf(LossType t) { return kObjectives[static_cast<size_t>(t)]; }
std::span<const Objective> Objectives() { return kObjectives; }

}  // namespace loss

StatusOr<LossType> ParseLossType(std::string_view name) {
  for (const loss::Objective& o : loss::Objectives()) {
    if (o.name == name) return o.type;
  }
  std::string choices;
  for (std::string_view n : common::kLossTypeNames) {
    choices += (choices.empty() ? "" : "|") + std::string(n);
  }
  return Status::InvalidArgument("unknown loss_type '" + std::string(name) + "' (expected " +
                                 choices + ")");
}

std::string_view LossTypeName(LossType t) { return loss::ObjectiveOf(t).name; }

}  // namespace grpo::learner
