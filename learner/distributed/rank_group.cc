#include "learner/distributed/rank_group.h"

#include <c10/util/Exception.h>

#include <charconv>
#include <cstdlib>
#include <exception>
#include <string_view>
#include <vector>

#ifdef GRPO_HAVE_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

#include "common/cuda/cuda_module.h"
#include "common/logging.h"
#include "common/weight_sync/gloo_rendezvous.h"
#include "common/weight_sync/gloo_weight_sync.h"

namespace grpo::learner::distributed {

namespace {

StatusOr<int> IntVar(const std::function<const char*(const char*)>& getenv, const char* name,
                     int fallback) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const std::string_view text(v);
  int out = 0;
  const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (ec != std::errc() || p != text.data() + text.size() || out < 0) {
    return Status::InvalidArgument(std::string("environment variable ") + name + "='" + v +
                                   "' is not a non-negative integer");
  }
  return out;
}

}  // namespace

StatusOr<RankEnv> ParseRankEnv(const std::function<const char*(const char*)>& getenv) {
  RankEnv env;
  ASSIGN_OR_RETURN(env.world_size, IntVar(getenv, "WORLD_SIZE", 1));
  if (env.world_size < 1) {
    return Status::InvalidArgument("environment variable WORLD_SIZE must be at least 1");
  }
  ASSIGN_OR_RETURN(const int index, IntVar(getenv, "JOB_COMPLETION_INDEX", 0));
  ASSIGN_OR_RETURN(const int offset, IntVar(getenv, "GRPO_RANK_OFFSET", 0));
  ASSIGN_OR_RETURN(env.rank, IntVar(getenv, "RANK", index + offset));
  ASSIGN_OR_RETURN(env.local_rank, IntVar(getenv, "LOCAL_RANK", env.rank));
  ASSIGN_OR_RETURN(env.local_world_size, IntVar(getenv, "LOCAL_WORLD_SIZE", 1));
  if (env.local_world_size < 1 || env.local_world_size > env.world_size) {
    return Status::InvalidArgument(
        "environment variable LOCAL_WORLD_SIZE=" + std::to_string(env.local_world_size) +
        " is not between 1 and WORLD_SIZE=" + std::to_string(env.world_size));
  }
  if (env.rank >= env.world_size) {
    return Status::InvalidArgument("environment variable RANK=" + std::to_string(env.rank) +
                                   " is outside WORLD_SIZE=" + std::to_string(env.world_size));
  }
  ASSIGN_OR_RETURN(env.master_port, IntVar(getenv, "MASTER_PORT", env.master_port));
  if (env.master_port < 1 || env.master_port > 65535) {
    return Status::InvalidArgument(
        "environment variable MASTER_PORT=" + std::to_string(env.master_port) + " is not a port");
  }
  const char* addr = getenv("MASTER_ADDR");
  if (addr != nullptr && *addr != '\0') {
    env.master_addr = addr;
  } else if (env.world_size > 1) {
    return Status::InvalidArgument("environment variable MASTER_ADDR is not set (WORLD_SIZE is " +
                                   std::to_string(env.world_size) +
                                   "): the address of rank 0, which serves the rendezvous");
  }
  return env;
}

StatusOr<RankEnv> RankEnvFromEnvironment() {
  return ParseRankEnv([](const char* name) { return std::getenv(name); });
}

#ifdef GRPO_HAVE_GLOO

namespace {

using Clock = std::chrono::steady_clock;

std::string WhatOf(const std::exception& e) { return common::C10dErrorText(e); }
bool MentionsTimeout(const std::string& m) { return common::C10dErrorMentionsTimeout(m); }

bool IsLoopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

class RankGroup::Impl {
 public:
  RankEnv env;
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;  // CPU tensors (and CUDA ones without NCCL)
  c10::intrusive_ptr<c10d::Backend> nccl;         // CUDA tensors, on a GPU with NCCL built
  int64_t collectives = 0;                        // started so far (names a failure)
  std::string failure;       // the first failure; later collectives are Aborted
  int64_t next_command = 0;  // rank 0: posted; others: read
  int64_t oldest_kept = 0;   // rank 0: commands [oldest_kept, next_command) are in the store

  std::string CommandKey(int64_t n) const { return "grpo/ranks/command/" + std::to_string(n); }

  // The backend of `t`'s collectives.
  c10d::Backend& For(const at::Tensor& t) {
    if (nccl && t.is_cuda()) return *nccl;
    return *pg;
  }

  // c10d's tensor list is one tensor per local device: one collective per tensor here, each on
  // its device's backend.
  template <typename Launch>
  Status EachTensor(std::vector<at::Tensor>& tensors, const std::string& what, Launch launch) {
    for (at::Tensor& t : tensors) {
      std::vector<at::Tensor> one = {t};
      RETURN_IF_ERROR(Run(what, [&] { return launch(For(t), one); }));
    }
    return Status::OK();
  }

  // A collective started (or refused): what Await needs to name it and bound it.
  struct Started {
    std::string what, who;
    Clock::time_point start;
    c10::intrusive_ptr<c10d::Work> work;  // null when refused or failed to start
    Status status;                        // why, then
  };

  template <typename Fn>
  Started Launch(const std::string& what, Fn launch) {
    Started s{what,
              "learner rank " + std::to_string(env.rank) + "/" + std::to_string(env.world_size) +
                  ": " + what + " (collective " + std::to_string(collectives + 1) + ")",
              Clock::now(), nullptr, Status::OK()};
    if (!failure.empty()) {
      s.status = Status::Aborted(s.who + ": the rank group failed earlier: " + failure);
      return s;
    }
    ++collectives;
    try {
      s.work = launch();
    } catch (const std::exception& e) {
      s.status = Failed(s, WhatOf(e));
    }
    return s;
  }

  Status Await(Started& s) {
    if (!s.work) return s.status;
    try {
      s.work->wait(timeout);
      return Status::OK();
    } catch (const std::exception& e) {
      return Failed(s, WhatOf(e));
    }
  }

  template <typename Fn>
  Status Run(const std::string& what, Fn launch) {
    Started s = Launch(what, launch);
    return Await(s);
  }

 private:
  Status Failed(const Started& s, const std::string& m) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - s.start).count();
    if (failure.empty()) failure = s.what + " failed after " + std::to_string(ms) + " ms: " + m;
    if (MentionsTimeout(m) || Clock::now() - s.start >= timeout) {
      return Status::DeadlineExceeded(
          s.who + " failed after " + std::to_string(ms) + " ms (deadline rank_timeout_seconds = " +
          std::to_string(timeout.count() / 1000.0) + " s): a rank stalled: " + m);
    }
    return Status::Unavailable(s.who + " failed after " + std::to_string(ms) +
                               " ms: a rank left the group: " + m);
  }
};

RankGroup::RankGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RankGroup::~RankGroup() {
  try {
    impl_->nccl.reset();
    impl_->pg.reset();
    impl_->store.reset();
  } catch (const std::exception&) {
    // c10d's destructors should not throw; nothing more to do if one does.
  }
}

StatusOr<std::unique_ptr<RankGroup>> RankGroup::Join(const RankEnv& env,
                                                     std::chrono::milliseconds timeout,
                                                     const at::Device& device) {
  if (timeout.count() <= 0) return Status::InvalidArgument("rank group timeout must be > 0");
  auto impl = std::make_unique<Impl>();
  impl->env = env;
  impl->timeout = timeout;
  const auto start = Clock::now();
  const std::string op = "learner rank " + std::to_string(env.rank) + "/" +
                         std::to_string(env.world_size) + ": rendezvous at " + env.master_addr +
                         ":" + std::to_string(env.master_port);
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = env.rank == 0;
    opts.numWorkers = env.world_size;
    opts.waitWorkers = true;
    opts.timeout = timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("grpo/ranks/pg", impl->store);
    impl->pg = common::JoinGlooGroup(prefixed, env.rank, env.world_size, timeout,
                                     IsLoopback(env.master_addr) ? "127.0.0.1" : "");
    if (const common::CudaModule* cuda = common::Cuda(); cuda != nullptr && device.is_cuda()) {
      // Its own prefix of the store: NCCL's unique id is exchanged there. Communicators are
      // created at the first collective, on the device of its tensors (cuda:LOCAL_RANK).
      auto nccl_store = c10::make_intrusive<c10d::PrefixStore>("grpo/ranks/nccl", impl->store);
      impl->nccl = cuda->create_nccl_backend(nccl_store, env.rank, env.world_size, timeout);
    }
  } catch (const std::exception& e) {
    const std::string m = WhatOf(e);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    const std::string msg = op + " failed after " + std::to_string(ms) + " ms: " + m;
    if (MentionsTimeout(m) || Clock::now() - start >= timeout) {
      return Status::DeadlineExceeded(msg + " (not every rank of WORLD_SIZE " +
                                      std::to_string(env.world_size) + " joined in time)");
    }
    return Status::Unavailable(msg);
  }
  GRPO_LOG_INFO("{}: joined ({} ranks, collectives bounded by {} ms; CUDA tensors over {})", op,
                env.world_size, timeout.count(), impl->nccl ? "nccl" : "gloo");
  return std::unique_ptr<RankGroup>(new RankGroup(std::move(impl)));
}

int RankGroup::rank() const { return impl_->env.rank; }
std::string RankGroup::cuda_backend() const { return impl_->nccl ? "nccl" : "gloo"; }
int RankGroup::world_size() const { return impl_->env.world_size; }

Status RankGroup::AllReduceSum(std::vector<at::Tensor>& tensors, const std::string& what) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = impl_->timeout;
  return impl_->EachTensor(tensors, what, [&](c10d::Backend& b, std::vector<at::Tensor>& one) {
    return b.allreduce(one, opts);
  });
}

Status RankGroup::AllReduceMax(std::vector<at::Tensor>& tensors, const std::string& what) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  opts.timeout = impl_->timeout;
  return impl_->EachTensor(tensors, what, [&](c10d::Backend& b, std::vector<at::Tensor>& one) {
    return b.allreduce(one, opts);
  });
}

Status RankGroup::Broadcast(std::vector<at::Tensor>& tensors, const std::string& what) {
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  opts.timeout = impl_->timeout;
  return impl_->EachTensor(tensors, what, [&](c10d::Backend& b, std::vector<at::Tensor>& one) {
    return b.broadcast(one, opts);
  });
}

Status RankGroup::ReduceScatterSum(const at::Tensor& input, at::Tensor& output,
                                   const std::string& what) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = impl_->timeout;
  at::Tensor in = input;
  return impl_->Run(what, [&] { return impl_->For(in)._reduce_scatter_base(output, in, opts); });
}

Status RankGroup::AllGather(const at::Tensor& input, at::Tensor& output, const std::string& what) {
  c10d::AllgatherOptions opts;
  opts.timeout = impl_->timeout;
  at::Tensor in = input;
  return impl_->Run(what, [&] { return impl_->For(in)._allgather_base(output, in, opts); });
}

namespace {

// c10d's work, waited for with the group's deadline and error names.
class StartedAllGather final : public PendingCollective {
 public:
  StartedAllGather(RankGroup::Impl* impl, RankGroup::Impl::Started started)
      : impl_(impl), started_(std::move(started)) {}
  Status Wait() override { return impl_->Await(started_); }

 private:
  RankGroup::Impl* impl_;
  RankGroup::Impl::Started started_;
};

}  // namespace

std::unique_ptr<PendingCollective> RankGroup::AllGatherAsync(const at::Tensor& input,
                                                             at::Tensor& output,
                                                             const std::string& what) {
  c10d::AllgatherOptions opts;
  opts.timeout = impl_->timeout;
  at::Tensor in = input;
  return std::make_unique<StartedAllGather>(impl_.get(), impl_->Launch(what, [&] {
    return impl_->For(in)._allgather_base(output, in, opts);
  }));
}

Status RankGroup::Post(const std::string& command) {
  Impl& m = *impl_;
  if (m.env.rank != 0) return Status::FailedPrecondition("only rank 0 posts commands");
  try {
    // Drop the commands every other rank has read (each adds 1 to <key>/read).
    while (m.oldest_kept < m.next_command &&
           m.store->add(m.CommandKey(m.oldest_kept) + "/read", 0) >= m.env.world_size - 1) {
      m.store->deleteKey(m.CommandKey(m.oldest_kept));
      m.store->deleteKey(m.CommandKey(m.oldest_kept) + "/read");
      ++m.oldest_kept;
    }
    m.store->set(m.CommandKey(m.next_command),
                 std::vector<uint8_t>(command.begin(), command.end()));
    ++m.next_command;
    return Status::OK();
  } catch (const std::exception& e) {
    return Status::Unavailable("learner rank 0: posting command " + std::to_string(m.next_command) +
                               " failed: " + WhatOf(e));
  }
}

StatusOr<std::string> RankGroup::Next(std::chrono::milliseconds poll) {
  Impl& m = *impl_;
  if (m.env.rank == 0) return Status::FailedPrecondition("rank 0 posts commands, it reads none");
  const std::string key = m.CommandKey(m.next_command);
  while (true) {
    try {
      m.store->wait({key}, poll);
      const std::vector<uint8_t> bytes = m.store->get(key);
      m.store->add(key + "/read", 1);
      ++m.next_command;
      return std::string(bytes.begin(), bytes.end());
    } catch (const std::exception& e) {
      const std::string what = WhatOf(e);
      if (MentionsTimeout(what)) continue;  // rank 0 is idle: ask again
      return Status::Unavailable("learner rank " + std::to_string(m.env.rank) +
                                 ": waiting for command " + std::to_string(m.next_command) +
                                 " from rank 0 failed (rank 0 is gone): " + what);
    }
  }
}

#else  // GRPO_HAVE_GLOO

class RankGroup::Impl {};
RankGroup::RankGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankGroup::~RankGroup() = default;
StatusOr<std::unique_ptr<RankGroup>> RankGroup::Join(const RankEnv&, std::chrono::milliseconds,
                                                     const at::Device&) {
  return Status::Unimplemented("learner ranks need Gloo: built with GRPO_WITH_GLOO=OFF");
}
int RankGroup::rank() const { return 0; }
std::string RankGroup::cuda_backend() const { return "none"; }
int RankGroup::world_size() const { return 1; }
Status RankGroup::AllReduceSum(std::vector<at::Tensor>&, const std::string&) {
  return Status::Unimplemented("built without Gloo");
}
Status RankGroup::AllReduceMax(std::vector<at::Tensor>&, const std::string&) {
  return Status::Unimplemented("built without Gloo");
}
Status RankGroup::Broadcast(std::vector<at::Tensor>&, const std::string&) {
  return Status::Unimplemented("built without Gloo");
}
Status RankGroup::ReduceScatterSum(const at::Tensor&, at::Tensor&, const std::string&) {
  return Status::Unimplemented("built without Gloo");
}
Status RankGroup::AllGather(const at::Tensor&, at::Tensor&, const std::string&) {
  return Status::Unimplemented("built without Gloo");
}
std::unique_ptr<PendingCollective> RankGroup::AllGatherAsync(const at::Tensor& input,
                                                             at::Tensor& output,
                                                             const std::string& what) {
  return Collectives::AllGatherAsync(input, output, what);
}
Status RankGroup::Post(const std::string&) { return Status::Unimplemented("built without Gloo"); }
StatusOr<std::string> RankGroup::Next(std::chrono::milliseconds) {
  return Status::Unimplemented("built without Gloo");
}

#endif  // GRPO_HAVE_GLOO

}  // namespace grpo::learner::distributed
