// Which malloc this process runs: tcmalloc in the `grpo` binary (CMakeLists.txt GRPO_MALLOC),
// glibc's in the tests and in a GRPO_MALLOC=system build. The resident set above the live
// tensor bytes is the allocator's (README "Know before you launch"), so the benchmarks that
// report a resident set name it beside.
#pragma once

#include <cstdint>
#include <string>

namespace grpo::common {

// The malloc every library of the process binds to: "tcmalloc" (gperftools), "glibc",
// "jemalloc", or the file name of the library that defines it.
std::string MallocName();

// The bytes the program holds from malloc, and the bytes the malloc holds free in memory it has
// not given back to the kernel (most of it resident); -1 each when unknown. tcmalloc:
// generic.current_allocated_bytes, and generic.heap_size less that and the pages it unmapped
// (tcmalloc.pageheap_unmapped_bytes). glibc: mallinfo2's bytes in use (arenas and mmapped
// chunks) and its free bytes in the arenas. Takes the malloc's locks briefly: for a scrape, not
// a hot path.
struct MallocBytes {
  int64_t allocated = -1;
  int64_t free = -1;
};
MallocBytes ReadMallocBytes();

// A CPU allocator beside the malloc (common/mapped_allocator.h) whose blocks ReadMallocBytes adds
// in: its live bytes to `allocated`, the pages it keeps for reuse to `free`. One per process.
void SetAllocatorBytesReader(MallocBytes (*read)());
// libtorch's CPU allocator in this process: "mapped" once InstallMappedCpuAllocator has set the
// reader above (grpo-torch), else "malloc" (libtorch's own, over the malloc).
std::string CpuAllocatorName();

// Gives the free memory the malloc keeps back to the kernel (tcmalloc's ReleaseFreeMemory,
// glibc's malloc_trim), so that what the next allocations take shows in the resident set
// again: the benchmarks that read a step's peak resident set (VmHWM) start it from here. Without
// it tcmalloc hands a step the pages the previous step freed and the peak reads ~0.
void ReleaseFreeMemory();

// What ReleaseFreeMemory also runs first: the releaser of the blocks a CPU allocator keeps
// beside the malloc (common/mapped_allocator.h). One per process.
void SetFreeMemoryReleaser(void (*release)());

}  // namespace grpo::common
