#include "common/metrics/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/malloc_info.h"
#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace grpo::common {
namespace {

struct ProcStat {
  double cpu_seconds = -1;    // user + system
  double start_seconds = -1;  // since boot
  double virtual_bytes = -1, resident_bytes = -1;
};

// /proc/self/stat (proc(5)): the fields after the command's closing parenthesis (the command
// may hold spaces and parentheses), from field 3 on.
ProcStat ReadProcStat() {
  ProcStat out;
  std::ifstream f("/proc/self/stat");
  std::string line;
  if (!std::getline(f, line)) return out;
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return out;
  std::istringstream in(line.substr(close + 1));
  std::vector<std::string> fields;  // fields[0] is field 3 (state)
  for (std::string w; in >> w;) fields.push_back(w);
  if (fields.size() < 22) return out;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  // utime 14, stime 15, starttime 22, vsize 23, rss 24 (pages).
  out.cpu_seconds = (std::stod(fields[11]) + std::stod(fields[12])) / tick;
  out.start_seconds = std::stod(fields[19]) / tick;
  out.virtual_bytes = std::stod(fields[20]);
  out.resident_bytes = std::stod(fields[21]) * page;
  return out;
}

// The boot time, seconds since the epoch (/proc/stat "btime"); -1 when absent.
double BootTime() {
  std::ifstream f("/proc/stat");
  for (std::string key; f >> key;) {
    if (key == "btime") {
      double t = -1;
      f >> t;
      return t;
    }
    std::string rest;
    std::getline(f, rest);
  }
  return -1;
}

// Descriptors open now, not counting the one that lists them.
double OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int64_t n = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return static_cast<double>(n - 1);
}

struct Families {
  Counter* cpu = nullptr;
  Gauge* resident = nullptr;
  Gauge* virtual_memory = nullptr;
  Gauge* open_fds = nullptr;
  Gauge* max_fds = nullptr;
  Gauge* start_time = nullptr;
  Gauge* malloc_allocated = nullptr;
  Gauge* malloc_free = nullptr;
  Mutex mu;  // concurrent scrapes: the counter takes each CPU second once
  double cpu_counted GRPO_GUARDED_BY(mu) = 0;
};

void Refresh(Families* f) {
  const ProcStat stat = ReadProcStat();
  if (stat.cpu_seconds >= 0) {
    MutexLock lock(&f->mu);
    if (stat.cpu_seconds > f->cpu_counted) {
      f->cpu->Increment(stat.cpu_seconds - f->cpu_counted);
      f->cpu_counted = stat.cpu_seconds;
    }
  }
  if (stat.resident_bytes >= 0) f->resident->Set(stat.resident_bytes);
  if (stat.virtual_bytes >= 0) f->virtual_memory->Set(stat.virtual_bytes);
  if (const double fds = OpenFds(); fds >= 0) f->open_fds->Set(fds);
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    f->max_fds->Set(limit.rlim_cur == RLIM_INFINITY ? -1 : static_cast<double>(limit.rlim_cur));
  }
  const MallocBytes bytes = ReadMallocBytes();
  if (bytes.allocated >= 0) f->malloc_allocated->Set(static_cast<double>(bytes.allocated));
  if (bytes.free >= 0) f->malloc_free->Set(static_cast<double>(bytes.free));
}

}  // namespace

Status AddProcessMetrics(Registry* registry) {
  auto f = std::make_shared<Families>();
  ASSIGN_OR_RETURN(f->cpu, registry->AddCounter("process_cpu_seconds_total",
                                                "User and system CPU time spent in seconds."));
  ASSIGN_OR_RETURN(f->resident, registry->AddGauge("process_resident_memory_bytes",
                                                   "Resident memory size in bytes."));
  ASSIGN_OR_RETURN(f->virtual_memory, registry->AddGauge("process_virtual_memory_bytes",
                                                         "Virtual memory size in bytes."));
  ASSIGN_OR_RETURN(f->open_fds,
                   registry->AddGauge("process_open_fds", "Number of open file descriptors."));
  ASSIGN_OR_RETURN(f->max_fds, registry->AddGauge("process_max_fds",
                                                  "Maximum number of open file descriptors."));
  ASSIGN_OR_RETURN(f->start_time,
                   registry->AddGauge("process_start_time_seconds",
                                      "Start time of the process since unix epoch in seconds."));
  const std::string name = MallocName();
  // With grpo-torch's MappedCpuAllocator its tensor blocks and kept pages count too.
  const std::string mapped = CpuAllocatorName() == "mapped" ? " and MappedCpuAllocator" : "";
  ASSIGN_OR_RETURN(f->malloc_allocated,
                   registry->AddGauge("grpo_malloc_allocated_bytes",
                                      "Bytes the process holds from malloc (" + name + ")" +
                                          mapped + ", tensors included."));
  ASSIGN_OR_RETURN(f->malloc_free,
                   registry->AddGauge("grpo_malloc_free_bytes",
                                      "Bytes malloc (" + name + ")" + mapped +
                                          " keeps free for reuse, not given back to the kernel "
                                          "(most of it resident)."));
  const ProcStat stat = ReadProcStat();
  if (const double boot = BootTime(); boot >= 0 && stat.start_seconds >= 0) {
    f->start_time->Set(boot + stat.start_seconds);
  }
  Refresh(f.get());
  registry->OnExpose([f] { Refresh(f.get()); });
  return Status::OK();
}

}  // namespace grpo::common
