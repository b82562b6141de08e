// LearnerServer: the learner process's gRPC face (grpo.v1.LearnerService, proto/grpo/v1/
// learner.proto) around learner::Learner (learner/learner.h: the ledger, the training loop,
// the ingest policy, the worker registry, the weight publishers, the job state). The shell
// checks auth, converts between protobuf and the learner's plain structs (services/convert.h),
// runs the stream loops (PushRollouts, GetWeights in chunks, SubmitDataset, WatchJob) and
// serves the weight-sync groups' rendezvous store (the Store RPC).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "common/config.h"
#include "common/metrics/grpo_metrics.h"
#include "common/metrics/metrics.h"
#include "common/model/model.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/weight_sync/epoch_store.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "learner/job.h"
#include "learner/learner.h"
#include "learner/prompt_ledger.h"

namespace grpo::services {

// The learner's constants and job states (learner/learner.h), by their old names here.
using learner::JobState;
using learner::JobStateName;
using learner::kDefaultGetWeightsWait;
using learner::kDefaultHeartbeatInterval;
using learner::kDefaultLeaseRetryAfter;
using learner::kDefaultPushBufferWait;
using learner::kFinalCheckpointAttempts;
using learner::kHeartbeatsMissedBeforeDrop;
using learner::kHousekeepInterval;
using learner::kLeaseLongPoll;
using learner::kMaxBadGroupAttempts;
using learner::kMaxLeasesPerCall;
using learner::kWaitPollInterval;
using learner::kWatchQueueCapacity;

// In-flight calls get this long to finish when the server stops.
inline constexpr std::chrono::milliseconds kDefaultShutdownGrace{5000};
// WeightChunk payload: the default and the maximum (a request may ask for less).
inline constexpr int64_t kDefaultWeightChunkBytes = 4 << 20;
inline constexpr int64_t kMaxDatasetBytes = 1ll << 30;

struct LearnerServerOptions : learner::LearnerOptions {
  // The gRPC bind address; empty = config.grpc_bind_address.
  std::string bind_address;
  // SubmitDataset refuses uploads larger than this (each line counts its bytes + 1).
  int64_t max_dataset_bytes = kMaxDatasetBytes;
};

// Thread-safe: RPC handlers run on gRPC's threads. Lifetime: Create -> Start ->
// (WaitForJobEnd) -> Stop; the destructor stops.
class LearnerServer final : public v1::LearnerService::Service {
 public:
  // learner::Learner::Create, plus the gRPC port, the auth token and the server credentials.
  // InvalidArgument naming the key on a bad config, and for a `device` this process cannot use.
  static StatusOr<std::unique_ptr<LearnerServer>> Create(
      common::GrpoConfig config, std::unique_ptr<common::Model> policy,
      std::unique_ptr<common::Model> reference = nullptr, LearnerServerOptions options = {});
  ~LearnerServer() override;
  LearnerServer(const LearnerServer&) = delete;
  LearnerServer& operator=(const LearnerServer&) = delete;

  // Binds <bind_address>:<config.grpc_port> (0 = a free port), serves LearnerService and
  // grpc.health.v1 (SERVING), then starts the learner (initial weights, training thread).
  // With auth_token_file set, a call without the token is refused inside gRPC before its message
  // is read (TokenAuthProcessor; health Check/Watch are open); logs a WARNING when auth is off
  // and the address is not loopback. Unavailable when the port cannot be bound.
  Status Start() GRPO_EXCLUDES(mu_);
  // Stops training after the current generation batch, saves a checkpoint when `checkpoint`
  // and steps were taken since the last one, then shuts the server down (in-flight calls get
  // kDefaultShutdownGrace) and ends the ledger. Idempotent; returns the checkpoint error if any.
  Status Stop(bool checkpoint) GRPO_EXCLUDES(mu_);
  // Blocks until the job is done, cancelled or failed, or `timeout` passes; true if it ended.
  bool WaitForJobEnd(std::chrono::milliseconds timeout) { return learner_->WaitForJobEnd(timeout); }

  int port() const { return port_; }  // the bound port, after Start
  // This process's learner_incarnation (RegisterResponse): groups must carry it.
  const std::string& incarnation() const { return learner_->incarnation(); }
  JobState job_state() const { return learner_->job_state(); }
  int64_t published_version() const { return learner_->published_version(); }
  int64_t group_epoch() const { return learner_->group_epoch(); }
  learner::PromptLedger& TEST_ledger() { return learner_->TEST_ledger(); }
  std::map<std::string, int64_t> RefusedCounts() const { return learner_->RefusedCounts(); }
  const common::Model& policy() const { return learner_->policy(); }
  const std::shared_ptr<common::InMemoryEpochStore>& epoch_store() const {
    return learner_->epoch_store();
  }
  int64_t group_syncs(std::string_view backend) const { return learner_->group_syncs(backend); }
  int64_t group_sync_failures(std::string_view backend) const {
    return learner_->group_sync_failures(backend);
  }
  const common::Registry& metrics_registry() const { return learner_->metrics_registry(); }
  const common::LearnerMetrics& metrics() const { return learner_->metrics(); }
  Status Health() const { return learner_->Health(); }

  // --- grpo.v1.LearnerService. Every handler checks auth first and never throws.
  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status LeasePrompts(grpc::ServerContext* context, const v1::LeasePromptsRequest* request,
                            v1::LeasePromptsResponse* response) override;
  grpc::Status PushRollouts(grpc::ServerContext* context,
                            grpc::ServerReader<v1::RolloutGroup>* reader,
                            v1::PushRolloutsResponse* response) override;
  grpc::Status GetWeights(grpc::ServerContext* context, const v1::GetWeightsRequest* request,
                          grpc::ServerWriter<v1::WeightChunk>* writer) override;
  grpc::Status SubmitDataset(grpc::ServerContext* context,
                             grpc::ServerReader<v1::SubmitDatasetRequest>* reader,
                             v1::SubmitDatasetResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobEvent>* writer) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* response) override;
  grpc::Status Store(grpc::ServerContext* context, const v1::StoreRequest* request,
                     v1::StoreResponse* response) override;

 private:
  LearnerServer(common::GrpoConfig config, LearnerServerOptions options);

  const common::GrpoConfig config_;
  const LearnerServerOptions options_;
  std::unique_ptr<learner::Learner> learner_;
  std::string auth_token_;
  std::shared_ptr<grpc::ServerCredentials> server_credentials_;  // TLS or insecure
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  common::Mutex mu_;
  bool started_ GRPO_GUARDED_BY(mu_) = false;
  bool stopped_ GRPO_GUARDED_BY(mu_) = false;
};

}  // namespace grpo::services
