// Helpers shared by the service benchmarks (`grpo bench weight_sync | ingest | e2e`, one file
// each: bench_weight_sync.cc, bench_ingest.cc, bench_e2e.cc). Every one runs a real
// LearnerServer in this process on loopback; "workers" are threads of this process with their
// own gRPC channels (and, for Gloo, their own TCP connections), so every byte crosses a real
// socket. Each row carries its baseline measured in the same run.
#pragma once

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/model/model.h"
#include "common/model/safetensors.h"
#include "common/status.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "services/cli/bench_util.h"
#include "services/learner_service.h"

namespace grpo::services::bench {

inline constexpr std::chrono::seconds kBenchRpcTimeout{120};
// The rendezvous and each collective of the Gloo group.
inline constexpr std::chrono::seconds kSyncTimeout{60};

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& stem) {
    std::string tmpl = (std::filesystem::temp_directory_path() / (stem + "-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }

 private:
  std::string path_;
};

// A channel of its own (its own subchannel pool, so its own TCP connection) to `address`.
std::shared_ptr<grpc::Channel> OwnChannel(const std::string& address, int index);
std::unique_ptr<grpc::ClientContext> Ctx(std::chrono::seconds timeout = kBenchRpcTimeout);
// A learner service config at the bench shapes; training runs only when a generation batch
// (per_device_train_batch_size x steps_per_generation completions) is buffered.
common::GrpoConfig BenchServiceConfig(const std::string& dir);
// `heartbeat_interval`: the ingest bench's workers do not heartbeat (they only lease and push),
// so it gives them one long enough that the learner keeps them registered.
StatusOr<std::unique_ptr<LearnerServer>> StartLearner(
    common::GrpoConfig cfg, std::unique_ptr<common::Model> model,
    std::chrono::milliseconds heartbeat_interval = learner::kDefaultHeartbeatInterval);
// SubmitDataset of `lines` in messages of 256, the last one marked with the line count.
Status SubmitRows(v1::LearnerService::Stub& stub, const std::vector<std::string>& lines);
int64_t TotalBytes(const common::NamedTensors& t);
bool BitEqual(const common::NamedTensors& a, const common::NamedTensors& b);
nlohmann::json TimingJson(const Timing& t, const std::string& prefix = "s");
void Merge(nlohmann::json& row, const nlohmann::json& more);
// Prints the failure and returns the bench's exit code (1).
int Fail(const std::string& bench, const Status& s);

}  // namespace grpo::services::bench
