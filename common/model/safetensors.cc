#include "common/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>

namespace grpo::common {

// Tensor bytes are copied verbatim between memory and disk (little-endian on disk).
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint64_t kDataAlignment = 8;  // data buffer start, as the reference writer pads
constexpr char kSingleFileName[] = "model.safetensors";
constexpr char kIndexFileName[] = "model.safetensors.index.json";
constexpr char kMetadataKey[] = "__metadata__";

struct DtypeEntry {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeEntry kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string OffsetsString(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

std::string ErrnoString(int err) { return std::strerror(err); }

// "<path>: <problem>" so every error names the file.
Status FileError(StatusCode code, const std::string& path, const std::string& problem) {
  return Status(code, path + ": " + problem);
}

// One header entry validated on its own: field presence and types, dtype, shape vs byte size.
StatusOr<SafetensorInfo> ParseEntry(const std::string& path, const std::string& name,
                                    const json& entry) {
  const std::string where = "tensor " + Quote(name) + ": ";
  auto invalid = [&](const std::string& problem) {
    return FileError(StatusCode::kInvalidArgument, path, where + problem);
  };
  if (!entry.is_object()) return invalid("header entry is not a JSON object");

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end() || !dtype_it->is_string()) {
    return invalid("\"dtype\" is missing or not a string");
  }
  auto shape_it = entry.find("shape");
  if (shape_it == entry.end() || !shape_it->is_array()) {
    return invalid("\"shape\" is missing or not an array");
  }
  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return invalid("\"data_offsets\" is missing or not an array of 2 integers");
  }

  SafetensorInfo info;
  info.name = name;
  StatusOr<at::ScalarType> dtype = ParseSafetensorsDtype(dtype_it->get<std::string>());
  if (!dtype.ok()) return invalid(dtype.status().message());
  info.dtype = *dtype;

  uint64_t numel = 1;
  for (const json& dim : *shape_it) {
    // Non-negative JSON integers parse as unsigned; negatives and floats are rejected here.
    if (!dim.is_number_unsigned() ||
        dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return invalid("\"shape\" " + shape_it->dump() + " is not a list of non-negative integers");
    }
    const uint64_t d = dim.get<uint64_t>();
    info.shape.push_back(static_cast<int64_t>(d));
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return invalid("shape " + shape_it->dump() + " has too many elements");
    }
  }
  const json& offsets = *offsets_it;
  if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
    return invalid("\"data_offsets\" " + offsets.dump() + " are not non-negative integers");
  }
  info.begin = offsets[0].get<uint64_t>();
  info.end = offsets[1].get<uint64_t>();
  if (info.begin > info.end) {
    return invalid("data_offsets " + OffsetsString(info.begin, info.end) + " are reversed");
  }
  uint64_t nbytes = 0;
  const uint64_t element_size = c10::elementSize(info.dtype);
  if (__builtin_mul_overflow(numel, element_size, &nbytes) || nbytes != info.end - info.begin) {
    return invalid("shape " + ShapeString(info.shape) + " of " + dtype_it->get<std::string>() +
                   " needs " + std::to_string(numel) + " x " + std::to_string(element_size) +
                   " bytes but data_offsets " + OffsetsString(info.begin, info.end) + " span " +
                   std::to_string(info.end - info.begin));
  }
  return info;
}

struct ParsedHeader {
  std::map<std::string, SafetensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// Validates the JSON header against a data buffer of `buffer_size` bytes.
StatusOr<ParsedHeader> ParseHeader(const std::string& path, const char* header, uint64_t size,
                                   uint64_t buffer_size) {
  json root;
  try {
    root = json::parse(header, header + size);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e999
    return FileError(StatusCode::kInvalidArgument, path,
                     std::string("header is not valid JSON: ") + e.what());
  }
  if (!root.is_object()) {
    return FileError(StatusCode::kInvalidArgument, path,
                     "header is a JSON " + std::string(root.type_name()) + ", not an object");
  }

  ParsedHeader parsed;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) {
        return FileError(StatusCode::kInvalidArgument, path, "\"__metadata__\" is not an object");
      }
      for (const auto& [mkey, mvalue] : value.items()) {
        if (!mvalue.is_string()) {
          return FileError(StatusCode::kInvalidArgument, path,
                           "\"__metadata__\" value for " + Quote(mkey) + " is not a string");
        }
        parsed.metadata[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    StatusOr<SafetensorInfo> info = ParseEntry(path, key, value);
    if (!info.ok()) return info.status();
    parsed.tensors.emplace(key, std::move(info).value());
  }

  // In offset order, the range check first (a short file is truncation), then overlaps.
  std::vector<const SafetensorInfo*> by_offset;
  for (const auto& [name, info] : parsed.tensors) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  for (const SafetensorInfo* info : by_offset) {
    if (info->end > buffer_size) {
      return FileError(StatusCode::kDataLoss, path,
                       "tensor " + Quote(info->name) + " data_offsets " +
                           OffsetsString(info->begin, info->end) + " run past the end of the " +
                           std::to_string(buffer_size) + "-byte data buffer (file truncated?)");
    }
  }
  const SafetensorInfo* previous = nullptr;
  for (const SafetensorInfo* info : by_offset) {
    if (info->begin == info->end) continue;  // empty tensors occupy no bytes
    if (previous != nullptr && info->begin < previous->end) {
      return FileError(StatusCode::kInvalidArgument, path,
                       "tensors " + Quote(previous->name) + " " +
                           OffsetsString(previous->begin, previous->end) + " and " +
                           Quote(info->name) + " " + OffsetsString(info->begin, info->end) +
                           " overlap");
    }
    previous = info;
  }
  return parsed;
}

// Writes all of [data, data + size) to fd at byte `offset`, retrying on EINTR and short writes.
Status WriteAll(int fd, const std::string& path, const void* data, size_t size, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileError(StatusCode::kInternal, path, "write failed: " + ErrnoString(errno));
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<size_t>(n);
  }
  return Status::OK();
}

// Makes a rename into `path`'s directory durable; failure here leaves a complete file, so it is
// not an error.
Status FsyncParent(const std::string& path) {
  std::string dir = fs::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return Status::OK();
}

struct Chunk {
  const void* data;
  size_t size;
};

// Writes `chunks` to `path.tmp`, fsyncs, renames over `path` and fsyncs the directory. On error
// the temporary file is removed and `path` is untouched.
Status WriteFileAtomically(const std::string& path, const std::vector<Chunk>& chunks) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const StatusCode code = errno == ENOENT ? StatusCode::kNotFound : StatusCode::kInternal;
    return FileError(code, tmp, "cannot create: " + ErrnoString(errno));
  }
  Status status;
  uint64_t offset = 0;
  for (const Chunk& chunk : chunks) {
    status = WriteAll(fd, tmp, chunk.data, chunk.size, offset);
    if (!status.ok()) break;
    offset += chunk.size;
  }
  if (status.ok() && ::fsync(fd) != 0) {
    status = FileError(StatusCode::kInternal, tmp, "fsync failed: " + ErrnoString(errno));
  }
  if (::close(fd) != 0 && status.ok()) {
    status = FileError(StatusCode::kInternal, tmp, "close failed: " + ErrnoString(errno));
  }
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = FileError(StatusCode::kInternal, path,
                       "rename from " + tmp + " failed: " + ErrnoString(errno));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  return FsyncParent(path);
}

// Removes `path` if present; a missing file is fine.
Status RemoveIfExists(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return FileError(StatusCode::kInternal, path, "cannot remove: " + ErrnoString(errno));
  }
  return Status::OK();
}

// One tensor of a file to write: its name, dtype, shape and byte size, and where its bytes go.
struct TensorLayout {
  std::string name;
  at::ScalarType type = at::kFloat;
  std::string dtype;  // the on-disk name
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  uint64_t offset = 0;  // from the start of the file (LayOutFile)
};

// Checks the names (not reserved, not repeated) and dtypes of tensors to write.
StatusOr<std::vector<TensorLayout>> CheckSpecs(const std::string& path,
                                               const std::vector<SafetensorSpec>& specs) {
  std::vector<TensorLayout> out;
  std::set<std::string> seen;
  for (const SafetensorSpec& spec : specs) {
    auto invalid = [&](const std::string& problem) {
      return FileError(StatusCode::kInvalidArgument, path,
                       "tensor " + Quote(spec.name) + ": " + problem);
    };
    if (spec.name == kMetadataKey) return invalid("the name is reserved for metadata");
    if (!seen.insert(spec.name).second) return invalid("duplicate name");
    StatusOr<std::string> dtype = SafetensorsDtypeName(spec.dtype);
    if (!dtype.ok()) return invalid(dtype.status().message());
    TensorLayout t;
    t.name = spec.name;
    t.type = spec.dtype;
    t.dtype = *dtype;
    t.shape = spec.shape;
    t.nbytes = c10::elementSize(spec.dtype);
    for (int64_t d : spec.shape) {
      if (d < 0) return invalid("negative dimension in shape " + ShapeString(spec.shape));
      t.nbytes *= static_cast<uint64_t>(d);
    }
    out.push_back(std::move(t));
  }
  return out;
}

// The tensors to write (defined, CPU, strided), made contiguous, and their specs (appended to
// `specs`) for CheckSpecs.
StatusOr<std::vector<at::Tensor>> PrepareTensors(const std::string& path,
                                                 const NamedTensors& tensors,
                                                 std::vector<SafetensorSpec>& specs) {
  std::vector<at::Tensor> out;
  for (const auto& entry : tensors) {
    // Named, not a structured binding: clang-14, which builds the fuzz targets
    // (tests/fuzz/run.py), cannot capture a structured binding in a lambda.
    const std::string& name = entry.first;
    const at::Tensor& tensor = entry.second;
    auto invalid = [&](const std::string& problem) {
      return FileError(StatusCode::kInvalidArgument, path,
                       "tensor " + Quote(name) + ": " + problem);
    };
    if (!tensor.defined()) return invalid("undefined tensor");
    if (!tensor.device().is_cpu()) return invalid("not a CPU tensor");
    if (tensor.layout() != at::kStrided) return invalid("not a dense (strided) tensor");
    out.push_back(tensor.detach().contiguous());
    specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  return out;
}

// Writes PrepareTensors' tensors through `writer`, then finishes it.
Status WriteThrough(SafetensorsWriter& writer, const std::vector<SafetensorSpec>& specs,
                    const std::vector<at::Tensor>& values) {
  for (size_t i = 0; i < values.size(); ++i)
    RETURN_IF_ERROR(writer.Write(specs[i].name, values[i]));
  return writer.Finish();
}

// The header of one file holding `tensors` (the 8-byte length, then the JSON padded with spaces
// so that the data buffer starts 8-aligned), which it sorts into their data order: widest
// element first, then by name. With no gaps every tensor stays aligned to its element size, and
// the order does not depend on the caller's. Sets each tensor's offset in the file.
StatusOr<std::string> LayOutFile(const std::string& path, std::vector<TensorLayout>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    const auto wa = c10::elementSize(a.type), wb = c10::elementSize(b.type);
    return wa != wb ? wa > wb : a.name < b.name;
  });
  json header = json::object();  // std::map-backed: keys serialise in sorted order
  uint64_t offset = 0;
  for (const TensorLayout& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::type_error& e) {
    return FileError(
        StatusCode::kInvalidArgument, path,
        std::string("a tensor name or metadata string is not valid UTF-8: ") + e.what());
  }
  text.append((kDataAlignment - text.size() % kDataAlignment) % kDataAlignment, ' ');
  if (text.size() > kMaxSafetensorsHeaderBytes) {
    return FileError(StatusCode::kInvalidArgument, path,
                     "header would be " + std::to_string(text.size()) + " bytes, over the " +
                         std::to_string(kMaxSafetensorsHeaderBytes) + "-byte limit");
  }
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<uint8_t>(n >> (8 * i)));
  uint64_t at = out.size() + text.size();
  for (TensorLayout& t : tensors) {
    t.offset = at;
    at += t.nbytes;
  }
  return out + text;
}

// Reads a whole small file (the index); NotFound when it cannot be opened.
StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return FileError(StatusCode::kNotFound, path, "cannot open: " + ErrnoString(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return FileError(StatusCode::kDataLoss, path, "read failed");
  return ss.str();
}

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

Status OpenShardedImpl(const std::string& index_path, const fs::path& dir,
                       std::vector<std::unique_ptr<SafetensorsFile>>& files,
                       std::map<std::string, const SafetensorsFile*>& index) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path));
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e999
    return FileError(StatusCode::kInvalidArgument, index_path,
                     std::string("not valid JSON: ") + e.what());
  }
  if (!root.is_object() || !root.contains("weight_map") || !root["weight_map"].is_object()) {
    return FileError(StatusCode::kInvalidArgument, index_path,
                     "expected an object with a \"weight_map\" object");
  }
  std::map<std::string, std::string> weight_map;  // tensor -> shard file name
  for (const auto& [name, shard] : root["weight_map"].items()) {
    if (!shard.is_string() || !IsPlainFileName(shard.get<std::string>())) {
      return FileError(StatusCode::kInvalidArgument, index_path,
                       "weight_map entry for " + Quote(name) +
                           " is not a file name in the checkpoint directory: " + shard.dump());
    }
    weight_map[name] = shard.get<std::string>();
  }

  std::map<std::string, const SafetensorsFile*> shards;
  for (const auto& [name, shard] : weight_map) {
    if (shards.count(shard)) continue;
    const std::string shard_path = (dir / shard).string();
    std::error_code ec;
    if (!fs::exists(shard_path, ec)) {
      return FileError(StatusCode::kNotFound, index_path,
                       "shard " + Quote(shard) + " (holding tensor " + Quote(name) +
                           ") does not exist at " + shard_path);
    }
    StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(shard_path);
    if (!file.ok()) return file.status().WithContext(index_path);
    shards[shard] = file->get();
    files.push_back(std::move(file).value());
  }
  for (const auto& [name, shard] : weight_map) {
    const SafetensorsFile* file = shards.at(shard);
    if (file->Find(name) == nullptr) {
      return FileError(StatusCode::kNotFound, index_path,
                       "tensor " + Quote(name) + " is mapped to shard " + Quote(shard) + " but " +
                           file->path() + " does not contain it");
    }
    index[name] = file;
  }
  return Status::OK();
}

// The files of a checkpoint of `tensors`, in their order: one, or (above `max_shard_bytes`)
// greedy shards as transformers' shard_checkpoint makes them: a new shard starts when the next
// tensor would overflow a non-empty one.
std::vector<std::vector<TensorLayout>> ShardLayouts(std::vector<TensorLayout> tensors,
                                                    uint64_t max_shard_bytes) {
  uint64_t total = 0;
  for (const TensorLayout& t : tensors) total += t.nbytes;
  if (total <= max_shard_bytes) return {std::move(tensors)};
  std::vector<std::vector<TensorLayout>> shards(1);
  uint64_t shard_bytes = 0;
  for (TensorLayout& t : tensors) {
    if (!shards.back().empty() && shard_bytes + t.nbytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shard_bytes += t.nbytes;
    shards.back().push_back(std::move(t));
  }
  return shards;
}

}  // namespace

std::string ShapeString(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

StatusOr<std::string> SafetensorsDtypeName(at::ScalarType dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.type == dtype) return std::string(e.name);
  }
  return Status::InvalidArgument(std::string("dtype ") + c10::toString(dtype) +
                                 " has no safetensors encoding here");
}

StatusOr<at::ScalarType> ParseSafetensorsDtype(const std::string& name) {
  for (const DtypeEntry& e : kDtypes) {
    if (name == e.name) return e.type;
  }
  return Status::InvalidArgument("unknown or unsupported dtype \"" + name +
                                 "\" (supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  try {
    std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
    file->path_ = path;

    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const StatusCode code =
          errno == ENOENT ? StatusCode::kNotFound : StatusCode::kInvalidArgument;
      return FileError(code, path, "cannot open: " + ErrnoString(errno));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return FileError(StatusCode::kInvalidArgument, path, "not a regular file");
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < 8) {
      ::close(fd);
      return FileError(
          StatusCode::kDataLoss, path,
          "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
    }
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int mmap_errno = errno;
    ::close(fd);
    if (map == MAP_FAILED) {
      return FileError(StatusCode::kInternal, path, "mmap failed: " + ErrnoString(mmap_errno));
    }
    file->map_ = map;  // unmapped by the destructor on every path from here
    file->map_size_ = size;

    const auto* bytes = static_cast<const uint8_t*>(map);
    uint64_t header_size = 0;
    for (int i = 0; i < 8; ++i) header_size |= static_cast<uint64_t>(bytes[i]) << (8 * i);
    if (header_size > kMaxSafetensorsHeaderBytes) {
      return FileError(StatusCode::kInvalidArgument, path,
                       "header length " + std::to_string(header_size) + " exceeds the " +
                           std::to_string(kMaxSafetensorsHeaderBytes) + "-byte limit");
    }
    if (header_size > size - 8) {
      return FileError(StatusCode::kDataLoss, path,
                       "header length " + std::to_string(header_size) +
                           " runs past the end of the " + std::to_string(size) + "-byte file");
    }
    const uint64_t buffer_size = size - 8 - header_size;
    ASSIGN_OR_RETURN(
        ParsedHeader parsed,
        ParseHeader(path, reinterpret_cast<const char*>(bytes + 8), header_size, buffer_size));
    file->tensors_ = std::move(parsed.tensors);
    file->metadata_ = std::move(parsed.metadata);
    file->data_ = bytes + 8 + header_size;
    return file;
  } catch (const std::exception& e) {
    return FileError(StatusCode::kInternal, path, std::string("unexpected error: ") + e.what());
  }
}

std::vector<std::string> SafetensorsFile::Names() const {
  std::vector<const SafetensorInfo*> infos;
  for (const auto& [name, info] : tensors_) infos.push_back(&info);
  std::sort(infos.begin(), infos.end(), [](const auto* a, const auto* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  std::vector<std::string> names;
  for (const SafetensorInfo* info : infos) names.push_back(info->name);
  return names;
}

const SafetensorInfo* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

StatusOr<at::Tensor> SafetensorsFile::Get(const std::string& name) const {
  const SafetensorInfo* info = Find(name);
  if (info == nullptr) {
    return FileError(StatusCode::kNotFound, path_, "no tensor " + Quote(name));
  }
  const uint8_t* src = data_ + info->begin;
  const size_t nbytes = info->end - info->begin;
  if (info->dtype == at::kBool) {
    for (size_t i = 0; i < nbytes; ++i) {
      if (src[i] > 1) {
        return FileError(StatusCode::kInvalidArgument, path_,
                         "tensor " + Quote(name) + ": BOOL byte " + std::to_string(i) + " is " +
                             std::to_string(src[i]) + ", not 0 or 1");
      }
    }
  }
  try {
    at::Tensor out = at::empty(info->shape, at::TensorOptions().dtype(info->dtype));
    if (nbytes > 0) std::memcpy(out.data_ptr(), src, nbytes);
    DoneReading(name, 0, nbytes);  // the copy holds them now
    return out;
  } catch (const std::exception& e) {
    return FileError(StatusCode::kInternal, path_,
                     "tensor " + Quote(name) + ": allocation failed: " + e.what());
  }
}

void SafetensorsFile::DoneReading(const std::string& name, uint64_t begin, uint64_t end) const {
  const SafetensorInfo* info = Find(name);
  if (info == nullptr || map_ == nullptr) return;
  end = std::min(end, info->end - info->begin);
  if (begin >= end) return;
  // The whole pages the bytes touch (a page shared with a neighbour is mapped again when read):
  // the mapping is private and read-only, so MADV_DONTNEED only drops them from the resident set.
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(data_ + info->begin + begin) / page * page;
  const uintptr_t hi = reinterpret_cast<uintptr_t>(data_ + info->begin + end);
  ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

StatusOr<at::Tensor> SafetensorsFile::View(const std::string& name) const {
  const SafetensorInfo* info = Find(name);
  if (info == nullptr) {
    return FileError(StatusCode::kNotFound, path_, "no tensor " + Quote(name));
  }
  const auto options = at::TensorOptions().dtype(info->dtype);
  const size_t itemsize = c10::elementSize(info->dtype);
  const int64_t elements = static_cast<int64_t>((info->end - info->begin) / itemsize);
  const uint8_t* src = data_ + info->begin;
  if (reinterpret_cast<uintptr_t>(src) % itemsize != 0) {
    return FileError(StatusCode::kFailedPrecondition, path_,
                     "tensor " + Quote(name) + ": its bytes are not aligned to its dtype");
  }
  // The mapping is read-only (PROT_READ): the tensor must never be written.
  return at::from_blob(const_cast<uint8_t*>(src), {elements}, options);
}

Status WriteSafetensors(const std::string& path, const NamedTensors& tensors,
                        const std::map<std::string, std::string>& metadata) {
  try {
    std::vector<SafetensorSpec> specs;
    ASSIGN_OR_RETURN(std::vector<at::Tensor> values, PrepareTensors(path, tensors, specs));
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                     SafetensorsWriter::CreateFile(path, specs, metadata));
    return WriteThrough(*writer, specs, values);
  } catch (const std::exception& e) {
    return FileError(StatusCode::kInternal, path, std::string("unexpected error: ") + e.what());
  }
}

StatusOr<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::Open(
    const std::string& dir) {
  try {
    auto checkpoint = std::make_unique<SafetensorsCheckpoint>();
    const fs::path root(dir);
    const std::string single_path = (root / kSingleFileName).string();
    const std::string index_path = (root / kIndexFileName).string();
    std::error_code ec;
    if (fs::exists(single_path, ec)) {
      ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single_path));
      for (const std::string& name : file->Names()) checkpoint->index_[name] = file.get();
      checkpoint->files_.push_back(std::move(file));
    } else if (fs::exists(index_path, ec)) {
      RETURN_IF_ERROR(OpenShardedImpl(index_path, root, checkpoint->files_, checkpoint->index_));
    } else {
      return FileError(
          StatusCode::kNotFound, dir,
          std::string("neither ") + kSingleFileName + " nor " + kIndexFileName + " exists");
    }
    return checkpoint;
  } catch (const std::exception& e) {
    return FileError(StatusCode::kInternal, dir, std::string("unexpected error: ") + e.what());
  }
}

std::vector<std::string> SafetensorsCheckpoint::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, file] : index_) names.push_back(name);
  return names;
}

const SafetensorInfo* SafetensorsCheckpoint::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second->Find(name);
}

StatusOr<at::Tensor> SafetensorsCheckpoint::Get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return Status::NotFound("no tensor " + Quote(name) + " in the checkpoint");
  }
  return it->second->Get(name);
}

void SafetensorsCheckpoint::DoneReading(const std::string& name, uint64_t begin,
                                        uint64_t end) const {
  auto it = index_.find(name);
  if (it != index_.end()) it->second->DoneReading(name, begin, end);
}

StatusOr<at::Tensor> SafetensorsCheckpoint::View(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return Status::NotFound("no tensor " + Quote(name) + " in the checkpoint");
  }
  return it->second->View(name);
}

Status SafetensorsWriter::AddFile(const std::string& file_path, std::vector<SafetensorSpec> specs,
                                  const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::vector<TensorLayout> layout, CheckSpecs(file_path, specs));
  ASSIGN_OR_RETURN(std::string header, LayOutFile(file_path, layout, metadata));
  const std::string tmp = file_path + ".tmp";
  File file;
  file.path = file_path;
  file.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (file.fd < 0) {
    const StatusCode code = errno == ENOENT ? StatusCode::kNotFound : StatusCode::kInternal;
    return FileError(code, tmp, "cannot create: " + ErrnoString(errno));
  }
  files_.push_back(file);
  RETURN_IF_ERROR(WriteAll(file.fd, tmp, header.data(), header.size(), 0));
  for (TensorLayout& t : layout) {
    pending_.emplace(t.name, Pending{files_.size() - 1, t.type, t.shape, t.offset, t.nbytes});
  }
  return Status::OK();
}

StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::CreateFile(
    const std::string& path, const std::vector<SafetensorSpec>& specs,
    const std::map<std::string, std::string>& metadata) {
  try {
    std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
    RETURN_IF_ERROR(writer->AddFile(path, specs, metadata));
    return writer;
  } catch (const std::exception& e) {
    return FileError(StatusCode::kInternal, path, std::string("unexpected error: ") + e.what());
  }
}

StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::CreateCheckpoint(
    const std::string& dir, const std::vector<SafetensorSpec>& specs, uint64_t max_shard_bytes,
    const std::map<std::string, std::string>& metadata) {
  try {
    if (max_shard_bytes == 0) {
      return FileError(StatusCode::kInvalidArgument, dir, "max_shard_bytes must be positive");
    }
    // Everything is validated before a file is made: names must be unique across shards too.
    ASSIGN_OR_RETURN(std::vector<TensorLayout> all, CheckSpecs(dir, specs));
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      return FileError(StatusCode::kInternal, dir, "cannot create directory: " + ec.message());
    }
    uint64_t total = 0;
    for (const TensorLayout& t : all) total += t.nbytes;
    std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
    writer->dir_ = dir;
    const std::vector<std::vector<TensorLayout>> shards =
        ShardLayouts(std::move(all), max_shard_bytes);
    json weight_map = json::object();
    for (size_t s = 0; s < shards.size(); ++s) {
      std::string name = kSingleFileName;
      if (shards.size() > 1) {
        char numbered[64];
        std::snprintf(numbered, sizeof(numbered), "model-%05zu-of-%05zu.safetensors", s + 1,
                      shards.size());
        name = numbered;
      }
      std::vector<SafetensorSpec> in_file;
      for (const TensorLayout& t : shards[s]) {
        in_file.push_back({t.name, t.type, t.shape});
        if (shards.size() > 1) weight_map[t.name] = name;
      }
      RETURN_IF_ERROR(writer->AddFile((fs::path(dir) / name).string(), in_file, metadata));
    }
    if (shards.size() > 1) {
      writer->index_ =
          json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n";
    }
    return writer;
  } catch (const std::exception& e) {
    return FileError(StatusCode::kInternal, dir, std::string("unexpected error: ") + e.what());
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  for (const File& f : files_) {
    if (f.fd >= 0) ::close(f.fd);
    if (!finished_) ::unlink((f.path + ".tmp").c_str());
  }
}

Status SafetensorsWriter::Write(const std::string& name, const at::Tensor& value) {
  auto it = pending_.find(name);
  if (it == pending_.end()) {
    return FileError(StatusCode::kInvalidArgument, Where(),
                     "tensor " + Quote(name) +
                         (written_.count(name) ? " is written already" : " was not declared"));
  }
  const Pending& p = it->second;
  const File& file = files_[p.file];
  auto invalid = [&](const std::string& problem) {
    return FileError(StatusCode::kInvalidArgument, file.path,
                     "tensor " + Quote(name) + ": " + problem);
  };
  if (!value.defined() || !value.device().is_cpu() || value.layout() != at::kStrided) {
    return invalid("not a defined dense CPU tensor");
  }
  if (value.scalar_type() != p.type || value.sizes().vec() != p.shape) {
    return invalid(std::string("is ") + c10::toString(value.scalar_type()) + " " +
                   ShapeString(value.sizes().vec()) + ", declared " + c10::toString(p.type) + " " +
                   ShapeString(p.shape));
  }
  try {
    const at::Tensor bytes = value.detach().contiguous();
    RETURN_IF_ERROR(WriteAll(file.fd, file.path + ".tmp", bytes.data_ptr(), p.nbytes, p.offset));
  } catch (const std::exception& e) {
    return invalid(std::string("unexpected error: ") + e.what());
  }
  written_.insert(name);
  pending_.erase(it);
  return Status::OK();
}

Status SafetensorsWriter::Finish() {
  if (finished_) return FileError(StatusCode::kFailedPrecondition, Where(), "finished already");
  if (!pending_.empty()) {
    return FileError(StatusCode::kFailedPrecondition, Where(),
                     std::to_string(pending_.size()) + " tensor(s) never written, " +
                         Quote(pending_.begin()->first) + " first");
  }
  for (File& f : files_) {
    const std::string tmp = f.path + ".tmp";
    if (::fsync(f.fd) != 0) {
      return FileError(StatusCode::kInternal, tmp, "fsync failed: " + ErrnoString(errno));
    }
    const int rc = ::close(f.fd);
    f.fd = -1;
    if (rc != 0)
      return FileError(StatusCode::kInternal, tmp, "close failed: " + ErrnoString(errno));
  }
  for (const File& f : files_) {
    if (::rename((f.path + ".tmp").c_str(), f.path.c_str()) != 0) {
      return FileError(StatusCode::kInternal, f.path,
                       "rename from " + f.path + ".tmp failed: " + ErrnoString(errno));
    }
  }
  finished_ = true;
  if (dir_.empty()) return FsyncParent(files_[0].path);
  const fs::path root(dir_);
  const std::string single_path = (root / kSingleFileName).string();
  const std::string index_path = (root / kIndexFileName).string();
  if (index_.empty()) {
    // Open prefers model.safetensors, so a stale index is harmless; remove it anyway.
    RETURN_IF_ERROR(RemoveIfExists(index_path));
  } else {
    // The index goes last so it only ever names complete shards; then the single file (which
    // Open would prefer) goes.
    RETURN_IF_ERROR(WriteFileAtomically(index_path, {{index_.data(), index_.size()}}));
    RETURN_IF_ERROR(RemoveIfExists(single_path));
  }
  return FsyncParent(index_path);
}

std::string SafetensorsWriter::Where() const { return dir_.empty() ? files_[0].path : dir_; }

Status WriteSafetensorsCheckpoint(const std::string& dir, const NamedTensors& tensors,
                                  uint64_t max_shard_bytes,
                                  const std::map<std::string, std::string>& metadata) {
  try {
    std::vector<SafetensorSpec> specs;
    ASSIGN_OR_RETURN(std::vector<at::Tensor> values, PrepareTensors(dir, tensors, specs));
    ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                     SafetensorsWriter::CreateCheckpoint(dir, specs, max_shard_bytes, metadata));
    return WriteThrough(*writer, specs, values);
  } catch (const std::exception& e) {
    return FileError(StatusCode::kInternal, dir, std::string("unexpected error: ") + e.what());
  }
}

std::string SafetensorsCheckpoint::FileOf(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? std::string() : it->second->path();
}

}  // namespace grpo::common
