// Client commands against a learner: `grpo submit`, `grpo status`, `grpo watch`, `grpo cancel`.
// Every call carries the shared token (--auth_token_file) and a deadline.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/config.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "services/auth.h"
#include "services/cli.h"
#include "services/convert.h"

namespace grpo::services {
namespace {

// Deadline of one unary call, and of a whole SubmitDataset upload.
constexpr double kDefaultCallTimeoutSeconds = 60;
// Deadline of a WatchJob stream (a watch normally ends with the job long before).
constexpr double kDefaultWatchTimeoutSeconds = 7 * 24 * 3600;
// SubmitDataset message payload (lines are never split).
constexpr size_t kSubmitChunkBytes = 1 << 20;

struct ClientOptions {
  std::string config_file;  // learner_address and auth_token_file from here unless given
  std::string learner_address;
  std::string auth_token_file;
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
};

void AddCommonOptions(CLI::App* cmd, ClientOptions* o) {
  cmd->add_option("--learner_address", o->learner_address,
                  "HOST:PORT of the learner (default: the config's learner_address)");
  cmd->add_option("--auth_token_file", o->auth_token_file, "file holding the shared token");
  cmd->add_option("--config", o->config_file,
                  "YAML config to take learner_address and auth_token_file from");
  cmd->add_option("--timeout_seconds", o->timeout_seconds, "deadline of each call");
}

// A connected client: the stub and the token.
struct Client {
  std::unique_ptr<v1::LearnerService::Stub> stub;
  std::string token;

  std::unique_ptr<grpc::ClientContext> Context(double seconds) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
    AddAuth(*ctx, token);
    return ctx;
  }
};

StatusOr<Client> Connect(const ClientOptions& o) {
  common::GrpoConfig cfg;
  if (!o.config_file.empty()) {
    ASSIGN_OR_RETURN(cfg, common::LoadConfigFile(o.config_file));
  }
  const std::string address = o.learner_address.empty() ? cfg.learner_address : o.learner_address;
  const std::string token_file =
      o.auth_token_file.empty() ? cfg.auth_token_file : o.auth_token_file;
  if (!(o.timeout_seconds > 0)) return Status::InvalidArgument("--timeout_seconds must be > 0");
  Client c;
  ASSIGN_OR_RETURN(c.token, ReadAuthToken(token_file));
  c.stub = v1::LearnerService::NewStub(MakeChannel(address));
  return c;
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

double Metric(const v1::JobEvent& e, const char* name) {
  auto it = e.metrics().find(name);
  return it == e.metrics().end() ? 0.0 : it->second;
}

void PrintJob(const v1::Job& job, bool json) {
  if (json) {
    std::cout << ProtoJson(job) << "\n";
    return;
  }
  const auto& p = job.prompts();
  std::cout << "state    " << job.state()
            << (job.message().empty() ? "" : " (" + job.message() + ")") << "\n"
            << "step     " << job.global_step() << " / " << job.max_steps() << "\n"
            << "policy   version " << job.policy_version() << ", " << job.workers() << " workers\n"
            << "prompts  queued " << p.queued() << ", leased " << p.leased() << ", trained "
            << p.trained() << ", rejected " << p.rejected() << " (pass " << p.pass() << ")\n";
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

// Streams WatchJob until the job ends; reconnects when the learner dropped a slow watcher.
int Watch(const Client& c, const ClientOptions& o) {
  bool header = false;
  while (true) {
    auto ctx = c.Context(o.watch_timeout_seconds);
    auto reader = c.stub->WatchJob(ctx.get(), v1::WatchJobRequest());
    v1::JobEvent e;
    std::string state;
    while (reader->Read(&e)) {
      state = e.job().state();
      if (e.metrics().empty()) {
        std::cerr << "job " << state << " at step " << e.job().global_step() << "/"
                  << e.job().max_steps()
                  << (e.job().message().empty() ? "" : ": " + e.job().message()) << "\n";
        continue;
      }
      if (o.json) {
        nlohmann::json j = nlohmann::json::object();
        for (const auto& [k, v] : e.metrics()) j[k] = v;
        j["step"] = e.step();
        std::cout << j.dump() << "\n" << std::flush;
        continue;
      }
      if (!header) {
        std::cout << std::setw(6) << "step" << std::setw(10) << "reward" << std::setw(11)
                  << "reward_std" << std::setw(10) << "loss" << std::setw(10) << "kl"
                  << std::setw(10) << "grad_norm" << std::setw(8) << "len" << std::setw(10)
                  << "tok/s"
                  << "\n";
        header = true;
      }
      std::cout << std::fixed << std::setw(6) << e.step() << std::setprecision(4) << std::setw(10)
                << Metric(e, "reward") << std::setw(11) << Metric(e, "reward_std") << std::setw(10)
                << Metric(e, "loss") << std::setw(10) << Metric(e, "kl") << std::setw(10)
                << Metric(e, "grad_norm") << std::setprecision(1) << std::setw(8)
                << Metric(e, "completions/mean_length") << std::setw(10)
                << Metric(e, "tokens_per_second") << "\n"
                << std::flush;
    }
    grpc::Status s = reader->Finish();
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) continue;  // dropped: rewatch
    if (!s.ok()) return Fail("watch", FromGrpcStatus(s));
    return state == "failed" ? 1 : 0;
  }
}

int RunSubmit(const ClientOptions& o) {
  auto c = Connect(o);
  if (!c.ok()) return Fail("submit", c.status());
  std::ifstream in(o.dataset);
  if (!in) return Fail("submit", Status::NotFound("cannot read dataset " + o.dataset));
  auto ctx = c->Context(o.timeout_seconds);
  v1::SubmitDatasetResponse response;
  auto writer = c->stub->SubmitDataset(ctx.get(), &response);
  v1::SubmitDatasetRequest msg;
  msg.set_idempotency_key(o.idempotency_key);
  msg.set_name(o.name.empty() ? o.dataset : o.name);
  size_t bytes = 0;
  bool write_ok = true;
  std::string line;
  while (write_ok && std::getline(in, line)) {
    bytes += line.size();
    msg.add_lines(std::move(line));
    if (bytes >= kSubmitChunkBytes) {
      write_ok = writer->Write(msg);
      msg.Clear();
      bytes = 0;
    }
  }
  if (write_ok && (msg.lines_size() > 0 || !msg.idempotency_key().empty() || !msg.name().empty())) {
    write_ok = writer->Write(msg);
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return Fail("submit", FromGrpcStatus(s));
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

int RunWatch(const ClientOptions& o) {
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
