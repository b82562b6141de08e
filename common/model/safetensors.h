// safetensors (https://github.com/huggingface/safetensors) read and write.
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str:
// str}}, then the data buffer; offsets are relative to the start of the buffer.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace grpo::common {

// Headers longer than this are rejected before anything is allocated (as the reference
// implementation does).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// The on-disk dtype name ("F32", "BF16", ...); InvalidArgument for a dtype safetensors files
// here cannot hold.
StatusOr<std::string> SafetensorsDtypeName(at::ScalarType dtype);
// The inverse; InvalidArgument naming `name` when it is unknown or unsupported.
StatusOr<at::ScalarType> ParseSafetensorsDtype(const std::string& name);

// Supported on disk: F32, F16, BF16, I64, I32 (plus F64, I16, I8, U8, BOOL for convenience).
struct SafetensorInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offset into the data buffer
  uint64_t end = 0;    // one past the last byte
};

// One memory-mapped .safetensors file, validated entirely on Open (header, dtypes, shapes vs
// byte sizes, offsets in range and not overlapping, file not truncated). Immutable after Open:
// thread-safe for concurrent reads.
class SafetensorsFile {
 public:
  // Errors name the file and the problem (InvalidArgument / DataLoss / NotFound).
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensor names in the order of their data offsets.
  std::vector<std::string> Names() const;
  // nullptr when absent.
  const SafetensorInfo* Find(const std::string& name) const;
  // A CPU tensor that owns a copy of the bytes (safe after this file is closed).
  // NotFound (naming the file and tensor) when absent.
  StatusOr<at::Tensor> Get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::map<std::string, SafetensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  const uint8_t* data_ = nullptr;  // start of the data buffer inside the mapping
  void* map_ = nullptr;
  size_t map_size_ = 0;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes CPU tensors (any supported dtype; made contiguous) and string metadata to `path`
// through `path.tmp` + fsync + rename, so a crash never leaves a partial file at `path`.
// Duplicate names or an unsupported dtype are InvalidArgument.
Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                        const std::map<std::string, std::string>& metadata = {});

// The weights of a Hugging Face model directory: `model.safetensors`, or the shards listed in
// `model.safetensors.index.json` ({"weight_map": {name: shard_file}}). Thread-safe reads.
class SafetensorsCheckpoint {
 public:
  // NotFound when the directory has neither file; errors name the file and the problem.
  static StatusOr<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& dir);

  std::vector<std::string> Names() const;
  const SafetensorInfo* Find(const std::string& name) const;
  StatusOr<at::Tensor> Get(const std::string& name) const;
  // The file that holds `name` (for error messages); empty when absent.
  std::string FileOf(const std::string& name) const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> index_;
};

// Writes `dir/model.safetensors`, or, when the total exceeds `max_shard_bytes`, shards
// `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` (HF layout).
Status WriteSafetensorsCheckpoint(const std::string& dir, const NamedTensors& tensors,
                                  uint64_t max_shard_bytes = 5ull << 30,
                                  const std::map<std::string, std::string>& metadata = {});

}  // namespace grpo::common
