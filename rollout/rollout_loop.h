// RolloutLoop: the rollout worker's loop, free of gRPC. It registers through a LearnerLink,
// takes the policy's weights through a WeightReceiver, then repeats: lease prompts -> produce
// their groups (rollout/produce.h: row -> prompt text -> ids -> generate -> score) -> push the
// groups, taking newer weights between rounds, while a heartbeat thread keeps the learner
// informed. services::RolloutWorker runs it over gRPC; tests run it over FakeLearnerLink.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/metrics/grpo_metrics.h"
#include "common/metrics/metrics.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/tokenizer/tokenizer.h"
#include "rollout/env/episode_config.h"
#include "rollout/generator.h"
#include "rollout/learner_link.h"
#include "rollout/produce.h"
#include "rollout/reward.h"
#include "rollout/weight_receiver.h"

namespace grpo::rollout {

// Per-call deadlines (weights: kDefaultWeightReceiveTimeout in weight_receiver.h).
inline constexpr std::chrono::milliseconds kDefaultRegisterTimeout{10000};
inline constexpr std::chrono::milliseconds kDefaultHeartbeatTimeout{5000};
inline constexpr std::chrono::milliseconds kDefaultLeaseTimeout{10000};
// One push (every group of one round).
inline constexpr std::chrono::milliseconds kDefaultPushTimeout{60000};
// When stopping, the last push gets one attempt with this deadline.
inline constexpr std::chrono::milliseconds kDefaultStopPushTimeout{10000};
// Used when Register's heartbeat_interval_ms is 0.
inline constexpr std::chrono::milliseconds kDefaultWorkerHeartbeatInterval{5000};
// Wait before leasing again when the learner had no prompts and gave no retry_after_ms.
inline constexpr std::chrono::milliseconds kDefaultEmptyLeaseWait{1000};

// Capped exponential backoff with jitter between retries of a call.
struct BackoffOptions {
  std::chrono::milliseconds initial{100};
  std::chrono::milliseconds max{10000};
  double multiplier = 2.0;
  double jitter = 0.2;  // each delay is scaled by a uniform factor in [1 - jitter, 1 + jitter]
};

// Not thread-safe.
class Backoff {
 public:
  explicit Backoff(BackoffOptions options, uint64_t seed = std::random_device{}());
  // The delay before the next attempt: initial * multiplier^n, jittered, never above max.
  std::chrono::milliseconds Next();
  void Reset() { attempt_ = 0; }
  int64_t attempts() const { return attempt_; }

 private:
  BackoffOptions options_;
  std::mt19937_64 rng_;
  int64_t attempt_ = 0;
};

struct LinkTimeouts {
  std::chrono::milliseconds register_call = kDefaultRegisterTimeout;
  std::chrono::milliseconds heartbeat = kDefaultHeartbeatTimeout;
  std::chrono::milliseconds lease = kDefaultLeaseTimeout;
  std::chrono::milliseconds push = kDefaultPushTimeout;
  std::chrono::milliseconds stop_push = kDefaultStopPushTimeout;
  std::chrono::milliseconds get_weights = kDefaultWeightReceiveTimeout;
};

// Counters since Create (a consistent-enough snapshot; each field is read atomically).
struct WorkerStats {
  int64_t registrations = 0;
  int64_t rounds = 0;  // lease rounds that returned prompts
  int64_t leases = 0;  // leases received
  int64_t groups_pushed = 0;
  int64_t groups_accepted = 0;  // as acked by the learner
  int64_t groups_rejected = 0;
  int64_t groups_dropped = 0;  // generated but never acknowledged (push failed)
  int64_t prompts_failed = 0;  // bad row, tokenizer error, too long with reject, empty ...
  int64_t completion_tokens = 0;
  int64_t weight_fetches = 0;
  int64_t rpc_retries = 0;  // failed attempts that were retried
  int64_t heartbeats = 0;
  int64_t heartbeat_failures = 0;
  int64_t reward_errors = 0;
  int64_t reward_timeouts = 0;
  int64_t episodes = 0;       // multi-turn episodes run
  int64_t episode_turns = 0;  // their model turns
  int64_t env_errors = 0;     // episodes whose environment failed
};

// The sampler seed index of a leased prompt (FNV-1a of its lease id), so its completions depend
// on the lease only (not on the rest of the batch) and differ between two leases of one prompt.
int64_t SeedIndex(std::string_view lease_id);

// The generation, precision (bf16) and reward keys a worker takes from the learner's
// config_json. Not `device`: a worker's GPU is its own.
const std::vector<std::string>& LearnerOwnedConfigKeys();
// `local` with LearnerOwnedConfigKeys() taken from `config_json` (a GrpoConfig as JSON; other and
// unknown keys are ignored; model_name_or_path only when `local`'s is empty).
// InvalidArgument naming the key on a malformed value, or when the result does not Validate.
StatusOr<common::GrpoConfig> MergeLearnerConfig(const common::GrpoConfig& local,
                                                const std::string& config_json);

// The reward functions of a (merged) configuration.
using RewardRunnerFactory =
    std::function<StatusOr<std::unique_ptr<RewardRunner>>(const common::GrpoConfig& config)>;

struct RolloutLoopOptions {
  std::string worker_id;  // empty = the learner assigns one
  // The worker's own configuration: device, model_name_or_path (tokenizer) ... The generation,
  // precision (bf16) and reward keys of Register's config_json override it
  // (LearnerOwnedConfigKeys); `device` is always this one's.
  common::GrpoConfig config;
  // Prompts per LeasePrompts call; 0 = generation batch / num_generations (at least 1).
  int64_t prompts_per_lease = 0;
  // tokenizer.json or a model directory. Empty: config.model_name_or_path when it holds one
  // here, else the byte tokenizer when the model's vocabulary is its size (tiny models).
  std::string tokenizer_path;
  // Builds the reward functions at every Register; null = RewardRunner::FromConfig (built-ins
  // only) with reward_options and reward_timeout. services:: passes one with remote functions.
  RewardRunnerFactory make_rewards;
  // Builds the environment of a config with an `env` (multi-turn episodes) at every Register;
  // null = rollout::MakeEnvironment (built-ins only). services:: passes one with grpc: too.
  EnvironmentFactory make_environment;
  // Options of built-in reward functions by name, e.g. {"length": {"target_length": 8}}.
  nlohmann::json reward_options = nlohmann::json::object();
  std::chrono::milliseconds reward_timeout = kDefaultRewardTimeout;
  BackoffOptions backoff;
  LinkTimeouts timeouts;
  // Borrowed; may be null. Once true (e.g. from a SIGTERM handler), the loop leases nothing
  // more, pushes what it already generated (one attempt) and Run returns OK.
  const std::atomic<bool>* stop = nullptr;
  int64_t max_rounds = 0;  // lease rounds with prompts before Run returns; 0 = no limit
  // Borrowed; may be null. The loop adds common::WorkerMetrics to it at its first Register
  // (the reward_fn label values are the learner's reward_funcs) and keeps them updated.
  common::Registry* metrics_registry = nullptr;
  // Tests: GeneratorOptions::window_hook of the generator the loop builds.
  std::function<void(int64_t steps)> generator_window_hook;
};

// Run is called once, from one thread; it starts and joins a heartbeat thread. The accessors
// may be called from any thread.
//
// Failure handling: a call that fails with Unavailable, DeadlineExceeded, ResourceExhausted,
// Aborted, Internal, FailedPrecondition or Cancelled is retried with Backoff until it succeeds or
// the stop flag is set (a push only while some of its leases are still valid). NotFound from
// Heartbeat or LeasePrompts (the learner forgot this worker, e.g. it restarted), or a heartbeat
// naming another learner incarnation, means register again. A group that cannot be generated is
// pushed as its failure, which gives its lease back at once: its environment failed, timed out
// or went away (the learner queues the prompt again, and the next lease waits: backoff_
// options, longer while every group fails), or the prompt itself failed (empty, too long with
// truncate_prompt=reject: the learner rejects it). Leases of rows that do not parse (the
// learner checks the row schema at submission) or of groups that cannot be pushed expire after
// lease_seconds, and the learner queues them again.
//
// Weights: a new version is received into a fresh model (the generator may still use the old
// one) and installed between rounds; each group carries the version and the learner incarnation
// of its weights. With partial_rollouts, newer weights of the same learner incarnation are also
// received while a round generates and installed at once (Generate switches to them between two
// decode steps; each token records its version, and the group its oldest).
class RolloutLoop {
 public:
  // `link` and `receiver` are borrowed, not null, and must outlive the loop. InvalidArgument
  // for a negative prompts_per_lease, and naming the key for a `device` that cannot be used
  // here (common::ResolveDevice). No call to the learner yet.
  static StatusOr<std::unique_ptr<RolloutLoop>> Create(RolloutLoopOptions options,
                                                       LearnerLink* link, WeightReceiver* receiver);
  ~RolloutLoop();

  // Registers, takes the weights and runs rounds until the learner reports the job done (or
  // shutdown), max_rounds, or the stop flag. OK then; otherwise the non-retryable error
  // (Unauthenticated, InvalidArgument config, a model config without tokenizer, Internal from
  // generation ...).
  Status Run();

  WorkerStats stats() const;
  // The policy the next round generates with (null before the first weights), and its version:
  // on config.device, in bf16 when the learner's `bf16` is true, else fp32.
  std::shared_ptr<const common::Model> policy() const GRPO_EXCLUDES(mu_);
  int64_t policy_version() const { return policy_version_.load(); }
  std::string worker_id() const GRPO_EXCLUDES(mu_);
  int32_t rank() const { return rank_.load(); }
  // The merged generation config (after Register).
  common::GrpoConfig config() const GRPO_EXCLUDES(mu_);

 private:
  RolloutLoop(RolloutLoopOptions options, at::Device device, LearnerLink* link,
              WeightReceiver* receiver);

  bool Stopping() const;
  // Sleeps up to `d`; false (early) when stopping.
  bool SleepUnlessStopping(std::chrono::milliseconds d);
  // Runs `attempt` until OK, an error outside the retryable set, Stopping() (Cancelled) or
  // `give_up()` (the last error). `what` names the call in logs.
  // `backoff`: a thread's own (null = backoff_, main thread only).
  Status Retry(std::string_view what, const std::function<Status()>& attempt,
               const std::function<bool()>& give_up = {}, Backoff* backoff = nullptr);

  Status Register();  // with retries; (re)builds config, tokenizer, rewards, generator
  Status ApplyRegistration(const Registration& registration) GRPO_EXCLUDES(mu_);
  GeneratorOptions GeneratorOptionsOf(const common::GrpoConfig& config) const;
  Status SyncWeights(int64_t min_version);  // with retries; installs a new policy snapshot
  // One GetWeights attempt: a fresh model on device_ in the compute dtype with the weights of
  // version >= min_version, and what they are.
  StatusOr<std::pair<std::shared_ptr<const common::Model>, ReceivedVersion>> ReceiveWeights(
      int64_t min_version) GRPO_EXCLUDES(mu_);
  // partial_rollouts: runs beside a round's generation until `*generating` is false, taking each
  // newer version of learner `incarnation`'s weights (one attempt each; a failure waits for the
  // next round) and installing it; it stops at weights of another incarnation.
  void FetchInFlight(const std::string& incarnation, const std::atomic<bool>* generating)
      GRPO_EXCLUDES(mu_);
  Status InstallPolicy(std::shared_ptr<const common::Model> model, const ReceivedVersion& received)
      GRPO_EXCLUDES(mu_);
  // No weights yet, newer ones at the learner, or weights of a learner incarnation the worker
  // has left.
  bool NeedsWeights() const GRPO_EXCLUDES(mu_);
  // The learner incarnation of the weights that generate now (policy_incarnation_).
  std::string PolicyIncarnation() const GRPO_EXCLUDES(mu_);
  // One LeasePrompts exchange of up to `count` prompts (with Retry and the learner's long poll
  // for budget when `retry`, else one attempt answered at once): the reply, counted as a round,
  // when it holds prompts. nullopt otherwise: done_ set when the job is done, needs_register_
  // when the learner forgot this worker or restarted, and *wait the learner's retry_after when it
  // had no prompts now. Errors: the call's. `starts_with`: the version the groups start with (the
  // stream's current one), or -1 when the round takes the newest weights after leasing.
  StatusOr<std::optional<LeaseReply>> Lease(int64_t count, bool retry, int64_t starts_with,
                                            std::chrono::milliseconds* wait);
  // One lease round. Sets done_ when the learner has nothing more.
  Status RunRound() GRPO_EXCLUDES(mu_);
  // Continuous batching (rollout/rollout_stream.cc): one GenerateStream call that leases
  // prompts as groups leave and pushes each group when done (from a pusher thread), until the
  // job is done, the worker stops, must register again, or its in-flight weight fetch gave up;
  // rounds_limit > 0 caps counters_.rounds. Errors as RunRound's.
  Status RunStream(int64_t rounds_limit) GRPO_EXCLUDES(mu_);
  // Continuous batching of multi-turn episodes (with a config `env`; rollout_stream.cc): one
  // StreamEpisodes call that leases prompts while environment sessions are free and pushes each
  // group as soon as its episodes end (from a pusher thread). With partial_rollouts newer
  // weights are installed while it runs (taken between turns, when nothing decodes); without,
  // it stops leasing once the learner has newer weights and ends when its groups are done.
  // Ends and errors as RunStream's.
  Status RunEpisodeStream(int64_t rounds_limit) GRPO_EXCLUDES(mu_);
  // A stream's leasing (RunStream's and RunEpisodeStream's `take`): up to `room` prepared
  // prompts. `idle`: nothing decodes, so it may wait (Lease's retries and long poll; a lease
  // error is kept in *error and ends the stream); else one attempt, and none before the
  // learner's retry_after (*next_at) when the last had nothing. Nothing once the stream should
  // end: stopping, the job done, rounds_limit reached, to register again, `fetch_stopped`, an
  // error kept, or `behind()` while idle. `version`: the version the prompts start with.
  std::vector<std::pair<PromptLease, Prompt>> LeaseForStream(
      int64_t room, bool idle, int64_t version, int64_t rounds_limit,
      const std::function<bool()>& behind, const std::atomic<bool>& fetch_stopped,
      std::chrono::steady_clock::time_point* next_at, Status* error);
  // Row -> prompt of a lease; nullopt (counted, logged) for a bad row.
  std::optional<Prompt> PrepareLeased(const PromptLease& lease);
  // A produced group as pushed: lease, prompt and incarnation set, reward failures counted. A
  // group that failed (counted, logged) is pushed as its failure alone (RolloutGroup::failure,
  // and prompt_failed when the prompt itself failed), which gives its lease back.
  common::RolloutGroup ToPushed(ProducedGroup& produced, const PromptLease& lease,
                                const std::string& incarnation);
  // After a failed group (`failed`) the next lease waits: exponentially longer while every group
  // fails (an environment that is down), not at all after one that did not. Returns the wait.
  std::chrono::milliseconds AfterGroup(bool failed);
  // With retries (`backoff`: as Retry's) while a lease is valid; a failed push drops the groups.
  Status PushGroups(const std::vector<common::RolloutGroup>& groups, int64_t last_deadline_ms,
                    Backoff* backoff = nullptr);
  // A stream's push (rollout_stream.cc): PushGroups with a Backoff of its own, for one thread.
  std::function<void(const std::vector<common::RolloutGroup>&, int64_t)> PushWithBackoff();
  // A streamed group that left the decode: its `tokens` generated, in the counters and metrics,
  // and its generation time since `started`.
  void CountStreamedGroup(int64_t tokens, std::chrono::steady_clock::time_point started);
  void HeartbeatLoop() GRPO_EXCLUDES(mu_);
  void StartHeartbeat() GRPO_EXCLUDES(mu_);
  void StopHeartbeat() GRPO_EXCLUDES(mu_);
  void NoteLearnerVersion(int64_t version);
  void SetLeasesHeld(int32_t n);
  // One ScoreGroup call's per-function latencies into grpo_rollout_reward_duration_seconds
  // and its failures, by kind, into grpo_rollout_reward_errors_total.
  void CountRewardFailures(const RewardCallReport& report);
  void CountEpisodes(const EpisodeCounts& counts);
  int64_t PromptsPerLease() const;

  const RolloutLoopOptions options_;
  const at::Device device_;  // options_.config.device, resolved: where generation runs
  // The learner's bf16 on a CPU that emulates it is said once per process (common/model/device.h
  // CpuBf16Warning).
  std::once_flag cpu_bf16_checked_;
  LearnerLink* const link_;  // borrowed, thread-safe
  Backoff backoff_;          // main thread only
  Backoff failed_groups_;    // main thread only: AfterGroup's

  // Main thread only (Run), except receiver_->SetGroup (thread-safe) from the heartbeat thread
  // and Receive from FetchInFlight while the main thread generates.
  WeightReceiver* const receiver_;  // borrowed
  std::unique_ptr<common::Tokenizer> tokenizer_;
  std::unique_ptr<RewardRunner> rewards_;
  std::unique_ptr<Generator> generator_;  // null until the first weights
  // With a config `env`: the environment and the episodes' options (rebuilt at Register).
  std::unique_ptr<Environment> environment_;
  std::optional<EpisodeOptions> episode_options_;
  common::ModelConfig model_config_;
  std::string model_config_json_;                 // as last received, to notice a change
  std::optional<common::WorkerMetrics> metrics_;  // when options_.metrics_registry is set
  bool done_ = false;

  mutable common::Mutex mu_;
  std::string worker_id_ GRPO_GUARDED_BY(mu_);
  std::string assigned_backend_ GRPO_GUARDED_BY(mu_);  // the learner's answer at the last Register
  common::GrpoConfig config_ GRPO_GUARDED_BY(mu_);
  std::shared_ptr<const common::Model> policy_ GRPO_GUARDED_BY(mu_);
  std::chrono::milliseconds heartbeat_interval_ GRPO_GUARDED_BY(mu_) =
      kDefaultWorkerHeartbeatInterval;
  bool heartbeat_stop_ GRPO_GUARDED_BY(mu_) = false;
  common::CondVar heartbeat_cv_;
  std::thread heartbeat_thread_;  // main thread only

  std::atomic<int32_t> rank_{-1};
  std::atomic<int64_t> group_epoch_{0};
  std::atomic<int64_t> policy_version_{-1};   // the version generating now; -1 = none
  std::atomic<int64_t> learner_version_{-1};  // the newest version the learner reported
  // FetchInFlight waits on version_cv_ for a newer learner_version_ or its round's end; a leaf
  // lock (taken under mu_ by NoteLearnerVersion, never the other way round).
  common::Mutex version_mu_;
  common::CondVar version_cv_;
  // Wakes FetchInFlight: learner_version_ or its round's `generating` changed.
  void WakeFetcher() GRPO_EXCLUDES(version_mu_);
  // The learner process registered with, and the one whose weights generate now (groups carry
  // it; a group of another learner's weights is refused).
  std::string learner_incarnation_ GRPO_GUARDED_BY(mu_);
  std::string policy_incarnation_ GRPO_GUARDED_BY(mu_);
  // Registrations applied: a heartbeat answered across one is stale (HeartbeatLoop).
  int64_t registration_seq_ GRPO_GUARDED_BY(mu_) = 0;
  std::atomic<int32_t> leases_held_{0};
  std::atomic<bool> learner_shutdown_{false};  // Heartbeat said shutdown
  std::atomic<bool> needs_register_{false};    // the learner does not know this worker

  struct Counters {
    std::atomic<int64_t> registrations{0}, rounds{0}, leases{0}, groups_pushed{0},
        groups_accepted{0}, groups_rejected{0}, groups_dropped{0}, prompts_failed{0},
        completion_tokens{0}, weight_fetches{0}, rpc_retries{0}, heartbeats{0},
        heartbeat_failures{0}, reward_errors{0}, reward_timeouts{0}, episodes{0}, episode_turns{0},
        env_errors{0};
  };
  Counters counters_;
};

}  // namespace grpo::rollout
