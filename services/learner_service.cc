#include "services/learner_service.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "common/device.h"
#include "common/logging.h"
#include "common/safetensors.h"
#include "learner/grpo_trainer.h"
#include "learner/checkpoint.h"
#include "services/auth.h"
#include "services/convert.h"
#include "services/grpc_store.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// "HOST:PORT" for gRPC, bracketing an IPv6 literal ("::" -> "[::]:50051").
std::string HostPort(const std::string& host, int64_t port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

constexpr const char* kServiceName = "grpo.v1.LearnerService";
constexpr size_t kMaxAckMessages = 8;

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Runs a handler body; an escaped exception becomes INTERNAL (handlers never throw).
template <typename F>
grpc::Status Guarded(const char* rpc, F&& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    GRPO_LOG_ERROR("{}: {}", rpc, e.what_without_backtrace());
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        std::string(rpc) + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    GRPO_LOG_ERROR("{}: {}", rpc, e.what());
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + ": " + e.what());
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + ": unknown exception");
  }
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
std::map<std::string, double> FlattenMetrics(const learner::StepMetrics& step) {
  std::map<std::string, double> out;
  const nlohmann::json j = step.ToJson();
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.value().is_number()) out[it.key()] = it.value().get<double>();
  }
  return out;
}

}  // namespace

std::string_view JobStateName(JobState state) {
  switch (state) {
    case JobState::kWaitingForData:
      return "waiting_for_data";
    case JobState::kRunning:
      return "running";
    case JobState::kDone:
      return "done";
    case JobState::kCancelled:
      return "cancelled";
    case JobState::kFailed:
      return "failed";
  }
  return "unknown";
}

LearnerServer::LearnerServer(common::GrpoConfig config, LearnerServerOptions options)
    : config_(std::move(config)), options_(std::move(options)) {}

StatusOr<std::unique_ptr<LearnerServer>> LearnerServer::Create(
    common::GrpoConfig config, std::unique_ptr<common::Model> policy,
    std::unique_ptr<common::Model> reference, LearnerServerOptions options) {
  RETURN_IF_ERROR(config.Validate());
  if (policy == nullptr) return Status::InvalidArgument("LearnerServer: no policy model");
  // `device` is resolved before anything is opened: an unusable one fails Create naming the key.
  ASSIGN_OR_RETURN(const at::Device device, common::ResolveDevice(config.device));
  if (config.grpc_port < 0 || config.grpc_port > 65535) {
    return Status::InvalidArgument("config key 'grpc_port' must be in [0, 65535], got " +
                                   std::to_string(config.grpc_port));
  }
  if (!(config.lease_seconds > 0)) {
    return Status::InvalidArgument("config key 'lease_seconds' must be positive");
  }
  if (!options.now_ms) options.now_ms = SystemNowMs;
  std::unique_ptr<LearnerServer> s(new LearnerServer(std::move(config), std::move(options)));
  s->incarnation_ = NewIncarnation();
  s->endpoint_ = common::LocalSyncEndpoint(device.str());
  const common::GrpoConfig& cfg = s->config_;
  s->registry_ = s->options_.metrics_registry;
  if (s->registry_ == nullptr) {
    s->own_registry_ = std::make_unique<common::Registry>();
    s->registry_ = s->own_registry_.get();
  }
  ASSIGN_OR_RETURN(s->metrics_, common::LearnerMetrics::Create(*s->registry_, cfg.reward_funcs));
  const int64_t gen_batch = cfg.per_device_train_batch_size * cfg.EffectiveStepsPerGeneration();
  s->batch_groups_ = gen_batch / cfg.num_generations;
  if (s->batch_groups_ < 1) {
    return Status::InvalidArgument(
        "config key 'num_generations' exceeds the generation batch "
        "(per_device_train_batch_size * steps_per_generation)");
  }
  {
    // Optimizer steps per generation batch: ceil(steps_per_generation / gradient_accumulation)
    // per pass, num_iterations passes; the policy version moves once per step.
    const int64_t spg = cfg.EffectiveStepsPerGeneration(), gas = cfg.gradient_accumulation_steps;
    s->versions_per_batch_ = std::max<int64_t>(1, (spg + gas - 1) / gas * cfg.num_iterations);
  }
  s->buffer_capacity_ = s->options_.buffer_capacity_groups > 0
                            ? std::max(s->options_.buffer_capacity_groups, s->batch_groups_)
                            : 2 * s->batch_groups_;
  ASSIGN_OR_RETURN(s->auth_token_, ReadAuthToken(cfg.auth_token_file));
  ASSIGN_OR_RETURN(s->server_credentials_, ServerCredentials(cfg, s->auth_token_));

  std::error_code ec;
  fs::create_directories(cfg.output_dir, ec);
  if (ec) {
    return Status::FailedPrecondition("cannot create output_dir " + cfg.output_dir + ": " +
                                      ec.message());
  }
  const std::string ledger_path = cfg.ledger_path.empty()
                                      ? (fs::path(cfg.output_dir) / "ledger.sqlite").string()
                                      : cfg.ledger_path;
  learner::PromptLedgerOptions ledger_options;
  ledger_options.now_ms = s->options_.now_ms;
  ASSIGN_OR_RETURN(s->ledger_, learner::PromptLedger::Open(ledger_path, ledger_options));

  // The policy trains on `device` in its own dtype (the fp32 master with `bf16`: GrpoTrainer
  // builds the bf16 compute copy); PublishWeights snapshots it to the CPU.
  s->policy_ = std::move(policy);
  RETURN_IF_ERROR(s->policy_->To(device, s->policy_->dtype()).WithContext("policy"));
  ASSIGN_OR_RETURN(s->trainer_,
                   learner::GrpoTrainer::Create(cfg, s->policy_.get(), std::move(reference)));
  s->trainer_->set_dump_incarnation(s->incarnation_);
  if (s->options_.resume) RETURN_IF_ERROR(s->Resume());
  s->global_step_ = s->trainer_->global_step();
  s->last_saved_step_ = s->global_step_;
  s->metrics_.policy_version->Set(static_cast<double>(s->trainer_->policy_version()));
  if (s->global_step_ >= cfg.max_steps) {
    s->state_ = JobState::kDone;
    s->message_ = "max_steps reached";
  }
  return s;
}

Status LearnerServer::Resume() {
  const std::string& out = config_.output_dir;
  auto restored = learner::RestoreLatestCheckpoint(*trainer_, out);
  if (restored.ok()) {
    GRPO_LOG_INFO("learner: resumed from {} at step {}", *restored, trainer_->global_step());
  } else if (restored.status().code() != StatusCode::kNotFound) {
    return restored.status().WithContext("resume");
  }
  // The ledger follows the weights: what the restored step does not hold (trainings after it,
  // groups accepted but never trained, pass boundaries crossed since) is undone.
  ASSIGN_OR_RETURN(learner::RollbackResult undone, ledger_->RollbackTo(trainer_->global_step()));
  if (undone.requeued + undone.trainings_undone + undone.moved_back > 0) {
    GRPO_LOG_INFO(
        "learner: ledger rolled back to step {}: {} trainings undone, {} prompts requeued, {} "
        "moved back to a pass they owe",
        trainer_->global_step(), undone.trainings_undone, undone.requeued, undone.moved_back);
  }
  return Status::OK();
}

LearnerServer::~LearnerServer() { (void)Stop(/*checkpoint=*/false); }

Status LearnerServer::Start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return Status::FailedPrecondition("LearnerServer already started");
    started_ = true;
  }
  RETURN_IF_ERROR(PublishWeights());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  ApplyServerLimits(builder, config_, "grpo-learner");
  const std::string host =
      options_.bind_address.empty() ? config_.grpc_bind_address : options_.bind_address;
  const std::string address = HostPort(host, config_.grpc_port);
  if (auth_token_.empty() && !IsLoopbackAddress(host)) {
    GRPO_LOG_WARN(
        "learner: WARNING: auth is off (no auth_token_file) and gRPC listens on {}: anyone who "
        "reaches this address can push groups and cancel the job; set auth_token_file or "
        "grpc_bind_address: 127.0.0.1",
        host);
  }
  builder.AddListeningPort(address, server_credentials_, &port_);
  builder.RegisterService(this);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return Status::Unavailable("learner: cannot listen on " + address);
  }
  if (auto* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    health->SetServingStatus(kServiceName, true);
  }
  started_ok_ = true;
  train_thread_ = std::thread([this] { TrainLoop(); });
  for (size_t i = 0; i < common::GroupBackends().size(); ++i) {
    sync_threads_.emplace_back([this, i] { WeightSyncLoop(i); });
  }
  GRPO_LOG_INFO("learner: serving on port {} (step {}, policy version {})", port_,
                trainer_->global_step(), trainer_->policy_version());
  return Status::OK();
}

Status LearnerServer::Stop(bool checkpoint) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return Status::OK();
    stopped_ = true;
    stopping_ = true;
    for (auto& sub : subscribers_) sub->cv.notify_all();
  }
  train_cv_.notify_all();
  room_cv_.notify_all();
  state_cv_.notify_all();
  epoch_store_->Stop();
  if (train_thread_.joinable()) train_thread_.join();
  for (std::thread& t : sync_threads_) {
    if (t.joinable()) t.join();
  }

  Status result;
  bool done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done = state_ == JobState::kDone;
  }
  if (checkpoint && !done && trainer_->open_step_micro_batches() > 0) {
    // Stopping inside an optimizer step: take it with the micro-batches it has (the ledger
    // already recorded its groups under that step), so that the checkpoint holds them. Not at
    // max_steps: the job ended there, and its open step's groups went back to the queue.
    auto flushed = trainer_->FlushPartialStep();
    if (flushed.ok() && flushed->has_value()) {
      RecordStepMetrics(**flushed);
      std::lock_guard<std::mutex> lock(mu_);
      global_step_ = trainer_->global_step();
    } else if (!flushed.ok()) {
      GRPO_LOG_WARN("learner: flush the open step at stop: {}", flushed.status().ToString());
    }
  }
  bool need_save = false;
  int64_t saved = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    need_save = checkpoint && global_step_ > last_saved_step_;
  }
  if (need_save) result = CheckpointWithRetry(kFinalCheckpointAttempts);
  {
    std::lock_guard<std::mutex> lock(mu_);
    saved = last_saved_step_;
  }

  if (server_ != nullptr) {
    if (auto* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
      health->SetServingStatus(kServiceName, false);
    }
    server_->Shutdown(std::chrono::system_clock::now() + kDefaultShutdownGrace);
    server_->Wait();
  }
  // After the last call: nothing can join the buffer any more.
  if (started_ok_) EndLedgerAtStep(saved);
  return result;
}

bool LearnerServer::WaitForJobEnd(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return state_cv_.wait_for(lock, timeout, [this] { return TerminalLocked(); });
}

JobState LearnerServer::job_state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

int64_t LearnerServer::published_version() const {
  std::lock_guard<std::mutex> lock(mu_);
  return weights_ ? weights_->version : -1;
}

std::map<std::string, int64_t> LearnerServer::RefusedCounts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

Status LearnerServer::Health() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != JobState::kFailed) return Status::OK();
  return Status::Unavailable("job failed: " + message_);
}

bool LearnerServer::TerminalLocked() const {
  return state_ == JobState::kDone || state_ == JobState::kCancelled || state_ == JobState::kFailed;
}

int64_t LearnerServer::LeaseBudgetLocked(int64_t leased_out) const {
  const int64_t pending = static_cast<int64_t>(buffer_.size() + accepting_ms_.size());
  // Batches that may be trained between a group's generation and its own batch.
  const int64_t batches_ahead = config_.max_staleness / versions_per_batch_;
  const int64_t stale_limit = (batches_ahead + 1 - (training_ ? 1 : 0)) * batch_groups_;
  if (pending >= buffer_capacity_) return 0;  // a full buffer: groups would only wait
  return std::max<int64_t>(0, stale_limit - pending - leased_out);
}

// ---------------------------------------------------------------------------------------------
// Training thread.

void LearnerServer::TrainLoop() {
  auto last_housekeep = Clock::now() - kHousekeepInterval;
  while (true) {
    std::vector<BufferedGroup> batch;
    bool housekeep = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      train_cv_.wait_for(lock, kWaitPollInterval, [this] {
        return stopping_ || housekeep_due_ ||
               (!TerminalLocked() && static_cast<int64_t>(buffer_.size()) >= batch_groups_);
      });
      if (stopping_) return;
      DropDeadWorkersLocked();
      housekeep = housekeep_due_ || Clock::now() - last_housekeep >= kHousekeepInterval ||
                  static_cast<int64_t>(buffer_.size()) >= batch_groups_;
      housekeep_due_ = false;
    }
    if (housekeep) {
      Housekeep();
      last_housekeep = Clock::now();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      if (TerminalLocked() || static_cast<int64_t>(buffer_.size()) < batch_groups_) continue;
      for (int64_t i = 0; i < batch_groups_; ++i) {
        batch.push_back(std::move(buffer_.front()));
        buffer_.pop_front();
      }
      metrics_.buffer_groups->Set(static_cast<double>(buffer_.size()));
      training_ = true;
    }
    room_cv_.notify_all();
    TrainBatch(std::move(batch));
    {
      std::lock_guard<std::mutex> lock(mu_);
      training_ = false;
    }
    room_cv_.notify_all();  // leases held back for staleness may go out now
  }
}

void LearnerServer::Housekeep() {
  RefreshLedgerMetrics();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (TerminalLocked()) return;
  }
  auto counts = ledger_->Counts();
  if (!counts.ok()) {
    GRPO_LOG_WARN("learner: ledger counts: {}", counts.status().ToString());
    return;
  }
  if (counts->queued + counts->leased == 0 && counts->trained > 0 && PassMayEnd()) {
    // Every prompt of this pass is trained, rejected, or accepted into the one partial batch
    // that trains next: the job needs more steps, so start the next pass (that partial batch
    // trains together with its first groups, before any other optimizer step).
    auto next = ledger_->StartNextPass(std::numeric_limits<int64_t>::max());
    if (next.ok() && *next) {
      GRPO_LOG_INFO("learner: pass {} done; starting pass {}", counts->pass, counts->pass + 1);
      counts->queued = counts->trained;
    } else if (!next.ok() && next.status().code() != StatusCode::kFailedPrecondition) {
      GRPO_LOG_WARN("learner: start next pass: {}", next.status().ToString());
    }
  }
  JobState want =
      counts->queued + counts->leased > 0 ? JobState::kRunning : JobState::kWaitingForData;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (want == JobState::kWaitingForData && !buffer_.empty()) want = JobState::kRunning;
    if (state_ == want || TerminalLocked()) return;
  }
  ChangeState(want, want == JobState::kRunning ? "" : "no prompts to lease");
}

bool LearnerServer::PassMayEnd() {
  std::vector<BufferedGroup> stale;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Groups being accepted, or a full batch waiting, would train after other steps: wait.
    if (!accepting_ms_.empty() || training_) return false;
    if (static_cast<int64_t>(buffer_.size()) >= batch_groups_) return false;
    // The partial batch trains next, at the current policy version: a group already too stale
    // for it goes back to its pass now, so that the pass is not left owing it.
    for (auto it = buffer_.begin(); it != buffer_.end();) {
      learner::RejectReason reason = learner::RejectReason::kGroupSize;
      if (!trainer_->ValidateGroup(it->group, &reason).ok() &&
          reason == learner::RejectReason::kStale) {
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
    metrics_.groups_rejected->Increment({"stale"});
    std::lock_guard<std::mutex> lock(mu_);
    ++refused_["stale"];
  }
  return stale.empty();
}

void LearnerServer::DropDeadWorkersLocked() {
  const auto cutoff = Clock::now() - options_.heartbeat_interval * kHeartbeatsMissedBeforeDrop;
  bool dropped = false;
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->second.last_seen < cutoff) {
      // Its leases go back to the queue now rather than after lease_seconds (ledger_ has its
      // own lock and never calls back into the server).
      auto moved = ledger_->ExpireWorkerLeases(it->first);
      GRPO_LOG_WARN("learner: worker {} missed its heartbeats; dropped from the group ({})",
                    it->first,
                    moved.ok() ? std::to_string(*moved) + " leases returned to the queue"
                               : moved.status().ToString());
      it = workers_.erase(it);
      dropped = true;
    } else {
      ++it;
    }
  }
  if (!dropped) return;
  // Ranks stay 1..N in their old order; the group is rebuilt under a new epoch.
  std::vector<std::pair<int32_t, Worker*>> by_rank;
  for (auto& [id, w] : workers_) by_rank.emplace_back(w.rank, &w);
  std::sort(by_rank.begin(), by_rank.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < by_rank.size(); ++i) by_rank[i].second->rank = static_cast<int32_t>(i + 1);
  epoch_store_->Advance();
}

void LearnerServer::TrainBatch(std::vector<BufferedGroup> batch) {
  std::vector<common::RolloutGroup> groups;
  std::vector<learner::TrainedGroup> keys;  // (prompt, pass) of groups[i]
  groups.reserve(batch.size());
  for (auto& b : batch) {
    keys.push_back({b.group.prompt_id, b.pass});
    groups.push_back(std::move(b.group));
  }
  StatusOr<learner::GenerationBatchResult> result = Status::Internal("not run");
  try {
    result = trainer_->TrainGenerationBatch(groups);
  } catch (const c10::Error& e) {
    result = Status::Internal(std::string("training: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    result = Status::Internal(std::string("training: ") + e.what());
  }
  if (!result.ok()) {
    GRPO_LOG_ERROR("learner: {}", result.status().ToString());
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
        RequeueUntrained(keys[i], learner::RejectReasonName(reason));
        break;
      }
    }
    metrics_.groups_rejected->Increment({learner::RejectReasonName(reason)});
    std::lock_guard<std::mutex> lock(mu_);
    ++refused_[std::string(learner::RejectReasonName(reason))];
  }
  // The rest are in the weights after the step now taken, or after the next one when the batch
  // ended inside an optimizer step (checkpoints are never taken inside one, see below).
  const int64_t step = trainer_->global_step();
  const bool open_step = trainer_->open_step_micro_batches() > 0;
  {
    std::vector<learner::TrainedGroup> trained;
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
  if (!result->steps.empty()) RefreshLedgerMetrics();

  bool publish = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    global_step_ = step;
    if (!result->steps.empty()) last_metrics_ = FlattenMetrics(result->steps.back());
    publish = step - last_published_step_ >= std::max<int64_t>(1, config_.weight_sync_steps) ||
              step >= config_.max_steps;
  }
  if (publish) {
    if (Status s = PublishWeights(); !s.ok()) GRPO_LOG_ERROR("learner: publish: {}", s.ToString());
  }
  if (!result->steps.empty()) {
    v1::Job job = BuildJob();
    for (const auto& sm : result->steps) {
      v1::JobEvent event;
      *event.mutable_job() = job;
      event.mutable_job()->set_global_step(sm.step);
      event.mutable_job()->set_policy_version(sm.policy_version);
      event.set_step(sm.step);
      for (const auto& [k, v] : FlattenMetrics(sm)) (*event.mutable_metrics())[k] = v;
      Broadcast(event);
    }
  }
  int64_t last_saved = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
      GRPO_LOG_ERROR("learner: checkpoint at step {} failed ({}); training goes on and the next "
                     "batch retries it",
                     step, s.ToString());
    }
  }
}

void LearnerServer::RequeueUntrained(const learner::TrainedGroup& key, std::string_view why) {
  auto moved = ledger_->RequeueTrained(key.prompt_id, key.pass);
  if (!moved.ok()) {
    // Never silent: the prompt would miss a pass.
    GRPO_LOG_ERROR("learner: requeue {} (pass {}, {}): {}", key.prompt_id, key.pass, why,
                   moved.status().ToString());
    metrics_.ledger_errors->Increment();
  }
}

Status LearnerServer::PublishWeights() {
  const auto publish_start = Clock::now();
  auto snap = std::make_shared<WeightSnapshot>();
  // A copy on the GPU too while a worker gets its weights over a GPU backend (NCCL, CUDA IPC):
  // it costs one model's memory there, so only then.
  bool on_device = false;
  if (!policy_->device().is_cpu()) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, w] : workers_) {
      on_device = on_device || w.assigned_backend == common::kBackendNccl ||
                  w.assigned_backend == common::kBackendCudaIpc;
    }
  }
  try {
    at::NoGradGuard no_grad;
    snap->version = trainer_->policy_version();
    for (const auto& [name, t] : policy_->NamedParameters()) {
      if (on_device) {
        at::Tensor copy = t.detach().contiguous().clone();
        // The CPU copy is made from the device copy and waits for it, so both are complete
        // when the snapshot is published.
        snap->tensors.emplace_back(name, copy.to(at::kCPU));
        snap->device_tensors.emplace_back(name, std::move(copy));
      } else {
        snap->tensors.emplace_back(name, t.detach().to(at::kCPU).contiguous().clone());
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
    std::lock_guard<std::mutex> lock(mu_);
    weights_ = std::move(snap);
    last_published_step_ = global_step_;
  }
  state_cv_.notify_all();
  return Status::OK();
}

void LearnerServer::WeightSyncLoop(size_t index) {
  const std::string backend(common::GroupBackends()[index]);
  common::WeightSyncFactory factory = options_.weight_sync_factory;
  if (!factory) {
    common::WeightSyncBackendOptions o;
    o.timeout = options_.weight_sync_timeout;
    o.hostname = options_.weight_sync_hostname.empty() ? config_.weight_sync_hostname
                                                       : options_.weight_sync_hostname;
    o.cuda_device = std::max(0, common::CudaOrdinal(policy_->device().str()));
    factory = common::BuiltinWeightSyncFactory(o);
  }
  learner::WeightPublisher publisher(backend, epoch_store_, std::move(factory),
                                     options_.weight_sync_timeout);
  GroupStats& stats = group_stats_[index];
  while (true) {
    std::shared_ptr<const WeightSnapshot> snap;
    std::vector<std::pair<int32_t, std::string>> by_rank;
    {
      std::unique_lock<std::mutex> lock(mu_);
      state_cv_.wait_for(lock, kWaitPollInterval);
      if (stopping_) break;
      snap = weights_;
      for (const auto& [id, w] : workers_) {
        if (w.assigned_backend == backend) by_rank.emplace_back(w.rank, id);
      }
    }
    std::sort(by_rank.begin(), by_rank.end());
    std::vector<std::string> members;
    for (auto& [rank, id] : by_rank) members.push_back(std::move(id));
    (void)publisher.Sync(members, snap);  // a failure is logged and ends the epoch
    stats.syncs = publisher.syncs();
    stats.failures = publisher.failures();
  }
  publisher.Close();
}

int64_t LearnerServer::group_syncs(std::string_view backend) const {
  const auto& all = common::GroupBackends();
  const auto it = std::find(all.begin(), all.end(), backend);
  return it == all.end() ? 0 : group_stats_[it - all.begin()].syncs.load();
}

int64_t LearnerServer::group_sync_failures(std::string_view backend) const {
  const auto& all = common::GroupBackends();
  const auto it = std::find(all.begin(), all.end(), backend);
  return it == all.end() ? 0 : group_stats_[it - all.begin()].failures.load();
}

Status LearnerServer::Checkpoint() {
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
      dir = learner::SaveCheckpoint(*trainer_, config_.output_dir, options_.model_dir);
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
    std::lock_guard<std::mutex> lock(mu_);
    last_saved_step_ = trainer_->global_step();
  }
  metrics_.checkpoint_duration->Observe(
      std::chrono::duration<double>(Clock::now() - save_start).count());
  GRPO_LOG_INFO("learner: saved {}", *dir);
  for (const std::string& old : learner::PruneCheckpoints(config_.output_dir,
                                                          config_.save_total_limit)) {
    GRPO_LOG_INFO("learner: removed {} (save_total_limit {})", old, config_.save_total_limit);
  }
  return Status::OK();
}

Status LearnerServer::CheckpointWithRetry(int attempts) {
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

void LearnerServer::EndLedgerAtStep(int64_t saved_step) {
  std::deque<BufferedGroup> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  if (!dropped.empty() || undone->requeued > 0) {
    GRPO_LOG_INFO("learner: {} buffered groups dropped at job end; {} prompts back to QUEUED",
                  dropped.size(), undone->requeued);
  }
}

void LearnerServer::ChangeState(JobState state, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (TerminalLocked() || state_ == state) return;
    state_ = state;
    message_ = message;
  }
  GRPO_LOG_INFO("learner: job {}{}{}", JobStateName(state), message.empty() ? "" : ": ", message);
  state_cv_.notify_all();
  room_cv_.notify_all();
  train_cv_.notify_all();
  v1::JobEvent event;
  *event.mutable_job() = BuildJob();
  event.set_step(event.job().global_step());
  Broadcast(event);
}

void LearnerServer::Broadcast(const v1::JobEvent& event) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& sub : subscribers_) {
    if (sub->dropped) continue;
    if (sub->events.size() >= kWatchQueueCapacity) {
      sub->dropped = true;  // never block training on a slow reader
      sub->events.clear();
    } else {
      sub->events.push_back(event);
    }
    sub->cv.notify_all();
  }
}

v1::Job LearnerServer::BuildJob() {
  v1::Job job;
  auto counts = ledger_->Counts();
  if (counts.ok()) {
    v1::LedgerCounts* c = job.mutable_prompts();
    c->set_queued(counts->queued);
    c->set_leased(counts->leased);
    c->set_trained(counts->trained);
    c->set_rejected(counts->rejected);
    c->set_pass(counts->pass);
  }
  std::lock_guard<std::mutex> lock(mu_);
  job.set_state(std::string(JobStateName(state_)));
  job.set_global_step(global_step_);
  job.set_max_steps(config_.max_steps);
  job.set_policy_version(weights_ ? weights_->version : trainer_->policy_version());
  job.set_workers(static_cast<int32_t>(workers_.size()));
  for (const auto& [k, v] : last_metrics_) (*job.mutable_last_metrics())[k] = v;
  std::string message = message_;
  if (!counts.ok()) message += (message.empty() ? "" : "; ") + counts.status().ToString();
  job.set_message(message);
  return job;
}

// ---------------------------------------------------------------------------------------------
// Workers.

grpc::Status LearnerServer::Register(grpc::ServerContext* context,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("Register", [&] {
    const std::string model_config = policy_->config().ToJson().dump();
    const std::string config_json = config_.ToJson().dump();
    std::lock_guard<std::mutex> lock(mu_);
    std::string id = request->worker_id();
    if (id.empty()) {
      do {
        id = "worker-" + std::to_string(next_worker_number_++);
      } while (workers_.count(id) > 0);
    }
    // Leases granted to this id before now belong to a process that is gone (a worker leases
    // only between registrations, never across one): back to the queue now, not after
    // lease_seconds, so they neither wait nor block the staleness budget.
    if (auto moved = ledger_->ExpireWorkerLeases(id); moved.ok() && *moved > 0) {
      GRPO_LOG_INFO("learner: worker {} registered again: {} leases of its earlier process "
                    "returned to the queue",
                    id, *moved);
    }
    const common::SyncEndpoint worker_end{common::CudaOrdinal(request->device()) >= 0,
                                          request->gpu_uuid()};
    const common::BackendAssignment assigned = common::AssignBackend(
        request->weight_sync_backend(), endpoint_, worker_end, [&](std::string_view b) {
          return options_.weight_sync_factory ? true : common::WeightSyncBackendBuilt(b);
        });
    auto it = workers_.find(id);
    if (it == workers_.end()) {
      Worker w;
      w.rank = static_cast<int32_t>(workers_.size() + 1);
      it = workers_.emplace(id, w).first;
      epoch_store_->Advance();  // the group gains a rank: rebuilt under a new epoch
      GRPO_LOG_INFO("learner: worker {} ({}:{}, {}) registered as rank {}; weight sync {}{}", id,
                    request->hostname(), request->pid(),
                    request->device().empty() ? "cpu" : request->device(), w.rank,
                    assigned.backend, assigned.note.empty() ? "" : " (" + assigned.note + ")");
    } else if (it->second.assigned_backend != assigned.backend) {
      epoch_store_->Advance();  // it leaves one group for another
    }
    Worker& w = it->second;
    w.hostname = request->hostname();
    w.pid = request->pid();
    w.backend = request->weight_sync_backend();
    w.assigned_backend = assigned.backend;
    w.last_seen = Clock::now();
    response->set_worker_id(id);
    response->set_rank(w.rank);
    response->set_world_size(static_cast<int32_t>(workers_.size() + 1));
    response->set_group_epoch(epoch_store_->epoch());
    response->set_policy_version(weights_ ? weights_->version : 0);
    response->set_weight_sync_backend(assigned.backend);
    response->set_weight_sync_note(assigned.note);
    response->set_config_json(config_json);
    response->set_heartbeat_interval_ms(options_.heartbeat_interval.count());
    response->set_model_config_json(model_config);
    response->set_learner_incarnation(incarnation_);
    return grpc::Status::OK;
  });
}

grpc::Status LearnerServer::Heartbeat(grpc::ServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("Heartbeat", [&] {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = workers_.find(request->worker_id());
    if (it == workers_.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND,
                          "unknown worker '" + request->worker_id() + "': Register again");
    }
    it->second.last_seen = Clock::now();
    it->second.weight_version = request->weight_version();
    response->set_policy_version(weights_ ? weights_->version : 0);
    response->set_group_epoch(epoch_store_->epoch());
    response->set_shutdown(TerminalLocked());
    response->set_learner_incarnation(incarnation_);
    return grpc::Status::OK;
  });
}

grpc::Status LearnerServer::LeasePrompts(grpc::ServerContext* context,
                                         const v1::LeasePromptsRequest* request,
                                         v1::LeasePromptsResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("LeasePrompts", [&] {
    if (request->worker_id().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "LeasePrompts: empty worker_id");
    }
    if (request->max_prompts() <= 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "LeasePrompts: max_prompts must be positive");
    }
    response->set_retry_after_ms(kDefaultLeaseRetryAfter.count());
    response->set_learner_incarnation(incarnation_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (workers_.count(request->worker_id()) == 0 && !TerminalLocked()) {
        // A learner that restarted does not know the worker: it must register again (and take
        // this learner's weights) before it generates for it.
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            "unknown worker '" + request->worker_id() + "': Register again");
      }
    }
    // Lease only what can be trained within max_staleness and fits the buffer: a group generated
    // now but trained too many versions later would be refused as stale, its generation wasted.
    // While the budget is 0, wait for it (a long poll woken when the trainer takes or finishes a
    // batch) instead of sending the worker to sleep for a fixed retry, so that generation resumes
    // the moment a lease may go out.
    std::lock_guard<std::mutex> lease_lock(lease_mu_);
    int64_t budget = 0;
    {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          context->deadline() - std::chrono::system_clock::now() - std::chrono::milliseconds(500));
      const auto poll_end = Clock::now() + std::max(std::chrono::milliseconds(0),
                                                    std::min(kLeaseLongPoll, left));
      while (true) {
        auto counts = ledger_->Counts();
        if (!counts.ok()) return ToGrpcStatus(counts.status());
        std::unique_lock<std::mutex> lock(mu_);
        response->set_policy_version(weights_ ? weights_->version : 0);
        if (TerminalLocked()) {
          response->set_job_done(true);
          return grpc::Status::OK;
        }
        if (stopping_) {
          // Shutting down is not the end of the job: the worker waits and reconnects.
          return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the learner is shutting down");
        }
        if (context->IsCancelled()) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "LeasePrompts: cancelled");
        }
        budget = LeaseBudgetLocked(counts->leased);
        if (budget > 0 || Clock::now() >= poll_end) break;
        room_cv_.wait_for(lock, std::min<Clock::duration>(kWaitPollInterval,
                                                          poll_end - Clock::now()));
      }
      if (budget == 0) return grpc::Status::OK;  // retry_after_ms is set
    }
    const int64_t n = std::min<int64_t>({request->max_prompts(), kMaxLeasesPerCall, budget});
    const auto duration =
        std::chrono::milliseconds(std::max<int64_t>(1, std::llround(config_.lease_seconds * 1000)));
    auto leases = ledger_->LeasePrompts(request->worker_id(), n, duration);
    if (!leases.ok()) return ToGrpcStatus(leases.status());
    if (context->IsCancelled()) {
      // Nobody will receive these leases: give them back at once.
      for (const auto& l : *leases) (void)ledger_->ReleaseLease(l.lease_id, l.prompt_id);
      return grpc::Status(grpc::StatusCode::CANCELLED, "LeasePrompts: cancelled");
    }
    for (const auto& l : *leases) {
      v1::Lease* out = response->add_leases();
      out->set_lease_id(l.lease_id);
      out->set_prompt_id(l.prompt_id);
      out->set_row_json(l.row_json);
      out->set_deadline_unix_ms(l.deadline_ms);
    }
    if (!leases->empty()) {
      response->set_retry_after_ms(0);
    } else {
      std::lock_guard<std::mutex> lock(mu_);
      housekeep_due_ = true;  // maybe the pass just ended
      train_cv_.notify_all();
    }
    return grpc::Status::OK;
  });
}

void LearnerServer::Refuse(PushTally* tally, const std::string& reason,
                           const std::string& message) {
  ++tally->refused;
  ++tally->by_reason[reason];
  if (tally->messages.size() < kMaxAckMessages) tally->messages.push_back(message);
  metrics_.groups_rejected->Increment({reason});
  std::lock_guard<std::mutex> lock(mu_);
  ++refused_[reason];
}

void LearnerServer::RecordStepMetrics(const learner::StepMetrics& step) {
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

void LearnerServer::RefreshLedgerMetrics() {
  auto counts = ledger_->Counts();
  if (!counts.ok()) return;  // Housekeep and BuildJob report ledger errors
  metrics_.ledger_prompts->Set({"queued"}, static_cast<double>(counts->queued));
  metrics_.ledger_prompts->Set({"leased"}, static_cast<double>(counts->leased));
  metrics_.ledger_prompts->Set({"trained"}, static_cast<double>(counts->trained));
  metrics_.ledger_prompts->Set({"rejected"}, static_cast<double>(counts->rejected));
}

void LearnerServer::ProcessGroup(const v1::RolloutGroup& msg, grpc::ServerContext* context,
                                 PushTally* tally) {
  common::RolloutGroup group = FromProto(msg);
  const std::string& lease = group.lease_id;
  const std::string& prompt = group.prompt_id;
  const std::string what = "group for prompt '" + prompt + "'";
  auto release = [&] {
    if (Status s = ledger_->ReleaseLease(lease, prompt); !s.ok()) {
      GRPO_LOG_DEBUG("learner: release {}: {}", prompt, s.ToString());
    }
  };
  bool ended = false, stopping = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ended = TerminalLocked();
    stopping = stopping_;
  }
  if (ended || stopping) {
    release();  // a lease that is still ours goes back to the queue now
    Refuse(tally, ended ? "job_ended" : "learner_stopping",
           what + (ended ? ": the job has ended" : ": the learner is shutting down"));
    return;
  }
  // 1. The lease.
  auto record = ledger_->GetPrompt(prompt);
  if (!record.ok() && record.status().code() != StatusCode::kNotFound) {
    Refuse(tally, "ledger_error", what + ": " + record.status().ToString());
    return;
  }
  if (!record.ok() || lease.empty() || record->state != learner::PromptState::kLeased ||
      record->lease_id != lease) {
    Refuse(tally, "unknown_lease", what + ": unknown lease '" + lease + "'");
    return;
  }
  if (record->lease_deadline_ms < ledger_->NowMs()) {
    Refuse(tally, "expired_lease", what + ": lease '" + lease + "' expired");
    return;
  }
  // 2. The policy: weights this learner published (a restarted learner's versions start again
  //    from its checkpoint, so a dead learner's version numbers mean other weights).
  if (group.policy_incarnation != incarnation_ ||
      group.policy_version > trainer_->policy_version()) {
    Refuse(tally, "unknown_policy",
           what + ": policy version " + std::to_string(group.policy_version) + " of learner '" +
               group.policy_incarnation + "' was not published by this learner ('" +
               incarnation_ + "', at version " + std::to_string(trainer_->policy_version()) +
               ")");
    release();
    return;
  }
  // 3. The content.
  learner::RejectReason reason = learner::RejectReason::kGroupSize;
  if (Status v = trainer_->ValidateGroup(group, &reason); !v.ok()) {
    Refuse(tally, std::string(learner::RejectReasonName(reason)), v.message());
    bool reject_prompt = reason == learner::RejectReason::kEmptyPrompt;
    if (reason != learner::RejectReason::kStale) {
      std::lock_guard<std::mutex> lock(mu_);
      if (++bad_group_attempts_[prompt] >= kMaxBadGroupAttempts) reject_prompt = true;
      if (reject_prompt) bad_group_attempts_.erase(prompt);
    }
    if (reject_prompt) {
      if (Status s = ledger_->RejectPrompt(lease, prompt, v.message()); !s.ok()) {
        GRPO_LOG_DEBUG("learner: reject {}: {}", prompt, s.ToString());
      }
    } else {
      release();
    }
    return;
  }
  if (config_.reward_funcs.empty() && !group.completions.empty()) {
    const auto count = static_cast<int64_t>(group.completions[0].rewards.size());
    std::unique_lock<std::mutex> lock(mu_);
    if (reward_count_ >= 0 && count != reward_count_) {
      lock.unlock();
      Refuse(tally, "reward_count",
             what + ": " + std::to_string(count) + " rewards per completion, earlier groups had " +
                 std::to_string(reward_count_));
      release();
      return;
    }
  }
  // 4. Room in the buffer (backpressure), reserved before the lease completes.
  int64_t accepted_ms = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto room = [this] {
      return stopping_ || TerminalLocked() ||
             static_cast<int64_t>(buffer_.size() + accepting_ms_.size()) < buffer_capacity_;
    };
    if (!tally->buffer_timed_out) {
      const auto deadline = Clock::now() + options_.push_buffer_wait;
      while (!room() && Clock::now() < deadline && !context->IsCancelled()) {
        room_cv_.wait_for(lock,
                          std::min<Clock::duration>(kWaitPollInterval, deadline - Clock::now()));
      }
    }
    if (stopping_ || TerminalLocked()) {
      const bool ended = TerminalLocked();
      lock.unlock();
      release();
      Refuse(tally, ended ? "job_ended" : "learner_stopping",
             what + (ended ? ": the job has ended" : ": the learner is shutting down"));
      return;
    }
    if (!room()) {
      tally->buffer_timed_out = true;
      lock.unlock();
      release();
      Refuse(tally, "buffer_full", what + ": the learner's buffer stayed full");
      return;
    }
    accepted_ms = ledger_->NowMs();
    accepting_ms_.insert(accepted_ms);
  }
  // 5. Complete the lease, then buffer the group.
  Status done = ledger_->CompleteLease(lease, prompt);
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ms_.erase(accepting_ms_.find(accepted_ms));
    if (done.ok()) {
      if (reward_count_ < 0 && !group.completions.empty()) {
        reward_count_ = static_cast<int64_t>(group.completions[0].rewards.size());
      }
      metrics_.staleness->Observe(
          static_cast<double>(trainer_->policy_version() - group.policy_version));
      buffer_.push_back(BufferedGroup{std::move(group), record->pass, accepted_ms});
      bad_group_attempts_.erase(prompt);
      ++tally->accepted;
      metrics_.groups_accepted->Increment();
      metrics_.buffer_groups->Set(static_cast<double>(buffer_.size()));
    }
  }
  if (!done.ok()) {
    room_cv_.notify_all();
    Refuse(tally, "expired_lease", what + ": " + done.message());
    return;
  }
  train_cv_.notify_all();
}

grpc::Status LearnerServer::PushRollouts(grpc::ServerContext* context,
                                         grpc::ServerReader<v1::RolloutGroup>* reader,
                                         v1::PushRolloutsResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("PushRollouts", [&] {
    PushTally tally;
    v1::RolloutGroup msg;
    while (reader->Read(&msg)) ProcessGroup(msg, context, &tally);
    response->set_accepted(tally.accepted);
    response->set_rejected(tally.refused);
    for (const auto& [k, v] : tally.by_reason) (*response->mutable_rejected_by_reason())[k] = v;
    for (const auto& m : tally.messages) response->add_messages(m);
    return grpc::Status::OK;
  });
}

grpc::Status LearnerServer::GetWeights(grpc::ServerContext* context,
                                       const v1::GetWeightsRequest* request,
                                       grpc::ServerWriter<v1::WeightChunk>* writer) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("GetWeights", [&] {
    const int64_t chunk = request->chunk_bytes() > 0
                              ? std::min<int64_t>(request->chunk_bytes(), kDefaultWeightChunkBytes)
                              : kDefaultWeightChunkBytes;
    std::shared_ptr<const WeightSnapshot> snap;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto deadline = Clock::now() + kDefaultGetWeightsWait;
      auto ready = [&] {
        return stopping_ || (weights_ && weights_->version >= request->min_version());
      };
      while (!ready() && Clock::now() < deadline && !context->IsCancelled()) {
        state_cv_.wait_for(lock, kWaitPollInterval);
      }
      if (!weights_ || weights_->version < request->min_version()) {
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "policy version " + std::to_string(request->min_version()) +
                                " not published (at " +
                                std::to_string(weights_ ? weights_->version : -1) + ")");
      }
      snap = weights_;
    }
    v1::WeightChunk msg;
    for (size_t i = 0; i < snap->tensors.size(); ++i) {
      const auto& [name, t] = snap->tensors[i];
      auto dtype = common::SafetensorsDtypeName(t.scalar_type());
      if (!dtype.ok()) return ToGrpcStatus(dtype.status());
      const int64_t bytes = static_cast<int64_t>(t.nbytes());
      const char* data = static_cast<const char*>(t.data_ptr());
      int64_t offset = 0;
      do {
        const int64_t n = std::min(chunk, bytes - offset);
        msg.Clear();
        msg.set_version(snap->version);
        msg.set_incarnation(incarnation_);
        msg.set_name(name);
        for (int64_t d : t.sizes()) msg.add_shape(d);
        msg.set_dtype(*dtype);
        msg.set_offset(offset);
        if (n > 0) msg.set_data(data + offset, static_cast<size_t>(n));
        msg.set_tensor_bytes(bytes);
        offset += n;
        msg.set_last(i + 1 == snap->tensors.size() && offset >= bytes);
        if (!writer->Write(msg)) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "GetWeights: the client went away");
        }
        metrics_.weight_sync_bytes->Increment(static_cast<double>(n));
      } while (offset < bytes);
    }
    return grpc::Status::OK;
  });
}

// ---------------------------------------------------------------------------------------------
// Clients.

grpc::Status LearnerServer::SubmitDataset(grpc::ServerContext* context,
                                          grpc::ServerReader<v1::SubmitDatasetRequest>* reader,
                                          v1::SubmitDatasetResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("SubmitDataset", [&] {
    v1::SubmitDatasetRequest msg;
    std::string key, name;
    std::vector<std::string> lines;
    int64_t bytes = 0;
    bool first = true, last = false;
    int64_t total_lines = -1;
    while (reader->Read(&msg)) {
      if (last) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "SubmitDataset: a message after the one marked last; nothing stored");
      }
      if (first) {
        key = msg.idempotency_key();
        name = msg.name();
        first = false;
      }
      for (auto& line : *msg.mutable_lines()) {
        // A line costs its bytes and its newline: a flood of blank lines counts too.
        bytes += static_cast<int64_t>(line.size()) + 1;
        if (bytes > options_.max_dataset_bytes) {
          return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                              "dataset larger than " + std::to_string(options_.max_dataset_bytes) +
                                  " bytes (a line counts its newline); nothing stored");
        }
        lines.push_back(std::move(line));
      }
      if (msg.last()) {
        last = true;
        total_lines = msg.total_lines();
      }
    }
    if (first) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty SubmitDataset");
    // Committed whole or not at all: a stream that broke (a connection lost, a deadline, a
    // message that failed to parse) ends without the message marked last.
    if (!last || context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          "SubmitDataset: the upload ended after " + std::to_string(lines.size()) +
                              " lines without its final message; nothing stored (retry it)");
    }
    if (total_lines != static_cast<int64_t>(lines.size())) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "SubmitDataset: the final message says " + std::to_string(total_lines) +
                              " lines, " + std::to_string(lines.size()) +
                              " arrived; nothing stored");
    }
    auto info = ledger_->AddDataset(key, lines);
    if (!info.ok()) return ToGrpcStatus(info.status());
    GRPO_LOG_INFO("learner: dataset {} '{}': {} prompts{}", info->dataset_id, name,
                  info->prompt_count, info->created ? "" : " (seen before)");
    response->set_dataset_id(info->dataset_id);
    response->set_prompt_count(info->prompt_count);
    response->set_created(info->created);
    {
      std::lock_guard<std::mutex> lock(mu_);
      housekeep_due_ = true;
    }
    train_cv_.notify_all();
    return grpc::Status::OK;
  });
}

grpc::Status LearnerServer::GetJob(grpc::ServerContext* context, const v1::GetJobRequest*,
                                   v1::Job* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("GetJob", [&] {
    *response = BuildJob();
    return grpc::Status::OK;
  });
}

grpc::Status LearnerServer::WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest*,
                                     grpc::ServerWriter<v1::JobEvent>* writer) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("WatchJob", [&] {
    auto sub = std::make_shared<Subscriber>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      subscribers_.push_back(sub);
    }
    struct Unsubscribe {
      LearnerServer* self;
      std::shared_ptr<Subscriber> sub;
      ~Unsubscribe() {
        std::lock_guard<std::mutex> lock(self->mu_);
        self->subscribers_.remove(sub);
      }
    } unsubscribe{this, sub};

    v1::JobEvent first;
    *first.mutable_job() = BuildJob();
    first.set_step(first.job().global_step());
    if (!writer->Write(first)) return grpc::Status::OK;
    auto terminal = [](const v1::Job& job) {
      return job.state() == "done" || job.state() == "cancelled" || job.state() == "failed";
    };
    if (terminal(first.job())) return grpc::Status::OK;
    while (true) {
      std::deque<v1::JobEvent> events;
      {
        std::unique_lock<std::mutex> lock(mu_);
        sub->cv.wait_for(lock, kWaitPollInterval,
                         [&] { return stopping_ || sub->dropped || !sub->events.empty(); });
        if (sub->dropped) {
          return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                              "WatchJob: the watcher fell too far behind; watch again");
        }
        events.swap(sub->events);
        if (events.empty() && stopping_) {
          return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the learner is shutting down");
        }
      }
      if (context->IsCancelled()) return grpc::Status::CANCELLED;
      for (const auto& e : events) {
        if (!writer->Write(e)) return grpc::Status::OK;  // the client left
        if (e.metrics().empty() && terminal(e.job())) return grpc::Status::OK;
      }
    }
  });
}

grpc::Status LearnerServer::CancelJob(grpc::ServerContext* context,
                                      const v1::CancelJobRequest* request, v1::Job* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("CancelJob", [&] {
    ChangeState(JobState::kCancelled,
                request->reason().empty() ? "cancelled by a client" : request->reason());
    *response = BuildJob();
    return grpc::Status::OK;
  });
}

// ---------------------------------------------------------------------------------------------
// The rendezvous store (c10d Store semantics; values are bytes, ADD keeps a decimal integer).

grpc::Status LearnerServer::Store(grpc::ServerContext* context, const v1::StoreRequest* request,
                                  v1::StoreResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("Store", [&]() -> grpc::Status {
    return ToGrpcStatus(ServeStoreRequest(*epoch_store_, *request, response,
                                          [context] { return context->IsCancelled(); }));
  });
}

}  // namespace grpo::services
