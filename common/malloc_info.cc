#include "common/malloc_info.h"

#include <dlfcn.h>

#include <cstring>

namespace grpo::common {

std::string MallocName() {
  // The library that defines the malloc every library binds to (the first in the global scope:
  // LD_PRELOAD's, then the binary's own libraries in link order, glibc last).
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

}  // namespace grpo::common
