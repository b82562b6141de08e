// GrpcStore: a c10d::Store over the learner's Store RPC (learner.proto), the
// rendezvous store of the weight-sync group (docs/ARCHITECTURE.md "Weight sync").
// Every call carries the auth token and the group epoch and has a deadline;
// keys live in the learner's per-epoch key space, so a store of a past epoch
// fails every call (FailedPrecondition) instead of mixing groups.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "common/status.h"
#include "grpo/v1/learner.grpc.pb.h"

namespace grpo::services {

// The default deadline of a store call (a GET or wait waits this long for its
// keys).
inline constexpr std::chrono::milliseconds kDefaultGrpcStoreTimeout{60'000};
// Added to a waiting call's RPC deadline so the server's own timeout answers
// first.
inline constexpr std::chrono::milliseconds kStoreRpcSlack{2000};

// The weight-sync group's keys (per epoch): the roster (worker ids of
// ranks 1..N, one a line) and the announcement of the k-th version of the epoch
// (its policy version, decimal), written by the learner before it calls Begin.
inline constexpr const char *kWeightSyncRosterKey = "grpo/gloo/roster";
inline constexpr const char *kWeightSyncVersionKeyPrefix = "grpo/gloo/version/";

// One Store RPC: (request, response, deadline of the call) -> status.
using StoreCall =
    std::function<Status(const v1::StoreRequest &, v1::StoreResponse *,
                         std::chrono::milliseconds deadline)>;

// Thread-safe (c10d calls it from several threads). The c10d overrides throw
// c10::Error carrying the Status text (c10d's contract); the Status methods
// below do not throw.
class GrpcStore final : public c10d::Store {
public:
  // `call` reaches the learner (a Stub through Connect, or the server
  // in-process).
  GrpcStore(StoreCall call, int64_t epoch, std::chrono::milliseconds timeout);
  // A store over LearnerService.Store on `channel`; `auth_token` may be empty.
  static c10::intrusive_ptr<GrpcStore>
  Connect(std::shared_ptr<grpc::Channel> channel, std::string auth_token,
          int64_t epoch,
          std::chrono::milliseconds timeout = kDefaultGrpcStoreTimeout);

  int64_t epoch() const { return epoch_; }

  // Waits for `key` up to `timeout`: DeadlineExceeded then, FailedPrecondition
  // when the epoch ended, Unavailable when the learner is gone or stopping.
  StatusOr<std::string> Get(const std::string &key,
                            std::chrono::milliseconds timeout);
  Status Set(const std::string &key, const std::string &value);
  StatusOr<int64_t> Add(const std::string &key, int64_t delta);

  // --- c10d::Store.
  void set(const std::string &key, const std::vector<uint8_t> &value) override;
  std::vector<uint8_t> compareSet(const std::string &key,
                                  const std::vector<uint8_t> &expected,
                                  const std::vector<uint8_t> &desired) override;
  std::vector<uint8_t>
  get(const std::string &key) override; // waits up to getTimeout()
  int64_t add(const std::string &key, int64_t value) override;
  bool deleteKey(const std::string &key) override;
  bool check(const std::vector<std::string> &keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string> &keys) override;
  void wait(const std::vector<std::string> &keys,
            const std::chrono::milliseconds &timeout) override;
  // A second client of the same store (same call, epoch and timeout); libtorch 2.x's c10d
  // clones a store for each thread that talks to it.
  c10::intrusive_ptr<c10d::Store> clone() override;

private:
  StatusOr<v1::StoreResponse> Call(v1::StoreRequest request,
                                   std::chrono::milliseconds deadline);

  const StoreCall call_;
  const int64_t epoch_;
};

} // namespace grpo::services
