// learner::Learner: the learner's engine, without gRPC or protobuf (docs/ARCHITECTURE.md "The
// flow of one training step"). It owns the prompt ledger, the policy, the GrpoTrainer, a
// bounded buffer of accepted rollout groups, the worker registry, the published weights and
// their weight-sync publishers, the job state machine, checkpoints and job-event subscribers.
// services::LearnerServer is its gRPC shell (auth, conversion, stream loops).
//
// Ingest policy (AcceptGroup), per group, in this order:
//   1. The lease must be the prompt's current, unexpired lease (unknown_lease / expired_lease;
//      the ledger is not touched: an expired lease requeues on its own).
//   1a. A group the worker could not generate (RolloutGroup::failure: no completions) gives its
//      lease back: worker_failed, the prompt queued again at once, never rejected for it; or,
//      when the prompt itself failed (prompt_failed), prompt_failed: the prompt is rejected.
//   2. The policy: groups whose policy this learner did not publish (another
//      learner_incarnation: a restarted learner's versions restart from its checkpoint, or a
//      version above its own) are unknown_policy (lease released).
//   3. GrpoTrainer::ValidateGroup. A bad group is most likely a worker bug, so the prompt is
//      requeued (ReleaseLease); only empty_prompt (the prompt itself tokenizes to nothing), or
//      the same prompt failing kMaxBadGroupAttempts times in a row, rejects the prompt
//      (RejectPrompt). A stale group is always requeued.
//   3a. Dynamic sampling (config dynamic_sampling; learner/dynamic_sampling.h): a group with no
//      learning signal (all rewards equal) is filtered: the ledger records the prompt FILTERED
//      for its pass (PromptLedger::FilterPrompt), it never enters the buffer, and the lease
//      budget it held goes to another prompt. The push counts it as filtered, not refused.
//   4. Backpressure: the call waits (push_buffer_wait at most) for room in the buffer before it
//      completes the lease; after a timeout the rest of the push is refused (buffer_full) and
//      released at once.
//   5. CompleteLease (LEASED -> TRAINED), then the group joins the buffer.
// A buffered group that the trainer refuses later (it went stale while waiting) gets its prompt
// back for the same pass (PromptLedger::RequeueTrained; a failure is an error). While the
// learner stops: learner_stopping (lease released); after the job ended: job_ended.
//
// Crash consistency (ledger vs model): the ledger marks a prompt TRAINED (accepted) when its
// group joins the buffer, and records the optimizer step that takes it (MarkTrained; the step
// after it when the batch ends inside a step). Periodic checkpoints are taken only between
// optimizer steps, so "the weights after step S hold these groups" is exact. On start, after
// RestoreLatestCheckpoint at step S, PromptLedger::RollbackTo(S) undoes every training after S,
// requeues accepted groups and moves prompts back to any pass they owe (a pass boundary after S
// is undone for them): nothing trained is lost and nothing is trained twice in a pass; the
// batch dumps of steps after S are removed (GrpoTrainer::RemoveDumpsAfter). At job end
// (max_steps, stop) the buffer is dropped and the ledger rolled back to the saved step.
// Leases of a dead learner stay valid until their deadline (a worker that outlived it may still
// push; its groups of the dead learner's weights are refused as unknown_policy, the prompt
// released).
//
// Pass boundaries (Housekeep): the next pass starts when nothing is QUEUED or LEASED, no
// prompt owes an earlier pass, nothing is being accepted and the buffer's whole batches do not
// already take the job to max_steps. The buffer is first in, first out: the pass's batches
// train before the new pass's groups, its partial batch together with the new pass's first.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/cancel_token.h"
#include "common/config.h"
#include "common/group_refusal.h"
#include "common/learner_protocol.h"
#include "common/metrics/grpo_metrics.h"
#include "common/metrics/metrics.h"
#include "common/model/model.h"
#include "common/mutex.h"
#include "common/rollout_types.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/weight_sync/backends.h"
#include "common/weight_sync/epoch_store.h"
#include "learner/distributed/trainer_rank.h"
#include "learner/dynamic_sampling.h"
#include "learner/grpo_trainer.h"
#include "learner/job.h"
#include "learner/prompt_ledger.h"
#include "learner/weight_publisher.h"
#include "learner/weight_readers.h"
#include "learner/worker_registry.h"

namespace grpo::learner {

// How often a worker should heartbeat; one that misses kHeartbeatsMissedBeforeDrop of them is
// dropped from the weight-sync group (the group epoch bumps).
inline constexpr std::chrono::milliseconds kDefaultHeartbeatInterval{2000};
inline constexpr int kHeartbeatsMissedBeforeDrop = 5;
// The longest a push waits for room in a full buffer.
inline constexpr std::chrono::milliseconds kDefaultPushBufferWait{30'000};
// LeasePrompts with nothing to lease: how long the worker should wait before asking again.
inline constexpr std::chrono::milliseconds kDefaultLeaseRetryAfter{250};
// LeasePrompts while the buffer is full waits up to this long for room (a long poll: the call
// returns as soon as the trainer takes a batch), never past the call's deadline minus a margin.
inline constexpr std::chrono::milliseconds kLeaseLongPoll{3000};
// WaitForWeights for a version not published yet waits this long at most.
inline constexpr std::chrono::milliseconds kDefaultGetWeightsWait{60'000};
// The training loop and the weight publishers wake at least this often to re-check their state,
// and so does the lease long poll (the ledger's counts change outside mu_). The waits of calls
// never poll for their cancellation: a common::CancelToken that the call's cancellation or
// deadline trips wakes them.
inline constexpr std::chrono::milliseconds kWaitPollInterval{200};
// The training thread refreshes the job state from the ledger this often (and after events).
inline constexpr std::chrono::milliseconds kHousekeepInterval{1000};
// Events queued per subscriber; a subscriber that falls this far behind is dropped.
inline constexpr size_t kWatchQueueCapacity = 1024;
inline constexpr int64_t kMaxLeasesPerCall = 1024;
inline constexpr int kMaxBadGroupAttempts = 3;
// Rejection messages kept per push (PushReply::messages).
inline constexpr size_t kMaxAckMessages = 8;
// Characters of a worker's RolloutGroup::failure kept in its refusal message.
inline constexpr size_t kMaxWorkerFailureChars = 500;
// The final checkpoint (max_steps, stop) is tried this often before the job fails.
inline constexpr int kFinalCheckpointAttempts = 3;

struct LearnerOptions {
  // Tokenizer files here are copied into every checkpoint; empty = none.
  std::string model_dir;
  // The ledger's clock (unix ms); empty = system clock. Tests inject a fake.
  std::function<int64_t()> now_ms;
  std::chrono::milliseconds heartbeat_interval = kDefaultHeartbeatInterval;
  std::chrono::milliseconds push_buffer_wait = kDefaultPushBufferWait;
  // Accepted groups held at most; 0 = two generation batches.
  int64_t buffer_capacity_groups = 0;
  // Restore the latest checkpoint under output_dir (and requeue what it does not hold).
  bool resume = true;
  // Weight-sync groups (workers assigned gloo, nccl or cuda_ipc at Register): the deadline of
  // each rendezvous/collective, and the address the learner's Gloo rank listens on (empty: the
  // machine's hostname unless config.weight_sync_hostname names one; "127.0.0.1" for loopback).
  // 0 = the config's weight_sync_timeout_seconds.
  std::chrono::milliseconds weight_sync_timeout{0};
  std::string weight_sync_hostname;
  // The backends' factory; empty = the built-in ones (common::BuiltinWeightSyncFactory). A test
  // injects the in-process fake; then every group backend counts as built.
  common::WeightSyncFactory weight_sync_factory;
  // Tests only: called before each checkpoint save with its step; an error fails that save as a
  // full disk would (fault injection).
  std::function<Status(int64_t step)> TEST_checkpoint_fault;
  // Tests only: the trainer's micro-batch fault (GrpoTrainer::TEST_set_micro_batch_fault).
  std::function<Status(int64_t micro_batch)> TEST_micro_batch_fault;
  // Borrowed, must outlive the learner; the learner adds common::LearnerMetrics to it. Null = the
  // learner owns a registry of its own (metrics_registry()).
  common::Registry* metrics_registry = nullptr;
  // Learner ranks (README "Learner ranks"): the group this learner is rank 0 of, borrowed (must
  // outlive the learner); null = a learner of one rank. Every rank trains each generation batch
  // (world size x the one of a rank: TRL's), rank 0 telling the others what to train.
  distributed::RankGroup* ranks = nullptr;
};

// The tally of one push (a stream of groups from one worker).
struct PushTally {
  common::PushReply reply;
  bool buffer_timed_out = false;  // later groups of the push are refused at once
};

// Thread-safe: any thread may call any method; one training thread owns the trainer and the
// policy. Lifetime: Create -> Start -> (WaitForJobEnd) -> Stop; the destructor stops.
class Learner {
 public:
  // A job-event subscriber (Subscribe / NextEvents / Unsubscribe).
  // Its fields are guarded by the learner's mu_; clang's analysis cannot name the lock of the
  // enclosing object from a nested struct (GRPO_GUARDED_BY(mu_) here would mean a Subscriber's own
  // mu_), so this stays a comment and NextEvents / Broadcast are where to look.
  struct Subscriber {
    common::CondVar cv;
    std::deque<JobEvent> events;  // guarded by Learner::mu_
    bool dropped = false;         // guarded by Learner::mu_: fell kWatchQueueCapacity behind
  };

  // Opens the ledger (config.ledger_path, default <output_dir>/ledger.sqlite), moves `policy` to
  // config.device in its own dtype (fp32 with `bf16`: the trainer trains a bf16 copy), creates the
  // trainer on it (`reference` as GrpoTrainer::Create requires), restores the latest checkpoint
  // when options.resume. InvalidArgument naming the key on a bad config, and for a `device`
  // this process cannot use (common::ResolveDevice).
  static StatusOr<std::unique_ptr<Learner>> Create(common::GrpoConfig config,
                                                   std::unique_ptr<common::Model> policy,
                                                   std::unique_ptr<common::Model> reference,
                                                   LearnerOptions options);
  ~Learner();
  Learner(const Learner&) = delete;
  Learner& operator=(const Learner&) = delete;

  // Publishes the initial weights and starts the training and weight-sync threads.
  // FailedPrecondition when called twice.
  Status Start() GRPO_EXCLUDES(mu_);
  // Stops the threads (training stops after the current generation batch); with `checkpoint`,
  // takes an open optimizer step short and saves a checkpoint when steps were taken since the
  // last one. Idempotent; returns the checkpoint error if any. EndLedger must follow once no
  // more groups can arrive (the shell calls it after its server stopped).
  Status Stop(bool checkpoint) GRPO_EXCLUDES(mu_);
  // Job end at stop: drops the buffer and rolls the ledger back to the last saved step.
  void EndLedger() GRPO_EXCLUDES(mu_);
  // Blocks until the job is done, cancelled or failed, or `timeout` passes; true if it ended.
  bool WaitForJobEnd(std::chrono::milliseconds timeout) GRPO_EXCLUDES(mu_);

  // --- What workers ask (common/learner_protocol.h).
  // Registers (or re-registers) a worker: a new id joins the weight-sync group under a new
  // epoch, leases of its earlier process go back to the queue, its backend is assigned.
  StatusOr<common::Registration> Register(const common::RegisterRequest& request)
      GRPO_EXCLUDES(mu_);
  // NotFound for a worker this learner does not know (Register again).
  StatusOr<common::HeartbeatReply> Heartbeat(const common::HeartbeatRequest& request)
      GRPO_EXCLUDES(mu_);
  // Leases at most `max_prompts` prompts within the lease budget (max_staleness and the buffer;
  // LeaseBudget), waiting up to kLeaseLongPoll (and no later than 500 ms before `deadline`) for
  // budget, or for prompts (the next pass). InvalidArgument for an empty id or a non-positive
  // count, NotFound for an unknown worker, Unavailable while stopping, Cancelled once `cancel` (may
  // be null) is tripped: the wait ends at once, and leases granted meanwhile go back.
  // `worker_version` >= 0: the policy version the worker starts these leases' groups with (it
  // takes no newer weights first): the budget is that of a worker so many versions behind
  // (admission.h), and a worker behind the published version gets no long poll (it should take
  // the newer weights first). -1: the worker takes the published version first.
  StatusOr<common::LeaseReply> LeasePrompts(const std::string& worker_id, int64_t max_prompts,
                                            std::chrono::steady_clock::time_point deadline,
                                            const common::CancelToken* cancel,
                                            int64_t worker_version = -1)
      GRPO_EXCLUDES(lease_mu_, mu_);
  // The ingest policy above for one group; its verdict goes into `tally`. Tripping `cancel`
  // (may be null) ends a wait for buffer room at once.
  void AcceptGroup(common::RolloutGroup group, const common::CancelToken* cancel, PushTally* tally)
      GRPO_EXCLUDES(mu_);
  // The newest published weights once their version is >= min_version (waits up to
  // kDefaultGetWeightsWait, or until `cancel`, may be null, is tripped): DeadlineExceeded
  // otherwise. A min_version of another learner
  // incarnation (`incarnation` non-empty and not this one: a worker that has not seen the
  // restart) names none of this learner's versions: the newest is served at once.
  StatusOr<std::shared_ptr<const WeightSnapshot>> WaitForWeights(
      int64_t min_version, const common::CancelToken* cancel, const std::string& incarnation = "")
      GRPO_EXCLUDES(mu_);
  // GetWeights: the weights of a published version >= min_version (as WaitForWeights), each
  // tensor handed to `sink` in Model::NamedParameters order. With `weight_publish: snapshot`
  // the sink runs on the caller's thread over the snapshot; with `stream` the caller waits (up to
  // kDefaultGetWeightsWait more) for the training thread, which runs the sink as it reads the
  // policy (learner/weight_readers.h). Cancelled when the sink returned false.
  Status ReadWeights(int64_t min_version, const common::CancelToken* cancel,
                     const std::string& incarnation, const WeightSink& sink) GRPO_EXCLUDES(mu_);
  // `weight_publish: stream`: no snapshot is kept; GetWeights is served by the training thread.
  bool streams_weights() const { return streams_weights_; }

  // --- What clients ask.
  StatusOr<DatasetInfo> AddDataset(const std::string& idempotency_key,
                                   const std::vector<std::string>& lines) GRPO_EXCLUDES(mu_);
  JobSnapshot Snapshot() GRPO_EXCLUDES(mu_);
  // Ends the job as cancelled (unless it already ended).
  void Cancel(const std::string& reason) GRPO_EXCLUDES(mu_);
  std::shared_ptr<Subscriber> Subscribe() GRPO_EXCLUDES(mu_);
  void Unsubscribe(const std::shared_ptr<Subscriber>& subscriber) GRPO_EXCLUDES(mu_);
  // The events queued for `subscriber`, waiting up to `wait` for one, or until `cancel` (may be
  // null) is tripped: OK (maybe none), ResourceExhausted when it fell too far behind,
  // Unavailable when the learner stops, Cancelled when tripped.
  Status NextEvents(Subscriber& subscriber, std::chrono::milliseconds wait,
                    const common::CancelToken* cancel, std::deque<JobEvent>* events)
      GRPO_EXCLUDES(mu_);

  // --- State.
  // This process's learner_incarnation (Registration): groups must carry it.
  const std::string& incarnation() const { return incarnation_; }
  const common::GrpoConfig& config() const { return config_; }
  JobState job_state() const GRPO_EXCLUDES(mu_);
  int64_t published_version() const GRPO_EXCLUDES(mu_);
  int64_t group_epoch() const { return epoch_store_->epoch(); }
  // Tests only: the ledger itself (the interface is the calls above).
  PromptLedger& TEST_ledger() { return *ledger_; }
  // Groups refused by AcceptGroup (and by the trainer later) since start, by reason.
  std::map<std::string, int64_t> RefusedCounts() const GRPO_EXCLUDES(mu_);
  // The live policy. Read it only while training is idle (tests, `grpo bench weight_sync`).
  const common::Model& policy() const { return *policy_; }
  // The rendezvous store of the weight-sync groups; its epoch is the group epoch.
  const std::shared_ptr<common::InMemoryEpochStore>& epoch_store() const { return epoch_store_; }
  // Versions committed to `backend`'s group (gloo, nccl, cuda_ipc), and its failed
  // joins/broadcasts (each ended an epoch).
  int64_t group_syncs(std::string_view backend) const;
  int64_t group_sync_failures(std::string_view backend) const;
  // The registry holding the learner's families (docs/GRPO_SPEC.md "Metrics per optimizer step").
  const common::Registry& metrics_registry() const { return *registry_; }
  const common::LearnerMetrics& metrics() const { return metrics_; }
  // For /healthz: OK unless the job failed; then Unavailable with the failure message.
  Status Health() const GRPO_EXCLUDES(mu_);

 private:
  struct BufferedGroup {
    common::RolloutGroup group;
    int64_t pass = 0;         // the ledger pass it was leased in
    int64_t accepted_ms = 0;  // ledger clock, taken before CompleteLease
  };
  // One group backend's counters (its publisher's, copied after each round).
  struct GroupStats {
    std::atomic<int64_t> syncs{0};
    std::atomic<int64_t> failures{0};
  };

  Learner(common::GrpoConfig config, LearnerOptions options);

  Status Resume();
  void TrainLoop() GRPO_EXCLUDES(mu_);
  // Ledger bookkeeping between batches: job state, next pass. Training thread.
  void Housekeep() GRPO_EXCLUDES(mu_);
  // Drops the workers that missed their heartbeats (the epoch advances); their ids, whose
  // leases ReturnLeasesOfDropped then returns, without mu_ (the ledger's commit is fsynced).
  std::vector<std::string> DropDeadWorkersLocked() GRPO_REQUIRES(mu_);
  void ReturnLeasesOfDropped(const std::vector<std::string>& dropped) GRPO_EXCLUDES(mu_);
  // Register's decisions under mu_ (roster, backend, epoch); the caller does the ledger I/O.
  common::Registration RegisterWorker(const common::RegisterRequest& request) GRPO_EXCLUDES(mu_);
  // After a sync whose deadline expired: leaves out of the group the members not heard from for
  // 1.5 heartbeat intervals (WorkerRegistry::SuspendSilentSince), until they heartbeat again.
  void SuspendStalledMembers(const std::string& backend, const std::vector<std::string>& members)
      GRPO_EXCLUDES(mu_);
  // `fill`: what dynamic sampling spent on the batch (its step metrics).
  void TrainBatch(std::vector<BufferedGroup> batch, BatchFill fill) GRPO_EXCLUDES(mu_);
  // AcceptGroup 3a: the group has no learning signal; the ledger records it filtered.
  void FilterGroup(const common::RolloutGroup& group, PushTally* tally) GRPO_EXCLUDES(mu_);
  // Until the published version is >= min_version (the incarnation rule of WaitForWeights):
  // OK, or DeadlineExceeded after kDefaultGetWeightsWait (or at once when stopping or
  // `cancel` trips).
  Status WaitForPublished(int64_t min_version, const common::CancelToken* cancel,
                          const std::string& incarnation) GRPO_EXCLUDES(mu_);
  // A new published version: the snapshot (`weight_publish: snapshot`), or (`stream`) the
  // version alone, and the readers waiting are served.
  Status PublishWeights() GRPO_EXCLUDES(mu_);
  // `stream`: hands the policy, a tensor at a time, to the readers waiting now (training thread,
  // while the weights are the published version's).
  Status ServeWeightReaders() GRPO_EXCLUDES(mu_);
  // TrainLoop, between steps, with `stream`: serves the readers waiting when the weights are the
  // published version's, or publishes them first when no batch is ready to train.
  void ServeReadersBetweenSteps() GRPO_EXCLUDES(mu_);
  // One weight-sync thread per group backend (`index` into common::GroupBackends()): its
  // WeightPublisher serves the workers assigned that backend, broadcasting each newly
  // published version.
  void WeightSyncLoop(size_t index) GRPO_EXCLUDES(mu_);
  Status Checkpoint() GRPO_EXCLUDES(mu_);
  // Checkpoint, tried `attempts` times with backoff (the final save at max_steps and at stop).
  Status CheckpointWithRetry(int attempts) GRPO_EXCLUDES(mu_);
  // Job end (max_steps, or stop): drops the buffer and rolls the ledger back to `saved_step`,
  // so that no prompt stays TRAINED that no saved weights hold.
  void EndLedgerAtStep(int64_t saved_step) GRPO_EXCLUDES(mu_);
  // A group accepted as (prompt, pass) was not trained: the ledger queues the pass again; a
  // failure is logged as an error and counted (grpo_ledger_errors_total), never silent.
  void RequeueUntrained(const TrainedGroup& key, std::string_view why);
  // Housekeep, before a pass boundary: true when nothing of the pass is being accepted or
  // trained and the buffer's whole batches do not already take the job to max_steps (full
  // batches may wait: the next pass's groups queue behind them); buffered groups already too
  // stale at the current version are requeued first (then false).
  bool PassMayEnd() GRPO_EXCLUDES(mu_);
  // Moves the job to `state` unless it already ended; tells subscribers.
  void ChangeState(JobState state, const std::string& message) GRPO_EXCLUDES(mu_);
  void Broadcast(const JobEvent& event) GRPO_EXCLUDES(mu_);
  void Refuse(PushTally* tally, common::GroupRefusal reason, const std::string& message)
      GRPO_EXCLUDES(mu_);
  // Metric updates: one optimizer step's values; the ledger's prompts by state.
  void RecordStepMetrics(const StepMetrics& step);
  void RefreshLedgerMetrics();
  bool TerminalLocked() const GRPO_REQUIRES(mu_);
  // What workers are told. The job is over for them (they exit) when it is done or cancelled.
  // A failed job is this process's end, not the job's: `grpo learner` exits 1 for its
  // orchestrator to restart it (a learner group whose rank died, a training error), and the
  // job resumes from the last checkpoint; workers are told the learner is shutting down, wait
  // and reconnect, as they do for a stopping learner.
  bool JobOverForWorkersLocked() const GRPO_REQUIRES(mu_);
  bool ShuttingDownForWorkersLocked() const GRPO_REQUIRES(mu_);
  // A generation batch is buffered: a full one, or a short one dynamic sampling lets go.
  bool BatchReadyLocked() const GRPO_REQUIRES(mu_);

  const common::GrpoConfig config_;
  const LearnerOptions options_;
  std::string incarnation_;         // NewIncarnation() at Create: this process's id for its weights
  bool started_ok_ = false;         // Start succeeded (the training thread ran)
  int64_t batch_groups_ = 0;        // groups per generation batch
  int64_t buffer_capacity_ = 0;     // groups
  int64_t versions_per_batch_ = 1;  // optimizer steps (policy versions) per generation batch
  // config multi_objective_aggregation (dynamic sampling's test of a group's signal)
  MultiObjectiveAggregation aggregation_ = MultiObjectiveAggregation::kSumThenNormalize;

  std::unique_ptr<PromptLedger> ledger_;   // thread-safe
  std::unique_ptr<common::Model> policy_;  // the training thread writes it
  std::unique_ptr<GrpoTrainer> trainer_;   // training thread (ValidateGroup: any)
  // Rank 0 posting to the other learner ranks; null alone. Used by the training thread (and by
  // Create and Stop, when no training thread runs).
  std::unique_ptr<distributed::RankZeroLink> rank_link_;
  std::unique_ptr<common::Registry> own_registry_;  // when options_.metrics_registry is null
  common::Registry* registry_ = nullptr;
  common::LearnerMetrics metrics_;  // families are thread-safe

  std::thread train_thread_;
  std::vector<std::thread> sync_threads_;  // WeightSyncLoop, one per group backend
  GroupStats group_stats_[3];              // by index into common::GroupBackends()
  // The rendezvous store; its epoch is the group epoch (bumped when the roster changes or a
  // group fails).
  const std::shared_ptr<common::InMemoryEpochStore> epoch_store_ =
      std::make_shared<common::InMemoryEpochStore>();
  common::SyncEndpoint endpoint_;  // where the policy lives (AssignBackend); set by Create

  mutable common::Mutex mu_;
  // Serialises LeasePrompts from its budget to its ledger write, so that concurrent calls do not
  // both spend the same lease budget. Taken before mu_, never while holding it.
  common::Mutex lease_mu_ GRPO_ACQUIRED_BEFORE(mu_);
  common::CondVar train_cv_;  // training thread: a batch is ready, or stop
  common::CondVar room_cv_;   // AcceptGroup: room in the buffer
  common::CondVar state_cv_;  // job state or published weights changed
  bool started_ GRPO_GUARDED_BY(mu_) = false;
  bool stopping_ GRPO_GUARDED_BY(mu_) = false;
  bool training_ GRPO_GUARDED_BY(mu_) = false;  // a batch is being trained
  bool stopped_ GRPO_GUARDED_BY(mu_) = false;
  bool ledger_ended_ GRPO_GUARDED_BY(mu_) = false;  // EndLedger ran
  JobState state_ GRPO_GUARDED_BY(mu_) = JobState::kWaitingForData;
  std::string message_ GRPO_GUARDED_BY(mu_);
  int64_t global_step_ GRPO_GUARDED_BY(mu_) = 0;
  int64_t last_saved_step_ GRPO_GUARDED_BY(mu_) = 0;
  // A generation batch failed in training: the weights may hold optimizer steps its groups took
  // before the failure, and those groups went back to the queue; no checkpoint is saved after it.
  bool training_failed_ GRPO_GUARDED_BY(mu_) = false;
  int64_t last_published_step_ GRPO_GUARDED_BY(mu_) = -1;
  bool housekeep_due_ GRPO_GUARDED_BY(mu_) = true;
  // Rewards per completion of every accepted group, when reward_funcs does not fix it: the
  // trainer needs one count per generation batch. -1 until the first group.
  int64_t reward_count_ GRPO_GUARDED_BY(mu_) = -1;
  std::map<std::string, double> last_metrics_ GRPO_GUARDED_BY(mu_);
  std::deque<BufferedGroup> buffer_ GRPO_GUARDED_BY(mu_);
  // Groups filtered for the batch being filled (dynamic sampling); set by Create.
  BatchFillCounter batch_fill_ GRPO_GUARDED_BY(mu_){1, 0};
  // Housekeep found the pass unable to end only because a prompt owes an earlier pass while its
  // later group waits in the partial batch (the owed pass is queued once that group trains): the
  // buffer trains now, short, instead of waiting for groups that cannot come.
  bool drain_buffer_ GRPO_GUARDED_BY(mu_) = false;
  std::multiset<int64_t> accepting_ms_ GRPO_GUARDED_BY(mu_);            // accepts in flight
  std::map<std::string, int> bad_group_attempts_ GRPO_GUARDED_BY(mu_);  // by prompt id
  std::map<std::string, int64_t> refused_ GRPO_GUARDED_BY(mu_);         // by reason
  WorkerRegistry workers_ GRPO_GUARDED_BY(mu_);
  std::shared_ptr<const WeightSnapshot> weights_ GRPO_GUARDED_BY(mu_);  // snapshot mode
  int64_t published_version_ GRPO_GUARDED_BY(mu_) = -1;                 // in both modes
  const bool streams_weights_;
  // GetWeights calls waiting for the training thread (`weight_publish: stream`).
  WeightReaders readers_;
  std::list<std::shared_ptr<Subscriber>> subscribers_ GRPO_GUARDED_BY(mu_);
};

}  // namespace grpo::learner
