#include "common/model/device.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "common/config.h"

namespace grpo::common {
namespace {

int64_t ProcStatusBytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) {
      std::istringstream ss(line.substr(prefix.size()));
      int64_t kib = 0;
      ss >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

}  // namespace

// libtorch's CUDA hooks and allocator registry: no CUDA symbol is linked (common/cuda/
// cuda_module.h says why); without libtorch's CUDA part loaded they see no device.
bool CudaAvailable() { return torch::cuda::device_count() > 0; }

StatusOr<at::Device> ResolveDevice(std::string_view device) {
  if (!IsDeviceSpelling(device)) {
    return Status::InvalidArgument("config key 'device' must be auto, cpu, cuda or cuda:N, got '" +
                                   std::string(device) + "'");
  }
  const int64_t visible = static_cast<int64_t>(torch::cuda::device_count());
  if (device == "cpu") return at::Device(at::kCPU);
  if (device == "auto") return visible > 0 ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const int64_t index = device == "cuda" ? 0 : std::stoll(std::string(device.substr(5)));
  if (visible == 0) {
    return Status::InvalidArgument("config key 'device' is '" + std::string(device) +
                                   "' but no CUDA device is visible (use cpu or auto)");
  }
  if (index >= visible) {
    return Status::InvalidArgument("config key 'device' is '" + std::string(device) +
                                   "' but only " + std::to_string(visible) +
                                   " CUDA device(s) are visible");
  }
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

int64_t PeakMemoryBytes(const at::Device& device) {
  if (device.is_cuda()) {
    const auto stats = c10::getDeviceAllocator(at::kCUDA)->getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .peak;
  }
  return ProcStatusBytes("VmHWM");
}

int64_t CurrentMemoryBytes(const at::Device& device) {
  if (device.is_cuda()) {
    const auto stats = c10::getDeviceAllocator(at::kCUDA)->getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
        .current;
  }
  return ProcStatusBytes("VmRSS");
}

int64_t TotalMemoryBytes(const at::Device& device) {
  if (device.is_cuda()) {
    return static_cast<int64_t>(
        c10::getDeviceAllocator(at::kCUDA)->getMemoryInfo(device.index()).second);
  }
  int64_t total = 0;
  {
    std::ifstream in("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    while (in >> key >> kib) {
      if (key == "MemTotal:") {
        total = kib * 1024;
        break;
      }
      in.ignore(1 << 10, '\n');
    }
  }
  // A container's limit: cgroup v2 ("max" when there is none), then v1 (a huge number then).
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    int64_t limit = 0;
    if (in >> limit && limit > 0 && (total == 0 || limit < total)) total = limit;
  }
  return total;
}

void ResetPeakMemory(const at::Device& device) {
  if (device.is_cuda()) c10::getDeviceAllocator(at::kCUDA)->resetPeakStats(device.index());
}

CpuBf16Speed MeasureCpuBf16Matmul() {
  CpuBf16Speed speed;
  // On a thread of its own with one intra-op thread: on busy cores waking a second thread can
  // cost a small product more than the product itself, in either dtype, and the ratio would
  // measure the scheduler. The caller's thread count is untouched (OpenMP's and MKL's are per
  // thread), but at::set_num_threads also sets the count that a thread adopts at its first
  // parallel op, which a thread starting one meanwhile would take (1); the callers run this at
  // start-up, before their computing threads, and the count is restored after.
  std::thread([&speed] {
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    // Fixed inputs from a generator of their own: the process's random state stays as it was.
    at::Generator g = at::detail::createCPUGenerator(0);
    const at::Tensor a = at::randn({64, 256}, g), b = at::randn({256, 256}, g);
    const at::Tensor a16 = a.to(at::kBFloat16), b16 = b.to(at::kBFloat16);
    at::mm(a, b);  // warm-up: each kernel's first call picks and pages in its code
    at::mm(a16, b16);
    const auto seconds = [](const at::Tensor& x, const at::Tensor& y) {
      const auto t0 = std::chrono::steady_clock::now();
      at::mm(x, y);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    // The best of 5 each, interleaved, so that a slow stretch of the machine meets both.
    for (int i = 0; i < 5; ++i) {
      const double f = seconds(a, b), h = seconds(a16, b16);
      speed.fp32_seconds = i == 0 ? f : std::min(speed.fp32_seconds, f);
      speed.bf16_seconds = i == 0 ? h : std::min(speed.bf16_seconds, h);
    }
    at::set_num_threads(threads);
  }).join();
  return speed;
}

std::string CpuBf16Warning(const CpuBf16Speed& speed) {
  const double slowdown = speed.slowdown();
  if (slowdown < kCpuBf16SlowdownToWarn) return "";
  std::ostringstream out;
  out.precision(slowdown < 10 ? 2 : 3);
  out << "bf16 on the CPU: a bf16 matrix product runs " << slowdown
      << "x slower than fp32 on this CPU (libtorch emulates bf16 where the CPU has no bf16 "
         "instructions: AVX512-BF16 or AMX), so here bf16 saves memory and costs the run most of "
         "its speed; set bf16: false unless the model needs the memory (grpo plan shows it)";
  return out.str();
}

}  // namespace grpo::common
