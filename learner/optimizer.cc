#include "learner/optimizer.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <numbers>
#include <sstream>

namespace grpo::learner {

AdamW::AdamW(common::NamedTensors params, AdamWOptions options)
    : params_(std::move(params)), options_(options) {
  for (const auto& [name, p] : params_) {
    exp_avg_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    exp_avg_sq_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
  }
}

void AdamWUpdate(at::Tensor& p, const at::Tensor& g, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                 const AdamWOptions& options, double lr, int64_t step) {
  at::NoGradGuard no_grad;
  const double bias1 = 1.0 - std::pow(options.beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(options.beta2, static_cast<double>(step));
  const double step_size = lr / bias1;
  const double bias2_sqrt = std::sqrt(bias2);
  if (options.weight_decay != 0.0) p.mul_(1.0 - lr * options.weight_decay);
  exp_avg.lerp_(g, 1.0 - options.beta1);
  exp_avg_sq.mul_(options.beta2).addcmul_(g, g, 1.0 - options.beta2);
  at::Tensor denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(options.eps);
  p.addcdiv_(exp_avg, denom, -step_size);
}

void AdamW::Step(double lr) {
  at::NoGradGuard no_grad;
  ++step_;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i].second;
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    AdamWUpdate(p, g, exp_avg_[i], exp_avg_sq_[i], options_, lr, step_);
  }
}

void AdamW::ZeroGrad() {
  at::NoGradGuard no_grad;
  for (auto& [name, p] : params_) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

common::NamedTensors NameAdamWState(const common::NamedTensors& params,
                                    const std::vector<at::Tensor>& exp_avg,
                                    const std::vector<at::Tensor>& exp_avg_sq, int64_t step) {
  common::NamedTensors out;
  for (size_t i = 0; i < params.size(); ++i) {
    out.emplace_back("exp_avg." + params[i].first, exp_avg[i]);
    out.emplace_back("exp_avg_sq." + params[i].first, exp_avg_sq[i]);
  }
  out.emplace_back("step", at::scalar_tensor(step, at::kLong));
  return out;
}

common::NamedTensors AdamW::StateDict() const {
  return NameAdamWState(params_, exp_avg_, exp_avg_sq_, step_);
}

StatusOr<AdamWStateView> MatchAdamWState(const common::NamedTensors& state,
                                         const common::NamedTensors& params) {
  auto find = [&](const std::string& name) -> const at::Tensor* {
    for (const auto& [n, t] : state) {
      if (n == name) return &t;
    }
    return nullptr;
  };
  const at::Tensor* step = find("step");
  if (step == nullptr || step->numel() != 1) {
    return Status::InvalidArgument("optimizer state: missing scalar 'step'");
  }
  AdamWStateView view;
  view.exp_avg.resize(params.size());
  view.exp_avg_sq.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    for (auto [prefix, dst] :
         {std::pair{"exp_avg.", &view.exp_avg}, std::pair{"exp_avg_sq.", &view.exp_avg_sq}}) {
      const std::string name = prefix + params[i].first;
      const at::Tensor* t = find(name);
      if (t == nullptr) return Status::InvalidArgument("optimizer state: missing '" + name + "'");
      if (t->sizes() != params[i].second.sizes()) {
        std::ostringstream m;
        m << "optimizer state: '" << name << "' has shape " << t->sizes() << ", expected "
          << params[i].second.sizes();
        return Status::InvalidArgument(m.str());
      }
      (*dst)[i] = t;
    }
  }
  view.step = step->item<int64_t>();
  return view;
}

Status AdamW::LoadStateDict(const common::NamedTensors& state) {
  ASSIGN_OR_RETURN(const AdamWStateView view, MatchAdamWState(state, params_));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    exp_avg_[i].copy_(*view.exp_avg[i]);
    exp_avg_sq_[i].copy_(*view.exp_avg_sq[i]);
  }
  step_ = view.step;
  return Status::OK();
}

double ClipGradNorm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const auto& p : params) {
    if (p.grad().defined()) norms.push_back(p.grad().detach().to(at::kDouble).norm(2));
  }
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm(2).item<double>();
  if (max_norm > 0) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0) {
      for (const auto& p : params) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
  }
  return total;
}

StatusOr<LrSchedule> ParseLrSchedule(std::string_view name) {
  if (name == "constant") return LrSchedule::kConstant;
  if (name == "linear") return LrSchedule::kLinear;
  if (name == "cosine") return LrSchedule::kCosine;
  return Status::InvalidArgument("lr_scheduler_type: unknown schedule '" + std::string(name) +
                                 "' (expected constant, linear or cosine)");
}

double LearningRateAt(LrSchedule schedule, double base_lr, int64_t step, int64_t warmup_steps,
                      int64_t total_steps) {
  if (step < warmup_steps) {
    return base_lr * static_cast<double>(step) /
           static_cast<double>(std::max<int64_t>(1, warmup_steps));
  }
  const double progress = static_cast<double>(step - warmup_steps) /
                          static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  switch (schedule) {
    case LrSchedule::kConstant:
      return base_lr;
    case LrSchedule::kLinear:
      return base_lr * std::max(0.0, 1.0 - progress);
    case LrSchedule::kCosine:
      return base_lr * std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
  }
  return base_lr;
}

}  // namespace grpo::learner
