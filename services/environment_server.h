// EnvironmentServer: serves any rollout::Environment over grpo.v1.EnvironmentService
// (proto/grpo/v1/environment.proto), for `grpo env-server` and for tests.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "grpo/v1/environment.grpc.pb.h"
#include "rollout/env/environment.h"

namespace grpo::services {

// Grace period for running episodes on Shutdown; then their streams are cancelled.
inline constexpr std::chrono::milliseconds kDefaultEnvServerShutdownTimeout{5000};

// One session (Environment::Open) per Episode stream, driven on the stream's own gRPC thread:
// the reset and the steps run there, one at a time, and the session is destroyed when the stream
// ends (the worker closed it, cancelled it or died). A step's deadline is the action's timeout_ms
// (rollout::kDefaultEnvStepTimeout when 0); a step that overruns it still runs to its end on the
// server (the client has cancelled by then). A call that fails (an error Status, an exception, an
// observation that cannot travel) or an action of the wrong kind is answered with `error` set,
// and that answer ends the stream (status OK): the session is not called again, as
// rollout::EnvSession requires. Open failing ends the stream with its status instead.
// Each running episode holds one of the server's threads (grpc_max_threads, default 256); a
// stream beyond them is refused with RESOURCE_EXHAUSTED. Thread-safe.
class EnvironmentServiceImpl final : public v1::EnvironmentService::Service {
 public:
  // `env` is borrowed and must outlive the service; `auth_token` empty = no auth.
  EnvironmentServiceImpl(rollout::Environment* env, std::string auth_token);

  grpc::Status Episode(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::EnvObservation, v1::EnvAction>* stream) override;

 private:
  rollout::Environment* const env_;
  const std::string auth_token_;
};

// Owns a running grpc::Server with EnvironmentService and grpc.health.v1. Thread-safe.
class EnvironmentServer {
 public:
  // address: "HOST:PORT"; port 0 picks a free one (see port()). A non-empty `auth_token` (the
  // environment's own token, never the learner's) is checked before a stream's first message is
  // read (TokenAuthProcessor) and again in the handler. InvalidArgument for a null environment;
  // Unavailable when it cannot bind.
  static StatusOr<std::unique_ptr<EnvironmentServer>> Start(
      const std::string& address, std::unique_ptr<rollout::Environment> env,
      std::string auth_token = "");
  ~EnvironmentServer();  // Shutdown()

  int port() const { return port_; }
  // Stops accepting streams, waits up to `grace` for running episodes, then cancels them and
  // waits for their handlers to return (a step in progress runs to its end). Idempotent.
  void Shutdown(std::chrono::milliseconds grace = kDefaultEnvServerShutdownTimeout);

 private:
  EnvironmentServer() = default;
  // Destroyed in reverse: the server (after Shutdown) before the service and the environment.
  std::unique_ptr<rollout::Environment> env_;
  std::unique_ptr<EnvironmentServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::once_flag shutdown_once_;
};

}  // namespace grpo::services
