#include "common/weight_sync/gloo_weight_sync.h"

#include <c10/util/Exception.h>
#include <signal.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef GRPO_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include <csignal>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/weight_sync/gloo_rendezvous.h"
#include "common/weight_sync/weight_sync_protocol.h"

namespace grpo::common {

std::string C10dErrorText(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

bool C10dErrorMentionsTimeout(const std::string& text) {
  for (const char* needle : {"timed out", "Timed out", "timeout", "Timeout"}) {
    if (text.find(needle) != std::string::npos) return true;
  }
  return false;
}

namespace {
#ifdef GRPO_HAVE_GLOO

using Clock = std::chrono::steady_clock;

// A failed collective or rendezvous: DeadlineExceeded when the deadline passed or gloo says it
// timed out, else Unavailable (a peer closed its connection, the transport failed).
Status FromException(const std::exception& e, Clock::time_point start,
                     std::chrono::milliseconds timeout, const std::string& op) {
  const std::string what = C10dErrorText(e);
  const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  const std::string m = op + " failed after " + std::to_string(elapsed.count()) + " ms: " + what;
  if (C10dErrorMentionsTimeout(what) || elapsed >= timeout) {
    return Status::DeadlineExceeded(m + " (deadline " + std::to_string(timeout.count()) + " ms)");
  }
  return Status::Unavailable(m);
}

// Gloo writes to its sockets without MSG_NOSIGNAL: a write to a peer that closed the group (a
// rank that aborted, or rank 0 while this one was stopped) raised SIGPIPE and killed the process
// (gloo_weight_sync_test, gloo_stall_test). The first group makes SIGPIPE ignored, so the write
// fails with EPIPE and the collective with an error, unless the process chose a handler itself.
void IgnoreSigpipeOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      std::signal(SIGPIPE, SIG_IGN);
    }
  });
}

class GlooWeightSync final : public HostMemoryWeightSync {
 public:
  GlooWeightSync(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, int rank, int world_size,
                 int64_t epoch, WeightSyncOptions options)
      : HostMemoryWeightSync(rank, world_size, epoch, options), pg_(std::move(pg)) {}
  ~GlooWeightSync() override { AbortBackend(); }

 protected:
  const char* backend_name() const override { return "gloo"; }

  Status BroadcastBytes(void* data, int64_t bytes) override {
    std::vector<at::Tensor> tensors = {at::from_blob(data, {bytes}, at::kByte)};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    opts.timeout = options().timeout;
    return Run("broadcast of " + std::to_string(bytes) + " bytes",
               [&] { return pg_->broadcast(tensors, opts); });
  }

  Status AllGatherInt64(const std::vector<int64_t>& mine, std::vector<int64_t>* all) override {
    const int64_t n = static_cast<int64_t>(mine.size());
    std::vector<at::Tensor> input = {at::empty({n}, at::kLong)};
    std::memcpy(input[0].data_ptr(), mine.data(), n * sizeof(int64_t));
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < world_size(); ++r) output[0].push_back(at::empty({n}, at::kLong));
    c10d::AllgatherOptions opts;
    opts.timeout = options().timeout;
    RETURN_IF_ERROR(Run("all-gather", [&] { return pg_->allgather(output, input, opts); }));
    all->resize(n * world_size());
    for (int r = 0; r < world_size(); ++r) {
      std::memcpy(all->data() + r * n, output[0][r].data_ptr(), n * sizeof(int64_t));
    }
    return Status::OK();
  }

  // Destroying the process group joins its worker threads (an op in flight ends by gloo's own
  // timeout, the same deadline) and closes the connections, so peers fail fast.
  void AbortBackend() override {
    if (!pg_) return;
    try {
      pg_.reset();
    } catch (const std::exception& e) {
      // Destructors of c10d should not throw; nothing more to do if one does.
    }
  }

 private:
  template <typename Launch>
  Status Run(const std::string& op, Launch launch) {
    if (!pg_) return Status::Aborted("gloo process group is gone");
    const auto start = Clock::now();
    try {
      c10::intrusive_ptr<c10d::Work> work = launch();
      work->wait(options().timeout);
      return Status::OK();
    } catch (const std::exception& e) {
      return FromException(e, start, options().timeout, op);
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

#endif  // GRPO_HAVE_GLOO

}  // namespace

StatusOr<std::unique_ptr<WeightSync>> CreateGlooWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                           int rank, int world_size, int64_t epoch,
                                                           const GlooWeightSyncOptions& options) {
#ifndef GRPO_HAVE_GLOO
  return Status::Unimplemented("built without Gloo (GRPO_WITH_GLOO=OFF)");
#else
  if (!store) return Status::InvalidArgument("gloo weight sync needs a store");
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " outside world of " +
                                   std::to_string(world_size));
  }
  if (options.sync.bucket_bytes <= 0) return Status::InvalidArgument("bucket_bytes must be > 0");
  if (options.sync.timeout.count() <= 0) return Status::InvalidArgument("timeout must be > 0");
  IgnoreSigpipeOnce();
  const auto start = Clock::now();
  const std::string op = "gloo rendezvous (epoch " + std::to_string(epoch) + ", rank " +
                         std::to_string(rank) + "/" + std::to_string(world_size) + ")";
  try {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        "grpo/weight_sync/" + std::to_string(epoch), std::move(store));
    auto pg = JoinGlooGroup(std::move(prefixed), rank, world_size, options.sync.timeout,
                            options.hostname);
    return std::unique_ptr<WeightSync>(
        std::make_unique<GlooWeightSync>(std::move(pg), rank, world_size, epoch, options.sync));
  } catch (const std::exception& e) {
    return FromException(e, start, options.sync.timeout, op);
  }
#endif  // GRPO_HAVE_GLOO
}

StatusOr<std::unique_ptr<WeightSync>> CreateGlooWeightSync(c10::intrusive_ptr<c10d::Store> store,
                                                           int rank, int world_size, int64_t epoch,
                                                           std::chrono::milliseconds timeout) {
  GlooWeightSyncOptions options;
  options.sync.timeout = timeout;
  return CreateGlooWeightSync(std::move(store), rank, world_size, epoch, options);
}

}  // namespace grpo::common
