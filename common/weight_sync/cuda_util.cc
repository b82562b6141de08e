#include "common/weight_sync/cuda_util.h"

#include <cstdio>
#include <thread>

namespace grpo::common {
namespace {

constexpr auto kPollInterval = std::chrono::microseconds(20);

}  // namespace

Status CudaError(cudaError_t e, const std::string& what) {
  return Status::Unavailable(what + ": CUDA error " + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
}

Status WaitCudaStream(cudaStream_t stream, std::chrono::steady_clock::time_point deadline,
                      std::chrono::milliseconds timeout, const std::string& what,
                      const std::function<Status()>& also) {
  for (;;) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q != cudaSuccess && q != cudaErrorNotReady) return CudaError(q, what);
    if (also) RETURN_IF_ERROR(also());
    if (q == cudaSuccess) return Status::OK();
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::DeadlineExceeded(what + " not complete after " +
                                      std::to_string(timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

Status CheckCudaPointer(const void* ptr, int device, const std::string& name) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the runtime's last error
    return Status::InvalidArgument("tensor '" + name + "': not CUDA memory (" +
                                   cudaGetErrorString(e) + ")");
  }
  const bool ok = attr.type == cudaMemoryTypeManaged ||
                  (attr.type == cudaMemoryTypeDevice && attr.device == device);
  if (!ok) {
    return Status::InvalidArgument("tensor '" + name + "' is not in device memory of GPU " +
                                   std::to_string(device));
  }
  return Status::OK();
}

StatusOr<std::string> CudaDeviceUuid(int device) {
  cudaDeviceProp prop{};
  GRPO_CUDA_RETURN(cudaGetDeviceProperties(&prop, device),
                   "cudaGetDeviceProperties(" + std::to_string(device) + ")");
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char text[64];
  std::snprintf(text, sizeof(text),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return std::string(text);
}

Status DeviceMemoryWeightSync::CheckTensorMemory(const std::string& name, const at::Tensor& t) {
  if (t.nbytes() == 0) return Status::OK();
  return CheckCudaPointer(t.data_ptr(), device_, name);
}

StatusOr<uint8_t*> DeviceMemoryWeightSync::Staging(int64_t bytes) {
  if (staging_bytes_ < bytes) {
    // The stream may still use the old buffer (an unpack in flight).
    RETURN_IF_ERROR(Synchronize());
    FreeStaging();
    GRPO_CUDA_RETURN(cudaMalloc(&staging_, bytes), "cudaMalloc staging");
    staging_bytes_ = bytes;
  }
  return staging_;
}

Status DeviceMemoryWeightSync::CopyBytes(void* dst, const void* src, int64_t bytes) {
  GRPO_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync D2D");
  return Status::OK();
}

Status DeviceMemoryWeightSync::PrepareMemory() {
  RETURN_IF_ERROR(Ready());
  GRPO_CUDA_RETURN(cudaStreamSynchronize(cudaStreamLegacy), "waiting for libtorch's stream");
  return Status::OK();
}

void DeviceMemoryWeightSync::FreeStaging() {
  if (staging_ != nullptr) cudaFree(staging_);
  staging_ = nullptr;
  staging_bytes_ = 0;
}

}  // namespace grpo::common
