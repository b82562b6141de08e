#include "learner/grpo_loss.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

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

StatusOr<LossType> ParseLossType(std::string_view name) {
  if (name == "grpo") return LossType::kGrpo;
  if (name == "bnpo") return LossType::kBnpo;
  if (name == "dr_grpo") return LossType::kDrGrpo;
  if (name == "dapo") return LossType::kDapo;
  return Status::InvalidArgument("unknown loss_type '" + std::string(name) +
                                 "' (expected grpo|bnpo|dr_grpo|dapo)");
}

StatusOr<ImportanceSamplingLevel> ParseImportanceSamplingLevel(std::string_view name) {
  if (name == "token") return ImportanceSamplingLevel::kToken;
  if (name == "sequence") return ImportanceSamplingLevel::kSequence;
  return Status::InvalidArgument("unknown importance_sampling_level '" + std::string(name) +
                                 "' (expected token|sequence)");
}

StatusOr<ImportanceSamplingCorrection> ParseImportanceSamplingCorrection(std::string_view name) {
  if (name == "none") return ImportanceSamplingCorrection::kNone;
  if (name == "token_truncate") return ImportanceSamplingCorrection::kTokenTruncate;
  if (name == "token_mask") return ImportanceSamplingCorrection::kTokenMask;
  return Status::InvalidArgument("unknown importance_sampling_correction '" + std::string(name) +
                                 "' (expected none|token_truncate|token_mask)");
}

std::string_view LossTypeName(LossType t) {
  switch (t) {
    case LossType::kGrpo:
      return "grpo";
    case LossType::kBnpo:
      return "bnpo";
    case LossType::kDrGrpo:
      return "dr_grpo";
    case LossType::kDapo:
      return "dapo";
  }
  return "unknown";
}

std::string_view ImportanceSamplingLevelName(ImportanceSamplingLevel l) {
  return l == ImportanceSamplingLevel::kToken ? "token" : "sequence";
}

std::string_view ImportanceSamplingCorrectionName(ImportanceSamplingCorrection c) {
  switch (c) {
    case ImportanceSamplingCorrection::kNone:
      return "none";
    case ImportanceSamplingCorrection::kTokenTruncate:
      return "token_truncate";
    case ImportanceSamplingCorrection::kTokenMask:
      return "token_mask";
  }
  return "unknown";
}

Status GrpoLossConfig::Validate() const {
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
  if (max_completion_length < 1) {
    return Status::InvalidArgument("max_completion_length must be >= 1, got " +
                                   std::to_string(max_completion_length));
  }
  return Status::OK();
}

void GrpoLossMetrics::Merge(const GrpoLossMetrics& o) {
  loss += o.loss;
  tokens += o.tokens;
  micro_batches += o.micro_batches;
  clip_low_sum += o.clip_low_sum;
  clip_high_sum += o.clip_high_sum;
  clip_region_sum += o.clip_region_sum;
  kl_sum += o.kl_sum;
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
  if (config.loss_type == LossType::kDapo) {
    if (!Finite(normaliser.step_completion_tokens) || normaliser.step_completion_tokens <= 0.0) {
      return Status::InvalidArgument("dapo needs step_completion_tokens > 0, got " +
                                     std::to_string(normaliser.step_completion_tokens));
    }
  } else if (normaliser.gradient_accumulation_steps < 1) {
    return Status::InvalidArgument("gradient_accumulation_steps must be >= 1, got " +
                                   std::to_string(normaliser.gradient_accumulation_steps));
  }

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
    at::Tensor log_ratio = at::where(valid, lp - old, zero);                  // [B, T]
    const at::Tensor seq_tokens = m.sum(1, /*keepdim=*/true).clamp_min(1.0);  // [B, 1]
    if (config.importance_sampling_level == ImportanceSamplingLevel::kSequence) {
      log_ratio = (log_ratio * m).sum(1, /*keepdim=*/true) / seq_tokens;  // [B, 1] (GSPO)
    }
    const at::Tensor ratio = at::exp(log_ratio);  // [B, T] or [B, 1]
    const double eps_low = config.epsilon;
    const double eps_high = config.EpsilonHigh();
    const at::Tensor c2 = at::clamp(ratio, 1.0 - eps_low, 1.0 + eps_high);
    const at::Tensor c1 = config.delta ? at::clamp_max(ratio, *config.delta) : ratio;
    const at::Tensor a = adv.unsqueeze(1);                           // [B, 1]
    at::Tensor per_token = -at::min(c1 * a, c2 * a).expand({b, t});  // [B, T]

    at::Tensor is_ratio;  // [B, T], detached
    if (beh.defined()) is_ratio = at::exp(at::where(valid, old - beh, zero));
    if (correct_is) {
      const double cap = config.importance_sampling_cap;
      const at::Tensor w =
          config.importance_sampling_correction == ImportanceSamplingCorrection::kTokenTruncate
              ? at::clamp_max(is_ratio, cap)
              : is_ratio * (is_ratio <= cap).to(dt);  // token_mask keeps the ratio (TRL #4530)
      per_token = per_token * w;
    }
    at::Tensor kl;  // [B, T]
    if (config.beta != 0.0) {
      const at::Tensor d = at::where(valid, ref - lp, zero);
      kl = at::exp(d) - d - 1.0;
      per_token = per_token + config.beta * kl;
    }

    const at::Tensor masked = per_token * m;  // finite everywhere: padding terms are 0
    at::Tensor loss;
    switch (config.loss_type) {
      case LossType::kGrpo:
        loss = (masked.sum(1) / seq_tokens.squeeze(1)).mean() /
               static_cast<double>(normaliser.gradient_accumulation_steps);
        break;
      case LossType::kBnpo:
        loss = masked.sum() / m.sum().clamp_min(1.0) /
               static_cast<double>(normaliser.gradient_accumulation_steps);
        break;
      case LossType::kDrGrpo:
        loss = masked.sum() / (static_cast<double>(b) * config.max_completion_length *
                               normaliser.gradient_accumulation_steps);
        break;
      case LossType::kDapo:
        loss = masked.sum() / normaliser.step_completion_tokens;
        break;
    }

    // Metrics (docs/GRPO_SPEC.md, TRL 1.16): clip flags on the ratio the loss uses (after the delta
    // clamp); means over this micro-batch's masked tokens, or over its sequences with
    // sequence-level importance sampling (one flag per sequence).
    at::Tensor stats;
    {
      at::NoGradGuard no_grad;
      const bool per_sequence =
          config.importance_sampling_level == ImportanceSamplingLevel::kSequence;
      const at::Tensor r = c1.detach();  // [B, T] or [B, 1]
      const at::Tensor low = (r < 1.0 - eps_low) & (a < 0);
      const at::Tensor high = (r > 1.0 + eps_high) & (a > 0);
      const at::Tensor w = per_sequence ? at::ones({b, 1}, m.options()) : m;
      std::vector<at::Tensor> parts = {loss.detach(), m.sum(), (low.to(dt) * w).sum(),
                                       (high.to(dt) * w).sum(), ((low | high).to(dt) * w).sum()};
      parts.push_back(kl.defined() ? (kl.detach() * m).sum() : zero);
      if (is_ratio.defined()) {
        parts.push_back((is_ratio * m).sum());
        parts.push_back(at::where(valid, is_ratio, zero).max());
      } else {
        parts.push_back(zero);
        parts.push_back(zero);
      }
      stats = at::stack(parts).to(at::kCPU, at::kDouble);
    }
    const double* s = stats.data_ptr<double>();
    GrpoLossOutput out;
    out.loss = loss;
    GrpoLossMetrics& mt = out.metrics;
    mt.loss = s[0];
    mt.tokens = s[1];
    mt.micro_batches = 1;
    const double flag_den = config.importance_sampling_level == ImportanceSamplingLevel::kSequence
                                ? static_cast<double>(b)
                                : std::max(1.0, s[1]);
    mt.clip_low_sum = s[2] / flag_den;
    mt.clip_high_sum = s[3] / flag_den;
    mt.clip_region_sum = s[4] / flag_den;
    mt.has_kl = kl.defined();
    mt.kl_sum = s[5] / std::max(1.0, s[1]);
    mt.has_is_ratio = is_ratio.defined();
    mt.is_ratio_sum = s[6];
    mt.is_ratio_tokens = is_ratio.defined() ? s[1] : 0.0;
    mt.is_ratio_max = s[7];
    return out;
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("grpo loss: ") + e.what_without_backtrace());
  }
}

StatusOr<TokenLossGrad> GrpoTokenLossGrad(const GrpoLossConfig& config, GrpoLossInputs in,
                                          const LossNormaliser& normaliser, Status* error) {
  if (config.importance_sampling_level != ImportanceSamplingLevel::kToken) {
    return Status::InvalidArgument(
        "the fused per-token loss gradient needs importance_sampling_level token");
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
