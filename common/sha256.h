// SHA-256 (FIPS 180-4), for checkpoint checksums in `sha256sum` format.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace grpo::common {

// Incremental hasher. Not thread-safe.
class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t size);
  // Lower-case hex digest; the hasher must not be updated afterwards.
  std::string HexDigest();

 private:
  void Block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string Sha256Hex(std::string_view data);
// Streams the file; NotFound / DataLoss naming the file on read errors.
StatusOr<std::string> Sha256File(const std::string& path);

}  // namespace grpo::common
