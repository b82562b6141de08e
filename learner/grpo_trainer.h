// GrpoTrainer: trains a policy on generation batches of rollout groups (docs/GRPO_SPEC.md; TRL
// GRPOTrainer semantics for num_iterations, steps_per_generation and
// gradient_accumulation_steps; see README "num_iterations and the generation batch").
// Memory-flat: each micro-batch runs forward -> chunked log-probs -> loss -> backward on its
// own, so peak memory is set by per_device_train_batch_size and logprob_chunk_tokens, not by
// num_generations or the number of micro-batches.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/group_refusal.h"
#include "common/model/model.h"
#include "common/rollout_types.h"
#include "common/status.h"
#include "learner/distributed/collectives.h"
#include "learner/distributed/frozen_shards.h"
#include "learner/group_check.h"
#include "learner/grpo_loss.h"
#include "learner/loss/entropy_bonus.h"
#include "learner/micro_batch_worker.h"
#include "learner/optimizer.h"
#include "learner/step_optimizer.h"

namespace grpo::learner {

// Why a group was refused at ingest: the trainer's reasons are the first twelve of the one table
// (common/group_refusal.h), from kGroupSize to kStale.
using RejectReason = common::GroupRefusal;
constexpr std::string_view RejectReasonName(RejectReason reason) {
  return common::GroupRefusalName(reason);
}

// The metrics of one optimizer step, named as TRL logs them (ToJson).
struct StepMetrics {
  int64_t step = 0;            // global optimizer step, 1-based
  int64_t policy_version = 0;  // after this step
  int64_t iteration = 0;       // 0..num_iterations-1 within the generation batch
  double loss = 0, grad_norm = 0, learning_rate = 0;
  double reward = 0, reward_std = 0, frac_reward_zero_std = 0;
  std::vector<std::string> reward_names;
  std::vector<double> reward_fn_mean, reward_fn_std;
  double completions_mean_length = 0, completions_clipped_ratio = 0;
  double entropy = 0;
  // clip_ratio/{low,high,region}_mean; for cispo, high and region hold cispo_clip_ratio.
  double clip_ratio_low = 0, clip_ratio_high = 0, clip_ratio_region = 0;
  // Which of the objective's metrics ToJson writes (TRL logs clip ratios for the clipped
  // surrogate, cispo_clip_ratio for cispo, vespo/phi_seq_mean for vespo, none for sapo).
  loss::ObjectiveMetric objective_metric = loss::ObjectiveMetric::kClipRatios;
  double vespo_phi_mean = 0;
  // TRL's `entropy_coef`: the entropy bonus's coefficient after this step (adaptive: updated),
  // logged when the bonus is on.
  bool has_entropy_coef = false;
  double entropy_coef = 0;
  bool has_kl = false;
  double kl = 0;
  bool has_is_ratio = false;
  double is_ratio_mean = 0, is_ratio_max = 0;
  // |behaviour - old| log-prob over the step's completion tokens (nats): the rollout/learner
  // numerical mismatch when the groups are on-policy (worker and learner run the same model
  // code: ~0 in fp32, bf16 rounding in bf16); policy drift too for stale groups. Set when the
  // groups carry behaviour log-probs. `old` is the no-grad pass when one runs, else logp.detach().
  bool has_logprob_mismatch = false;
  double logprob_mismatch_mean = 0, logprob_mismatch_max = 0;
  double staleness_mean = 0;
  // TRL's tools/call_frequency (tool calls per sequence of the step) and tools/failure_frequency
  // (failed calls per call; 0 without calls), logged when a sequence of the step comes from an
  // environment that declared tools (Completion::uses_tools).
  bool has_tools = false;
  int64_t tool_calls = 0, tool_call_failures = 0;
  double tool_call_frequency = 0, tool_failure_frequency = 0;
  int64_t sequences = 0, completion_tokens = 0;
  double step_seconds = 0, tokens_per_second = 0;
  int64_t peak_memory_bytes = 0;  // CUDA caching allocator's peak on CUDA, else VmHWM
  int64_t micro_batches = 0;      // in this step (gradient_accumulation_steps but for a flush)

  nlohmann::json ToJson() const;
};

struct GenerationBatchResult {
  std::vector<StepMetrics> steps;
  int64_t groups_trained = 0;
  // prompt_id -> reason, for every refused group; counts by reason.
  std::vector<std::pair<std::string, RejectReason>> rejected;
  std::map<RejectReason, int64_t> rejected_counts;
};

// Not thread-safe: one training thread owns it, except that ValidateGroup and policy_version()
// may run on other threads concurrently with training (a service validates groups at ingest).
// The policy is borrowed and updated in place. Everything runs on the policy's device (but
// beside a master on the host: see Create's `offload`).
// With `bf16` the policy is the fp32 master: the trainer owns a bf16 compute copy that runs
// every forward and backward (old/ref log-probs too); its gradients are added into the
// master's fp32 .grad after each micro-batch, AdamW (fp32 state) steps the master, and the copy
// is refreshed from the master after each step and at the start of each generation batch (so
// a master changed from outside, e.g. by a checkpoint restore, is picked up). Log-softmax, the
// loss and the advantages are fp32 in both modes.
class GrpoTrainer {
 public:
  // `reference` is required when beta != 0 and must be absent otherwise (no reference model
  // is built when beta is 0); it is moved to the policy's device and the compute dtype.
  // InvalidArgument naming the option on a bad config, and for bf16 with a policy that is not
  // fp32 (the master weights must be).
  ~GrpoTrainer();
  // `ranks` (borrowed; null = this process alone) makes it one of the learner's data-parallel
  // ranks (README "Learner ranks"): every rank gets the same generation batches and takes the
  // same steps, each back-propagating its share of every step's micro-batches (the step's
  // stream position modulo the world size), with gradient_accumulation_steps per rank: a step
  // is gradient_accumulation_steps x world_size micro-batches, the one step a single rank with
  // that accumulation takes. The gradients are summed over the ranks as `fsdp` says
  // (step_optimizer.h: an all-reduce at the step for no_shard; a reduce-scatter per round of
  // micro-batches into 1/world_size shards for shard_grad_op), the metrics at the step, so
  // every collective is matched however few micro-batches a rank has. full_shard shards the
  // policy's parameters too (distributed/full_shard_adamw.h): its tensors then hold no values
  // between uses and the whole weights are read through optimizer().GatherWeights; Create is
  // then a collective (with bf16 the gate sits on the bf16 compute copy), and so is the
  // reference's: sharded too (distributed/frozen_shards.h), read a shard a rank when deferred.
  // `offload` on a GPU: full_shard's shards on the host, at any world size; with no_shard and
  // shard_grad_op the fp32 master (the policy, its gradient, AdamW's state) on the host and a
  // compute copy (bf16, or fp32) on the GPU that runs every forward and backward, its gradients
  // added into the master's after each micro-batch (step_optimizer.h HostsMaster). `device`:
  // where the trainer computes (the policy's device when unset); the policy must be there,
  // except with the master on the host, where it may be on the host already (loaded there: the
  // GPU never holds it whole in fp32). Batch dumps at world size > 1 are rank 0's, of the whole
  // step.
  static StatusOr<std::unique_ptr<GrpoTrainer>> Create(
      const common::GrpoConfig& config, common::Model* policy,
      std::unique_ptr<common::Model> reference, distributed::Collectives* ranks = nullptr,
      std::optional<at::Device> device = std::nullopt);

  // OK when the group can be trained on now; otherwise InvalidArgument whose message says why,
  // and `*reason` (when given) the reason's code.
  Status ValidateGroup(const common::RolloutGroup& group, RejectReason* reason = nullptr) const;

  // Trains on one generation batch: refuses invalid groups (counted), computes advantages,
  // then num_iterations passes over its micro-batches, an optimizer step every
  // gradient_accumulation_steps micro-batches. Every step's gradient is the sum of its
  // micro-batches' (docs/GRPO_SPEC.md "Aggregation"). When the batch ends inside a step (its
  // micro-batches x num_iterations not a multiple of gradient_accumulation_steps) the step stays
  // open and the next batch completes it, as in TRL; it is never a shorter step divided by the
  // full count. An error (a Status, or an exception from libtorch, returned as Internal)
  // discards the open step, also one carried over from an earlier batch: its gradient, counters
  // and dump rows are dropped, so no later step holds any of it. The model and optimizer are then
  // those of the last step taken (steps this call completed before the error stay taken, and so
  // does a step whose dump could not be written). With dump_batches_dir, each step is written
  // when it is taken, all its rows in one `step-<8 digits>.safetensors` (README "Batch dumps").
  StatusOr<GenerationBatchResult> TrainGenerationBatch(
      const std::vector<common::RolloutGroup>& groups);
  // Takes the open step, if any, with the micro-batches it has (normalised by their own count;
  // at the end of a job), and dumps it as any other step. nullopt when no step is open. An error
  // discards the open step, as in TrainGenerationBatch.
  StatusOr<std::optional<StepMetrics>> FlushPartialStep();
  // Micro-batches back-propagated into the open step (0 when none is open).
  int64_t open_step_micro_batches() const;
  // Removes the batch dumps of steps after `step` from dump_batches_dir (`step-N.safetensors`,
  // `step-N-part.safetensors` of older versions, and their `.tmp` files, for N > step): a trainer
  // restored at `step` redoes those steps, and no file of a dead learner's step may stand beside
  // the redone one. Returns the number removed; 0 when dumps are off or the directory does not
  // exist; Internal naming the file when one cannot be removed.
  StatusOr<int64_t> RemoveDumpsAfter(int64_t step) const;

  // Rank 0's weights, AdamW state and counters into every rank's (at start and after rank 0
  // restored a checkpoint: the other ranks then hold what rank 0 holds). OK at world size 1.
  Status SyncFromRankZero();
  int world_size() const { return ranks_->world_size(); }
  int rank() const { return ranks_->rank(); }
  distributed::Collectives& ranks() { return *ranks_; }
  // Micro-batches of one optimizer step over all ranks: gradient_accumulation_steps x
  // world_size.
  int64_t step_micro_batches() const {
    return config_.gradient_accumulation_steps * ranks_->world_size();
  }

  int64_t global_step() const { return global_step_; }
  int64_t policy_version() const { return policy_version_; }
  const common::GrpoConfig& config() const { return config_; }
  common::Model& policy() { return *policy_; }
  // The model that runs forward/backward: the bf16 copy with `bf16` (or the GPU copy beside a
  // master on the host), else the policy. Its device is the one the trainer computes on.
  const common::Model& compute_model() const { return compute_ ? *compute_ : *policy_; }
  // AdamW over the ranks as `fsdp` says; its StateDict is a collective when sharded.
  StepOptimizer& optimizer() { return *optimizer_; }
  // The reference's shards where full_shard shards it (beta != 0), else null.
  const distributed::FrozenShards* reference_shards() const { return reference_shards_.get(); }
  // The learner process id (64-bit hex) written into batch dumps as learner_incarnation, next to
  // each row's policy_incarnation (the chaos test checks that they agree).
  void set_dump_incarnation(std::string incarnation) { dump_incarnation_ = std::move(incarnation); }
  // Used by checkpoint restore.
  void RestoreCounters(int64_t global_step, int64_t policy_version) {
    global_step_ = global_step;
    policy_version_ = policy_version;
  }
  // The entropy bonus's controller (its coefficient and the last step's entropy are checkpoint
  // state).
  const loss::EntropyController& entropy_control() const { return entropy_control_; }
  void RestoreEntropyControl(double coef, double last_entropy) {
    entropy_control_.Restore(coef, last_entropy);
  }
  // Tests only: called after each micro-batch's backward with its index in the call's stream of
  // micro-batches (0-based, over all num_iterations passes); an error fails the call there, as a
  // micro-batch that fails after its gradient reached .grad would (fault injection).
  void TEST_set_micro_batch_fault(std::function<Status(int64_t micro_batch)> fault) {
    TEST_micro_batch_fault_ = std::move(fault);
  }

 private:
  struct Batch;  // flattened sequences of a generation batch
  GrpoTrainer(common::GrpoConfig config, GrpoLossConfig loss_config, common::Model* policy,
              std::unique_ptr<common::Model> reference);

  struct OpenStep;     // the optimizer step being accumulated
  struct MicroResult;  // one micro-batch's forward and backward
  struct StepDump;     // the open step's rows for its batch dump
  // TrainGenerationBatch and FlushPartialStep without the discard on error.
  StatusOr<GenerationBatchResult> TrainGenerationBatchOrFail(
      const std::vector<common::RolloutGroup>& groups);
  StatusOr<std::optional<StepMetrics>> FlushPartialStepOrFail();
  // Drops the open step: its counters and dump rows, and every gradient (master and compute
  // copy). The one cleanup of every error path.
  void DiscardOpenStep();
  // Zeroes the gradients of the master and of the compute copy.
  void ZeroGrads();
  // Rows [b0, b1) of `batch` forward and backward on the compute model, with `loss_config` and
  // `norm` of the open step: the gradients into the parameters' .grad, or with `apart` into
  // result->grads (grad_params_'s, in order; .grad untouched), as the micro-batch worker runs
  // it beside the trainer's own. Reads only what no step changes while it runs; throws what a
  // forward or backward throws (the worker's job catches it).
  void ComputeMicroBatch(const Batch& batch, int64_t b0, int64_t b1,
                         const GrpoLossConfig& loss_config, const LossNormaliser& norm, bool apart,
                         MicroResult* result) const;
  // Adds a micro-batch's gradients computed apart (ComputeMicroBatch) into .grad.
  void AddGradients(const std::vector<at::Tensor>& grads);
  // Sums the open step's gradients (StepOptimizer::ReduceGradients) and metrics over the ranks
  // (nothing at world size 1).
  Status ReduceOverRanks(OpenStep& step);
  // Steps the optimizer on the open step's gradient; `divisor` micro-batches (the accumulation
  // count, or fewer for a flush). Dumps the step when dumps are on.
  StatusOr<StepMetrics> FinishStep(int64_t divisor);
  // Copies rows [b0, b1) of `batch`, one micro-batch trained with log-probs `logp` ([b, C]),
  // into the open step's dump; with `owned` false another rank trained it (`logp` unused) and
  // its log-probs are zeros here.
  static void AppendDumpRows(const Batch& batch, int64_t b0, int64_t b1, const at::Tensor& logp,
                             bool owned, StepDump* dump);
  // Writes `step-<8 digits>.safetensors` of the open step (README "Batch dumps"); at several
  // ranks a collective (the log-probs are summed over the ranks) and rank 0 writes.
  Status DumpStep(const OpenStep& step, int64_t step_number) const;

  // Adds the compute copy's gradients into the master's fp32 .grad and zeroes them (with a
  // compute copy only).
  void MoveComputeGradsToMaster();
  // Copies the master weights into the compute copy (with one only).
  void RefreshComputeCopy();

  common::GrpoConfig config_;
  GrpoLossConfig loss_config_;
  common::Model* policy_;
  // The compute copy (bf16, or on the GPU beside a master on the host), or null.
  std::unique_ptr<common::Model> compute_;
  std::unique_ptr<common::Model> reference_;
  // Where full_shard's gate fills the policy's parameters: the reference's shards, the gate of
  // reference_ (after it: destroyed first); null with the reference whole.
  std::unique_ptr<distributed::FrozenShards> reference_shards_;
  std::unique_ptr<StepOptimizer> optimizer_;
  distributed::SingleRank single_rank_;
  distributed::Collectives* ranks_ = &single_rank_;  // never null
  LrSchedule schedule_ = LrSchedule::kLinear;
  int64_t global_step_ = 0;
  std::atomic<int64_t> policy_version_{0};  // read by ValidateGroup on other threads
  std::unique_ptr<OpenStep> open_;
  loss::EntropyController entropy_control_{{}};  // set by Create from the config
  std::string dump_incarnation_;
  std::function<Status(int64_t)> TEST_micro_batch_fault_;
  // micro_batch_threads 2: the thread that trains the next micro-batch of a step beside the
  // trainer's own, and the parameters it differentiates (those requiring grad). Null at 1.
  std::unique_ptr<MicroBatchWorker> micro_worker_;
  std::vector<at::Tensor> grad_params_;
};

// Peak resident set of this process (VmHWM), in bytes; 0 when unknown. (The trainer's
// peak_memory_bytes is common::PeakMemoryBytes(device): this on CPU.)
int64_t PeakResidentBytes();

}  // namespace grpo::learner
