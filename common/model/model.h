// Model: a decoder-only transformer of the Qwen2 / Qwen3 / Llama family (RMSNorm, RoPE with
// the Hugging Face rotate_half convention, causal grouped-query attention, SwiGLU MLP), with
// Hugging Face tensor names, a whole-sequence forward for the learner and a KV-cache forward
// for rollout workers.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/model/model_config.h"
#include "common/model/model_weights.h"
#include "common/model/parameter_gate.h"
#include "common/model/safetensors.h"
#include "common/status.h"

namespace grpo::common {

// Keys and values of every layer for a batch of rows, preallocated to `capacity` columns.
// Column j of a row holds the token fed at step j; `key_mask` says which columns are real
// (padding and inactive steps are 0). Owned by the caller; one cache per generating thread.
struct KvCache {
  std::vector<at::Tensor> keys;    // per layer [B, kv_heads, capacity, head_dim]
  std::vector<at::Tensor> values;  // per layer [B, kv_heads, capacity, head_dim]
  at::Tensor key_mask;             // [B, capacity] bool
  at::Tensor next_position;        // [B] int64: RoPE position of the row's next real token
  int64_t length = 0;              // columns filled (the same for every row)
  int64_t capacity = 0;

  int64_t batch() const { return key_mask.defined() ? key_mask.size(0) : 0; }
};

// Parameters are plain at::Tensor leaves of one dtype (fp32, or bf16 for a compute copy) on one
// device; compute, the KV cache and NewCache follow their device and dtype. In a non-fp32 model
// RMSNorm and the attention softmax run in fp32 (as transformers does); fp32 is unaffected.
// Forward functions are const and may run concurrently from several threads; LoadStateFrom,
// To and SetRequiresGrad must not run concurrently with them.
class Model {
 public:
  // Reads `dir/config.json` and the weights (`model.safetensors` or a sharded index); weights
  // on disk may be F32, F16, BF16 or F64 and are converted to `dtype` (fp32 by default) on
  // `device`. Errors name the file and the tensor: NotFound (missing tensor), InvalidArgument
  // (shape or dtype, or a dtype that is not floating).
  static StatusOr<std::unique_ptr<Model>> Load(const std::string& dir,
                                               const at::Device& device = at::kCPU,
                                               at::ScalarType dtype = at::kFloat);
  // As Load, but only config.json and the weights' names, dtypes and shapes are read now (the
  // same errors): every parameter has its shape and no memory (UnallocatedTensor) until its
  // values are read, by a full_shard optimizer each rank its own chunk of each unit
  // (TakeDeferredWeights; no rank holds the whole model), or whole by Materialize. Copy and To
  // of a deferred model make deferred ones; its forwards fail (TORCH_CHECK), and so do Save's.
  static StatusOr<std::unique_ptr<Model>> LoadDeferred(const std::string& dir,
                                                       const at::Device& device = at::kCPU,
                                                       at::ScalarType dtype = at::kFloat);
  // Whether the values are still in the files (LoadDeferred, not yet read or taken).
  bool deferred() const { return deferred_ != nullptr; }
  // Reads the whole model of a deferred one (each parameter converted to the model's device and
  // dtype); nothing for a model that is not. The errors of reading; then nothing changed.
  Status Materialize();
  // The files a deferred model's values are in, handed to whoever fills its parameters (null
  // when not deferred); the model is no longer deferred and its parameters stay without memory.
  std::shared_ptr<const ModelWeights> TakeDeferredWeights();
  // Linears and embeddings ~ N(0, 0.02), norms 1, biases 0; a function of (config, seed) only:
  // drawn in fp32 on the CPU, then moved to `device` and cast to `dtype`, so every device gets
  // the same weights.
  static StatusOr<std::unique_ptr<Model>> InitRandom(const ModelConfig& config, uint64_t seed,
                                                     const at::Device& device = at::kCPU,
                                                     at::ScalarType dtype = at::kFloat);

  // A new model with its own storage on `device` in `dtype` (the bf16 compute copy of an fp32
  // master, or a CPU copy of a GPU model). Gradients and requires_grad are not copied.
  // InvalidArgument for a dtype that is not floating; Internal on a libtorch error.
  StatusOr<std::unique_ptr<Model>> Copy(const at::Device& device, at::ScalarType dtype) const;
  // Moves and casts every parameter in place (their gradients are dropped). Same errors as Copy.
  Status To(const at::Device& device, at::ScalarType dtype);
  at::Device device() const { return embed_.device(); }
  at::ScalarType dtype() const { return embed_.scalar_type(); }

  // Writes `dir/config.json` and `dir/model.safetensors` (sharded above `max_shard_bytes`) with
  // Hugging Face names, in fp32 from any device; tied models have no lm_head.weight. Creates
  // `dir` if needed.
  Status Save(const std::string& dir, uint64_t max_shard_bytes = 5ull << 30) const;
  // As Save, with `weights` for the values: NamedParameters' names in its order and shapes
  // (InvalidArgument otherwise), e.g. the gathered weights of a model whose parameters are
  // sharded (parameter_gate.h).
  Status SaveWeights(const std::string& dir, const NamedTensors& weights,
                     uint64_t max_shard_bytes = 5ull << 30) const;
  // Hands one parameter's values (its name; any float dtype, any device) to be written.
  using WeightPut = std::function<Status(const std::string& name, const at::Tensor& value)>;
  // As SaveWeights, with the values handed over one at a time: `produce` calls `put` once for
  // every parameter, in any order, and each is written (as fp32, through the CPU) before the
  // next, so a model whose parameters are sharded is written one gathered unit at a time and is
  // never whole in memory (SafetensorsWriter). `put` fails with InvalidArgument for a
  // name that is not a parameter's, a second value or another shape; a parameter never put
  // fails the save with FailedPrecondition; either leaves no model file. `produce` is called
  // exactly once, also when the directory or its files cannot be made (then every `put` returns
  // that error): collectives inside it stay matched across ranks.
  Status SaveWeightsFrom(const std::string& dir,
                         const std::function<Status(const WeightPut& put)>& produce,
                         uint64_t max_shard_bytes = 5ull << 30) const;

  const ModelConfig& config() const { return config_; }
  // The live parameters (shared storage) under their Hugging Face names, in checkpoint order.
  NamedTensors NamedParameters() const { return params_; }
  // The parameters' names and shapes from the config, in the same order (what
  // ModelWeights::Open checks a model's files against).
  std::vector<std::pair<std::string, std::vector<int64_t>>> ParameterShapes() const;
  std::vector<at::Tensor> Parameters() const;
  int64_t NumParameters() const;
  void SetRequiresGrad(bool requires_grad);
  // Copies every parameter in place from `state` (all names, no others; shapes must match;
  // any float dtype/device). Validates everything before copying anything: InvalidArgument
  // naming the tensor on failure, and then no parameter changed.
  Status LoadStateFrom(const NamedTensors& state);

  // --- Whole sequences (learner). Differentiable when grad mode is on.
  // input_ids [B, T] int64, attention_mask [B, T] (1 real, 0 pad; left, right or both) ->
  // final-normed hidden states [B, T, D]. Positions are cumsum(mask) - 1; padded keys are
  // masked out; hidden states at padded positions are finite garbage.
  // With `gradient_checkpointing` (and grad mode on) each decoder layer keeps only its input for
  // backward and recomputes its activations there (one extra layer forward per layer), so the
  // activation memory of the layers is one [B, T, D] tensor per layer instead of all of their
  // intermediates (attention scores [B, H, T, T], the MLP's [B, T, I], ...). Same gradients.
  at::Tensor ForwardHidden(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                           bool gradient_checkpointing = false) const;
  // The learner's groups share their prompt: with `prefix_ids` [U, P] (LEFT-padded, each row's
  // last column real; prefix_mask [U, P] 1 real, 0 pad), `suffix_ids` [B, C] (RIGHT-padded;
  // suffix_mask [B, C]) and `row_prefix` [B] int64 (the prefix row i continues), returns the
  // final-normed hidden states that predict each suffix token, [B, C, D]: column 0 the
  // prefix's last position, column t the suffix's token t - 1. These are ForwardHidden's of the
  // rows prefix ++ suffix at columns P - 1 .. P + C - 2, up to rounding, but each prefix runs
  // through the layers once however many rows continue it (its keys and values joined to every
  // row's; their gradients summed over the rows) and the suffix's last token not at all.
  // Differentiable; `gradient_checkpointing` and a parameter gate as in ForwardHidden (a layer
  // runs the prefix and its suffixes together: one recompute, one gather of its weights).
  at::Tensor ForwardSharedPrefix(const at::Tensor& prefix_ids, const at::Tensor& prefix_mask,
                                 const at::Tensor& row_prefix, const at::Tensor& suffix_ids,
                                 const at::Tensor& suffix_mask,
                                 bool gradient_checkpointing = false) const;
  // [V, D]; the embedding matrix when tied. With a parameter gate, acquires the lm_head's unit
  // and leaves it acquired: its user releases it (the gate's owner, after the backward).
  at::Tensor LmHeadWeight() const;
  // hidden [..., D] -> logits [..., V].
  at::Tensor Logits(const at::Tensor& hidden) const;

  // --- Units of parameters (parameter_gate.h): 0 the embedding (with the lm_head when tied),
  // 1 + i decoder layer i, then the final norm, then the untied lm_head.
  int NumUnits() const;
  int LayerUnit(int64_t layer) const { return 1 + static_cast<int>(layer); }
  int NormUnit() const { return 1 + static_cast<int>(config_.num_hidden_layers); }
  int LmHeadUnit() const { return config_.tie_word_embeddings ? 0 : NormUnit() + 1; }
  // The unit's parameters (shared storage), in NamedParameters' order.
  NamedTensors UnitParameters(int unit) const;
  // `gate` (borrowed; null, the default, = none) is called around every use of a unit's
  // parameters by ForwardHidden and its backward, and by LmHeadWeight. With a gate, each decoder
  // layer and the final norm are differentiated by the model itself (their gradients go to
  // ParameterGate::TakeGradients, not to .grad; the embedding's and lm_head's still reach .grad),
  // one whole-sequence forward runs at a time, and the KV-cache forwards refuse (TORCH_CHECK).
  // Not while a forward or backward runs.
  void SetParameterGate(ParameterGate* gate) { gate_ = gate; }
  ParameterGate* parameter_gate() const { return gate_; }

  // --- Incremental decoding (rollout). All run without autograd.
  // The KV-cache columns a forward over columns [0, total) attends to: `total`, or on the CPU in
  // bf16/fp16 `total` rounded up to kAttendColumnsBucket (at most `capacity`; the columns past
  // `total` blocked). oneDNN, which runs those matmuls there, compiles and caches a kernel for
  // every shape: one per context length made a decode's memory grow with each token (README
  // "bf16 on the CPU").
  int64_t AttendedColumns(int64_t total, int64_t capacity) const;
  static constexpr int64_t kAttendColumnsBucket = 64;
  // An empty cache for `batch` rows and up to `capacity` tokens per row (prompt + completion).
  KvCache NewCache(int64_t batch, int64_t capacity) const;
  // Appends ids [B, T] with mask [B, T] to `cache` and returns the logits [B, V] of the last
  // column (prompts are LEFT-padded so it is each row's last real token).
  // TORCH_CHECKs the shapes and that the cache has room.
  at::Tensor Prefill(const at::Tensor& ids, const at::Tensor& mask, KvCache& cache) const;
  // Row i of `cache` becomes rows i*g .. i*g+g-1 of the result (copies).
  KvCache ExpandCache(const KvCache& cache, int64_t g) const;
  // Appends one token per row: ids [B] -> logits [B, V]. Rows with row_active == false
  // ([B] bool; undefined = all active) store a masked column and keep their position; their
  // logits are finite garbage.
  at::Tensor DecodeStep(const at::Tensor& ids, KvCache& cache,
                        const at::Tensor& row_active = {}) const;
  // Keeps only rows `row_indices` ([B'] int64, in that order) so finished rows cost nothing.
  // InvalidArgument when an index is out of range.
  Status KeepRows(KvCache& cache, const at::Tensor& row_indices) const;
  // Row `row` of `cache` as a new one-row DENSE cache: its first `num_tokens` real columns
  // (key_mask true; padding and masked steps dropped), at columns [0, num_tokens), with length =
  // capacity = num_tokens and next_position = num_tokens (a row's k-th real token has RoPE
  // position k). Copies; `cache` is unchanged. TORCH_CHECKs the row and that it has that many.
  KvCache CompactRow(const KvCache& cache, int64_t row, int64_t num_tokens) const;
  // One cache of rows.size() rows and `capacity` columns to continue from: row i holds the first
  // num_tokens[i] columns of the dense one-row cache *rows[i] (CompactRow's; null or 0 = an
  // empty row), RIGHT-aligned at [L - num_tokens[i], L), L = max num_tokens, the columns before
  // masked out, and next_position num_tokens[i]; length L. Prefill then appends LEFT-padded ids
  // (each row's last column real) with each row's positions following its own tokens.
  // TORCH_CHECKs sizes, that capacity >= L and that each row has its num_tokens.
  KvCache StackRows(const std::vector<const KvCache*>& rows, const std::vector<int64_t>& num_tokens,
                    int64_t capacity) const;

 private:
  struct Layer {
    at::Tensor input_norm, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, q_norm, k_norm;
    at::Tensor post_norm, gate_w, up_w, down_w;
  };
  // Every tensor field of Layer, in a fixed order (the checkpointed layer's autograd inputs).
  static const std::vector<at::Tensor Layer::*>& LayerFields();
  friend class CheckpointedLayerFunction;
  friend class GatedUnitFunction;

  explicit Model(ModelConfig config) : config_(std::move(config)) {}
  // Sets params_ (order of ParameterShapes) and the typed handles below.
  void Bind(NamedTensors params);

  at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& w) const;
  // x [B, T, heads, hd]; cos and sin [B, T, 1, hd] from Forward, sin signed (its first half
  // negated: the rotation's sign).
  at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;
  // The attention mask every layer adds to its scores, from blocked [B, T, L] bool (true = may
  // not attend): [B, 1, 1, T, L], 0 or BlockedScore in the model's dtype; for half precision,
  // whose BlockedScore (-65504) a score added to could overflow, blocked itself (Attend writes
  // BlockedScore over those scores instead).
  at::Tensor AttentionMask(const at::Tensor& blocked) const;
  // q [B, H, T, hd]; k, v [B, KV, L, hd]; mask: AttentionMask's.
  at::Tensor Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& mask) const;
  // A shared prefix's keys and values in one layer (RunLayer of kSharedInputs): the prefix's
  // pass records them (post-RoPE); the suffixes' pass puts row i's prefix (rows[i]) before the
  // row's own.
  struct PrefixKv {
    bool record = true;
    at::Tensor keys, values;  // [U, KV, P, hd]
    at::Tensor rows;          // [B] int64
  };
  // Whole rows' RoPE positions (cumsum(mask) - 1, [B, T] int64) and blocked keys (a later
  // column, or padding: [B, T, T] bool) for mask [B, T] int64 (1 real, 0 pad).
  static std::pair<at::Tensor, at::Tensor> RowPositionsAndBlocked(const at::Tensor& mask);
  // The causal part of a mask: [T, past + T] bool, true where the key's column comes after the
  // query's (query i sits at column past + i). On `options`' device.
  // With `width` > past + T, [T, width]: the columns past the last query's blocked too.
  static at::Tensor LaterColumns(int64_t t, int64_t past, const at::TensorOptions& options,
                                 int64_t width = 0);
  // cos and sin [B, T, 1, hd] for positions [B, T] (sin signed: ApplyRope's).
  std::pair<at::Tensor, at::Tensor> RopeTables(const at::Tensor& positions) const;
  // One step over new tokens; when `cache` is set, keys/values are written at columns
  // [cache->length, cache->length + T) and attention spans the mask's columns (Extend's:
  // [0, AttendedColumns(length + T, capacity)), those past length + T blocked).
  at::Tensor Forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& blocked,
                     KvCache* cache, bool gradient_checkpointing = false) const;
  // Decoder layer `li` (weights `L`) on x [B, T, D]; cos/sin [B, T, 1, hd] (ApplyRope's); mask:
  // AttentionMask's; at most one of `cache` and `prefix`.
  at::Tensor LayerForward(const Layer& L, size_t li, const at::Tensor& x, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& mask, KvCache* cache,
                          PrefixKv* prefix = nullptr) const;
  // A layer's inputs that are not its weights: kSingleInputs = {x, cos, sin, mask} (one
  // stream of rows), kSharedInputs = {xp, xs, pcos, psin, pmask, scos, ssin, smask, rows} (a
  // shared prefix and its suffixes: ForwardSharedPrefix). The first LayerStreams of them are
  // the hidden states, differentiated; RunLayer returns one output per stream.
  static constexpr size_t kSingleInputs = 4, kSharedInputs = 9;
  static size_t LayerStreams(int64_t inputs) { return inputs == kSharedInputs ? 2 : 1; }
  std::vector<at::Tensor> RunLayer(const Layer& L, size_t li, at::TensorList in) const;
  // Unit `unit` on its inputs: a decoder layer on RunLayer's, the final norm on {x}.
  std::vector<at::Tensor> RunUnit(int unit, at::TensorList in) const;
  // The steps of a forward as the model runs them: behind its parameter gate (the unit acquired
  // around it, or GatedUnitFunction under grad mode), checkpointed (CheckpointedLayerFunction
  // under grad mode) or plain. Decoder layer `li` on RunLayer's inputs; the final norm on x;
  // the embedding of ids.
  std::vector<at::Tensor> LayerStep(size_t li, const std::vector<at::Tensor>& in,
                                    bool gradient_checkpointing) const;
  at::Tensor NormStep(const at::Tensor& x, bool gradient_checkpointing) const;
  at::Tensor Embed(const at::Tensor& ids) const;
  // Prefill/DecodeStep body: ids [B, T], mask [B, T] bool -> hidden [B, T, D].
  at::Tensor Extend(const at::Tensor& ids, const at::Tensor& mask, KvCache& cache) const;

  ModelConfig config_;
  NamedTensors params_;
  at::Tensor embed_, final_norm_, lm_head_;  // lm_head_ is embed_ when tied
  std::vector<Layer> layers_;
  at::Tensor rope_freq_;      // [head_dim] fp32: transformers' inv_freq [head_dim / 2] twice over
  at::Tensor rope_sin_sign_;  // [head_dim] fp32: -1 then +1 (ApplyRope's)
  ParameterGate* gate_ = nullptr;                 // borrowed
  std::shared_ptr<const ModelWeights> deferred_;  // LoadDeferred's files, until read or taken
};

}  // namespace grpo::common
