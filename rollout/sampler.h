// Token sampling for rollout workers: Hugging Face's default logits pipeline (repetition
// penalty, then the warpers temperature, top_k, top_p, min_p) with one random stream per row.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "common/config.h"
#include "common/status.h"

namespace grpo::rollout {

// TRL GRPOConfig names and semantics.
struct SamplingParams {
  double temperature = 1.0;         // 0 = greedy (argmax of the penalised logits)
  int64_t top_k = 0;                // 0 = off
  double top_p = 1.0;               // 1 = off
  std::optional<double> min_p;      // unset = off
  double repetition_penalty = 1.0;  // 1 = off

  static SamplingParams FromConfig(const common::GrpoConfig& config);
  // InvalidArgument naming the key: temperature < 0, top_k < 0, top_p not in [0, 1],
  // min_p not in [0, 1], repetition_penalty <= 0, or a non-finite value.
  Status Validate() const;
  bool greedy() const { return temperature == 0.0; }
  bool uses_penalty() const { return repetition_penalty != 1.0; }
};

// The logits the sampler draws from, as transformers computes them: repetition penalty on the
// tokens in `seen` (logit / p if logit > 0 else logit * p), / temperature (skipped when greedy),
// top_k, top_p, min_p (each keeps at least one token). Removed tokens are -inf.
// logits [B, V] floating; seen [B, V] bool (may be undefined when the penalty is off).
// Returns [B, V] float32. TORCH_CHECKs shapes.
at::Tensor ProcessLogits(const at::Tensor& logits, const at::Tensor& seen,
                         const SamplingParams& params);

// softmax(ProcessLogits(...)): the distribution a token is drawn from. [B, V] float32.
at::Tensor FilteredProbs(const at::Tensor& logits, const at::Tensor& seen,
                         const SamplingParams& params);

// A CPU generator whose seed mixes (seed, prompt_index, generation_index) (SplitMix64), so a
// row's random stream does not depend on the other rows of the batch.
at::Generator MakeRowGenerator(uint64_t seed, int64_t prompt_index, int64_t generation_index);

// One uniform double in [0, 1) from `gen` (53 random bits; advances the generator).
double NextUniform(at::Generator& gen);

struct SampleOutput {
  at::Tensor tokens;  // [B] int64, on the logits' device
  // [B] float32: log_softmax(logits / T)[token] of the raw model logits, i.e. of the
  // UNFILTERED, unpenalised distribution (T = 1 when greedy). This is the quantity the learner
  // recomputes, so on-policy importance ratios are exactly 1; it is not the log-probability of
  // the filtered distribution the token was actually drawn from.
  at::Tensor logprobs;
};

// Draws one token per row: row b uses gens[b] (one uniform per call, inverse CDF over the
// filtered distribution). Greedy draws nothing. logits [B, V]; seen [B, V] bool or undefined.
// InvalidArgument on bad shapes or gens.size() != B; Internal on a libtorch error.
StatusOr<SampleOutput> Sample(const at::Tensor& logits, const at::Tensor& seen,
                              const SamplingParams& params, std::vector<at::Generator>& gens);

// The same draw with the uniforms given: uniforms [B] float64 on the logits' device, row b's
// value being what NextUniform(gens[b]) would return (undefined when greedy). Lets a caller on
// a GPU draw several steps' uniforms at once and copy them in one transfer (no host sync per
// token). InvalidArgument on bad shapes or a missing uniforms tensor when not greedy.
StatusOr<SampleOutput> SampleWithUniforms(const at::Tensor& logits, const at::Tensor& seen,
                                          const SamplingParams& params, const at::Tensor& uniforms);

}  // namespace grpo::rollout
