// Memory-flat per-token log-probs from hidden states (docs/GRPO_SPEC.md "Memory contract").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>

namespace grpo::learner {

// Default token chunk. Peak extra memory ~ 2 * chunk * V * 4 bytes (0.6 GB of float32 logits
// per copy at V = 152k).
inline constexpr int64_t kDefaultLogprobChunkTokens = 1024;

// log softmax(hidden @ lm_weight^T / temperature)[label] per token, never holding more than
// [chunk_tokens, V] logits. hidden: [N, D] or [B, T, D]; lm_weight: [V, D] (may be the tied
// embedding: gradients from both uses add up); labels: [N] or [B, T] int64 in [0, V).
// Returns [N] or [B, T], float64 when hidden is float64, else float32 (logits are upcast per
// chunk). Differentiable wrt hidden and lm_weight (once: no double backward); backward
// recomputes each chunk's logits from the saved hidden, weight, labels and per-token logsumexp;
// it holds one [V, D] float32 (float64) accumulator for lm_weight's gradient.
// entropy_out, when given, receives the entropy of the tempered distribution per token (same
// shape), computed from the same chunk, differentiable too (dH/dz_v = -p_v (log p_v + H), the
// entropy bonus's gradient; backward recomputes it from the saved entropies).
// Throws c10::Error (TORCH_CHECK) naming the problem on bad shapes, dtypes, devices, labels
// out of range, chunk_tokens < 1 or a non-positive temperature.
at::Tensor ChunkedTokenLogprobs(const at::Tensor& hidden, const at::Tensor& lm_weight,
                                const at::Tensor& labels,
                                int64_t chunk_tokens = kDefaultLogprobChunkTokens,
                                double temperature = 1.0, at::Tensor* entropy_out = nullptr);

// dL/dlogp for the `c` tokens [start, start + c) of the flat token order, given their log-probs
// logp_chunk [c] (detached). It may depend on those tokens' values only: the loss must be a sum
// of per-token terms (GRPO with token-level importance sampling is; sequence-level is not).
using TokenLossGrad = std::function<at::Tensor(int64_t start, const at::Tensor& logp_chunk)>;

// The fused LM head + loss path: the log-probs of ChunkedTokenLogprobs and, in the same pass
// over each chunk's logits, the gradient of the loss wrt hidden and lm_weight, from the per-token
// gradient `token_grad` gives for that chunk. No logits are recomputed in backward (3 matmuls
// per chunk instead of 4: forward, d hidden, d weight), and still never more than one chunk of
// [chunk_tokens, V] logits. Returns a scalar 0 whose backward (gradient s) adds s times those
// gradients into hidden and lm_weight; *logp_out (and *entropy_out when given) receive the
// per-token log-probs (entropies) shaped like labels, without gradient. Until that backward
// runs it holds one [V, D] and one [N, D] gradient buffer. entropy_grad, when defined (shaped
// like labels; needs entropy_out), is dL/dH per token of a loss term linear in the entropies
// (the entropy bonus), added to the same gradient. Same checks as ChunkedTokenLogprobs; throws
// c10::Error when token_grad returns a tensor that is not [c].
at::Tensor FusedTokenLogprobsLoss(const at::Tensor& hidden, const at::Tensor& lm_weight,
                                  const at::Tensor& labels, const TokenLossGrad& token_grad,
                                  at::Tensor* logp_out,
                                  int64_t chunk_tokens = kDefaultLogprobChunkTokens,
                                  double temperature = 1.0, at::Tensor* entropy_out = nullptr,
                                  const at::Tensor& entropy_grad = at::Tensor());

// The same numbers the naive way (TRL's original get_per_token_logps: full [N, V] logits,
// log_softmax, gather); differentiable through ordinary autograd (the entropies too). For tests
// and benchmarks.
at::Tensor NaiveTokenLogprobs(const at::Tensor& hidden, const at::Tensor& lm_weight,
                              const at::Tensor& labels, double temperature = 1.0,
                              at::Tensor* entropy_out = nullptr);

}  // namespace grpo::learner
