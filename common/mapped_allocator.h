// MappedCpuAllocator: libtorch's CPU allocator in `grpo-torch` (README "Know before you launch",
// the resident set). Blocks of at least kMappedMinBytes are anonymous mappings that it keeps
// when they are freed, and a new block is made of the pages kept before any new page is
// taken: a kept range that fits is cut to size, and ranges that are too small are moved side by
// side (mremap: the kernel moves the pages, nothing is copied or zeroed). So the pages of the
// large blocks never outnumber the most that were live at once, whatever the order of the
// sizes; a malloc keeps a freed block where it was, and one too small for the next request
// stays resident beside the new pages taken for it (tcmalloc's heap grew 12-88 MiB above the
// live peak of `grpo bench sharding`'s rows, the order of the allocations deciding how much).
// Smaller blocks go to the allocator it wraps (libtorch's default: malloc).
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "common/mutex.h"

namespace grpo::common {

// tcmalloc's page heap's: it serves blocks from 256 KiB from spans of pages (smaller ones from
// size classes, where a freed block is the next of its class).
inline constexpr int64_t kMappedMinBytes = 256ll << 10;
// Kept ranges beyond this many are given back, the smallest first: each is a mapping of the
// process's (at most vm.max_map_count, 65530 by default).
inline constexpr int64_t kMappedMaxKeptRanges = 4096;

struct MappedAllocatorStats {
  int64_t live = 0;         // bytes of the blocks handed out and not freed (whole pages)
  int64_t kept = 0;         // bytes of freed blocks' pages kept for the next blocks
  int64_t kept_ranges = 0;  // how many ranges they are in
  int64_t peak_live = 0;    // the most `live` has been since the start or ResetPeaks
  int64_t peak_mapped = 0;  // the most `live + kept` has been (never above the highest
                            // peak_live: pages are taken anew only when none are kept)
  int64_t new_bytes = 0;    // bytes of new pages, from the start (each page a fault when touched)
  int64_t released = 0;     // bytes given back to the kernel, from the start
  int64_t blocks = 0;       // blocks handed out, from the start
  int64_t exact = 0;        // of them, a kept range of the same size, as it was
  int64_t moved = 0;        // of them, made of several ranges moved side by side
};

class MappedCpuAllocator final : public c10::Allocator {
 public:
  // The process's one instance (its deleter finds it from any block).
  static MappedCpuAllocator& Get();
  // Blocks smaller than `min_bytes` from `small`. Before the first allocation.
  void Configure(c10::Allocator* small, int64_t min_bytes);

  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  MappedAllocatorStats Stats();
  // From now on, peak_live and peak_mapped are the current figures.
  void ResetPeaks();
  // Gives every kept range back to the kernel (common::ReleaseFreeMemory calls it).
  void ReleaseKept();

 private:
  // A page range inside one mapping (the kernel's mremap moves no range across two).
  struct Range {
    char* addr = nullptr;
    int64_t bytes = 0;
    // Ranges of one origin are parts of the mapping it was made as (one mmap or mremap), so two
    // that touch are one mapping's pages and are kept as one; 0: not named yet.
    uint64_t origin = 0;
  };
  MappedCpuAllocator() = default;
  static void Free(void* data);
  // Takes `bytes` of kept ranges, or as many as there are: the ranges to move side by side, in
  // order. Sets `*exact` when one kept range had the size.
  std::vector<Range> TakeKept(int64_t bytes, bool* exact) GRPO_REQUIRES(mu_);
  // Takes the kept range `it` out, its first `want` bytes into `taken`, the rest kept.
  void Cut(std::multimap<int64_t, char*>::iterator it, int64_t want, std::vector<Range>* taken)
      GRPO_REQUIRES(mu_);
  // Joins the kept range `at` (of r's origin, touching it) into `r`, out of the kept ones.
  void Join(std::map<char*, Range>::iterator at, Range* r) GRPO_REQUIRES(mu_);
  // Keeps `r`, joined with the kept ranges of its origin it touches; one still smaller than
  // min_bytes_ (what is left of a range cut to size) goes back to the kernel instead: the kept
  // ranges stay few, and a block is made of a few moves.
  void Keep(Range r) GRPO_REQUIRES(mu_);
  // Takes a kept range out (by its entry in kept_).
  Range Unkeep(std::multimap<int64_t, char*>::iterator it) GRPO_REQUIRES(mu_);
  // Moves the smallest kept ranges beyond kMappedMaxKeptRanges to `released_`.
  void TrimKept() GRPO_REQUIRES(mu_);
  // Unmaps what a locked section took out of `released_`, after the lock.
  static void Unmap(const std::vector<Range>& ranges);
  // Makes one block of `bytes` from `ranges`: one of its size as it is; one smaller grown in
  // place or moved by mremap, new pages after its own; several moved side by side into a new
  // mapping, new pages after them. Its ranges, the first at the block's address; none (the
  // ranges unmapped) when the kernel refused. Outside the lock.
  static std::vector<Range> Assemble(std::vector<Range> ranges, int64_t bytes);

  Mutex mu_;
  c10::Allocator* small_ = nullptr;
  int64_t min_bytes_ = kMappedMinBytes;
  // The blocks handed out: each one's ranges.
  std::unordered_map<void*, std::vector<Range>> handed_ GRPO_GUARDED_BY(mu_);
  // The kept ranges, by size and by address.
  std::multimap<int64_t, char*> kept_ GRPO_GUARDED_BY(mu_);
  std::map<char*, Range> kept_at_ GRPO_GUARDED_BY(mu_);
  uint64_t next_origin_ GRPO_GUARDED_BY(mu_) = 1;
  // To unmap: the section that put them there takes them out before it unlocks.
  std::vector<Range> released_ GRPO_GUARDED_BY(mu_);
  MappedAllocatorStats stats_ GRPO_GUARDED_BY(mu_);
};

// Makes MappedCpuAllocator libtorch's CPU allocator, over the one installed, unless the
// environment says GRPO_CPU_ALLOCATOR=malloc; common::CpuAllocatorName then says "mapped", and
// common::ReadMallocBytes and ReleaseFreeMemory count and release its pages with the malloc's.
// Returns whether it did. Before any tensor.
bool InstallMappedCpuAllocator();

}  // namespace grpo::common
