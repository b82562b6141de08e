#include "learner/chunked_logprobs.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>

namespace grpo::learner {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::ScalarType ComputeType(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Tempered logits of one chunk, upcast: [c, V].
at::Tensor ChunkLogits(const at::Tensor& h, const at::Tensor& weight, at::ScalarType dt,
                       double temperature) {
  at::Tensor z = at::matmul(h, weight.t()).to(dt);
  if (temperature != 1.0) z.div_(temperature);
  return z;
}

// Rows per block for the temporaries of the fused path and of the entropy gradient (a
// [kRowBlock, V] tensor at a time).
constexpr int64_t kRowBlock = 64;

// lp [c, V] = log p, in place -> -p (g + g_H (log p + H)): dL/dz of g logp + g_H H without the
// onehot(label) g term, by row blocks so that the temporary stays small. g, g_H, H: [c, 1].
void EntropyAndLogpGrad(at::Tensor& lp, const at::Tensor& g, const at::Tensor& g_entropy,
                        const at::Tensor& entropy) {
  const int64_t c = lp.size(0);
  for (int64_t r = 0; r < c; r += kRowBlock) {
    const int64_t k = std::min(kRowBlock, c - r);
    at::Tensor b = lp.narrow(0, r, k);
    const at::Tensor t =
        (b + entropy.narrow(0, r, k)).mul_(g_entropy.narrow(0, r, k)).add_(g.narrow(0, r, k));
    b.exp_().mul_(t).neg_();
  }
}

// Saves hidden, weight, labels and the per-token logsumexp; nothing of size V.
class ChunkedLogprobsFunction : public torch::autograd::Function<ChunkedLogprobsFunction> {
 public:
  // hidden [N, D], weight [V, D], labels [N] int64. Returns {logp [N]} or {logp, entropy}.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const at::Tensor& weight, const at::Tensor& labels,
                               int64_t chunk_tokens, double temperature, bool with_entropy) {
    const int64_t n = hidden.size(0);
    const at::ScalarType dt = ComputeType(hidden);
    const auto opts = hidden.options().dtype(dt);
    at::Tensor logp = at::empty({n}, opts);
    at::Tensor lse = at::empty({n}, opts);
    at::Tensor entropy = with_entropy ? at::empty({n}, opts) : at::Tensor();
    for (int64_t s = 0; s < n; s += chunk_tokens) {
      const int64_t c = std::min(chunk_tokens, n - s);
      const at::Tensor z = ChunkLogits(hidden.narrow(0, s, c), weight, dt, temperature);  // [c, V]
      const at::Tensor l = at::logsumexp(z, {1});                                         // [c]
      const at::Tensor picked = z.gather(1, labels.narrow(0, s, c).unsqueeze(1)).squeeze(1);
      logp.narrow(0, s, c).copy_(picked - l);
      lse.narrow(0, s, c).copy_(l);
      if (with_entropy) {
        // H = lse - sum_v softmax(z)_v * z_v
        const at::Tensor p = at::exp(z - l.unsqueeze(1));
        entropy.narrow(0, s, c).copy_(l - (p * z).sum(1));
      }
    }
    ctx->save_for_backward({hidden, weight, labels, lse});
    ctx->saved_data["chunk_tokens"] = chunk_tokens;
    ctx->saved_data["temperature"] = temperature;
    if (with_entropy) {
      ctx->saved_data["entropy"] = entropy.detach();  // dH/dz needs H
      return {logp, entropy};
    }
    return {logp};
  }

  // dlogp/dz = onehot(label) - softmax(z), dH/dz = -softmax(z) (log softmax(z) + H),
  // z = logits / temperature.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& labels = saved[2];
    const at::Tensor& lse = saved[3];
    const int64_t chunk_tokens = ctx->saved_data["chunk_tokens"].toInt();
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const int64_t n = hidden.size(0);
    const at::ScalarType dt = ComputeType(hidden);
    const bool need_hidden = ctx->needs_input_grad(0);
    const bool need_weight = ctx->needs_input_grad(1);

    at::Tensor grad_hidden, grad_weight;
    // [N] each; undefined when that output was unused
    const at::Tensor& g = grad_outputs[0];
    const at::Tensor g_entropy = grad_outputs.size() > 1 ? grad_outputs[1] : at::Tensor();
    if ((g.defined() || g_entropy.defined()) && (need_hidden || need_weight)) {
      const auto opts = hidden.options().dtype(dt);
      const at::Tensor gs = (g.defined() ? g.to(dt) : at::zeros({n}, opts)) / temperature;
      const at::Tensor ghs = g_entropy.defined() ? g_entropy.to(dt) / temperature : at::Tensor();
      const at::Tensor entropy =
          ghs.defined() ? ctx->saved_data["entropy"].toTensor().to(dt) : at::Tensor();
      if (need_hidden) grad_hidden = at::empty_like(hidden);
      if (need_weight) grad_weight = at::zeros(weight.sizes(), weight.options().dtype(dt));
      for (int64_t s = 0; s < n; s += chunk_tokens) {
        const int64_t c = std::min(chunk_tokens, n - s);
        const at::Tensor h = hidden.narrow(0, s, c);
        at::Tensor dz = ChunkLogits(h, weight, dt, temperature);  // [c, V], becomes dL/dz
        const at::Tensor gc = gs.narrow(0, s, c).unsqueeze(1);    // [c, 1]
        dz.sub_(lse.narrow(0, s, c).unsqueeze(1));                // log p
        if (ghs.defined()) {
          EntropyAndLogpGrad(dz, gc, ghs.narrow(0, s, c).unsqueeze(1),
                             entropy.narrow(0, s, c).unsqueeze(1));
        } else {
          dz.exp_().mul_(-gc);
        }
        dz.scatter_add_(1, labels.narrow(0, s, c).unsqueeze(1), gc);
        if (need_hidden)
          grad_hidden.narrow(0, s, c).copy_(at::matmul(dz.to(weight.scalar_type()), weight));
        if (need_weight) grad_weight.addmm_(dz.t(), h.to(dt));
      }
      if (need_weight) grad_weight = grad_weight.to(weight.scalar_type());
    }
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Logits, log-probs and the loss gradient in one pass per chunk (see FusedTokenLogprobsLoss).
class FusedLogprobsLossFunction : public torch::autograd::Function<FusedLogprobsLossFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const at::Tensor& weight, const at::Tensor& labels,
                               const TokenLossGrad* token_grad, int64_t chunk_tokens,
                               double temperature, bool with_entropy,
                               const at::Tensor* entropy_grad) {
    const int64_t n = hidden.size(0);
    const at::ScalarType dt = ComputeType(hidden);
    const auto opts = hidden.options().dtype(dt);
    // A pointer, not a tensor argument: autograd records every tensor argument (and this one may
    // be undefined).
    const at::Tensor ghs = entropy_grad != nullptr && entropy_grad->defined()
                               ? entropy_grad->to(dt) / temperature
                               : at::Tensor();
    at::Tensor logp = at::empty({n}, opts);
    at::Tensor entropy = with_entropy ? at::empty({n}, opts) : at::Tensor();
    at::Tensor grad_hidden = at::empty_like(hidden);
    at::Tensor grad_weight = at::zeros(weight.sizes(), weight.options().dtype(dt));
    for (int64_t s = 0; s < n; s += chunk_tokens) {
      const int64_t c = std::min(chunk_tokens, n - s);
      const at::Tensor h = hidden.narrow(0, s, c);
      const at::Tensor lab = labels.narrow(0, s, c).unsqueeze(1);
      // One [c, V] buffer, transformed in place: logits -> log-softmax -> softmax -> dL/dz;
      // row blocks keep the temporaries of the exp-sums and the entropy small.
      at::Tensor z = ChunkLogits(h, weight, dt, temperature);        // [c, V]
      const at::Tensor m = std::get<0>(z.max(1, /*keepdim=*/true));  // [c, 1]
      z.sub_(m);
      at::Tensor sum_exp = at::empty({c, 1}, opts);
      for (int64_t r = 0; r < c; r += kRowBlock) {
        const int64_t k = std::min(kRowBlock, c - r);
        sum_exp.narrow(0, r, k).copy_(z.narrow(0, r, k).exp().sum(1, /*keepdim=*/true));
      }
      z.sub_(sum_exp.log());  // log p
      const at::Tensor lp = z.gather(1, lab).squeeze(1);
      logp.narrow(0, s, c).copy_(lp);
      if (with_entropy) {
        for (int64_t r = 0; r < c; r += kRowBlock) {
          const int64_t k = std::min(kRowBlock, c - r);
          const at::Tensor lpb = z.narrow(0, r, k);
          // H = -sum_v p_v log p_v, the dot products as one batched matmul
          entropy.narrow(0, s + r, k)
              .copy_(-at::bmm(lpb.exp().view({k, 1, -1}), lpb.view({k, -1, 1})).view({k}));
        }
      }
      at::Tensor g = (*token_grad)(s, lp);
      TORCH_CHECK(g.defined() && g.dim() == 1 && g.size(0) == c,
                  "fused log-probs: the token gradient of chunk ", s, " must be [", c, "]");
      const at::Tensor gs = (g.to(dt) / temperature).unsqueeze(1);  // [c, 1]
      // dL/dz = (g (onehot(label) - p) - g_H p (log p + H)) / temperature
      at::Tensor dz = z;
      if (ghs.defined()) {
        EntropyAndLogpGrad(dz, gs, ghs.narrow(0, s, c).unsqueeze(1),
                           entropy.narrow(0, s, c).unsqueeze(1));
      } else {
        dz.exp_().mul_(-gs);
      }
      dz.scatter_add_(1, lab, gs);
      grad_hidden.narrow(0, s, c).copy_(at::matmul(dz.to(weight.scalar_type()), weight));
      grad_weight.addmm_(dz.t(), h.to(dt));
    }
    ctx->save_for_backward({grad_hidden, grad_weight.to(weight.scalar_type())});
    ctx->mark_non_differentiable(with_entropy ? variable_list{logp, entropy} : variable_list{logp});
    at::Tensor anchor = at::zeros({}, opts);
    if (with_entropy) return {anchor, logp, entropy};
    return {anchor, logp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& g = grad_outputs[0];  // scalar
    at::Tensor grad_hidden, grad_weight;
    if (g.defined()) {
      if (ctx->needs_input_grad(0)) grad_hidden = saved[0] * g.to(saved[0].scalar_type());
      if (ctx->needs_input_grad(1)) grad_weight = saved[1] * g.to(saved[1].scalar_type());
    }
    return {grad_hidden,  grad_weight,  at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct Flat {
  at::Tensor hidden;  // [N, D]
  at::Tensor labels;  // [N] int64
};

Flat CheckAndFlatten(const at::Tensor& hidden, const at::Tensor& lm_weight,
                     const at::Tensor& labels, double temperature) {
  TORCH_CHECK(hidden.defined() && (hidden.dim() == 2 || hidden.dim() == 3),
              "token logprobs: hidden must be [N, D] or [B, T, D]");
  TORCH_CHECK(lm_weight.defined() && lm_weight.dim() == 2,
              "token logprobs: lm_weight must be [V, D]");
  TORCH_CHECK(at::isFloatingType(hidden.scalar_type()), "token logprobs: hidden must be floating");
  TORCH_CHECK(hidden.scalar_type() == lm_weight.scalar_type(), "token logprobs: hidden is ",
              hidden.scalar_type(), " but lm_weight is ", lm_weight.scalar_type());
  TORCH_CHECK(hidden.device() == lm_weight.device() && hidden.device() == labels.device(),
              "token logprobs: hidden, lm_weight and labels must be on one device");
  const int64_t d = hidden.size(-1);
  TORCH_CHECK(lm_weight.size(1) == d, "token logprobs: hidden has D = ", d, " but lm_weight is ",
              lm_weight.sizes());
  const auto lead = hidden.sizes().slice(0, hidden.dim() - 1);
  TORCH_CHECK(labels.defined() && labels.sizes() == lead, "token logprobs: labels must be ", lead,
              ", got ", labels.sizes());
  TORCH_CHECK(at::isIntegralType(labels.scalar_type(), /*includeBool=*/false),
              "token logprobs: labels must be integer");
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0,
              "token logprobs: temperature must be > 0, got ", temperature);
  Flat f{hidden.reshape({-1, d}), labels.reshape({-1}).to(at::kLong)};
  if (f.labels.numel() > 0) {
    const at::Tensor range = at::stack({f.labels.min(), f.labels.max()}).cpu();
    const int64_t lo = range[0].item<int64_t>(), hi = range[1].item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < lm_weight.size(0), "token logprobs: labels must be in [0, ",
                lm_weight.size(0), "), got [", lo, ", ", hi, "]");
  }
  return f;
}

}  // namespace

at::Tensor ChunkedTokenLogprobs(const at::Tensor& hidden, const at::Tensor& lm_weight,
                                const at::Tensor& labels, int64_t chunk_tokens, double temperature,
                                at::Tensor* entropy_out) {
  TORCH_CHECK(chunk_tokens >= 1, "token logprobs: chunk_tokens must be >= 1, got ", chunk_tokens);
  const Flat f = CheckAndFlatten(hidden, lm_weight, labels, temperature);
  const bool with_entropy = entropy_out != nullptr;
  const variable_list out = ChunkedLogprobsFunction::apply(f.hidden, lm_weight, f.labels,
                                                           chunk_tokens, temperature, with_entropy);
  if (with_entropy) *entropy_out = out[1].reshape(labels.sizes());
  return out[0].reshape(labels.sizes());
}

at::Tensor FusedTokenLogprobsLoss(const at::Tensor& hidden, const at::Tensor& lm_weight,
                                  const at::Tensor& labels, const TokenLossGrad& token_grad,
                                  at::Tensor* logp_out, int64_t chunk_tokens, double temperature,
                                  at::Tensor* entropy_out, const at::Tensor& entropy_grad) {
  TORCH_CHECK(chunk_tokens >= 1, "token logprobs: chunk_tokens must be >= 1, got ", chunk_tokens);
  TORCH_CHECK(logp_out != nullptr, "fused log-probs: logp_out is required");
  TORCH_CHECK(static_cast<bool>(token_grad), "fused log-probs: no token gradient function");
  const Flat f = CheckAndFlatten(hidden, lm_weight, labels, temperature);
  const bool with_entropy = entropy_out != nullptr;
  TORCH_CHECK(!entropy_grad.defined() || with_entropy,
              "fused log-probs: entropy_grad needs entropy_out");
  TORCH_CHECK(!entropy_grad.defined() || entropy_grad.sizes() == labels.sizes(),
              "fused log-probs: entropy_grad must be shaped like labels ", labels.sizes(), ", got ",
              entropy_grad.sizes());
  const at::Tensor flat_entropy_grad =
      entropy_grad.defined() ? entropy_grad.reshape({-1}).detach() : at::Tensor();
  const variable_list out =
      FusedLogprobsLossFunction::apply(f.hidden, lm_weight, f.labels, &token_grad, chunk_tokens,
                                       temperature, with_entropy, &flat_entropy_grad);
  *logp_out = out[1].reshape(labels.sizes());
  if (with_entropy) *entropy_out = out[2].reshape(labels.sizes());
  return out[0];
}

at::Tensor NaiveTokenLogprobs(const at::Tensor& hidden, const at::Tensor& lm_weight,
                              const at::Tensor& labels, double temperature,
                              at::Tensor* entropy_out) {
  const Flat f = CheckAndFlatten(hidden, lm_weight, labels, temperature);
  const at::Tensor logits =
      at::matmul(f.hidden, lm_weight.t()).to(ComputeType(hidden)) / temperature;  // [N, V]
  const at::Tensor logsm = at::log_softmax(logits, -1);                           // [N, V]
  if (entropy_out != nullptr) {
    *entropy_out = -(at::exp(logsm) * logsm).sum(-1).reshape(labels.sizes());
  }
  return logsm.gather(1, f.labels.unsqueeze(1)).squeeze(1).reshape(labels.sizes());
}

}  // namespace grpo::learner
