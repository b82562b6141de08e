// libFuzzer target: a .safetensors file (common/model/safetensors.h SafetensorsFile), read from
// every model directory and checkpoint the learner and workers load: the 8-byte length, the JSON
// header, dtypes, shapes against byte sizes, offsets against the file. The input is the whole
// file (in a memfd). Any input must open or give a Status, never a crash or undefined behaviour;
// an opened file's every tensor must come back with its declared dtype and shape and exactly
// the bytes its offsets span.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/model/safetensors.h"

namespace {

// One memfd reused by every input: a regular file with no name on disk.
int Memfd() {
  static const int fd = [] {
    const int f = ::memfd_create("grpo-fuzz-safetensors", MFD_CLOEXEC);
    if (f < 0) std::abort();
    return f;
  }();
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = Memfd();
  if (::ftruncate(fd, 0) != 0) std::abort();
  if (size > 0 && ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto file = grpo::common::SafetensorsFile::Open(path);
  if (!file.ok()) return 0;
  const uint64_t header = size < 8 ? 0 : [&] {
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(data[i]) << (8 * i);
    return n;
  }();
  const uint8_t* buffer = data + 8 + header;
  for (const std::string& name : (*file)->Names()) {
    const grpo::common::SafetensorInfo* info = (*file)->Find(name);
    if (info == nullptr || info->end > size - 8 - header) std::abort();
    auto tensor = (*file)->Get(name);
    if (!tensor.ok()) std::abort();
    if (tensor->scalar_type() != info->dtype || tensor->sizes().vec() != info->shape) std::abort();
    const size_t nbytes = tensor->nbytes();
    if (nbytes != info->end - info->begin) std::abort();
    if (nbytes > 0 && std::memcmp(tensor->data_ptr(), buffer + info->begin, nbytes) != 0) {
      std::abort();
    }
  }
  return 0;
}
