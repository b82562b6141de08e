// LearnerServer: the learner process's gRPC face (grpo.v1.LearnerService, proto/grpo/v1/
// learner.proto) and the training loop behind it (docs/ARCHITECTURE.md "The flow of one training
// step"). It owns the prompt ledger, the policy, the GrpoTrainer, a bounded buffer of accepted
// rollout groups, the worker registry, the published weights, the job state, WatchJob
// subscribers and the c10d rendezvous store.
//
// Ingest policy (PushRollouts), per group, in this order:
//   1. The lease must be the prompt's current, unexpired lease (unknown_lease / expired_lease;
//      the ledger is not touched: an expired lease requeues on its own).
//   2. GrpoTrainer::ValidateGroup. A bad group is most likely a worker bug, so the prompt is
//      requeued (ReleaseLease); only empty_prompt (the prompt itself tokenizes to nothing), or
//      the same prompt failing kMaxBadGroupAttempts times in a row, rejects the prompt
//      (RejectPrompt). A stale group is always requeued.
//   3. Backpressure: the handler waits (push_buffer_wait at most) for room in the buffer before
//      it completes the lease; after a timeout the rest of the stream is refused (buffer_full)
//      and released at once.
//   4. CompleteLease (LEASED -> TRAINED), then the group joins the buffer.
// A buffered group that the trainer refuses later (it went stale while waiting) gets its
// prompt back for the same pass (PromptLedger::RequeueTrained; a failure is an error).
//
// Refused before the content: groups whose policy this learner did not publish (another
// learner_incarnation: a restarted learner's versions restart from its checkpoint, or a version
// above its own): unknown_policy. While the learner stops: learner_stopping (lease released).
//
// Crash consistency (ledger vs model): the ledger marks a prompt TRAINED (accepted) when its
// group joins the buffer, and records the optimizer step that takes it (MarkTrained; the step
// after it when the batch ends inside a step). Periodic checkpoints are taken only between
// optimizer steps, so "the weights after step S hold these groups" is exact. On start, after
// RestoreLatestCheckpoint at step S, PromptLedger::RollbackTo(S) undoes every training after S,
// requeues accepted groups and moves prompts back to any pass they owe (a pass boundary after S
// is undone for them): nothing trained is lost and nothing is trained twice in a pass. At job
// end (max_steps, stop) the buffer is dropped and the ledger rolled back to the saved step.
// Leases of a dead learner stay valid until their deadline (a worker that outlived it may still
// push; its groups of the dead learner's weights are refused as unknown_policy, the prompt
// released).
//
// Pass boundaries (Housekeep): the next pass starts when nothing is QUEUED or LEASED, no
// prompt owes an earlier pass, nothing is being accepted and the buffer holds less than one
// generation batch; that partial batch trains next, together with the new pass's first groups.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/grpo_metrics.h"
#include "common/metrics.h"
#include "common/model.h"
#include "common/rollout_types.h"
#include "common/status.h"
#include "common/weight_sync/backends.h"
#include "common/weight_sync/epoch_store.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "learner/grpo_trainer.h"
#include "learner/prompt_ledger.h"
#include "learner/weight_publisher.h"
#include "services/grpc_store.h"

namespace grpo::services {

// How often a worker should heartbeat; one that misses kHeartbeatsMissedBeforeDrop of them is
// dropped from the weight-sync group (the group epoch bumps).
inline constexpr std::chrono::milliseconds kDefaultHeartbeatInterval{2000};
inline constexpr int kHeartbeatsMissedBeforeDrop = 5;
// The longest a PushRollouts stream waits for room in a full buffer.
inline constexpr std::chrono::milliseconds kDefaultPushBufferWait{30'000};
// LeasePrompts with nothing to lease: how long the worker should wait before asking again.
inline constexpr std::chrono::milliseconds kDefaultLeaseRetryAfter{250};
// LeasePrompts while the buffer is full waits up to this long for room (a long poll: the call
// returns as soon as the trainer takes a batch), never past the call's deadline minus a margin.
inline constexpr std::chrono::milliseconds kLeaseLongPoll{3000};
// GetWeights for a version not published yet waits this long at most (or the call's deadline).
inline constexpr std::chrono::milliseconds kDefaultGetWeightsWait{60'000};
// In-flight calls get this long to finish when the server stops.
inline constexpr std::chrono::milliseconds kDefaultShutdownGrace{5000};
// Long waits (WatchJob, Store GET, buffer room) re-check cancellation this often.
inline constexpr std::chrono::milliseconds kWaitPollInterval{200};
// The training thread refreshes the job state from the ledger this often (and after events).
inline constexpr std::chrono::milliseconds kHousekeepInterval{1000};
// WeightChunk payload: the default and the maximum (a request may ask for less).
inline constexpr int64_t kDefaultWeightChunkBytes = 4 << 20;
// Events queued per WatchJob subscriber; a subscriber that falls this far behind is dropped.
inline constexpr size_t kWatchQueueCapacity = 1024;
inline constexpr int64_t kMaxLeasesPerCall = 1024;
inline constexpr int kMaxBadGroupAttempts = 3;
inline constexpr int64_t kMaxDatasetBytes = 1ll << 30;
// The final checkpoint (max_steps, stop) is tried this often before the job fails.
inline constexpr int kFinalCheckpointAttempts = 3;

enum class JobState { kWaitingForData, kRunning, kDone, kCancelled, kFailed };
// "waiting_for_data", "running", "done", "cancelled", "failed" (Job.state on the wire).
std::string_view JobStateName(JobState state);

struct LearnerServerOptions {
  // Tokenizer files here are copied into every checkpoint; empty = none.
  std::string model_dir;
  // The gRPC bind address; empty = config.grpc_bind_address.
  std::string bind_address;
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
  std::chrono::milliseconds weight_sync_timeout = common::kDefaultBroadcastTimeout;
  std::string weight_sync_hostname;
  // The backends' factory; empty = the built-in ones (common::BuiltinWeightSyncFactory). A test
  // injects the in-process fake; then every group backend counts as built.
  common::WeightSyncFactory weight_sync_factory;
  // Tests only: called before each checkpoint save with its step; an error fails that save as a
  // full disk would (fault injection).
  std::function<Status(int64_t step)> TEST_checkpoint_fault;
  // SubmitDataset refuses uploads larger than this (each line counts its bytes + 1).
  int64_t max_dataset_bytes = kMaxDatasetBytes;
  // Borrowed, must outlive the server; the server adds common::LearnerMetrics to it. Null = the
  // server owns a registry of its own (metrics_registry()).
  common::Registry* metrics_registry = nullptr;
};

// Thread-safe: RPC handlers run on gRPC's threads; one training thread owns the trainer and the
// policy. Lifetime: Create -> Start -> (WaitForJobEnd) -> Stop; the destructor stops.
class LearnerServer final : public v1::LearnerService::Service {
 public:
  // Opens the ledger (config.ledger_path, default <output_dir>/ledger.sqlite), moves `policy` to
  // config.device in its own dtype (fp32 with `bf16`: the trainer trains a bf16 copy), creates the
  // trainer on it (`reference` as GrpoTrainer::Create requires), restores the latest checkpoint
  // when options.resume. InvalidArgument naming the key on a bad config, and for a `device`
  // this process cannot use (common::ResolveDevice).
  static StatusOr<std::unique_ptr<LearnerServer>> Create(
      common::GrpoConfig config, std::unique_ptr<common::Model> policy,
      std::unique_ptr<common::Model> reference = nullptr, LearnerServerOptions options = {});
  ~LearnerServer() override;
  LearnerServer(const LearnerServer&) = delete;
  LearnerServer& operator=(const LearnerServer&) = delete;

  // Binds <bind_address>:<config.grpc_port> (0 = a free port), serves LearnerService and
  // grpc.health.v1 (SERVING), publishes the initial weights and starts the training thread.
  // With auth_token_file set, a call without the token is refused inside gRPC before its message
  // is read (TokenAuthProcessor; health Check/Watch are open); logs a WARNING when auth is off
  // and the address is not loopback. Unavailable when the port cannot be bound.
  Status Start();
  // Stops training after the current generation batch, saves a checkpoint when `checkpoint`
  // and steps were taken since the last one, then shuts the server down (in-flight calls get
  // kDefaultShutdownGrace). Idempotent; returns the checkpoint error if any.
  Status Stop(bool checkpoint);
  // Blocks until the job is done, cancelled or failed, or `timeout` passes; true if it ended.
  bool WaitForJobEnd(std::chrono::milliseconds timeout);

  int port() const { return port_; }  // the bound port, after Start
  // This process's learner_incarnation (RegisterResponse): groups must carry it.
  const std::string& incarnation() const { return incarnation_; }
  JobState job_state() const;
  int64_t published_version() const;
  int64_t group_epoch() const { return epoch_store_->epoch(); }
  learner::PromptLedger& ledger() { return *ledger_; }
  // Groups refused by PushRollouts (and by the trainer later) since start, by reason.
  std::map<std::string, int64_t> RefusedCounts() const;
  // The live policy. Read it only while training is idle (tests).
  const common::Model& policy() const { return *policy_; }
  int64_t generation_batch_groups() const { return batch_groups_; }
  // The rendezvous store the Store RPC serves (the learner's side of it; no auth). Its epoch is
  // the weight-sync group epoch.
  const std::shared_ptr<common::InMemoryEpochStore>& epoch_store() const { return epoch_store_; }
  // Versions committed to `backend`'s group (gloo, nccl, cuda_ipc), and its failed
  // joins/broadcasts (each ended an epoch).
  int64_t group_syncs(std::string_view backend) const;
  int64_t group_sync_failures(std::string_view backend) const;
  // The registry holding the learner's families (docs/GRPO_SPEC.md "Metrics per optimizer step"),
  // for an HttpExposer and tests; updated after each step, on ingest, publish and checkpoint.
  const common::Registry& metrics_registry() const { return *registry_; }
  const common::LearnerMetrics& metrics() const { return metrics_; }
  // For /healthz: OK unless the job failed; then Unavailable with the failure message.
  Status Health() const;

  // --- grpo.v1.LearnerService. Every handler checks auth first and never throws.
  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status LeasePrompts(grpc::ServerContext* context, const v1::LeasePromptsRequest* request,
                            v1::LeasePromptsResponse* response) override;
  grpc::Status PushRollouts(grpc::ServerContext* context,
                            grpc::ServerReader<v1::RolloutGroup>* reader,
                            v1::PushRolloutsResponse* response) override;
  grpc::Status GetWeights(grpc::ServerContext* context, const v1::GetWeightsRequest* request,
                          grpc::ServerWriter<v1::WeightChunk>* writer) override;
  grpc::Status SubmitDataset(grpc::ServerContext* context,
                             grpc::ServerReader<v1::SubmitDatasetRequest>* reader,
                             v1::SubmitDatasetResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* response) override;
  grpc::Status Store(grpc::ServerContext* context, const v1::StoreRequest* request,
                     v1::StoreResponse* response) override;

 private:
  struct BufferedGroup {
    common::RolloutGroup group;
    int64_t pass = 0;         // the ledger pass it was leased in
    int64_t accepted_ms = 0;  // ledger clock, taken before CompleteLease
  };
  struct Worker {
    std::string hostname;
    int32_t pid = 0;
    std::string backend;           // asked for at Register
    std::string assigned_backend;  // common::AssignBackend's answer
    int32_t rank = 0;
    int64_t weight_version = -1;
    std::chrono::steady_clock::time_point last_seen;
  };
  // An immutable copy of the policy's tensors, shared with GetWeights calls and the publishers.
  using WeightSnapshot = learner::WeightSnapshot;
  // One group backend's counters (its publisher's, copied after each round).
  struct GroupStats {
    std::atomic<int64_t> syncs{0};
    std::atomic<int64_t> failures{0};
  };
  struct Subscriber {
    std::condition_variable cv;
    std::deque<v1::JobEvent> events;  // GUARDED_BY(mu_)
    bool dropped = false;             // GUARDED_BY(mu_): fell kWatchQueueCapacity behind
  };
  // The tally of one PushRollouts stream.
  struct PushTally {
    int64_t accepted = 0, refused = 0;
    std::map<std::string, int64_t> by_reason;
    std::vector<std::string> messages;
    bool buffer_timed_out = false;
  };

  LearnerServer(common::GrpoConfig config, LearnerServerOptions options);

  Status Resume();
  void TrainLoop();
  // Ledger bookkeeping between batches: job state, next pass. Training thread.
  void Housekeep();
  void DropDeadWorkersLocked();  // REQUIRES(mu_)
  void TrainBatch(std::vector<BufferedGroup> batch);
  Status PublishWeights();
  // One weight-sync thread per group backend (`index` into common::GroupBackends()): its
  // WeightPublisher serves the workers assigned that backend, broadcasting each newly
  // published version.
  void WeightSyncLoop(size_t index);
  Status Checkpoint();
  // Checkpoint, tried `attempts` times with backoff (the final save at max_steps and at stop).
  Status CheckpointWithRetry(int attempts);
  // Job end (max_steps, or stop): drops the buffer and rolls the ledger back to `saved_step`,
  // so that no prompt stays TRAINED that no saved weights hold.
  void EndLedgerAtStep(int64_t saved_step);
  // A group accepted as (prompt, pass) was not trained: the ledger queues the pass again; a
  // failure is logged as an error and counted (grpo_ledger_errors_total), never silent.
  void RequeueUntrained(const learner::TrainedGroup& key, std::string_view why);
  // Housekeep, before a pass boundary: true when nothing of the pass is being accepted or
  // trained and the buffer holds less than one batch (which trains next, before any other
  // step); buffered groups already too stale for that batch are requeued first (then false).
  bool PassMayEnd();
  // Moves the job to `state` unless it already ended; tells subscribers.
  void ChangeState(JobState state, const std::string& message);
  void Broadcast(const v1::JobEvent& event);
  v1::Job BuildJob();
  void ProcessGroup(const v1::RolloutGroup& msg, grpc::ServerContext* context, PushTally* tally);
  void Refuse(PushTally* tally, const std::string& reason, const std::string& message);
  // Metric updates: one optimizer step's values; the ledger's prompts by state.
  void RecordStepMetrics(const learner::StepMetrics& step);
  void RefreshLedgerMetrics();
  bool TerminalLocked() const;  // REQUIRES(mu_)
  // Groups that may be leased now (>= 0) so that none of them goes stale: a group leased now is
  // generated with the current policy and trained after the batches ahead of it (the one in
  // training, the groups buffered, being pushed and `leased_out`), each of which moves the
  // policy versions_per_batch_ versions; max_staleness bounds that. 0 while the buffer is full
  // (buffer_capacity_). REQUIRES(mu_)
  int64_t LeaseBudgetLocked(int64_t leased_out) const;

  const common::GrpoConfig config_;
  const LearnerServerOptions options_;
  std::string auth_token_;
  std::string incarnation_;  // NewIncarnation() at Create: this process's id for its weights
  bool started_ok_ = false;  // Start succeeded (the training thread ran)
  std::shared_ptr<grpc::ServerCredentials> server_credentials_;  // TLS or insecure
  int64_t batch_groups_ = 0;     // groups per generation batch
  int64_t buffer_capacity_ = 0;  // groups
  int64_t versions_per_batch_ = 1;  // optimizer steps (policy versions) per generation batch

  std::unique_ptr<learner::PromptLedger> ledger_;  // thread-safe
  std::unique_ptr<common::Model> policy_;          // the training thread writes it
  std::unique_ptr<learner::GrpoTrainer> trainer_;  // training thread (ValidateGroup: any)
  std::unique_ptr<common::Registry> own_registry_;   // when options_.metrics_registry is null
  common::Registry* registry_ = nullptr;
  common::LearnerMetrics metrics_;  // families are thread-safe

  std::unique_ptr<grpc::Server> server_;
  std::thread train_thread_;
  std::vector<std::thread> sync_threads_;  // WeightSyncLoop, one per group backend
  GroupStats group_stats_[3];              // by index into common::GroupBackends()
  int port_ = 0;
  // The rendezvous store; its epoch is the group epoch (bumped when the roster changes or a
  // group fails).
  const std::shared_ptr<common::InMemoryEpochStore> epoch_store_ =
      std::make_shared<common::InMemoryEpochStore>();
  common::SyncEndpoint endpoint_;  // where the policy lives (AssignBackend); set by Create

  mutable std::mutex mu_;
  // Serialises LeasePrompts from its budget to its ledger write, so that concurrent calls do not
  // both spend the same lease budget. Taken before mu_, never while holding it.
  std::mutex lease_mu_;
  std::condition_variable train_cv_;            // training thread: a batch is ready, or stop
  std::condition_variable room_cv_;             // PushRollouts: room in the buffer
  std::condition_variable state_cv_;            // job state or published weights changed
  bool started_ = false;                        // GUARDED_BY(mu_)
  bool stopping_ = false;                       // GUARDED_BY(mu_)
  bool training_ = false;                       // GUARDED_BY(mu_): a batch is being trained
  bool stopped_ = false;                        // GUARDED_BY(mu_)
  JobState state_ = JobState::kWaitingForData;  // GUARDED_BY(mu_)
  std::string message_;                         // GUARDED_BY(mu_)
  int64_t global_step_ = 0;                     // GUARDED_BY(mu_)
  int64_t last_saved_step_ = 0;                 // GUARDED_BY(mu_)
  int64_t last_published_step_ = -1;            // GUARDED_BY(mu_)
  bool housekeep_due_ = true;                   // GUARDED_BY(mu_)
  // Rewards per completion of every accepted group, when reward_funcs does not fix it: the
  // trainer needs one count per generation batch. -1 until the first group.
  int64_t reward_count_ = -1;                           // GUARDED_BY(mu_)
  std::map<std::string, double> last_metrics_;          // GUARDED_BY(mu_)
  std::deque<BufferedGroup> buffer_;                    // GUARDED_BY(mu_)
  std::multiset<int64_t> accepting_ms_;                 // GUARDED_BY(mu_): accepts in flight
  std::map<std::string, int> bad_group_attempts_;       // GUARDED_BY(mu_): by prompt id
  std::map<std::string, int64_t> refused_;              // GUARDED_BY(mu_): by reason
  std::map<std::string, Worker> workers_;               // GUARDED_BY(mu_): by worker id
  int64_t next_worker_number_ = 1;                      // GUARDED_BY(mu_)
  std::shared_ptr<const WeightSnapshot> weights_;       // GUARDED_BY(mu_)
  std::list<std::shared_ptr<Subscriber>> subscribers_;  // GUARDED_BY(mu_)

};

}  // namespace grpo::services
