#include "services/environment_server.h"

#include <exception>

#include "common/config.h"
#include "common/logging.h"
#include "services/auth.h"
#include "services/convert.h"
#include "services/environment_convert.h"

namespace grpo::services {
namespace {

using Clock = std::chrono::steady_clock;

// Runs a session call; an exception becomes Internal (handlers never throw).
template <typename Fn>
auto Guarded(const char* what, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return Status::Internal(std::string(what) + " threw: " + e.what());
  } catch (...) {
    return Status::Internal(std::string(what) + " threw");
  }
}

}  // namespace

EnvironmentServiceImpl::EnvironmentServiceImpl(rollout::Environment* env, std::string auth_token)
    : env_(env), auth_token_(std::move(auth_token)) {}

grpc::Status EnvironmentServiceImpl::Episode(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::EnvObservation, v1::EnvAction>* stream) {
  if (grpc::Status auth = CheckAuth(*context, auth_token_); !auth.ok()) return auth;
  StatusOr<std::unique_ptr<rollout::EnvSession>> session = Guarded(
      "Open", [&]() -> StatusOr<std::unique_ptr<rollout::EnvSession>> { return env_->Open(); });
  if (!session.ok()) return ToGrpcStatus(session.status());
  bool reset_done = false;
  bool declared_tools = false;  // the reset's answer declared tools: steps carry tool calls
  v1::EnvAction action;
  v1::EnvObservation answer;
  while (stream->Read(&action)) {
    const auto timeout = action.timeout_ms() > 0 ? std::chrono::milliseconds(action.timeout_ms())
                                                 : rollout::kDefaultEnvStepTimeout;
    const auto deadline = Clock::now() + timeout;
    StatusOr<rollout::EnvObservation> obs =
        Status::InvalidArgument("an action with neither reset nor step");
    if (action.has_reset()) {
      if (reset_done) {
        obs = Status::FailedPrecondition("a second reset on one episode's stream");
      } else {
        reset_done = true;
        nlohmann::json row = nlohmann::json::object();
        if (!action.reset().row_json().empty()) {
          row = nlohmann::json::parse(action.reset().row_json(), nullptr,
                                      /*allow_exceptions=*/false);
        }
        if (!row.is_object()) {
          obs = Status::InvalidArgument("reset row_json is not a JSON object");
        } else {
          obs = Guarded("Reset",
                        [&] { return (*session)->Reset(row, action.reset().seed(), deadline); });
        }
      }
    } else if (action.has_step()) {
      if (!reset_done) {
        obs = Status::FailedPrecondition("a step before the reset");
      } else if (!declared_tools) {
        obs = Guarded("Step", [&] { return (*session)->Step(action.step().text(), deadline); });
      } else if (auto calls = ToolCallsFromProto(action.step()); !calls.ok()) {
        obs = calls.status();
      } else {
        obs = Guarded("Step", [&] {
          return (*session)->StepToolCalls(action.step().text(), *calls, deadline);
        });
      }
    }
    if (action.has_reset() && obs.ok()) declared_tools = !obs->tools.empty();
    Status wire = obs.ok() ? ToProto(*obs, &answer) : obs.status();
    if (!wire.ok()) {
      GRPO_LOG_DEBUG("environment {}: {}", env_->name(), common::EscapeForLog(wire.ToString()));
      answer.Clear();
      answer.set_error(wire.ToString());
      stream->Write(answer);
      return grpc::Status::OK;  // an error answer ends the episode
    }
    if (!stream->Write(answer)) break;  // the worker went away
  }
  return grpc::Status::OK;
}

StatusOr<std::unique_ptr<EnvironmentServer>> EnvironmentServer::Start(
    const std::string& address, std::unique_ptr<rollout::Environment> env, std::string auth_token) {
  if (env == nullptr) return Status::InvalidArgument("environment server needs an environment");
  // Defaults of the gRPC limits (grpc_memory_quota_mb, grpc_max_threads); plaintext.
  const common::GrpoConfig defaults;
  ASSIGN_OR_RETURN(auto credentials, ServerCredentials(defaults, auth_token));
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<EnvironmentServer> server(new EnvironmentServer());
  server->env_ = std::move(env);
  server->service_ =
      std::make_unique<EnvironmentServiceImpl>(server->env_.get(), std::move(auth_token));
  grpc::ServerBuilder builder;
  ApplyServerLimits(builder, defaults, "grpo-env-server");
  builder.AddListeningPort(address, credentials, &server->port_);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return Status::Unavailable("environment server cannot listen on " + address);
  }
  return server;
}

EnvironmentServer::~EnvironmentServer() { Shutdown(); }

void EnvironmentServer::Shutdown(std::chrono::milliseconds grace) {
  std::call_once(shutdown_once_, [&] {
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + grace);
      server_->Wait();
    }
  });
}

}  // namespace grpo::services
