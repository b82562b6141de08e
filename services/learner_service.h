// LearnerServer: the learner process's gRPC face (grpo.v1.LearnerService, proto/grpo/v1/
// learner.proto) around learner::Learner (learner/learner.h: the ledger, the training loop,
// the ingest policy, the worker registry, the weight publishers, the job state). The shell
// checks auth, converts between protobuf and the learner's plain structs (services/convert.h),
// runs the stream loops (PushRollouts, GetWeights in chunks, SubmitDataset, WatchJob) and
// serves the weight-sync groups' rendezvous store (the Store RPC).
//
// The methods that wait (LeasePrompts, PushRollouts, GetWeights, WatchJob, Store) are gRPC
// callback-API methods whose reactors trip a cancel token the learner's waits watch
// (services/blocking_calls.h): a wait ends the moment its call is cancelled, its deadline
// passes or the server shuts down. The others are sync-API methods (they do not wait).
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
#include "services/blocking_calls.h"

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

// The generated service with the waiting methods on the callback API.
using LearnerServiceBase = v1::LearnerService::WithCallbackMethod_LeasePrompts<
    v1::LearnerService::WithCallbackMethod_PushRollouts<
        v1::LearnerService::WithCallbackMethod_GetWeights<
            v1::LearnerService::WithCallbackMethod_WatchJob<
                v1::LearnerService::WithCallbackMethod_Store<v1::LearnerService::Service>>>>>;

// Thread-safe: sync handlers run on gRPC's threads, the waiting methods' bodies on threads of
// CallThreads (at most config.grpc_max_threads of each). Lifetime: Create -> Start ->
// (WaitForJobEnd) -> Stop; the destructor stops.
class LearnerServer final : public LearnerServiceBase {
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
  grpc::ServerUnaryReactor* LeasePrompts(grpc::CallbackServerContext* context,
                                         const v1::LeasePromptsRequest* request,
                                         v1::LeasePromptsResponse* response) override;
  grpc::ServerReadReactor<v1::RolloutGroup>* PushRollouts(
      grpc::CallbackServerContext* context, v1::PushRolloutsResponse* response) override;
  grpc::ServerWriteReactor<v1::WeightChunk>* GetWeights(
      grpc::CallbackServerContext* context, const v1::GetWeightsRequest* request) override;
  grpc::Status SubmitDataset(grpc::ServerContext* context,
                             grpc::ServerReader<v1::SubmitDatasetRequest>* reader,
                             v1::SubmitDatasetResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* context,
                                                   const v1::WatchJobRequest* request) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::Job* response) override;
  grpc::ServerUnaryReactor* Store(grpc::CallbackServerContext* context,
                                  const v1::StoreRequest* request,
                                  v1::StoreResponse* response) override;

  // Bodies of the waiting methods running now (tests: a cancelled call frees its thread).
  int64_t TEST_running_call_bodies() const { return call_threads_->running(); }

 private:
  LearnerServer(common::GrpoConfig config, LearnerServerOptions options);
  // GetWeights' and WatchJob's stream loops, on a CallThreads thread.
  // `context` cancels a streamed call whose client stops reading.
  grpc::Status ServeWeights(const v1::GetWeightsRequest& request,
                            BlockingWriteReactor<v1::WeightChunk>& call,
                            grpc::CallbackServerContext* context);
  grpc::Status ServeJobEvents(BlockingWriteReactor<v1::JobEvent>& call);

  const common::GrpoConfig config_;
  const LearnerServerOptions options_;
  std::unique_ptr<learner::Learner> learner_;
  std::string auth_token_;
  std::shared_ptr<grpc::ServerCredentials> server_credentials_;  // TLS or insecure
  // Declared before server_: destroyed after it (the server's calls run on these threads).
  std::unique_ptr<CallThreads> call_threads_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  common::Mutex mu_;
  bool started_ GRPO_GUARDED_BY(mu_) = false;
  bool stopped_ GRPO_GUARDED_BY(mu_) = false;
};

}  // namespace grpo::services
