#include "learner/learner.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "common/logging.h"
#include "common/model/device.h"
#include "learner/admission.h"
#include "learner/checkpoint.h"

namespace grpo::learner {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A fresh learner incarnation id: 64 random bits, hex. Weights and groups carry it, so that a
// group generated with a dead learner's weights is never taken for one of this learner's.
std::string NewIncarnation() {
  std::random_device rd;
  const uint64_t bits = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(bits));
  return buf;
}

// StepMetrics::ToJson numbers, by TRL name.
std::map<std::string, double> FlattenMetrics(const StepMetrics& step) {
  std::map<std::string, double> out;
  const nlohmann::json j = step.ToJson();
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.value().is_number()) out[it.key()] = it.value().get<double>();
  }
  return out;
}

}  // namespace

Learner::Learner(common::GrpoConfig config, LearnerOptions options)
    : config_(std::move(config)),
      options_(std::move(options)),
      streams_weights_(config_.weight_publish == "stream"),
      readers_([this] {
        common::MutexLock lock(&mu_);
        train_cv_.NotifyAll();
      }) {}

StatusOr<std::unique_ptr<Learner>> Learner::Create(common::GrpoConfig config,
                                                   std::unique_ptr<common::Model> policy,
                                                   std::unique_ptr<common::Model> reference,
                                                   LearnerOptions options) {
  RETURN_IF_ERROR(config.Validate());
  if (policy == nullptr) return Status::InvalidArgument("Learner: no policy model");
  // `device` is resolved before anything is opened: an unusable one fails Create naming the key.
  ASSIGN_OR_RETURN(const at::Device device, common::ResolveDevice(config.device));
  if (!(config.lease_seconds > 0)) {
    return Status::InvalidArgument("config key 'lease_seconds' must be positive");
  }
  if (!options.now_ms) options.now_ms = SystemNowMs;
  if (options.weight_sync_timeout.count() <= 0) {
    options.weight_sync_timeout = std::chrono::milliseconds(
        static_cast<int64_t>(std::ceil(config.weight_sync_timeout_seconds * 1000.0)));
  }
  std::unique_ptr<Learner> s(new Learner(std::move(config), std::move(options)));
  s->mu_.TrackHoldTime();  // grpo_learner_lock_max_hold_seconds: no RPC should wait on I/O
  s->incarnation_ = NewIncarnation();
  s->endpoint_ = common::LocalSyncEndpoint(device.str());
  const common::GrpoConfig& cfg = s->config_;
  s->registry_ = s->options_.metrics_registry;
  if (s->registry_ == nullptr) {
    s->own_registry_ = std::make_unique<common::Registry>();
    s->registry_ = s->own_registry_.get();
  }
  ASSIGN_OR_RETURN(s->metrics_, common::LearnerMetrics::Create(*s->registry_, cfg.reward_funcs));
  // A generation batch of every rank's share (TRL: per_device_train_batch_size x world size x
  // steps_per_generation completions).
  const int64_t world = s->options_.ranks != nullptr ? s->options_.ranks->world_size() : 1;
  s->batch_groups_ = cfg.GenerationBatchGroups() * world;
  if (s->batch_groups_ < 1) {
    return Status::InvalidArgument(
        "config key 'num_generations' exceeds the generation batch "
        "(per_device_train_batch_size * steps_per_generation)");
  }
  s->versions_per_batch_ = cfg.VersionsPerGenerationBatch();
  ASSIGN_OR_RETURN(s->aggregation_,
                   ParseMultiObjectiveAggregation(cfg.multi_objective_aggregation));
  s->buffer_capacity_ = s->options_.buffer_capacity_groups > 0
                            ? std::max(s->options_.buffer_capacity_groups, s->batch_groups_)
                            : 2 * s->batch_groups_;

  std::error_code ec;
  fs::create_directories(cfg.output_dir, ec);
  if (ec) {
    return Status::FailedPrecondition("cannot create output_dir " + cfg.output_dir + ": " +
                                      ec.message());
  }
  const std::string ledger_path = cfg.ledger_path.empty()
                                      ? (fs::path(cfg.output_dir) / "ledger.sqlite").string()
                                      : cfg.ledger_path;
  PromptLedgerOptions ledger_options;
  ledger_options.now_ms = s->options_.now_ms;
  ASSIGN_OR_RETURN(s->ledger_, PromptLedger::Open(ledger_path, ledger_options));

  // The policy trains on `device` in its own dtype (the fp32 master with `bf16`: GrpoTrainer
  // builds the bf16 compute copy), or stays on the host as the master beside a compute copy on
  // `device` (no_shard / shard_grad_op offload); PublishWeights snapshots it to the CPU.
  s->policy_ = std::move(policy);
  ASSIGN_OR_RETURN(const common::FsdpSpec fsdp, common::ParseFsdp(cfg.fsdp));
  RETURN_IF_ERROR(
      s->policy_->To(MasterHome(fsdp, device), s->policy_->dtype()).WithContext("policy"));
  ASSIGN_OR_RETURN(s->trainer_, GrpoTrainer::Create(cfg, s->policy_.get(), std::move(reference),
                                                    s->options_.ranks, device));
  s->trainer_->set_dump_incarnation(s->incarnation_);
  if (s->options_.TEST_micro_batch_fault) {
    s->trainer_->TEST_set_micro_batch_fault(s->options_.TEST_micro_batch_fault);
  }
  if (s->options_.resume) RETURN_IF_ERROR(s->Resume());
  if (s->options_.ranks != nullptr) {
    // The other ranks start from what rank 0 holds now: its restored checkpoint, or its model.
    s->rank_link_ = std::make_unique<distributed::RankZeroLink>(s->options_.ranks);
    RETURN_IF_ERROR(s->rank_link_->Sync());
    RETURN_IF_ERROR(s->trainer_->SyncFromRankZero());
    GRPO_LOG_INFO("learner: rank 0 of {} learner ranks, at step {}", world,
                  s->trainer_->global_step());
  }
  // No other thread sees the learner yet; the lock costs nothing and keeps the rule simple.
  common::MutexLock lock(&s->mu_);
  s->batch_fill_ = BatchFillCounter(s->batch_groups_, cfg.max_num_gen_batches);
  s->global_step_ = s->trainer_->global_step();
  s->last_saved_step_ = s->global_step_;
  s->metrics_.policy_version->Set(static_cast<double>(s->trainer_->policy_version()));
  if (s->global_step_ >= cfg.max_steps) {
    s->state_ = JobState::kDone;
    s->message_ = "max_steps reached";
  }
  return s;
}

Status Learner::Resume() {
  const std::string& out = config_.output_dir;
  auto restored = RestoreLatestCheckpoint(*trainer_, out);
  if (restored.ok()) {
    GRPO_LOG_INFO("learner: resumed from {} at step {}", *restored, trainer_->global_step());
  } else if (restored.status().code() != StatusCode::kNotFound) {
    return restored.status().WithContext("resume");
  }
  // The ledger follows the weights: what the restored step does not hold (trainings after it,
  // groups accepted but never trained, pass boundaries crossed since) is undone.
  ASSIGN_OR_RETURN(RollbackResult undone, ledger_->RollbackTo(trainer_->global_step()));
  if (undone.requeued + undone.trainings_undone + undone.moved_back > 0) {
    GRPO_LOG_INFO(
        "learner: ledger rolled back to step {}: {} trainings undone, {} prompts requeued, {} "
        "moved back to a pass they owe",
        trainer_->global_step(), undone.trainings_undone, undone.requeued, undone.moved_back);
  }
  // So do the batch dumps: a dead learner's steps after the restored one are redone.
  ASSIGN_OR_RETURN(const int64_t removed, trainer_->RemoveDumpsAfter(trainer_->global_step()));
  if (removed > 0) {
    GRPO_LOG_INFO("learner: removed {} batch dump files of steps after {}", removed,
                  trainer_->global_step());
  }
  return Status::OK();
}

Learner::~Learner() {
  (void)Stop(/*checkpoint=*/false);
  EndLedger();
}

Status Learner::Start() {
  {
    common::MutexLock lock(&mu_);
    if (started_) return Status::FailedPrecondition("Learner already started");
    started_ = true;
  }
  RETURN_IF_ERROR(PublishWeights());
  started_ok_ = true;
  train_thread_ = std::thread([this] { TrainLoop(); });
  for (size_t i = 0; i < common::GroupBackends().size(); ++i) {
    sync_threads_.emplace_back([this, i] { WeightSyncLoop(i); });
  }
  return Status::OK();
}

Status Learner::Stop(bool checkpoint) {
  {
    common::MutexLock lock(&mu_);
    if (stopped_) return Status::OK();
    stopped_ = true;
    stopping_ = true;
    for (auto& sub : subscribers_) sub->cv.NotifyAll();
  }
  GRPO_LOG_INFO("learner: the longest hold of the state lock was {:.6f} s", mu_.max_hold_seconds());
  train_cv_.NotifyAll();
  room_cv_.NotifyAll();
  state_cv_.NotifyAll();
  epoch_store_->Stop();
  if (train_thread_.joinable()) train_thread_.join();
  readers_.Close();  // after the training thread: none is served any more
  for (std::thread& t : sync_threads_) {
    if (t.joinable()) t.join();
  }

  Status result;
  bool done = false;
  {
    common::MutexLock lock(&mu_);
    done = state_ == JobState::kDone;
  }
  if (checkpoint && !done && trainer_->open_step_micro_batches() > 0) {
    // Stopping inside an optimizer step: take it with the micro-batches it has (the ledger
    // already recorded its groups under that step), so that the checkpoint holds them. Not at
    // max_steps: the job ended there, and its open step's groups went back to the queue.
    const Status posted = rank_link_ ? rank_link_->Flush() : Status::OK();
    auto flushed =
        posted.ok() ? trainer_->FlushPartialStep() : StatusOr<std::optional<StepMetrics>>(posted);
    if (flushed.ok() && flushed->has_value()) {
      RecordStepMetrics(**flushed);
      common::MutexLock lock(&mu_);
      global_step_ = trainer_->global_step();
    } else if (!flushed.ok()) {
      GRPO_LOG_WARN("learner: flush the open step at stop: {}", flushed.status().ToString());
    }
  }
  bool need_save = false;
  {
    common::MutexLock lock(&mu_);
    need_save = checkpoint && global_step_ > last_saved_step_ && !training_failed_;
    if (checkpoint && training_failed_) {
      // Steps the failed batch took are in the weights but its groups are QUEUED again: saving
      // would train them twice after a restart. The last checkpoint stays the one to resume;
      // EndLedger rolls the ledger back to it.
      GRPO_LOG_WARN("learner: no checkpoint at stop: training failed (the last is step {})",
                    last_saved_step_);
    }
  }
  if (need_save) result = CheckpointWithRetry(kFinalCheckpointAttempts);
  if (rank_link_) {
    // After the last checkpoint, which the other ranks take part in when AdamW is sharded: they
    // leave their loops (a rank already gone makes this fail: nothing to tell).
    if (Status s = rank_link_->Stop(); !s.ok()) GRPO_LOG_WARN("learner: {}", s.ToString());
  }
  return result;
}

void Learner::EndLedger() {
  int64_t saved = 0;
  {
    common::MutexLock lock(&mu_);
    if (!stopped_ || ledger_ended_ || !started_ok_) return;
    ledger_ended_ = true;
    saved = last_saved_step_;
  }
  // After the last call: nothing can join the buffer any more.
  EndLedgerAtStep(saved);
}

bool Learner::WaitForJobEnd(std::chrono::milliseconds timeout) {
  common::MutexLock lock(&mu_);
  const auto deadline = Clock::now() + timeout;  // as wait_for: from when the lock is held
  while (!TerminalLocked()) {
    if (!state_cv_.WaitUntil(&mu_, deadline)) return TerminalLocked();
  }
  return true;
}

JobState Learner::job_state() const {
  common::MutexLock lock(&mu_);
  return state_;
}

int64_t Learner::published_version() const {
  common::MutexLock lock(&mu_);
  return published_version_;
}

std::map<std::string, int64_t> Learner::RefusedCounts() const {
  common::MutexLock lock(&mu_);
  return refused_;
}

Status Learner::Health() const {
  common::MutexLock lock(&mu_);
  if (state_ != JobState::kFailed) return Status::OK();
  return Status::Unavailable("job failed: " + message_);
}

bool Learner::TerminalLocked() const { return IsTerminal(state_); }

bool Learner::JobOverForWorkersLocked() const {
  return state_ == JobState::kDone || state_ == JobState::kCancelled;
}

bool Learner::ShuttingDownForWorkersLocked() const {
  return stopping_ || state_ == JobState::kFailed;
}

// ---------------------------------------------------------------------------------------------
// Training thread.

void Learner::TrainLoop() {
  auto last_housekeep = Clock::now() - kHousekeepInterval;
  while (true) {
    std::vector<BufferedGroup> batch;
    BatchFill fill;
    bool batch_drained = false;  // a short batch for an owed pass, not for max_num_gen_batches
    bool housekeep = false;
    std::vector<std::string> dropped;
    {
      common::MutexLock lock(&mu_);
      const auto deadline = Clock::now() + kWaitPollInterval;
      while (!stopping_ && !housekeep_due_ && !(!TerminalLocked() && BatchReadyLocked()) &&
             !(streams_weights_ && readers_.waiting(published_version_) > 0)) {
        if (!train_cv_.WaitUntil(&mu_, deadline)) break;
      }
      if (stopping_) return;
      dropped = DropDeadWorkersLocked();
      housekeep = housekeep_due_ || Clock::now() - last_housekeep >= kHousekeepInterval ||
                  BatchReadyLocked();
      housekeep_due_ = false;
    }
    ReturnLeasesOfDropped(dropped);
    if (streams_weights_) ServeReadersBetweenSteps();
    if (housekeep) {
      Housekeep();
      last_housekeep = Clock::now();
    }
    // A dead worker's leases that went back, or a housekeeping pass (the job state, a pass
    // boundary), may free lease budget that a LeasePrompts long poll is waiting for.
    if (housekeep || !dropped.empty()) room_cv_.NotifyAll();
    {
      common::MutexLock lock(&mu_);
      if (stopping_) return;
      if (TerminalLocked() || !BatchReadyLocked()) continue;
      // A full batch, or (dynamic sampling, after max_num_gen_batches batches' worth) what the
      // buffer holds.
      const int64_t take = std::min<int64_t>(batch_groups_, buffer_.size());
      batch_drained = drain_buffer_ && take < batch_groups_;
      for (int64_t i = 0; i < take; ++i) {
        batch.push_back(std::move(buffer_.front()));
        buffer_.pop_front();
      }
      fill = batch_fill_.Take(take);
      drain_buffer_ = false;
      metrics_.buffer_groups->Set(static_cast<double>(buffer_.size()));
      training_ = true;
    }
    room_cv_.NotifyAll();
    if (fill.short_batch && !batch_drained) {
      metrics_.short_batches->Increment();
      GRPO_LOG_WARN(
          "learner: dynamic sampling: training a short batch of {} groups (of {}): {} groups "
          "were filtered for it, max_num_gen_batches {} reached",
          batch.size(), batch_groups_, fill.groups_filtered, config_.max_num_gen_batches);
    }
    TrainBatch(std::move(batch), fill);
    {
      common::MutexLock lock(&mu_);
      training_ = false;
      // This batch may have been the pass's last: housekeeping starts the next one now, for
      // the leases that wait for its prompts, not kHousekeepInterval later.
      housekeep_due_ = true;
    }
    room_cv_.NotifyAll();  // leases held back for staleness may go out now
  }
}

void Learner::ServeReadersBetweenSteps() {
  bool publish = false;
  {
    common::MutexLock lock(&mu_);
    if (readers_.waiting(published_version_) == 0) return;
    if (global_step_ != last_published_step_) {
      // The weights are past the published version (weight_sync_steps > 1): the readers wait
      // for the next publish while batches train, and get this step published now when none
      // is ready (they may be the workers that would fill it).
      if (!TerminalLocked() && BatchReadyLocked()) return;
      publish = true;
    }
  }
  const Status s = publish ? PublishWeights() : ServeWeightReaders();
  if (!s.ok()) GRPO_LOG_ERROR("learner: publish for the weights' readers: {}", s.ToString());
}

void Learner::Housekeep() {
  RefreshLedgerMetrics();
  {
    common::MutexLock lock(&mu_);
    if (TerminalLocked()) return;
  }
  auto counts = ledger_->Counts();
  if (!counts.ok()) {
    GRPO_LOG_WARN("learner: ledger counts: {}", counts.status().ToString());
    return;
  }
  if (counts->queued + counts->leased == 0 && counts->done() > 0 && PassMayEnd()) {
    // Every prompt of this pass is trained, rejected, or accepted into the buffer, and the job
    // needs more steps than the buffer's whole batches give: start the next pass now, so that
    // workers generate its first groups while the buffered batches train (the buffer is first
    // in, first out: the pass's groups train before the next pass's, its last partial batch
    // together with the next pass's first groups).
    auto next = ledger_->StartNextPass(std::numeric_limits<int64_t>::max());
    if (next.ok() && *next) {
      GRPO_LOG_INFO("learner: pass {} done; starting pass {}", counts->pass, counts->pass + 1);
      counts->queued = counts->done();
    } else if (!next.ok() && next.status().code() != StatusCode::kFailedPrecondition) {
      GRPO_LOG_WARN("learner: start next pass: {}", next.status().ToString());
    } else if (!next.ok()) {
      // Nothing queued or leased, yet the pass cannot end: a prompt owes an earlier pass, which
      // is queued only after its later group (in the partial batch) trains. Nothing else will
      // fill that batch (with dynamic sampling the rest of the pass may all be filtered): it
      // trains now.
      common::MutexLock lock(&mu_);
      if (!buffer_.empty() && !drain_buffer_ && !BatchReadyLocked()) {
        drain_buffer_ = true;
        GRPO_LOG_INFO(
            "learner: pass {} owes a training ({}); the {} buffered groups train now, short of a "
            "batch",
            counts->pass, next.status().message(), buffer_.size());
        train_cv_.NotifyAll();
      }
    }
  }
  JobState want =
      counts->queued + counts->leased > 0 ? JobState::kRunning : JobState::kWaitingForData;
  {
    common::MutexLock lock(&mu_);
    if (want == JobState::kWaitingForData && !buffer_.empty()) want = JobState::kRunning;
    if (state_ == want || TerminalLocked()) return;
  }
  ChangeState(want, want == JobState::kRunning ? "" : "no prompts to lease");
}

bool Learner::PassMayEnd() {
  std::vector<BufferedGroup> stale;
  {
    common::MutexLock lock(&mu_);
    // Groups being accepted: wait.
    if (!accepting_ms_.empty() || training_) return false;
    // The whole batches buffered already take the job to max_steps: the next pass would only
    // be generated and dropped. (Were the count short, the pass starts after they trained.)
    const int64_t whole_batches = static_cast<int64_t>(buffer_.size()) / batch_groups_;
    if (global_step_ + whole_batches * versions_per_batch_ >= config_.max_steps) return false;
    // A buffered group already too stale at the current policy version (it only gets staler
    // before it trains) goes back to its pass now, so that the pass is not left owing it.
    for (auto it = buffer_.begin(); it != buffer_.end();) {
      RejectReason reason = RejectReason::kGroupSize;
      if (!trainer_->ValidateGroup(it->group, &reason).ok() && reason == RejectReason::kStale) {
        stale.push_back(std::move(*it));
        it = buffer_.erase(it);
      } else {
        ++it;
      }
    }
    metrics_.buffer_groups->Set(static_cast<double>(buffer_.size()));
  }
  for (const auto& b : stale) {
    RequeueUntrained({b.group.prompt_id, b.pass}, "stale at the end of its pass");
    const std::string_view stale = common::GroupRefusalName(common::GroupRefusal::kStale);
    metrics_.groups_rejected->Increment({stale});
    common::MutexLock lock(&mu_);
    ++refused_[std::string(stale)];
  }
  return stale.empty();
}

std::vector<std::string> Learner::DropDeadWorkersLocked() {
  const auto cutoff = Clock::now() - options_.heartbeat_interval * kHeartbeatsMissedBeforeDrop;
  const std::vector<std::string> dropped = workers_.DropSilentSince(cutoff);
  // The group is rebuilt under a new epoch.
  if (!dropped.empty()) epoch_store_->Advance();
  return dropped;
}

void Learner::ReturnLeasesOfDropped(const std::vector<std::string>& dropped) {
  for (const std::string& id : dropped) {
    // Its leases go back to the queue now rather than after lease_seconds (ledger_ has its
    // own lock and never calls back into the learner; called without mu_: a commit is fsynced).
    auto moved = ledger_->ExpireWorkerLeases(id);
    GRPO_LOG_WARN("learner: worker {} missed its heartbeats; dropped from the group ({})",
                  common::EscapeForLog(id),
                  moved.ok() ? std::to_string(*moved) + " leases returned to the queue"
                             : moved.status().ToString());
  }
}

bool Learner::BatchReadyLocked() const {
  const auto buffered = static_cast<int64_t>(buffer_.size());
  return buffered >= batch_groups_ || batch_fill_.ShortBatchDue(buffered) ||
         (drain_buffer_ && buffered > 0);
}

void Learner::TrainBatch(std::vector<BufferedGroup> batch, BatchFill fill) {
  std::vector<common::RolloutGroup> groups;
  std::vector<TrainedGroup> keys;  // (prompt, pass) of groups[i]
  groups.reserve(batch.size());
  for (auto& b : batch) {
    keys.push_back({b.group.prompt_id, b.pass});
    groups.push_back(std::move(b.group));
  }
  StatusOr<GenerationBatchResult> result = Status::Internal("not run");
  try {
    const Status posted = rank_link_ ? rank_link_->Train(groups) : Status::OK();
    result = posted.ok() ? trainer_->TrainGenerationBatch(groups)
                         : StatusOr<GenerationBatchResult>(posted);
  } catch (const c10::Error& e) {
    result = Status::Internal(std::string("training: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    result = Status::Internal(std::string("training: ") + e.what());
  }
  if (!result.ok()) {
    GRPO_LOG_ERROR("learner: {}", result.status().ToString());
    {
      common::MutexLock lock(&mu_);
      training_failed_ = true;
    }
    for (const auto& k : keys) RequeueUntrained(k, "training failed");
    ChangeState(JobState::kFailed, result.status().ToString());
    return;
  }
  // Groups that went stale in the buffer were never trained: their prompts owe that pass.
  std::vector<bool> refused(keys.size(), false);
  for (const auto& [prompt_id, reason] : result->rejected) {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!refused[i] && keys[i].prompt_id == prompt_id) {
        refused[i] = true;
        RequeueUntrained(keys[i], RejectReasonName(reason));
        break;
      }
    }
    metrics_.groups_rejected->Increment({RejectReasonName(reason)});
    common::MutexLock lock(&mu_);
    ++refused_[std::string(RejectReasonName(reason))];
  }
  // The rest are in the weights after the step now taken, or after the next one when the batch
  // ended inside an optimizer step (checkpoints are never taken inside one, see below).
  const int64_t step = trainer_->global_step();
  const bool open_step = trainer_->open_step_micro_batches() > 0;
  {
    std::vector<TrainedGroup> trained;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!refused[i]) trained.push_back(keys[i]);
    }
    auto marked = ledger_->MarkTrained(trained, open_step ? step + 1 : step);
    if (!marked.ok()) {
      GRPO_LOG_ERROR("learner: ledger: {}", marked.status().ToString());
      metrics_.ledger_errors->Increment();
    }
  }
  for (const auto& sm : result->steps) RecordStepMetrics(sm);
  // The step's metrics by TRL name, with what dynamic sampling spent on its batch.
  const auto step_metrics = [&](const StepMetrics& sm) {
    std::map<std::string, double> m = FlattenMetrics(sm);
    if (config_.dynamic_sampling) {
      m["dynamic_sampling/groups_filtered"] = static_cast<double>(fill.groups_filtered);
      m["dynamic_sampling/num_gen_batches"] = static_cast<double>(fill.num_gen_batches);
      m["dynamic_sampling/short_batch"] = fill.short_batch ? 1.0 : 0.0;
    }
    return m;
  };
  if (!result->steps.empty()) RefreshLedgerMetrics();

  bool publish = false;
  {
    common::MutexLock lock(&mu_);
    global_step_ = step;
    if (!result->steps.empty()) last_metrics_ = step_metrics(result->steps.back());
    publish = step - last_published_step_ >= std::max<int64_t>(1, config_.weight_sync_steps) ||
              step >= config_.max_steps;
  }
  if (publish) {
    if (Status s = PublishWeights(); !s.ok()) GRPO_LOG_ERROR("learner: publish: {}", s.ToString());
  }
  if (!result->steps.empty()) {
    const JobSnapshot job = Snapshot();
    for (const auto& sm : result->steps) {
      JobEvent event;
      event.job = job;
      event.job.global_step = sm.step;
      event.job.policy_version = sm.policy_version;
      event.step = sm.step;
      event.metrics = step_metrics(sm);
      Broadcast(event);
    }
  }
  int64_t last_saved = 0;
  {
    common::MutexLock lock(&mu_);
    last_saved = last_saved_step_;
  }
  const bool finished = step >= config_.max_steps;
  if (finished) {
    // The final weights: a failure is retried, and after the last attempt the job fails (the
    // result cannot be kept). An optimizer step still open is not taken (TRL stops at max_steps
    // too); its groups go back to the queue with the buffered ones.
    if (step > last_saved) {
      if (Status s = CheckpointWithRetry(kFinalCheckpointAttempts); !s.ok()) {
        ChangeState(JobState::kFailed, "final checkpoint: " + s.ToString());
        return;
      }
    }
    EndLedgerAtStep(step);
    ChangeState(JobState::kDone, "max_steps reached");
    return;
  }
  // A periodic checkpoint waits for a boundary between optimizer steps: the ledger then knows
  // exactly which groups its weights hold. A failed one is logged and counted, the previous
  // checkpoint stays the one a restart uses, and the next batch tries again.
  const bool save_due =
      config_.save_steps > 0 && step / config_.save_steps > last_saved / config_.save_steps;
  if (save_due && step > last_saved && !open_step) {
    if (Status s = Checkpoint(); !s.ok()) {
      GRPO_LOG_ERROR(
          "learner: checkpoint at step {} failed ({}); training goes on and the next "
          "batch retries it",
          step, s.ToString());
    }
  }
}

void Learner::RequeueUntrained(const TrainedGroup& key, std::string_view why) {
  auto moved = ledger_->RequeueTrained(key.prompt_id, key.pass);
  if (!moved.ok()) {
    // Never silent: the prompt would miss a pass.
    GRPO_LOG_ERROR("learner: requeue {} (pass {}, {}): {}", key.prompt_id, key.pass, why,
                   moved.status().ToString());
    metrics_.ledger_errors->Increment();
  }
}

Status Learner::PublishWeights() {
  if (streams_weights_) {
    // No copy: the version is announced, and whoever reads it is served from the policy now
    // (and at any later point where it is still this version: TrainLoop).
    {
      common::MutexLock lock(&mu_);
      published_version_ = trainer_->policy_version();
      last_published_step_ = global_step_;
    }
    state_cv_.NotifyAll();
    return ServeWeightReaders();
  }
  const auto publish_start = Clock::now();
  auto snap = std::make_shared<WeightSnapshot>();
  // A copy on the GPU too while a worker gets its weights over a GPU backend (NCCL, CUDA IPC):
  // it costs one model's memory there, so only then.
  bool on_device = false;
  const at::Device device = trainer_->compute_model().device();
  if (!device.is_cpu()) {
    common::MutexLock lock(&mu_);
    on_device = workers_.AnyAssigned({common::kBackendNccl, common::kBackendCudaIpc});
  }
  // full_shard (and shard_grad_op's sharded fp32 master): the weights exist whole nowhere;
  // every rank joins their gather (a unit or a bucket at a time, each copied to the CPU here).
  common::NamedTensors gathered;
  if (trainer_->optimizer().ShardsParameters()) {
    if (rank_link_) RETURN_IF_ERROR(rank_link_->Publish());
    ASSIGN_OR_RETURN(
        gathered, trainer_->optimizer().GatherWeights("gather of the weights to publish at step " +
                                                          std::to_string(trainer_->global_step()),
                                                      /*every_rank=*/false));
  }
  try {
    at::NoGradGuard no_grad;
    snap->version = trainer_->policy_version();
    snap->incarnation = incarnation_;
    const bool sharded = trainer_->optimizer().ShardsParameters();
    if (sharded && !on_device) {
      // Fresh contiguous CPU tensors already: they become the snapshot as they are (a copy
      // would hold the weights a third time beside the published version while it is made).
      snap->tensors = std::move(gathered);
    } else {
      for (const auto& [name, t] : sharded ? gathered : policy_->NamedParameters()) {
        if (on_device) {  // the master may be on the host (offload): copied to the device
          at::Tensor copy = t.detach()
                                .to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true)
                                .contiguous();
          // The CPU copy is made from the device copy and waits for it, so both are complete
          // when the snapshot is published.
          snap->tensors.emplace_back(name, copy.to(at::kCPU));
          snap->device_tensors.emplace_back(name, std::move(copy));
        } else {
          snap->tensors.emplace_back(name, t.detach().to(at::kCPU).contiguous().clone());
        }
      }
    }
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("snapshot weights: ") + e.what_without_backtrace());
  }
  // Observed before the version becomes visible: whoever sees published_version() >= v (under
  // mu_) also sees this observation (learner_metrics_test raced with it when it came after).
  metrics_.weight_sync_duration->Observe(
      std::chrono::duration<double>(Clock::now() - publish_start).count());
  {
    common::MutexLock lock(&mu_);
    published_version_ = snap->version;
    weights_ = std::move(snap);
    last_published_step_ = global_step_;
  }
  state_cv_.NotifyAll();
  return Status::OK();
}

Status Learner::ServeWeightReaders() {
  int64_t version = 0;
  {
    common::MutexLock lock(&mu_);
    version = published_version_;
  }
  if (readers_.waiting(version) == 0) return Status::OK();
  const auto start = Clock::now();
  const size_t count = policy_->NamedParameters().size();
  const bool sharded = trainer_->optimizer().ShardsParameters();
  const Status served = readers_.Serve(version, count, [&](const WeightPut& put) -> Status {
    if (!sharded) {
      at::NoGradGuard no_grad;
      for (const auto& [name, t] : policy_->NamedParameters()) put(name, t);
      return Status::OK();
    }
    // Sharded: every rank joins the gather, a unit (or bucket) at a time; rank 0 hands each
    // one's tensors on and frees it before the next.
    if (rank_link_) RETURN_IF_ERROR(rank_link_->Publish());
    return trainer_->optimizer().StreamWeights(
        "gather of the weights to stream at version " + std::to_string(version), false,
        [&](const std::string& name, const at::Tensor& t) {
          put(name, t);
          return Status::OK();
        });
  });
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  metrics_.weight_sync_duration->Observe(seconds);
  if (!served.ok()) {
    GRPO_LOG_ERROR("learner: streaming version {} to its readers: {}", version, served.ToString());
  } else {
    GRPO_LOG_INFO("learner: policy version {} streamed to its readers in {:.3f} s", version,
                  seconds);
  }
  return served;
}

void Learner::WeightSyncLoop(size_t index) {
  const std::string backend(common::GroupBackends()[index]);
  common::WeightSyncFactory factory = options_.weight_sync_factory;
  if (!factory) {
    common::WeightSyncBackendOptions o;
    o.timeout = options_.weight_sync_timeout;
    o.hostname = options_.weight_sync_hostname.empty() ? config_.weight_sync_hostname
                                                       : options_.weight_sync_hostname;
    o.cuda_device = std::max(0, common::CudaOrdinal(trainer_->compute_model().device().str()));
    factory = common::BuiltinWeightSyncFactory(o);
  }
  WeightPublisher publisher(backend, epoch_store_, std::move(factory),
                            options_.weight_sync_timeout);
  GroupStats& stats = group_stats_[index];
  bool waited = false;  // stream: the last round waited in WeightReaders::Read
  while (true) {
    std::shared_ptr<const WeightSnapshot> snap;
    std::vector<std::string> members;
    {
      common::MutexLock lock(&mu_);
      if (!waited) state_cv_.WaitFor(&mu_, kWaitPollInterval);
      if (stopping_) break;
      snap = weights_;
      members = workers_.Members(backend);
    }
    // A failure is logged and ends the epoch. Only a deadline that expired is a stall: an epoch
    // that ended under a rendezvous (a registration) or a peer that closed its connections (it
    // died) fails at once, and says nothing of who is silent.
    // Streaming, the round waits in readers_ for kWaitPollInterval at most, then looks at the
    // membership again.
    const Status synced =
        streams_weights_ ? publisher.StreamRound(members, readers_, incarnation_,
                                                 Clock::now() + kWaitPollInterval, nullptr, &waited)
                         : publisher.Sync(members, snap);
    if (synced.code() == StatusCode::kDeadlineExceeded) SuspendStalledMembers(backend, members);
    stats.syncs = publisher.syncs();
    stats.failures = publisher.failures();
  }
  publisher.Close();
}

void Learner::SuspendStalledMembers(const std::string& backend,
                                    const std::vector<std::string>& members) {
  // A live worker heartbeats every heartbeat_interval; one not heard from for 1.5 of them when
  // the collective gave up is taken for the one that stalled it (the deadline is above that:
  // a peer stopped before the collective began is always caught; one stopped in its last 1.5
  // intervals only by the next failure, a second deadline at most).
  const auto cutoff = Clock::now() - options_.heartbeat_interval * 3 / 2;
  common::MutexLock lock(&mu_);
  const std::vector<std::string> out = workers_.SuspendSilentSince(members, cutoff);
  for (const std::string& id : out) {
    GRPO_LOG_WARN(
        "learner: worker {} sent no heartbeat while the {} weight sync waited for it; left out "
        "of the group until it heartbeats again",
        common::EscapeForLog(id), backend);
  }
}

int64_t Learner::group_syncs(std::string_view backend) const {
  const auto& all = common::GroupBackends();
  const auto it = std::find(all.begin(), all.end(), backend);
  return it == all.end() ? 0 : group_stats_[it - all.begin()].syncs.load();
}

int64_t Learner::group_sync_failures(std::string_view backend) const {
  const auto& all = common::GroupBackends();
  const auto it = std::find(all.begin(), all.end(), backend);
  return it == all.end() ? 0 : group_stats_[it - all.begin()].failures.load();
}

Status Learner::Checkpoint() {
  const auto save_start = Clock::now();
  // No watermark is needed: the ledger records the step of every training (MarkTrained), so
  // restoring this checkpoint rolls the ledger back to exactly what its weights hold.
  const std::string name = "checkpoint-" + std::to_string(trainer_->global_step());
  StatusOr<std::string> dir = Status::Internal("not run");
  try {
    const Status fault = options_.TEST_checkpoint_fault
                             ? options_.TEST_checkpoint_fault(trainer_->global_step())
                             : Status::OK();
    if (fault.ok()) {
      // The other ranks join SaveCheckpoint's gather of a sharded AdamW state.
      const Status posted = rank_link_ ? rank_link_->Checkpoint() : Status::OK();
      dir = posted.ok() ? SaveCheckpoint(*trainer_, config_.output_dir, options_.model_dir)
                        : StatusOr<std::string>(posted);
    } else {
      dir = fault;
    }
  } catch (const std::exception& e) {
    dir = Status::Internal(std::string("save checkpoint: ") + e.what());
  }
  if (!dir.ok()) {
    metrics_.checkpoint_failures->Increment();
    return dir.status();
  }
  if (fs::path(*dir).filename().string() != name) {
    return Status::Internal("checkpoint saved as " + *dir + ", expected " + name);
  }
  {
    common::MutexLock lock(&mu_);
    last_saved_step_ = trainer_->global_step();
  }
  metrics_.checkpoint_duration->Observe(
      std::chrono::duration<double>(Clock::now() - save_start).count());
  GRPO_LOG_INFO("learner: saved {}", *dir);
  for (const std::string& old : PruneCheckpoints(config_.output_dir, config_.save_total_limit)) {
    GRPO_LOG_INFO("learner: removed {} (save_total_limit {})", old, config_.save_total_limit);
  }
  return Status::OK();
}

Status Learner::CheckpointWithRetry(int attempts) {
  Status s;
  auto delay = std::chrono::milliseconds(500);
  for (int i = 0; i < attempts; ++i) {
    s = Checkpoint();
    if (s.ok()) return s;
    GRPO_LOG_ERROR("learner: checkpoint attempt {}/{} failed: {}", i + 1, attempts, s.ToString());
    if (i + 1 < attempts) {
      std::this_thread::sleep_for(delay);
      delay *= 2;
    }
  }
  return s;
}

void Learner::EndLedgerAtStep(int64_t saved_step) {
  std::deque<BufferedGroup> dropped;
  {
    common::MutexLock lock(&mu_);
    dropped.swap(buffer_);
    metrics_.buffer_groups->Set(0);
  }
  // Buffered groups were accepted but never trained, and trainings after the saved step are in
  // no weights that outlive this process: the ledger says so (their prompts are QUEUED again).
  auto undone = ledger_->RollbackTo(saved_step);
  if (!undone.ok()) {
    GRPO_LOG_ERROR("learner: ledger at job end: {}", undone.status().ToString());
    return;
  }
  if (!dropped.empty() || undone->requeued > 0 || undone->moved_back > 0) {
    GRPO_LOG_INFO(
        "learner: {} buffered groups dropped at job end; {} prompts back to QUEUED, {} back to "
        "a pass they owe",
        dropped.size(), undone->requeued, undone->moved_back);
  }
}

void Learner::ChangeState(JobState state, const std::string& message) {
  {
    common::MutexLock lock(&mu_);
    if (TerminalLocked() || state_ == state) return;
    state_ = state;
    message_ = message;
  }
  // The message may be a client's cancel reason.
  GRPO_LOG_INFO("learner: job {}{}{}", JobStateName(state), message.empty() ? "" : ": ",
                common::EscapeForLog(message));
  state_cv_.NotifyAll();
  room_cv_.NotifyAll();
  train_cv_.NotifyAll();
  JobEvent event;
  event.job = Snapshot();
  event.step = event.job.global_step;
  Broadcast(event);
}

void Learner::Broadcast(const JobEvent& event) {
  common::MutexLock lock(&mu_);
  for (auto& sub : subscribers_) {
    if (sub->dropped) continue;
    if (sub->events.size() >= kWatchQueueCapacity) {
      sub->dropped = true;  // never block training on a slow reader
      sub->events.clear();
    } else {
      sub->events.push_back(event);
    }
    sub->cv.NotifyAll();
  }
}

}  // namespace grpo::learner
