#include "services/cli/bench_services_util.h"

#include <cstring>
#include <iostream>

#include "services/auth.h"
#include "services/convert.h"

namespace grpo::services::bench {

using nlohmann::json;

std::shared_ptr<grpc::Channel> OwnChannel(const std::string& address, int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("grpo.bench_channel", index);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

std::unique_ptr<grpc::ClientContext> Ctx(std::chrono::seconds timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  return ctx;
}

common::GrpoConfig BenchServiceConfig(const std::string& dir) {
  common::GrpoConfig c;
  c.output_dir = dir;
  c.grpc_port = 0;
  c.metrics_port = 0;
  c.num_generations = kBenchGenerations;
  c.per_device_train_batch_size = kBenchGenerations;
  c.gradient_accumulation_steps = 1;
  c.max_prompt_length = kPromptLen;
  c.max_completion_length = kCompletionLen;
  c.max_steps = 1 << 20;
  c.save_steps = 0;
  c.lease_seconds = 3600;
  c.reward_funcs = {"length"};
  return c;
}

StatusOr<std::unique_ptr<LearnerServer>> StartLearner(
    common::GrpoConfig cfg, std::unique_ptr<common::Model> model,
    std::chrono::milliseconds heartbeat_interval) {
  LearnerServerOptions options;
  options.heartbeat_interval = heartbeat_interval;
  options.bind_address = "127.0.0.1";
  options.resume = false;
  options.weight_sync_timeout = kSyncTimeout;
  options.weight_sync_hostname = "127.0.0.1";
  ASSIGN_OR_RETURN(auto server,
                   LearnerServer::Create(std::move(cfg), std::move(model), nullptr, options));
  RETURN_IF_ERROR(server->Start());
  return server;
}

Status SubmitRows(v1::LearnerService::Stub& stub, const std::vector<std::string>& lines) {
  auto ctx = Ctx();
  v1::SubmitDatasetResponse response;
  auto writer = stub.SubmitDataset(ctx.get(), &response);
  v1::SubmitDatasetRequest req;
  req.set_name("bench");
  for (size_t i = 0; i < lines.size(); ++i) {
    req.add_lines(lines[i]);
    if (req.lines_size() == 256 || i + 1 == lines.size()) {
      // The last message says so, with the line count: the learner commits a dataset only
      // whole (SubmitDatasetRequest.last, total_lines).
      if (i + 1 == lines.size()) {
        req.set_last(true);
        req.set_total_lines(static_cast<int64_t>(lines.size()));
      }
      if (!writer->Write(req)) break;
      req.Clear();
    }
  }
  writer->WritesDone();
  return FromGrpcStatus(writer->Finish()).WithContext("SubmitDataset");
}

int64_t TotalBytes(const common::NamedTensors& t) {
  int64_t n = 0;
  for (const auto& [name, x] : t) n += static_cast<int64_t>(x.nbytes());
  return n;
}

bool BitEqual(const common::NamedTensors& a, const common::NamedTensors& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor x = a[i].second.contiguous(), y = b[i].second.contiguous();
    if (x.nbytes() != y.nbytes() || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

json TimingJson(const Timing& t, const std::string& prefix) {
  return {{prefix + "_median", t.median}, {prefix + "_min", t.min}, {prefix + "_max", t.max}};
}

void Merge(json& row, const json& more) {
  for (auto it = more.begin(); it != more.end(); ++it) row[it.key()] = it.value();
}

int Fail(const std::string& bench, const Status& s) {
  std::cerr << "grpo bench " << bench << ": " << s.ToString() << "\n";
  return 1;
}

}  // namespace grpo::services::bench
