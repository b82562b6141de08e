#include "learner/weight_publisher.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <utility>

#include "common/logging.h"
#include "common/weight_sync/group.h"

namespace grpo::learner {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

WeightPublisher::WeightPublisher(std::string backend,
                                 std::shared_ptr<common::InMemoryEpochStore> store,
                                 common::WeightSyncFactory factory,
                                 std::chrono::milliseconds timeout, int64_t stream_group_bytes)
    : backend_(std::move(backend)),
      store_(std::move(store)),
      factory_(std::move(factory)),
      timeout_(timeout),
      stream_group_bytes_(stream_group_bytes) {}

WeightPublisher::~WeightPublisher() { Close(); }

void WeightPublisher::Close() {
  stream_.reset();  // before sync_, which it refers to
  if (sync_) sync_->Abort();
  sync_.reset();
  group_store_.reset();
  roster_.clear();
}

int64_t WeightPublisher::group_epoch() const { return sync_ ? sync_->epoch() : 0; }

Status WeightPublisher::Fail(int64_t epoch, const Status& s, const char* what) {
  const double seconds = std::chrono::duration<double>(Clock::now() - phase_start_).count();
  GRPO_LOG_WARN(
      "learner: {} weight sync at epoch {} failed after {:.3f} s ({}: {}); rebuilding the group",
      backend_, epoch, seconds, what, s.ToString());
  Close();
  failures_ += 1;
  store_->AdvanceFrom(epoch);
  return s;
}

StatusOr<bool> WeightPublisher::Form(const std::vector<std::string>& members) {
  phase_start_ = Clock::now();
  const int64_t epoch = store_->epoch();
  if (members.empty() || (sync_ && (sync_->epoch() != epoch || roster_ != members))) Close();
  if (members.empty()) return false;
  if (!sync_ && formed_epoch_ == epoch) {
    // A second group in one epoch would reuse the first one's rendezvous keys: end the epoch
    // (every member rebuilds) and form the group in the next one.
    store_->AdvanceFrom(epoch);
    return false;
  }
  if (!sync_) {
    formed_epoch_ = epoch;
    // The roster first: a worker learns its rank from it, then joins.
    const std::shared_ptr<common::EpochStore> shared = store_;
    Status s = store_->Set(epoch, common::RosterKey(backend_), common::FormatRoster(members));
    if (!s.ok()) return Fail(epoch, s, "roster");
    group_store_ = c10::make_intrusive<c10d::PrefixStore>(
        common::GroupPrefix(backend_),
        c10::make_intrusive<common::C10dEpochStore>(shared, epoch, timeout_));
    const int world = static_cast<int>(members.size()) + 1;
    auto created = factory_(backend_, group_store_, 0, world, epoch);
    if (!created.ok()) return Fail(epoch, created.status(), "join");
    sync_ = std::move(created).value();
    roster_ = members;
    seq_ = 0;
    last_sent_ = -1;
    GRPO_LOG_INFO("learner: {} weight-sync group of {} ranks at epoch {}", backend_, world, epoch);
  }
  return true;
}

Status WeightPublisher::Sync(const std::vector<std::string>& members,
                             const std::shared_ptr<const WeightSnapshot>& weights) {
  ASSIGN_OR_RETURN(const bool live, Form(members));
  if (!live) return Status::OK();
  const int64_t epoch = sync_->epoch();
  if (!weights || weights->version <= last_sent_) return Status::OK();
  const bool on_device = backend_ != common::kBackendGloo;
  // A version snapshotted before this group had members has no device copy: the members get
  // it with GetWeights (their receiver's fallback) and the group carries the next one.
  if (on_device && weights->device_tensors.empty()) return Status::OK();
  const auto t0 = Clock::now();
  phase_start_ = t0;  // a failure below is timed from the announcement, not from the join
  // Shares the immutable snapshot's storage.
  common::NamedTensors tensors = on_device ? weights->device_tensors : weights->tensors;
  Status s =
      store_->Set(epoch, common::VersionKey(backend_, seq_),
                  common::FormatVersionAnnouncement({weights->version, weights->incarnation}));
  if (s.ok()) s = sync_->Begin(weights->version);
  if (s.ok()) s = sync_->Broadcast(tensors);
  if (s.ok()) s = sync_->Commit();
  if (!s.ok()) return Fail(epoch, s, "broadcast");
  ++seq_;
  last_sent_ = weights->version;
  syncs_ += 1;
  last_sync_seconds_ = std::chrono::duration<double>(Clock::now() - t0).count();
  GRPO_LOG_INFO("learner: policy version {} broadcast over {} (epoch {}) in {:.3f} s",
                weights->version, backend_, epoch, last_sync_seconds_);
  return Status::OK();
}

Status WeightPublisher::StreamRound(const std::vector<std::string>& members, WeightReaders& readers,
                                    const std::string& incarnation, Clock::time_point deadline,
                                    const common::CancelToken* cancel, bool* waited) {
  *waited = false;
  ASSIGN_OR_RETURN(const bool live, Form(members));
  if (!live) return Status::OK();
  Status streamed = Status::OK();
  const WeightSink sink = [&](const WeightPiece& piece) {
    streamed = StreamPiece(piece, incarnation);
    return streamed.ok();
  };
  const Status read = readers.Read(sink, deadline, cancel, last_sent_);
  *waited = read.code() != StatusCode::kUnavailable;
  if (!streamed.ok()) return streamed;
  if (!read.ok()) {
    // Not served (a deadline, a cancel, readers closed: nothing is open then), or the producer
    // failed mid-version (a rank's gather): the group is left inside it.
    if (stream_) GRPO_LOG_WARN("learner: {} weight sync: {}", backend_, read.ToString());
    AbortOpenStream(read);
  }
  return Status::OK();
}

void WeightPublisher::AbortOpenStream(const Status& why) {
  if (!stream_ || !sync_) return;
  (void)Fail(sync_->epoch(), why, "stream");
}

Status WeightPublisher::StreamPiece(const WeightPiece& piece, const std::string& incarnation) {
  if (!sync_) return Status::FailedPrecondition(backend_ + " weight sync: no group to stream to");
  const int64_t epoch = sync_->epoch();
  if (piece.index == 0) {
    phase_start_ = Clock::now();
    common::VersionAnnouncement a{piece.version, incarnation};
    a.stream_group_bytes = stream_group_bytes_;
    Status s = store_->Set(epoch, common::VersionKey(backend_, seq_),
                           common::FormatVersionAnnouncement(a));
    if (s.ok()) s = sync_->Begin(piece.version);
    if (!s.ok()) return Fail(epoch, s, "stream");
    stream_.emplace(*sync_, stream_group_bytes_, /*copy_grouped=*/true);
  }
  if (!stream_) {
    return Fail(epoch, Status::FailedPrecondition("a piece of a version that was not begun"),
                "stream");
  }
  const bool on_device = backend_ != common::kBackendGloo;
  Status s = Status::OK();
  try {
    // In the groups the receivers make from their layout (common::StreamGroupBroadcast).
    s = stream_->Put(piece.name, on_device ? piece.source : piece.tensor);
    if (s.ok() && piece.index + 1 == piece.count) s = stream_->Finish();
  } catch (const c10::Error& e) {
    s = Status::Internal(e.what_without_backtrace());
  }
  if (s.ok() && piece.index + 1 == piece.count) s = sync_->Commit();
  if (!s.ok()) return Fail(epoch, s, "stream");
  if (piece.index + 1 < piece.count) return Status::OK();
  stream_.reset();
  ++seq_;
  last_sent_ = piece.version;
  syncs_ += 1;
  last_sync_seconds_ = std::chrono::duration<double>(Clock::now() - phase_start_).count();
  GRPO_LOG_INFO("learner: policy version {} streamed over {} (epoch {}, {} tensors) in {:.3f} s",
                piece.version, backend_, epoch, piece.count, last_sync_seconds_);
  return Status::OK();
}

}  // namespace grpo::learner
