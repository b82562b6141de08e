#include "learner/loss/off_policy.h"

#include <ATen/core/grad_mode.h>

#include <limits>
#include <string>

namespace grpo::learner {

StatusOr<ImportanceSamplingCorrection> ParseImportanceSamplingCorrection(std::string_view name) {
  if (name == "none") return ImportanceSamplingCorrection::kNone;
  if (name == "token_truncate") return ImportanceSamplingCorrection::kTokenTruncate;
  if (name == "token_mask") return ImportanceSamplingCorrection::kTokenMask;
  if (name == "sequence_truncate") return ImportanceSamplingCorrection::kSequenceTruncate;
  if (name == "sequence_mask") return ImportanceSamplingCorrection::kSequenceMask;
  return Status::InvalidArgument(
      "unknown importance_sampling_correction '" + std::string(name) +
      "' (expected none|token_truncate|token_mask|sequence_truncate|sequence_mask)");
}

std::string_view ImportanceSamplingCorrectionName(ImportanceSamplingCorrection c) {
  switch (c) {
    case ImportanceSamplingCorrection::kNone:
      return "none";
    case ImportanceSamplingCorrection::kTokenTruncate:
      return "token_truncate";
    case ImportanceSamplingCorrection::kTokenMask:
      return "token_mask";
    case ImportanceSamplingCorrection::kSequenceTruncate:
      return "sequence_truncate";
    case ImportanceSamplingCorrection::kSequenceMask:
      return "sequence_mask";
  }
  return "unknown";
}

bool IsSequenceLevel(ImportanceSamplingCorrection c) {
  return c == ImportanceSamplingCorrection::kSequenceTruncate ||
         c == ImportanceSamplingCorrection::kSequenceMask;
}

namespace loss {

at::Tensor ImportanceSamplingWeights(ImportanceSamplingCorrection mode, const at::Tensor& log_rho,
                                     double cap, std::optional<double> clip_min) {
  at::NoGradGuard no_grad;
  const at::Tensor zero = at::zeros({}, log_rho.options());
  const at::Tensor rho =
      at::exp(IsSequenceLevel(mode) ? log_rho.sum(1, /*keepdim=*/true) : log_rho);
  switch (mode) {
    case ImportanceSamplingCorrection::kTokenTruncate:
    case ImportanceSamplingCorrection::kSequenceTruncate:
      return clip_min ? at::clamp(rho, *clip_min, cap) : at::clamp_max(rho, cap);
    case ImportanceSamplingCorrection::kTokenMask:
    case ImportanceSamplingCorrection::kSequenceMask: {
      const double lo = clip_min.value_or(-std::numeric_limits<double>::infinity());
      return at::where((rho < lo) | (rho > cap), zero, rho);
    }
    case ImportanceSamplingCorrection::kNone:
      break;
  }
  return at::ones_like(rho);
}

at::Tensor OffPolicySequenceMask(const at::Tensor& advantages, const at::Tensor& logp,
                                 const at::Tensor& sampling, const at::Tensor& mask,
                                 const at::Tensor& valid, double threshold) {
  at::NoGradGuard no_grad;
  const at::Tensor zero = at::zeros({}, mask.options());
  const at::Tensor kl = at::where(valid, sampling - logp.detach(), zero);  // [B, T]
  const at::Tensor mean_kl =
      kl.sum(1, /*keepdim=*/true) / mask.sum(1, /*keepdim=*/true).clamp_min(1.0);  // [B, 1]
  return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.scalar_type());
}

}  // namespace loss
}  // namespace grpo::learner
