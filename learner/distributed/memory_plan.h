// The memory planner behind `grpo plan` and the learner's start-up check: the peak memory of one
// learner rank, from the model's config.json and the run's config alone (no weights loaded, no
// libtorch). Pure arithmetic; every figure counts what the code of this repository allocates
// (common/model/model.cc's forward, learner/chunked_logprobs.cc, learner/grpo_trainer.cc,
// learner/optimizer.cc, learner/learner.cc's weight snapshots), and the sharding modes follow
// ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
// Models", 2020): shard_grad_op = ZeRO-2, full_shard = ZeRO-3, offload = ZeRO-Offload.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/model/model_config.h"
#include "common/status.h"

namespace grpo::learner::distributed {

// What the process needs beside its tensors. CPU: an idle `grpo learner` with the tiny model
// (libtorch, gRPC, SQLite mapped in) measured 373 MiB resident (369 MiB on 2026-12-06, with
// GRPO_CUDA=1) with libtorch's CUDA part loaded, as it is on a machine with an NVIDIA device
// (README "One libtorch"), and 141 MiB without it. CUDA: the context, cuBLAS and its workspace;
// an assumption (0.5-1 GiB is what PyTorch users report), not measured here.
inline constexpr int64_t kHostRuntimeBytes = 384ll << 20;
inline constexpr int64_t kCudaRuntimeBytes = 1ll << 30;
// The largest figure a plan holds (256 PiB): far beyond any device, and small enough that a
// plan's sums of figures stay inside int64. PlanMemory refuses a micro-batch whose activations
// pass it (a config's sizes are bounded, common/config.h and common/model/model_config.h, but
// their products are not).
inline constexpr int64_t kMaxPlanBytes = int64_t{1} << 58;
// SuggestFix looks for a world size up to this many ranks.
inline constexpr int kMaxSuggestedWorldSize = 1024;
// The flat bucket of the data-parallel gradient all-reduce (distributed::kDefaultBucketBytes of
// collectives.h, which this header does not include to stay free of libtorch).
inline constexpr int64_t kGradientBucketBytes = 25ll << 20;

// Parameter counts of a ModelConfig, as common::Model builds it (Model::ParameterShapes).
struct ParameterCounts {
  int64_t total = 0;
  int64_t embedding = 0;       // [V, D]
  int64_t lm_head = 0;         // [V, D] when untied, else 0 (the embedding is the LM head)
  int64_t per_layer = 0;       // one decoder layer
  int64_t largest_tensor = 0;  // the largest single parameter tensor
  int64_t largest_unit = 0;    // the largest unit gathered whole: a layer or the [V, D] matrix
};
ParameterCounts CountParameters(const common::ModelConfig& model);

// Bytes per rank. "Device" figures are on the rank's device (on the CPU that is host memory);
// host_* figures are the host memory of the same rank beside it (CUDA only; on the CPU they are
// part of the device figures already).
struct MemoryPlan {
  // What was planned.
  std::string model_type;
  int64_t vocab_size = 0;
  std::string device;  // "cpu" | "cuda"
  int world_size = 1;
  common::FsdpSpec fsdp;
  bool bf16 = false;
  bool gradient_checkpointing = false;
  int64_t micro_batch_threads = 1;  // micro-batches trained at once (GrpoTrainer)
  bool reference = false;           // beta != 0
  int64_t micro_batch_rows = 0;     // per_device_train_batch_size
  int64_t prompt_length = 0;        // max_prompt_length
  int64_t completion_length = 0;    // max_completion_length
  int64_t sequence_tokens = 0;      // max_prompt_length + max_completion_length (padded rows)
  int64_t completion_tokens = 0;    // rows x max_completion_length: the LM head's tokens
  int64_t chunk_tokens = 0;         // min(logprob_chunk_tokens, completion_tokens)
  // The most distinct prompts among the rows (whole groups of num_generations in a row); fewer
  // than the rows: each runs through the layers once (Model::ForwardSharedPrefix).
  int64_t distinct_prompts = 0;
  ParameterCounts params;

  // Model state, resident all run.
  int64_t parameters = 0;          // compute dtype: the fp32 policy, or the bf16 copy with bf16
  int64_t gradients = 0;           // their .grad (kept between steps: AdamW::ZeroGrad zeroes;
                                   // shard_grad_op: the fp32 shard, see PlanMemory)
  int64_t master_weights = 0;      // bf16: the fp32 master (the policy AdamW steps; 1/W
                                   // with shard_grad_op and full_shard)
  int64_t master_gradients = 0;    // bf16: the master's fp32 .grad (MoveComputeGradsToMaster)
  int64_t adamw_state = 0;         // exp_avg + exp_avg_sq, fp32
  int64_t reference_model = 0;     // beta != 0: a frozen copy in the compute dtype (1/W where
                                   // full_shard gathers; on the host with offload)
  bool streams_weights = false;    // weight_publish: stream (no snapshot is kept)
  int64_t weight_snapshot = 0;     // published weights (fp32) held on this device
  int64_t weight_sync_bucket = 0;  // one flat bucket of the weight-sync backend on this device
  int64_t publish_unit = 0;  // weight_publish stream, sharded: one unit (full_shard) or bucket
                             // (shard_grad_op's master) gathered, fp32
  int64_t runtime = 0;       // kHostRuntimeBytes or kCudaRuntimeBytes

  // One micro-batch (per_device_train_batch_size rows of sequence_tokens).
  int64_t activations_no_checkpointing = 0;  // saved for backward, every layer whole
  int64_t activations_checkpointing = 0;     // each layer's input only
  int64_t logits_chunk = 0;                  // the [chunk, V] logits buffer(s) of the fused LM head
  int64_t lm_head_pass = 0;  // logits chunk + the [V, D] and [N, D] gradient buffers at their peak
  int64_t layer_backward_no_checkpointing = 0;  // one layer's backward temporaries
  int64_t layer_backward_checkpointing = 0;     // + its recomputed activations
  // What sharding holds beside the micro-batch. full_shard: the LM head's unit whole (both
  // phases), and beside a layer's backward the head's gradient (untied), the layer whole, its
  // gradients, their flat and the prefetched layer; shard_grad_op: a gradient bucket in flight.
  int64_t gathered_lm_head = 0;  // beside the LM-head pass
  int64_t gathered_layer = 0;    // beside one layer's backward
  // full_shard: after the backward (no activations), the head's unit, the [V, D] .grad(s) of
  // the units autograd accumulates and the fp32 flat one is packed into.
  int64_t finish_backward = 0;
  // full_shard: loading, before the first step (a phase of its own). With sharded_loading
  // (model_name_or_path given: each rank reads its own chunks from the files) one unit's buffer;
  // otherwise (a model built in memory) the whole fp32 model on every rank, the bf16 compute
  // copy with bf16, and one unit packed for its broadcast beside its buffer. shard_grad_op with
  // its master sharded (bf16, or offload): from model_name_or_path (sharded_loading) one tensor
  // read for the compute copy in the file's dtype (fp32 at most; on the host with offload:
  // host_load), each rank reading its master's chunks from the files; built in memory the whole
  // fp32 model (on the host with offload) and one flat bucket of the broadcast that cuts them.
  int64_t load = 0;
  bool sharded_loading = false;
  // The optimizer step: the gradient all-reduce's bucket at several no_shard ranks, then the
  // grad-norm clip in fp64 and AdamW's temporaries, one tensor at a time; never at the same time
  // as a micro-batch.
  int64_t optimizer_step = 0;

  // Host memory beside a CUDA device: offloaded state, rank 0's CPU weight snapshots, a gloo or
  // grpc bucket and the process itself.
  int64_t host_offloaded = 0;
  // shard_grad_op offload: the whole fp32 model loaded on the host until its master chunks are
  // cut from it (beside host_offloaded).
  int64_t host_load = 0;
  int64_t host_weight_snapshot = 0;
  int64_t host_other = 0;

  std::vector<std::string> notes;  // assumptions that matter for this plan, one line each

  int64_t activations() const {
    return gradient_checkpointing ? activations_checkpointing : activations_no_checkpointing;
  }
  int64_t layer_backward() const {
    return gradient_checkpointing ? layer_backward_checkpointing : layer_backward_no_checkpointing;
  }
  // The larger of activations + max(LM-head pass + gathered_lm_head, one layer's backward +
  // gathered_layer) and finish_backward.
  int64_t MicroBatchPeak() const;
  // The state the trainer holds all run (parameters ... reference model; not the gathered
  // units, which MicroBatchPeak counts).
  int64_t ModelState() const;
  // With micro_batch_threads 2 a second micro-batch trains at once: its MicroBatchPeak and the
  // gradient it computes apart (gradients, whole: one process) before the trainer adds it.
  int64_t SecondMicroBatch() const;
  // The micro-batches' phase of a step: MicroBatchPeak + SecondMicroBatch.
  int64_t MicroBatchPhase() const;
  // What GrpoTrainer alone peaks at: ModelState + max(MicroBatchPhase, optimizer_step, load).
  int64_t TrainingPeak() const;
  // The rank's predicted peak on its device: TrainingPeak + snapshot + bucket + runtime.
  int64_t Total() const;
  // Loading and publishing are phases of their own (the snapshot is first taken after loading).
  int64_t HostTotal() const {
    return host_offloaded + std::max(host_load, host_weight_snapshot) + host_other;
  }
  bool Fits(int64_t device_bytes) const { return Total() <= device_bytes; }

  // Every figure by name (the JSON of `grpo plan --json`).
  nlohmann::json ToJson() const;
};

// The plan of `config` for `model` on `world_size` ranks of `device` ("cpu", or "cuda"/"cuda:N";
// resolve "auto" first). InvalidArgument naming the key for a bad fsdp, world_size < 1 or an
// unknown device, and for a micro-batch too large to plan (a figure above kMaxPlanBytes).
StatusOr<MemoryPlan> PlanMemory(const common::ModelConfig& model, const common::GrpoConfig& config,
                                int world_size, const std::string& device);

// One change of a suggestion: a config key (or "world_size", which is WORLD_SIZE / --world_size)
// and its new value as it would be written on the command line.
struct ConfigChange {
  std::string key;
  std::string value;
};
struct Suggestion {
  std::vector<ConfigChange> changes;
  MemoryPlan plan;           // the plan with the changes applied
  std::string Text() const;  // "set gradient_checkpointing: true and fsdp: full_shard ..."
};

struct SuggestOptions {
  // > 0 (CUDA): the host memory beside each GPU, which must hold HostTotal too (offload moves
  // the optimizer's state there). 0: not checked.
  int64_t host_bytes = 0;
};

// The smallest change that fits `device_bytes`: single changes first, in this order:
// gradient_checkpointing on, a smaller per_device_train_batch_size (the largest divisor of it
// that fits, gradient_accumulation_steps scaled to keep the optimizer batch), fsdp
// shard_grad_op, fsdp full_shard (one of the two), offload (CUDA only); then combinations of them,
// fewest knobs first in the same order; and last, as machines cost most, more ranks alone or with
// the others: the fewest ranks that fit, with the fewest other knobs. NotFound when none fits (up
// to kMaxSuggestedWorldSize ranks), saying what a rank needs at best. An empty suggestion when the
// config fits as it is.
StatusOr<Suggestion> SuggestFix(const common::ModelConfig& model, const common::GrpoConfig& config,
                                int world_size, const std::string& device, int64_t device_bytes,
                                const SuggestOptions& options = {});

// OK when the plan fits `device_bytes` (or device_bytes <= 0: unknown, nothing is checked);
// FailedPrecondition otherwise, saying the predicted and available bytes and the change that
// fits (SuggestFix), or what a rank needs at best. The learner calls it at start.
Status CheckFitsDevice(const common::ModelConfig& model, const common::GrpoConfig& config,
                       int world_size, const std::string& device, int64_t device_bytes);

// The human table of `grpo plan`: each component, the total, the device memory and the verdict.
std::string FormatPlan(const MemoryPlan& plan, int64_t device_bytes);
// "14.2 GiB", "512.0 MiB", "8.0 KiB", "12 B".
std::string FormatBytes(int64_t bytes);

}  // namespace grpo::learner::distributed
