// The backend-independent weight-sync protocol (bucket plan, fingerprint, checksum) and the
// in-process FakeWeightSync that runs it.
#include "common/weight_sync/weight_sync.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <vector>

#include "common/weight_sync/fake_weight_sync.h"
#include "common/weight_sync/weight_sync_protocol.h"
#include "tests/common/weight_sync_test_util.h"

namespace grpo::common {
namespace {

using grpo::testing::AllRanks;
using grpo::testing::BitEqual;
using grpo::testing::kOddBucketBytes;
using grpo::testing::MakeLayout;
using grpo::testing::RunRanks;
using namespace std::chrono_literals;

bool SamePiece(const BucketPiece& p, int64_t tensor, int64_t tensor_offset, int64_t bucket_offset,
               int64_t bytes) {
  return p.tensor == tensor && p.tensor_offset == tensor_offset &&
         p.bucket_offset == bucket_offset && p.bytes == bytes;
}

TEST(PlanBuckets, ConcatenatesEachDtypeAndCutsAtTheBucketSize) {
  // f32: 12 + 20 = 32 bytes -> two 16-byte buckets, the second inside tensor 1; i64: 16 bytes.
  NamedTensors t = {{"a", at::zeros({3}, at::kFloat)},
                    {"c", at::zeros({2}, at::kLong)},
                    {"b", at::zeros({5}, at::kFloat)}};
  const auto buckets = PlanBuckets(t, 16);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].dtype, at::kFloat);
  EXPECT_EQ(buckets[0].bytes, 16);
  ASSERT_EQ(buckets[0].pieces.size(), 2u);
  EXPECT_TRUE(SamePiece(buckets[0].pieces[0], 0, 0, 0, 12));
  EXPECT_TRUE(SamePiece(buckets[0].pieces[1], 2, 0, 12, 4));
  EXPECT_FALSE(buckets[0].zero_copy());
  EXPECT_EQ(buckets[1].bytes, 16);
  ASSERT_EQ(buckets[1].pieces.size(), 1u);
  EXPECT_TRUE(SamePiece(buckets[1].pieces[0], 2, 4, 0, 16));
  EXPECT_TRUE(buckets[1].zero_copy());
  EXPECT_EQ(buckets[2].dtype, at::kLong);
  ASSERT_EQ(buckets[2].pieces.size(), 1u);
  EXPECT_TRUE(SamePiece(buckets[2].pieces[0], 1, 0, 0, 16));
}

TEST(PlanBuckets, RoundsTheBucketSizeUpToEightBytes) {
  NamedTensors t = {{"a", at::zeros({8}, at::kFloat)}};  // 32 bytes, buckets of 16
  const auto buckets = PlanBuckets(t, 10);
  ASSERT_EQ(buckets.size(), 2u);
  EXPECT_EQ(buckets[0].bytes, 16);
  EXPECT_EQ(buckets[1].bytes, 16);
}

TEST(PlanBuckets, CoversEveryByteOfEveryTensorExactlyOnce) {
  const NamedTensors t = MakeLayout(1, /*zeros=*/true);
  std::vector<int64_t> covered(t.size(), 0);
  for (const Bucket& b : PlanBuckets(t, kOddBucketBytes)) {
    EXPECT_LE(b.bytes, kOddBucketBytes);
    int64_t next = 0;
    for (const BucketPiece& p : b.pieces) {
      EXPECT_EQ(t[p.tensor].second.scalar_type(), b.dtype);
      EXPECT_EQ(p.bucket_offset, next);               // pieces tile the bucket
      EXPECT_EQ(p.tensor_offset, covered[p.tensor]);  // and walk each tensor in order
      covered[p.tensor] += p.bytes;
      next += p.bytes;
    }
    EXPECT_EQ(next, b.bytes);
  }
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(covered[i], static_cast<int64_t>(t[i].second.nbytes())) << t[i].first;
  }
}

TEST(LayoutFingerprint, ChangesWithNameShapeAndDtypeOnly) {
  const NamedTensors base = {{"w", at::zeros({2, 3})}};
  EXPECT_EQ(LayoutFingerprint(base), LayoutFingerprint({{"w", at::ones({2, 3})}}));
  EXPECT_NE(LayoutFingerprint(base), LayoutFingerprint({{"v", at::zeros({2, 3})}}));
  EXPECT_NE(LayoutFingerprint(base), LayoutFingerprint({{"w", at::zeros({3, 2})}}));
  EXPECT_NE(LayoutFingerprint(base), LayoutFingerprint({{"w", at::zeros({2, 3}, at::kDouble)}}));
}

TEST(ChecksumBytes, DetectsASingleFlippedBitAnywhere) {
  std::vector<uint8_t> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  const uint64_t h = ChecksumBytes(data.data(), data.size(), 0);
  EXPECT_EQ(h, ChecksumBytes(data.data(), data.size(), 0));
  EXPECT_NE(h, ChecksumBytes(data.data(), data.size(), 1));
  for (size_t pos : {0ul, 31ul, 32ul, 500ul, 991ul, 999ul}) {
    data[pos] ^= 0x10;
    EXPECT_NE(h, ChecksumBytes(data.data(), data.size(), 0)) << "byte " << pos;
    data[pos] ^= 0x10;
  }
}

// --- The protocol, through the fake transport.

WeightSyncOptions FastOptions(std::chrono::milliseconds timeout = 2000ms) {
  WeightSyncOptions o;
  o.timeout = timeout;
  o.bucket_bytes = kOddBucketBytes;
  return o;
}

std::vector<std::unique_ptr<WeightSync>> MakeFakeGroup(std::shared_ptr<FakeWeightSyncHub> hub,
                                                       int64_t epoch, WeightSyncOptions options) {
  std::vector<std::unique_ptr<WeightSync>> syncs;
  for (int r = 0; r < hub->world_size(); ++r) {
    auto s = CreateFakeWeightSync(hub, r, epoch, options);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    syncs.push_back(std::move(s).value());
  }
  return syncs;
}

TEST(FakeWeightSync, ReceiversGetThePublishersTensorsBitExactAndCommit) {
  auto hub = std::make_shared<FakeWeightSyncHub>(3);
  auto syncs = MakeFakeGroup(hub, 0, FastOptions());
  const NamedTensors sent = MakeLayout(7, false);
  std::vector<NamedTensors> tensors = {sent, MakeLayout(7, true), MakeLayout(7, true)};
  std::vector<Status> begin(3), bcast(3), commit(3);
  RunRanks(AllRanks(3), [&](int r) {
    begin[r] = syncs[r]->Begin(r == 0 ? 5 : kAnyVersion);
    bcast[r] = syncs[r]->Broadcast(tensors[r]);
    commit[r] = syncs[r]->Commit();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(begin[r].ok()) << begin[r].ToString();
    EXPECT_TRUE(bcast[r].ok()) << bcast[r].ToString();
    EXPECT_TRUE(commit[r].ok()) << commit[r].ToString();
    EXPECT_EQ(syncs[r]->committed_version(), 5);
    EXPECT_TRUE(BitEqual(tensors[r], sent)) << "rank " << r;
  }
}

TEST(FakeWeightSync, ReceiverExpectingAnotherVersionFailsBeginOnEveryRank) {
  auto hub = std::make_shared<FakeWeightSyncHub>(2);
  auto syncs = MakeFakeGroup(hub, 0, FastOptions());
  std::vector<Status> begin(2);
  RunRanks(AllRanks(2), [&](int r) { begin[r] = syncs[r]->Begin(r == 0 ? 5 : 4); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(begin[r].code(), StatusCode::kFailedPrecondition) << begin[r].ToString();
    EXPECT_FALSE(syncs[r]->aborted());
  }
}

TEST(FakeWeightSync, LayoutMismatchFailsOnEveryRankAndTheGroupStaysUsable) {
  auto hub = std::make_shared<FakeWeightSyncHub>(2);
  auto syncs = MakeFakeGroup(hub, 0, FastOptions());
  std::vector<NamedTensors> tensors = {MakeLayout(1, false), MakeLayout(1, true)};
  tensors[1][3].second = at::zeros({300'000}, at::kFloat);  // "big" one element short
  std::vector<Status> bcast(2);
  RunRanks(AllRanks(2), [&](int r) {
    EXPECT_TRUE(syncs[r]->Begin(r == 0 ? 1 : kAnyVersion).ok());
    bcast[r] = syncs[r]->Broadcast(tensors[r]);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(bcast[r].code(), StatusCode::kInvalidArgument) << bcast[r].ToString();
  }
  // The same group then carries a good version.
  tensors[1] = MakeLayout(1, true);
  std::vector<Status> commit(2);
  RunRanks(AllRanks(2), [&](int r) {
    EXPECT_TRUE(syncs[r]->Begin(r == 0 ? 2 : kAnyVersion).ok());
    EXPECT_TRUE(syncs[r]->Broadcast(tensors[r]).ok());
    commit[r] = syncs[r]->Commit();
  });
  EXPECT_TRUE(commit[1].ok()) << commit[1].ToString();
  EXPECT_TRUE(BitEqual(tensors[0], tensors[1]));
}

TEST(FakeWeightSync, NonContiguousTensorOnOneRankFailsOnEveryRank) {
  auto hub = std::make_shared<FakeWeightSyncHub>(2);
  auto syncs = MakeFakeGroup(hub, 0, FastOptions());
  std::vector<NamedTensors> tensors = {{{"w", at::ones({4, 3})}}, {{"w", at::zeros({3, 4}).t()}}};
  std::vector<Status> bcast(2);
  RunRanks(AllRanks(2), [&](int r) {
    EXPECT_TRUE(syncs[r]->Begin(r == 0 ? 1 : kAnyVersion).ok());
    bcast[r] = syncs[r]->Broadcast(tensors[r]);
  });
  EXPECT_EQ(bcast[0].code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bcast[1].message().find("not contiguous"), std::string::npos) << bcast[1].ToString();
}

TEST(FakeWeightSync, PeerThatNeverJoinsIsDeadlineExceededAndAbortsTheGroup) {
  auto hub = std::make_shared<FakeWeightSyncHub>(3);
  auto syncs = MakeFakeGroup(hub, 0, FastOptions(300ms));
  std::vector<Status> begin(3);
  const auto start = std::chrono::steady_clock::now();
  RunRanks({0, 1}, [&](int r) { begin[r] = syncs[r]->Begin(r == 0 ? 1 : kAnyVersion); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  // The first rank past its deadline reports DeadlineExceeded and aborts the group; a peer
  // still waiting sees Aborted.
  int deadline_exceeded = 0;
  for (int r : {0, 1}) {
    EXPECT_TRUE(begin[r].code() == StatusCode::kDeadlineExceeded ||
                begin[r].code() == StatusCode::kAborted)
        << begin[r].ToString();
    deadline_exceeded += begin[r].code() == StatusCode::kDeadlineExceeded;
  }
  EXPECT_GE(deadline_exceeded, 1);
  EXPECT_TRUE(syncs[0]->aborted());
  EXPECT_EQ(syncs[0]->Begin(2).code(), StatusCode::kAborted);
}

TEST(FakeWeightSync, AfterAnAbortANewEpochWorks) {
  auto hub = std::make_shared<FakeWeightSyncHub>(2);
  auto old_group = MakeFakeGroup(hub, 0, FastOptions());
  old_group[1]->Abort();
  EXPECT_EQ(old_group[0]->Begin(1).code(), StatusCode::kAborted);  // peers see it at once
  auto group = MakeFakeGroup(hub, 1, FastOptions());
  std::vector<NamedTensors> tensors = {MakeLayout(3, false), MakeLayout(3, true)};
  std::vector<Status> commit(2);
  RunRanks(AllRanks(2), [&](int r) {
    EXPECT_TRUE(group[r]->Begin(r == 0 ? 1 : kAnyVersion).ok());
    EXPECT_TRUE(group[r]->Broadcast(tensors[r]).ok());
    commit[r] = group[r]->Commit();
  });
  EXPECT_TRUE(commit[0].ok() && commit[1].ok());
  EXPECT_EQ(group[1]->epoch(), 1);
  EXPECT_TRUE(BitEqual(tensors[0], tensors[1]));
}

TEST(FakeWeightSync, CallsOutOfOrderAreFailedPreconditionWithoutACollective) {
  auto hub = std::make_shared<FakeWeightSyncHub>(1);
  auto syncs = MakeFakeGroup(hub, 0, FastOptions());
  NamedTensors t = MakeLayout(1, false);
  EXPECT_EQ(syncs[0]->Broadcast(t).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(syncs[0]->Commit().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(syncs[0]->Begin(-3).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(syncs[0]->Begin(0).ok());
  EXPECT_TRUE(syncs[0]->Broadcast(t).ok());
  EXPECT_TRUE(syncs[0]->Commit().ok());
  EXPECT_EQ(syncs[0]->committed_version(), 0);
}

TEST(FakeWeightSync, RejectsARankOutsideTheWorld) {
  auto hub = std::make_shared<FakeWeightSyncHub>(2);
  EXPECT_EQ(CreateFakeWeightSync(hub, 2, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::common
