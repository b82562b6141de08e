// NcclWeightSync on a GPU machine (LABELS gpu; every test skips where no CUDA device is
// visible). One GPU cannot hold two NCCL ranks, so the group tests use world_size 1 (init,
// bucketed broadcast, commit, abort) and a missing second rank (the deadline path).
// Tensors describe device memory through at::from_blob: libtorch here may be CPU-only.
#include "common/weight_sync/nccl_weight_sync.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "common/weight_sync/weight_sync.h"
#include "tests/common/weight_sync_test_util.h"

namespace grpo::common {
namespace {

using grpo::testing::BitEqual;
using grpo::testing::kOddBucketBytes;
using grpo::testing::MakeLayout;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

// Device copies of host tensors; the at::Tensors only describe the device memory.
class DeviceTensors {
 public:
  explicit DeviceTensors(const NamedTensors& host) {
    for (const auto& [name, t] : host) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(t.nbytes(), 1)), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p, t.data_ptr(), t.nbytes(), cudaMemcpyHostToDevice), cudaSuccess);
      buffers_.push_back(p);
      tensors_.emplace_back(name, at::from_blob(p, t.sizes(), t.options()));
    }
  }
  ~DeviceTensors() {
    for (void* p : buffers_) cudaFree(p);
  }
  NamedTensors& tensors() { return tensors_; }
  NamedTensors ToHost() const {
    NamedTensors out;
    for (const auto& [name, t] : tensors_) {
      at::Tensor h = at::empty(t.sizes(), t.options());
      EXPECT_EQ(cudaMemcpy(h.data_ptr(), t.data_ptr(), t.nbytes(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      out.emplace_back(name, h);
    }
    return out;
  }

 private:
  std::vector<void*> buffers_;
  NamedTensors tensors_;
};

NcclWeightSyncOptions Options(std::chrono::milliseconds timeout) {
  NcclWeightSyncOptions o;
  o.sync.timeout = timeout;
  o.sync.bucket_bytes = kOddBucketBytes;
  return o;
}

TEST(NcclWeightSync, OneRankInitsBroadcastsInBucketsCommitsAndAborts) {
  SKIP_WITHOUT_GPU();
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto sync = CreateNcclWeightSync(store, 0, 1, 0, Options(30s));
  ASSERT_TRUE(sync.ok()) << sync.status().ToString();
  const NamedTensors host = MakeLayout(21, false);
  DeviceTensors dev(host);
  ASSERT_TRUE((*sync)->Begin(3).ok());
  Status s = (*sync)->Broadcast(dev.tensors());
  ASSERT_TRUE(s.ok()) << s.ToString();
  s = (*sync)->Commit();
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ((*sync)->committed_version(), 3);
  EXPECT_TRUE(BitEqual(dev.ToHost(), host));  // packing through staging kept every byte
  (*sync)->Abort();
  EXPECT_EQ((*sync)->Begin(4).code(), StatusCode::kAborted);
}

TEST(NcclWeightSync, HostMemoryIsRejectedOnEveryRank) {
  SKIP_WITHOUT_GPU();
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto sync = CreateNcclWeightSync(store, 0, 1, 0, Options(30s));
  ASSERT_TRUE(sync.ok()) << sync.status().ToString();
  NamedTensors host = MakeLayout(1, false);
  ASSERT_TRUE((*sync)->Begin(0).ok());
  EXPECT_EQ((*sync)->Broadcast(host).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE((*sync)->aborted());
}

TEST(NcclWeightSync, PeerThatNeverJoinsIsDeadlineExceededWithinTheTimeout) {
  SKIP_WITHOUT_GPU();
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto start = Clock::now();
  auto sync = CreateNcclWeightSync(store, 0, 2, 0, Options(2000ms));  // rank 1 never comes
  const auto elapsed = Clock::now() - start;
  EXPECT_EQ(sync.status().code(), StatusCode::kDeadlineExceeded) << sync.status().ToString();
  EXPECT_LT(elapsed, 6s);
}

TEST(NcclWeightSync, ReceiverWithoutAPublisherIsDeadlineExceeded) {
  SKIP_WITHOUT_GPU();
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto start = Clock::now();
  auto sync = CreateNcclWeightSync(store, 1, 2, 0, Options(1000ms));  // no unique id ever
  EXPECT_EQ(sync.status().code(), StatusCode::kDeadlineExceeded) << sync.status().ToString();
  EXPECT_LT(Clock::now() - start, 4s);
}

}  // namespace
}  // namespace grpo::common
