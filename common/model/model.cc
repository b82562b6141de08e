#include "common/model/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>

#include "common/atomic_file.h"
#include "common/logging.h"

namespace grpo::common {
namespace {

namespace fs = std::filesystem;

bool IsNormWeight(const std::string& name) {
  return name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
}

bool IsBias(const std::string& name) {
  return name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
}

// Softmax-safe stand-in for -inf: a row whose keys are all blocked gets a uniform (finite)
// distribution instead of NaN.
double BlockedScore(at::ScalarType t) { return t == at::kHalf ? -65504.0 : -1e30; }

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> Model::ParameterShapes() const {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size, q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_key_value_heads * c.head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, d}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    s.push_back({p + "self_attn.q_proj.weight", {q, d}});
    if (c.attention_bias) s.push_back({p + "self_attn.q_proj.bias", {q}});
    s.push_back({p + "self_attn.k_proj.weight", {kv, d}});
    if (c.attention_bias) s.push_back({p + "self_attn.k_proj.bias", {kv}});
    s.push_back({p + "self_attn.v_proj.weight", {kv, d}});
    if (c.attention_bias) s.push_back({p + "self_attn.v_proj.bias", {kv}});
    s.push_back({p + "self_attn.o_proj.weight", {d, q}});
    if (c.o_proj_bias()) s.push_back({p + "self_attn.o_proj.bias", {d}});
    if (c.qk_norm) {
      s.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      s.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    s.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, d}});
    s.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, d}});
    s.push_back({p + "mlp.down_proj.weight", {d, c.intermediate_size}});
    s.push_back({p + "input_layernorm.weight", {d}});
    s.push_back({p + "post_attention_layernorm.weight", {d}});
  }
  s.push_back({"model.norm.weight", {d}});
  if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, d}});
  return s;
}

void Model::Bind(NamedTensors params) {
  params_ = std::move(params);
  std::unordered_map<std::string, at::Tensor> by_name;
  for (const auto& [name, t] : params_) by_name[name] = t;
  auto get = [&](const std::string& name) -> at::Tensor {
    auto it = by_name.find(name);
    return it == by_name.end() ? at::Tensor() : it->second;
  };
  embed_ = get("model.embed_tokens.weight");
  final_norm_ = get("model.norm.weight");
  lm_head_ = config_.tie_word_embeddings ? embed_ : get("lm_head.weight");
  layers_.clear();
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer l;
    l.input_norm = get(p + "input_layernorm.weight");
    l.q_w = get(p + "self_attn.q_proj.weight");
    l.q_b = get(p + "self_attn.q_proj.bias");
    l.k_w = get(p + "self_attn.k_proj.weight");
    l.k_b = get(p + "self_attn.k_proj.bias");
    l.v_w = get(p + "self_attn.v_proj.weight");
    l.v_b = get(p + "self_attn.v_proj.bias");
    l.o_w = get(p + "self_attn.o_proj.weight");
    l.o_b = get(p + "self_attn.o_proj.bias");
    l.q_norm = get(p + "self_attn.q_norm.weight");
    l.k_norm = get(p + "self_attn.k_norm.weight");
    l.post_norm = get(p + "post_attention_layernorm.weight");
    l.gate_w = get(p + "mlp.gate_proj.weight");
    l.up_w = get(p + "mlp.up_proj.weight");
    l.down_w = get(p + "mlp.down_proj.weight");
    layers_.push_back(std::move(l));
  }
  // As transformers' default RoPE: inv_freq = 1 / theta^(arange(0, hd, 2) / hd), in fp32.
  at::NoGradGuard no_grad;
  const int64_t hd = config_.head_dim;
  at::Tensor exponent = at::arange(0, hd, 2, at::kLong).to(at::kFloat) / static_cast<double>(hd);
  const at::Tensor inv_freq =
      at::reciprocal(at::pow(config_.rope_theta, exponent)).to(embed_.device());
  // RopeTables' per-column frequencies and signs, so a call is one product, cos and sin.
  rope_freq_ = at::cat({inv_freq, inv_freq});
  rope_sin_sign_ = at::cat(
      {at::full({hd / 2}, -1.0, inv_freq.options()), at::ones({hd / 2}, inv_freq.options())});
}

namespace {

Status CheckPlacement(const char* where, at::ScalarType dtype) {
  if (!at::isFloatingType(dtype)) {
    return Status::InvalidArgument(std::string(where) + ": dtype " + c10::toString(dtype) +
                                   " is not a floating type");
  }
  return Status::OK();
}

// Every tensor of `params` on device in dtype (copies when either changes, else shares).
NamedTensors Placed(const NamedTensors& params, const at::Device& device, at::ScalarType dtype,
                    bool force_copy) {
  NamedTensors out;
  out.reserve(params.size());
  for (const auto& [name, t] : params) {
    at::Tensor d = t.detach().to(device, dtype, /*non_blocking=*/false, /*copy=*/force_copy);
    out.emplace_back(name, d.is_contiguous() ? d : d.contiguous());
  }
  return out;
}

// Tensors of `params`' shapes on device in dtype that hold no memory (a deferred model's).
NamedTensors Unallocated(const NamedTensors& params, const at::Device& device,
                         at::ScalarType dtype) {
  NamedTensors out;
  out.reserve(params.size());
  const auto options = at::TensorOptions().device(device).dtype(dtype);
  for (const auto& [name, t] : params)
    out.emplace_back(name, UnallocatedTensor(t.sizes(), options));
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<Model>> Model::Copy(const at::Device& device, at::ScalarType dtype) const {
  RETURN_IF_ERROR(CheckPlacement("Model::Copy", dtype));
  try {
    at::NoGradGuard no_grad;
    std::unique_ptr<Model> m(new Model(config_));
    if (deferred_) {
      m->Bind(Unallocated(params_, device, dtype));
      m->deferred_ = deferred_;
      return m;
    }
    m->Bind(Placed(params_, device, dtype, /*force_copy=*/true));
    return m;
  } catch (const c10::Error& e) {
    return Status::Internal("Model::Copy: " + std::string(e.what_without_backtrace()));
  }
}

Status Model::To(const at::Device& device, at::ScalarType dtype) {
  RETURN_IF_ERROR(CheckPlacement("Model::To", dtype));
  if (device == this->device() && dtype == this->dtype()) return Status::OK();
  try {
    at::NoGradGuard no_grad;
    Bind(deferred_ ? Unallocated(params_, device, dtype)
                   : Placed(params_, device, dtype, /*force_copy=*/false));
    return Status::OK();
  } catch (const c10::Error& e) {
    return Status::Internal("Model::To: " + std::string(e.what_without_backtrace()));
  }
}

StatusOr<std::unique_ptr<Model>> Model::InitRandom(const ModelConfig& config, uint64_t seed,
                                                   const at::Device& device, at::ScalarType dtype) {
  RETURN_IF_ERROR(config.Validate("InitRandom config"));
  RETURN_IF_ERROR(CheckPlacement("Model::InitRandom", dtype));
  try {
    at::NoGradGuard no_grad;
    std::unique_ptr<Model> m(new Model(config));
    at::Generator gen = at::detail::createCPUGenerator(seed);
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    NamedTensors params;
    for (const auto& [name, shape] : m->ParameterShapes()) {
      at::Tensor t;
      if (IsNormWeight(name)) {
        t = at::ones(shape, opts);
      } else if (IsBias(name)) {
        t = at::zeros(shape, opts);
      } else {
        t = at::normal(0.0, 0.02, shape, gen, opts);
      }
      params.emplace_back(name, std::move(t));
    }
    m->Bind(std::move(params));
    RETURN_IF_ERROR(m->To(device, dtype));
    return m;
  } catch (const c10::Error& e) {
    return Status::Internal("Model::InitRandom: " + std::string(e.what_without_backtrace()));
  }
}

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir, const at::Device& device,
                                             at::ScalarType dtype) {
  ASSIGN_OR_RETURN(std::unique_ptr<Model> m, LoadDeferred(dir, device, dtype));
  RETURN_IF_ERROR(m->Materialize());
  return m;
}

StatusOr<std::unique_ptr<Model>> Model::LoadDeferred(const std::string& dir,
                                                     const at::Device& device,
                                                     at::ScalarType dtype) {
  RETURN_IF_ERROR(CheckPlacement("Model::Load", dtype));
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig((fs::path(dir) / "config.json").string()));
  std::unique_ptr<Model> m(new Model(config));
  const auto shapes = m->ParameterShapes();
  ASSIGN_OR_RETURN(m->deferred_,
                   ModelWeights::Open(dir, shapes, "config.json model_type " + config.model_type));
  try {
    at::NoGradGuard no_grad;
    NamedTensors params;
    const auto options = at::TensorOptions().device(device).dtype(dtype);
    for (const auto& [name, shape] : shapes) {
      params.emplace_back(name, UnallocatedTensor(shape, options));
    }
    m->Bind(std::move(params));
    return m;
  } catch (const c10::Error& e) {
    return Status::Internal(dir + ": " + std::string(e.what_without_backtrace()));
  }
}

Status Model::Materialize() {
  if (!deferred_) return Status::OK();
  NamedTensors params;
  params.reserve(params_.size());
  for (const auto& [name, p] : params_) {
    ASSIGN_OR_RETURN(at::Tensor t, deferred_->Read(name, p.device(), p.scalar_type()));
    params.emplace_back(name, std::move(t));
  }
  at::NoGradGuard no_grad;
  Bind(std::move(params));
  deferred_.reset();
  return Status::OK();
}

std::shared_ptr<const ModelWeights> Model::TakeDeferredWeights() { return std::move(deferred_); }

Status Model::Save(const std::string& dir, uint64_t max_shard_bytes) const {
  if (deferred_) {
    return Status::FailedPrecondition(dir + ": the model's weights are not read yet (they are in " +
                                      deferred_->dir() + ")");
  }
  return SaveWeights(dir, params_, max_shard_bytes);
}

Status Model::SaveWeights(const std::string& dir, const NamedTensors& weights,
                          uint64_t max_shard_bytes) const {
  if (weights.size() != params_.size()) {
    return Status::InvalidArgument(dir + ": " + std::to_string(weights.size()) +
                                   " tensors to save for " + std::to_string(params_.size()) +
                                   " parameters");
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weights[i].first != params_[i].first || !weights[i].second.defined() ||
        weights[i].second.sizes() != params_[i].second.sizes()) {
      return Status::InvalidArgument(dir + ": tensor " + std::to_string(i) + " to save is not '" +
                                     params_[i].first + "' of its shape");
    }
  }
  return SaveWeightsFrom(
      dir,
      [&weights](const WeightPut& put) {
        for (const auto& [name, t] : weights) RETURN_IF_ERROR(put(name, t));
        return Status::OK();
      },
      max_shard_bytes);
}

Status Model::SaveWeightsFrom(const std::string& dir,
                              const std::function<Status(const WeightPut& put)>& produce,
                              uint64_t max_shard_bytes) const {
  // fp32 whatever the model computes in (config.json says float32 below).
  std::vector<SafetensorSpec> specs;
  for (const auto& [name, p] : params_) specs.push_back({name, at::kFloat, p.sizes().vec()});
  ModelConfig c = config_;
  c.torch_dtype = "float32";
  std::unique_ptr<SafetensorsWriter> writer;
  Status ready = Status::OK();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) ready = Status::Internal(dir + ": cannot create directory: " + ec.message());
  if (ready.ok()) {
    ready =
        WriteFileAtomically((fs::path(dir) / "config.json").string(), c.ToJson().dump(2) + "\n");
  }
  if (ready.ok()) {
    auto made =
        SafetensorsWriter::CreateCheckpoint(dir, specs, max_shard_bytes, {{"format", "pt"}});
    if (made.ok()) {
      writer = std::move(made).value();
    } else {
      ready = made.status();
    }
  }
  const Status produced = produce([&](const std::string& name, const at::Tensor& value) {
    RETURN_IF_ERROR(ready);
    try {
      at::NoGradGuard no_grad;
      return writer->Write(name, value.detach().to(at::kCPU, at::kFloat).contiguous());
    } catch (const c10::Error& e) {
      return Status::Internal(dir + ": copying " + name + ": " + e.what_without_backtrace());
    }
  });
  RETURN_IF_ERROR(ready);
  RETURN_IF_ERROR(produced);
  return writer->Finish();
}

std::vector<at::Tensor> Model::Parameters() const {
  std::vector<at::Tensor> out;
  out.reserve(params_.size());
  for (const auto& [name, t] : params_) out.push_back(t);
  return out;
}

int64_t Model::NumParameters() const {
  int64_t n = 0;
  for (const auto& [name, t] : params_) n += t.numel();
  return n;
}

void Model::SetRequiresGrad(bool requires_grad) {
  for (auto& [name, t] : params_) t.set_requires_grad(requires_grad);
}

Status Model::LoadStateFrom(const NamedTensors& state) {
  std::unordered_map<std::string, const at::Tensor*> given;
  for (const auto& [name, t] : state) {
    if (!given.emplace(name, &t).second) {
      return Status::InvalidArgument("LoadStateFrom: tensor '" + name + "' given twice");
    }
  }
  for (const auto& [name, p] : params_) {
    auto it = given.find(name);
    if (it == given.end())
      return Status::InvalidArgument("LoadStateFrom: tensor '" + name + "' missing");
    const at::Tensor& t = *it->second;
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) {
      return Status::InvalidArgument("LoadStateFrom: tensor '" + name + "' is not a float tensor");
    }
    if (t.sizes() != p.sizes()) {
      return Status::InvalidArgument("LoadStateFrom: tensor '" + name + "': shape " +
                                     ShapeString(t.sizes()) + ", expected " +
                                     ShapeString(p.sizes()));
    }
  }
  if (given.size() != params_.size()) {
    std::map<std::string, bool> known;
    for (const auto& [name, p] : params_) known[name] = true;
    for (const auto& [name, t] : state) {
      if (!known.count(name)) {
        return Status::InvalidArgument("LoadStateFrom: unknown tensor '" + name + "'");
      }
    }
  }
  try {
    at::NoGradGuard no_grad;
    if (deferred_) {  // the values come from `state`, not the files: each parameter its memory
      for (auto& [name, p] : params_) p.set_data(at::empty(p.sizes(), p.options()));
      deferred_.reset();
    }
    for (auto& [name, p] : params_) p.copy_(*given.at(name));
  } catch (const c10::Error& e) {
    return Status::Internal("LoadStateFrom: " + std::string(e.what_without_backtrace()));
  }
  return Status::OK();
}

// ---------------------------------------------------------------------------------------------
// Forward.

at::Tensor Model::RmsNorm(const at::Tensor& x, const at::Tensor& w) const {
  // transformers' Qwen2RMSNorm / LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps)).
  if (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) {
    return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + config_.rms_norm_eps) * w;
  }
  // Half precision: the statistics and the scaling in fp32, then back (transformers' order).
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed =
      xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + config_.rms_norm_eps);
  return w * normed.to(x.scalar_type());
}

at::Tensor Model::ApplyRope(const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) const {
  // transformers' x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): the sign sits
  // in `sin` (Forward's signed sin, -sin on the first half), so x2 * -sin1 = -x2 * sin1 exactly.
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

at::Tensor Model::AttentionMask(const at::Tensor& blocked) const {
  const int64_t b = blocked.size(0), t = blocked.size(1), l = blocked.size(2);
  const at::Tensor rows = blocked.view({b, 1, 1, t, l});
  const at::ScalarType dtype = embed_.scalar_type();
  if (dtype == at::kHalf) return rows;
  return at::zeros(rows.sizes(), blocked.options().dtype(dtype))
      .masked_fill_(rows, BlockedScore(dtype));
}

at::Tensor Model::Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& mask) const {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), hd = q.size(3);
  const int64_t kv = k.size(1), l = k.size(2), g = h / kv;
  // Query head i uses key/value head i / g (transformers' repeat_kv), so group the g query heads
  // of one KV head along the rows of a single matmul instead of copying K and V g times.
  at::Tensor qg = (q * (1.0 / std::sqrt(static_cast<double>(hd)))).reshape({b, kv, g * t, hd});
  at::Tensor scores = at::matmul(qg, k.transpose(-2, -1));  // [B, KV, g*T, L]
  // Out of place: an in-place write into a view of the scores made autograd copy them whole in
  // backward (CopySlices). The add's backward is the incoming gradient as it is. A blocked
  // score becomes BlockedScore exactly, as masked_fill writes it: |score| is far below half an
  // ulp of 1e30, so the sum rounds to it.
  const at::Tensor grouped = scores.view({b, kv, g, t, l});
  scores = (mask.scalar_type() == at::kBool
                ? grouped.masked_fill(mask, BlockedScore(scores.scalar_type()))
                : grouped + mask)
               .view({b, kv, g * t, l});
  // Half precision: softmax in fp32 and back (transformers' eager attention); fp32 as is.
  at::Tensor probs = scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble
                         ? at::softmax(scores, -1)
                         : at::softmax(scores, -1, at::kFloat).to(scores.scalar_type());
  at::Tensor out = at::matmul(probs, v);  // [B, KV, g*T, hd]
  return out.view({b, h, t, hd}).transpose(1, 2).reshape({b, t, h * hd});
}

// ---------------------------------------------------------------------------------------------
// Per-layer gradient checkpointing.

const std::vector<at::Tensor Model::Layer::*>& Model::LayerFields() {
  static const std::vector<at::Tensor Layer::*> fields = {
      &Layer::input_norm, &Layer::q_w,       &Layer::q_b,    &Layer::k_w,  &Layer::k_b,
      &Layer::v_w,        &Layer::v_b,       &Layer::o_w,    &Layer::o_b,  &Layer::q_norm,
      &Layer::k_norm,     &Layer::post_norm, &Layer::gate_w, &Layer::up_w, &Layer::down_w};
  return fields;
}

// One decoder layer whose forward keeps no intermediates: backward recomputes the layer from its
// saved inputs under grad mode (on detached leaves) and differentiates that. The model and layer
// travel as integers because autograd's saved_data holds IValues; the Model outlives the graph
// (the trainer owns both). Inputs: the layer's `n_act` inputs that are not weights (RunLayer's),
// then its defined weights.
class CheckpointedLayerFunction : public torch::autograd::Function<CheckpointedLayerFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, int64_t model_address,
                                                int64_t layer, int64_t n_act) {
    const auto* model = reinterpret_cast<const Model*>(model_address);
    ctx->saved_data["model"] = model_address;
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["n_act"] = n_act;
    ctx->save_for_backward(inputs.vec());
    const size_t li = static_cast<size_t>(layer);
    return model->RunLayer(model->layers_[li], li, inputs.slice(0, n_act));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto* model = reinterpret_cast<const Model*>(ctx->saved_data["model"].toInt());
    const size_t li = static_cast<size_t>(ctx->saved_data["layer"].toInt());
    const int64_t n_act = ctx->saved_data["n_act"].toInt();
    const size_t streams = Model::LayerStreams(n_act);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    // Detached leaves for the recompute; their gradients are returned to autograd, which adds
    // them to the real inputs' .grad (nothing here touches the parameters' .grad directly).
    Model::Layer leaves = model->layers_[li];
    std::vector<at::Tensor> act(saved.begin(), saved.begin() + n_act);
    std::vector<at::Tensor> wrt;
    for (size_t i = 0; i < streams; ++i) {
      act[i] = saved[i].detach().requires_grad_(true);
      wrt.push_back(act[i]);
    }
    size_t next = static_cast<size_t>(n_act);
    for (auto field : Model::LayerFields()) {
      if (!(leaves.*field).defined()) continue;
      leaves.*field = saved[next++].detach().requires_grad_(true);
      wrt.push_back(leaves.*field);
    }
    torch::autograd::variable_list out;
    {
      at::AutoGradMode grad(true);
      out = model->RunLayer(leaves, li, act);
    }
    torch::autograd::variable_list grads =
        torch::autograd::grad(out, wrt, grad_outputs, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);
    // One entry per forward input: the streams, the other inputs, the weights, the integers.
    torch::autograd::variable_list result(grads.begin(), grads.begin() + streams);
    result.insert(result.end(), n_act - streams, at::Tensor());
    result.insert(result.end(), grads.begin() + streams, grads.end());
    result.insert(result.end(), 3, at::Tensor());
    return result;
  }
};

// A decoder layer or the final norm behind a parameter gate (parameter_gate.h): the forward
// acquires the unit, runs it and releases it; the backward acquires it again (once, also when
// it recomputes), differentiates the unit, hands the gradient of its parameters to the gate
// (TakeGradients) and releases it. With `keep` (no gradient checkpointing) the forward keeps
// the unit's autograd graph, whose saved tensors include the parameters themselves: their
// values are back once the backward's Acquire refilled them. Otherwise only the inputs are
// saved and the backward recomputes the unit, as CheckpointedLayerFunction does. Inputs: the
// unit's `n_act` inputs (RunUnit's).
class GatedUnitFunction : public torch::autograd::Function<GatedUnitFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, int64_t model_address,
                                                int64_t unit, bool keep, int64_t n_act) {
    const auto* model = reinterpret_cast<const Model*>(model_address);
    ctx->saved_data["model"] = model_address;
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["keep"] = keep;
    ctx->saved_data["n_act"] = n_act;
    const size_t streams = Model::LayerStreams(n_act);
    const int u = static_cast<int>(unit);
    model->gate_->Acquire(u);
    torch::autograd::variable_list out;
    if (keep) {
      at::AutoGradMode grad(true);
      std::vector<at::Tensor> act = inputs.vec(), leaves;
      for (size_t i = 0; i < streams; ++i) {
        act[i] = inputs[i].detach().requires_grad_(true);
        leaves.push_back(act[i]);
      }
      const std::vector<at::Tensor> inner = model->RunUnit(u, act);
      ctx->saved_data["x"] = leaves;
      ctx->saved_data["inner"] = inner;
      for (const at::Tensor& t : inner) out.push_back(t.detach());
    } else {
      ctx->save_for_backward(inputs.vec());
      out = model->RunUnit(u, inputs);
    }
    model->gate_->Release(u);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto* model = reinterpret_cast<const Model*>(ctx->saved_data["model"].toInt());
    const int u = static_cast<int>(ctx->saved_data["unit"].toInt());
    const int64_t n_act = ctx->saved_data["n_act"].toInt();
    const size_t streams = Model::LayerStreams(n_act);
    model->gate_->Acquire(u);
    std::vector<at::Tensor> wrt;
    std::vector<at::Tensor> out;
    if (ctx->saved_data["keep"].toBool()) {
      wrt = ctx->saved_data["x"].toTensorVector();
      out = ctx->saved_data["inner"].toTensorVector();
    } else {
      std::vector<at::Tensor> act = ctx->get_saved_variables();
      for (size_t i = 0; i < streams; ++i) {
        act[i] = act[i].detach().requires_grad_(true);
        wrt.push_back(act[i]);
      }
      at::AutoGradMode grad(true);
      out = model->RunUnit(u, act);
    }
    std::vector<size_t> params;  // indices in the unit's parameters of those differentiated
    const NamedTensors unit_params = model->UnitParameters(u);
    for (size_t i = 0; i < unit_params.size(); ++i) {
      if (!unit_params[i].second.requires_grad()) continue;
      params.push_back(i);
      wrt.push_back(unit_params[i].second);
    }
    torch::autograd::variable_list grads =
        torch::autograd::grad(out, wrt, grad_outputs, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);
    ctx->saved_data.erase("inner");
    std::vector<at::Tensor> unit_grads(unit_params.size());
    for (size_t k = 0; k < params.size(); ++k) unit_grads[params[k]] = grads[streams + k];
    model->gate_->TakeGradients(u, unit_grads);
    model->gate_->Release(u);
    // One entry per forward input: the streams, the other inputs, then the four scalars.
    torch::autograd::variable_list result(grads.begin(), grads.begin() + streams);
    result.insert(result.end(), n_act - streams + 4, at::Tensor());
    return result;
  }
};

std::vector<at::Tensor> Model::RunLayer(const Layer& L, size_t li, at::TensorList in) const {
  if (in.size() == kSingleInputs) return {LayerForward(L, li, in[0], in[1], in[2], in[3], nullptr)};
  TORCH_CHECK(in.size() == kSharedInputs, "RunLayer: ", in.size(), " inputs");
  PrefixKv kv;
  at::Tensor prefix = LayerForward(L, li, in[0], in[2], in[3], in[4], nullptr, &kv);
  kv.record = false;
  kv.rows = in[8];
  return {prefix, LayerForward(L, li, in[1], in[5], in[6], in[7], nullptr, &kv)};
}

std::vector<at::Tensor> Model::RunUnit(int unit, at::TensorList in) const {
  if (unit == NormUnit()) return {RmsNorm(in[0], final_norm_)};
  const size_t li = static_cast<size_t>(unit - 1);
  TORCH_CHECK(unit >= 1 && li < layers_.size(), "RunUnit: unit ", unit,
              " is not a decoder layer or the final norm");
  return RunLayer(layers_[li], li, in);
}

std::vector<at::Tensor> Model::LayerStep(size_t li, const std::vector<at::Tensor>& in,
                                         bool gradient_checkpointing) const {
  const int64_t self = reinterpret_cast<int64_t>(this);
  const int64_t n_act = static_cast<int64_t>(in.size());
  const bool grad = at::GradMode::is_enabled();
  if (gate_ != nullptr) {
    const int u = LayerUnit(static_cast<int64_t>(li));
    if (grad) {
      return GatedUnitFunction::apply(at::TensorList(in), self, static_cast<int64_t>(u),
                                      !gradient_checkpointing, n_act);
    }
    gate_->Acquire(u);
    std::vector<at::Tensor> out = RunUnit(u, in);
    gate_->Release(u);
    return out;
  }
  if (gradient_checkpointing && grad) {
    std::vector<at::Tensor> inputs = in;
    for (auto field : LayerFields()) {
      if ((layers_[li].*field).defined()) inputs.push_back(layers_[li].*field);
    }
    return CheckpointedLayerFunction::apply(at::TensorList(inputs), self, static_cast<int64_t>(li),
                                            n_act);
  }
  return RunLayer(layers_[li], li, in);
}

at::Tensor Model::NormStep(const at::Tensor& x, bool gradient_checkpointing) const {
  if (gate_ == nullptr) return RmsNorm(x, final_norm_);
  const int u = NormUnit();
  if (at::GradMode::is_enabled()) {
    return GatedUnitFunction::apply(at::TensorList({x}), reinterpret_cast<int64_t>(this),
                                    static_cast<int64_t>(u), !gradient_checkpointing, 1)[0];
  }
  gate_->Acquire(u);
  at::Tensor out = RunUnit(u, {x})[0];
  gate_->Release(u);
  return out;
}

at::Tensor Model::Embed(const at::Tensor& ids) const {
  if (gate_ == nullptr) return at::embedding(embed_, ids);
  gate_->Acquire(0);
  at::Tensor x = at::embedding(embed_, ids);  // [B, T, D]; its backward needs no weights
  gate_->Release(0);
  return x;
}

at::Tensor Model::LayerForward(const Layer& L, size_t li, const at::Tensor& x_in,
                               const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                               KvCache* cache, PrefixKv* prefix) const {
  const ModelConfig& c = config_;
  const int64_t b = x_in.size(0), t = x_in.size(1);
  const int64_t h = c.num_attention_heads, kv = c.num_key_value_heads, hd = c.head_dim;
  at::Tensor a = RmsNorm(x_in, L.input_norm);
  at::Tensor q = at::linear(a, L.q_w, L.q_b).view({b, t, h, hd});
  at::Tensor k = at::linear(a, L.k_w, L.k_b).view({b, t, kv, hd});
  at::Tensor v = at::linear(a, L.v_w, L.v_b).view({b, t, kv, hd});
  if (c.qk_norm) {
    q = RmsNorm(q, L.q_norm);
    k = RmsNorm(k, L.k_norm);
  }
  q = ApplyRope(q, cos, sin).transpose(1, 2);  // [B, H, T, hd]
  k = ApplyRope(k, cos, sin).transpose(1, 2);  // [B, KV, T, hd]
  v = v.transpose(1, 2);
  if (cache != nullptr) {
    cache->keys[li].narrow(2, cache->length, t).copy_(k);
    cache->values[li].narrow(2, cache->length, t).copy_(v);
    k = cache->keys[li].narrow(2, 0, mask.size(-1));  // Extend's width
    v = cache->values[li].narrow(2, 0, mask.size(-1));
  } else if (prefix != nullptr && prefix->record) {
    prefix->keys = k;
    prefix->values = v;
  } else if (prefix != nullptr) {
    k = at::cat({prefix->keys.index_select(0, prefix->rows), k}, 2);
    v = at::cat({prefix->values.index_select(0, prefix->rows), v}, 2);
  }
  at::Tensor x = x_in + at::linear(Attend(q, k, v, mask), L.o_w, L.o_b);
  at::Tensor m = RmsNorm(x, L.post_norm);
  return x + at::linear(at::silu(at::linear(m, L.gate_w)) * at::linear(m, L.up_w), L.down_w);
}

std::pair<at::Tensor, at::Tensor> Model::RopeTables(const at::Tensor& positions) const {
  // transformers' emb = cat(freqs, freqs): the product with inv_freq twice over gives the same
  // values in the same places, in one op instead of three.
  const at::Tensor emb = (positions.to(rope_freq_.scalar_type()).unsqueeze(-1) * rope_freq_)
                             .unsqueeze(2);  // [B,T,1,hd]
  at::Tensor cos = emb.cos().to(embed_.scalar_type());
  // ApplyRope's signed sin: the first half negated (exactly: a product by -1, before the
  // rounding to the model's dtype, which is symmetric), once here instead of -x twice a layer,
  // forward and backward.
  at::Tensor sin = (emb.sin() * rope_sin_sign_).to(embed_.scalar_type());
  return {cos, sin};
}

at::Tensor Model::Forward(const at::Tensor& ids, const at::Tensor& positions,
                          const at::Tensor& blocked, KvCache* cache,
                          bool gradient_checkpointing) const {
  TORCH_CHECK(!deferred_, "the model's weights are not read yet (Model::LoadDeferred)");
  const auto [cos, sin] = RopeTables(positions);
  const at::Tensor mask = AttentionMask(blocked);  // once for every layer
  TORCH_CHECK(gate_ == nullptr || cache == nullptr,
              "a model behind a parameter gate runs no KV-cache forward");
  at::Tensor x = Embed(ids);  // [B, T, D]
  for (size_t li = 0; li < layers_.size(); ++li) {
    x = cache != nullptr ? LayerForward(layers_[li], li, x, cos, sin, mask, cache)
                         : LayerStep(li, {x, cos, sin, mask}, gradient_checkpointing)[0];
  }
  return NormStep(x, gradient_checkpointing);
}

at::Tensor Model::ForwardHidden(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                bool gradient_checkpointing) const {
  TORCH_CHECK(input_ids.dim() == 2, "ForwardHidden: input_ids must be [B, T], got ",
              input_ids.sizes());
  TORCH_CHECK(input_ids.scalar_type() == at::kLong, "ForwardHidden: input_ids must be int64");
  TORCH_CHECK(input_ids.device() == device(), "ForwardHidden: input_ids are on ",
              input_ids.device(), " but the model is on ", device());
  TORCH_CHECK(attention_mask.sizes() == input_ids.sizes(), "ForwardHidden: attention_mask ",
              attention_mask.sizes(), " does not match input_ids ", input_ids.sizes());
  const auto [positions, blocked] =
      RowPositionsAndBlocked(attention_mask.to(input_ids.device(), at::kLong));
  return Forward(input_ids, positions, blocked, nullptr, gradient_checkpointing);
}

std::pair<at::Tensor, at::Tensor> Model::RowPositionsAndBlocked(const at::Tensor& mask) {
  const int64_t t = mask.size(1);
  at::Tensor positions = (mask.cumsum(1) - 1).clamp_min(0);  // [B, T]
  at::Tensor blocked =
      LaterColumns(t, 0, mask.options()).unsqueeze(0) | (mask == 0).unsqueeze(1);  // [B, T, T]
  return {positions, blocked};
}

at::Tensor Model::LaterColumns(int64_t t, int64_t past, const at::TensorOptions& options,
                               int64_t width) {
  return at::ones({t, std::max(width, past + t)}, options.dtype(at::kBool)).triu(past + 1);
}

int64_t Model::AttendedColumns(int64_t total, int64_t capacity) const {
  const at::ScalarType dt = dtype();
  if (!device().is_cpu() || dt == at::kFloat || dt == at::kDouble) return total;
  const int64_t rounded =
      (total + kAttendColumnsBucket - 1) / kAttendColumnsBucket * kAttendColumnsBucket;
  return std::max(total, std::min(rounded, capacity));
}

at::Tensor Model::LmHeadWeight() const {
  if (gate_ != nullptr) gate_->Acquire(LmHeadUnit());
  return lm_head_;
}

at::Tensor Model::Logits(const at::Tensor& hidden) const {
  return at::linear(hidden, LmHeadWeight());
}

int Model::NumUnits() const { return NormUnit() + (config_.tie_word_embeddings ? 1 : 2); }

NamedTensors Model::UnitParameters(int unit) const {
  NamedTensors out;
  for (const auto& [name, t] : params_) {
    int u = 0;
    if (name == "model.norm.weight") {
      u = NormUnit();
    } else if (name == "lm_head.weight") {
      u = LmHeadUnit();
    } else if (name.rfind("model.layers.", 0) == 0) {
      u = LayerUnit(std::stoll(name.substr(13)));
    }
    if (u == unit) out.emplace_back(name, t);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// KV cache.

KvCache Model::NewCache(int64_t batch, int64_t capacity) const {
  TORCH_CHECK(batch >= 0 && capacity > 0, "NewCache: bad batch ", batch, " / capacity ", capacity);
  at::NoGradGuard no_grad;
  KvCache cache;
  const auto opts = embed_.options().requires_grad(false);
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    cache.keys.push_back(
        at::zeros({batch, config_.num_key_value_heads, capacity, config_.head_dim}, opts));
    cache.values.push_back(
        at::zeros({batch, config_.num_key_value_heads, capacity, config_.head_dim}, opts));
  }
  cache.key_mask = at::zeros({batch, capacity}, opts.dtype(at::kBool));
  cache.next_position = at::zeros({batch}, opts.dtype(at::kLong));
  cache.length = 0;
  cache.capacity = capacity;
  return cache;
}

at::Tensor Model::Extend(const at::Tensor& ids, const at::Tensor& mask, KvCache& cache) const {
  const int64_t b = ids.size(0), t = ids.size(1);
  TORCH_CHECK(b == cache.batch(), "KV cache has ", cache.batch(), " rows, input has ", b);
  TORCH_CHECK(cache.length + t <= cache.capacity, "KV cache capacity ", cache.capacity,
              " exceeded (length ", cache.length, " + ", t, ")");
  const int64_t len = cache.length, total = len + t;
  at::Tensor m = mask.to(ids.device(), at::kBool);
  const at::Tensor counted = t == 1 ? m.to(at::kLong) : m.to(at::kLong).cumsum(1);  // [B, T]
  at::Tensor positions = (cache.next_position.unsqueeze(1) + counted - 1).clamp_min(0);
  cache.key_mask.narrow(1, len, t).copy_(m);
  // A key is blocked where it is padding, after its query's column, or past `total` (the
  // columns AttendedColumns adds, whatever they hold); a single query (a decode step) sits at
  // the last filled column, so only padding and those columns block it.
  const int64_t width = AttendedColumns(total, cache.capacity);
  at::Tensor blocked = cache.key_mask.narrow(1, 0, width).logical_not();  // [B, W], a copy
  if (width > total) blocked.narrow(1, total, width - total).fill_(true);
  blocked = blocked.unsqueeze(1);  // [B, 1, W]
  if (t > 1) {
    blocked = LaterColumns(t, len, ids.options(), width).unsqueeze(0) | blocked;  // [B, T, W]
  }
  at::Tensor hidden = Forward(ids, positions, blocked, &cache);
  cache.length = total;
  cache.next_position += m.sum(1);
  return hidden;
}

at::Tensor Model::Prefill(const at::Tensor& ids, const at::Tensor& mask, KvCache& cache) const {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) > 0, "Prefill: ids must be [B, T>0], got ",
              ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "Prefill: ids must be int64");
  TORCH_CHECK(mask.sizes() == ids.sizes(), "Prefill: mask ", mask.sizes(), " does not match ids ",
              ids.sizes());
  at::NoGradGuard no_grad;
  at::Tensor hidden = Extend(ids, mask, cache);
  return Logits(hidden.select(1, ids.size(1) - 1));
}

KvCache Model::ExpandCache(const KvCache& cache, int64_t g) const {
  TORCH_CHECK(g >= 1, "ExpandCache: g must be >= 1, got ", g);
  at::NoGradGuard no_grad;
  at::Tensor rows = at::arange(cache.batch(), cache.next_position.options()).repeat_interleave(g);
  KvCache out;
  for (const auto& k : cache.keys) out.keys.push_back(k.index_select(0, rows));
  for (const auto& v : cache.values) out.values.push_back(v.index_select(0, rows));
  out.key_mask = cache.key_mask.index_select(0, rows);
  out.next_position = cache.next_position.index_select(0, rows);
  out.length = cache.length;
  out.capacity = cache.capacity;
  return out;
}

at::Tensor Model::DecodeStep(const at::Tensor& ids, KvCache& cache,
                             const at::Tensor& row_active) const {
  TORCH_CHECK(ids.dim() == 1, "DecodeStep: ids must be [B], got ", ids.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong, "DecodeStep: ids must be int64");
  at::NoGradGuard no_grad;
  at::Tensor mask;
  if (row_active.defined()) {
    TORCH_CHECK(row_active.dim() == 1 && row_active.size(0) == ids.size(0),
                "DecodeStep: row_active must be [B], got ", row_active.sizes());
    mask = row_active.to(ids.device(), at::kBool).unsqueeze(1);
  } else {
    mask = at::ones({ids.size(0), 1}, ids.options().dtype(at::kBool));
  }
  at::Tensor hidden = Extend(ids.unsqueeze(1), mask, cache);  // [B, 1, D]
  return Logits(hidden.squeeze(1));
}

Status Model::KeepRows(KvCache& cache, const at::Tensor& row_indices) const {
  try {
    if (!row_indices.defined() || row_indices.dim() != 1) {
      return Status::InvalidArgument("KeepRows: row_indices must be a 1-D tensor");
    }
    if (at::isFloatingType(row_indices.scalar_type()) || row_indices.scalar_type() == at::kBool) {
      return Status::InvalidArgument("KeepRows: row_indices must be integers");
    }
    at::NoGradGuard no_grad;
    at::Tensor rows = row_indices.to(cache.next_position.device(), at::kLong);
    if (rows.numel() > 0) {
      const int64_t lo = rows.min().item<int64_t>(), hi = rows.max().item<int64_t>();
      if (lo < 0 || hi >= cache.batch()) {
        return Status::InvalidArgument("KeepRows: row index out of range [0, " +
                                       std::to_string(cache.batch()) +
                                       "): " + std::to_string(lo < 0 ? lo : hi));
      }
    }
    for (auto& k : cache.keys) k = k.index_select(0, rows);
    for (auto& v : cache.values) v = v.index_select(0, rows);
    cache.key_mask = cache.key_mask.index_select(0, rows);
    cache.next_position = cache.next_position.index_select(0, rows);
    return Status::OK();
  } catch (const c10::Error& e) {
    return Status::Internal("KeepRows: " + std::string(e.what_without_backtrace()));
  }
}

KvCache Model::CompactRow(const KvCache& cache, int64_t row, int64_t num_tokens) const {
  TORCH_CHECK(row >= 0 && row < cache.batch(), "CompactRow: row ", row, " outside [0, ",
              cache.batch(), ")");
  TORCH_CHECK(num_tokens >= 0, "CompactRow: num_tokens ", num_tokens, " < 0");
  at::NoGradGuard no_grad;
  // Real columns of the row among the filled ones, in order: [num_tokens] int64.
  at::Tensor cols = cache.key_mask[row].narrow(0, 0, cache.length).nonzero().squeeze(1);
  TORCH_CHECK(cols.size(0) >= num_tokens, "CompactRow: row ", row, " holds ", cols.size(0),
              " tokens, ", num_tokens, " asked");
  cols = cols.narrow(0, 0, num_tokens);
  KvCache out;
  for (const auto& k : cache.keys) out.keys.push_back(k.narrow(0, row, 1).index_select(2, cols));
  for (const auto& v : cache.values) {
    out.values.push_back(v.narrow(0, row, 1).index_select(2, cols));
  }
  out.key_mask = at::ones({1, num_tokens}, cache.key_mask.options());
  out.next_position = at::full({1}, num_tokens, cache.next_position.options());
  out.length = num_tokens;
  out.capacity = num_tokens;
  return out;
}

KvCache Model::StackRows(const std::vector<const KvCache*>& rows,
                         const std::vector<int64_t>& num_tokens, int64_t capacity) const {
  TORCH_CHECK(rows.size() == num_tokens.size(), "StackRows: ", rows.size(), " rows, ",
              num_tokens.size(), " token counts");
  const int64_t b = static_cast<int64_t>(rows.size());
  int64_t len = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = num_tokens[i];
    TORCH_CHECK(n >= 0, "StackRows: row ", i, ": num_tokens ", n, " < 0");
    if (n == 0) continue;
    TORCH_CHECK(rows[i] != nullptr && rows[i]->batch() == 1 && rows[i]->length >= n,
                "StackRows: row ", i, " does not hold ", n, " tokens in one row");
    len = std::max(len, n);
  }
  TORCH_CHECK(capacity >= len && capacity > 0, "StackRows: capacity ", capacity, " < ", len);
  at::NoGradGuard no_grad;
  KvCache out = NewCache(b, capacity);
  std::vector<int64_t> next(b, 0);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = num_tokens[i];
    if (n == 0) continue;
    for (size_t li = 0; li < out.keys.size(); ++li) {
      out.keys[li][i].narrow(1, len - n, n).copy_(rows[i]->keys[li][0].narrow(1, 0, n));
      out.values[li][i].narrow(1, len - n, n).copy_(rows[i]->values[li][0].narrow(1, 0, n));
    }
    out.key_mask[i].narrow(0, len - n, n).fill_(true);
    next[i] = n;
  }
  out.next_position.copy_(at::tensor(next, at::kLong));
  out.length = len;
  return out;
}

}  // namespace grpo::common
