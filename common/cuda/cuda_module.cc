#include "common/cuda/cuda_module.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string_view>
#include <system_error>

#include "common/mutex.h"

namespace grpo::common {
namespace {

namespace fs = std::filesystem;

std::atomic<const CudaModule*> g_linked{nullptr};
std::atomic<const CudaModule*> g_loaded{nullptr};

// Constructed at first use: the linked module registers itself during static initialization.
struct State {
  Mutex mu;
  std::string text GRPO_GUARDED_BY(mu) = "not loaded (LoadCudaModule was not called)";
};
State& TheState() {
  static State* state = new State;  // never destroyed: read until the process ends
  return *state;
}

void SetState(std::string text) {
  State& s = TheState();
  MutexLock lock(&s.mu);
  s.text = std::move(text);
}

bool HasNvidiaDevice() {
  std::error_code ec;
  return fs::exists("/dev/nvidiactl", ec) || fs::exists("/proc/driver/nvidia/gpus", ec);
}

// GRPO_CUDA_MODULE as it is, else the first of libgrpo_cuda.so beside the executable and in
// ../lib/grpo/ from it that exists; NotFound naming the places looked at.
StatusOr<fs::path> FindModule() {
  if (const char* path = std::getenv("GRPO_CUDA_MODULE"); path != nullptr && *path != '\0') {
    return fs::path(path);
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return Status::NotFound("no place to look for libgrpo_cuda.so: " + ec.message());
  const fs::path dir = exe.parent_path();
  std::string tried;
  for (const fs::path& path :
       {dir / "libgrpo_cuda.so", dir / ".." / "lib" / "grpo" / "libgrpo_cuda.so"}) {
    const fs::path p = path.lexically_normal();
    if (fs::exists(p, ec)) return p;
    tried += (tried.empty() ? "" : ", ") + p.string();
  }
  return Status::NotFound("libgrpo_cuda.so is in none of " + tried +
                          " (GRPO_CUDA_MODULE names another place)");
}

StatusOr<const CudaModule*> Open(const fs::path& path) {
  // RTLD_GLOBAL: libtorch's CUDA part joins the process as if linked (its kernels and hooks
  // register with libtorch_cpu as it loads).
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    return Status::Unavailable("CUDA module " + path.string() + ": " +
                               (why ? why : "dlopen failed"));
  }
  using Entry = const CudaModule* (*)(int);
  auto entry = reinterpret_cast<Entry>(::dlsym(handle, "grpo_cuda_module"));
  if (entry == nullptr) {
    return Status::Unavailable("CUDA module " + path.string() + ": no grpo_cuda_module symbol");
  }
  const CudaModule* module = entry(kCudaModuleAbi);
  if (module == nullptr) {
    return Status::FailedPrecondition("CUDA module " + path.string() +
                                      " was built from other sources (module ABI " +
                                      std::to_string(kCudaModuleAbi) + " refused): rebuild it");
  }
  return module;  // never unloaded: libtorch keeps pointers into it
}

}  // namespace

const CudaModule* Cuda() {
  if (const CudaModule* linked = g_linked.load(std::memory_order_acquire)) return linked;
  return g_loaded.load(std::memory_order_acquire);
}

void RegisterLinkedCudaModule(const CudaModule* module) {
  g_linked.store(module, std::memory_order_release);
  SetState("linked into this program");
}

Status LoadCudaModule() {
  if (g_linked.load(std::memory_order_acquire) != nullptr) return Status::OK();
  if (g_loaded.load(std::memory_order_acquire) != nullptr) return Status::OK();
  const char* value = std::getenv("GRPO_CUDA");
  const std::string_view want = value == nullptr ? "auto" : value;
  bool required = false;
  if (want == "0" || want == "off") {
    SetState("not loaded (GRPO_CUDA=" + std::string(want) + ")");
    return Status::OK();
  }
  if (want == "1" || want == "on") {
    required = true;
  } else if (want != "auto" && !want.empty()) {
    return Status::InvalidArgument("GRPO_CUDA='" + std::string(want) +
                                   "': expected auto, 1, on, 0 or off");
  } else if (!HasNvidiaDevice()) {
    SetState("not loaded (no NVIDIA device here; GRPO_CUDA=1 loads it anyway)");
    return Status::OK();
  }
  StatusOr<fs::path> path = FindModule();
  StatusOr<const CudaModule*> module = path.ok() ? Open(*path) : path.status();
  if (module.ok()) {
    g_loaded.store(*module, std::memory_order_release);
    SetState("loaded from " + path->lexically_normal().string());
    return Status::OK();
  }
  const Status last = module.status();
  SetState("not loaded: " + last.message());
  if (required) return last;
  // Logging is not set up yet (main() calls this first).
  std::cerr << "grpo: warning: this machine has an NVIDIA device, but " << last.message()
            << "; running on the CPU only\n";
  return Status::OK();
}

std::string CudaModuleState() {
  State& s = TheState();
  MutexLock lock(&s.mu);
  return s.text;
}

}  // namespace grpo::common
