// RankGroup: the learner's ranks as real processes on PyTorch's c10d (docs/ARCHITECTURE.md
// "Learner ranks"): the world from torchrun's environment, a TCPStore served by rank 0 at
// MASTER_ADDR:MASTER_PORT for the rendezvous, a ProcessGroupGloo over it for the collectives of
// CPU tensors and, on a GPU where the process has the CUDA module (common/cuda/), a
// ProcessGroupNCCL for those of CUDA tensors (Gloo otherwise; every collective bounded by
// rank_timeout_seconds), and a command channel on the same store by which rank 0 (the service)
// tells the other ranks (trainers) what to do next.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/status.h"
#include "learner/distributed/collectives.h"

namespace grpo::learner::distributed {

// Where this process is in the learner's world.
struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;  // the ranks on this host (torchrun's LOCAL_WORLD_SIZE)
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // torchrun's default
};

// The world from the environment: RANK (or, in a Kubernetes indexed Job, JOB_COMPLETION_INDEX
// plus GRPO_RANK_OFFSET, default 0: deploy/k8s runs rank 0 in the learner's StatefulSet and
// ranks 1.. as an indexed Job with offset 1), WORLD_SIZE, LOCAL_RANK (default: RANK),
// LOCAL_WORLD_SIZE (default 1: one rank a host, as a pod; at most WORLD_SIZE),
// MASTER_ADDR, MASTER_PORT, as torchrun, Kubeflow's PyTorchJob and the manifests of deploy/k8s
// set them. Without WORLD_SIZE (or with 1) the world
// is this one process. InvalidArgument naming the variable on a bad value (not a number, rank
// outside the world, MASTER_ADDR missing at WORLD_SIZE > 1).
StatusOr<RankEnv> ParseRankEnv(const std::function<const char*(const char*)>& getenv);
StatusOr<RankEnv> RankEnvFromEnvironment();

class RankGroup final : public Collectives {
 public:
  // Joins the group: rank 0 serves the store and waits for the other ranks, which connect to
  // it, all within `timeout` (also the deadline of every collective). DeadlineExceeded naming
  // the ranks still missing; Unimplemented when built without Gloo. With a CUDA `device` (the
  // rank's, cuda:LOCAL_RANK) CUDA tensors go over NCCL when the CUDA module is here.
  static StatusOr<std::unique_ptr<RankGroup>> Join(const RankEnv& env,
                                                   std::chrono::milliseconds timeout,
                                                   const at::Device& device = at::kCPU);
  // The backend of CUDA tensors' collectives: "nccl", or "gloo".
  std::string cuda_backend() const;
  ~RankGroup() override;

  int rank() const override;
  int world_size() const override;
  Status AllReduceSum(std::vector<at::Tensor>& tensors, const std::string& what) override;
  Status AllReduceMax(std::vector<at::Tensor>& tensors, const std::string& what) override;
  Status Broadcast(std::vector<at::Tensor>& tensors, const std::string& what) override;
  Status ReduceScatterSum(const at::Tensor& input, at::Tensor& output,
                          const std::string& what) override;
  Status AllGather(const at::Tensor& input, at::Tensor& output, const std::string& what) override;
  // Started on c10d at once, waited for in Wait() (every rank's later collectives queue after).
  std::unique_ptr<PendingCollective> AllGatherAsync(const at::Tensor& input, at::Tensor& output,
                                                    const std::string& what) override;

  // Rank 0: the next command (bytes) for every other rank, in order. Commands read by every
  // rank are removed from the store.
  Status Post(const std::string& command);
  // Ranks > 0: the next command. Waits as long as rank 0 is there (a learner waits for rollouts
  // as long as it needs to), polling its store every `poll`; Unavailable once rank 0 is gone.
  StatusOr<std::string> Next(std::chrono::milliseconds poll = std::chrono::milliseconds(1000));

  class Impl;  // rank_group.cc's (public: the pending collectives it starts name it)

 private:
  explicit RankGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace grpo::learner::distributed
