// common/metrics/process_metrics.h: each series against what the test did to the process (memory
// touched, CPU burned as the kernel's per-process clock counts it, files opened, a limit set),
// not against the /proc fields the code reads.
#include "common/metrics/process_metrics.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sstream>
#include <string>
#include <vector>

#include "common/malloc_info.h"
#include "common/metrics/metrics.h"

namespace grpo::common {
namespace {

// The value of the series `name` (no labels) in a scrape; NaN when absent.
double Sample(const Registry& registry, const std::string& name) {
  std::istringstream in(registry.Expose());
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  return std::nan("");
}

double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

constexpr double kMiB = 1024.0 * 1024.0;

// Under a sanitizer its runtime is the malloc (tests/sanitize/run.py), which has no statistics
// these read.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerMalloc = true;
#else
constexpr bool kSanitizerMalloc = false;
#endif

TEST(ProcessMetrics, ExposesTheStandardFamiliesOnceAndTypesThem) {
  Registry registry;
  ASSERT_TRUE(AddProcessMetrics(&registry).ok());
  const std::string text = registry.Expose();
  for (const char* family :
       {"# TYPE process_cpu_seconds_total counter", "# TYPE process_resident_memory_bytes gauge",
        "# TYPE process_virtual_memory_bytes gauge", "# TYPE process_open_fds gauge",
        "# TYPE process_max_fds gauge", "# TYPE process_start_time_seconds gauge",
        "# TYPE grpo_malloc_allocated_bytes gauge", "# TYPE grpo_malloc_free_bytes gauge"}) {
    EXPECT_NE(text.find(family), std::string::npos) << family << "\n" << text;
  }
  EXPECT_EQ(AddProcessMetrics(&registry).code(), StatusCode::kAlreadyExists);
}

TEST(ProcessMetrics, ResidentAndMallocBytesFollowMemoryTheTestTouches) {
  if (kSanitizerMalloc) GTEST_SKIP() << "the sanitizer's malloc";
  Registry registry;
  ASSERT_TRUE(AddProcessMetrics(&registry).ok());
  const double resident0 = Sample(registry, "process_resident_memory_bytes");
  const double allocated0 = Sample(registry, "grpo_malloc_allocated_bytes");
  constexpr size_t kBytes = 96 << 20;
  char* block = static_cast<char*>(std::malloc(kBytes));
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, kBytes);  // every page resident
  const double resident1 = Sample(registry, "process_resident_memory_bytes");
  const double allocated1 = Sample(registry, "grpo_malloc_allocated_bytes");
  EXPECT_GE(resident1 - resident0, 95 * kMiB) << resident0 << " -> " << resident1;
  EXPECT_LE(resident1 - resident0, 120 * kMiB) << resident0 << " -> " << resident1;
  EXPECT_GE(allocated1 - allocated0, 96 * kMiB) << allocated0 << " -> " << allocated1;
  EXPECT_LE(allocated1 - allocated0, 100 * kMiB) << allocated0 << " -> " << allocated1;
  std::free(block);
  const double allocated2 = Sample(registry, "grpo_malloc_allocated_bytes");
  EXPECT_LE(allocated2, allocated1 - 95 * kMiB) << allocated1 << " -> " << allocated2;
  EXPECT_GE(Sample(registry, "grpo_malloc_free_bytes"), 0);
}

TEST(ProcessMetrics, VirtualMemoryCountsAReservationThatIsNotResident) {
  Registry registry;
  ASSERT_TRUE(AddProcessMetrics(&registry).ok());
  const double virtual0 = Sample(registry, "process_virtual_memory_bytes");
  const double resident0 = Sample(registry, "process_resident_memory_bytes");
  constexpr size_t kBytes = size_t{1} << 30;
  void* p = mmap(nullptr, kBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_GE(Sample(registry, "process_virtual_memory_bytes") - virtual0, 1024 * kMiB);
  EXPECT_LT(Sample(registry, "process_resident_memory_bytes") - resident0, 16 * kMiB);
  munmap(p, kBytes);
}

TEST(ProcessMetrics, CpuSecondsCountWhatTheKernelsProcessClockCounts) {
  Registry registry;
  ASSERT_TRUE(AddProcessMetrics(&registry).ok());
  const double counted0 = Sample(registry, "process_cpu_seconds_total");
  const double clock0 = ProcessCpuSeconds();
  // Half in user code, half in the kernel (copying /dev/zero's bytes): both count.
  volatile double sink = 0;
  while (ProcessCpuSeconds() - clock0 < 0.25) {
    for (int i = 0; i < 100000; ++i) sink = sink + i * 0.5;
  }
  const int zero = open("/dev/zero", O_RDONLY);
  ASSERT_GE(zero, 0);
  std::vector<char> buffer(1 << 20);
  while (ProcessCpuSeconds() - clock0 < 0.5) {
    ASSERT_EQ(read(zero, buffer.data(), buffer.size()), static_cast<ssize_t>(buffer.size()));
  }
  close(zero);
  const double counted1 = Sample(registry, "process_cpu_seconds_total");
  const double clock1 = ProcessCpuSeconds();
  // /proc/self/stat counts in clock ticks (10 ms): within two ticks of the process clock over
  // the same span, which the scrapes bracket.
  EXPECT_GE(counted1 - counted0, (clock1 - clock0) - 0.1) << counted0 << " -> " << counted1;
  EXPECT_LE(counted1 - counted0, (clock1 - clock0) + 0.1) << counted0 << " -> " << counted1;
  // A counter: a second registry of the same process starts at the process's whole CPU time.
  Registry other;
  ASSERT_TRUE(AddProcessMetrics(&other).ok());
  EXPECT_GE(Sample(other, "process_cpu_seconds_total"), clock0 - 0.1);
}

TEST(ProcessMetrics, OpenFdsCountFilesTheTestOpensAndMaxFdsIsTheLimitItSets) {
  Registry registry;
  ASSERT_TRUE(AddProcessMetrics(&registry).ok());
  const double open0 = Sample(registry, "process_open_fds");
  // The descriptors open, counted by asking the kernel about each number (no thread of this
  // test opens one meanwhile).
  int valid = 0;
  for (int fd = 0; fd < 65536; ++fd) valid += fcntl(fd, F_GETFD) != -1 ? 1 : 0;
  EXPECT_EQ(open0, valid);
  std::vector<int> fds;
  for (int i = 0; i < 16; ++i) fds.push_back(open("/dev/null", O_RDONLY));
  EXPECT_EQ(Sample(registry, "process_open_fds") - open0, 16);
  for (int fd : fds) close(fd);
  EXPECT_EQ(Sample(registry, "process_open_fds"), open0);

  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lower = saved;
  lower.rlim_cur = 777;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lower), 0);
  EXPECT_EQ(Sample(registry, "process_max_fds"), 777);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
}

TEST(ProcessMetrics, StartTimeIsWhenThisProcessBegan) {
  Registry registry;
  ASSERT_TRUE(AddProcessMetrics(&registry).ok());
  const double start = Sample(registry, "process_start_time_seconds");
  const double now = static_cast<double>(std::time(nullptr));
  // The test process began before this test and, run by ctest, within its timeout.
  EXPECT_LE(start, now + 1);
  EXPECT_GE(start, now - 1800);
}

TEST(ProcessMetrics, TheTestBinaryRunsGlibcsMalloc) {
  if (kSanitizerMalloc) GTEST_SKIP() << "the sanitizer's malloc";
  // The tests link no tcmalloc (CMakeLists.txt GRPO_MALLOC): the malloc figures above are
  // glibc's (mallinfo2); the grpo binary's tcmalloc figures are checked through a worker's
  // /metrics (cli_tools_test).
  EXPECT_EQ(MallocName(), "glibc");
}

}  // namespace
}  // namespace grpo::common
