// Client commands against a learner: `grpo submit`, `grpo status`, `grpo watch`, `grpo cancel`.
// Every call carries the shared token (--auth_token_file) and a deadline.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "common/config.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "services/auth.h"
#include "services/cli/cli.h"
#include "services/cli/progress.h"
#include "services/convert.h"
#include "services/learner_client.h"

namespace grpo::services {
namespace {

struct ClientOptions {
  std::string config_file;  // learner_address and auth_token_file from here unless given
  std::string learner_address;
  std::string auth_token_file;
  std::string tls_ca_file;
  double timeout_seconds = kDefaultCallTimeoutSeconds;
  double watch_timeout_seconds = kDefaultWatchTimeoutSeconds;
  bool json = false;
  // submit
  std::string dataset;
  std::string idempotency_key;
  std::string name;
  bool follow = false;
  // cancel
  std::string reason;
  // watch --report_to: handed to the Python package (python/grpo_serve, `grpo-serve watch`)
  std::string report_to, project, run_name, logging_dir;
};

void AddCommonOptions(CLI::App* cmd, ClientOptions* o) {
  cmd->add_option("--learner_address", o->learner_address,
                  "HOST:PORT of the learner (default: the config's learner_address)");
  cmd->add_option("--auth_token_file", o->auth_token_file, "file holding the shared token");
  cmd->add_option("--tls_ca_file", o->tls_ca_file,
                  "PEM CA certificate: connect with TLS and verify the learner against it");
  cmd->add_option("--config", o->config_file,
                  "YAML config to take learner_address, auth_token_file and tls_ca_file from");
  cmd->add_option("--timeout_seconds", o->timeout_seconds, "deadline of each call");
}

using Client = LearnerClient;

// Where the learner is and how to reach it: each flag, else the --config file's key.
struct LearnerEndpoint {
  std::string address, token_file, ca_file;
};

StatusOr<LearnerEndpoint> ResolveEndpoint(const ClientOptions& o) {
  common::GrpoConfig cfg;
  if (!o.config_file.empty()) {
    ASSIGN_OR_RETURN(cfg, common::LoadConfigFile(o.config_file));
  }
  if (!(o.timeout_seconds > 0)) return Status::InvalidArgument("--timeout_seconds must be > 0");
  const auto pick = [](const std::string& flag, const std::string& key) {
    return flag.empty() ? key : flag;
  };
  return LearnerEndpoint{pick(o.learner_address, cfg.learner_address),
                         pick(o.auth_token_file, cfg.auth_token_file),
                         pick(o.tls_ca_file, cfg.tls_ca_file)};
}

StatusOr<Client> Connect(const ClientOptions& o) {
  ASSIGN_OR_RETURN(const LearnerEndpoint e, ResolveEndpoint(o));
  return ConnectLearner(e.address, e.token_file, e.ca_file);
}

int Fail(const char* cmd, const Status& s) {
  std::cerr << "grpo " << cmd << ": " << s.ToString() << "\n";
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? 2 : 1;
}

std::string ProtoJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, opts);
  return out;
}

void PrintJob(const v1::Job& job, bool json) {
  if (json) {
    std::cout << ProtoJson(job) << "\n";
    return;
  }
  const auto& p = job.prompts();
  std::cout << "state    " << JobStateName(job.state())
            << (job.message().empty() ? "" : " (" + job.message() + ")") << "\n"
            << "step     " << job.global_step() << " / " << job.max_steps() << "\n"
            << "policy   version " << job.policy_version() << ", " << job.workers() << " workers\n"
            << "prompts  queued " << p.queued() << ", leased " << p.leased() << ", trained "
            << p.trained() << ", rejected " << p.rejected()
            << (p.filtered() > 0 ? ", filtered " + std::to_string(p.filtered()) : std::string())
            << " (pass " << p.pass() << ")\n";
  if (!job.last_metrics().empty()) {
    std::cout << "last     ";
    for (const char* k : {"loss", "reward", "reward_std", "kl", "grad_norm",
                          "completions/mean_length", "tokens_per_second"}) {
      auto it = job.last_metrics().find(k);
      if (it != job.last_metrics().end()) std::cout << k << " " << it->second << "  ";
    }
    std::cout << "\n";
  }
}

JobProgress ProgressOf(const v1::JobEvent& e) {
  const v1::Job& job = e.job();
  JobProgress p;
  p.step = job.global_step();
  p.max_steps = job.max_steps();
  p.trained = job.prompts().trained() + job.prompts().filtered();
  p.total = job.prompts().queued() + job.prompts().leased() + job.prompts().trained() +
            job.prompts().rejected() + job.prompts().filtered();
  p.pass = job.prompts().pass();
  if (auto it = e.metrics().find("reward"); it != e.metrics().end()) {
    p.reward = it->second;
  } else if (auto jt = job.last_metrics().find("reward"); jt != job.last_metrics().end()) {
    p.reward = jt->second;
  }
  return p;
}

// Follows the job until it ends: one line (or JSON object) per step on stdout, state changes on
// stderr. Without --json, a progress bar (prompts, step, reward, ETA) on stderr: redrawn in place
// on a terminal, one line per step otherwise. 1 when the job failed.
int Watch(const Client& c, const ClientOptions& o) {
  bool header = false;
  const bool tty = isatty(STDERR_FILENO) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::optional<JobProgress> first;
  double first_s = 0;
  bool bar_shown = false;
  auto clear_bar = [&] {
    if (bar_shown) std::cerr << "\r\033[K" << std::flush;
    bar_shown = false;
  };
  auto state = FollowJob(c, o.watch_timeout_seconds, [&](const v1::JobEvent& e) {
    const JobProgress now = ProgressOf(e);
    if (!first) {
      first = now;
      first_s = seconds();
    }
    clear_bar();
    if (e.metrics().empty()) {
      std::cerr << JobStateLine(e) << "\n";
    } else if (o.json) {
      std::cout << StepJson(e).dump() << "\n" << std::flush;
    } else {
      if (!header) std::cout << StepTableHeader();
      header = true;
      std::cout << StepTableRow(e) << std::flush;
    }
    if (o.json) return;
    const std::string line = ProgressLine(*first, first_s, now, seconds());
    if (tty) {
      std::cerr << line << std::flush;
      bar_shown = true;
    } else if (!e.metrics().empty()) {
      std::cerr << line << "\n";
    }
  });
  clear_bar();
  if (!state.ok()) return Fail("watch", state.status());
  return *state == learner::JobState::kFailed ? 1 : 0;
}

int RunSubmit(const ClientOptions& o) {
  // A directory opens as a stream and fails only when read: refuse it as the argument it is.
  if (std::error_code ec; std::filesystem::is_directory(o.dataset, ec)) {
    return Fail("submit", Status::InvalidArgument("--dataset " + o.dataset +
                                                  " is a directory, not a JSON Lines file"));
  }
  auto c = Connect(o);
  if (!c.ok()) return Fail("submit", c.status());
  std::ifstream in(o.dataset);
  if (!in) return Fail("submit", Status::NotFound("cannot read --dataset " + o.dataset));
  auto submitted = SubmitLines(*c, in, o.idempotency_key, o.name.empty() ? o.dataset : o.name,
                               o.timeout_seconds);
  if (!submitted.ok()) return Fail("submit", submitted.status());
  const v1::SubmitDatasetResponse& response = *submitted;
  if (o.json) {
    std::cout << nlohmann::json{{"dataset_id", response.dataset_id()},
                                {"prompt_count", response.prompt_count()},
                                {"created", response.created()}}
                     .dump()
              << "\n";
  } else {
    std::cout << "dataset " << response.dataset_id() << ": " << response.prompt_count()
              << " prompts" << (response.created() ? "" : " (already submitted)") << "\n";
  }
  std::cout << std::flush;
  return o.follow ? Watch(*c, o) : 0;
}

int RunStatus(const ClientOptions& o) {
  auto c = Connect(o);
  if (!c.ok()) return Fail("status", c.status());
  v1::Job job;
  grpc::Status s = c->stub->GetJob(c->Context(o.timeout_seconds).get(), v1::GetJobRequest(), &job);
  if (!s.ok()) return Fail("status", FromGrpcStatus(s));
  PrintJob(job, o.json);
  return 0;
}

// `grpo watch --report_to ...`: the dashboards' clients are Python packages, so the watch is the
// Python package's (`python -m grpo_serve watch`, same output, same exit codes), run in place of
// this process with the venv's Python ($GRPO_PYTHON, else $GRPO_VENV/bin/python, else
// deploy/setup.sh's /opt/grpo-serve/venv/bin/python).
int ExecPythonWatch(const ClientOptions& o) {
  const StatusOr<LearnerEndpoint> endpoint = ResolveEndpoint(o);
  if (!endpoint.ok()) return Fail("watch", endpoint.status());
  std::string python;
  if (const char* p = std::getenv("GRPO_PYTHON"); p != nullptr && *p != '\0') {
    python = p;
  } else if (const char* v = std::getenv("GRPO_VENV"); v != nullptr && *v != '\0') {
    python = std::string(v) + "/bin/python";
  } else {
    python = "/opt/grpo-serve/venv/bin/python";
  }
  std::vector<std::string> args = {python,
                                   "-m",
                                   "grpo_serve",
                                   "watch",
                                   "--learner_address",
                                   endpoint->address,
                                   "--timeout_seconds",
                                   std::to_string(o.timeout_seconds),
                                   "--watch_timeout_seconds",
                                   std::to_string(o.watch_timeout_seconds),
                                   "--report_to",
                                   o.report_to};
  const auto add = [&](const char* flag, const std::string& value) {
    if (!value.empty()) args.insert(args.end(), {flag, value});
  };
  add("--auth_token_file", endpoint->token_file);
  add("--tls_ca_file", endpoint->ca_file);
  add("--project", o.project);
  add("--run_name", o.run_name);
  add("--logging_dir", o.logging_dir);
  if (o.json) args.push_back("--json");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::cout.flush();
  ::execv(python.c_str(), argv.data());
  return Fail("watch", Status::FailedPrecondition(
                           "--report_to runs the grpo_serve Python package with " + python +
                           ", which could not be started (" + std::strerror(errno) +
                           "): run deploy/setup.sh, or set GRPO_PYTHON to a Python that has it"));
}

int RunWatch(const ClientOptions& o) {
  if (!o.report_to.empty()) return ExecPythonWatch(o);
  auto c = Connect(o);
  if (!c.ok()) return Fail("watch", c.status());
  return Watch(*c, o);
}

int RunCancel(const ClientOptions& o) {
  auto c = Connect(o);
  if (!c.ok()) return Fail("cancel", c.status());
  v1::CancelJobRequest req;
  req.set_reason(o.reason);
  v1::Job job;
  grpc::Status s = c->stub->CancelJob(c->Context(o.timeout_seconds).get(), req, &job);
  if (!s.ok()) return Fail("cancel", FromGrpcStatus(s));
  PrintJob(job, o.json);
  return 0;
}

}  // namespace

void AddClientCommands(CLI::App& app, CliAction* action) {
  {
    auto o = std::make_shared<ClientOptions>();
    auto* cmd = app.add_subcommand("submit", "Submit a JSON Lines prompt dataset to a learner");
    AddCommonOptions(cmd, o.get());
    cmd->add_option("--dataset", o->dataset, "JSON Lines rows with \"prompt\" or \"messages\"")
        ->required();
    cmd->add_option("--idempotency_key", o->idempotency_key,
                    "resubmitting with the same key adds nothing");
    cmd->add_option("--name", o->name, "a name for the dataset (default: the file name)");
    cmd->add_flag("--follow", o->follow, "then watch the job, as `grpo watch`");
    cmd->add_flag("--json", o->json, "JSON output");
    cmd->add_option("--watch_timeout_seconds", o->watch_timeout_seconds,
                    "deadline of the --follow stream");
    cmd->callback([o, action] { *action = [o] { return RunSubmit(*o); }; });
  }
  {
    auto o = std::make_shared<ClientOptions>();
    auto* cmd = app.add_subcommand("status", "Print a learner's job state");
    AddCommonOptions(cmd, o.get());
    cmd->add_flag("--json", o->json, "the Job message as JSON");
    cmd->callback([o, action] { *action = [o] { return RunStatus(*o); }; });
  }
  {
    auto o = std::make_shared<ClientOptions>();
    auto* cmd = app.add_subcommand(
        "watch", "Follow a learner's job: one line per optimizer step until the job ends");
    AddCommonOptions(cmd, o.get());
    cmd->add_flag("--json", o->json, "one JSON object per step (TRL metric names)");
    cmd->add_option("--watch_timeout_seconds", o->watch_timeout_seconds, "deadline of the stream");
    cmd->add_option("--report_to", o->report_to,
                    "also log every step to these dashboards (comma-separated: trackio, "
                    "tensorboard, wandb, mlflow), with TRL's metric names; runs the grpo_serve "
                    "Python package's watch");
    cmd->add_option("--project", o->project,
                    "with --report_to: trackio/wandb project, MLflow "
                    "experiment");
    cmd->add_option("--run_name", o->run_name, "with --report_to: the dashboards' run name");
    cmd->add_option("--logging_dir", o->logging_dir, "with --report_to: TensorBoard's directory");
    cmd->callback([o, action] { *action = [o] { return RunWatch(*o); }; });
  }
  {
    auto o = std::make_shared<ClientOptions>();
    auto* cmd = app.add_subcommand("cancel", "Cancel a learner's job");
    AddCommonOptions(cmd, o.get());
    cmd->add_option("--reason", o->reason, "recorded in the job's message");
    cmd->add_flag("--json", o->json, "the Job message as JSON");
    cmd->callback([o, action] { *action = [o] { return RunCancel(*o); }; });
  }
}

}  // namespace grpo::services
