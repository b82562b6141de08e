#include "services/remote_reward.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include "services/auth.h"

namespace grpo::services {

StatusOr<RemoteRewardSpec> ParseRemoteRewardSpec(std::string_view spec) {
  const auto bad = [&](const std::string& what) {
    return Status::InvalidArgument("reward function '" + std::string(spec) + "': " + what +
                                   " (expected remote:NAME@HOST:PORT)");
  };
  if (spec.substr(0, kRemoteRewardPrefix.size()) != kRemoteRewardPrefix) {
    return bad("not a remote reward function");
  }
  const std::string_view rest = spec.substr(kRemoteRewardPrefix.size());
  const size_t at = rest.find('@');
  if (at == std::string_view::npos || at == 0) return bad("missing NAME@");
  RemoteRewardSpec out{std::string(rest.substr(0, at)), std::string(rest.substr(at + 1))};
  const size_t colon = out.address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == out.address.size()) {
    return bad("missing HOST:PORT");
  }
  for (size_t i = colon + 1; i < out.address.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(out.address[i]))) return bad("bad port");
  }
  return out;
}

StatusOr<std::unique_ptr<RemoteRewardFunction>> RemoteRewardFunction::Create(
    std::string_view spec, std::string auth_token, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(RemoteRewardSpec parsed, ParseRemoteRewardSpec(spec));
  if (timeout.count() <= 0) {
    return Status::InvalidArgument("remote reward timeout must be positive");
  }
  return std::unique_ptr<RemoteRewardFunction>(new RemoteRewardFunction(
      std::string(spec), std::move(parsed), std::move(auth_token), timeout));
}

RemoteRewardFunction::RemoteRewardFunction(std::string spec, RemoteRewardSpec parsed,
                                           std::string auth_token,
                                           std::chrono::milliseconds timeout)
    : spec_(std::move(spec)),
      parsed_(std::move(parsed)),
      auth_token_(std::move(auth_token)),
      timeout_(timeout),
      stub_(v1::RewardService::NewStub(MakeChannel(parsed_.address))) {}

std::vector<std::optional<double>> RemoteRewardFunction::Score(
    const std::vector<rollout::RewardInput>& inputs) const {
  v1::ScoreRequest request;
  request.set_reward_fn(parsed_.name);
  for (const auto& in : inputs) {
    v1::RewardSample* s = request.add_samples();
    s->set_prompt(in.prompt);
    s->set_completion(in.completion);
    s->set_completion_tokens(in.completion_tokens);
    if (!in.row.is_null()) s->set_row_json(in.row.dump());
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout_);
  AddAuth(context, auth_token_);
  v1::ScoreResponse response;
  const grpc::Status status = stub_->Score(&context, request, &response);
  if (!status.ok()) {
    // Its own deadline missed: a timeout of this function; any other RPC failure an error.
    const rollout::RewardErrorKind kind = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                                              ? rollout::RewardErrorKind::kTimeout
                                              : rollout::RewardErrorKind::kError;
    throw rollout::RewardError(kind, "Score on " + parsed_.address +
                                         " failed: " + std::to_string(status.error_code()) + " " +
                                         status.error_message());
  }
  if (response.scores_size() != static_cast<int>(inputs.size())) {
    throw rollout::RewardError(rollout::RewardErrorKind::kError,
                               "Score on " + parsed_.address + " returned " +
                                   std::to_string(response.scores_size()) + " scores for " +
                                   std::to_string(inputs.size()) + " samples");
  }
  std::vector<std::optional<double>> out;
  out.reserve(inputs.size());
  for (const auto& v : response.scores()) {
    out.push_back(v.has_value() ? std::optional<double>(v.value()) : std::nullopt);
  }
  return out;
}

StatusOr<std::unique_ptr<rollout::RewardRunner>> MakeRewardRunner(
    const common::GrpoConfig& config, const nlohmann::json& options_by_name,
    const std::string& auth_token, std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<const rollout::RewardFunction>> functions;
  for (const auto& name : config.reward_funcs) {
    if (name.rfind(kRemoteRewardPrefix, 0) == 0) {
      const auto remote_timeout = std::min(kDefaultRemoteRewardTimeout, timeout * 5 / 6);
      ASSIGN_OR_RETURN(auto fn, RemoteRewardFunction::Create(name, auth_token, remote_timeout));
      functions.push_back(std::move(fn));
      continue;
    }
    nlohmann::json options = nlohmann::json::object();
    if (options_by_name.is_object() && options_by_name.contains(name)) {
      options = options_by_name[name];
    }
    ASSIGN_OR_RETURN(auto fn, rollout::MakeRewardFunction(name, options));
    functions.push_back(std::move(fn));
  }
  return rollout::RewardRunner::Create(std::move(functions), config.reward_weights, timeout);
}

}  // namespace grpo::services
