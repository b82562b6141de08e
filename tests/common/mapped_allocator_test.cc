// MappedCpuAllocator (common/mapped_allocator.h): which pages a block is made of, counted by
// hand for short sequences, and for a long random one that no page is ever in two live blocks
// and that the pages never outnumber the live peak.
#include "common/mapped_allocator.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace grpo::common {
namespace {

constexpr int64_t kMiB = 1 << 20;

class MappedAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    alloc_.Configure(c10::GetDefaultCPUAllocator(), kMiB);
    alloc_.ReleaseKept();
    alloc_.ResetPeaks();
    start_ = alloc_.Stats();
    ASSERT_EQ(start_.live, 0) << "a block of an earlier test is still live";
  }
  // The figures counted from the start of the test.
  int64_t NewBytes() { return alloc_.Stats().new_bytes - start_.new_bytes; }
  int64_t Released() { return alloc_.Stats().released - start_.released; }
  int64_t Exact() { return alloc_.Stats().exact - start_.exact; }
  int64_t Moved() { return alloc_.Stats().moved - start_.moved; }
  int64_t Blocks() { return alloc_.Stats().blocks - start_.blocks; }

  MappedCpuAllocator& alloc_ = MappedCpuAllocator::Get();
  MappedAllocatorStats start_;
};

TEST_F(MappedAllocatorTest, AFreedBlockIsTheNextOneOfItsSizeWithNoNewPage) {
  c10::DataPtr a = alloc_.allocate(4 * kMiB);
  void* const where = a.get();
  EXPECT_EQ(NewBytes(), 4 * kMiB);
  a.clear();
  EXPECT_EQ(alloc_.Stats().kept, 4 * kMiB);
  c10::DataPtr b = alloc_.allocate(4 * kMiB);
  EXPECT_EQ(b.get(), where);
  EXPECT_EQ(NewBytes(), 4 * kMiB);  // nothing more
  EXPECT_EQ(Exact(), 1);
  EXPECT_EQ(alloc_.Stats().kept, 0);
  EXPECT_EQ(alloc_.Stats().live, 4 * kMiB);
}

TEST_F(MappedAllocatorTest, ASmallerBlockIsCutFromAKeptOneAndJoinsItAgainWhenFreed) {
  c10::DataPtr a = alloc_.allocate(8 * kMiB);
  char* const where = static_cast<char*>(a.get());
  a.clear();
  c10::DataPtr b = alloc_.allocate(3 * kMiB);  // the first 3 MiB of the 8
  EXPECT_EQ(b.get(), where);
  EXPECT_EQ(NewBytes(), 8 * kMiB);
  MappedAllocatorStats s = alloc_.Stats();
  EXPECT_EQ(s.kept, 5 * kMiB);
  EXPECT_EQ(s.kept_ranges, 1);
  c10::DataPtr c = alloc_.allocate(5 * kMiB);  // the rest, as it is
  EXPECT_EQ(c.get(), where + 3 * kMiB);
  EXPECT_EQ(Exact(), 1);
  b.clear();
  c.clear();
  s = alloc_.Stats();
  EXPECT_EQ(s.kept, 8 * kMiB);
  EXPECT_EQ(s.kept_ranges, 1);  // one mapping's pages, one range again
  c10::DataPtr d = alloc_.allocate(8 * kMiB);
  EXPECT_EQ(d.get(), where);
  EXPECT_EQ(NewBytes(), 8 * kMiB);
}

TEST_F(MappedAllocatorTest, KeptBlocksTooSmallEachAreMovedSideBySideWithTheirPages) {
  c10::DataPtr a = alloc_.allocate(2 * kMiB);
  c10::DataPtr b = alloc_.allocate(3 * kMiB);
  std::memset(a.get(), 0xAB, 2 * kMiB);
  std::memset(b.get(), 0xCD, 3 * kMiB);
  a.clear();
  b.clear();
  EXPECT_EQ(alloc_.Stats().kept_ranges, 2);  // two mappings: never joined
  c10::DataPtr c = alloc_.allocate(5 * kMiB);
  EXPECT_EQ(NewBytes(), 5 * kMiB);  // the two blocks' pages only
  EXPECT_EQ(Moved(), 1);
  EXPECT_EQ(alloc_.Stats().kept, 0);
  // Moved, not copied or zeroed: the larger range first, then the other.
  const auto* p = static_cast<const unsigned char*>(c.get());
  EXPECT_EQ(p[0], 0xCD);
  EXPECT_EQ(p[3 * kMiB - 1], 0xCD);
  EXPECT_EQ(p[3 * kMiB], 0xAB);
  EXPECT_EQ(p[5 * kMiB - 1], 0xAB);
}

TEST_F(MappedAllocatorTest, ALargerBlockTakesTheKeptPagesThenNewOnesForTheRest) {
  c10::DataPtr a = alloc_.allocate(2 * kMiB);
  a.clear();
  c10::DataPtr b = alloc_.allocate(6 * kMiB);
  EXPECT_EQ(NewBytes(), 2 * kMiB + 4 * kMiB);
  std::memset(b.get(), 1, 6 * kMiB);  // every page of it writable
  const MappedAllocatorStats s = alloc_.Stats();
  EXPECT_EQ(s.kept, 0);
  EXPECT_EQ(s.peak_mapped, 6 * kMiB);
}

TEST_F(MappedAllocatorTest, WhatIsLeftOfACutBelowTheSmallestBlockGoesBackToTheKernel) {
  c10::DataPtr a = alloc_.allocate(5 * kMiB / 2);
  a.clear();
  c10::DataPtr b = alloc_.allocate(2 * kMiB);
  EXPECT_EQ(Released(), kMiB / 2);
  EXPECT_EQ(alloc_.Stats().kept, 0);
  EXPECT_EQ(alloc_.Stats().kept_ranges, 0);
}

TEST_F(MappedAllocatorTest, SmallBlocksAreTheWrappedAllocatorsAndReleaseEmptiesWhatIsKept) {
  c10::DataPtr small = alloc_.allocate(kMiB - 1);
  EXPECT_NE(small.get(), nullptr);
  EXPECT_EQ(Blocks(), 0);
  // raw_allocate / raw_deallocate: the raw deleter frees a small block too.
  void* raw = alloc_.raw_allocate(4096);
  alloc_.raw_deallocate(raw);
  c10::DataPtr big = alloc_.allocate(kMiB);
  EXPECT_EQ(Blocks(), 1);
  big.clear();
  EXPECT_EQ(alloc_.Stats().kept, kMiB);
  alloc_.ReleaseKept();
  EXPECT_EQ(alloc_.Stats().kept, 0);
  EXPECT_EQ(Released(), kMiB);
}

// Blocks of random sizes allocated and freed in a random order: every live block keeps the
// byte it was filled with (no page of it is in another block), `live` is the sum of the live
// blocks' pages, and the pages mapped never pass the most that were live at once.
void RandomBlocks(MappedCpuAllocator& alloc, uint32_t seed, int steps, int64_t* peak_live) {
  std::mt19937 rng(seed);
  const int64_t page = static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  struct Block {
    c10::DataPtr ptr;
    int64_t bytes;
    unsigned char fill;
  };
  std::vector<Block> live;
  int64_t live_bytes = 0;
  auto check = [](const Block& b) {
    const auto* p = static_cast<const unsigned char*>(b.ptr.get());
    for (int64_t off = 0; off < b.bytes; off += 4096) ASSERT_EQ(p[off], b.fill);
    ASSERT_EQ(p[b.bytes - 1], b.fill);
  };
  for (int i = 0; i < steps; ++i) {
    if (live.size() < 12 && (live.empty() || rng() % 3 != 0)) {
      // 1 MiB to 24 MiB, not whole pages.
      const int64_t bytes = kMiB + static_cast<int64_t>(rng() % (23 * kMiB));
      Block b{alloc.allocate(static_cast<size_t>(bytes)), bytes,
              static_cast<unsigned char>(rng() % 251 + 1)};
      std::memset(b.ptr.get(), b.fill, static_cast<size_t>(bytes));
      live_bytes += (bytes + page - 1) / page * page;
      *peak_live = std::max(*peak_live, live_bytes);
      live.push_back(std::move(b));
    } else {
      const size_t k = rng() % live.size();
      check(live[k]);
      live_bytes -= (live[k].bytes + page - 1) / page * page;
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  for (const Block& b : live) check(b);
}

TEST_F(MappedAllocatorTest, RandomBlocksNeverShareAPageAndNeverMapMoreThanTheLivePeak) {
  int64_t peak_live = 0;
  RandomBlocks(alloc_, 7, 3000, &peak_live);
  const MappedAllocatorStats s = alloc_.Stats();
  EXPECT_EQ(s.live, 0);
  EXPECT_EQ(s.peak_live, peak_live);
  EXPECT_LE(s.peak_mapped, peak_live);
  EXPECT_LE(NewBytes() - Released(), peak_live);  // what is mapped now: the kept pages
  EXPECT_GT(Moved(), 0) << "the sequence never made a block of several ranges";
  EXPECT_GT(Exact(), 0);
}

TEST_F(MappedAllocatorTest, TwoThreadsAllocatingAtOnceNeverShareAPage) {
  int64_t peaks[2] = {0, 0};
  std::thread a([&] { RandomBlocks(alloc_, 11, 1500, &peaks[0]); });
  std::thread b([&] { RandomBlocks(alloc_, 12, 1500, &peaks[1]); });
  a.join();
  b.join();
  const MappedAllocatorStats s = alloc_.Stats();
  EXPECT_EQ(s.live, 0);
  EXPECT_LE(s.peak_mapped, s.peak_live);
  EXPECT_LE(s.peak_live, peaks[0] + peaks[1]);
}

// As libtorch's CPU allocator: tensors of it compute what they compute with the default one.
TEST_F(MappedAllocatorTest, TensorsOnItComputeAsOnTheDefaultAllocator) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({512, 1024});
  const at::Tensor w = at::randn({1024, 768});
  const at::Tensor expected = at::matmul(x, w).relu().sum(0);
  c10::Allocator* const before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&alloc_, /*priority=*/100);
  at::Tensor got;
  {
    const at::Tensor x2 = x.clone();  // 2 MiB: mapped
    got = at::matmul(x2, w).relu().sum(0);
  }
  c10::SetCPUAllocator(before, /*priority=*/101);
  EXPECT_GE(Blocks(), 2);  // the clone, the product
  EXPECT_TRUE(at::allclose(got, expected, 1e-6, 1e-5));
}

}  // namespace
}  // namespace grpo::common
