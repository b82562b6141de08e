// Reward functions scored by an external RewardService (reward.proto), configured in
// reward_funcs as `remote:NAME@HOST:PORT`, and the worker's RewardRunner that mixes them with the
// in-process built-ins.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "common/config.h"
#include "common/status.h"
#include "grpo/v1/reward.grpc.pb.h"
#include "rollout/reward.h"

namespace grpo::services {

inline constexpr std::string_view kRemoteRewardPrefix = "remote:";
// Deadline of one Score call; below rollout::kDefaultRewardTimeout so that a slow server shows
// as a failed RPC of this function (a timeout) rather than an abandoned call.
inline constexpr std::chrono::milliseconds kDefaultRemoteRewardTimeout{25000};

struct RemoteRewardSpec {
  std::string name;     // the function name sent as ScoreRequest.reward_fn
  std::string address;  // HOST:PORT
};
// Parses `remote:NAME@HOST:PORT`; InvalidArgument naming the spec otherwise.
StatusOr<RemoteRewardSpec> ParseRemoteRewardSpec(std::string_view spec);

// Calls RewardService.Score once per group. Thread-safe (the stub is). Score throws
// rollout::RewardError on an RPC failure (kind kTimeout when the call missed its deadline,
// kError otherwise) or a wrong number of scores (kError); RewardRunner turns that into nulls for
// the group and counts it by kind.
class RemoteRewardFunction final : public rollout::RewardFunction {
 public:
  // Connects lazily (no RPC here). InvalidArgument for a bad spec.
  static StatusOr<std::unique_ptr<RemoteRewardFunction>> Create(
      std::string_view spec, std::string auth_token = "",
      std::chrono::milliseconds timeout = kDefaultRemoteRewardTimeout);

  // The spec as configured (`remote:NAME@HOST:PORT`), so names match reward_funcs.
  std::string name() const override { return spec_; }
  std::vector<std::optional<double>> Score(
      const std::vector<rollout::RewardInput>& inputs) const override;

 private:
  RemoteRewardFunction(std::string spec, RemoteRewardSpec parsed, std::string auth_token,
                       std::chrono::milliseconds timeout);

  const std::string spec_;
  const RemoteRewardSpec parsed_;
  const std::string auth_token_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<v1::RewardService::Stub> stub_;
};

// One function per config.reward_funcs entry: `remote:...` entries become RemoteRewardFunction,
// others built-ins (options from options_by_name[name]); weights from config.reward_weights.
// InvalidArgument naming the bad entry.
StatusOr<std::unique_ptr<rollout::RewardRunner>> MakeRewardRunner(
    const common::GrpoConfig& config,
    const nlohmann::json& options_by_name = nlohmann::json::object(),
    const std::string& auth_token = "",
    std::chrono::milliseconds timeout = rollout::kDefaultRewardTimeout);

}  // namespace grpo::services
