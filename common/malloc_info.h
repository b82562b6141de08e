// Which malloc this process runs: tcmalloc in the `grpo` binary (CMakeLists.txt GRPO_MALLOC),
// glibc's in the tests and in a GRPO_MALLOC=system build. The resident set above the live
// tensor bytes is the allocator's (README "Know before you launch"), so the benchmarks that
// report a resident set name it beside.
#pragma once

#include <string>

namespace grpo::common {

// The malloc every library of the process binds to: "tcmalloc" (gperftools), "glibc",
// "jemalloc", or the file name of the library that defines it.
std::string MallocName();

}  // namespace grpo::common
