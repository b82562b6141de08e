// learner::Learner, its outside: what workers and clients ask (registration, heartbeats, the
// lease budget, the ingest policy, weights, datasets, the job and its events). The training
// thread, checkpoints and publishing are in learner.cc.
#include <algorithm>
#include <cmath>

#include "common/logging.h"
#include "learner/admission.h"
#include "learner/learner.h"

namespace grpo::learner {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

JobSnapshot Learner::Snapshot() {
  JobSnapshot job;
  auto counts = ledger_->Counts();
  if (counts.ok()) {
    job.queued = counts->queued;
    job.leased = counts->leased;
    job.trained = counts->trained;
    job.rejected = counts->rejected;
    job.filtered = counts->filtered;
    job.pass = counts->pass;
  }
  common::MutexLock lock(&mu_);
  job.state = state_;
  job.global_step = global_step_;
  job.max_steps = config_.max_steps;
  job.policy_version = published_version_ >= 0 ? published_version_ : trainer_->policy_version();
  job.workers = workers_.size();
  job.last_metrics = last_metrics_;
  job.message = message_;
  if (!counts.ok()) job.message += (job.message.empty() ? "" : "; ") + counts.status().ToString();
  return job;
}

// ---------------------------------------------------------------------------------------------
// Workers.

StatusOr<common::Registration> Learner::Register(const common::RegisterRequest& request) {
  const std::string model_config = policy_->config().ToJson().dump();
  const std::string config_json = config_.ToJson().dump();
  common::Registration r = RegisterWorker(request);
  // Leases granted to this id before now belong to a process that is gone (a worker leases
  // only between registrations, never across one): back to the queue now, not after
  // lease_seconds, so they neither wait nor block the staleness budget. After mu_: the ledger
  // has its own lock, and its commit is fsynced.
  if (auto moved = ledger_->ExpireWorkerLeases(r.worker_id); moved.ok() && *moved > 0) {
    GRPO_LOG_INFO(
        "learner: worker {} registered again: {} leases of its earlier process "
        "returned to the queue",
        common::EscapeForLog(r.worker_id), *moved);
  }
  r.config_json = config_json;
  r.model_config_json = model_config;
  return r;
}

common::Registration Learner::RegisterWorker(const common::RegisterRequest& request) {
  common::MutexLock lock(&mu_);
  const common::SyncEndpoint worker_end{common::CudaOrdinal(request.device) >= 0, request.gpu_uuid};
  const common::BackendAssignment assigned = common::AssignBackend(
      request.weight_sync_backend, endpoint_, worker_end, [&](std::string_view b) {
        return options_.weight_sync_factory ? true : common::WeightSyncBackendBuilt(b);
      });
  const WorkerRegistry::Registered w =
      workers_.Register(request.worker_id, request.hostname, request.pid,
                        request.weight_sync_backend, assigned.backend, Clock::now());
  if (w.is_new) {
    epoch_store_->Advance();  // the group gains a rank: rebuilt under a new epoch
    // Everything but the rank and the assigned backend comes from the worker.
    GRPO_LOG_INFO("learner: worker {} ({}:{}, {}) registered as rank {}; weight sync {}{}",
                  common::EscapeForLog(w.worker_id), common::EscapeForLog(request.hostname),
                  request.pid,
                  request.device.empty() ? "cpu" : common::EscapeForLog(request.device), w.rank,
                  assigned.backend,
                  assigned.note.empty() ? "" : " (" + common::EscapeForLog(assigned.note) + ")");
  } else if (w.backend_changed) {
    epoch_store_->Advance();  // it leaves one group for another
  }
  common::Registration r;
  r.worker_id = w.worker_id;
  r.rank = w.rank;
  r.world_size = workers_.size() + 1;
  r.group_epoch = epoch_store_->epoch();
  r.policy_version = std::max<int64_t>(published_version_, 0);
  r.weight_sync_backend = assigned.backend;
  r.weight_sync_note = assigned.note;
  r.heartbeat_interval_ms = options_.heartbeat_interval.count();
  r.learner_incarnation = incarnation_;
  return r;
}

StatusOr<common::HeartbeatReply> Learner::Heartbeat(const common::HeartbeatRequest& request) {
  common::MutexLock lock(&mu_);
  const WorkerEntry* entry = workers_.Find(request.worker_id);
  const bool was_suspended = entry != nullptr && entry->suspended;
  if (!workers_.Heartbeat(request.worker_id, request.weight_version, Clock::now())) {
    return Status::NotFound("unknown worker '" + request.worker_id + "': Register again");
  }
  if (was_suspended) {
    GRPO_LOG_INFO("learner: worker {} heartbeats again; it rejoins the weight-sync group",
                  common::EscapeForLog(request.worker_id));
  }
  common::HeartbeatReply reply;
  reply.policy_version = std::max<int64_t>(published_version_, 0);
  reply.group_epoch = epoch_store_->epoch();
  reply.shutdown = JobOverForWorkersLocked();
  reply.learner_incarnation = incarnation_;
  return reply;
}

StatusOr<common::LeaseReply> Learner::LeasePrompts(const std::string& worker_id,
                                                   int64_t max_prompts, Clock::time_point deadline,
                                                   const common::CancelToken* cancel,
                                                   int64_t worker_version) {
  if (worker_id.empty()) return Status::InvalidArgument("LeasePrompts: empty worker_id");
  if (max_prompts <= 0) {
    return Status::InvalidArgument("LeasePrompts: max_prompts must be positive");
  }
  common::LeaseReply reply;
  reply.retry_after_ms = kDefaultLeaseRetryAfter.count();
  reply.learner_incarnation = incarnation_;
  {
    common::MutexLock lock(&mu_);
    if (!workers_.Contains(worker_id) && !TerminalLocked()) {
      // A learner that restarted does not know the worker: it must register again (and take
      // this learner's weights) before it generates for it.
      return Status::NotFound("unknown worker '" + worker_id + "': Register again");
    }
  }
  // Lease only what can be trained within max_staleness and fits the buffer: a group generated
  // now but trained too many versions later would be refused as stale, its generation wasted.
  // While the budget is 0, wait for it (a long poll woken when the trainer takes or finishes a
  // batch) instead of sending the worker to sleep for a fixed retry, so that generation resumes
  // the moment a lease may go out. lease_mu_ is held from a budget's read to its ledger write,
  // never across the wait: a call that answers at once (a deadline within 500 ms) does not queue
  // behind another worker's long poll.
  const common::CancelToken::Subscription wake = common::CancelToken::Watch(cancel, [this] {
    common::MutexLock lock(&mu_);
    room_cv_.NotifyAll();
  });
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - Clock::now() - std::chrono::milliseconds(500));
  const auto poll_end =
      Clock::now() + std::max(std::chrono::milliseconds(0), std::min(kLeaseLongPoll, left));
  std::vector<Lease> leases;
  bool asked_housekeeping = false;
  while (true) {
    {
      common::MutexLock lease_lock(&lease_mu_);
      auto counts = ledger_->Counts();
      if (!counts.ok()) return counts.status();
      int64_t budget = 0;
      {
        common::MutexLock lock(&mu_);
        reply.policy_version = std::max<int64_t>(published_version_, 0);
        if (JobOverForWorkersLocked()) {
          reply.job_done = true;
          return reply;
        }
        if (ShuttingDownForWorkersLocked()) {
          // Shutting down is not the end of the job: the worker waits and reconnects.
          return Status::Unavailable("the learner is shutting down");
        }
        if (common::CancelToken::Tripped(cancel)) {
          return Status::Cancelled("LeasePrompts: cancelled");
        }
        LeaseBudgetInput in;
        in.buffered = static_cast<int64_t>(buffer_.size() + accepting_ms_.size());
        in.leased_out = counts->leased;
        in.training = training_;
        in.batch_groups = batch_groups_;
        in.buffer_capacity = buffer_capacity_;
        in.max_staleness = config_.max_staleness;
        in.versions_per_batch = versions_per_batch_;
        if (worker_version >= 0) in.worker_lag = reply.policy_version - worker_version;
        budget = LeaseBudget(in);
      }
      if (budget > 0) {
        const int64_t n = std::min<int64_t>({max_prompts, kMaxLeasesPerCall, budget});
        const auto duration = std::chrono::milliseconds(
            std::max<int64_t>(1, std::llround(config_.lease_seconds * 1000)));
        ASSIGN_OR_RETURN(leases, ledger_->LeasePrompts(worker_id, n, duration));
        if (!leases.empty()) break;
        // Nothing queued. Maybe the pass just ended: its next one starts in housekeeping, and
        // this long poll takes its first prompts (rather than the worker sleeping retry_after_ms
        // per pass: on a small dataset most of a step). Asked once per call: a housekeeping
        // pass wakes this wait again.
        if (!asked_housekeeping) {
          asked_housekeeping = true;
          common::MutexLock lock(&mu_);
          housekeep_due_ = true;
          train_cv_.NotifyAll();
        }
      }
    }
    // No budget or nothing queued; retry_after_ms is set. A worker behind the published version
    // is answered at once: it takes the newer weights before it asks again (its budget grows
    // with them).
    if (Clock::now() >= poll_end) break;
    if (worker_version >= 0 && worker_version < reply.policy_version) break;
    // Woken when the trainer takes or finishes a batch, a group is refused (its lease went
    // back), a dead worker's leases go back, after housekeeping, when the learner stops, and
    // at once when the call is cancelled (its CancelToken). The budget is read outside this
    // wait's lock, so a change between that read and this wait would go unnoticed: it is read
    // again every kWaitPollInterval (cancellation does not wait for it).
    common::MutexLock lock(&mu_);
    room_cv_.WaitUntil(&mu_, std::min(poll_end, Clock::now() + kWaitPollInterval));
  }
  if (common::CancelToken::Tripped(cancel)) {
    // Nobody will receive these leases: give them back at once.
    for (const auto& l : leases) (void)ledger_->ReleaseLease(l.lease_id, l.prompt_id);
    return Status::Cancelled("LeasePrompts: cancelled");
  }
  for (const auto& l : leases) {
    reply.leases.push_back({l.lease_id, l.prompt_id, l.row_json, l.deadline_ms});
  }
  if (!leases.empty()) reply.retry_after_ms = 0;
  return reply;
}

void Learner::Refuse(PushTally* tally, common::GroupRefusal why, const std::string& message) {
  const std::string reason(common::GroupRefusalName(why));
  ++tally->reply.rejected;
  ++tally->reply.rejected_by_reason[reason];
  if (tally->reply.messages.size() < kMaxAckMessages) tally->reply.messages.push_back(message);
  metrics_.groups_rejected->Increment({reason});
  {
    common::MutexLock lock(&mu_);
    ++refused_[reason];
  }
  // A refused group's lease went back (most refusals release it): a lease budget may be free.
  room_cv_.NotifyAll();
}

void Learner::RecordStepMetrics(const StepMetrics& step) {
  const common::LearnerMetrics& m = metrics_;
  m.optimizer_steps->Increment();
  m.policy_version->Set(static_cast<double>(step.policy_version));
  m.loss->Set(step.loss);
  m.reward_mean->Set(step.reward);
  m.reward_std->Set(step.reward_std);
  for (size_t i = 0; i < step.reward_names.size(); ++i) {
    const std::string& fn = step.reward_names[i];
    if (i < step.reward_fn_mean.size()) m.reward_fn_mean->Set({fn}, step.reward_fn_mean[i]);
    if (i < step.reward_fn_std.size()) m.reward_fn_std->Set({fn}, step.reward_fn_std[i]);
  }
  m.reward_zero_std_ratio->Set(step.frac_reward_zero_std);
  m.completion_mean_length->Set(step.completions_mean_length);
  m.completion_clipped_ratio->Set(step.completions_clipped_ratio);
  m.kl->Set(step.has_kl ? step.kl : 0.0);
  m.clip_ratio->Set({"low"}, step.clip_ratio_low);
  m.clip_ratio->Set({"high"}, step.clip_ratio_high);
  m.clip_ratio->Set({"region"}, step.clip_ratio_region);
  m.entropy->Set(step.entropy);
  if (step.has_is_ratio) {
    m.is_ratio_mean->Set(step.is_ratio_mean);
    m.is_ratio_max->Set(step.is_ratio_max);
  }
  if (step.has_logprob_mismatch) {
    m.logprob_mismatch->Set({"mean"}, step.logprob_mismatch_mean);
    m.logprob_mismatch->Set({"max"}, step.logprob_mismatch_max);
  }
  m.grad_norm->Set(step.grad_norm);
  m.learning_rate->Set(step.learning_rate);
  m.tokens_per_second->Set(step.tokens_per_second);
  m.step_duration->Observe(step.step_seconds);
  m.peak_memory->Set(static_cast<double>(step.peak_memory_bytes));
}

void Learner::RefreshLedgerMetrics() {
  metrics_.lock_max_hold->Set(mu_.max_hold_seconds());
  auto counts = ledger_->Counts();
  if (!counts.ok()) return;  // Housekeep and Snapshot report ledger errors
  metrics_.ledger_prompts->Set({"queued"}, static_cast<double>(counts->queued));
  metrics_.ledger_prompts->Set({"leased"}, static_cast<double>(counts->leased));
  metrics_.ledger_prompts->Set({"trained"}, static_cast<double>(counts->trained));
  metrics_.ledger_prompts->Set({"rejected"}, static_cast<double>(counts->rejected));
  metrics_.ledger_prompts->Set({"filtered"}, static_cast<double>(counts->filtered));
}

void Learner::AcceptGroup(common::RolloutGroup group, const common::CancelToken* cancel,
                          PushTally* tally) {
  const std::string& lease = group.lease_id;
  const std::string& prompt = group.prompt_id;
  const std::string what = "group for prompt '" + prompt + "'";
  auto release = [&] {
    if (Status s = ledger_->ReleaseLease(lease, prompt); !s.ok()) {
      GRPO_LOG_DEBUG("learner: release {}: {}", common::EscapeForLog(prompt),
                     common::EscapeForLog(s.ToString()));  // it names the pushed lease
    }
  };
  bool ended = false, stopping = false;
  {
    common::MutexLock lock(&mu_);
    ended = JobOverForWorkersLocked();
    stopping = ShuttingDownForWorkersLocked();
  }
  if (ended || stopping) {
    release();  // a lease that is still ours goes back to the queue now
    Refuse(tally, ended ? common::GroupRefusal::kJobEnded : common::GroupRefusal::kLearnerStopping,
           what + (ended ? ": the job has ended" : ": the learner is shutting down"));
    return;
  }
  // 1. The lease.
  auto record = ledger_->GetPrompt(prompt);
  if (!record.ok() && record.status().code() != StatusCode::kNotFound) {
    Refuse(tally, common::GroupRefusal::kLedgerError, what + ": " + record.status().ToString());
    return;
  }
  if (!record.ok() || lease.empty() || record->state != PromptState::kLeased ||
      record->lease_id != lease) {
    Refuse(tally, common::GroupRefusal::kUnknownLease, what + ": unknown lease '" + lease + "'");
    return;
  }
  if (record->lease_deadline_ms < ledger_->NowMs()) {
    Refuse(tally, common::GroupRefusal::kExpiredLease, what + ": lease '" + lease + "' expired");
    return;
  }
  // 1a. The worker could not generate it (RolloutGroup::failure): the prompt goes back to the
  //     queue now, not when the lease expires. Never rejected for it (an environment that is
  //     down is no fault of the prompt's); the worker backs off before it leases again. A
  //     prompt that failed itself (prompt_failed) would fail again: rejected at once.
  if (!group.failure.empty()) {
    const std::string message = what + ": the worker could not generate it: " +
                                group.failure.substr(0, kMaxWorkerFailureChars);
    if (group.prompt_failed) {
      if (Status s = ledger_->RejectPrompt(lease, prompt, message); !s.ok()) {
        GRPO_LOG_DEBUG("learner: reject {}: {}", common::EscapeForLog(prompt),
                       common::EscapeForLog(s.ToString()));
      }
      Refuse(tally, common::GroupRefusal::kPromptFailed, message);
    } else {
      release();
      Refuse(tally, common::GroupRefusal::kWorkerFailed, message);
    }
    return;
  }
  // 2. The policy: weights this learner published (a restarted learner's versions start again
  //    from its checkpoint, so a dead learner's version numbers mean other weights).
  if (group.policy_incarnation != incarnation_ ||
      group.policy_version > trainer_->policy_version()) {
    Refuse(tally, common::GroupRefusal::kUnknownPolicy,
           what + ": policy version " + std::to_string(group.policy_version) + " of learner '" +
               group.policy_incarnation + "' was not published by this learner ('" + incarnation_ +
               "', at version " + std::to_string(trainer_->policy_version()) + ")");
    release();
    return;
  }
  // 3. The content.
  RejectReason reason = RejectReason::kGroupSize;
  if (Status v = trainer_->ValidateGroup(group, &reason); !v.ok()) {
    Refuse(tally, reason, v.message());
    bool reject_prompt = reason == RejectReason::kEmptyPrompt;
    if (reason != RejectReason::kStale) {
      common::MutexLock lock(&mu_);
      if (++bad_group_attempts_[prompt] >= kMaxBadGroupAttempts) reject_prompt = true;
      if (reject_prompt) bad_group_attempts_.erase(prompt);
    }
    if (reject_prompt) {
      if (Status s = ledger_->RejectPrompt(lease, prompt, v.message()); !s.ok()) {
        GRPO_LOG_DEBUG("learner: reject {}: {}", common::EscapeForLog(prompt),
                       common::EscapeForLog(s.ToString()));
      }
    } else {
      release();
    }
    return;
  }
  if (config_.reward_funcs.empty() && !group.completions.empty()) {
    const auto count = static_cast<int64_t>(group.completions[0].rewards.size());
    int64_t earlier = -1;  // read under the lock, used after it (Refuse takes it again)
    {
      common::MutexLock lock(&mu_);
      earlier = reward_count_;
    }
    if (earlier >= 0 && count != earlier) {
      Refuse(tally, common::GroupRefusal::kRewardCount,
             what + ": " + std::to_string(count) + " rewards per completion, earlier groups had " +
                 std::to_string(earlier));
      release();
      return;
    }
  }
  // 3a. Dynamic sampling: a group with no learning signal is recorded and not trained.
  if (config_.dynamic_sampling && !GroupHasSignal(group, config_.reward_weights, aggregation_)) {
    FilterGroup(group, tally);
    return;
  }
  // 4. Room in the buffer (backpressure), reserved before the lease completes.
  // The verdict is taken under the lock and acted on after it: release() and Refuse() must not
  // run with mu_ held (Refuse takes it).
  enum class Admit { kRoom, kEnded, kStopping, kFull };
  Admit admit = Admit::kRoom;
  int64_t accepted_ms = 0;
  {
    const common::CancelToken::Subscription wake = common::CancelToken::Watch(cancel, [this] {
      common::MutexLock lock(&mu_);
      room_cv_.NotifyAll();
    });
    common::MutexLock lock(&mu_);
    if (!tally->buffer_timed_out) {
      const auto deadline = Clock::now() + options_.push_buffer_wait;
      while (!stopping_ && !TerminalLocked() &&
             static_cast<int64_t>(buffer_.size() + accepting_ms_.size()) >= buffer_capacity_ &&
             !common::CancelToken::Tripped(cancel)) {
        if (!room_cv_.WaitUntil(&mu_, deadline)) break;
      }
    }
    if (JobOverForWorkersLocked()) {
      admit = Admit::kEnded;
    } else if (ShuttingDownForWorkersLocked()) {
      admit = Admit::kStopping;
    } else if (static_cast<int64_t>(buffer_.size() + accepting_ms_.size()) >= buffer_capacity_) {
      admit = Admit::kFull;
    } else {
      accepted_ms = ledger_->NowMs();
      accepting_ms_.insert(accepted_ms);
    }
  }
  if (admit == Admit::kEnded || admit == Admit::kStopping) {
    const bool ended = admit == Admit::kEnded;
    release();
    Refuse(tally, ended ? common::GroupRefusal::kJobEnded : common::GroupRefusal::kLearnerStopping,
           what + (ended ? ": the job has ended" : ": the learner is shutting down"));
    return;
  }
  if (admit == Admit::kFull) {
    tally->buffer_timed_out = true;
    release();
    Refuse(tally, common::GroupRefusal::kBufferFull, what + ": the learner's buffer stayed full");
    return;
  }
  // 5. Complete the lease, then buffer the group.
  Status done = ledger_->CompleteLease(lease, prompt);
  {
    common::MutexLock lock(&mu_);
    accepting_ms_.erase(accepting_ms_.find(accepted_ms));
    if (done.ok()) {
      if (reward_count_ < 0 && !group.completions.empty()) {
        reward_count_ = static_cast<int64_t>(group.completions[0].rewards.size());
      }
      metrics_.staleness->Observe(
          static_cast<double>(trainer_->policy_version() - group.policy_version));
      buffer_.push_back(BufferedGroup{std::move(group), record->pass, accepted_ms});
      bad_group_attempts_.erase(prompt);
      ++tally->reply.accepted;
      metrics_.groups_accepted->Increment();
      metrics_.buffer_groups->Set(static_cast<double>(buffer_.size()));
    }
  }
  if (!done.ok()) {
    room_cv_.NotifyAll();
    Refuse(tally, common::GroupRefusal::kExpiredLease, what + ": " + done.message());
    return;
  }
  train_cv_.NotifyAll();
}

void Learner::FilterGroup(const common::RolloutGroup& group, PushTally* tally) {
  int64_t step = 0;
  {
    common::MutexLock lock(&mu_);
    step = global_step_;
  }
  if (Status s = ledger_->FilterPrompt(group.lease_id, group.prompt_id, step); !s.ok()) {
    // The lease expired meanwhile (the prompt is queued again on its own), or the ledger
    // failed: either way the group is not recorded, as for CompleteLease.
    Refuse(tally,
           s.code() == StatusCode::kFailedPrecondition ? common::GroupRefusal::kExpiredLease
                                                       : common::GroupRefusal::kLedgerError,
           "group for prompt '" + group.prompt_id + "': " + s.message());
    return;
  }
  ++tally->reply.filtered;
  metrics_.groups_filtered->Increment();
  bool warn = false;
  int64_t filtered = 0;
  {
    common::MutexLock lock(&mu_);
    batch_fill_.AddFiltered();
    bad_group_attempts_.erase(group.prompt_id);
    filtered = batch_fill_.filtered();
    // Say so, once per 10 batches' worth, when nothing with a signal arrives: the data may be
    // solved (all rewards at the top) or out of reach (all at the bottom).
    warn = buffer_.empty() && filtered % (10 * batch_groups_) == 0;
  }
  if (warn) {
    GRPO_LOG_WARN(
        "learner: dynamic sampling filtered the last {} groups (all rewards equal in each) and "
        "none had a learning signal: the prompts may be all solved or all out of reach",
        filtered);
  }
  room_cv_.NotifyAll();   // the lease budget it held is free
  train_cv_.NotifyAll();  // a short batch may be due (max_num_gen_batches)
}

Status Learner::WaitForPublished(int64_t min_version, const common::CancelToken* cancel,
                                 const std::string& incarnation) {
  if (!incarnation.empty() && incarnation != incarnation_) min_version = 0;
  const common::CancelToken::Subscription wake = common::CancelToken::Watch(cancel, [this] {
    common::MutexLock lock(&mu_);
    state_cv_.NotifyAll();
  });
  common::MutexLock lock(&mu_);
  const auto deadline = Clock::now() + kDefaultGetWeightsWait;
  while (!stopping_ && published_version_ < min_version && !common::CancelToken::Tripped(cancel)) {
    if (!state_cv_.WaitUntil(&mu_, deadline)) break;
  }
  if (published_version_ < min_version) {
    return Status::DeadlineExceeded("policy version " + std::to_string(min_version) +
                                    " not published (at " + std::to_string(published_version_) +
                                    ")");
  }
  return Status::OK();
}

Status Learner::ReadWeights(int64_t min_version, const common::CancelToken* cancel,
                            const std::string& incarnation, const WeightSink& sink) {
  if (!streams_weights_) {
    ASSIGN_OR_RETURN(std::shared_ptr<const WeightSnapshot> snap,
                     WaitForWeights(min_version, cancel, incarnation));
    for (size_t i = 0; i < snap->tensors.size(); ++i) {
      const auto& [name, t] = snap->tensors[i];
      if (!sink(WeightPiece{snap->version, name, t, i, snap->tensors.size()})) {
        return Status::Cancelled("the reader went away");
      }
    }
    return Status::OK();
  }
  RETURN_IF_ERROR(WaitForPublished(min_version, cancel, incarnation));
  // The training thread serves it with the version published then (>= min_version: versions
  // only grow within an incarnation).
  return readers_.Read(sink, Clock::now() + kDefaultGetWeightsWait, cancel);
}

StatusOr<std::shared_ptr<const WeightSnapshot>> Learner::WaitForWeights(
    int64_t min_version, const common::CancelToken* cancel, const std::string& incarnation) {
  if (streams_weights_) {
    return Status::FailedPrecondition("weight_publish stream keeps no snapshot (ReadWeights)");
  }
  RETURN_IF_ERROR(WaitForPublished(min_version, cancel, incarnation));
  common::MutexLock lock(&mu_);
  return weights_;  // published with published_version_: at least min_version
}

// ---------------------------------------------------------------------------------------------
// Clients.

StatusOr<DatasetInfo> Learner::AddDataset(const std::string& idempotency_key,
                                          const std::vector<std::string>& lines) {
  ASSIGN_OR_RETURN(DatasetInfo info, ledger_->AddDataset(idempotency_key, lines));
  {
    common::MutexLock lock(&mu_);
    housekeep_due_ = true;
  }
  train_cv_.NotifyAll();
  return info;
}

void Learner::Cancel(const std::string& reason) {
  ChangeState(JobState::kCancelled, reason.empty() ? "cancelled by a client" : reason);
}

std::shared_ptr<Learner::Subscriber> Learner::Subscribe() {
  auto sub = std::make_shared<Subscriber>();
  common::MutexLock lock(&mu_);
  subscribers_.push_back(sub);
  return sub;
}

void Learner::Unsubscribe(const std::shared_ptr<Subscriber>& subscriber) {
  common::MutexLock lock(&mu_);
  subscribers_.remove(subscriber);
}

Status Learner::NextEvents(Subscriber& sub, std::chrono::milliseconds wait,
                           const common::CancelToken* cancel, std::deque<JobEvent>* events) {
  const common::CancelToken::Subscription wake = common::CancelToken::Watch(cancel, [this, &sub] {
    common::MutexLock lock(&mu_);
    sub.cv.NotifyAll();
  });
  common::MutexLock lock(&mu_);
  const auto deadline = Clock::now() + wait;  // as wait_for: from when the lock is held
  while (!stopping_ && !sub.dropped && sub.events.empty() &&
         !common::CancelToken::Tripped(cancel)) {
    if (!sub.cv.WaitUntil(&mu_, deadline)) break;
  }
  if (sub.dropped) {
    return Status::ResourceExhausted("the watcher fell too far behind; watch again");
  }
  events->swap(sub.events);
  sub.events.clear();
  if (events->empty() && stopping_) return Status::Unavailable("the learner is shutting down");
  if (events->empty() && common::CancelToken::Tripped(cancel)) {
    return Status::Cancelled("the watch was cancelled");
  }
  return Status::OK();
}

}  // namespace grpo::learner
