// GrpcEpochStore: a worker's EpochStore (common/weight_sync/epoch_store.h) over the learner's
// Store RPC (learner.proto), the rendezvous store of the weight-sync groups
// (docs/ARCHITECTURE.md "Weight sync"). Every call carries the auth token and the group epoch
// and has a deadline; the learner serves its InMemoryEpochStore behind the RPC, so a call of a
// past epoch fails (FailedPrecondition) instead of mixing groups. c10d gets it through
// common::C10dEpochStore.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/weight_sync/epoch_store.h"
#include "grpo/v1/learner.grpc.pb.h"

namespace grpo::services {

// The deadline of a store call that does not wait.
inline constexpr std::chrono::milliseconds kDefaultGrpcStoreTimeout{60'000};
// Added to a waiting call's RPC deadline so the server's own timeout answers first.
inline constexpr std::chrono::milliseconds kStoreRpcSlack{2000};

// One Store RPC: (request, response, deadline of the call) -> status.
using StoreCall = std::function<Status(const v1::StoreRequest&, v1::StoreResponse*,
                                       std::chrono::milliseconds deadline)>;

// Thread-safe. Errors: the learner's (see common::EpochStore), Unavailable when it is gone,
// Unimplemented from a learner without the Store RPC.
class GrpcEpochStore final : public common::EpochStore {
 public:
  // `call` reaches the learner (a Stub through Connect, or a server in-process in tests).
  explicit GrpcEpochStore(StoreCall call,
                          std::chrono::milliseconds timeout = kDefaultGrpcStoreTimeout);
  // A store over LearnerService.Store on `channel`; `auth_token` may be empty.
  static std::shared_ptr<GrpcEpochStore> Connect(
      std::shared_ptr<grpc::Channel> channel, std::string auth_token,
      std::chrono::milliseconds timeout = kDefaultGrpcStoreTimeout);

  StatusOr<std::string> Get(int64_t epoch, const std::string& key,
                            std::chrono::milliseconds timeout) override;
  Status Set(int64_t epoch, const std::string& key, const std::string& value) override;
  StatusOr<int64_t> Add(int64_t epoch, const std::string& key, int64_t delta) override;
  StatusOr<bool> Check(int64_t epoch, const std::vector<std::string>& keys) override;
  StatusOr<bool> Delete(int64_t epoch, const std::string& key) override;
  StatusOr<int64_t> NumKeys(int64_t epoch) override;
  StatusOr<std::string> CompareSet(int64_t epoch, const std::string& key,
                                   const std::string& expected, const std::string& desired,
                                   bool* swapped) override;

 private:
  StatusOr<v1::StoreResponse> Call(int64_t epoch, v1::StoreRequest request,
                                   std::chrono::milliseconds deadline);

  const StoreCall call_;
  const std::chrono::milliseconds timeout_;
};

// The Store RPC's body on the learner: `request` against `store` (`cancel` may be null:
// in-process calls; tripping it ends a waiting GET). Statuses are the store's.
Status ServeStoreRequest(common::InMemoryEpochStore& store, const v1::StoreRequest& request,
                         v1::StoreResponse* response, const common::CancelToken* cancel);

}  // namespace grpo::services
