// OpenEnvEnvironment: rollout::Environment over the protocol of OpenEnv's environment servers
// (the `openenv-core` package, 0.3.0: `create_app` / HTTPEnvServer) at http://HOST[:PORT][/BASE].
// Each session is one WebSocket at BASE/ws, and so one environment instance on the server (the
// server's HTTP /reset and /step build a fresh instance per request: no episode survives them, so
// they are not used). The action and observation models are the environment's own; they are read
// once per environment from BASE/schema (HTTP GET) and mapped:
//   action       {action_field: the model's turn text}; action_field: the action model's one
//                string field (its `metadata` aside), unless options.action_field names one.
//   observation  the value of observation_field (a string as is, anything else as JSON) becomes
//                one message of options.role; observation_field: the observation model's one
//                string field (`reward`, `done`, `metadata` aside) unless options names one. The
//                observation's other fields are the metadata (a JSON object); reward and done
//                are OpenEnv's (reward null: none; true/false: 1/0); truncated is always false.
//   reset        {"type": "reset", "data": {the dataset row's fields..., "seed": seed}}: the
//                server passes the keys its environment's reset() accepts (all of them when it
//                takes **kwargs) and drops the others. The reset observation's text, when not
//                empty, is one message as a step's (the episode loop shows it to the model
//                before the first turn, rollout/env/episode.h), and is also
//                metadata["reset_observation"] for reward functions.
// A server allows max_concurrent_envs WebSockets at once (1 unless its environment declares
// SUPPORTS_CONCURRENT_SESSIONS and create_app is given more): it must allow every worker's
// env_max_concurrency together, or the sessions past it fail with ResourceExhausted.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "rollout/env/environment.h"

namespace grpo::services {

// How long a session's destructor waits for the server to end a healthy WebSocket (the
// protocol's "close" message, then the close handshake) before it closes the socket.
inline constexpr std::chrono::milliseconds kDefaultOpenEnvCloseTimeout{2000};
// The largest message (a WebSocket message or the /schema body) read from a server: an
// observation is text for a model, far below this; more is a broken or hostile server.
inline constexpr size_t kMaxOpenEnvMessageBytes = 16u << 20;

struct OpenEnvOptions {
  // The action model's field that gets the model's turn text; "": its one string field.
  std::string action_field;
  // The observation model's field shown to the model; "": its one string field.
  std::string observation_field;
  // The role of the observation's message: "user" or "tool".
  std::string role = "user";
  // Environment::name(); empty: "openenv:" + the url.
  std::string name;
  std::chrono::milliseconds close_timeout = kDefaultOpenEnvCloseTimeout;
};

// Thread-safe: Open may be called from any thread; each session is driven by one thread and does
// its I/O on that thread (no background threads). Open does no I/O and never fails; a session's
// first Reset reads the schema (once per environment, cached when it maps or cannot be mapped;
// unreachable servers are asked again by the next Reset). Sessions share the cached schema and
// may outlive the environment.
//
// How a session's calls fail (rollout::EnvErrorKind):
//   DeadlineExceeded  no answer by the call's deadline (connect, schema, handshake, send or
//                     receive): the socket is closed, which ends the episode on the server (its
//                     step may still be running then).
//   Unavailable       the server cannot be reached or resolved, refused the connection, or the
//                     connection broke or was closed (server killed, shut down).
//   InvalidArgument   the schema cannot be mapped: no string field, several and no option, or the
//                     option names no field; the message lists the fields and the option to set
//                     (env_action_field / env_observation_field). Also returned by every later
//                     Reset of the environment (the schema is cached).
//   ResourceExhausted the server runs max_concurrent_envs sessions already (CAPACITY_REACHED).
//   Internal          the server answered with an error (its message: the environment raised, the
//                     action did not validate, ...), a WebSocket upgrade was refused (not an
//                     OpenEnv server, or none at BASE), or an answer does not parse.
// After any error the session is spent: later calls return FailedPrecondition. Reset must come
// first and once (FailedPrecondition otherwise). The destructor ends the episode (the "close"
// message and the close handshake, at most close_timeout, then closes the socket) and never
// blocks longer than close_timeout plus a bounded drain of the socket's cancelled operations
// (and, for a host name rather than an IP address, a DNS lookup still in flight).
class OpenEnvEnvironment final : public rollout::Environment {
 public:
  struct Endpoint {
    std::string host;  // without IPv6 brackets
    std::string port;
    std::string base;  // path prefix, "" or "/..." without a trailing '/'
  };
  class Shared;  // the endpoint, options and cached schema mapping its sessions share (.cc)

  OpenEnvEnvironment(std::string url, Endpoint endpoint, OpenEnvOptions options);
  ~OpenEnvEnvironment() override;

  std::string name() const override { return name_; }
  StatusOr<std::unique_ptr<rollout::EnvSession>> Open() override;

 private:
  const std::string url_;
  const std::string name_;
  const std::shared_ptr<Shared> shared_;  // thread-safe; shared with sessions
};

// The factory for workers: an OpenEnvEnvironment at `url`, http://HOST[:PORT][/BASE] (port 80 when
// none; IPv6 hosts in brackets). InvalidArgument for another scheme (https and wss: no TLS here,
// put a proxy in front), a url without host, a role other than user|tool or a non-positive
// close_timeout. No network I/O.
StatusOr<std::unique_ptr<rollout::Environment>> MakeOpenEnvEnvironment(std::string url,
                                                                       OpenEnvOptions options = {});

}  // namespace grpo::services
