#include "learner/grpo_loss.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "learner/loss/entropy_bonus.h"
#include "learner/loss/entropy_mask.h"

namespace grpo::learner {
namespace {

bool Finite(double v) { return std::isfinite(v); }

// InvalidArgument unless t is a defined [B, T] tensor on `device`.
Status CheckBT(const at::Tensor& t, const char* name, int64_t b, int64_t tt,
               const at::Device& device) {
  if (t.dim() != 2 || t.size(0) != b || t.size(1) != tt) {
    return Status::InvalidArgument(std::string(name) + " must be [B, T] = [" + std::to_string(b) +
                                   ", " + std::to_string(tt) + "], got " + c10::str(t.sizes()));
  }
  if (t.device() != device) {
    return Status::InvalidArgument(std::string(name) + " is on " + t.device().str() +
                                   " but logp is on " + device.str());
  }
  if (!at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool) {
    return Status::InvalidArgument(std::string(name) + " must be floating point");
  }
  return Status::OK();
}

}  // namespace

StatusOr<ImportanceSamplingLevel> ParseImportanceSamplingLevel(std::string_view name) {
  if (name == "token") return ImportanceSamplingLevel::kToken;
  if (name == "sequence") return ImportanceSamplingLevel::kSequence;
  return Status::InvalidArgument("unknown importance_sampling_level '" + std::string(name) +
                                 "' (expected token|sequence)");
}

std::string_view ImportanceSamplingLevelName(ImportanceSamplingLevel l) {
  return l == ImportanceSamplingLevel::kToken ? "token" : "sequence";
}

Status GrpoLossConfig::Validate() const {
  if (!Finite(entropy_coef)) {
    return Status::InvalidArgument("entropy_coef must be finite, got " +
                                   std::to_string(entropy_coef));
  }
  if (!Finite(epsilon) || epsilon < 0.0 || epsilon > 1.0) {
    return Status::InvalidArgument("epsilon must be in [0, 1], got " + std::to_string(epsilon));
  }
  if (epsilon_high && (!Finite(*epsilon_high) || *epsilon_high < 0.0)) {
    return Status::InvalidArgument("epsilon_high must be >= 0, got " +
                                   std::to_string(*epsilon_high));
  }
  if (delta && (!Finite(*delta) || *delta <= 1.0)) {
    return Status::InvalidArgument("delta must be > 1, got " + std::to_string(*delta));
  }
  if (!Finite(beta) || beta < 0.0) {
    return Status::InvalidArgument("beta must be >= 0, got " + std::to_string(beta));
  }
  if (!Finite(importance_sampling_cap) || importance_sampling_cap <= 0.0) {
    return Status::InvalidArgument("importance_sampling_cap must be > 0, got " +
                                   std::to_string(importance_sampling_cap));
  }
  if (importance_sampling_min &&
      (!Finite(*importance_sampling_min) || *importance_sampling_min < 0.0 ||
       *importance_sampling_min >= importance_sampling_cap)) {
    return Status::InvalidArgument(
        "importance_sampling_min must be in [0, importance_sampling_cap "
        "= " +
        std::to_string(importance_sampling_cap) + "), got " +
        std::to_string(*importance_sampling_min));
  }
  if (!Finite(top_entropy_quantile) || top_entropy_quantile <= 0.0 || top_entropy_quantile > 1.0) {
    return Status::InvalidArgument("top_entropy_quantile must be in (0, 1], got " +
                                   std::to_string(top_entropy_quantile));
  }
  if (off_policy_mask_threshold &&
      (!Finite(*off_policy_mask_threshold) || *off_policy_mask_threshold < 0.0)) {
    return Status::InvalidArgument("off_policy_mask_threshold must be >= 0, got " +
                                   std::to_string(*off_policy_mask_threshold));
  }
  for (const auto& [name, v] : {std::pair{"sapo_temperature_pos", sapo_temperature_pos},
                                std::pair{"sapo_temperature_neg", sapo_temperature_neg},
                                std::pair{"vespo_lambda_pos", vespo_lambda_pos},
                                std::pair{"vespo_lambda_neg", vespo_lambda_neg}}) {
    if (!Finite(v) || v <= 0.0) {
      return Status::InvalidArgument(std::string(name) + " must be > 0, got " + std::to_string(v));
    }
  }
  for (const auto& [name, v] :
       {std::pair{"vespo_k_pos", vespo_k_pos}, std::pair{"vespo_k_neg", vespo_k_neg}}) {
    if (!Finite(v) || v < 0.0) {
      return Status::InvalidArgument(std::string(name) + " must be >= 0, got " + std::to_string(v));
    }
  }
  if (max_completion_length < 1) {
    return Status::InvalidArgument("max_completion_length must be >= 1, got " +
                                   std::to_string(max_completion_length));
  }
  if (loss_type == LossType::kVespo && IsSequenceLevel(importance_sampling_correction)) {
    return Status::InvalidArgument(
        "loss_type vespo folds token-level IS weights into its sequence weight: "
        "importance_sampling_correction must be none, token_truncate or token_mask, got " +
        std::string(ImportanceSamplingCorrectionName(importance_sampling_correction)));
  }
  return Status::OK();
}

bool TokenSeparable(const GrpoLossConfig& config, bool has_old) {
  return loss::ObjectiveOf(config.loss_type).token_separable &&
         config.importance_sampling_level == ImportanceSamplingLevel::kToken &&
         !config.off_policy_mask_threshold && config.top_entropy_quantile >= 1.0 &&
         (has_old || !IsSequenceLevel(config.importance_sampling_correction));
}

void GrpoLossMetrics::Merge(const GrpoLossMetrics& o) {
  loss += o.loss;
  tokens += o.tokens;
  micro_batches += o.micro_batches;
  clip_low_sum += o.clip_low_sum;
  clip_high_sum += o.clip_high_sum;
  clip_region_sum += o.clip_region_sum;
  kl_sum += o.kl_sum;
  phi_sum += o.phi_sum;
  entropy_sum += o.entropy_sum;
  entropy_tokens += o.entropy_tokens;
  is_ratio_sum += o.is_ratio_sum;
  is_ratio_tokens += o.is_ratio_tokens;
  is_ratio_max = std::max(is_ratio_max, o.is_ratio_max);
  has_kl = has_kl || o.has_kl;
  has_is_ratio = has_is_ratio || o.has_is_ratio;
}

namespace {
double PerMicroBatchMean(double sum, int64_t micro_batches) {
  return micro_batches > 0 ? sum / static_cast<double>(micro_batches) : 0.0;
}
}  // namespace

double GrpoLossMetrics::ClipLowMean() const {
  return PerMicroBatchMean(clip_low_sum, micro_batches);
}
double GrpoLossMetrics::ClipHighMean() const {
  return PerMicroBatchMean(clip_high_sum, micro_batches);
}
double GrpoLossMetrics::ClipRegionMean() const {
  return PerMicroBatchMean(clip_region_sum, micro_batches);
}
double GrpoLossMetrics::KlMean() const { return PerMicroBatchMean(kl_sum, micro_batches); }
double GrpoLossMetrics::PhiMean() const { return PerMicroBatchMean(phi_sum, micro_batches); }
double GrpoLossMetrics::IsRatioMean() const {
  return is_ratio_tokens > 0 ? is_ratio_sum / is_ratio_tokens : 0.0;
}

StatusOr<GrpoLossOutput> ComputeGrpoLoss(const GrpoLossConfig& config, const GrpoLossInputs& in,
                                         const LossNormaliser& normaliser) {
  RETURN_IF_ERROR(config.Validate());
  const at::Tensor& logp = in.logp;
  if (!logp.defined() || logp.dim() != 2 || !at::isFloatingType(logp.scalar_type())) {
    return Status::InvalidArgument("logp must be a floating [B, T] tensor");
  }
  const int64_t b = logp.size(0);
  const int64_t t = logp.size(1);
  if (b == 0) return Status::InvalidArgument("empty micro-batch (B = 0)");
  const at::Device device = logp.device();
  if (!in.mask.defined()) return Status::InvalidArgument("mask is required");
  RETURN_IF_ERROR(CheckBT(in.mask, "mask", b, t, device));
  if (in.old.defined()) RETURN_IF_ERROR(CheckBT(in.old, "old", b, t, device));
  if (in.beh.defined()) RETURN_IF_ERROR(CheckBT(in.beh, "beh", b, t, device));
  if (in.ref.defined()) RETURN_IF_ERROR(CheckBT(in.ref, "ref", b, t, device));
  if (in.entropy.defined()) RETURN_IF_ERROR(CheckBT(in.entropy, "entropy", b, t, device));
  if (config.top_entropy_quantile < 1.0 && !in.entropy.defined()) {
    return Status::InvalidArgument("top_entropy_quantile < 1 needs the tokens' entropy");
  }
  if (!in.advantages.defined() || in.advantages.dim() != 1 || in.advantages.size(0) != b ||
      !at::isFloatingType(in.advantages.scalar_type()) || in.advantages.device() != device) {
    return Status::InvalidArgument("advantages must be a floating [B] = [" + std::to_string(b) +
                                   "] tensor on logp's device");
  }
  if (config.beta != 0.0 && !in.ref.defined()) {
    return Status::InvalidArgument("beta != 0 needs reference log-probs (ref)");
  }
  const bool correct_is =
      config.importance_sampling_correction != ImportanceSamplingCorrection::kNone;
  if (correct_is && !in.beh.defined()) {
    return Status::InvalidArgument(
        "importance_sampling_correction " +
        std::string(ImportanceSamplingCorrectionName(config.importance_sampling_correction)) +
        " needs behaviour log-probs (beh)");
  }
  const loss::Objective& objective = loss::ObjectiveOf(config.loss_type);
  RETURN_IF_ERROR(loss::CheckNormaliser(objective.aggregation, normaliser));

  try {
    const at::ScalarType dt = logp.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor lp = logp.to(dt);             // [B, T], with grad
    const at::Tensor m = in.mask.detach().to(dt);  // [B, T]
    const at::Tensor valid = m != 0;               // [B, T] bool
    const at::Tensor zero = at::zeros({}, lp.options().requires_grad(false));
    const at::Tensor adv = in.advantages.detach().to(dt);  // [B]
    const at::Tensor old = in.old.defined() ? in.old.detach().to(dt) : lp.detach();
    const at::Tensor beh = in.beh.defined() ? in.beh.detach().to(dt) : at::Tensor();
    const at::Tensor ref = in.ref.defined() ? in.ref.detach().to(dt) : at::Tensor();

    // Entry checks, one host sync: mask is 0/1; values finite where mask == 1.
    {
      std::vector<at::Tensor> bad = {
          ((m != 0) & (m != 1)).any(), adv.isfinite().logical_not().any(),
          at::where(valid, lp.detach(), zero).isfinite().logical_not().any()};
      std::vector<const char*> what = {"mask has values other than 0 and 1",
                                       "advantages are not finite", "logp is not finite"};
      for (const auto& [x, name] :
           {std::pair{old, "old"}, std::pair{beh, "beh"}, std::pair{ref, "ref"}}) {
        if (!x.defined()) continue;
        bad.push_back(at::where(valid, x, zero).isfinite().logical_not().any());
        what.push_back(name);
      }
      const at::Tensor flags = at::stack(bad).cpu();
      const bool* f = flags.data_ptr<bool>();
      for (size_t i = 0; i < what.size(); ++i) {
        if (!f[i]) continue;
        if (i < 3) return Status::InvalidArgument(what[i]);
        return Status::InvalidArgument(std::string(what[i]) + " is not finite at a masked token");
      }
    }

    // Padding positions get log-ratio 0 through where (never 0 * inf).
    const at::Tensor token_log_ratio = at::where(valid, lp - old, zero);      // [B, T]
    const at::Tensor seq_tokens = m.sum(1, /*keepdim=*/true).clamp_min(1.0);  // [B, 1]
    const bool per_sequence =
        config.importance_sampling_level == ImportanceSamplingLevel::kSequence;
    const at::Tensor log_ratio =
        per_sequence ? (token_log_ratio * m).sum(1, /*keepdim=*/true) / seq_tokens  // GSPO
                     : token_log_ratio;
    const at::Tensor a = adv.unsqueeze(1);  // [B, 1]

    at::Tensor is_ratio;  // [B, T], detached: the metric, before any truncation
    at::Tensor is_weights;
    if (beh.defined()) {
      const at::Tensor log_rho = at::where(valid, old - beh, zero);
      is_ratio = at::exp(log_rho);
      if (correct_is) {
        is_weights = loss::ImportanceSamplingWeights(config.importance_sampling_correction, log_rho,
                                                     config.importance_sampling_cap,
                                                     config.importance_sampling_min);
      }
    }

    loss::ObjectiveInputs oin;
    oin.logp = at::where(valid, lp, zero);
    oin.log_ratio = token_log_ratio;
    oin.ratio = at::exp(log_ratio);  // [B, T] or [B, 1]
    oin.advantages = a;
    oin.mask = m;
    oin.is_weights = is_weights;
    const loss::ObjectiveTerms terms = objective.terms(config, oin);
    at::Tensor per_token = terms.per_token.expand({b, t});  // [B, T]
    if (config.off_policy_mask_threshold) {
      per_token = per_token * loss::OffPolicySequenceMask(a, lp, beh.defined() ? beh : old, m,
                                                          valid, *config.off_policy_mask_threshold);
    }
    // The tokens the policy term acts on (and the entropy bonus with them, as TRL).
    at::Tensor effective = m;
    if (config.top_entropy_quantile < 1.0) {
      const at::Tensor high =
          loss::HighEntropyMask(in.entropy, valid, m, 1.0 - config.top_entropy_quantile);
      per_token = per_token * high;
      effective = m * high.to(dt);
    }
    if (is_weights.defined() && !objective.folds_is_weights) per_token = per_token * is_weights;
    at::Tensor kl;  // [B, T]
    if (config.beta != 0.0) {
      const at::Tensor d = at::where(valid, ref - lp, zero);
      kl = at::exp(d) - d - 1.0;
      if (config.use_bias_correction_kl) kl = kl * oin.ratio;  // before the delta clamp, as TRL
      per_token = per_token + config.beta * kl;
    }

    const at::Tensor masked = per_token * m;  // finite everywhere: padding terms are 0
    at::Tensor loss = loss::AggregateMicroBatch(objective.aggregation, masked, m, seq_tokens,
                                                config.max_completion_length, normaliser);
    const at::Tensor entropy = in.entropy.defined() ? in.entropy.to(dt) : at::Tensor();
    if (config.entropy_coef != 0.0 && entropy.defined()) {
      loss = loss - config.entropy_coef * loss::EntropyBonus(entropy, effective, valid, normaliser);
    }

    // Metrics (docs/GRPO_SPEC.md, TRL 1.16): clip flags as the objective defines them; means over
    // this micro-batch's masked tokens, or over its sequences when a flag is one per sequence.
    at::Tensor stats;
    {
      at::NoGradGuard no_grad;
      const at::Tensor none = at::zeros({b, 1}, at::kBool).to(device);
      const at::Tensor low = terms.clip_low.defined() ? terms.clip_low : none;
      const at::Tensor high = terms.clip_high.defined() ? terms.clip_high : none;
      auto flag_sum = [&](const at::Tensor& f) {
        return f.size(1) == 1 ? f.to(dt).sum() : (f.to(dt) * m).sum();
      };
      std::vector<at::Tensor> parts = {loss.detach(), m.sum(), flag_sum(low), flag_sum(high),
                                       flag_sum(low | high)};
      parts.push_back(kl.defined() ? (kl.detach() * m).sum() : zero);
      if (is_ratio.defined()) {
        parts.push_back((is_ratio * m).sum());
        parts.push_back(at::where(valid, is_ratio, zero).max());
      } else {
        parts.push_back(zero);
        parts.push_back(zero);
      }
      parts.push_back(terms.phi.defined() ? terms.phi.sum() : zero);
      parts.push_back(
          entropy.defined() ? (at::where(valid, entropy.detach(), zero) * effective).sum() : zero);
      parts.push_back(effective.sum());
      stats = at::stack(parts).to(at::kCPU, at::kDouble);
    }
    const double* s = stats.data_ptr<double>();
    GrpoLossOutput out;
    out.loss = loss;
    GrpoLossMetrics& mt = out.metrics;
    mt.loss = s[0];
    mt.tokens = s[1];
    mt.micro_batches = 1;
    // One flag per sequence ([B, 1]: GSPO's ratio, or no flags at all) or one per token.
    const bool flag_per_sequence = !terms.clip_high.defined() || terms.clip_high.size(1) == 1;
    const double flag_den = flag_per_sequence ? static_cast<double>(b) : std::max(1.0, s[1]);
    mt.clip_low_sum = s[2] / flag_den;
    mt.clip_high_sum = s[3] / flag_den;
    mt.clip_region_sum = s[4] / flag_den;
    mt.has_kl = kl.defined();
    mt.kl_sum = s[5] / std::max(1.0, s[1]);
    mt.has_is_ratio = is_ratio.defined();
    mt.is_ratio_sum = s[6];
    mt.is_ratio_tokens = is_ratio.defined() ? s[1] : 0.0;
    mt.is_ratio_max = s[7];
    mt.phi_sum = s[8] / static_cast<double>(b);
    if (entropy.defined()) {
      mt.entropy_sum = s[9];
      mt.entropy_tokens = s[10];
    }
    return out;
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("grpo loss: ") + e.what_without_backtrace());
  }
}

StatusOr<TokenLossGrad> GrpoTokenLossGrad(const GrpoLossConfig& config, GrpoLossInputs in,
                                          const LossNormaliser& normaliser, Status* error) {
  if (!TokenSeparable(config, in.old.defined())) {
    return Status::InvalidArgument(
        "the fused per-token loss gradient needs a token-separable loss (loss/objectives.h: "
        "token-level importance sampling, no off-policy mask, not vespo)");
  }
  if (error == nullptr || !in.mask.defined() || in.mask.dim() != 2) {
    return Status::InvalidArgument("GrpoTokenLossGrad: needs a [B, T] mask and an error slot");
  }
  const int64_t b = in.mask.size(0), t = in.mask.size(1);
  // Values outside the chunk: finite, otherwise irrelevant.
  const at::Tensor placeholder =
      (in.old.defined() ? in.old.contiguous()
                        : at::zeros({b, t}, in.mask.options().dtype(at::kFloat)))
          .reshape({-1});
  return TokenLossGrad([config, in, normaliser, error, placeholder, b, t](
                           int64_t start, const at::Tensor& lp) -> at::Tensor {
    at::AutoGradMode grad_mode(true);
    const int64_t n = b * t, c = lp.size(0);
    TORCH_CHECK(start >= 0 && start + c <= n, "GrpoTokenLossGrad: chunk [", start, ", ", start + c,
                ") outside ", n, " tokens");
    at::Tensor leaf = lp.detach().clone().requires_grad_(true);
    const at::Tensor rest = placeholder.to(lp.scalar_type());
    GrpoLossInputs chunk_in = in;
    chunk_in.logp =
        at::cat({rest.narrow(0, 0, start), leaf, rest.narrow(0, start + c, n - start - c)})
            .view({b, t});
    StatusOr<GrpoLossOutput> out = ComputeGrpoLoss(config, chunk_in, normaliser);
    if (!out.ok()) {
      if (error->ok()) *error = out.status();
      return at::zeros_like(lp);
    }
    return torch::autograd::grad({out->loss}, {leaf})[0];
  });
}

}  // namespace grpo::learner
