#include "services/learner_client.h"

#include <chrono>
#include <iomanip>
#include <optional>
#include <sstream>

#include "common/sha256.h"
#include "services/auth.h"
#include "services/convert.h"

namespace grpo::services {
namespace {

// SubmitDataset message payload (lines are never split).
constexpr size_t kSubmitChunkBytes = 1 << 20;

double Metric(const v1::JobEvent &e, const char *name) {
  auto it = e.metrics().find(name);
  return it == e.metrics().end() ? 0.0 : it->second;
}

}  // namespace

std::unique_ptr<grpc::ClientContext> LearnerClient::Context(double seconds) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  AddAuth(*ctx, token);
  return ctx;
}

StatusOr<LearnerClient> ConnectLearner(const std::string &address,
                                       const std::string &auth_token_file,
                                       const std::string &tls_ca_file) {
  LearnerClient c;
  ASSIGN_OR_RETURN(c.token, ReadAuthToken(auth_token_file));
  ASSIGN_OR_RETURN(const std::string root_certs, ReadPemFile(tls_ca_file, "tls_ca_file"));
  c.stub = v1::LearnerService::NewStub(MakeChannel(address, root_certs));
  return c;
}

std::string DatasetContentKey(const std::vector<std::string> &lines) {
  // The ledger's own content hash (length-prefixed lines), so that the same file always gets
  // the same key.
  common::Sha256 hasher;
  for (const std::string &line : lines) {
    const uint64_t size = line.size();
    hasher.Update(&size, sizeof(size));
    hasher.Update(line.data(), line.size());
  }
  return "sha256:" + hasher.HexDigest();
}

StatusOr<v1::SubmitDatasetResponse> SubmitLines(const LearnerClient &client, std::istream &jsonl,
                                                const std::string &idempotency_key,
                                                const std::string &name, double timeout_seconds) {
  std::vector<std::string> lines;
  for (std::string line; std::getline(jsonl, line);) lines.push_back(std::move(line));
  if (jsonl.bad()) return Status::Internal("SubmitDataset: cannot read the input");
  const std::string key = idempotency_key.empty() ? DatasetContentKey(lines) : idempotency_key;

  auto ctx = client.Context(timeout_seconds);
  v1::SubmitDatasetResponse response;
  auto writer = client.stub->SubmitDataset(ctx.get(), &response);
  v1::SubmitDatasetRequest msg;
  msg.set_idempotency_key(key);
  msg.set_name(name);
  size_t bytes = 0;
  bool write_ok = true;
  for (size_t i = 0; write_ok && i < lines.size(); ++i) {
    bytes += lines[i].size() + 1;
    msg.add_lines(std::move(lines[i]));
    if (bytes >= kSubmitChunkBytes && i + 1 < lines.size()) {
      write_ok = writer->Write(msg);
      msg.Clear();
      bytes = 0;
    }
  }
  // The final message: without it the learner stores nothing.
  msg.set_last(true);
  msg.set_total_lines(static_cast<int64_t>(lines.size()));
  if (write_ok) write_ok = writer->Write(msg);
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

void WatchCanceller::Cancel() {
  common::MutexLock lock(&mu_);
  cancelled_ = true;
  if (context_ != nullptr) context_->TryCancel();
}

bool WatchCanceller::cancelled() const {
  common::MutexLock lock(&mu_);
  return cancelled_;
}

void WatchCanceller::Attach(grpc::ClientContext *context) {
  common::MutexLock lock(&mu_);
  context_ = context;
  if (cancelled_ && context_ != nullptr) context_->TryCancel();
}

StatusOr<learner::JobState> FollowJob(const LearnerClient &client, double watch_timeout_seconds,
                                      const std::function<void(const v1::JobEvent &)> &on_event,
                                      WatchCanceller *canceller) {
  while (true) {
    auto ctx = client.Context(watch_timeout_seconds);
    if (canceller != nullptr) canceller->Attach(ctx.get());
    auto reader = client.stub->WatchJob(ctx.get(), v1::WatchJobRequest());
    v1::JobEvent e;
    std::optional<learner::JobState> state;
    while (reader->Read(&e)) {
      state = FromProto(e.job().state());
      on_event(e);
    }
    grpc::Status s = reader->Finish();
    if (canceller != nullptr) canceller->Attach(nullptr);
    if (canceller != nullptr && canceller->cancelled()) return Status::Cancelled("watch cancelled");
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) continue;  // dropped: rewatch
    if (!s.ok()) return FromGrpcStatus(s);
    if (!state) return Status::Internal("the job stream ended without a known job state");
    return *state;
  }
}

nlohmann::json StepJson(const v1::JobEvent &e) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto &[k, v] : e.metrics()) j[k] = v;
  j["step"] = e.step();
  return j;
}

std::string StepTableHeader() {
  std::ostringstream out;
  out << std::setw(6) << "step" << std::setw(10) << "reward" << std::setw(11) << "reward_std"
      << std::setw(10) << "loss" << std::setw(10) << "kl" << std::setw(10) << "grad_norm"
      << std::setw(8) << "len" << std::setw(10) << "tok/s"
      << "\n";
  return out.str();
}

std::string StepTableRow(const v1::JobEvent &e) {
  std::ostringstream out;
  out << std::fixed << std::setw(6) << e.step() << std::setprecision(4) << std::setw(10)
      << Metric(e, "reward") << std::setw(11) << Metric(e, "reward_std") << std::setw(10)
      << Metric(e, "loss") << std::setw(10) << Metric(e, "kl") << std::setw(10)
      << Metric(e, "grad_norm") << std::setprecision(1) << std::setw(8)
      << Metric(e, "completions/mean_length") << std::setw(10) << Metric(e, "tokens_per_second")
      << "\n";
  return out.str();
}

std::string JobStateLine(const v1::JobEvent &e) {
  return "job " + std::string(JobStateName(e.job().state())) + " at step " +
         std::to_string(e.job().global_step()) + "/" + std::to_string(e.job().max_steps()) +
         (e.job().message().empty() ? "" : ": " + e.job().message());
}

}  // namespace grpo::services
