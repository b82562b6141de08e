#include "rollout/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>

namespace grpo::rollout {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

Status ValidateLogits(const at::Tensor& logits, const at::Tensor& seen) {
  if (!logits.defined() || logits.dim() != 2 || logits.size(1) == 0) {
    return Status::InvalidArgument("sampler: logits must be [B, V>0]");
  }
  if (!at::isFloatingType(logits.scalar_type())) {
    return Status::InvalidArgument("sampler: logits must be floating");
  }
  if (seen.defined() && (seen.sizes() != logits.sizes() || seen.scalar_type() != at::kBool)) {
    return Status::InvalidArgument("sampler: seen must be a bool tensor shaped like logits");
  }
  return Status::OK();
}

void CheckLogits(const at::Tensor& logits, const at::Tensor& seen) {
  const Status s = ValidateLogits(logits, seen);
  TORCH_CHECK(s.ok(), s.message());
}

}  // namespace

SamplingParams SamplingParams::FromConfig(const common::GrpoConfig& config) {
  SamplingParams p;
  p.temperature = config.temperature;
  p.top_k = config.top_k;
  p.top_p = config.top_p;
  p.min_p = config.min_p;
  p.repetition_penalty = config.repetition_penalty;
  return p;
}

Status SamplingParams::Validate() const {
  if (!std::isfinite(temperature) || temperature < 0) {
    return Status::InvalidArgument("temperature must be >= 0 (0 = greedy), got " +
                                   std::to_string(temperature));
  }
  if (top_k < 0) {
    return Status::InvalidArgument("top_k must be >= 0 (0 = off), got " + std::to_string(top_k));
  }
  if (!std::isfinite(top_p) || top_p < 0 || top_p > 1) {
    return Status::InvalidArgument("top_p must be in [0, 1], got " + std::to_string(top_p));
  }
  if (min_p && (!std::isfinite(*min_p) || *min_p < 0 || *min_p > 1)) {
    return Status::InvalidArgument("min_p must be in [0, 1], got " + std::to_string(*min_p));
  }
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0) {
    return Status::InvalidArgument("repetition_penalty must be > 0, got " +
                                   std::to_string(repetition_penalty));
  }
  return Status::OK();
}

at::Tensor ProcessLogits(const at::Tensor& logits, const at::Tensor& seen,
                         const SamplingParams& params) {
  CheckLogits(logits, seen);
  at::NoGradGuard no_grad;
  at::Tensor x = logits.to(at::kFloat);
  // RepetitionPenaltyLogitsProcessor.
  if (params.uses_penalty() && seen.defined()) {
    const double p = params.repetition_penalty;
    x = at::where(seen, at::where(x < 0, x * p, x / p), x);
  }
  if (params.greedy()) return x;  // warpers never change the argmax
  // TemperatureLogitsWarper.
  if (params.temperature != 1.0) x = x / params.temperature;
  // TopKLogitsWarper: keeps every token >= the k-th largest (ties included).
  if (params.top_k > 0) {
    const int64_t k = std::min<int64_t>(params.top_k, x.size(1));
    at::Tensor kth = std::get<0>(x.topk(k, /*dim=*/1)).narrow(1, k - 1, 1);  // [B, 1]
    x = x.masked_fill(x < kth, kNegInf);
  }
  // TopPLogitsWarper: drops the low tokens whose cumulative mass (ascending) is <= 1 - top_p.
  if (params.top_p < 1.0) {
    auto [sorted, order] = x.sort(/*dim=*/1, /*descending=*/false);
    at::Tensor cum = sorted.softmax(1).cumsum(1);
    at::Tensor drop_sorted = cum <= (1.0 - params.top_p);
    drop_sorted.narrow(1, x.size(1) - 1, 1).fill_(false);  // keep at least the top token
    at::Tensor drop = drop_sorted.scatter(1, order, drop_sorted);
    x = x.masked_fill(drop, kNegInf);
  }
  // MinPLogitsWarper: drops tokens with prob < min_p * max prob (the top token always stays).
  if (params.min_p && *params.min_p > 0) {
    at::Tensor probs = x.softmax(1);
    at::Tensor top = std::get<0>(probs.max(1, /*keepdim=*/true));
    x = x.masked_fill(probs < top * *params.min_p, kNegInf);
  }
  return x;
}

at::Tensor FilteredProbs(const at::Tensor& logits, const at::Tensor& seen,
                         const SamplingParams& params) {
  return ProcessLogits(logits, seen, params).softmax(1);
}

at::Generator MakeRowGenerator(uint64_t seed, int64_t prompt_index, int64_t generation_index) {
  uint64_t h = SplitMix64(seed);
  h = SplitMix64(h ^ static_cast<uint64_t>(prompt_index));
  h = SplitMix64(h ^ static_cast<uint64_t>(generation_index));
  return at::detail::createCPUGenerator(h);
}

double NextUniform(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  const uint64_t r = gen.get<at::CPUGeneratorImpl>()->random64();
  return static_cast<double>(r >> 11) * 0x1.0p-53;
}

StatusOr<SampleOutput> Sample(const at::Tensor& logits, const at::Tensor& seen,
                              const SamplingParams& params, std::vector<at::Generator>& gens) {
  RETURN_IF_ERROR(ValidateLogits(logits, seen));
  const int64_t b = logits.size(0);
  if (params.greedy()) return SampleWithUniforms(logits, seen, params, at::Tensor());
  if (static_cast<int64_t>(gens.size()) != b) {
    return Status::InvalidArgument("sampler: " + std::to_string(gens.size()) + " generators for " +
                                   std::to_string(b) + " rows");
  }
  try {
    std::vector<double> u(b);
    for (int64_t i = 0; i < b; ++i) u[i] = NextUniform(gens[i]);
    return SampleWithUniforms(logits, seen, params, at::tensor(u, at::kDouble).to(logits.device()));
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("sampler: ") + e.what_without_backtrace());
  }
}

StatusOr<SampleOutput> SampleWithUniforms(const at::Tensor& logits, const at::Tensor& seen,
                                          const SamplingParams& params,
                                          const at::Tensor& uniforms) {
  RETURN_IF_ERROR(ValidateLogits(logits, seen));
  try {
    const int64_t b = logits.size(0), v = logits.size(1);
    if (!params.greedy() &&
        (!uniforms.defined() || uniforms.dim() != 1 || uniforms.size(0) != b ||
         uniforms.scalar_type() != at::kDouble || uniforms.device() != logits.device())) {
      return Status::InvalidArgument("sampler: uniforms must be [" + std::to_string(b) +
                                     "] float64 on the logits' device");
    }
    at::NoGradGuard no_grad;
    SampleOutput out;
    at::Tensor processed = ProcessLogits(logits, seen, params);
    if (params.greedy()) {
      out.tokens = processed.argmax(1);
    } else {
      at::Tensor cdf = processed.softmax(1).to(at::kDouble).cumsum(1);      // [B, V]
      at::Tensor target = uniforms.unsqueeze(1) * cdf.narrow(1, v - 1, 1);  // [B, 1]
      // First index with cdf > target: a token of zero probability is never chosen.
      out.tokens = at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true)
                       .squeeze(1)
                       .clamp_max(v - 1);
    }
    const double t = params.greedy() ? 1.0 : params.temperature;
    const at::Tensor x = logits.to(at::kFloat);
    at::Tensor logp = (t == 1.0 ? x : x / t).log_softmax(1);  // x / 1 is x: one op fewer a step
    out.logprobs = logp.gather(1, out.tokens.unsqueeze(1)).squeeze(1);
    return out;
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("sampler: ") + e.what_without_backtrace());
  }
}

}  // namespace grpo::rollout
