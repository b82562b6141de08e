// grpo rollout: a rollout worker against a learner (services/rollout_worker.h).
// grpo reward-server: built-in reward functions served over RewardService (reward.proto).
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/logging.h"
#include "common/metrics/http_exposer.h"
#include "common/metrics/metrics.h"
#include "common/metrics/process_metrics.h"
#include "rollout/reward.h"
#include "services/auth.h"
#include "services/cli/cli.h"
#include "services/reward_server.h"
#include "services/rollout_worker.h"

namespace grpo::services {
namespace {

// Set by SIGTERM / SIGINT (lock-free atomic store: async-signal-safe).
std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void HandleStopSignal(int) { g_stop.store(true); }

void InstallStopHandlers() {
  struct sigaction sa = {};
  sa.sa_handler = HandleStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

struct RolloutCliOptions {
  std::string learner_address;
  std::string learner_address_file;
  double learner_wait_seconds = 120;
  int64_t metrics_port = 9401;
  std::string worker_id;
  int64_t prompts_per_lease = 0;
  std::string tokenizer;
  std::string reward_options = "{}";
  int64_t max_rounds = 0;
  std::vector<std::string> overrides;
};

// The address `file` holds once it exists (a line HOST:PORT; the writer renames it into place),
// waiting up to `wait_seconds`; nullopt when stopped first (SIGTERM).
StatusOr<std::optional<std::string>> WaitForAddressFile(const std::string& file,
                                                        double wait_seconds) {
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(wait_seconds * 1000));
  GRPO_LOG_INFO("rollout: waiting for the learner's address in {}", file);
  while (!g_stop.load()) {
    std::ifstream in(file);
    std::string address;
    if (in && std::getline(in, address) && !address.empty()) return std::optional(address);
    if (std::chrono::steady_clock::now() >= end) {
      return Status::DeadlineExceeded("no learner address in --learner_address_file '" + file +
                                      "' after " + std::to_string(wait_seconds) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::optional<std::string>();
}

int RunRollout(const RolloutCliOptions& o) {
  auto fail = [](const Status& s, int code) {
    std::cerr << "grpo rollout: " << s.ToString() << "\n";
    return code;
  };
  if (o.learner_address.empty() == o.learner_address_file.empty()) {
    return fail(Status::InvalidArgument(
                    "give the learner's address: --learner_address or --learner_address_file"),
                2);
  }
  std::string learner_address = o.learner_address;
  if (!o.learner_address_file.empty()) {
    // Started beside the learner (grpo demo): libtorch loads here while the learner starts.
    InstallStopHandlers();
    auto address = WaitForAddressFile(o.learner_address_file, o.learner_wait_seconds);
    if (!address.ok()) return fail(address.status(), 1);
    if (!*address) return 0;  // stopped before the learner served
    learner_address = **address;
  }
  common::GrpoConfig cfg;
  // GetWeights unless the config or --weight_sync_backend asks for a group (gloo, nccl,
  // cuda_ipc, auto): a one-off worker needs no rendezvous.
  cfg.weight_sync_backend = "grpc";
  if (Status s = common::ApplyConfigOverrides(cfg, o.overrides); !s.ok()) return fail(s, 2);
  cfg.learner_address = learner_address;
  if (Status s = cfg.Validate(); !s.ok()) return fail(s, 2);
  if (o.metrics_port < 0 || o.metrics_port > 65535) {
    return fail(Status::InvalidArgument("--metrics_port must be a port (0 = off)"), 2);
  }
  auto token = ReadAuthToken(cfg.auth_token_file);
  if (!token.ok()) return fail(token.status(), 2);
  auto reward_token = ReadAuthToken(cfg.reward_auth_token_file, "reward_auth_token_file");
  if (!reward_token.ok()) return fail(reward_token.status(), 2);
  auto root_certs = ReadPemFile(cfg.tls_ca_file, "tls_ca_file");
  if (!root_certs.ok()) return fail(root_certs.status(), 2);
  const nlohmann::json reward_options =
      nlohmann::json::parse(o.reward_options, nullptr, /*allow_exceptions=*/false);
  if (reward_options.is_discarded() || !reward_options.is_object()) {
    return fail(Status::InvalidArgument("--reward_options must be a JSON object"), 2);
  }

  // Declared before the worker: both outlive it.
  common::Registry registry;
  std::unique_ptr<common::HttpExposer> exposer;
  if (o.metrics_port > 0) {
    if (Status s = common::AddProcessMetrics(&registry); !s.ok()) return fail(s, 1);
    exposer = std::make_unique<common::HttpExposer>(registry, nullptr,
                                                    common::HttpExposerLimitsFrom(cfg));
    if (Status s = exposer->Start(cfg.metrics_bind_address, static_cast<uint16_t>(o.metrics_port));
        !s.ok()) {
      return fail(s.WithContext("metrics_port"), 1);
    }
  }

  RolloutWorkerOptions wo;
  wo.metrics_registry = &registry;
  wo.learner_address = cfg.learner_address;
  wo.auth_token = *token;
  wo.reward_auth_token = *reward_token;
  wo.weight_group.hostname = cfg.weight_sync_hostname;
  // The deadline of this worker's rendezvous and receives: the default (60 s) made a worker
  // whose learner vanished inside a rendezvous take a minute to exit (chaos_test, gdb: the
  // receiver's thread in gloo's Pair::waitUntilConnected while the destructor joined it).
  wo.weight_group.timeout = std::chrono::milliseconds(
      static_cast<int64_t>(std::ceil(cfg.weight_sync_timeout_seconds * 1000.0)));
  wo.root_certs_pem = *root_certs;
  wo.worker_id = o.worker_id;
  wo.config = cfg;
  wo.prompts_per_lease = o.prompts_per_lease;
  wo.tokenizer_path = o.tokenizer;
  wo.reward_options = reward_options;
  wo.max_rounds = o.max_rounds;
  wo.stop = &g_stop;
  auto worker = RolloutWorker::Create(std::move(wo));
  if (!worker.ok()) return fail(worker.status(), 2);

  InstallStopHandlers();
  GRPO_LOG_INFO("rollout: {} intra-op threads", at::get_num_threads());
  const Status s = (*worker)->Run();
  if (!s.ok()) {
    // Not retried (rollout/retry_policy.h): the learner, or a proxy before it, refused the token.
    const bool refused =
        s.code() == StatusCode::kUnauthenticated || s.code() == StatusCode::kPermissionDenied;
    if (refused) {
      return fail(s.WithContext("the learner at " + cfg.learner_address +
                                " refused this worker's credentials (auth_token_file '" +
                                cfg.auth_token_file + "'); not retried"),
                  2);
    }
    const bool bad_input =
        s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kFailedPrecondition;
    return fail(s, bad_input ? 2 : 1);
  }
  return 0;
}

struct RewardServerCliOptions {
  std::vector<std::string> reward_funcs;
  int64_t port = 50061;
  std::string host = "0.0.0.0";
  std::string reward_options = "{}";
  std::string reward_auth_token_file;
};

int RunRewardServer(const RewardServerCliOptions& o) {
  auto fail = [](const Status& s, int code) {
    std::cerr << "grpo reward-server: " << s.ToString() << "\n";
    return code;
  };
  const nlohmann::json options =
      nlohmann::json::parse(o.reward_options, nullptr, /*allow_exceptions=*/false);
  if (options.is_discarded() || !options.is_object()) {
    return fail(Status::InvalidArgument("--reward_options must be a JSON object"), 2);
  }
  auto token = ReadAuthToken(o.reward_auth_token_file, "--reward_auth_token_file");
  if (!token.ok()) return fail(token.status(), 2);
  if (token->empty() && !IsLoopbackAddress(o.host)) {
    GRPO_LOG_WARN(
        "reward server: WARNING: auth is off (no --reward_auth_token_file) and it listens on {}: "
        "anyone who reaches it can call Score",
        o.host);
  }
  std::map<std::string, std::shared_ptr<const rollout::RewardFunction>> functions;
  for (const auto& name : o.reward_funcs) {
    auto fn = rollout::MakeRewardFunction(
        name, options.contains(name) ? options[name] : nlohmann::json::object());
    if (!fn.ok()) return fail(fn.status(), 2);
    functions[name] = std::move(fn).value();
  }
  InstallStopHandlers();
  auto server =
      RewardServer::Start(o.host + ":" + std::to_string(o.port), std::move(functions), *token);
  if (!server.ok()) return fail(server.status(), 1);
  // One line on stdout with the bound port (port 0 picks one), for scripts and tests.
  std::cout << nlohmann::json{{"reward_server", true}, {"port", (*server)->port()}}.dump()
            << std::endl;
  GRPO_LOG_INFO("reward server on port {}", (*server)->port());
  while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  (*server)->Shutdown();
  return 0;
}

}  // namespace

void AddRolloutCommands(CLI::App& app, CliAction* action) {
  auto* cmd = app.add_subcommand(
      "rollout",
      "Rollout worker: lease prompts from a learner, generate and score groups, push them; "
      "config keys as --key value (the learner's generation keys win)");
  auto o = std::make_shared<RolloutCliOptions>();
  cmd->add_option("--learner_address", o->learner_address, "the learner's HOST:PORT");
  cmd->add_option("--learner_address_file", o->learner_address_file,
                  "instead of --learner_address: a file that will hold the learner's HOST:PORT "
                  "(the worker waits for it; grpo demo starts its workers beside the learner)");
  cmd->add_option("--learner_wait_seconds", o->learner_wait_seconds,
                  "how long to wait for --learner_address_file")
      ->capture_default_str();
  cmd->add_option("--metrics_port", o->metrics_port, "Prometheus /metrics port (0 = off)")
      ->capture_default_str();
  cmd->add_option("--worker_id", o->worker_id, "worker id (default: assigned by the learner)");
  cmd->add_option("--prompts_per_lease", o->prompts_per_lease,
                  "prompts per LeasePrompts call (default: generation batch / num_generations)");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "tokenizer.json or model directory (default: model_name_or_path, or the byte "
                  "tokenizer for tiny models)");
  cmd->add_option("--reward_options", o->reward_options,
                  "built-in reward options as JSON, e.g. {\"length\": {\"target_length\": 8}}");
  cmd->add_option("--max_rounds", o->max_rounds, "stop after N lease rounds (0 = until done)");
  cmd->allow_extras();
  cmd->callback([cmd, o, action] {
    o->overrides = cmd->remaining();
    *action = [o] { return RunRollout(*o); };
  });

  auto* rs = app.add_subcommand("reward-server",
                                "Serve built-in reward functions over RewardService (workers "
                                "use them as reward_funcs remote:NAME@HOST:PORT)");
  auto r = std::make_shared<RewardServerCliOptions>();
  rs->add_option("--reward_funcs", r->reward_funcs, "built-in function names (comma-separated)")
      ->required()
      ->delimiter(',');
  rs->add_option("--port", r->port, "gRPC port (0 = any free port)")->capture_default_str();
  rs->add_option("--host", r->host, "address to bind")->capture_default_str();
  rs->add_option("--reward_options", r->reward_options, "options by function name, as JSON");
  rs->add_option("--reward_auth_token_file,--auth_token_file", r->reward_auth_token_file,
                 "the reward servers' own token file, as workers' reward_auth_token_file "
                 "(never the learner's auth_token_file; default: no auth)");
  rs->callback([r, action] { *action = [r] { return RunRewardServer(*r); }; });
}

}  // namespace grpo::services
