#include "common/weight_sync/weight_sync_protocol.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "common/logging.h"

namespace grpo::common {
namespace {

constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

uint64_t Fnv(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

uint64_t FnvInt(uint64_t h, int64_t v) { return Fnv(h, &v, sizeof(v)); }

// xxHash64's primes and round (https://github.com/Cyan4973/xxHash, XXH64 spec).
constexpr uint64_t kP1 = 11400714785074694791ull;
constexpr uint64_t kP2 = 14029467366897019727ull;
constexpr uint64_t kP3 = 1609587929392839161ull;
inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t Round(uint64_t acc, uint64_t w) { return Rotl(acc + w * kP2, 31) * kP1; }

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ranks[i]);
  }
  return s;
}

}  // namespace

std::vector<Bucket> PlanBuckets(const NamedTensors& tensors, int64_t bucket_bytes) {
  const int64_t cap = std::max<int64_t>(8, (bucket_bytes + 7) / 8 * 8);
  std::vector<at::ScalarType> dtypes;
  for (const auto& [name, t] : tensors) {
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) {
      dtypes.push_back(t.scalar_type());
    }
  }
  std::vector<Bucket> buckets;
  for (at::ScalarType dtype : dtypes) {
    Bucket cur;
    cur.dtype = dtype;
    for (int64_t i = 0; i < static_cast<int64_t>(tensors.size()); ++i) {
      const at::Tensor& t = tensors[i].second;
      if (t.scalar_type() != dtype) continue;
      const int64_t n = static_cast<int64_t>(t.nbytes());
      int64_t off = 0;
      while (off < n) {
        const int64_t take = std::min(n - off, cap - cur.bytes);
        cur.pieces.push_back(BucketPiece{i, off, cur.bytes, take});
        cur.bytes += take;
        off += take;
        if (cur.bytes == cap) {
          buckets.push_back(std::move(cur));
          cur = Bucket{};
          cur.dtype = dtype;
        }
      }
    }
    if (cur.bytes > 0) buckets.push_back(std::move(cur));
  }
  return buckets;
}

uint64_t LayoutFingerprint(const NamedTensors& tensors) {
  uint64_t h = kFnvOffset;
  h = FnvInt(h, static_cast<int64_t>(tensors.size()));
  for (const auto& [name, t] : tensors) {
    h = FnvInt(h, static_cast<int64_t>(name.size()));
    h = Fnv(h, name.data(), name.size());
    h = FnvInt(h, static_cast<int64_t>(t.scalar_type()));
    h = FnvInt(h, t.dim());
    for (int64_t d : t.sizes()) h = FnvInt(h, d);
  }
  return h;
}

uint64_t ChecksumBytes(const void* data, int64_t bytes, uint64_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t a = seed + kP1 + kP2, b = seed + kP2, c = seed, d = seed - kP1;
  int64_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, sizeof(w));
    a = Round(a, w[0]);
    b = Round(b, w[1]);
    c = Round(c, w[2]);
    d = Round(d, w[3]);
  }
  uint64_t h = Rotl(a, 1) + Rotl(b, 7) + Rotl(c, 12) + Rotl(d, 18) + static_cast<uint64_t>(bytes);
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, sizeof(w));
    h = Rotl(h ^ Round(0, w), 27) * kP1 + kP3;
  }
  for (; i < bytes; ++i) h = Rotl(h ^ (p[i] * 2870177450012600261ull), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  return h;
}

CollectiveWeightSync::CollectiveWeightSync(int rank, int world_size, int64_t epoch,
                                           WeightSyncOptions options)
    : rank_(rank), world_size_(world_size), epoch_(epoch), options_(options) {}

Status CollectiveWeightSync::RequireLive() const {
  if (state_ == State::kAborted) {
    return Status::Aborted(std::string(backend_name()) + " weight-sync group of epoch " +
                           std::to_string(epoch_) + " was aborted; rebuild it with a new epoch");
  }
  return Status::OK();
}

Status CollectiveWeightSync::Fail(const Status& status, const char* what) {
  Abort();
  const std::string context = std::string(backend_name()) + " weight sync (epoch " +
                              std::to_string(epoch_) + ", rank " + std::to_string(rank_) + "/" +
                              std::to_string(world_size_) + ") " + what;
  GRPO_LOG_WARN("{}: {}; group aborted", context, status.ToString());
  return status.WithContext(context);
}

void CollectiveWeightSync::Abort() {
  if (state_ == State::kAborted) return;
  state_ = State::kAborted;
  AbortBackend();
}

Status CollectiveWeightSync::Begin(int64_t version) {
  RETURN_IF_ERROR(RequireLive());
  if (rank_ == 0 && version < 0) {
    return Status::InvalidArgument("the publisher's version must be >= 0, got " +
                                   std::to_string(version));
  }
  if (rank_ != 0 && version < kAnyVersion) {
    return Status::InvalidArgument("expected version must be >= 0 or kAnyVersion, got " +
                                   std::to_string(version));
  }
  std::vector<int64_t> all;
  Status s = AllGatherInt64({version}, &all);
  if (!s.ok()) return Fail(s, "Begin");
  const int64_t offered = all[0];
  std::vector<int> mismatched;
  for (int r = 1; r < world_size_; ++r) {
    if (all[r] != kAnyVersion && all[r] != offered) mismatched.push_back(r);
  }
  state_ = State::kIdle;
  if (!mismatched.empty()) {
    return Status::FailedPrecondition("publisher offers version " + std::to_string(offered) +
                                      " but rank(s) " + RankList(mismatched) + " expected another");
  }
  state_ = State::kBegun;
  version_ = offered;
  bytes_ = 0;
  checksum_ = static_cast<uint64_t>(offered);
  return Status::OK();
}

Status CollectiveWeightSync::Broadcast(NamedTensors& tensors) {
  RETURN_IF_ERROR(RequireLive());
  if (state_ != State::kBegun) return Status::FailedPrecondition("Broadcast before Begin");

  // Every rank validates locally, then all compare: a bad rank must still join the
  // collective, or its peers would wait out the deadline.
  Status local;
  int64_t total = 0;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) {
      local = Status::InvalidArgument("tensor '" + name + "' is undefined");
    } else if (!t.is_contiguous()) {
      local = Status::InvalidArgument("tensor '" + name + "' is not contiguous");
    } else {
      local = CheckTensorMemory(name, t);
    }
    if (!local.ok()) break;
    total += static_cast<int64_t>(t.nbytes());
  }
  const uint64_t fingerprint = local.ok() ? LayoutFingerprint(tensors) : 0;
  std::vector<int64_t> all;
  Status s = AllGatherInt64({local.ok() ? 1 : 0, static_cast<int64_t>(fingerprint), total,
                             static_cast<int64_t>(tensors.size())},
                            &all);
  if (!s.ok()) return Fail(s, "Broadcast (layout check)");
  if (!local.ok()) return local;
  std::vector<int> invalid, differ;
  for (int r = 0; r < world_size_; ++r) {
    const int64_t* row = &all[4 * r];
    if (row[0] == 0) {
      invalid.push_back(r);
    } else if (!std::equal(row + 1, row + 4, all.begin() + 1)) {
      differ.push_back(r);
    }
  }
  if (!invalid.empty()) {
    return Status::InvalidArgument("rank(s) " + RankList(invalid) +
                                   " rejected their tensors (see their logs)");
  }
  if (!differ.empty()) {
    return Status::InvalidArgument("tensor names/dtypes/shapes of rank(s) " + RankList(differ) +
                                   " differ from the publisher's (" + std::to_string(all[3]) +
                                   " tensors, " + std::to_string(all[2]) + " bytes)");
  }
  s = PrepareMemory();
  if (s.ok()) s = BroadcastBuckets(tensors);
  if (!s.ok()) return Fail(s, "Broadcast");
  bytes_ += total;
  return Status::OK();
}

Status CollectiveWeightSync::BroadcastBuckets(NamedTensors& tensors) {
  const bool checksum = options_.verify_checksum && host_memory();
  for (const Bucket& bucket : PlanBuckets(tensors, options_.bucket_bytes)) {
    auto piece_ptr = [&](const BucketPiece& p) {
      return static_cast<uint8_t*>(tensors[p.tensor].second.data_ptr()) + p.tensor_offset;
    };
    uint8_t* buffer = nullptr;
    if (bucket.zero_copy()) {
      buffer = piece_ptr(bucket.pieces[0]);
    } else {
      ASSIGN_OR_RETURN(buffer, Staging(bucket.bytes));
      if (rank_ == 0) {
        for (const BucketPiece& p : bucket.pieces) {
          RETURN_IF_ERROR(CopyBytes(buffer + p.bucket_offset, piece_ptr(p), p.bytes));
        }
      }
    }
    RETURN_IF_ERROR(BroadcastBytes(buffer, bucket.bytes));
    if (checksum) checksum_ = ChecksumBytes(buffer, bucket.bytes, checksum_);
    if (rank_ != 0 && !bucket.zero_copy()) {
      for (const BucketPiece& p : bucket.pieces) {
        RETURN_IF_ERROR(CopyBytes(piece_ptr(p), buffer + p.bucket_offset, p.bytes));
      }
    }
  }
  return Synchronize();
}

Status CollectiveWeightSync::Commit() {
  RETURN_IF_ERROR(RequireLive());
  if (state_ != State::kBegun) return Status::FailedPrecondition("Commit before Begin");
  std::vector<int64_t> all;
  Status s = AllGatherInt64({version_, bytes_, static_cast<int64_t>(checksum_)}, &all);
  if (!s.ok()) return Fail(s, "Commit");
  state_ = State::kIdle;
  std::vector<int> differ;
  for (int r = 1; r < world_size_; ++r) {
    if (!std::equal(all.begin() + 3 * r, all.begin() + 3 * r + 3, all.begin())) {
      differ.push_back(r);
    }
  }
  if (!differ.empty()) {
    return Status::DataLoss("version " + std::to_string(version_) + " not committed: rank(s) " +
                            RankList(differ) +
                            " disagree with the publisher on (version, bytes, checksum)");
  }
  committed_version_ = version_;
  return Status::OK();
}

Status HostMemoryWeightSync::CheckTensorMemory(const std::string& name, const at::Tensor& t) {
  if (!t.device().is_cpu()) {
    return Status::InvalidArgument("tensor '" + name + "' is on " + t.device().str() + "; the " +
                                   backend_name() + " weight sync takes CPU tensors");
  }
  return Status::OK();
}

StatusOr<uint8_t*> HostMemoryWeightSync::Staging(int64_t bytes) {
  if (static_cast<int64_t>(staging_.size()) < bytes) staging_.resize(bytes);
  return staging_.data();
}

Status HostMemoryWeightSync::CopyBytes(void* dst, const void* src, int64_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::OK();
}

}  // namespace grpo::common
