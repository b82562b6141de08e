#include "learner/distributed/memory_plan.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <numeric>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>

#include "common/malloc_info.h"

namespace grpo::learner::distributed {
namespace {

using common::FsdpMode;

// The weight-sync buckets: common::kDefaultBucketBytes (gloo, nccl) and ipc_bucket_bytes
// (cuda_ipc) of common/weight_sync/, and GetWeights' chunk (services/learner_service.h
// kDefaultWeightChunkBytes). Copied, not included, to keep libtorch and gRPC out of this file;
// memory_plan_test checks the first two against them.
constexpr int64_t kBucketBytes = 16ll << 20;
constexpr int64_t kCudaIpcBucketBytes = 256ll << 20;
constexpr int64_t kGetWeightsChunkBytes = 4ll << 20;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most distinct prompts a micro-batch of `rows` holds when a generation batch is whole groups
// of `g` rows in a row (GrpoTrainer): one that starts `o` rows into a group spans
// ceil((o + rows) / g) groups, o a multiple of gcd(rows, g) below g; at most `rows`.
int64_t DistinctPrompts(int64_t rows, int64_t g) {
  if (g < 2 || rows < 1) return std::max<int64_t>(rows, 0);
  return std::min(rows, CeilDiv(rows + g - std::gcd(rows, g), g));
}

bool IsCuda(const std::string& device) { return device.rfind("cuda", 0) == 0; }

// Saved-for-backward bytes of one decoder layer over one token, without checkpointing, read off
// Model::LayerForward (s = bytes of the compute dtype). RmsNorm keeps 8 bytes per element beyond
// its input in both precisions: fp32 x*rsqrt and the output; bf16 an fp32 copy of x, the bf16
// normed value and the output.
int64_t LayerTokenBytes(const common::ModelConfig& m, int64_t s) {
  const int64_t d = m.hidden_size, q = m.num_attention_heads * m.head_dim;
  const int64_t k = m.num_key_value_heads * m.head_dim, i = m.intermediate_size;
  int64_t bytes = s * d + 8 * d;  // the layer's input; input_layernorm
  // q: the projection, rotate_half(q) and the scaled, head-grouped copy Attend multiplies;
  // k: the projection, rotate_half(k) and the roped copy in the score matmul; v: its copy in the
  // value matmul.
  bytes += s * (3 * q + 4 * k);
  if (m.qk_norm) bytes += 8 * (q + k);  // q_norm, k_norm: RmsNorm over head_dim
  bytes += s * q;                       // the attention output, o_proj's input
  bytes += s * d + 8 * d;               // the residual after attention; post_attention_layernorm
  bytes += 4 * s * i;                   // gate, silu(gate), up, silu(gate) * up
  return bytes;
}

}  // namespace

ParameterCounts CountParameters(const common::ModelConfig& m) {
  const int64_t v = m.vocab_size, d = m.hidden_size, i = m.intermediate_size;
  const int64_t q = m.num_attention_heads * m.head_dim, k = m.num_key_value_heads * m.head_dim;
  ParameterCounts c;
  c.embedding = v * d;
  c.lm_head = m.tie_word_embeddings ? 0 : v * d;
  c.per_layer = q * d + 2 * k * d + d * q + 3 * i * d + 2 * d;  // q k v o, mlp, 2 norms
  if (m.attention_bias) c.per_layer += q + 2 * k;
  if (m.o_proj_bias()) c.per_layer += d;
  if (m.qk_norm) c.per_layer += 2 * m.head_dim;
  c.total = c.embedding + c.lm_head + m.num_hidden_layers * c.per_layer + d;  // + model.norm
  c.largest_tensor = std::max({v * d, i * d, q * d, k * d});
  c.largest_unit = std::max(c.per_layer, v * d);
  return c;
}

int64_t MemoryPlan::MicroBatchPeak() const {
  return std::max(
      activations() + std::max(lm_head_pass + gathered_lm_head, layer_backward() + gathered_layer),
      finish_backward);
}

int64_t MemoryPlan::ModelState() const {
  return parameters + gradients + master_weights + master_gradients + adamw_state + reference_model;
}

int64_t MemoryPlan::SecondMicroBatch() const {
  return micro_batch_threads > 1 ? MicroBatchPeak() + gradients : 0;
}

int64_t MemoryPlan::MicroBatchPhase() const { return MicroBatchPeak() + SecondMicroBatch(); }

int64_t MemoryPlan::TrainingPeak() const {
  return ModelState() + std::max({MicroBatchPhase(), optimizer_step, load});
}

int64_t MemoryPlan::Total() const {
  // Publishing copies the weights into a new snapshot while the last one is still held, on the
  // training thread between steps: a phase of its own, like the optimizer step.
  const int64_t phase =
      std::max({MicroBatchPhase(), optimizer_step, load, weight_snapshot, publish_unit});
  return ModelState() + weight_snapshot + weight_sync_bucket + runtime + phase;
}

StatusOr<MemoryPlan> PlanMemory(const common::ModelConfig& m, const common::GrpoConfig& cfg,
                                int world_size, const std::string& device) {
  if (world_size < 1) {
    return Status::InvalidArgument("world_size must be at least 1, got " +
                                   std::to_string(world_size));
  }
  if (device != "cpu" && !IsCuda(device)) {
    return Status::InvalidArgument("memory plan: device must be cpu or cuda, got '" + device + "'");
  }
  ASSIGN_OR_RETURN(const common::FsdpSpec fsdp, common::ParseFsdp(cfg.fsdp));
  MemoryPlan p;
  p.device = IsCuda(device) ? "cuda" : "cpu";
  p.model_type = m.model_type;
  p.vocab_size = m.vocab_size;
  p.world_size = world_size;
  p.fsdp = fsdp;
  p.bf16 = cfg.bf16;
  p.gradient_checkpointing = cfg.gradient_checkpointing;
  p.micro_batch_threads = cfg.micro_batch_threads;
  p.reference = cfg.beta != 0;
  p.params = CountParameters(m);
  const bool cuda = p.device == "cuda";
  const int64_t w = world_size, n = p.params.total, s = cfg.bf16 ? 2 : 4;
  // ZeRO stages: shard_grad_op divides gradients and optimizer state (and the fp32 master) over
  // the ranks, full_shard the parameters too; with one rank sharding is the identity.
  const bool sharded = fsdp.mode != FsdpMode::kNoShard && w > 1;
  const bool full = fsdp.mode == FsdpMode::kFullShard && w > 1;
  const bool offload = fsdp.offload && cuda;
  // full_shard as built gathers units (FullShardAdamW): at several ranks, or offloaded at any.
  const bool gathers = fsdp.mode == FsdpMode::kFullShard && (full || offload);
  // no_shard / shard_grad_op offload as built: the fp32 master on the host, a compute copy on
  // the GPU (step_optimizer.h HostsMaster).
  const bool host_master = offload && fsdp.mode != FsdpMode::kFullShard;
  // shard_grad_op's fp32 master in 1/W chunks beside a compute copy (bf16, or the host master):
  // ShardedAdamW as built (step_optimizer.h ShardsMasterBesideCopy).
  const bool master_chunks =
      fsdp.mode == FsdpMode::kShardGradOp && w > 1 && (cfg.bf16 || host_master);
  auto shard = [&](int64_t bytes, bool divided) { return divided ? CeilDiv(bytes, w) : bytes; };
  // shard_grad_op's flat fp32 bucket (sharded_adamw.h): 25 MiB at most, a larger tensor alone.
  const int64_t zero2_bucket =
      std::max(std::min(kGradientBucketBytes, 4 * n), 4 * p.params.largest_tensor);

  p.parameters = shard(s * n, full);
  p.gradients = shard(s * n, sharded);
  const int64_t master = cfg.bf16 ? shard(4 * n, sharded) : 0;
  const int64_t adamw = shard(8 * n, sharded);
  // AdamW's step and the fp64 grad-norm copy (ClipGradNorm) take one tensor at a time: 8 bytes
  // per element of the largest (sqrt(v) and its quotient; or the fp64 copy).
  const int64_t temporaries = shard(8 * p.params.largest_tensor, sharded);
  // Data parallel (no_shard at several ranks): the gradients are summed over the ranks in flat
  // buckets before the step (learner/distributed/collectives.h BucketedAllReduceSum).
  const int64_t all_reduce = fsdp.mode == FsdpMode::kNoShard && w > 1 ? kGradientBucketBytes : 0;
  const int64_t step = std::max(temporaries, all_reduce);
  if (!offload) {
    p.master_weights = master;
    p.master_gradients = master;
    p.adamw_state = adamw;
    p.optimizer_step = step;
  }
  if (host_master) {
    // no_shard / shard_grad_op offload as built (ZeRO-Offload; step_optimizer.h HostsMaster):
    // on the host the fp32 master (whole with no_shard; shard_grad_op's 1/W chunks, as
    // ZeRO-Offload partitions it), its fp32 gradient (whole with no_shard, which adds each
    // micro-batch's into it; shard_grad_op's 1/W shard), AdamW's state (1/W with shard_grad_op)
    // and the step's temporaries. On the GPU the compute copy, whole; with no_shard its gradient
    // (kept between micro-batches, zeroed), summed over the ranks a 25 MiB bucket at a time
    // staged on the GPU; shard_grad_op's fresh gradients go into their fp32 bucket on the GPU as
    // without offload (below) and to the host chunk by chunk, its step all-gathers a bucket in
    // the compute dtype on the GPU beside this rank's chunk of it. shard_grad_op's load phase:
    // from model_name_or_path each rank reads its master's chunks from the files and the copy a
    // tensor at a time (through the host in the file's dtype); built in memory the whole fp32
    // model on the host, its chunks cut from rank 0's a bucket at a time (the flat bucket of
    // the broadcast on the GPU), then freed.
    // With bf16 a tensor that crosses (no_shard: a gradient to the host, the master into the
    // copy) is converted on the GPU: one tensor in fp32 there.
    p.parameters = s * n;
    p.gradients = sharded ? 0 : s * n;
    p.host_offloaded = 2 * shard(4 * n, sharded) + adamw + temporaries;
    const int64_t cast = cfg.bf16 ? 4 * p.params.largest_tensor : 0;
    if (sharded) {
      const int64_t gather = zero2_bucket / 4 * s;
      p.gathered_layer = std::min(kGradientBucketBytes, 4 * n);
      p.optimizer_step = gather + CeilDiv(gather, w);
      if (cfg.model_name_or_path.empty()) {
        p.load = zero2_bucket;
        p.host_load = 4 * n;
      } else {
        // Sharded loading: the copy read a tensor at a time (each in the file's dtype on the
        // host first, fp32 at most) before the host's shards exist, then this rank's chunks of
        // the master straight from the files: beyond those shards only a larger tensor.
        p.host_load =
            std::max<int64_t>(0, 4 * p.params.largest_tensor - (p.host_offloaded - temporaries));
      }
    } else {
      p.optimizer_step = std::max(all_reduce, cast);
    }
  } else if (offload && fsdp.mode == FsdpMode::kFullShard) {
    // full_shard offload as built (full_shard_adamw.h), at any world size: the four fp32 shards
    // (the master, its gradient, AdamW's moments: 16 bytes a parameter over the ranks) and the
    // step (AdamW's temporaries and the fp64 norm copy of one unit's chunk) on the host; the
    // GPU holds no model state between uses, only the gathered unit: its weights and gradient
    // in the compute dtype, and with bf16 the fp32 flat the gradient is reduced in.
    p.parameters = 0;
    p.gradients = 0;
    p.host_offloaded = CeilDiv(16 * n, w) + 8 * CeilDiv(p.params.largest_unit, w);
  } else if (full && cfg.bf16) {
    // full_shard with bf16 as built (full_shard_adamw.h): no bf16 copy lives between uses; the
    // fp32 shard is the master and the fp32 gradient shard its gradient (above).
    p.parameters = 0;
    p.gradients = 0;
  }
  // What sharding holds beside one micro-batch, in each of its two phases (MicroBatchPeak): the
  // units gathered beside the LM-head pass, and beside one layer's backward. Measured against
  // the live bytes of each rank in memory_plan_test (MemoryPlanRanks): counted once beside the
  // whole micro-batch, the LM head's gradient was counted twice and a prefetched unit as large
  // as the LM head, 1.2-1.3x the live peak of this project's bench model.
  const int64_t head = p.params.embedding;  // the LM head's [V, D], tied or not
  if (gathers) {
    // full_shard as built (full_shard_adamw.h, Model::GatedForward): the LM head's unit is
    // gathered for the head and stays whole until the micro-batch's backward ends
    // (FinishBackward). The head's gradient is the LM-head pass's [V, D] accumulator, and then
    // is held through every layer's backward: by autograd when tied (layer_backward's `held`),
    // as the head's .grad when not. A layer's backward holds the layer whole, the gradients
    // autograd returns, the fp32 flat they are packed into to be reduce-scattered
    // and, with the prefetch (fsdp_prefetch), the layer before it, gathered.
    const int64_t flat = 4;  // packed in the fp32 master's dtype (FullShardAdamW::Pack)
    const int64_t prefetch = cfg.fsdp_prefetch ? s : 0;
    p.gathered_lm_head = s * head;
    p.gathered_layer = s * head + (m.tie_word_embeddings ? 0 : s * head) +
                       (2 * s + flat + prefetch) * p.params.per_layer;
    // After the backward (FinishBackward), with the activations freed: the head's unit still
    // whole, the .grad of the units autograd accumulates (the head, and the embedding when
    // untied: both [V, D]) and the fp32 flat the first is packed into for its reduce-scatter.
    // Larger than the phases above only when the activations are small beside s x V x D.
    p.finish_backward = s * head + (m.tie_word_embeddings ? 1 : 2) * s * head + 4 * head;
  } else if (sharded && !offload) {
    // shard_grad_op as built (sharded_adamw.h): AdamW's state and the fp32 gradient shard the
    // rounds sum into are 1/W; during backward each tensor's fresh gradient (layer_backward
    // counts it) is moved into its fp32 bucket and the bucket reduced once whole: one bucket in
    // flight beside a layer's backward (at most 25 MiB; a tensor alone needs no copy). The
    // LM head's gradient is the LM-head pass's accumulator. The weights stay whole on every
    // rank; with bf16 the fp32 master is 1/W too (ZeRO-2 with mixed precision) and has no
    // .grad. The step: one flat bucket of the all-gather (a larger tensor alone) and three of
    // its chunks (the rank's weights, sqrt(v) and the denominator; the fp64 norm copy is two);
    // with bf16 the rank's chunk is updated in place, cast to bf16 and all-gathered in bf16.
    // Loading with bf16 built in memory: the whole fp32 model beside the state until the
    // chunks are cut from rank 0's, a bucket at a time (its flat fp32 buffer of the broadcast).
    p.gradients = CeilDiv(4 * n, w);
    p.master_weights = cfg.bf16 ? CeilDiv(4 * n, w) : 0;
    p.master_gradients = 0;
    p.gathered_layer = std::min(kGradientBucketBytes, 4 * n);
    if (cfg.bf16) {
      const int64_t gather = zero2_bucket / 2;
      p.optimizer_step = gather + CeilDiv(gather, w) + 2 * CeilDiv(zero2_bucket, w);
      // From model_name_or_path (sharded loading): the bf16 copy read a tensor at a time (each
      // in the file's dtype first, fp32 at most) before the optimizer's shards exist, then this
      // rank's chunks of the master straight from the files: beyond the shards only a larger
      // tensor (memory_plan_test measures the state alone). Built in memory: the whole fp32
      // model beside the state.
      const int64_t shards = p.gradients + p.master_weights + p.adamw_state;
      p.load = cfg.model_name_or_path.empty()
                   ? 4 * n + zero2_bucket
                   : std::max<int64_t>(0, 4 * p.params.largest_tensor - shards);
    } else {
      p.optimizer_step = zero2_bucket + 3 * CeilDiv(zero2_bucket, w);
    }
  }
  // Loading (full_shard as built: GrpoTrainer::Create, FullShardAdamW::Create, and first the
  // reference's FrozenShards::Create), a phase of its own. From model_name_or_path (sharded
  // loading, Model::LoadDeferred): each rank reads only its chunk of each unit from the files
  // straight into its shard, and holds beside the shards one unit's buffer in the compute
  // dtype, which the unit's parameters become views of before it is freed. A model built in
  // memory (no model_name_or_path: the tiny preset, the benches) is whole on every rank (fp32,
  // and with bf16 its compute copy) until the shards are cut from rank 0's, broadcast a unit at
  // a time: the unit packed in fp32 (on the host with offload), freed before that buffer is
  // made; a reference built in memory is whole beside the whole fp32 policy until it is
  // sharded (with bf16 its fp32 values beside the bf16 ones while it is cast; the unit packed
  // in its dtype otherwise). Measured in memory_plan_test (MemoryPlanRanks) but for the
  // reference built in memory, an upper bound.
  p.sharded_loading = (gathers || master_chunks) && !cfg.model_name_or_path.empty();
  if (p.sharded_loading && gathers) {
    p.load = s * p.params.largest_unit;
  } else if (gathers) {
    p.load = 4 * n + (cfg.bf16 ? 2 * n : 0) + (offload ? s : 4) * p.params.largest_unit;
    if (p.reference) {
      p.load = std::max(p.load, 4 * n + (cfg.bf16 ? 6 * n : 4 * n + 4 * p.params.largest_unit));
    }
  }
  // Streaming the weights from full_shard (StreamWeights) gathers one unit at a time in fp32;
  // from shard_grad_op's sharded master (bf16, or offload) one bucket in fp32.
  if (cfg.weight_publish == "stream" && gathers) {
    p.publish_unit = 4 * p.params.largest_unit;
  } else if (cfg.weight_publish == "stream" && master_chunks) {
    p.publish_unit = zero2_bucket;
  }
  // The reference model (beta != 0), frozen in the compute dtype: whole on every rank, or where
  // full_shard gathers the policy's units, 1/W of it a rank (FrozenShards: on the host with
  // offload). Its gathered units are used in its own no-grad forwards, with none of the
  // policy's gathered: within the micro-batch phases above.
  if (p.reference) {
    if (!gathers) {
      p.reference_model = s * n;
    } else if (offload) {
      p.host_offloaded += CeilDiv(s * n, w);
    } else {
      p.reference_model = CeilDiv(s * n, w);
    }
  }

  // Weights published for rollout workers (learner/learner.cc PublishWeights): fp32 CPU tensors
  // always, and a copy on the GPU while a worker takes them over NCCL or CUDA IPC. With
  // `weight_publish: stream` none: each reader (a GetWeights call, a weight-sync group) is
  // handed the policy's tensors a tensor at a time (with full_shard, of the gathered unit the
  // model state counts).
  const std::string& backend = cfg.weight_sync_backend;
  const bool gpu_backend = backend == "nccl" || backend == "cuda_ipc" || backend == "auto";
  if (cuda) {
    p.runtime = kCudaRuntimeBytes;
    p.host_weight_snapshot = 2 * 4 * n;  // the published version and the next one being copied
    if (gpu_backend) p.weight_snapshot = 4 * n;
    if (backend == "cuda_ipc" || backend == "auto") {
      p.weight_sync_bucket = kCudaIpcBucketBytes;
    } else if (backend == "nccl") {
      p.weight_sync_bucket = kBucketBytes;
    }
    p.host_other = kHostRuntimeBytes + (backend == "grpc" ? kGetWeightsChunkBytes
                                        : gpu_backend     ? 0
                                                          : kBucketBytes);
  } else {
    p.runtime = kHostRuntimeBytes;
    p.weight_snapshot = 4 * n;
    p.weight_sync_bucket = backend == "grpc" ? kGetWeightsChunkBytes : kBucketBytes;
  }
  p.streams_weights = cfg.weight_publish == "stream";
  if (p.streams_weights) {
    // The groups' buckets stay (a tensor is broadcast from its own memory, or staged); the
    // snapshots go. From a GPU each tensor is copied to the host once for the CPU readers.
    p.weight_snapshot = 0;
    p.host_weight_snapshot = cuda ? 4 * p.params.largest_tensor : 0;
  }

  // One micro-batch: rows padded to the longest prompt and completion (common::Model forward,
  // GrpoTrainer's MakeMicroBatch); the worst case is both at their maximum. These products of
  // the run's sizes (B x H x T x T x layers ...) can pass 2^63 within the configs' bounds, so they
  // are formed in 128 bits, exactly, and each figure refused when it passes kMaxPlanBytes.
  p.micro_batch_rows = cfg.per_device_train_batch_size;
  p.prompt_length = cfg.max_prompt_length;
  p.completion_length = cfg.max_completion_length;
  p.sequence_tokens = cfg.max_prompt_length + cfg.max_completion_length;
  p.completion_tokens = cfg.per_device_train_batch_size * cfg.max_completion_length;
  p.chunk_tokens = std::min(cfg.logprob_chunk_tokens, p.completion_tokens);
  p.distinct_prompts = DistinctPrompts(cfg.per_device_train_batch_size, cfg.num_generations);
  using Wide = __int128;
  const Wide b = p.micro_batch_rows, t = p.sequence_tokens;
  const Wide d = m.hidden_size, v = m.vocab_size, l = m.num_hidden_layers;
  const Wide h = m.num_attention_heads, ws = s;
  // The rows' streams through the layers (Model::ForwardSharedPrefix): the distinct prompts
  // once, then the completions but their last token after them, each query over its prompt's
  // keys and its own; rows of their own prompts (G = 1) whole. `keys` per query.
  struct Stream {
    Wide rows, tokens, keys;
  };
  std::vector<Stream> streams = {{b, t, t}};
  if (p.distinct_prompts < p.micro_batch_rows) {
    const Wide u = p.distinct_prompts, pl = p.prompt_length, sl = p.completion_length - 1;
    streams = {{u, pl, pl}};
    if (sl > 0) streams.push_back({b, sl, pl + sl});
  }
  Wide tokens = 0, mask_cells = 0, widest = 0, joined_keys = 0;
  for (const Stream& st : streams) {
    tokens += st.rows * st.tokens;
    mask_cells += st.rows * st.tokens * st.keys;  // [B, T, keys]
    // A layer's backward, one stream at a time: the gradients of the probabilities and scores
    // (fp32) or of the MLP's [B, T, I] tensors, whichever is larger.
    widest = std::max<Wide>({widest, 8 * st.rows * h * st.tokens * st.keys,
                             3 * ws * st.rows * st.tokens * m.intermediate_size});
    // A suffix's prompt keys and values joined to its own: each row's copy of them, which the
    // score and value matmuls keep.
    joined_keys += st.rows * (st.keys - st.tokens);
  }
  // Attention probabilities [B, H, T, keys]: fp32 softmax output, plus its bf16 copy with bf16.
  const Wide scores = h * mask_cells;
  const Wide kv_width = static_cast<Wide>(m.num_key_value_heads) * m.head_dim;
  const Wide layer = tokens * LayerTokenBytes(m, s) + scores * (cfg.bf16 ? 6 : 4) +
                     2 * ws * joined_keys * kv_width;
  // Shared by every layer: the blocked-key mask [B, T, keys] bool and the attention mask made of
  // it in the compute dtype (Model::AttentionMask), cos and sin [B, T, 1, hd], the int64 ids,
  // mask and labels of the padded rows. The final norm keeps the last hidden state and 8 bytes
  // more: of every position, or with shared prompts of the positions that predict.
  const Wide padded = b * t;
  const Wide shared = mask_cells * (1 + ws) + 2 * tokens * m.head_dim * ws + 3 * 8 * padded;
  const Wide normed = streams.size() > 1 ? b * p.completion_length : tokens;
  const Wide final_norm = normed * (ws * d + 8 * d);
  // Backward of one layer: `widest` above, the incoming and outgoing [B, T, D] gradients and a
  // weight's fresh gradient before it is added into .grad. A recomputed layer (checkpointing)
  // holds its activations again and returns all its weights' gradients at once. With tied
  // embeddings autograd holds the LM head's [V, D] gradient until the embedding's arrives (one
  // AccumulateGrad, two inputs): through every layer's backward.
  const Wide vd = v * d;
  const Wide largest_layer_weight =
      std::max(m.intermediate_size, m.num_attention_heads * m.head_dim) * d;
  const Wide held = (m.tie_word_embeddings ? ws * vd : 0) + 2 * ws * tokens * d;
  // The fused LM head (learner/chunked_logprobs.cc). Per chunk one fp32 [c, V] buffer and a
  // [64, V] fp32 block of exp() beside it; with bf16 also the bf16 matmul output it is upcast
  // from (and later the bf16 copy of dL/dz). Beside the chunks: the flattened hidden states and
  // their gradient [N, D] and the fp32 [V, D] weight-gradient accumulator (and its bf16 copy,
  // saved for backward); backward scales the saved [V, D] gradient into a new tensor.
  const Wide c = p.chunk_tokens;
  const Wide logits_chunk =
      std::max<Wide>(cfg.bf16 ? 6 * c * v : 0, 4 * c * v + 4 * std::min<Wide>(64, c) * v);
  const Wide hidden_n = 2 * ws * p.completion_tokens * d;
  const std::pair<const char*, Wide> figures[] = {
      {"activations_no_checkpointing", l * layer + shared + final_norm},
      {"activations_checkpointing", l * tokens * ws * d + shared + final_norm},
      {"layer_backward_no_checkpointing", widest + held + ws * largest_layer_weight},
      {"layer_backward_checkpointing", layer + widest + held + ws * p.params.per_layer},
      {"logits_chunk", logits_chunk},
      {"lm_head_pass",
       std::max<Wide>(hidden_n + 4 * vd + logits_chunk, hidden_n + (cfg.bf16 ? 6 * vd : 8 * vd))},
  };
  int64_t* const fields[] = {&p.activations_no_checkpointing,
                             &p.activations_checkpointing,
                             &p.layer_backward_no_checkpointing,
                             &p.layer_backward_checkpointing,
                             &p.logits_chunk,
                             &p.lm_head_pass};
  for (size_t i = 0; i < std::size(figures); ++i) {
    if (figures[i].second > kMaxPlanBytes) {
      return Status::InvalidArgument(
          std::string("memory plan: ") + figures[i].first + " of one micro-batch (" +
          std::to_string(p.micro_batch_rows) + " rows of " + std::to_string(p.sequence_tokens) +
          " tokens) is more than " + FormatBytes(kMaxPlanBytes) +
          ", beyond any device: lower per_device_train_batch_size, max_prompt_length or "
          "max_completion_length");
    }
    *fields[i] = static_cast<int64_t>(figures[i].second);
  }
  // A loss that couples tokens leaves the fused path: grpo_loss.h TokenSeparable with `old`
  // computed (without it a sequence-level IS weight is decided per batch), spelt from the config
  // here to keep libtorch out of this file; memory_plan_test checks the two agree.
  const char* coupled = cfg.importance_sampling_level != "token"
                            ? "importance_sampling_level sequence"
                        : cfg.loss_type == "vespo"      ? "loss_type vespo"
                        : cfg.off_policy_mask_threshold ? "off_policy_mask_threshold"
                        : cfg.top_entropy_quantile < 1  ? "top_entropy_quantile"
                                                        : nullptr;
  if (coupled != nullptr) {
    p.notes.push_back(std::string(coupled) +
                      ": the LM head runs through autograd "
                      "(ChunkedTokenLogprobs); its buffers are planned as the fused path's, about "
                      "the same");
  }

  if (!sharded && w > 1) {
    p.notes.push_back("fsdp " + std::string(common::FsdpModeName(fsdp.mode)) + " with " +
                      std::to_string(w) + " ranks: every rank holds the whole model state");
  }
  if (fsdp.mode != FsdpMode::kNoShard && w == 1 &&
      !(offload && fsdp.mode == FsdpMode::kFullShard)) {
    p.notes.push_back("fsdp " + std::string(common::FsdpModeName(fsdp.mode)) +
                      " with 1 rank shards nothing (it is no_shard)");
  }
  if (host_master) {
    p.notes.push_back(
        "offload with " + std::string(common::FsdpModeName(fsdp.mode)) +
        ": the fp32 master, its gradient and AdamW's state on the host; a compute copy of the "
        "weights on the GPU, its gradients copied to the host after each micro-batch");
  }
  if (!cuda) {
    // `grpo bench sharding` (2026-12-07, README "Sharding, measured"): the live tensor bytes
    // were 0.977-0.991x the plan in every row. A rank's own memory (its resident set less the
    // pages of files) was 1.02-1.04x in fp32 and 1.07-1.19x in bf16 (three runs; the 4-rank
    // bf16 rows moved by up to 8 MiB between runs) with grpo-torch's MappedCpuAllocator, the
    // resident set 1.10-1.34x with libtorch's code (20-26 MiB); on tcmalloc alone it was
    // 1.15-1.57x, on glibc's malloc 1.27-1.91x (both keep freed blocks where they are, and take
    // new pages for a larger one; memory_plan_test: 0.98-1.02x with MALLOC_MMAP_THRESHOLD_=131072,
    // which cost the step 30% of its speed).
    const std::string malloc_name = common::MallocName();
    if (common::CpuAllocatorName() == "mapped") {
      p.notes.push_back(
          "cpu: live bytes; a rank's own memory ran at 1.02-1.04x the training peak in fp32, "
          "1.07-1.19x in bf16, its resident set at 1.1-1.34x with libtorch's code (grpo bench "
          "sharding)");
    } else {
      p.notes.push_back(malloc_name == "tcmalloc"
                            ? "cpu: live bytes; tcmalloc's free blocks and libtorch's code put a "
                              "rank's resident set at 1.1-1.6x the training peak (grpo bench "
                              "sharding, GRPO_CPU_ALLOCATOR=malloc)"
                            : "cpu: live bytes; under " + malloc_name +
                                  "'s malloc a rank's resident set ran to 1.3-1.9x the training "
                                  "peak (the freed blocks it keeps; grpo links tcmalloc)");
    }
    if (p.bf16) {
      // Not a term: how many kernels a run compiles depends on its lengths, not on config.json.
      p.notes.push_back(
          "cpu, bf16: oneDNN keeps a compiled kernel per matmul shape; over a run's many lengths "
          "they held ~230 MiB above fp32 (grpo train-local, 300 steps), inside the runtime term "
          "(README \"bf16 on the CPU\")");
    }
  }
  if (!cuda && fsdp.offload) {
    p.notes.push_back("device cpu: offload changes nothing (the device memory is host memory)");
  }
  if (cuda && gpu_backend) {
    p.notes.push_back("weight_sync_backend " + backend +
                      ": a fp32 copy of the weights on the GPU for NCCL / CUDA IPC workers");
  }
  if (w > 1) p.notes.push_back("planned for rank 0, which also serves the weights");
  return p;
}

nlohmann::json MemoryPlan::ToJson() const {
  nlohmann::json j;
  j["device"] = device;
  j["world_size"] = world_size;
  j["fsdp"] = std::string(common::FsdpModeName(fsdp.mode)) + (fsdp.offload ? " offload" : "");
  j["bf16"] = bf16;
  j["gradient_checkpointing"] = gradient_checkpointing;
  j["micro_batch_threads"] = micro_batch_threads;
  j["micro_batch_rows"] = micro_batch_rows;
  j["sequence_tokens"] = sequence_tokens;
  j["completion_tokens"] = completion_tokens;
  j["distinct_prompts"] = distinct_prompts;
  j["chunk_tokens"] = chunk_tokens;
  j["num_parameters"] = params.total;
  nlohmann::json c;
  c["parameters"] = parameters;
  c["gradients"] = gradients;
  c["master_weights"] = master_weights;
  c["master_gradients"] = master_gradients;
  c["adamw_state"] = adamw_state;
  c["gathered_lm_head"] = gathered_lm_head;
  c["gathered_layer"] = gathered_layer;
  c["finish_backward"] = finish_backward;
  c["load"] = load;
  j["sharded_loading"] = sharded_loading;
  c["publish_unit"] = publish_unit;
  c["reference_model"] = reference_model;
  j["weight_publish"] = streams_weights ? "stream" : "snapshot";
  c["weight_snapshot"] = weight_snapshot;
  c["weight_sync_bucket"] = weight_sync_bucket;
  c["runtime"] = runtime;
  c["activations_no_checkpointing"] = activations_no_checkpointing;
  c["activations_checkpointing"] = activations_checkpointing;
  c["logits_chunk"] = logits_chunk;
  c["lm_head_pass"] = lm_head_pass;
  c["layer_backward"] = layer_backward();
  c["micro_batch_peak"] = MicroBatchPeak();
  c["optimizer_step"] = optimizer_step;
  j["components"] = c;
  j["model_state_bytes"] = ModelState();
  j["training_peak_bytes"] = TrainingPeak();
  j["total_bytes"] = Total();
  j["host"] = {{"offloaded", host_offloaded},
               {"load", host_load},
               {"weight_snapshot", host_weight_snapshot},
               {"other", host_other},
               {"total_bytes", HostTotal()}};
  j["notes"] = notes;
  return j;
}

std::string Suggestion::Text() const {
  std::string out;
  for (size_t i = 0; i < changes.size(); ++i) {
    const ConfigChange& c = changes[i];
    out += i == 0 ? "" : (i + 1 == changes.size() ? " and " : ", ");
    if (c.key == "world_size") {
      out += "run " + c.value + " ranks (world_size " + c.value + ")";
    } else {
      out += (i == 0 ? "set " : "") + c.key + ": " + c.value;
    }
  }
  return out;
}

namespace {

// The knobs SuggestFix turns, in its order of preference.
// shard_grad_op before full_shard: it gathers no weights (less communication), so it is the one
// to take when both fit; at the ranks' own count full_shard usually needs fewer ranks.
// weight_publish stream after the batch: it changes no number the step computes, and costs
// the training thread the time each version streams, not every step's.
enum Knob {
  kCheckpointing,
  kBatch,
  kStream,
  kShardGradOp,
  kFullShard,
  kOffload,
  kRanks,
  kNumKnobs
};

struct Candidate {
  common::GrpoConfig config;
  int world_size = 1;
};

StatusOr<bool> CandidateFits(const common::ModelConfig& m, const Candidate& c,
                             const std::string& device, int64_t device_bytes,
                             const SuggestOptions& o, MemoryPlan* out) {
  ASSIGN_OR_RETURN(MemoryPlan p, PlanMemory(m, c.config, c.world_size, device));
  *out = std::move(p);
  const bool host_ok =
      o.host_bytes <= 0 || out->device != "cuda" || out->HostTotal() <= o.host_bytes;
  return out->Fits(device_bytes) && host_ok;
}

// `base` with per_device_train_batch_size b (a divisor of the original), the accumulation (and
// steps_per_generation when set) scaled to keep the optimizer and generation batches.
common::GrpoConfig WithBatch(const common::GrpoConfig& base, int64_t b) {
  common::GrpoConfig c = base;
  const int64_t k = base.per_device_train_batch_size / b;
  c.per_device_train_batch_size = b;
  c.gradient_accumulation_steps = base.gradient_accumulation_steps * k;
  if (base.steps_per_generation) c.steps_per_generation = *base.steps_per_generation * k;
  return c;
}

// Applies the knobs in `mask` to (config, world_size); the batch and the ranks take the least
// change that fits (the largest batch, the fewest ranks), else their extreme. Sets *fits.
StatusOr<Suggestion> TryKnobs(const common::ModelConfig& m, const common::GrpoConfig& config,
                              int world_size, const std::string& device, int64_t device_bytes,
                              const SuggestOptions& o, unsigned mask, bool* fits) {
  ASSIGN_OR_RETURN(common::FsdpSpec fsdp, common::ParseFsdp(config.fsdp));
  Candidate base{config, world_size};
  if (mask & (1u << kCheckpointing)) base.config.gradient_checkpointing = true;
  if (mask & (1u << kStream)) base.config.weight_publish = "stream";
  if (mask & (1u << kShardGradOp)) fsdp.mode = common::FsdpMode::kShardGradOp;
  if (mask & (1u << kFullShard)) fsdp.mode = common::FsdpMode::kFullShard;
  if (mask & (1u << kOffload)) fsdp.offload = true;
  base.config.fsdp =
      std::string(common::FsdpModeName(fsdp.mode)) + (fsdp.offload ? " offload" : "");
  *fits = false;
  Suggestion best;
  // More ranks divide nothing without sharding.
  if ((mask & (1u << kRanks)) && fsdp.mode == common::FsdpMode::kNoShard) return best;

  std::vector<int> worlds = {world_size};
  if (mask & (1u << kRanks)) {
    worlds.clear();
    for (int w2 = world_size + 1; w2 <= kMaxSuggestedWorldSize; ++w2) worlds.push_back(w2);
  }
  std::vector<int64_t> batches = {config.per_device_train_batch_size};
  if (mask & (1u << kBatch)) {
    batches.clear();
    for (int64_t b = config.per_device_train_batch_size - 1; b >= 1; --b) {
      if (config.per_device_train_batch_size % b == 0) batches.push_back(b);
    }
  }
  for (int w2 : worlds) {
    for (int64_t b : batches) {
      Candidate c = base;
      c.world_size = w2;
      if (mask & (1u << kBatch)) c.config = WithBatch(base.config, b);
      if (!c.config.Validate().ok()) continue;
      ASSIGN_OR_RETURN(bool ok, CandidateFits(m, c, device, device_bytes, o, &best.plan));
      if (!ok) continue;
      *fits = true;
      if (mask & (1u << kCheckpointing)) best.changes.push_back({"gradient_checkpointing", "true"});
      if (mask & (1u << kBatch)) {
        best.changes.push_back({"per_device_train_batch_size", std::to_string(b)});
        best.changes.push_back(
            {"gradient_accumulation_steps", std::to_string(c.config.gradient_accumulation_steps)});
        if (c.config.steps_per_generation) {
          best.changes.push_back(
              {"steps_per_generation", std::to_string(*c.config.steps_per_generation)});
        }
      }
      if (mask & (1u << kStream)) best.changes.push_back({"weight_publish", "stream"});
      if (mask & ((1u << kShardGradOp) | (1u << kFullShard) | (1u << kOffload))) {
        best.changes.push_back({"fsdp", c.config.fsdp});
      }
      if (mask & (1u << kRanks)) best.changes.push_back({"world_size", std::to_string(w2)});
      return best;
    }
  }
  return best;
}

}  // namespace

StatusOr<Suggestion> SuggestFix(const common::ModelConfig& m, const common::GrpoConfig& config,
                                int world_size, const std::string& device, int64_t device_bytes,
                                const SuggestOptions& o) {
  MemoryPlan current;
  ASSIGN_OR_RETURN(const bool fits_now, CandidateFits(m, Candidate{config, world_size}, device,
                                                      device_bytes, o, &current));
  if (fits_now) return Suggestion{{}, current};
  // Knobs that can change anything here.
  unsigned usable = 0;
  if (!config.gradient_checkpointing) usable |= 1u << kCheckpointing;
  if (config.per_device_train_batch_size > 1) usable |= 1u << kBatch;
  if (config.weight_publish != "stream") usable |= 1u << kStream;
  if (current.fsdp.mode == common::FsdpMode::kNoShard) usable |= 1u << kShardGradOp;
  if (current.fsdp.mode != common::FsdpMode::kFullShard) usable |= 1u << kFullShard;
  if (!current.fsdp.offload && current.device == "cuda") usable |= 1u << kOffload;
  usable |= 1u << kRanks;
  // Subsets of the knobs, fewest first, then in the order of preference (the lowest knob first).
  std::vector<unsigned> masks;
  for (unsigned mask = 1; mask < (1u << kNumKnobs); ++mask) {
    const unsigned both = (1u << kShardGradOp) | (1u << kFullShard);  // one mode at a time
    if ((mask & usable) == mask && (mask & both) != both) masks.push_back(mask);
  }
  std::stable_sort(masks.begin(), masks.end(), [](unsigned a, unsigned b) {
    const int pa = __builtin_popcount(a), pb = __builtin_popcount(b);
    if (pa != pb) return pa < pb;
    // Lexicographic over the knobs in order: the subset holding the earlier knob first.
    for (int k = 0; k < kNumKnobs; ++k) {
      const bool ia = a & (1u << k), ib = b & (1u << k);
      if (ia != ib) return ia;
    }
    return false;
  });
  // More ranks cost machines: every change without them first; then, of those with them, the
  // one that needs the fewest ranks (fewest knobs, then the order, on a tie).
  std::optional<Suggestion> with_ranks;
  for (unsigned mask : masks) {
    bool fits = false;
    ASSIGN_OR_RETURN(Suggestion s,
                     TryKnobs(m, config, world_size, device, device_bytes, o, mask, &fits));
    if (!fits) continue;
    if (!(mask & (1u << kRanks))) return s;
    if (!with_ranks || s.plan.world_size < with_ranks->plan.world_size) with_ranks = std::move(s);
  }
  if (with_ranks) return *std::move(with_ranks);
  // Nothing fits: say what every knob at its extreme still needs.
  Candidate floor{WithBatch(config, 1), kMaxSuggestedWorldSize};
  floor.config.gradient_checkpointing = true;
  floor.config.weight_publish = "stream";
  floor.config.fsdp = current.device == "cuda" ? "full_shard offload" : "full_shard";
  MemoryPlan least;
  RETURN_IF_ERROR(CandidateFits(m, floor, device, device_bytes, SuggestOptions{}, &least).status());
  std::string msg = "no change fits " + FormatBytes(device_bytes) +
                    " per rank: with gradient_checkpointing, 1 row, weight_publish stream, " +
                    floor.config.fsdp + " and " + std::to_string(kMaxSuggestedWorldSize) + " ranks";
  msg += " a rank still needs " + FormatBytes(least.Total());
  return Status::NotFound(msg);
}

Status CheckFitsDevice(const common::ModelConfig& m, const common::GrpoConfig& config,
                       int world_size, const std::string& device, int64_t device_bytes) {
  if (device_bytes <= 0) return Status::OK();
  ASSIGN_OR_RETURN(const MemoryPlan plan, PlanMemory(m, config, world_size, device));
  if (plan.Fits(device_bytes)) return Status::OK();
  std::string msg = "memory plan: a rank needs " + FormatBytes(plan.Total()) + " of " +
                    plan.device + " memory but has " + FormatBytes(device_bytes) + " (" +
                    std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks") +
                    ", fsdp " + config.fsdp + "; `grpo plan` prints the breakdown): ";
  StatusOr<Suggestion> fix = SuggestFix(m, config, world_size, device, device_bytes);
  if (fix.ok()) {
    msg += fix->Text() + " (" + FormatBytes(fix->plan.Total()) + ")";
  } else {
    msg += fix.status().message();
  }
  return Status::FailedPrecondition(msg);
}

std::string FormatBytes(int64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= (1ll << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", b / (1ll << 30));
  } else if (bytes >= (1ll << 20)) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", b / (1ll << 20));
  } else if (bytes >= (1ll << 10)) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", b / (1ll << 10));
  } else {
    std::snprintf(buf, sizeof(buf), "%" PRId64 " B", bytes);
  }
  return buf;
}

std::string FormatPlan(const MemoryPlan& p, int64_t device_bytes) {
  std::ostringstream o;
  const std::string cdt = p.bf16 ? "bf16" : "fp32";
  const std::string fsdp =
      std::string(common::FsdpModeName(p.fsdp.mode)) + (p.fsdp.offload ? " offload" : "");
  char params[32];
  const double n = static_cast<double>(p.params.total);
  std::snprintf(params, sizeof(params), n >= 1e9 ? "%.2f B" : "%.1f M",
                n >= 1e9 ? n / 1e9 : n / 1e6);
  o << p.model_type << ", " << params << " parameters; " << p.world_size
    << (p.world_size == 1 ? " rank" : " ranks") << " of " << p.device << ", fsdp " << fsdp << ", "
    << cdt << ", gradient_checkpointing " << (p.gradient_checkpointing ? "on" : "off")
    << (p.streams_weights ? ", weight_publish stream" : "") << "\n";
  o << "micro-batch: " << p.micro_batch_rows << " rows x " << p.sequence_tokens << " tokens ("
    << p.prompt_length << " prompt + " << p.completion_length << " completion)";
  if (p.distinct_prompts < p.micro_batch_rows) {  // each runs through the layers once
    o << ", at most " << p.distinct_prompts << " distinct prompt"
      << (p.distinct_prompts == 1 ? "" : "s");
  }
  o << "\nthe LM head over " << p.completion_tokens << " tokens in chunks of " << p.chunk_tokens
    << "\n\n";
  auto row = [&o](const std::string& name, int64_t bytes, const std::string& mark = "") {
    char line[160];
    std::snprintf(line, sizeof(line), "  %-58s %10s%s%s\n", name.c_str(),
                  FormatBytes(bytes).c_str(), mark.empty() ? "" : "  ", mark.c_str());
    o << line;
  };
  o << "model state (per rank)\n";
  row("parameters (" + cdt + (p.bf16 ? " compute copy)" : ")"), p.parameters);
  const bool zero2 = p.fsdp.mode == FsdpMode::kShardGradOp && p.world_size > 1;
  row(zero2 ? std::string("gradients (the rank's fp32 shard)") : "gradients (" + cdt + ")",
      p.gradients);
  if (p.bf16) {
    row("fp32 master weights", p.master_weights);
    row("fp32 master gradients", p.master_gradients);
  }
  row("AdamW state (2 fp32 moments)", p.adamw_state);
  row("reference model (beta != 0)", p.reference_model);
  o << "one micro-batch\n";
  row("activations, gradient_checkpointing off", p.activations_no_checkpointing,
      p.gradient_checkpointing ? "" : "<- in effect");
  row("activations, gradient_checkpointing on", p.activations_checkpointing,
      p.gradient_checkpointing ? "<- in effect" : "");
  row("logits chunk [" + std::to_string(p.chunk_tokens) + " x " + std::to_string(p.vocab_size) +
          "] fp32",
      p.logits_chunk);
  row("LM-head pass (the chunk + [V, D] and [N, D] gradients)", p.lm_head_pass);
  row("  + beside it: the LM head's unit gathered (full_shard)", p.gathered_lm_head);
  row("backward of one layer", p.layer_backward());
  row(zero2 ? "  + beside it: a gradient bucket in flight (shard_grad_op)"
            : "  + beside it: gathered layer x3 + head unit (full_shard)",
      p.gathered_layer);
  row("after the backward: head unit, .grads, flat (full_shard)", p.finish_backward);
  row("peak: max(activations + max(LM head, layer), after)", p.MicroBatchPeak());
  if (p.micro_batch_threads > 1) {
    row("  + a second micro-batch at once and its gradient (micro_batch_threads 2)",
        p.SecondMicroBatch());
  }
  o << "other phases and the service\n";
  row("optimizer step (all-reduce bucket, fp64 norm, AdamW temps)", p.optimizer_step);
  const bool zero2_load = p.fsdp.mode == FsdpMode::kShardGradOp;
  row(zero2_load ? (p.sharded_loading ? "loading: one tensor of the copy (shard_grad_op, sharded)"
                                      : "loading: the fp32 model and a bucket (shard_grad_op)")
      : p.sharded_loading ? "loading: one unit's buffer (full_shard, sharded loading)"
                          : "loading: the whole model beside the shards (full_shard)",
      p.load);
  row(p.streams_weights ? "published weights here (weight_publish stream: none kept)"
                        : "published weights here (fp32; 2x while publishing)",
      p.weight_snapshot);
  row("weight-sync bucket", p.weight_sync_bucket);
  if (p.publish_unit > 0)
    row("streamed version: one unit or bucket gathered (fp32)", p.publish_unit);
  row(p.device == "cuda" ? "CUDA context and libraries" : "the process (libraries, threads)",
      p.runtime);
  o << "\n";
  row("total: state + max(micro-batch, step, publish) + the rest", p.Total());
  if (device_bytes > 0) row(p.device + " memory of a rank", device_bytes);
  if (p.device == "cuda") {
    row(p.streams_weights ? "host memory beside it (offloaded, a streamed tensor, process)"
                          : "host memory beside it (offloaded, 2 snapshots, process)",
        p.HostTotal());
  }
  for (const std::string& note : p.notes) o << "note: " << note << "\n";
  return o.str();
}

}  // namespace grpo::learner::distributed
