#include "services/rollout_worker.h"

#include <algorithm>

#include "common/logging.h"
#include "common/model/device.h"
#include "services/auth.h"
#include "services/convert.h"
#include "services/grpc_environment.h"
#include "services/grpc_weight_receiver.h"
#include "services/openenv_environment.h"
#include "services/remote_reward.h"

namespace grpo::services {

std::shared_ptr<grpc::Channel> MakeLearnerChannel(const std::string& address,
                                                  const std::string& root_certs_pem,
                                                  const BackoffOptions& backoff) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  const int initial = static_cast<int>(std::max<int64_t>(1, backoff.initial.count()));
  const int max = static_cast<int>(std::max<int64_t>(initial, backoff.max.count()));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, initial);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, initial);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max);
  return grpc::CreateCustomChannel(address, ChannelCredentials(root_certs_pem), args);
}

// --- RolloutWorker

StatusOr<std::unique_ptr<RolloutWorker>> RolloutWorker::Create(RolloutWorkerOptions options) {
  if (options.learner_address.empty()) {
    return Status::InvalidArgument("rollout worker needs learner_address");
  }
  std::unique_ptr<RolloutWorker> worker(new RolloutWorker(std::move(options)));
  const RolloutWorkerOptions& o = worker->options_;
  rollout::RolloutLoopOptions lo;
  lo.worker_id = o.worker_id;
  lo.config = o.config;
  lo.prompts_per_lease = o.prompts_per_lease;
  lo.tokenizer_path = o.tokenizer_path;
  // Built-ins and `remote:NAME@HOST:PORT` functions (RewardService over gRPC).
  lo.make_rewards = [reward_options = o.reward_options, token = o.reward_auth_token,
                     timeout = o.reward_timeout](const common::GrpoConfig& config) {
    return MakeRewardRunner(config, reward_options, token, timeout);
  };
  // Built-in environments, `grpc:HOST:PORT` (EnvironmentService), with the worker's own
  // env_auth_token_file, and `openenv:http://HOST:PORT` (an OpenEnv server).
  lo.make_environment = [](const common::GrpoConfig& config) {
    if (config.env.rfind("grpc:", 0) == 0) {
      GrpcEnvironmentOptions eo;
      eo.auth_token_file = config.env_auth_token_file;
      return MakeGrpcEnvironment(config.env.substr(5), eo);
    }
    if (config.env.rfind("openenv:", 0) == 0) {
      OpenEnvOptions oo;
      oo.action_field = config.env_action_field;
      oo.observation_field = config.env_observation_field;
      return MakeOpenEnvEnvironment(config.env.substr(8), oo);
    }
    return rollout::MakeEnvironment(config);
  };
  lo.reward_options = o.reward_options;
  lo.reward_timeout = o.reward_timeout;
  lo.backoff = o.backoff;
  lo.timeouts = o.timeouts;
  lo.stop = o.stop;
  lo.max_rounds = o.max_rounds;
  lo.metrics_registry = o.metrics_registry;
  ASSIGN_OR_RETURN(worker->loop_, rollout::RolloutLoop::Create(std::move(lo), worker->link_.get(),
                                                               worker->receiver_.get()));
  return worker;
}

RolloutWorker::RolloutWorker(RolloutWorkerOptions options)
    : options_(std::move(options)),
      channel_(
          MakeLearnerChannel(options_.learner_address, options_.root_certs_pem, options_.backoff)),
      link_(std::make_unique<GrpcLearnerLink>(channel_, options_.auth_token, options_.stop)) {
  if (options_.make_weight_receiver) {
    receiver_ = options_.make_weight_receiver(channel_);
  }
  if (receiver_ == nullptr) {
    // Where the group receiver receives (GPU backends); a bad `device` fails the loop's Create.
    const StatusOr<at::Device> device = common::ResolveDevice(options_.config.device);
    auto made = MakeWeightReceiver(
        channel_, options_.auth_token, options_.config.weight_sync_backend,
        options_.weights_chunk_bytes, options_.weight_group, device.ok() ? *device : at::kCPU);
    if (made.ok()) {
      receiver_ = std::move(made).value();
    } else {
      GRPO_LOG_WARN("{}; using grpc", made.status().ToString());
      receiver_ = std::make_unique<GrpcWeightReceiver>(channel_, options_.auth_token,
                                                       options_.weights_chunk_bytes);
    }
  }
}

RolloutWorker::~RolloutWorker() = default;

Status RolloutWorker::Run() { return loop_->Run(); }

}  // namespace grpo::services
