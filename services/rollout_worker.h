// RolloutWorker: the rollout worker over gRPC, a shell around rollout::RolloutLoop (the loop
// itself: register, take weights, lease -> generate -> score -> push, heartbeats, retries). It
// makes the channel to the learner, the weight receiver, a GrpcLearnerLink and the reward
// functions (remote ones too, services/remote_reward.h), and runs the loop with them.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/metrics/metrics.h"
#include "common/model/model.h"
#include "common/status.h"
#include "rollout/reward.h"
#include "rollout/rollout_loop.h"
#include "rollout/weight_receiver.h"
#include "services/grpc_learner_link.h"
#include "services/grpc_weight_receiver.h"

namespace grpo::services {

// The loop's types and helpers, under the names the worker's callers use.
using BackoffOptions = rollout::BackoffOptions;
using Backoff = rollout::Backoff;
using RpcTimeouts = rollout::LinkTimeouts;
using WorkerStats = rollout::WorkerStats;
using rollout::LearnerOwnedConfigKeys;
using rollout::MergeLearnerConfig;

struct RolloutWorkerOptions {
  std::string learner_address;  // HOST:PORT
  std::string auth_token;       // empty = no auth
  // Sent to remote reward servers (reward_auth_token_file), never auth_token; empty = none.
  std::string reward_auth_token;
  std::string root_certs_pem;  // empty = insecure channel
  std::string worker_id;       // empty = the learner assigns one
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

// A channel to the learner that retries connecting quickly (gRPC's default reconnect backoff
// grows to 120 s): reconnect backoff from `backoff`, message limits as MakeChannel.
std::shared_ptr<grpc::Channel> MakeLearnerChannel(const std::string& address,
                                                  const std::string& root_certs_pem,
                                                  const BackoffOptions& backoff);

// Run is called once, from one thread. The accessors may be called from any thread. Failure
// handling and weight updates: rollout::RolloutLoop's contract.
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

  WorkerStats stats() const { return loop_->stats(); }
  // The policy the next round generates with (null before the first weights), and its version:
  // on config.device, in bf16 when the learner's `bf16` is true, else fp32.
  std::shared_ptr<const common::Model> policy() const { return loop_->policy(); }
  int64_t policy_version() const { return loop_->policy_version(); }
  std::string worker_id() const { return loop_->worker_id(); }
  int32_t rank() const { return loop_->rank(); }
  // The merged generation config (after Register).
  common::GrpoConfig config() const { return loop_->config(); }

 private:
  explicit RolloutWorker(RolloutWorkerOptions options);

  const RolloutWorkerOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rollout::WeightReceiver> receiver_;
  std::unique_ptr<GrpcLearnerLink> link_;
  // Declared last: destroyed first, before the link and receiver it borrows.
  std::unique_ptr<rollout::RolloutLoop> loop_;
};

}  // namespace grpo::services
