// safetensors (https://github.com/huggingface/safetensors) read and write.
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str:
// str}}, then the data buffer; offsets are relative to the start of the buffer.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
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

// A shape as errors name it: "[2, 3]".
std::string ShapeString(at::IntArrayRef shape);

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
  // The tensor's bytes where the file maps them, as a flat CPU tensor of its dtype: no copy,
  // valid while this file is open, never to be written. Null data (a 0-element tensor) is fine.
  // NotFound when absent; FailedPrecondition when the bytes are not aligned to the dtype's
  // size (Get copies them then).
  StatusOr<at::Tensor> View(const std::string& name) const;
  // Bytes [begin, end) of the tensor's data are read: their pages leave this process's resident
  // set (they stay in the page cache, and a later read maps them again). Nothing for a name that
  // is absent.
  void DoneReading(const std::string& name, uint64_t begin, uint64_t end) const;
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
// Duplicate names or an unsupported dtype are InvalidArgument. Through SafetensorsWriter.
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
  StatusOr<at::Tensor> View(const std::string& name) const;
  void DoneReading(const std::string& name, uint64_t begin, uint64_t end) const;
  // The file that holds `name` (for error messages); empty when absent.
  std::string FileOf(const std::string& name) const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> index_;
};

// Writes `dir/model.safetensors`, or, when the total exceeds `max_shard_bytes`, shards
// `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` (HF layout).
// Through SafetensorsWriter.
Status WriteSafetensorsCheckpoint(const std::string& dir, const NamedTensors& tensors,
                                  uint64_t max_shard_bytes = 5ull << 30,
                                  const std::map<std::string, std::string>& metadata = {});

// A tensor of a file, declared before its values exist.
struct SafetensorSpec {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

// Writes safetensors files with the tensors handed over one at a time and in any order, so that
// they never have to be in memory all at once: a learner whose parameters are sharded writes
// each unit as it is gathered, a rank its AdamW shard a parameter at a time.
// WriteSafetensorsCheckpoint and WriteSafetensors write whole tensor lists through it.
// Create* lays out every file from the specs (names, dtypes, shapes) and opens each as
// `<file>.tmp`; Write puts one tensor's bytes at their offset; Finish fsyncs and renames the
// files (a checkpoint's index last, then what another layout left: model.safetensors, or the
// index). A writer destroyed before its Finish succeeded removes its temporary files, and the
// files it would have replaced are as they were. Not thread-safe.
class SafetensorsWriter {
 public:
  // A Hugging Face model directory, as WriteSafetensorsCheckpoint lays it out. InvalidArgument
  // for a reserved or repeated name, a dtype safetensors cannot hold or a zero
  // `max_shard_bytes`; Internal when a file cannot be made. Errors name the file.
  static StatusOr<std::unique_ptr<SafetensorsWriter>> CreateCheckpoint(
      const std::string& dir, const std::vector<SafetensorSpec>& specs,
      uint64_t max_shard_bytes = 5ull << 30,
      const std::map<std::string, std::string>& metadata = {});
  // One file at `path`, as WriteSafetensors writes it. The same errors.
  static StatusOr<std::unique_ptr<SafetensorsWriter>> CreateFile(
      const std::string& path, const std::vector<SafetensorSpec>& specs,
      const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // InvalidArgument for a name not declared or written already, or a value that is not a dense
  // CPU tensor of its declared dtype and shape; Internal when the write fails.
  Status Write(const std::string& name, const at::Tensor& value);
  // FailedPrecondition naming a tensor never written (nothing renamed then); Internal on an I/O
  // error.
  Status Finish();

 private:
  struct File {
    std::string path;  // written as path + ".tmp" until Finish
    int fd = -1;
  };
  struct Pending {
    size_t file = 0;
    at::ScalarType type = at::kFloat;
    std::vector<int64_t> shape;
    uint64_t offset = 0;  // in the file
    uint64_t nbytes = 0;
  };
  SafetensorsWriter() = default;
  std::string Where() const;  // for errors: the directory, or the one file
  // Lays out `file_path`'s tensors, opens its temporary file and writes the header.
  Status AddFile(const std::string& file_path, std::vector<SafetensorSpec> specs,
                 const std::map<std::string, std::string>& metadata);

  std::string dir_;  // the checkpoint's directory, or empty for one file
  std::vector<File> files_;
  std::map<std::string, Pending> pending_;
  std::set<std::string> written_;
  std::string index_;  // a sharded checkpoint's model.safetensors.index.json, else empty
  bool finished_ = false;
};

}  // namespace grpo::common
