// RolloutWorker: the client side of LearnerService (learner.proto). It registers, takes the
// policy's weights, then repeats: lease prompts -> generate num_generations completions per
// prompt -> score rewards -> push the groups, fetching newer weights between rounds.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
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
#include "common/grpo_metrics.h"
#include "common/metrics.h"
#include "common/model.h"
#include "common/model_config.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "rollout/generator.h"
#include "rollout/reward.h"
#include "rollout/weight_receiver.h"
#include "services/grpc_weight_receiver.h"

namespace grpo::services {

// Per-RPC deadlines (GetWeights: kDefaultGetWeightsTimeout in grpc_weight_receiver.h).
inline constexpr std::chrono::milliseconds kDefaultRegisterTimeout{10000};
inline constexpr std::chrono::milliseconds kDefaultHeartbeatTimeout{5000};
inline constexpr std::chrono::milliseconds kDefaultLeaseTimeout{10000};
// One PushRollouts stream (every group of one round).
inline constexpr std::chrono::milliseconds kDefaultPushTimeout{60000};
// When stopping, the last push gets one attempt with this deadline.
inline constexpr std::chrono::milliseconds kDefaultStopPushTimeout{10000};
// Used when Register's heartbeat_interval_ms is 0.
inline constexpr std::chrono::milliseconds kDefaultWorkerHeartbeatInterval{5000};
// Wait before leasing again when the learner had no prompts and gave no retry_after_ms.
inline constexpr std::chrono::milliseconds kDefaultEmptyLeaseWait{1000};

// Capped exponential backoff with jitter between retries of an RPC.
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

struct RpcTimeouts {
  std::chrono::milliseconds register_call = kDefaultRegisterTimeout;
  std::chrono::milliseconds heartbeat = kDefaultHeartbeatTimeout;
  std::chrono::milliseconds lease = kDefaultLeaseTimeout;
  std::chrono::milliseconds push = kDefaultPushTimeout;
  std::chrono::milliseconds stop_push = kDefaultStopPushTimeout;
  std::chrono::milliseconds get_weights = rollout::kDefaultWeightReceiveTimeout;
};

struct RolloutWorkerOptions {
  std::string learner_address;  // HOST:PORT
  std::string auth_token;       // empty = no auth
  // Sent to remote reward servers (reward_auth_token_file), never auth_token; empty = none.
  std::string reward_auth_token;
  std::string root_certs_pem;   // empty = insecure channel
  std::string worker_id;        // empty = the learner assigns one
  // The worker's own configuration: device, weight_sync_backend, model_name_or_path
  // (tokenizer) ... The generation, precision (bf16) and reward keys of Register's config_json
  // override it (LearnerOwnedConfigKeys); `device` is always this one's.
  common::GrpoConfig config;
  // Prompts per LeasePrompts call; 0 = generation batch / num_generations (at least 1).
  int64_t prompts_per_lease = 0;
  // tokenizer.json or a model directory. Empty: config.model_name_or_path when it holds one
  // here, else the byte tokenizer when the model's vocabulary is its size (tiny models).
  std::string tokenizer_path;
  // Options of built-in reward functions by name, e.g. {"length": {"target_length": 8}}.
  nlohmann::json reward_options = nlohmann::json::object();
  std::chrono::milliseconds reward_timeout = rollout::kDefaultRewardTimeout;
  int64_t weights_chunk_bytes = 0;  // GetWeights chunk size; 0 = the learner's default
  BackoffOptions backoff;
  RpcTimeouts timeouts;
  // Borrowed; may be null. Once true (e.g. from a SIGTERM handler), the worker leases nothing
  // more, pushes what it already generated (one attempt) and Run returns OK.
  const std::atomic<bool>* stop = nullptr;
  int64_t max_rounds = 0;  // lease rounds with prompts before Run returns; 0 = no limit
  // Borrowed; may be null. The worker adds common::WorkerMetrics to it at its first Register
  // (the reward_fn label values are the learner's reward_funcs) and keeps them updated.
  common::Registry* metrics_registry = nullptr;
  // How the worker takes weights; null = by config.weight_sync_backend (MakeWeightReceiver):
  // "grpc" is GetWeights only; gloo, nccl, cuda_ipc and auto join the learner's weight-sync
  // group of the backend the learner assigns at Register (options below), with GetWeights as
  // the fallback.
  std::function<std::unique_ptr<rollout::WeightReceiver>(std::shared_ptr<grpc::Channel>)>
      make_weight_receiver;
  WeightGroupOptions weight_group;
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
};

// The generation, precision (bf16) and reward keys a worker takes from the learner's
// config_json. Not `device`: a worker's GPU is its own.
const std::vector<std::string>& LearnerOwnedConfigKeys();
// `local` with LearnerOwnedConfigKeys() taken from `config_json` (a GrpoConfig as JSON; other and
// unknown keys are ignored; model_name_or_path only when `local`'s is empty).
// InvalidArgument naming the key on a malformed value, or when the result does not Validate.
StatusOr<common::GrpoConfig> MergeLearnerConfig(const common::GrpoConfig& local,
                                                const std::string& config_json);

// A channel to the learner that retries connecting quickly (gRPC's default reconnect backoff
// grows to 120 s): reconnect backoff from `backoff`, message limits as MakeChannel.
std::shared_ptr<grpc::Channel> MakeLearnerChannel(const std::string& address,
                                                  const std::string& root_certs_pem,
                                                  const BackoffOptions& backoff);

// Run is called once, from one thread; it starts and joins a heartbeat thread. The accessors
// may be called from any thread.
//
// Failure handling: an RPC that fails with Unavailable, DeadlineExceeded, ResourceExhausted,
// Aborted, Internal, FailedPrecondition or Cancelled is retried with Backoff until it succeeds or
// the stop flag is set (a push only while some of its leases are still valid). NotFound from
// Heartbeat or LeasePrompts (the learner forgot this worker, e.g. it restarted) means register
// again. Leases of prompts that fail (bad row, too long with truncate_prompt=reject, empty) or
// of groups that cannot be pushed are not released (the proto has no such RPC): they expire
// after lease_seconds and the learner queues them again.
class RolloutWorker {
 public:
  // InvalidArgument for an empty learner_address, and naming the key for a `device` that
  // cannot be used here (common::ResolveDevice). Makes the channel; no RPC yet.
  static StatusOr<std::unique_ptr<RolloutWorker>> Create(RolloutWorkerOptions options);
  ~RolloutWorker();

  // Registers, takes the weights and runs rounds until the learner reports the job done (or
  // shutdown), max_rounds, or the stop flag. OK then; otherwise the non-retryable error
  // (Unauthenticated, InvalidArgument config, a model config without tokenizer, Internal from
  // generation ...).
  Status Run();

  WorkerStats stats() const;
  // The policy the next round generates with (null before the first weights), and its version:
  // on config.device, in bf16 when the learner's `bf16` is true, else fp32.
  std::shared_ptr<const common::Model> policy() const;
  int64_t policy_version() const { return policy_version_.load(); }
  std::string worker_id() const;
  int32_t rank() const { return rank_.load(); }
  // The merged generation config (after Register).
  common::GrpoConfig config() const;

 private:
  RolloutWorker(RolloutWorkerOptions options, at::Device device);

  bool Stopping() const;
  // Sleeps up to `d`; false (early) when stopping.
  bool SleepUnlessStopping(std::chrono::milliseconds d);
  // Runs `attempt` until OK, an error outside the retryable set, Stopping() (Cancelled) or
  // `give_up()` (the last error). `what` names the call in logs.
  Status Retry(std::string_view what, const std::function<Status()>& attempt,
               const std::function<bool()>& give_up = {});

  Status Register();  // with retries; (re)builds config, tokenizer, rewards, generator
  Status RegisterOnce(v1::RegisterResponse* response);
  Status ApplyRegistration(const v1::RegisterResponse& response);
  Status SyncWeights(int64_t min_version);  // with retries; installs a new policy snapshot
  Status InstallPolicy(std::shared_ptr<const common::Model> model, int64_t version);
  // One lease round. Sets done_ when the learner has nothing more.
  Status RunRound();
  Status PushGroups(const std::vector<common::RolloutGroup>& groups, int64_t last_deadline_ms);
  void HeartbeatLoop();
  void StartHeartbeat();
  void StopHeartbeat();
  void NoteLearnerVersion(int64_t version);
  void SetLeasesHeld(int32_t n);
  // One ScoreGroup call's per-function latencies into grpo_rollout_reward_duration_seconds
  // and its failures into grpo_rollout_reward_errors_total.
  void CountRewardFailures(const rollout::RewardCallReport& report);
  int64_t PromptsPerLease() const;

  const RolloutWorkerOptions options_;
  const at::Device device_;  // options_.config.device, resolved: where generation runs
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LearnerService::Stub> stub_;  // thread-safe
  Backoff backoff_;                                 // main thread only

  // Main thread only (Run).
  std::unique_ptr<rollout::WeightReceiver> receiver_;
  std::string assigned_backend_;  // GUARDED_BY(mu_): the learner's answer at the last Register
  std::unique_ptr<common::Tokenizer> tokenizer_;
  std::unique_ptr<rollout::RewardRunner> rewards_;
  std::unique_ptr<rollout::Generator> generator_;  // null until the first weights
  common::ModelConfig model_config_;
  std::string model_config_json_;                 // as last received, to notice a change
  std::optional<common::WorkerMetrics> metrics_;  // when options_.metrics_registry is set
  bool done_ = false;

  mutable std::mutex mu_;
  std::string worker_id_;                                                     // GUARDED_BY(mu_)
  common::GrpoConfig config_;                                                 // GUARDED_BY(mu_)
  std::shared_ptr<const common::Model> policy_;                               // GUARDED_BY(mu_)
  // GUARDED_BY(mu_)
  std::chrono::milliseconds heartbeat_interval_ = kDefaultWorkerHeartbeatInterval;
  bool heartbeat_stop_ = false;                                               // GUARDED_BY(mu_)
  std::condition_variable heartbeat_cv_;
  std::thread heartbeat_thread_;  // main thread only

  std::atomic<int32_t> rank_{-1};
  std::atomic<int64_t> group_epoch_{0};
  std::atomic<int64_t> policy_version_{-1};   // the version generating now; -1 = none
  std::atomic<int64_t> learner_version_{-1};  // the newest version the learner reported
  // The learner process registered with, and the one whose weights generate now (groups carry
  // it; a group of another learner's weights is refused). GUARDED_BY(mu_)
  std::string learner_incarnation_;
  std::string policy_incarnation_;
  std::atomic<int32_t> leases_held_{0};
  std::atomic<bool> learner_shutdown_{false};  // Heartbeat said shutdown
  std::atomic<bool> needs_register_{false};    // the learner does not know this worker

  struct Counters {
    std::atomic<int64_t> registrations{0}, rounds{0}, leases{0}, groups_pushed{0},
        groups_accepted{0}, groups_rejected{0}, groups_dropped{0}, prompts_failed{0},
        completion_tokens{0}, weight_fetches{0}, rpc_retries{0}, heartbeats{0},
        heartbeat_failures{0}, reward_errors{0}, reward_timeouts{0};
  };
  Counters counters_;
};

}  // namespace grpo::services
