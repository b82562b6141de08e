#include "common/mapped_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "common/malloc_info.h"

namespace grpo::common {

namespace {

int64_t PageRound(int64_t n) {
  static const int64_t page = static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

}  // namespace

MappedCpuAllocator& MappedCpuAllocator::Get() {
  // Never destroyed: a tensor may be freed during the process's end.
  static MappedCpuAllocator* const allocator = new MappedCpuAllocator();
  return *allocator;
}

void MappedCpuAllocator::Configure(c10::Allocator* small, int64_t min_bytes) {
  small_ = small;
  min_bytes_ = std::max<int64_t>(min_bytes, 1);
}

void MappedCpuAllocator::Cut(std::multimap<int64_t, char*>::iterator it, int64_t want,
                             std::vector<Range>* taken) {
  Range r = Unkeep(it);
  if (r.bytes > want) {  // the rest stays kept: the same mapping's
    Keep(Range{r.addr + want, r.bytes - want, r.origin});
    r.bytes = want;
  }
  taken->push_back(r);
}

std::vector<MappedCpuAllocator::Range> MappedCpuAllocator::TakeKept(int64_t bytes, bool* exact) {
  std::vector<Range> taken;
  // One range that holds it: the same size, or the smallest larger one, cut.
  auto fit = kept_.lower_bound(bytes);
  if (fit != kept_.end()) {
    *exact = fit->first == bytes;
    Cut(fit, bytes, &taken);
    return taken;
  }
  // Every kept range is smaller: the largest first, until it is made up or none is left.
  int64_t need = bytes;
  while (need > 0 && !kept_.empty()) {
    auto largest = std::prev(kept_.end());
    const int64_t take = std::min(need, largest->first);
    Cut(largest, take, &taken);
    need -= take;
  }
  return taken;
}

void MappedCpuAllocator::Join(std::map<char*, Range>::iterator at, Range* r) {
  auto [first, last] = kept_.equal_range(at->second.bytes);
  for (auto it = first; it != last; ++it) {
    if (it->second == at->first) {
      kept_.erase(it);
      break;
    }
  }
  r->addr = std::min(r->addr, at->first);
  r->bytes += at->second.bytes;
  kept_at_.erase(at);
}

void MappedCpuAllocator::Keep(Range r) {
  stats_.kept += r.bytes;
  auto next = kept_at_.find(r.addr + r.bytes);
  if (next != kept_at_.end() && next->second.origin == r.origin) Join(next, &r);
  auto after = kept_at_.lower_bound(r.addr);
  if (after != kept_at_.begin()) {
    auto prev = std::prev(after);
    if (prev->second.origin == r.origin && prev->first + prev->second.bytes == r.addr) {
      Join(prev, &r);
    }
  }
  if (r.bytes < min_bytes_) {
    stats_.kept -= r.bytes;
    stats_.released += r.bytes;
    released_.push_back(r);
    return;
  }
  kept_.emplace(r.bytes, r.addr);
  kept_at_.emplace(r.addr, r);
}

MappedCpuAllocator::Range MappedCpuAllocator::Unkeep(std::multimap<int64_t, char*>::iterator it) {
  auto at = kept_at_.find(it->second);
  const Range r = at->second;
  kept_at_.erase(at);
  kept_.erase(it);
  stats_.kept -= r.bytes;
  return r;
}

void MappedCpuAllocator::TrimKept() {
  while (static_cast<int64_t>(kept_.size()) > kMappedMaxKeptRanges) {
    released_.push_back(Unkeep(kept_.begin()));
    stats_.released += released_.back().bytes;
  }
}

void MappedCpuAllocator::Unmap(const std::vector<Range>& ranges) {
  for (const Range& r : ranges) ::munmap(r.addr, static_cast<size_t>(r.bytes));
}

std::vector<MappedCpuAllocator::Range> MappedCpuAllocator::Assemble(std::vector<Range> ranges,
                                                                    int64_t bytes) {
  int64_t have = 0;
  for (const Range& r : ranges) have += r.bytes;
  if (ranges.size() == 1 && have == bytes) return ranges;
  if (ranges.size() == 1) {  // grown where it is, or moved: new pages after its own
    void* grown = ::mremap(ranges[0].addr, static_cast<size_t>(have), static_cast<size_t>(bytes),
                           MREMAP_MAYMOVE);
    if (grown == MAP_FAILED) {
      ::munmap(ranges[0].addr, static_cast<size_t>(have));
      return {};
    }
    return {Range{static_cast<char*>(grown), bytes, 0}};
  }
  // The block's address space: new pages (untouched, so not resident) that the kept ranges
  // then replace from its start; what they do not cover stays new.
  void* dest = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  std::vector<Range> out;
  if (dest == MAP_FAILED) {
    for (const Range& r : ranges) ::munmap(r.addr, static_cast<size_t>(r.bytes));
    return out;
  }
  char* at = static_cast<char*>(dest);
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    void* moved = ::mremap(r.addr, static_cast<size_t>(r.bytes), static_cast<size_t>(r.bytes),
                           MREMAP_MAYMOVE | MREMAP_FIXED, at);
    if (moved == MAP_FAILED) {
      for (size_t j = i; j < ranges.size(); ++j) {
        ::munmap(ranges[j].addr, static_cast<size_t>(ranges[j].bytes));
      }
      ::munmap(dest, static_cast<size_t>(bytes));
      return {};
    }
    out.push_back(Range{at, r.bytes, 0});
    at += r.bytes;
  }
  if (have < bytes) out.push_back(Range{at, bytes - have, 0});
  return out;
}

c10::DataPtr MappedCpuAllocator::allocate(size_t n) {
  if (static_cast<int64_t>(n) < min_bytes_) {
    TORCH_CHECK(small_ != nullptr, "MappedCpuAllocator: not configured");
    return small_->allocate(n);
  }
  const int64_t bytes = PageRound(static_cast<int64_t>(n));
  std::vector<Range> ranges, released;
  int64_t have = 0;
  {
    MutexLock lock(&mu_);
    stats_.live += bytes;
    stats_.peak_live = std::max(stats_.peak_live, stats_.live);
    ++stats_.blocks;
    bool exact = false;
    ranges = TakeKept(bytes, &exact);
    for (const Range& r : ranges) have += r.bytes;
    stats_.new_bytes += bytes - have;
    if (exact) ++stats_.exact;
    if (ranges.size() > 1) ++stats_.moved;
    stats_.peak_mapped = std::max(stats_.peak_mapped, stats_.live + stats_.kept);
    released.swap(released_);
  }
  Unmap(released);
  std::vector<Range> block;
  if (ranges.empty()) {
    void* p = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) block.push_back(Range{static_cast<char*>(p), bytes, 0});
  } else {
    block = Assemble(std::move(ranges), bytes);
  }
  const int error = errno;
  MutexLock lock(&mu_);
  if (block.empty()) {
    // What it took of the kept ranges is unmapped (Assemble gave it back).
    stats_.live -= bytes;
    stats_.released += have;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "MappedCpuAllocator: cannot map ", bytes,
                     " bytes: ", std::strerror(error));
  }
  for (Range& r : block) {
    if (r.origin == 0) r.origin = next_origin_++;  // a mapping of its own (mmap, mremap)
  }
  void* data = block.front().addr;
  handed_.emplace(data, std::move(block));
  return {data, data, &Free, c10::Device(c10::DeviceType::CPU)};
}

void MappedCpuAllocator::Free(void* data) {
  if (data == nullptr) return;
  MappedCpuAllocator& self = Get();
  bool mapped = false;
  std::vector<Range> released;
  {
    MutexLock lock(&self.mu_);
    auto it = self.handed_.find(data);
    if (it != self.handed_.end()) {
      for (const Range& r : it->second) {
        self.stats_.live -= r.bytes;
        self.Keep(r);
      }
      self.handed_.erase(it);
      self.TrimKept();
      released.swap(self.released_);
      mapped = true;
    }
  }
  if (mapped) {
    Unmap(released);
  } else {  // a small block, freed through raw_deleter (raw_allocate / raw_deallocate)
    self.small_->raw_deleter()(data);
  }
}

MappedAllocatorStats MappedCpuAllocator::Stats() {
  MutexLock lock(&mu_);
  MappedAllocatorStats s = stats_;
  s.kept_ranges = static_cast<int64_t>(kept_.size());
  return s;
}

void MappedCpuAllocator::ResetPeaks() {
  MutexLock lock(&mu_);
  stats_.peak_live = stats_.live;
  stats_.peak_mapped = stats_.live + stats_.kept;
}

void MappedCpuAllocator::ReleaseKept() {
  std::multimap<int64_t, char*> kept;
  {
    MutexLock lock(&mu_);
    kept.swap(kept_);
    kept_at_.clear();
    stats_.released += stats_.kept;
    stats_.kept = 0;
  }
  for (const auto& [bytes, addr] : kept) ::munmap(addr, static_cast<size_t>(bytes));
}

bool InstallMappedCpuAllocator() {
  const char* choice = std::getenv("GRPO_CPU_ALLOCATOR");
  if (choice != nullptr && std::string(choice) == "malloc") return false;
  MappedCpuAllocator& mapped = MappedCpuAllocator::Get();
  mapped.Configure(c10::GetCPUAllocator(), kMappedMinBytes);
  c10::SetCPUAllocator(&mapped, /*priority=*/0);
  SetFreeMemoryReleaser([] { MappedCpuAllocator::Get().ReleaseKept(); });
  SetAllocatorBytesReader([] {
    const MappedAllocatorStats s = MappedCpuAllocator::Get().Stats();
    return MallocBytes{s.live, s.kept};
  });
  return true;
}

}  // namespace grpo::common
