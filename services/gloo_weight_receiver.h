// GlooWeightReceiver: the worker side of the Gloo weight sync (docs/ARCHITECTURE.md
// "Weight sync"). A background thread joins the group of the current epoch
// through the learner's Store RPC (GrpcStore; its rank is its line in the
// epoch's roster), receives every version the learner broadcasts into fresh
// tensors and keeps the latest. Receive installs that one when it is new
// enough, and otherwise falls back to GetWeights (GrpcWeightReceiver). A failed
// collective or a new epoch makes the thread leave the group and rejoin at the
// next epoch.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/safetensors.h"
#include "common/status.h"
#include "common/weight_sync.h"
#include "rollout/weight_receiver.h"
#include "services/grpc_store.h"
#include "services/grpc_weight_receiver.h"

namespace grpo::services {

// Receive waits this long for the group's copy of a version before it uses
// GetWeights.
inline constexpr std::chrono::milliseconds kDefaultGlooVersionWait{10'000};
// The background thread's store waits (roster, next version) re-check the epoch
// this often.
inline constexpr std::chrono::milliseconds kGlooStorePollInterval{1000};

struct GlooWeightReceiverOptions {
  // Deadline of the rendezvous and of each collective (the learner's
  // weight_sync_timeout).
  std::chrono::milliseconds timeout = common::kDefaultBroadcastTimeout;
  std::chrono::milliseconds version_wait = kDefaultGlooVersionWait;
  // The address this rank listens on; empty: the machine's hostname
  // ("127.0.0.1": loopback).
  std::string hostname;
  int64_t chunk_bytes =
      0; // GetWeights fallback chunk size; 0 = the learner's default
};

// Receive: one caller at a time (the worker's main thread). SetGroup and the
// counters: any thread. The destructor stops the thread (within options.timeout
// at worst).
class GlooWeightReceiver final : public rollout::WeightReceiver {
public:
  GlooWeightReceiver(std::shared_ptr<grpc::Channel> channel,
                     std::string auth_token,
                     GlooWeightReceiverOptions options = {});
  ~GlooWeightReceiver() override;
  GlooWeightReceiver(const GlooWeightReceiver &) = delete;
  GlooWeightReceiver &operator=(const GlooWeightReceiver &) = delete;

  // The group's latest version when >= min_version (waits up to version_wait
  // while in a group), else GrpcWeightReceiver::Receive. Errors as
  // GrpcWeightReceiver / Model::LoadStateFrom.
  StatusOr<int64_t> Receive(int64_t min_version, common::Model &model,
                            std::chrono::milliseconds timeout) override;
  std::string backend() const override { return "gloo"; }
  void SetGroup(const std::string &worker_id, int64_t group_epoch) override;

  int64_t versions_received() const {
    return versions_received_.load();
  } // over gloo
  int64_t installs_from_gloo() const { return installs_from_gloo_.load(); }
  int64_t installs_from_grpc() const { return installs_from_grpc_.load(); }
  int64_t groups_joined() const { return groups_joined_.load(); }
  // The last version received over gloo (-1 when none) and its tensors (never
  // written again).
  std::pair<int64_t, common::NamedTensors> latest() const;

private:
  struct Slot {
    std::string name;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
  };

  void Loop();
  // Polls `key` at `epoch` until set, the epoch changes or stop: the value or
  // the last error.
  StatusOr<std::string> WaitForKey(GrpcStore &store, const std::string &key,
                                   int64_t epoch);
  bool EpochIs(int64_t epoch) const;

  const std::shared_ptr<grpc::Channel> channel_;
  const std::string auth_token_;
  const GlooWeightReceiverOptions options_;
  GrpcWeightReceiver grpc_; // main thread (Receive) only
  std::vector<Slot>
      layout_; // set by the first Receive, before the thread starts
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string worker_id_;       // GUARDED_BY(mu_)
  int64_t epoch_ = 0;           // GUARDED_BY(mu_): 0 = not registered yet
  bool stop_ = false;           // GUARDED_BY(mu_)
  bool in_group_ = false;       // GUARDED_BY(mu_)
  int64_t latest_version_ = -1; // GUARDED_BY(mu_)
  common::NamedTensors latest_; // GUARDED_BY(mu_)

  std::atomic<int64_t> versions_received_{0}, installs_from_gloo_{0},
      installs_from_grpc_{0}, groups_joined_{0};
};

} // namespace grpo::services
