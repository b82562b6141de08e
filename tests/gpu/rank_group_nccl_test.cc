// The learner ranks' c10d group on a GPU (issue 21, label `gpu`): with a CUDA device, CUDA
// tensors' collectives go over ProcessGroupNCCL and CPU tensors' over Gloo, in the same group.
// One GPU cannot hold two NCCL ranks, so this is a group of one: every collective is the
// identity, computed through NCCL's communicator (created at the first collective) and checked
// by hand; the multi-rank math is data_parallel_test's, over Gloo. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <chrono>

#include "common/model/device.h"
#include "learner/distributed/rank_group.h"
#include "tests/reserved_port.h"

namespace grpo::learner::distributed {
namespace {

TEST(RankGroupNccl, AGroupOfOneOnAGpuRunsEveryCollectiveOverNccl) {
  if (!common::CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  grpo::testing::ReservedPort port;
  ASSERT_GT(port.port(), 0);
  RankEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = port.port();
  const at::Device cuda(at::kCUDA, 0);
  auto group = RankGroup::Join(env, std::chrono::seconds(60), cuda);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EXPECT_EQ((*group)->cuda_backend(), "nccl");
  const auto on = at::TensorOptions().dtype(at::kFloat).device(cuda);
  std::vector<at::Tensor> sum = {at::tensor({1.f, -2.f, 3.5f}).to(cuda),
                                 at::tensor(std::vector<double>{4.0, 5.0})};  // CPU: Gloo
  ASSERT_TRUE((*group)->AllReduceSum(sum, "sum").ok());
  EXPECT_TRUE(at::equal(sum[0].cpu(), at::tensor({1.f, -2.f, 3.5f})));
  EXPECT_TRUE(at::equal(sum[1], at::tensor(std::vector<double>{4.0, 5.0})));
  std::vector<at::Tensor> max = {at::tensor({7.f, -1.f}).to(cuda)};
  ASSERT_TRUE((*group)->AllReduceMax(max, "max").ok());
  EXPECT_TRUE(at::equal(max[0].cpu(), at::tensor({7.f, -1.f})));
  std::vector<at::Tensor> bcast = {at::arange(6, on)};
  ASSERT_TRUE((*group)->Broadcast(bcast, "broadcast").ok());
  EXPECT_TRUE(at::equal(bcast[0].cpu(), at::arange(6, at::kFloat)));
  at::Tensor in = at::arange(4, on), out = at::zeros({4}, on);
  ASSERT_TRUE((*group)->ReduceScatterSum(in, out, "reduce-scatter").ok());
  EXPECT_TRUE(at::equal(out.cpu(), at::arange(4, at::kFloat)));
  at::Tensor gathered = at::zeros({4}, on);
  ASSERT_TRUE((*group)->AllGather(in, gathered, "all-gather").ok());
  EXPECT_TRUE(at::equal(gathered.cpu(), at::arange(4, at::kFloat)));
}

}  // namespace
}  // namespace grpo::learner::distributed
