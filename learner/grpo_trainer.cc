#include "learner/grpo_trainer.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "common/model/device.h"
#include "common/model/safetensors.h"
#include "learner/advantages.h"
#include "learner/chunked_logprobs.h"
#include "learner/distributed/state_shards.h"
#include "learner/shared_prompts.h"

namespace grpo::learner {

using common::RolloutGroup;

int64_t PeakResidentBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream ss(line.substr(6));
      int64_t kib = 0;
      ss >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

nlohmann::json StepMetrics::ToJson() const {
  nlohmann::json j;
  j["step"] = step;
  j["policy_version"] = policy_version;
  j["iteration"] = iteration;
  j["loss"] = loss;
  j["grad_norm"] = grad_norm;
  j["learning_rate"] = learning_rate;
  j["reward"] = reward;
  j["reward_std"] = reward_std;
  j["frac_reward_zero_std"] = frac_reward_zero_std;
  for (size_t k = 0; k < reward_names.size(); ++k) {
    auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
    j["rewards/" + reward_names[k] + "/mean"] = num(reward_fn_mean[k]);
    j["rewards/" + reward_names[k] + "/std"] = num(reward_fn_std[k]);
  }
  j["completions/mean_length"] = completions_mean_length;
  j["completions/clipped_ratio"] = completions_clipped_ratio;
  j["entropy"] = entropy;
  switch (objective_metric) {  // what TRL 1.16 logs for the loss type
    case loss::ObjectiveMetric::kClipRatios:
      j["clip_ratio/low_mean"] = clip_ratio_low;
      j["clip_ratio/high_mean"] = clip_ratio_high;
      j["clip_ratio/region_mean"] = clip_ratio_region;
      break;
    case loss::ObjectiveMetric::kCispoClipRatio:
      j["cispo_clip_ratio"] = clip_ratio_high;
      break;
    case loss::ObjectiveMetric::kVespoPhi:
      j["vespo/phi_seq_mean"] = vespo_phi_mean;
      break;
    case loss::ObjectiveMetric::kNone:
      break;
  }
  if (has_kl) j["kl"] = kl;
  if (has_entropy_coef) j["entropy_coef"] = entropy_coef;
  if (has_is_ratio) {
    j["is_ratio/mean"] = is_ratio_mean;
    j["is_ratio/max"] = is_ratio_max;
  }
  if (has_tools) {
    j["tools/call_frequency"] = tool_call_frequency;
    j["tools/failure_frequency"] = tool_failure_frequency;
  }
  if (has_logprob_mismatch) {
    j["logprob_mismatch/mean"] = logprob_mismatch_mean;
    j["logprob_mismatch/max"] = logprob_mismatch_max;
  }
  j["staleness"] = staleness_mean;
  j["sequences"] = sequences;
  j["completion_tokens"] = completion_tokens;
  j["step_seconds"] = step_seconds;
  j["tokens_per_second"] = tokens_per_second;
  j["peak_memory_bytes"] = peak_memory_bytes;
  j["micro_batches"] = micro_batches;
  return j;
}

// The sequences of a generation batch, flattened in group order.
struct GrpoTrainer::Batch {
  std::vector<const std::vector<int32_t>*> prompts;
  std::vector<const common::Completion*> completions;
  std::vector<int64_t> staleness;
  at::Tensor advantages;          // [N] float32
  at::Tensor rewards;             // [N] float64
  at::Tensor rewards_per_func;    // [N, K] float64, NaN = null
  std::vector<int64_t> versions;  // [N] the policy version each sequence was generated with
  std::vector<const std::string*> incarnations;  // [N] the learner that published it
  bool has_beh = false;
  at::Tensor old;  // [N, Cmax] or undefined (on-policy, one iteration)
  at::Tensor ref;  // [N, Cmax] or undefined (beta == 0)

  int64_t size() const { return static_cast<int64_t>(completions.size()); }
};

// The rows of an open step for its batch dump, copied out of their generation batches (a step
// may span batches, and a batch's groups live only as long as its TrainGenerationBatch call),
// in stream order: a row per sequence, a tensor per micro-batch.
struct GrpoTrainer::StepDump {
  std::vector<std::vector<int32_t>> prompts;    // [S]
  std::vector<common::Completion> completions;  // [S]
  std::vector<int64_t> versions, incarnations;  // [S] policy version, policy incarnation bits
  std::vector<at::Tensor> rewards;              // [b] float64
  std::vector<at::Tensor> rewards_per_func;     // [b, K] float64
  std::vector<at::Tensor> advantages;           // [b] float32
  std::vector<at::Tensor> old;                  // [b, Cmax] or undefined (old = logp there)
  std::vector<at::Tensor> ref;                  // [b, Cmax] or undefined (beta == 0)
  std::vector<at::Tensor> logp;                 // [b, C] as the micro-batch trained on them
};

// An optimizer step whose micro-batches have been back-propagated (their gradient is in the
// parameters' .grad) but not yet stepped: it may span generation batches.
struct GrpoTrainer::OpenStep {
  int64_t micro = 0;  // micro-batches accumulated
  std::chrono::steady_clock::time_point start;
  StepMetrics sm;  // iteration, sequences, completion_tokens, reward metrics so far
  GrpoLossMetrics lm;
  double step_completion_tokens = 0;  // dapo's normaliser (the loss mask's tokens)
  // The entropy bonus of this step: its coefficient (the controller's, fixed for the step, as
  // TRL) and LossNormaliser::entropy_bonus_scale (kStepTokens: the step's tokens, known when
  // the step starts because such a step never spans generation batches with the bonus on).
  double bonus_coef = 0.0, bonus_scale = 1.0;
  double clipped = 0, staleness_sum = 0, entropy_mean_sum = 0;
  double mismatch_sum = 0, mismatch_max = 0, mismatch_tokens = 0;
  int64_t all_tokens = 0;
  StepDump dump;  // with dumps on
};

GrpoTrainer::~GrpoTrainer() = default;

namespace {

// Inputs of sequences [begin, end): prompts left-padded to P, completions right-padded to C.
struct MicroBatch {
  at::Tensor ids;             // [b, P + C] int64
  at::Tensor attention_mask;  // [b, P + C] int64
  at::Tensor labels;          // [b, C] int64 (0 at padding)
  // [b, C] float32: the real completion tokens (0 at padding, and on truncated rows under
  // mask_truncated_completions): TRL's completion_mask.
  at::Tensor completion_mask;
  // [b, C] float32 (1 at padding) when a row has an env_mask (TRL's tool_mask); else undefined.
  at::Tensor env_mask;
  // [b, C] float32: the tokens trained on, completion_mask * env_mask (completion_mask itself
  // when env_mask is undefined). GrpoLossInputs::mask.
  at::Tensor loss_mask;
  at::Tensor beh;  // [b, C] float32 or undefined
  int64_t prompt_len = 0, completion_len = 0;
  SharedPrompts shared;  // the rows' distinct prompts, when some rows share one
};

}  // namespace

static MicroBatch MakeMicroBatch(const std::vector<const std::vector<int32_t>*>& prompts,
                                 const std::vector<const common::Completion*>& completions,
                                 int64_t begin, int64_t end, bool with_beh, bool mask_truncated) {
  MicroBatch mb;
  const int64_t b = end - begin;
  for (int64_t i = begin; i < end; ++i) {
    mb.prompt_len = std::max<int64_t>(mb.prompt_len, prompts[i]->size());
    mb.completion_len = std::max<int64_t>(mb.completion_len, completions[i]->token_ids.size());
  }
  const int64_t P = mb.prompt_len, C = mb.completion_len, T = P + C;
  std::vector<int64_t> ids(b * T, 0), attn(b * T, 0), labels(b * C, 0);
  std::vector<float> cmask(b * C, 0.f), beh(with_beh ? b * C : 0, 0.f);
  const bool with_env =
      std::any_of(completions.begin() + begin, completions.begin() + end,
                  [](const common::Completion* c) { return !c->env_mask.empty(); });
  std::vector<float> env(with_env ? b * C : 0, 1.f);
  for (int64_t r = 0; r < b; ++r) {
    const auto& p = *prompts[begin + r];
    const auto& c = *completions[begin + r];
    const int64_t off = P - static_cast<int64_t>(p.size());
    for (size_t t = 0; t < p.size(); ++t) {
      ids[r * T + off + t] = p[t];
      attn[r * T + off + t] = 1;
    }
    const bool masked_out = mask_truncated && c.truncated;
    for (size_t t = 0; t < c.token_ids.size(); ++t) {
      ids[r * T + P + t] = c.token_ids[t];
      attn[r * T + P + t] = 1;
      labels[r * C + t] = c.token_ids[t];
      cmask[r * C + t] = masked_out ? 0.f : 1.f;
      if (with_beh) beh[r * C + t] = c.logprobs[t];
    }
    for (size_t t = 0; t < c.env_mask.size(); ++t) env[r * C + t] = c.env_mask[t];
  }
  auto i64 = at::TensorOptions().dtype(at::kLong);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  mb.ids = at::from_blob(ids.data(), {b, T}, i64).clone();
  mb.attention_mask = at::from_blob(attn.data(), {b, T}, i64).clone();
  mb.labels = at::from_blob(labels.data(), {b, C}, i64).clone();
  mb.completion_mask = at::from_blob(cmask.data(), {b, C}, f32).clone();
  if (with_beh) mb.beh = at::from_blob(beh.data(), {b, C}, f32).clone();
  if (with_env) mb.env_mask = at::from_blob(env.data(), {b, C}, f32).clone();
  mb.loss_mask = with_env ? mb.completion_mask * mb.env_mask : mb.completion_mask;
  mb.shared = GroupPrompts(prompts, begin, end, P);
  return mb;
}

// The same micro-batch on `device` (no copy on the CPU).
static MicroBatch OnDevice(MicroBatch mb, const at::Device& device) {
  if (device.is_cpu()) return mb;
  mb.ids = mb.ids.to(device);
  mb.attention_mask = mb.attention_mask.to(device);
  mb.labels = mb.labels.to(device);
  mb.completion_mask = mb.completion_mask.to(device);
  if (mb.env_mask.defined()) mb.env_mask = mb.env_mask.to(device);
  mb.loss_mask = mb.env_mask.defined() ? mb.loss_mask.to(device) : mb.completion_mask;
  if (mb.beh.defined()) mb.beh = mb.beh.to(device);
  if (mb.shared.ids.defined()) {
    mb.shared.ids = mb.shared.ids.to(device);
    mb.shared.mask = mb.shared.mask.to(device);
    mb.shared.rows = mb.shared.rows.to(device);
  }
  return mb;
}

static double SamplingTemperature(const common::GrpoConfig& config) {
  return config.temperature > 0 ? config.temperature : 1.0;
}

// The hidden states that predict the completion tokens of `mb`: [b, C, D] (position P - 1 + t
// predicts completion token t). Rows that share a prompt (a group's) have it computed once
// (Model::ForwardSharedPrefix). Gradient checkpointing only matters with grad mode on (the
// policy's step).
static at::Tensor CompletionHidden(const common::Model& model, const MicroBatch& mb,
                                   const common::GrpoConfig& config) {
  if (mb.shared.ids.defined()) {
    return model.ForwardSharedPrefix(mb.shared.ids, mb.shared.mask, mb.shared.rows, mb.labels,
                                     mb.attention_mask.narrow(1, mb.prompt_len, mb.completion_len),
                                     config.gradient_checkpointing);
  }
  const at::Tensor hidden =
      model.ForwardHidden(mb.ids, mb.attention_mask, config.gradient_checkpointing);
  return hidden.narrow(1, mb.prompt_len - 1, mb.completion_len);
}

// Per-token log-probs of the completion tokens of `mb`: [b, C] (+ entropy when asked).
static at::Tensor CompletionLogprobs(const common::Model& model, const MicroBatch& mb,
                                     const common::GrpoConfig& config, at::Tensor* entropy) {
  const at::Tensor h = CompletionHidden(model, mb, config);
  return ChunkedTokenLogprobs(h, model.LmHeadWeight(), mb.labels, config.logprob_chunk_tokens,
                              SamplingTemperature(config), entropy);
}

// Back-propagates `loss` into the parameters' .grad, or with `grad_of` into `grads` (the
// gradients of grad_of's tensors, in order; undefined where one is unused) and no .grad.
static void Backward(const at::Tensor& loss, const std::vector<at::Tensor>* grad_of,
                     std::vector<at::Tensor>* grads) {
  if (grad_of == nullptr) {
    loss.backward();
    return;
  }
  *grads = torch::autograd::grad({loss}, *grad_of, /*grad_outputs=*/{}, /*retain_graph=*/false,
                                 /*create_graph=*/false, /*allow_unused=*/true);
}

// The fused path for losses that are sums of per-token terms (token-level importance sampling):
// log-probs, entropy and the loss gradient of the LM head in one pass over each chunk of
// logits (FusedTokenLogprobsLoss with GrpoTokenLossGrad), so backward recomputes no logits.
// Returns the micro-batch's loss output (value and metrics) after running its backward.
static StatusOr<GrpoLossOutput> FusedMicroBatchBackward(
    const common::Model& model, const MicroBatch& mb, const common::GrpoConfig& config,
    const GrpoLossConfig& loss_config, const LossNormaliser& norm, GrpoLossInputs in,
    at::Tensor* logp, at::Tensor* entropy, const std::vector<at::Tensor>* grad_of,
    std::vector<at::Tensor>* grads) {
  const at::Tensor h = CompletionHidden(model, mb, config);
  Status grad_status;
  ASSIGN_OR_RETURN(const TokenLossGrad token_grad,
                   GrpoTokenLossGrad(loss_config, in, norm, &grad_status));
  // The entropy bonus is linear in each token's entropy: its dL/dH joins the chunk's gradient.
  const at::Tensor entropy_grad =
      loss_config.entropy_coef != 0.0
          ? loss::EntropyBonusTokenGrad(mb.loss_mask, loss_config.entropy_coef, norm)
          : at::Tensor();
  at::Tensor anchor = FusedTokenLogprobsLoss(h, model.LmHeadWeight(), mb.labels, token_grad, logp,
                                             config.logprob_chunk_tokens,
                                             SamplingTemperature(config), entropy, entropy_grad);
  RETURN_IF_ERROR(grad_status);
  // Without gradient: the value and the metrics (the bonus's value too).
  in.logp = *logp;
  if (entropy_grad.defined()) in.entropy = *entropy;
  ASSIGN_OR_RETURN(GrpoLossOutput out, ComputeGrpoLoss(loss_config, in, norm));
  Backward(anchor, grad_of, grads);
  return out;
}

struct GrpoTrainer::MicroResult {
  Status status;
  MicroBatch mb;
  GrpoLossInputs in;
  GrpoLossOutput out;
  at::Tensor logp, entropy;
  std::vector<at::Tensor> grads;  // computed apart: grad_params_'s gradients
};

void GrpoTrainer::ComputeMicroBatch(const Batch& batch, int64_t b0, int64_t b1,
                                    const GrpoLossConfig& loss_config, const LossNormaliser& norm,
                                    bool apart, MicroResult* r) const {
  const common::Model& compute = compute_model();
  const at::Device device = compute.device();
  r->mb = OnDevice(MakeMicroBatch(batch.prompts, batch.completions, b0, b1, batch.has_beh,
                                  config_.mask_truncated_completions),
                   device);
  const MicroBatch& mb = r->mb;
  const int64_t C = mb.labels.size(1);
  GrpoLossInputs& in = r->in;
  in.mask = mb.loss_mask;
  in.advantages = batch.advantages.narrow(0, b0, b1 - b0).to(device);
  if (batch.old.defined()) in.old = batch.old.narrow(0, b0, b1 - b0).narrow(1, 0, C).to(device);
  if (batch.ref.defined()) in.ref = batch.ref.narrow(0, b0, b1 - b0).narrow(1, 0, C).to(device);
  if (batch.has_beh) in.beh = mb.beh;
  const std::vector<at::Tensor>* grad_of = apart ? &grad_params_ : nullptr;
  if (TokenSeparable(loss_config, in.old.defined())) {
    StatusOr<GrpoLossOutput> out = FusedMicroBatchBackward(
        compute, mb, config_, loss_config, norm, in, &r->logp, &r->entropy, grad_of, &r->grads);
    if (!out.ok()) {
      r->status = out.status();
      return;
    }
    r->out = *std::move(out);
  } else {  // the loss couples a sequence's tokens (grpo_loss.h): autograd through them
    r->logp = CompletionLogprobs(compute, mb, config_, &r->entropy);
    in.logp = r->logp;
    in.entropy = r->entropy;
    StatusOr<GrpoLossOutput> out = ComputeGrpoLoss(loss_config, in, norm);
    if (!out.ok()) {
      r->status = out.status();
      return;
    }
    r->out = *std::move(out);
    Backward(r->out.loss, grad_of, &r->grads);
  }
}

void GrpoTrainer::AddGradients(const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  // torch::autograd::grad returns one tensor per grad_params_ entry (Backward's grad_of).
  TORCH_CHECK(grads.size() == grad_params_.size(), "AddGradients: ", grads.size(),
              " gradients for ", grad_params_.size(), " parameters");
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    at::Tensor p = grad_params_[i];
    // What autograd's AccumulateGrad does with a micro-batch's gradient after the one before.
    if (p.grad().defined()) {
      p.mutable_grad().add_(grads[i]);
    } else {
      p.mutable_grad() = grads[i];
    }
  }
}

GrpoTrainer::GrpoTrainer(common::GrpoConfig config, GrpoLossConfig loss_config,
                         common::Model* policy, std::unique_ptr<common::Model> reference)
    : config_(std::move(config)),
      loss_config_(loss_config),
      policy_(policy),
      reference_(std::move(reference)) {}

StatusOr<std::unique_ptr<GrpoTrainer>> GrpoTrainer::Create(const common::GrpoConfig& config,
                                                           common::Model* policy,
                                                           std::unique_ptr<common::Model> reference,
                                                           distributed::Collectives* ranks,
                                                           std::optional<at::Device> device) {
  RETURN_IF_ERROR(config.Validate());
  if (policy == nullptr) return Status::InvalidArgument("GrpoTrainer: no policy model");
  ASSIGN_OR_RETURN(common::FsdpSpec fsdp, common::ParseFsdp(config.fsdp));
  fsdp.prefetch = config.fsdp_prefetch;
  if (config.beta != 0 && reference == nullptr) {
    return Status::InvalidArgument("config key 'beta' is " + std::to_string(config.beta) +
                                   ": a reference model is required");
  }
  if (config.beta == 0 && reference != nullptr) {
    return Status::InvalidArgument("beta is 0: no reference model may be built");
  }
  GrpoLossConfig lc;
  ASSIGN_OR_RETURN(lc.loss_type, ParseLossType(config.loss_type));
  ASSIGN_OR_RETURN(lc.importance_sampling_level,
                   ParseImportanceSamplingLevel(config.importance_sampling_level));
  ASSIGN_OR_RETURN(lc.importance_sampling_correction,
                   ParseImportanceSamplingCorrection(config.importance_sampling_correction));
  lc.epsilon = config.epsilon;
  lc.epsilon_high = config.epsilon_high;
  lc.delta = config.delta;
  lc.beta = config.beta;
  lc.importance_sampling_cap = config.importance_sampling_cap;
  lc.importance_sampling_min = config.importance_sampling_min;
  lc.max_completion_length = config.max_completion_length;
  lc.use_bias_correction_kl = config.use_bias_correction_kl;
  lc.off_policy_mask_threshold = config.off_policy_mask_threshold;
  lc.top_entropy_quantile = config.top_entropy_quantile;
  lc.sapo_temperature_pos = config.sapo_temperature_pos;
  lc.sapo_temperature_neg = config.sapo_temperature_neg;
  lc.vespo_k_pos = config.vespo_k_pos;
  lc.vespo_lambda_pos = config.vespo_lambda_pos;
  lc.vespo_k_neg = config.vespo_k_neg;
  lc.vespo_lambda_neg = config.vespo_lambda_neg;
  RETURN_IF_ERROR(lc.Validate());
  ASSIGN_OR_RETURN(LrSchedule schedule, ParseLrSchedule(config.lr_scheduler_type));

  if (config.bf16 && policy->dtype() != at::kFloat) {
    return Status::InvalidArgument(std::string("config key 'bf16' needs fp32 master weights, but "
                                               "the policy is ") +
                                   c10::toString(policy->dtype()));
  }
  const at::ScalarType compute_dtype = common::ComputeDtype(config.bf16);
  at::Device where = device.value_or(policy->device());
  // A deferred model (Model::LoadDeferred) is read a shard a rank where full_shard's gate fills
  // the policy's parameters, and whole here otherwise; so is the reference, which is then
  // sharded too (FrozenShards).
  const int world = ranks != nullptr ? ranks->world_size() : 1;
  const bool gates = GatesParameters(fsdp, world, where);
  // no_shard / shard_grad_op offload on a GPU: the policy is the fp32 master and stays on the
  // host (moved there if it was loaded on the device); a compute copy on the device runs.
  const bool host_master = HostsMaster(fsdp, where);
  // shard_grad_op beside a compute copy: a deferred policy's master is read a chunk a rank
  // (ShardedAdamW) and its copy whole in the compute dtype (below).
  const bool master_chunks = ShardsMasterBesideCopy(fsdp, world, config.bf16, where);
  if (!host_master) where = policy->device();  // everything runs where the policy is
  if (policy->deferred() && !gates && !master_chunks) {
    RETURN_IF_ERROR(policy->Materialize().WithContext("policy"));
  }
  if (host_master) RETURN_IF_ERROR(policy->To(at::kCPU, policy->dtype()).WithContext("policy"));
  if (reference) {
    if (!gates) RETURN_IF_ERROR(reference->Materialize().WithContext("reference model"));
    RETURN_IF_ERROR(reference->To(where, compute_dtype));
  }

  std::unique_ptr<GrpoTrainer> t(new GrpoTrainer(config, lc, policy, std::move(reference)));
  if (ranks != nullptr) t->ranks_ = ranks;
  if (t->reference_) {
    t->reference_->SetRequiresGrad(false);
    if (gates) {
      // Before the policy's shards: the whole reference (a model built in memory) is gone
      // before the policy's loading phase.
      ASSIGN_OR_RETURN(t->reference_shards_,
                       distributed::FrozenShards::Create(t->reference_.get(), t->ranks_,
                                                         fsdp.offload, fsdp.prefetch));
    }
  }
  loss::EntropyControlConfig ec;
  ec.entropy_coef = config.entropy_coef;
  ec.adaptive = config.use_adaptive_entropy;
  ec.coef_min = config.entropy_coef_min;
  ec.coef_max = config.entropy_coef_max;
  ec.coef_delta = config.entropy_coef_delta;
  ec.target = config.entropy_target;
  t->entropy_control_ = loss::EntropyController(ec);
  t->schedule_ = schedule;
  policy->SetRequiresGrad(true);
  if (config.bf16 || host_master) {
    ASSIGN_OR_RETURN(t->compute_,
                     policy->Copy(where, config.bf16 ? compute_dtype : policy->dtype()));
    // shard_grad_op's copy of a deferred policy is read whole from its files, a tensor at a
    // time (full_shard's gate fills its own a unit at a time).
    if (master_chunks) RETURN_IF_ERROR(t->compute_->Materialize().WithContext("compute copy"));
    t->compute_->SetRequiresGrad(true);
  }
  ASSIGN_OR_RETURN(t->optimizer_,
                   MakeStepOptimizer(fsdp, policy->NamedParameters(),
                                     t->compute_ ? t->compute_->Parameters() : policy->Parameters(),
                                     AdamWOptions{config.adam_beta1, config.adam_beta2,
                                                  config.adam_epsilon, config.weight_decay},
                                     t->ranks_, policy, t->compute_.get()));
  if (config.micro_batch_threads > 1) {
    if (t->ranks_->world_size() > 1 || t->compute_ || t->optimizer_->ShardsParameters()) {
      return Status::InvalidArgument(
          "micro_batch_threads " + std::to_string(config.micro_batch_threads) +
          ": two micro-batches at once need one learner process (WORLD_SIZE 1) and no compute "
          "copy (bf16 false, no offload); set it to 1");
    }
    for (const at::Tensor& p : policy->Parameters()) {
      if (p.requires_grad()) t->grad_params_.push_back(p);
    }
    t->micro_worker_ = std::make_unique<MicroBatchWorker>();
  }
  return t;
}

// Not with sharded parameters (full_shard): the gate takes the compute copy's gradients, and
// each gather casts the fp32 shard to the copy's dtype. With the master on the host the
// gradients cross to it here, once a micro-batch.
void GrpoTrainer::MoveComputeGradsToMaster() {
  if (!compute_ || optimizer_->ShardsParameters()) return;
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> master = policy_->Parameters();
  const std::vector<at::Tensor> compute = compute_->Parameters();
  for (size_t i = 0; i < master.size(); ++i) {
    const at::Tensor& g = compute[i].grad();
    if (!g.defined()) continue;
    at::Tensor m = master[i];
    if (m.grad().defined()) {
      m.mutable_grad().add_(g.to(m.device(), m.scalar_type()));
    } else {
      m.mutable_grad() = g.to(m.device(), m.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    }
    compute[i].mutable_grad().zero_();
  }
}

void GrpoTrainer::RefreshComputeCopy() {
  if (!compute_ || optimizer_->ShardsParameters()) return;
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> master = policy_->Parameters();
  std::vector<at::Tensor> compute = compute_->Parameters();
  for (size_t i = 0; i < master.size(); ++i) compute[i].copy_(master[i]);
}

Status GrpoTrainer::ValidateGroup(const RolloutGroup& g, RejectReason* reason) const {
  GroupLimits limits;
  limits.num_generations = config_.num_generations;
  limits.vocab_size = policy_->config().vocab_size;
  limits.max_completion_length = config_.max_completion_length;
  limits.reward_funcs = config_.reward_funcs.size();
  limits.policy_version = policy_version_;
  limits.max_staleness = config_.max_staleness;
  return CheckGroup(g, limits, reason);
}

namespace {

// Runs `body`, with a libtorch or standard exception turned into Internal (the edge of learner/),
// except a collective's failure that the optimizer's gate could only throw: that Status, with
// its own code (a rank that left is Unavailable, one that stalled DeadlineExceeded).
template <typename Body>
auto CatchAsStatus(StepOptimizer& optimizer, Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const c10::Error& e) {
    if (Status failed = optimizer.TakeGateError(); !failed.ok()) return failed;
    return Status::Internal(std::string("training step: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::Internal(std::string("training step: ") + e.what());
  }
}

}  // namespace

StatusOr<GenerationBatchResult> GrpoTrainer::TrainGenerationBatch(
    const std::vector<RolloutGroup>& groups) {
  auto result = CatchAsStatus(*optimizer_, [&] { return TrainGenerationBatchOrFail(groups); });
  if (!result.ok()) DiscardOpenStep();
  return result;
}

StatusOr<std::optional<StepMetrics>> GrpoTrainer::FlushPartialStep() {
  auto result = CatchAsStatus(*optimizer_, [&] { return FlushPartialStepOrFail(); });
  if (!result.ok()) DiscardOpenStep();
  return result;
}

void GrpoTrainer::DiscardOpenStep() {
  open_.reset();
  try {
    ZeroGrads();
  } catch (const c10::Error&) {
    // The device failed: nothing more to do here. The next step zeroes the gradients before its
    // first backward (ZeroGrads), so none of this one's can reach it.
  }
}

void GrpoTrainer::ZeroGrads() {
  optimizer_->ZeroGrad();
  if (!compute_) return;
  at::NoGradGuard no_grad;
  for (at::Tensor& p : compute_->Parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

StatusOr<GenerationBatchResult> GrpoTrainer::TrainGenerationBatchOrFail(
    const std::vector<RolloutGroup>& groups) {
  GenerationBatchResult result;
  Batch batch;
  std::vector<const RolloutGroup*> kept;
  for (const auto& g : groups) {
    RejectReason reason;
    if (ValidateGroup(g, &reason).ok()) {
      kept.push_back(&g);
    } else {
      result.rejected.emplace_back(g.prompt_id, reason);
      ++result.rejected_counts[reason];
    }
  }
  result.groups_trained = static_cast<int64_t>(kept.size());
  if (kept.empty()) return result;

  // Rewards [N, K] (null -> NaN, which ComputeAdvantages counts as 0) and advantages.
  const int64_t G = config_.num_generations;
  const int64_t N = static_cast<int64_t>(kept.size()) * G;
  const int64_t K = static_cast<int64_t>(kept[0]->completions[0].rewards.size());
  for (const auto* g : kept) {
    if (static_cast<int64_t>(g->completions[0].rewards.size()) != K) {
      return Status::InvalidArgument(
          "groups of one generation batch must carry the same number of rewards");
    }
  }
  at::Tensor rewards = at::empty({N, K}, at::kDouble);
  auto acc = rewards.accessor<double, 2>();
  batch.has_beh = true;
  for (int64_t gi = 0; gi < static_cast<int64_t>(kept.size()); ++gi) {
    for (int64_t j = 0; j < G; ++j) {
      const auto& c = kept[gi]->completions[j];
      for (int64_t k = 0; k < K; ++k) {
        acc[gi * G + j][k] = c.rewards[k] ? *c.rewards[k] : std::nan("");
      }
      batch.prompts.push_back(&kept[gi]->prompt_ids);
      batch.completions.push_back(&c);
      batch.staleness.push_back(policy_version_ - kept[gi]->policy_version);
      batch.versions.push_back(kept[gi]->policy_version);
      batch.incarnations.push_back(&kept[gi]->policy_incarnation);
      if (c.logprobs.empty()) batch.has_beh = false;
    }
  }
  AdvantageConfig ac;
  ac.num_generations = G;
  ASSIGN_OR_RETURN(ac.scale_rewards, ParseScaleRewards(config_.scale_rewards));
  ac.reward_weights = config_.reward_weights;
  ASSIGN_OR_RETURN(ac.multi_objective_aggregation,
                   ParseMultiObjectiveAggregation(config_.multi_objective_aggregation));
  ASSIGN_OR_RETURN(AdvantageResult adv, ComputeAdvantages(rewards, ac));
  batch.advantages = adv.advantages.to(at::kFloat);
  batch.rewards = adv.rewards;
  batch.rewards_per_func = rewards;

  const int64_t bs = config_.per_device_train_batch_size;
  const int64_t ga = step_micro_batches();  // over all ranks
  const int64_t world = ranks_->world_size();
  const int64_t num_micro = (N + bs - 1) / bs;
  // `old` is the policy's log-probs at the start of this batch. When every pass of it falls
  // inside the optimizer step now open, the policy cannot move before its last micro-batch and
  // `old` = logp.detach(), with no extra forward, on- or off-policy: the versions a stale group
  // missed are corrected through `beh`, not `old` (docs/GRPO_SPEC.md "When `old` is computed").
  const int64_t open_micro = open_ ? open_->micro : 0;
  const bool need_old = open_micro + config_.num_iterations * num_micro > ga;
  // The rank that back-propagates micro-batch m of pass `it`: its position in its step's
  // stream, modulo the world size (a step's micro-batches are dealt round-robin).
  auto owner = [&](int64_t it, int64_t m) {
    return ((open_micro + it * num_micro + m) % ga) % world;
  };
  std::vector<bool> mine(num_micro, false);  // trained here in some pass
  // The micro-batches each rank trains in some pass: every rank runs as many no-grad forwards
  // of the policy as the rank with the most (full_shard gathers its weights in each).
  std::vector<int64_t> trained_by(world, 0);
  for (int64_t m = 0; m < num_micro; ++m) {
    std::vector<bool> by(world, false);
    for (int64_t it = 0; it < config_.num_iterations; ++it) by[owner(it, m)] = true;
    for (int64_t r = 0; r < world; ++r) trained_by[r] += by[r] ? 1 : 0;
    mine[m] = by[ranks_->rank()];
  }
  const int64_t most_trained = *std::max_element(trained_by.begin(), trained_by.end());
  const at::Device device = compute_model().device();
  try {
    RefreshComputeCopy();  // the master may have changed since (checkpoint restore)
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("bf16 compute copy: ") + e.what_without_backtrace());
  }
  const common::Model& compute = compute_model();
  int64_t cmax = 0;
  for (const auto* c : batch.completions) cmax = std::max<int64_t>(cmax, c->token_ids.size());

  try {
    // `old` (and `ref`) once per generation batch, before its first optimizer step, no grad.
    std::vector<int64_t> own;  // this rank's micro-batches, another rank's are not needed here
    for (int64_t m = 0; m < num_micro; ++m) {
      if (mine[m]) own.push_back(m);
    }
    auto no_grad_logprobs = [&](const common::Model& model, at::Tensor& out, int64_t i) {
      at::NoGradGuard no_grad;
      const int64_t b0 = own[i] * bs, b1 = std::min(N, b0 + bs);
      MicroBatch mb =
          OnDevice(MakeMicroBatch(batch.prompts, batch.completions, b0, b1, false, false), device);
      at::Tensor lp = CompletionLogprobs(model, mb, config_, nullptr);
      out.narrow(0, b0, b1 - b0).narrow(1, 0, lp.size(1)).copy_(lp);
    };
    const int64_t n_own = static_cast<int64_t>(own.size());
    if (need_old) {
      batch.old = at::zeros({N, cmax}, at::kFloat);
      RETURN_IF_ERROR(optimizer_->RunNoGradForwards(
          n_own, most_trained, [&](int64_t i) { no_grad_logprobs(compute, batch.old, i); },
          " of the old log-probs of step " + std::to_string(global_step_ + 1)));
    }
    if (reference_) {
      batch.ref = at::zeros({N, cmax}, at::kFloat);
      auto forward = [&](int64_t i) { no_grad_logprobs(*reference_, batch.ref, i); };
      if (reference_shards_) {
        RETURN_IF_ERROR(reference_shards_->RunNoGradForwards(
            n_own, most_trained, forward,
            " of the reference log-probs of step " + std::to_string(global_step_ + 1)));
      } else {
        for (int64_t i = 0; i < n_own; ++i) forward(i);
      }
    }
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("old/ref log-probs: ") + e.what_without_backtrace());
  }

  const std::vector<std::string> reward_names = [&] {
    std::vector<std::string> names = config_.reward_funcs;
    for (int64_t k = static_cast<int64_t>(names.size()); k < K; ++k) {
      names.push_back("reward_" + std::to_string(k));
    }
    return names;
  }();

  // Without behaviour log-probs there is nothing to correct against.
  GrpoLossConfig step_loss_config = loss_config_;
  if (!batch.has_beh) {
    step_loss_config.importance_sampling_correction = ImportanceSamplingCorrection::kNone;
  }
  // A token-sum loss (dapo, cispo, vespo) divides by the completion tokens of the whole
  // optimizer step, which may span generation batches: its micro-batches back-propagate the
  // token sum and FinishStep divides the accumulated gradient (and loss) by
  // loss::StepGradientScale before clipping.
  LossNormaliser norm;
  norm.gradient_accumulation_steps = ga;
  norm.step_completion_tokens = 1.0;
  // The completion tokens of each micro-batch that a token-sum loss divides by, TRL's
  // num_items_in_batch: the policy's tokens only (env_mask), truncated completions left out under
  // mask_truncated_completions. The open step adds them up as it goes; with the entropy bonus
  // the step's total is needed when it starts, which requires that no step spans into the next
  // generation batch (one still open when the stream ends is taken short, below).
  const bool bonus_needs_tokens =
      entropy_control_.config().enabled() &&
      loss::ObjectiveOf(loss_config_.loss_type).aggregation == loss::Aggregation::kStepTokens;
  std::vector<double> micro_tokens(num_micro, 0.0);
  for (int64_t m = 0; m < num_micro; ++m) {
    for (int64_t r = m * bs; r < std::min(N, (m + 1) * bs); ++r) {
      const auto* c = batch.completions[r];
      if (!(config_.mask_truncated_completions && c->truncated)) {
        micro_tokens[m] += static_cast<double>(ModelTokenCount(*c));
      }
    }
  }
  const int64_t stream = config_.num_iterations * num_micro;

  // micro_batch_threads 2: the micro-batch the worker trains ahead, and its place in the stream.
  // Every way out of this function waits for the worker first (it reads `batch`).
  std::unique_ptr<MicroResult> ahead;
  int64_t ahead_q = -1;
  struct WaitForWorker {
    MicroBatchWorker* worker;
    ~WaitForWorker() {
      if (worker != nullptr) worker->Wait();
    }
  } wait_for_worker{micro_worker_.get()};

  // The micro-batch stream of this batch: num_iterations passes over its micro-batches; an
  // optimizer step every gradient_accumulation_steps micro-batches of the stream, carried over
  // to the next generation batch when this one ends inside a step (as TRL does).
  for (int64_t it = 0; it < config_.num_iterations; ++it) {
    for (int64_t m = 0; m < num_micro; ++m) {
      const int64_t q = it * num_micro + m;  // the micro-batch's place in the stream
      if (!open_) {
        open_ = std::make_unique<OpenStep>();
        open_->start = std::chrono::steady_clock::now();
        open_->sm.iteration = it;
        open_->bonus_coef = entropy_control_.ApplyCoef();
        if (bonus_needs_tokens) {
          double tokens = 0.0;
          for (int64_t k = q; k < std::min(stream, q + ga); ++k)
            tokens += micro_tokens[k % num_micro];
          open_->bonus_scale = std::max(1.0, tokens);
        }
      }
      OpenStep& os = *open_;
      step_loss_config.entropy_coef = os.bonus_coef;
      norm.entropy_bonus_scale = os.bonus_scale;
      const int64_t b0 = m * bs, b1 = std::min(N, b0 + bs);
      for (int64_t r = b0; r < b1; ++r) {
        const auto* c = batch.completions[r];
        // completion_tokens (and completions/mean_length) count the policy's tokens, as TRL;
        // tokens_per_second counts every token the forward pass ran over.
        os.sm.completion_tokens += ModelTokenCount(*c);
        os.all_tokens += static_cast<int64_t>(c->token_ids.size() + batch.prompts[r]->size());
        os.clipped += c->truncated ? 1.0 : 0.0;
        os.staleness_sum += static_cast<double>(batch.staleness[r]);
        os.sm.has_tools = os.sm.has_tools || c->uses_tools;
        os.sm.tool_calls += c->tool_calls;
        os.sm.tool_call_failures += c->tool_call_failures;
      }
      os.step_completion_tokens += micro_tokens[m];
      os.sm.sequences += b1 - b0;
      os.sm.reward = adv.reward_mean;
      os.sm.reward_std = adv.reward_std;
      os.sm.frac_reward_zero_std = adv.frac_reward_zero_std;
      os.sm.reward_names = reward_names;
      os.sm.reward_fn_mean = adv.reward_fn_mean;
      os.sm.reward_fn_std = adv.reward_fn_std;
      if (os.micro == 0) ZeroGrads();
      const std::string at_micro = " of micro-batch " + std::to_string(os.micro + 1) + " of step " +
                                   std::to_string(global_step_ + 1);
      if (owner(it, m) != ranks_->rank()) {  // another rank back-propagates this one
        if (!config_.dump_batches_dir.empty()) {
          AppendDumpRows(batch, b0, b1, at::Tensor(), /*owned=*/false, &os.dump);
        }
        RETURN_IF_ERROR(optimizer_->AfterMicroBatch(++os.micro, at_micro));
        if (os.micro < ga) continue;
        ASSIGN_OR_RETURN(StepMetrics sm, FinishStep(ga));
        result.steps.push_back(std::move(sm));
        continue;
      }
      optimizer_->BeforeBackward(at_micro);
      MicroResult r;
      if (ahead != nullptr && ahead_q == q) {  // the worker trained it beside the one before
        micro_worker_->Wait();
        r = std::move(*ahead);
        ahead.reset();
        RETURN_IF_ERROR(r.status);
        AddGradients(r.grads);  // after the micro-batch before it, as one after the other
      } else {
        if (micro_worker_ != nullptr && m + 1 < num_micro && os.micro + 1 < ga) {
          // The next micro-batch of this step goes to the worker while this one trains here.
          ahead = std::make_unique<MicroResult>();
          ahead_q = q + 1;
          // On the trainer's thread an exception reaches CatchAsStatus (a gate's error keeps its
          // own code); the worker's becomes its result's Status.
          micro_worker_->Run([this, &batch, n0 = b1, n1 = std::min(N, b1 + bs),
                              loss_config = step_loss_config, normaliser = norm,
                              result = ahead.get()] {
            try {
              ComputeMicroBatch(batch, n0, n1, loss_config, normaliser, /*apart=*/true, result);
            } catch (const c10::Error& e) {
              result->status = Status::Internal(std::string("micro-batch forward/backward: ") +
                                                e.what_without_backtrace());
            } catch (const std::exception& e) {
              result->status =
                  Status::Internal(std::string("micro-batch forward/backward: ") + e.what());
            }
          });
        }
        ComputeMicroBatch(batch, b0, b1, step_loss_config, norm, /*apart=*/false, &r);
        RETURN_IF_ERROR(r.status);
      }
      const MicroBatch& mb = r.mb;
      const GrpoLossInputs& in = r.in;
      const GrpoLossOutput& out = r.out;
      const at::Tensor& logp = r.logp;
      const at::Tensor& entropy = r.entropy;
      const int64_t C = mb.labels.size(1);
      MoveComputeGradsToMaster();
      if (TEST_micro_batch_fault_) RETURN_IF_ERROR(TEST_micro_batch_fault_(q));
      RETURN_IF_ERROR(optimizer_->AfterBackward(at_micro));
      os.lm.Merge(out.metrics);
      // One host read per micro-batch: TRL's entropy (the mean over micro-batches of each
      // one's token mean) and the |behaviour - old| sums over the real policy tokens.
      std::vector<at::Tensor> stats = {mb.loss_mask.sum(), (entropy * mb.loss_mask).sum()};
      if (batch.has_beh) {
        at::NoGradGuard no_grad;
        at::Tensor real = mb.attention_mask.narrow(1, mb.prompt_len, C).to(at::kFloat);  // [b, C]
        if (mb.env_mask.defined()) real = real * mb.env_mask;
        const at::Tensor old = in.old.defined() ? in.old : logp.detach();
        const at::Tensor diff = (mb.beh - old.to(at::kFloat)).abs() * real;
        stats.push_back(diff.sum());
        stats.push_back(diff.max());
        stats.push_back(real.sum());
      }
      const at::Tensor host = at::stack(stats).to(at::kCPU);
      const float* hs = host.data_ptr<float>();
      const double mb_tokens = hs[0];
      os.entropy_mean_sum += static_cast<double>(hs[1]) / std::max(1.0, mb_tokens);
      if (batch.has_beh) {
        os.mismatch_sum += hs[2];
        os.mismatch_max = std::max(os.mismatch_max, static_cast<double>(hs[3]));
        os.mismatch_tokens += hs[4];
      }
      if (!config_.dump_batches_dir.empty()) {
        AppendDumpRows(batch, b0, b1, logp, /*owned=*/true, &os.dump);
      }
      RETURN_IF_ERROR(optimizer_->AfterMicroBatch(++os.micro, at_micro));
      if (os.micro < ga) continue;
      ASSIGN_OR_RETURN(StepMetrics sm, FinishStep(ga));
      result.steps.push_back(std::move(sm));
    }
  }
  if (bonus_needs_tokens && open_ && open_->micro > 0) {
    // The step's tokens were counted from this batch alone: it ends here, short (every rank
    // runs this same stream and flushes here too).
    ASSIGN_OR_RETURN(StepMetrics sm, FinishStep(open_->micro));
    result.steps.push_back(std::move(sm));
  }
  return result;
}

int64_t GrpoTrainer::open_step_micro_batches() const { return open_ ? open_->micro : 0; }

StatusOr<std::optional<StepMetrics>> GrpoTrainer::FlushPartialStepOrFail() {
  if (!open_ || open_->micro == 0) {
    open_.reset();
    return std::optional<StepMetrics>();
  }
  ASSIGN_OR_RETURN(StepMetrics sm, FinishStep(open_->micro));
  return std::optional<StepMetrics>(std::move(sm));
}

Status GrpoTrainer::ReduceOverRanks(OpenStep& os) {
  if (ranks_->world_size() == 1) return Status::OK();
  const std::string at_step = " of step " + std::to_string(global_step_ + 1);
  RETURN_IF_ERROR(optimizer_->ReduceGradients(os.micro, at_step));
  GrpoLossMetrics& lm = os.lm;
  std::vector<double> sums = {lm.loss,
                              lm.tokens,
                              static_cast<double>(lm.micro_batches),
                              lm.clip_low_sum,
                              lm.clip_high_sum,
                              lm.clip_region_sum,
                              lm.kl_sum,
                              lm.phi_sum,
                              lm.entropy_sum,
                              lm.entropy_tokens,
                              lm.is_ratio_sum,
                              lm.is_ratio_tokens,
                              lm.has_kl ? 1.0 : 0.0,
                              lm.has_is_ratio ? 1.0 : 0.0,
                              os.entropy_mean_sum,
                              os.mismatch_sum,
                              os.mismatch_tokens};
  std::vector<double> maxima = {lm.is_ratio_max, os.mismatch_max};
  std::vector<at::Tensor> sum_t = {at::tensor(sums, at::kDouble)};
  std::vector<at::Tensor> max_t = {at::tensor(maxima, at::kDouble)};
  RETURN_IF_ERROR(ranks_->AllReduceSum(sum_t, "all-reduce of the metrics" + at_step));
  RETURN_IF_ERROR(ranks_->AllReduceMax(max_t, "all-reduce of the metric maxima" + at_step));
  const double* v = sum_t[0].data_ptr<double>();
  lm.loss = v[0];
  lm.tokens = v[1];
  lm.micro_batches = static_cast<int64_t>(std::llround(v[2]));
  lm.clip_low_sum = v[3];
  lm.clip_high_sum = v[4];
  lm.clip_region_sum = v[5];
  lm.kl_sum = v[6];
  lm.phi_sum = v[7];
  lm.entropy_sum = v[8];
  lm.entropy_tokens = v[9];
  lm.is_ratio_sum = v[10];
  lm.is_ratio_tokens = v[11];
  lm.has_kl = v[12] > 0;
  lm.has_is_ratio = v[13] > 0;
  os.entropy_mean_sum = v[14];
  os.mismatch_sum = v[15];
  os.mismatch_tokens = v[16];
  lm.is_ratio_max = max_t[0].data_ptr<double>()[0];
  os.mismatch_max = max_t[0].data_ptr<double>()[1];
  return Status::OK();
}

Status GrpoTrainer::SyncFromRankZero() {
  if (ranks_->world_size() == 1) return Status::OK();
  at::NoGradGuard no_grad;
  if (!optimizer_->ShardsParameters()) {
    RETURN_IF_ERROR(distributed::BucketedBroadcast(*ranks_, policy_->Parameters(),
                                                   distributed::kDefaultBucketBytes,
                                                   "broadcast of rank 0's weights"));
  }
  // A checkpoint of per-rank AdamW shards that rank 0 restored: each rank reads its own runs.
  RETURN_IF_ERROR(distributed::HandOutStateShards(*optimizer_, *ranks_,
                                                  "hand-out of the checkpoint's AdamW shards"));
  // The same state in one file (saved by ranks that did not share output_dir): from rank 0, a
  // parameter at a time.
  RETURN_IF_ERROR(distributed::HandOutStateFile(*optimizer_, policy_->NamedParameters(), *ranks_,
                                                "hand-out of the checkpoint's AdamW state"));
  // Sharded parameters: rank 0's restored weights too, a unit at a time.
  RETURN_IF_ERROR(optimizer_->SyncFromRankZero("broadcast of rank 0's AdamW state"));
  std::vector<at::Tensor> counters = {
      at::tensor(std::vector<int64_t>{global_step_, policy_version_.load()}, at::kLong)};
  RETURN_IF_ERROR(ranks_->Broadcast(counters, "broadcast of rank 0's step counters"));
  const int64_t* c = counters[0].data_ptr<int64_t>();
  RestoreCounters(c[0], c[1]);
  std::vector<at::Tensor> control = {at::tensor(
      std::vector<double>{entropy_control_.coef(), entropy_control_.last_entropy()}, at::kDouble)};
  RETURN_IF_ERROR(ranks_->Broadcast(control, "broadcast of rank 0's entropy controller"));
  const double* e = control[0].data_ptr<double>();
  entropy_control_.Restore(e[0], e[1]);
  open_.reset();
  ZeroGrads();
  RefreshComputeCopy();
  return Status::OK();
}

StatusOr<StepMetrics> GrpoTrainer::FinishStep(int64_t divisor) {
  OpenStep& os = *open_;
  StepMetrics sm = os.sm;
  RETURN_IF_ERROR(ReduceOverRanks(os));
  const double scale =
      loss::StepGradientScale(loss::ObjectiveOf(loss_config_.loss_type).aggregation,
                              os.step_completion_tokens, step_micro_batches(), divisor);
  const std::string at_step = " of step " + std::to_string(global_step_ + 1);
  if (scale != 1.0) optimizer_->ScaleGradients(scale);
  ASSIGN_OR_RETURN(sm.grad_norm, optimizer_->ClipGradNorm(config_.max_grad_norm, at_step));
  if (!std::isfinite(sm.grad_norm)) {
    return Status::Internal("non-finite gradient norm at step " + std::to_string(global_step_ + 1) +
                            "; step skipped");
  }
  const int64_t total_steps = config_.max_steps;
  const int64_t warmup = config_.warmup_steps > 0
                             ? config_.warmup_steps
                             : static_cast<int64_t>(std::ceil(config_.warmup_ratio *
                                                              static_cast<double>(total_steps)));
  sm.learning_rate =
      LearningRateAt(schedule_, config_.learning_rate, global_step_, warmup, total_steps);
  RETURN_IF_ERROR(optimizer_->Step(sm.learning_rate, at_step));
  optimizer_->ZeroGrad();
  RefreshComputeCopy();
  ++global_step_;
  ++policy_version_;
  sm.step = global_step_;
  sm.policy_version = policy_version_;
  sm.loss = os.lm.loss * scale;
  const double seqs = static_cast<double>(std::max<int64_t>(1, sm.sequences));
  sm.completions_mean_length = static_cast<double>(sm.completion_tokens) / seqs;
  sm.completions_clipped_ratio = os.clipped / seqs;
  sm.staleness_mean = os.staleness_sum / seqs;
  sm.tool_call_frequency = static_cast<double>(sm.tool_calls) / seqs;
  sm.tool_failure_frequency = sm.tool_calls > 0 ? static_cast<double>(sm.tool_call_failures) /
                                                      static_cast<double>(sm.tool_calls)
                                                : 0.0;
  sm.clip_ratio_low = os.lm.ClipLowMean();
  sm.clip_ratio_high = os.lm.ClipHighMean();
  sm.clip_ratio_region = os.lm.ClipRegionMean();
  sm.objective_metric = loss::ObjectiveOf(loss_config_.loss_type).metric;
  sm.vespo_phi_mean = os.lm.PhiMean();
  // The adaptive coefficient moves after each step, on the step's entropy over all ranks.
  entropy_control_.EndStep(os.lm.entropy_sum, os.lm.entropy_tokens);
  sm.has_entropy_coef = entropy_control_.config().enabled();
  sm.entropy_coef = entropy_control_.coef();
  sm.has_kl = os.lm.has_kl;
  sm.kl = os.lm.KlMean();
  sm.has_is_ratio = os.lm.has_is_ratio;
  sm.is_ratio_mean = os.lm.IsRatioMean();
  sm.is_ratio_max = os.lm.is_ratio_max;
  sm.entropy = os.micro > 0 ? os.entropy_mean_sum / static_cast<double>(os.micro) : 0.0;
  sm.step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - os.start).count();
  sm.tokens_per_second = static_cast<double>(os.all_tokens) / std::max(1e-9, sm.step_seconds);
  sm.has_logprob_mismatch = os.mismatch_tokens > 0;
  sm.logprob_mismatch_mean = os.mismatch_sum / std::max(1.0, os.mismatch_tokens);
  sm.logprob_mismatch_max = os.mismatch_max;
  sm.peak_memory_bytes = common::PeakMemoryBytes(compute_model().device());
  sm.micro_batches = os.micro;
  if (!config_.dump_batches_dir.empty() && !os.dump.prompts.empty()) {
    os.sm = sm;
    RETURN_IF_ERROR(DumpStep(os, sm.step));
  }
  open_.reset();
  return sm;
}

namespace {

// A 64-bit hex incarnation id as int64 bits; 0 when there is none.
int64_t IncarnationBits(const std::string& hex) {
  uint64_t v = 0;
  const auto [p, ec] = std::from_chars(hex.data(), hex.data() + hex.size(), v, 16);
  return ec == std::errc() && p == hex.data() + hex.size() ? static_cast<int64_t>(v) : 0;
}

// Pieces [b_i, w_i] stacked into [sum b_i, width] of `dtype`: each cut at `width`, or filled up
// to it with `pad` on the right.
at::Tensor CatPadded(const std::vector<at::Tensor>& pieces, int64_t width, double pad,
                     at::ScalarType dtype) {
  int64_t rows = 0;
  for (const at::Tensor& p : pieces) rows += p.size(0);
  at::Tensor out = at::full({rows, width}, pad, at::TensorOptions().dtype(dtype));
  int64_t at_row = 0;
  for (const at::Tensor& p : pieces) {
    const int64_t w = std::min(width, p.size(1));
    out.narrow(0, at_row, p.size(0)).narrow(1, 0, w).copy_(p.narrow(1, 0, w));
    at_row += p.size(0);
  }
  return out;
}

// The step a batch dump's file name belongs to: `step-<digits>` followed by `.safetensors` or
// `-part.safetensors` (and anything after it, e.g. `.tmp`); nullopt for any other name.
std::optional<int64_t> DumpFileStep(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  int64_t step = 0;
  const auto [p, ec] = std::from_chars(name.data(), name.data() + name.size(), step);
  if (ec != std::errc() || p == name.data()) return std::nullopt;
  const std::string_view rest(p, name.data() + name.size() - p);
  for (std::string_view suffix : {".safetensors", "-part.safetensors"}) {
    if (rest.substr(0, suffix.size()) == suffix) return step;
  }
  return std::nullopt;
}

}  // namespace

void GrpoTrainer::AppendDumpRows(const Batch& batch, int64_t b0, int64_t b1, const at::Tensor& logp,
                                 bool owned, StepDump* dump) {
  int64_t width = 0;  // the micro-batch's completion length (MakeMicroBatch's C)
  for (int64_t r = b0; r < b1; ++r) {
    dump->prompts.push_back(*batch.prompts[r]);
    dump->completions.push_back(*batch.completions[r]);
    dump->versions.push_back(batch.versions[r]);
    dump->incarnations.push_back(IncarnationBits(*batch.incarnations[r]));
    width = std::max<int64_t>(width, batch.completions[r]->token_ids.size());
  }
  const int64_t b = b1 - b0;
  dump->rewards.push_back(batch.rewards.narrow(0, b0, b));
  dump->rewards_per_func.push_back(batch.rewards_per_func.narrow(0, b0, b));
  dump->advantages.push_back(batch.advantages.narrow(0, b0, b));
  // Another rank's micro-batch: zeros where its owner has values (DumpStep sums over ranks).
  const auto rows = [&](const at::Tensor& t) {
    if (!t.defined()) return at::Tensor();
    return owned ? t.narrow(0, b0, b) : at::zeros({b, t.size(1)}, t.options());
  };
  dump->old.push_back(rows(batch.old));
  dump->ref.push_back(rows(batch.ref));
  dump->logp.push_back(owned ? logp.detach().to(at::kCPU)
                             : at::zeros({b, width}, at::TensorOptions().dtype(at::kFloat)));
}

Status GrpoTrainer::DumpStep(const OpenStep& os, int64_t step) const {
  // The step's micro-batches in stream order (a pass of num_iterations > 1 in the same step
  // repeats rows, each with its own log-probs), from every generation batch the step spans.
  // Every rank holds every row; the log-probs of a micro-batch only on the rank that trained it
  // (zeros on the others), so at several ranks they are summed over the ranks, a collective,
  // and rank 0 writes the file.
  const StepDump& d = os.dump;
  const int64_t n = static_cast<int64_t>(d.prompts.size());
  std::vector<const std::vector<int32_t>*> prompts;
  std::vector<const common::Completion*> completions;
  bool with_beh = true;
  for (int64_t i = 0; i < n; ++i) {
    prompts.push_back(&d.prompts[i]);
    completions.push_back(&d.completions[i]);
    with_beh = with_beh && !d.completions[i].logprobs.empty();
  }
  MicroBatch mb =
      MakeMicroBatch(prompts, completions, 0, n, with_beh, config_.mask_truncated_completions);
  const int64_t P = mb.prompt_len, C = mb.completion_len;
  common::NamedTensors t;
  t.emplace_back("prompt_ids", mb.ids.narrow(1, 0, P).contiguous());
  t.emplace_back("prompt_mask", mb.attention_mask.narrow(1, 0, P).contiguous());
  t.emplace_back("completion_ids", mb.labels);
  t.emplace_back("completion_mask", mb.completion_mask);
  if (mb.env_mask.defined()) t.emplace_back("env_mask", mb.env_mask);  // TRL's tool_mask
  t.emplace_back("rewards", at::cat(d.rewards));
  int64_t K = 0;  // the same in one generation batch; NaN (null) fills a batch with fewer
  for (const at::Tensor& r : d.rewards_per_func) K = std::max<int64_t>(K, r.size(1));
  t.emplace_back("rewards_per_func", CatPadded(d.rewards_per_func, K, std::nan(""), at::kDouble));
  t.emplace_back("advantages", at::cat(d.advantages));
  std::vector<int64_t> truncated(n);
  for (int64_t i = 0; i < n; ++i) truncated[i] = d.completions[i].truncated ? 1 : 0;
  t.emplace_back("policy_version", at::tensor(d.versions, at::kLong));
  // In-flight weight updates: each completion token's version [n, C] (a row without per-token
  // versions: its policy_version on every token; -1 past the row's tokens).
  if (std::any_of(d.completions.begin(), d.completions.end(),
                  [](const common::Completion& c) { return !c.token_versions.empty(); })) {
    at::Tensor tv = at::full({n, C}, -1, at::kLong);
    auto acc = tv.accessor<int64_t, 2>();
    for (int64_t i = 0; i < n; ++i) {
      const common::Completion& c = d.completions[i];
      const int64_t len = std::min<int64_t>(C, static_cast<int64_t>(c.token_ids.size()));
      for (int64_t k = 0; k < len; ++k) {
        acc[i][k] = c.token_versions.empty() ? d.versions[i] : c.token_versions[k];
      }
    }
    t.emplace_back("token_versions", tv);
  }
  // Incarnations (64-bit ids; 0 when none): each row's weights and the training learner's.
  t.emplace_back("policy_incarnation", at::tensor(d.incarnations, at::kLong));
  t.emplace_back("learner_incarnation",
                 at::tensor(std::vector<int64_t>{IncarnationBits(dump_incarnation_)}, at::kLong));
  t.emplace_back("truncated", at::tensor(truncated, at::kLong));
  // `old` where a batch computed it; a batch that did not used logp.detach() as `old`.
  std::vector<at::Tensor> trained = {CatPadded(d.logp, C, 0.0, at::kFloat)};  // logp, old, ref
  size_t old_at = 0, ref_at = 0;  // their index in `trained`; 0 when absent
  if (std::any_of(d.old.begin(), d.old.end(), [](const at::Tensor& o) { return o.defined(); })) {
    std::vector<at::Tensor> old;
    for (size_t m = 0; m < d.old.size(); ++m)
      old.push_back(d.old[m].defined() ? d.old[m] : d.logp[m]);
    old_at = trained.size();
    trained.push_back(CatPadded(old, C, 0.0, at::kFloat));
  }
  if (d.ref.front().defined()) {
    ref_at = trained.size();
    trained.push_back(CatPadded(d.ref, C, 0.0, at::kFloat));
  }
  if (ranks_->world_size() > 1) {
    RETURN_IF_ERROR(ranks_->AllReduceSum(
        trained, "all-reduce of the batch dump's log-probs of step " + std::to_string(step)));
    if (ranks_->rank() != 0) return Status::OK();
  }
  const at::Tensor& logp = trained[0];
  if (old_at != 0) t.emplace_back("old_logprobs", trained[old_at]);
  if (ref_at != 0) t.emplace_back("ref_logprobs", trained[ref_at]);
  if (mb.beh.defined()) t.emplace_back("behaviour_logprobs", mb.beh);
  t.emplace_back("logprobs", logp);
  t.emplace_back(
      "logprobs_first_micro_batch",
      logp.narrow(0, 0, d.logp.front().size(0)).narrow(1, 0, d.logp.front().size(1)).contiguous());
  nlohmann::json sizes = nlohmann::json::array();
  for (const at::Tensor& lp : d.logp) sizes.push_back(lp.size(0));
  std::error_code ec;
  std::filesystem::create_directories(config_.dump_batches_dir, ec);
  char name[64];
  std::snprintf(name, sizeof(name), "step-%08lld.safetensors", static_cast<long long>(step));
  return common::WriteSafetensors(config_.dump_batches_dir + "/" + name, t,
                                  {{"metrics", os.sm.ToJson().dump()},
                                   {"config", config_.ToJson().dump()},
                                   {"micro_batch_sizes", sizes.dump()}});
}

StatusOr<int64_t> GrpoTrainer::RemoveDumpsAfter(int64_t step) const {
  namespace fs = std::filesystem;
  if (config_.dump_batches_dir.empty()) return int64_t{0};
  std::error_code ec;
  std::vector<fs::path> obsolete;
  for (fs::directory_iterator it(config_.dump_batches_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::optional<int64_t> of = DumpFileStep(it->path().filename().string());
    if (of && *of > step) obsolete.push_back(it->path());
  }
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return Status::Internal("cannot list dump_batches_dir " + config_.dump_batches_dir + ": " +
                            ec.message());
  }
  for (const fs::path& path : obsolete) {
    if (!fs::remove(path, ec) && ec) {
      return Status::Internal("cannot remove batch dump " + path.string() + ": " + ec.message());
    }
  }
  return static_cast<int64_t>(obsolete.size());
}

}  // namespace grpo::learner
