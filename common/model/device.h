// Device and precision of a run (the `device` and `bf16` config keys) resolved against the GPUs
// this process can see, and the peak-memory reading that follows the device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace grpo::common {

// "auto" -> cuda (device 0) when a CUDA device is visible, else cpu; "cpu"; "cuda" (device 0);
// "cuda:N". InvalidArgument naming the key for any other spelling, for cuda when no CUDA device
// is visible, and for cuda:N with N >= the number of visible devices.
StatusOr<at::Device> ResolveDevice(std::string_view device);

// The compute dtype of `bf16`: kBFloat16 or kFloat.
inline at::ScalarType ComputeDtype(bool bf16) { return bf16 ? at::kBFloat16 : at::kFloat; }

// True when libtorch sees at least one CUDA device.
bool CudaAvailable();

// Peak memory in bytes since the last ResetPeakMemory(device): on CUDA the caching allocator's
// peak allocated bytes (c10::cuda::CUDACachingAllocator::getDeviceStats); on CPU the process's
// peak resident set (VmHWM, not resettable). 0 when unknown.
int64_t PeakMemoryBytes(const at::Device& device);
// Current memory in bytes: CUDA allocated bytes, or the CPU resident set (VmRSS).
int64_t CurrentMemoryBytes(const at::Device& device);
// The memory a run on `device` may use, in bytes: the GPU's total memory (cudaMemGetInfo), or on
// the CPU MemTotal of /proc/meminfo, or the cgroup's memory limit when that is lower. 0 when
// unknown.
int64_t TotalMemoryBytes(const at::Device& device);
// Resets the CUDA allocator's peak statistics of `device`; no-op on CPU.
void ResetPeakMemory(const at::Device& device);

// `bf16` on the CPU: libtorch multiplies bf16 matrices with the CPU's own bf16 instructions where
// it has them (AVX512-BF16, AMX) and emulates them otherwise, a hundred times slower than fp32
// and more (155x on an AVX2 EPYC), so that there bf16 saves memory and costs the run its speed.
// The time of one 64 x 256 by 256 x 256 product in each dtype on this CPU, on one intra-op
// thread (the best of 5, interleaved). For start-up, before the process's computing threads
// (device.cc says why).
struct CpuBf16Speed {
  double fp32_seconds = 0, bf16_seconds = 0;
  double slowdown() const { return fp32_seconds > 0 ? bf16_seconds / fp32_seconds : 0; }
};
CpuBf16Speed MeasureCpuBf16Matmul();
// bf16 this many times slower than fp32 or more is worth a warning.
inline constexpr double kCpuBf16SlowdownToWarn = 4.0;
// The warning a run with `bf16` on the CPU logs at start (the measured slowdown and the way
// out), or empty when bf16 is less than kCpuBf16SlowdownToWarn times slower.
std::string CpuBf16Warning(const CpuBf16Speed& speed);

}  // namespace grpo::common
