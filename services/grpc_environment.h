// GrpcEnvironment: rollout::Environment over grpo.v1.EnvironmentService
// (proto/grpo/v1/environment.proto) at HOST:PORT, served by `grpo env-server`, by
// grpo_serve.serve_environment in Python, or by any other server of the protocol. Each session is
// one Episode stream: Reset and Step write one action and wait for its one answer until the
// call's deadline.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "grpo/v1/environment.grpc.pb.h"
#include "rollout/env/environment.h"

namespace grpo::services {

// How long a session's destructor waits for the server to end a healthy stream (WritesDone, then
// the server's status) before it cancels the stream; also the bound on reading the status of a
// stream that broke. A server frees the episode either way.
inline constexpr std::chrono::milliseconds kDefaultEnvCloseTimeout{2000};
// How long gRPC gets to hand back a cancelled stream's pending operations (it does so at once;
// the bound keeps a destructor from hanging on a gRPC bug: the call is then abandoned, leaked).
inline constexpr std::chrono::milliseconds kDefaultEnvCancelTimeout{2000};

struct GrpcEnvironmentOptions {
  // The environment servers' own token file (sent as `authorization: Bearer`, read with
  // ReadAuthToken); never the learner's auth_token_file. Empty: no token.
  std::string auth_token_file;
  // Environment::name(); empty: "grpc:HOST:PORT".
  std::string name;
  std::chrono::milliseconds close_timeout = kDefaultEnvCloseTimeout;
};

// Thread-safe: Open may be called from any thread; each session is driven by one thread. Sessions
// share the environment's channel and keep it alive: they may outlive the environment.
//
// How a session's calls fail (rollout::EnvErrorKind):
//   DeadlineExceeded  no answer by the deadline: the stream is cancelled (the server's Episode
//                     ends and frees the episode; its step may still be running then).
//   Unavailable       the server cannot be reached, or the stream broke (server killed, shut
//                     down, connection lost).
//   Internal          the server answered with `error` (the message is the server's), ended the
//                     stream without an answer, or answered an observation that does not parse.
//   other codes       the server refused the stream (Unauthenticated for a wrong or missing
//                     token, Unimplemented when it serves no EnvironmentService, ...).
// After any error the session is spent: later calls return FailedPrecondition. Reset must come
// first and once (FailedPrecondition otherwise). The destructor ends the stream (WritesDone and
// the server's status, at most close_timeout, then a cancel) and never blocks longer than
// close_timeout + kDefaultEnvCancelTimeout.
class GrpcEnvironment final : public rollout::Environment {
 public:
  // `address`: HOST:PORT. Connects lazily: Open neither blocks nor fails for an unreachable
  // server; the session's Reset returns Unavailable then.
  GrpcEnvironment(std::string address, std::string auth_token, GrpcEnvironmentOptions options);

  std::string name() const override { return name_; }
  StatusOr<std::unique_ptr<rollout::EnvSession>> Open() override;

 private:
  const std::string address_;
  const std::string auth_token_;
  const std::string name_;
  const std::chrono::milliseconds close_timeout_;
  const std::shared_ptr<v1::EnvironmentService::Stub> stub_;  // thread-safe; shared with sessions
};

// The factory for workers: a GrpcEnvironment at `address` (HOST:PORT) with the token of
// options.auth_token_file. InvalidArgument for an address without HOST:PORT or a non-positive
// close_timeout; the errors of ReadAuthToken (NotFound, InvalidArgument) for the token file. No
// network I/O.
StatusOr<std::unique_ptr<rollout::Environment>> MakeGrpcEnvironment(
    std::string address, GrpcEnvironmentOptions options = {});

}  // namespace grpo::services
