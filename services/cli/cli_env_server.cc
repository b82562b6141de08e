// grpo env-server: a built-in environment (rollout/env/builtin_environments.h) served over
// EnvironmentService (environment.proto) for workers' multi-turn episodes.
#include <atomic>
#include <chrono>
#include <csignal>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "common/logging.h"
#include "rollout/env/builtin_environments.h"
#include "services/auth.h"
#include "services/cli/cli.h"
#include "services/environment_server.h"

namespace grpo::services {
namespace {

// Set by SIGTERM / SIGINT (lock-free atomic store: async-signal-safe).
std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void HandleEnvServerStopSignal(int) { g_stop.store(true); }

struct EnvServerCliOptions {
  std::string task;
  int64_t port = 50071;
  std::string host = "0.0.0.0";
  std::string auth_token_file;
};

int RunEnvServer(const EnvServerCliOptions& o) {
  auto fail = [](const Status& s, int code) {
    std::cerr << "grpo env-server: " << s.ToString() << "\n";
    return code;
  };
  if (o.port < 0 || o.port > 65535) {
    return fail(Status::InvalidArgument("--port must be a port (0 = any free one)"), 2);
  }
  auto token = ReadAuthToken(o.auth_token_file, "--auth_token_file");
  if (!token.ok()) return fail(token.status(), 2);
  auto env = rollout::MakeBuiltinEnvironment(o.task);
  if (!env.ok()) return fail(env.status(), 2);
  if (token->empty() && !IsLoopbackAddress(o.host)) {
    GRPO_LOG_WARN(
        "environment server: WARNING: auth is off (no --auth_token_file) and it listens on {}: "
        "anyone who reaches it can run episodes",
        o.host);
  }
  struct sigaction sa = {};
  sa.sa_handler = HandleEnvServerStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  auto server = EnvironmentServer::Start(o.host + ":" + std::to_string(o.port),
                                         std::move(env).value(), *token);
  if (!server.ok()) return fail(server.status(), 1);
  // One line on stdout with the bound port (port 0 picks one), for scripts and tests.
  std::cout << nlohmann::json{{"env_server", true}, {"port", (*server)->port()}}.dump()
            << std::endl;
  GRPO_LOG_INFO("environment server ({}) on port {}", o.task, (*server)->port());
  while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  (*server)->Shutdown();
  return 0;
}

}  // namespace

void AddEnvServerCommand(CLI::App& app, CliAction* action) {
  auto* cmd = app.add_subcommand(
      "env-server", "Serve a built-in environment over EnvironmentService for multi-turn episodes");
  auto o = std::make_shared<EnvServerCliOptions>();
  std::string known;
  for (const auto& n : rollout::BuiltinEnvironmentNames()) known += (known.empty() ? "" : ", ") + n;
  cmd->add_option("--task", o->task, "the environment (built-in: " + known + ")")->required();
  cmd->add_option("--port", o->port, "gRPC port (0 = any free port)")->capture_default_str();
  cmd->add_option("--host", o->host, "address to bind")->capture_default_str();
  cmd->add_option("--auth_token_file,--env_auth_token_file", o->auth_token_file,
                  "the environment servers' own token file, as workers' env_auth_token_file "
                  "(never the learner's auth_token_file; default: no auth)");
  cmd->callback([o, action] { *action = [o] { return RunEnvServer(*o); }; });
}

}  // namespace grpo::services
