// GlooWeightSync: WeightSync over TCP through libtorch's c10d ProcessGroupGloo (CPU tensors).
// The group rendezvouses through a c10d::Store under the prefix "grpo/weight_sync/<epoch>/", so
// groups of different epochs never mix on one store.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/status.h"
#include "common/weight_sync/weight_sync.h"

namespace grpo::common {

struct GlooWeightSyncOptions {
  WeightSyncOptions sync;
  // The address this rank listens on ("127.0.0.1" for loopback); empty: the machine's
  // hostname, else loopback (c10d's createDefaultDevice).
  std::string hostname;
};

// Joins the group: blocks until all `world_size` ranks have joined through `store` or
// options.sync.timeout passes (DeadlineExceeded). The first call makes the process ignore
// SIGPIPE when it has the default disposition (Gloo's writes to a closed peer raise it).
// InvalidArgument for a bad rank/world/option; Unavailable when the transport cannot be set up.
// `store` is shared with the caller.
StatusOr<std::unique_ptr<WeightSync>> CreateGlooWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                           int rank, int world_size, int64_t epoch,
                                                           const GlooWeightSyncOptions& options);

// The same with default options and the given deadline.
StatusOr<std::unique_ptr<WeightSync>> CreateGlooWeightSync(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, int64_t epoch,
    std::chrono::milliseconds timeout = kDefaultBroadcastTimeout);

// The text of a c10d/gloo exception (c10::Error without its backtrace), and whether it says a
// deadline passed: the two facts every caller of a c10d collective turns into a Status (here,
// and the learner's rank group, learner/distributed/rank_group.cc).
std::string C10dErrorText(const std::exception& e);
bool C10dErrorMentionsTimeout(const std::string& text);

}  // namespace grpo::common
