#include "common/malloc_info.h"

#include <dlfcn.h>
#include <malloc.h>

#include <atomic>
#include <cstddef>
#include <cstring>

namespace grpo::common {

namespace {

// The library that defines the malloc every library binds to (the first in the global scope:
// LD_PRELOAD's, then the binary's own libraries in link order, glibc last).
std::string BoundMalloc() {
  Dl_info info{};
  void* const bound = dlsym(RTLD_DEFAULT, "malloc");
  if (bound == nullptr || dladdr(bound, &info) == 0 || info.dli_fname == nullptr) return "unknown";
  const char* slash = std::strrchr(info.dli_fname, '/');
  const std::string file = slash != nullptr ? slash + 1 : info.dli_fname;
  if (file.rfind("libtcmalloc", 0) == 0) return "tcmalloc";
  if (file.rfind("libc.so", 0) == 0) return "glibc";
  if (file.rfind("libjemalloc", 0) == 0) return "jemalloc";
  return file;
}

}  // namespace

std::string MallocName() {
  // Fixed once the process has started: looked up once.
  static const std::string name = BoundMalloc();
  return name;
}

namespace {

// The malloc's own figures.
MallocBytes ReadMallocOwnBytes() {
  MallocBytes bytes;
  const std::string name = MallocName();
  if (name == "tcmalloc") {
    // gperftools' C API, looked up so that nothing but the grpo binary links tcmalloc.
    using Property = int (*)(const char*, size_t*);
    const auto get =
        reinterpret_cast<Property>(dlsym(RTLD_DEFAULT, "MallocExtension_GetNumericProperty"));
    size_t allocated = 0, heap = 0, unmapped = 0;
    if (get != nullptr && get("generic.current_allocated_bytes", &allocated) != 0 &&
        get("generic.heap_size", &heap) != 0 &&
        get("tcmalloc.pageheap_unmapped_bytes", &unmapped) != 0) {
      bytes.allocated = static_cast<int64_t>(allocated);
      bytes.free = static_cast<int64_t>(heap) - static_cast<int64_t>(allocated) -
                   static_cast<int64_t>(unmapped);
    }
  } else if (name == "glibc") {
    const struct mallinfo2 info = mallinfo2();
    bytes.allocated = static_cast<int64_t>(info.uordblks + info.hblkhd);
    bytes.free = static_cast<int64_t>(info.fordblks);
  }
  return bytes;
}

std::atomic<MallocBytes (*)()> allocator_reader{nullptr};
std::atomic<void (*)()> releaser{nullptr};

}  // namespace

void SetAllocatorBytesReader(MallocBytes (*read)()) { allocator_reader = read; }

std::string CpuAllocatorName() { return allocator_reader.load() != nullptr ? "mapped" : "malloc"; }

MallocBytes ReadMallocBytes() {
  MallocBytes bytes = ReadMallocOwnBytes();
  if (auto* read = allocator_reader.load(); read != nullptr && bytes.allocated >= 0) {
    const MallocBytes more = read();
    bytes.allocated += more.allocated;
    bytes.free += more.free;
  }
  return bytes;
}

void SetFreeMemoryReleaser(void (*release)()) { releaser = release; }

void ReleaseFreeMemory() {
  if (auto* release = releaser.load(); release != nullptr) release();
  const std::string name = MallocName();
  if (name == "tcmalloc") {
    using Release = void (*)();
    const auto release =
        reinterpret_cast<Release>(dlsym(RTLD_DEFAULT, "MallocExtension_ReleaseFreeMemory"));
    if (release != nullptr) release();
  } else if (name == "glibc") {
    malloc_trim(0);
  }
}

}  // namespace grpo::common
