#include "rollout/rollout_loop.h"

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <thread>
#include <utility>

#include "common/group_refusal.h"
#include "common/logging.h"
#include "common/model/device.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "common/weight_sync/backends.h"
#include "rollout/retry_policy.h"

namespace grpo::rollout {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Slice of every interruptible wait: how late a stop request can be noticed.
constexpr milliseconds kStopPollInterval{20};

int64_t UnixMillis() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
}

}  // namespace

int64_t SeedIndex(std::string_view lease_id) {
  // FNV-1a.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : lease_id) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 2);
}

// --- Backoff

Backoff::Backoff(BackoffOptions options, uint64_t seed) : options_(options), rng_(seed) {}

milliseconds Backoff::Next() {
  double base = static_cast<double>(options_.initial.count());
  const double cap = static_cast<double>(options_.max.count());
  for (int64_t i = 0; i < attempt_ && base < cap; ++i) base *= options_.multiplier;
  ++attempt_;
  const double j = std::clamp(options_.jitter, 0.0, 1.0);
  std::uniform_real_distribution<double> factor(1.0 - j, 1.0 + j);
  const double d = std::min(cap, base * factor(rng_));
  return milliseconds(static_cast<int64_t>(std::max(0.0, d)));
}

// --- Config from the learner

const std::vector<std::string>& LearnerOwnedConfigKeys() {
  static const std::vector<std::string> keys = {"seed",
                                                "num_generations",
                                                "max_prompt_length",
                                                "max_completion_length",
                                                "temperature",
                                                "top_p",
                                                "top_k",
                                                "min_p",
                                                "repetition_penalty",
                                                "mask_truncated_completions",
                                                "bf16",
                                                "truncate_prompt",
                                                "env",
                                                "max_turns",
                                                "env_max_concurrency",
                                                "env_step_timeout_seconds",
                                                "overlap_env_steps",
                                                "env_action_field",
                                                "env_observation_field",
                                                "chat_template",
                                                "reward_funcs",
                                                "reward_weights",
                                                "max_staleness",
                                                "partial_rollouts",
                                                "partial_rollout_kv_cache",
                                                "continuous_batching",
                                                "per_device_train_batch_size",
                                                "gradient_accumulation_steps",
                                                "steps_per_generation",
                                                "lease_seconds"};
  return keys;
}

StatusOr<common::GrpoConfig> MergeLearnerConfig(const common::GrpoConfig& local,
                                                const std::string& config_json) {
  common::GrpoConfig merged = local;
  if (config_json.empty()) {
    RETURN_IF_ERROR(merged.Validate().WithContext("worker config"));
    return merged;
  }
  const nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument("learner config_json is not a JSON object");
  }
  const auto text_of = [](const nlohmann::json& v) -> std::string {
    if (v.is_null()) return "null";
    if (v.is_string()) return v.get<std::string>();
    if (v.is_array()) {
      std::string out;
      for (const auto& item : v) {
        if (!out.empty()) out += ",";
        out += item.is_string() ? item.get<std::string>() : item.dump();
      }
      return "[" + out + "]";
    }
    return v.dump();
  };
  for (const auto& key : LearnerOwnedConfigKeys()) {
    if (!j.contains(key)) continue;
    RETURN_IF_ERROR(
        common::SetConfigValue(merged, key, text_of(j[key])).WithContext("learner config_json"));
  }
  if (merged.model_name_or_path.empty() && j.contains("model_name_or_path") &&
      j["model_name_or_path"].is_string()) {
    merged.model_name_or_path = j["model_name_or_path"].get<std::string>();
  }
  RETURN_IF_ERROR(merged.Validate().WithContext("learner config_json"));
  return merged;
}

// --- RolloutLoop

StatusOr<std::unique_ptr<RolloutLoop>> RolloutLoop::Create(RolloutLoopOptions options,
                                                           LearnerLink* link,
                                                           WeightReceiver* receiver) {
  if (link == nullptr || receiver == nullptr) {
    return Status::InvalidArgument("rollout loop needs a learner link and a weight receiver");
  }
  if (options.prompts_per_lease < 0) {
    return Status::InvalidArgument("prompts_per_lease must be >= 0");
  }
  // `device` is the worker's own (never the learner's): resolved here, before any call.
  ASSIGN_OR_RETURN(const at::Device device, common::ResolveDevice(options.config.device));
  return std::unique_ptr<RolloutLoop>(new RolloutLoop(std::move(options), device, link, receiver));
}

RolloutLoop::RolloutLoop(RolloutLoopOptions options, at::Device device, LearnerLink* link,
                         WeightReceiver* receiver)
    : options_(std::move(options)),
      device_(device),
      link_(link),
      backoff_(options_.backoff),
      failed_groups_(options_.backoff),
      receiver_(receiver),
      worker_id_(options_.worker_id),
      config_(options_.config) {}

RolloutLoop::~RolloutLoop() { StopHeartbeat(); }

WorkerStats RolloutLoop::stats() const {
  WorkerStats s;
  s.registrations = counters_.registrations.load();
  s.rounds = counters_.rounds.load();
  s.leases = counters_.leases.load();
  s.groups_pushed = counters_.groups_pushed.load();
  s.groups_accepted = counters_.groups_accepted.load();
  s.groups_rejected = counters_.groups_rejected.load();
  s.groups_dropped = counters_.groups_dropped.load();
  s.prompts_failed = counters_.prompts_failed.load();
  s.completion_tokens = counters_.completion_tokens.load();
  s.weight_fetches = counters_.weight_fetches.load();
  s.rpc_retries = counters_.rpc_retries.load();
  s.heartbeats = counters_.heartbeats.load();
  s.heartbeat_failures = counters_.heartbeat_failures.load();
  s.reward_errors = counters_.reward_errors.load();
  s.reward_timeouts = counters_.reward_timeouts.load();
  s.episodes = counters_.episodes.load();
  s.episode_turns = counters_.episode_turns.load();
  s.env_errors = counters_.env_errors.load();
  return s;
}

std::shared_ptr<const common::Model> RolloutLoop::policy() const {
  common::MutexLock lock(&mu_);
  return policy_;
}

std::string RolloutLoop::worker_id() const {
  common::MutexLock lock(&mu_);
  return worker_id_;
}

common::GrpoConfig RolloutLoop::config() const {
  common::MutexLock lock(&mu_);
  return config_;
}

bool RolloutLoop::Stopping() const { return options_.stop != nullptr && options_.stop->load(); }

bool RolloutLoop::SleepUnlessStopping(milliseconds d) {
  const auto end = Clock::now() + d;
  while (!Stopping()) {
    const auto now = Clock::now();
    if (now >= end) return true;
    std::this_thread::sleep_for(std::min<Clock::duration>(kStopPollInterval, end - now));
  }
  return false;
}

Status RolloutLoop::Retry(std::string_view what, const std::function<Status()>& attempt,
                          const std::function<bool()>& give_up, Backoff* backoff) {
  Backoff& b = backoff != nullptr ? *backoff : backoff_;
  b.Reset();
  while (true) {
    if (Stopping()) return Status::Cancelled(std::string(what) + ": worker stopping");
    Status s = attempt();
    if (s.ok() || !IsRetryable(s.code())) return s;
    // A call the stop cancelled (a long poll) is no failure to retry or warn about.
    if (Stopping()) return Status::Cancelled(std::string(what) + ": worker stopping");
    if (give_up && give_up()) return s;
    const milliseconds delay = b.Next();
    counters_.rpc_retries += 1;
    GRPO_LOG_WARN("{} failed ({}); retry {} in {} ms", what, s.ToString(), b.attempts(),
                  delay.count());
    if (!SleepUnlessStopping(delay)) {
      return Status::Cancelled(std::string(what) + ": worker stopping");
    }
  }
}

Status RolloutLoop::ApplyRegistration(const Registration& r) {
  ASSIGN_OR_RETURN(common::GrpoConfig merged, MergeLearnerConfig(options_.config, r.config_json));
  const nlohmann::json mj =
      nlohmann::json::parse(r.model_config_json, nullptr, /*allow_exceptions=*/false);
  if (mj.is_discarded()) return Status::InvalidArgument("Register: model_config_json is not JSON");
  ASSIGN_OR_RETURN(common::ModelConfig model_config,
                   common::ModelConfig::FromJson(mj, "Register model_config_json"));

  // The tokenizer is fixed for the worker's life (the vocabulary cannot change under a job).
  if (tokenizer_ == nullptr) {
    std::string path = options_.tokenizer_path;
    if (path.empty() && !merged.model_name_or_path.empty() &&
        std::filesystem::exists(std::filesystem::path(merged.model_name_or_path) /
                                "tokenizer.json")) {
      path = merged.model_name_or_path;
    }
    if (!path.empty()) {
      ASSIGN_OR_RETURN(tokenizer_, common::LoadTokenizer(path));
    } else if (model_config.vocab_size == common::ByteTokenizer::kVocabSize) {
      tokenizer_ = std::make_unique<common::ByteTokenizer>();
    } else {
      return Status::FailedPrecondition("no tokenizer for a model with vocab_size " +
                                        std::to_string(model_config.vocab_size) +
                                        ": pass --tokenizer (a tokenizer.json or model directory)");
    }
  }
  if (tokenizer_->vocab_size() > model_config.vocab_size) {
    return Status::InvalidArgument("tokenizer has " + std::to_string(tokenizer_->vocab_size()) +
                                   " tokens, the model's vocabulary " +
                                   std::to_string(model_config.vocab_size));
  }
  if (options_.make_rewards) {
    ASSIGN_OR_RETURN(rewards_, options_.make_rewards(merged));
  } else {
    ASSIGN_OR_RETURN(rewards_, RewardRunner::FromConfig(merged, options_.reward_options,
                                                        options_.reward_timeout));
  }
  environment_.reset();
  episode_options_.reset();
  if (!merged.env.empty()) {
    ASSIGN_OR_RETURN(environment_, options_.make_environment ? options_.make_environment(merged)
                                                             : MakeEnvironment(merged));
    ASSIGN_OR_RETURN(EpisodeOptions episode_options, EpisodeOptionsFromConfig(merged, *tokenizer_));
    episode_options_ = std::move(episode_options);
  }

  if (merged.bf16 && device_.is_cpu()) {
    std::call_once(cpu_bf16_checked_, [] {
      const std::string warning = common::CpuBf16Warning(common::MeasureCpuBf16Matmul());
      if (!warning.empty()) {
        GRPO_LOG_WARN("{} (a worker generates in the learner's precision: bf16 is its key)",
                      warning);
      }
    });
  }
  const std::shared_ptr<const common::Model> held = policy();
  if (r.model_config_json != model_config_json_ ||
      (held != nullptr && held->dtype() != common::ComputeDtype(merged.bf16))) {
    // A different architecture, or the learner's `bf16` changed: the current policy (if any)
    // cannot serve it.
    generator_.reset();
    common::MutexLock lock(&mu_);
    policy_.reset();
    policy_version_ = -1;
  }
  model_config_ = model_config;
  model_config_json_ = r.model_config_json;
  {
    common::MutexLock lock(&mu_);
    worker_id_ = r.worker_id;
    config_ = merged;
    heartbeat_interval_ = r.heartbeat_interval_ms > 0 ? milliseconds(r.heartbeat_interval_ms)
                                                      : kDefaultWorkerHeartbeatInterval;
  }
  if (generator_ != nullptr) {
    // Options may have changed: a new generator over the same policy snapshot.
    ASSIGN_OR_RETURN(generator_, Generator::Create(policy(), policy_version_.load(),
                                                   GeneratorOptionsOf(merged), tokenizer_.get()));
  }
  if (options_.metrics_registry != nullptr && !metrics_) {
    auto m = common::WorkerMetrics::Create(*options_.metrics_registry, merged.reward_funcs);
    if (m.ok()) {
      metrics_ = *m;
    } else {
      GRPO_LOG_WARN("worker metrics unavailable: {}", m.status().ToString());
    }
  }
  {
    common::MutexLock lock(&mu_);
    if (r.learner_incarnation != learner_incarnation_) {
      // A different learner process (a restart): its versions restart from its checkpoint, so
      // what we hold under a version number is not its weights. Take its weights now.
      if (!learner_incarnation_.empty()) {
        GRPO_LOG_WARN("the learner restarted (incarnation {} -> {}): dropping policy version {}",
                      learner_incarnation_, r.learner_incarnation, policy_version_.load());
      }
      learner_incarnation_ = r.learner_incarnation;
      if (policy_incarnation_ != learner_incarnation_) policy_version_ = -1;
    }
    // The registration is the learner's word on its version (NoteLearnerVersion only raises it).
    learner_version_ = r.policy_version;
    WakeFetcher();
    // Under the lock with the sequence, so that a heartbeat answered across this registration
    // neither asks for another nor is noted (HeartbeatLoop).
    ++registration_seq_;
    needs_register_ = false;
  }
  {
    common::MutexLock lock(&mu_);
    assigned_backend_ = r.weight_sync_backend;
  }
  if (!r.weight_sync_note.empty()) {
    GRPO_LOG_INFO("weight sync: asked for {}, the learner assigned {}: {}", receiver_->backend(),
                  r.weight_sync_backend, r.weight_sync_note);
  }
  rank_ = r.rank;
  group_epoch_ = r.group_epoch;
  receiver_->SetGroup({r.worker_id, r.group_epoch, r.weight_sync_backend, r.learner_incarnation});
  counters_.registrations += 1;
  GRPO_LOG_INFO("registered as {} (rank {}/{}, epoch {}, policy version {})", r.worker_id, r.rank,
                r.world_size, r.group_epoch, r.policy_version);
  return Status::OK();
}

Status RolloutLoop::Register() {
  RegisterRequest request;
  request.worker_id = worker_id();
  request.hostname = Hostname();
  request.pid = static_cast<int32_t>(getpid());
  request.weight_sync_backend = receiver_->backend();
  request.device = device_.str();
  if (device_.is_cuda()) request.gpu_uuid = common::LocalSyncEndpoint(device_.str()).gpu_uuid;
  Registration registration;
  RETURN_IF_ERROR(Retry("Register", [&]() -> Status {
    ASSIGN_OR_RETURN(registration, link_->Register(request, options_.timeouts.register_call));
    return Status::OK();
  }));
  return ApplyRegistration(registration);
}

void RolloutLoop::NoteLearnerVersion(int64_t version) {
  int64_t seen = learner_version_.load();
  while (version > seen && !learner_version_.compare_exchange_weak(seen, version)) {
  }
  if (version > seen) WakeFetcher();
}

void RolloutLoop::WakeFetcher() {
  // Taking the lock orders this change after a waiter's check of it, or before it: a waiter
  // between its check and its wait holds version_mu_ (no wake-up is lost).
  { common::MutexLock lock(&version_mu_); }
  version_cv_.NotifyAll();
}

GeneratorOptions RolloutLoop::GeneratorOptionsOf(const common::GrpoConfig& config) const {
  GeneratorOptions o = GeneratorOptions::FromConfig(config);
  o.window_hook = options_.generator_window_hook;
  return o;
}

Status RolloutLoop::InstallPolicy(std::shared_ptr<const common::Model> model,
                                  const ReceivedVersion& received) {
  const int64_t version = received.version;
  if (generator_ == nullptr) {
    ASSIGN_OR_RETURN(generator_, Generator::Create(model, version, GeneratorOptionsOf(config()),
                                                   tokenizer_.get()));
  } else {
    // Generation already running keeps its snapshot; the next Generate call takes this one.
    RETURN_IF_ERROR(generator_->SetPolicy(model, version));
  }
  if (metrics_) metrics_->weight_version->Set(static_cast<double>(version));
  common::MutexLock lock(&mu_);
  policy_ = std::move(model);
  policy_version_ = version;
  // Groups carry the incarnation that published these weights, not the one registered with:
  // the learner then refuses nothing it published, and the worker refetches (NeedsWeights)
  // when the two differ.
  policy_incarnation_ = received.incarnation;
  if (policy_incarnation_ == learner_incarnation_) NoteLearnerVersion(version);
  return Status::OK();
}

StatusOr<std::pair<std::shared_ptr<const common::Model>, ReceivedVersion>>
RolloutLoop::ReceiveWeights(int64_t min_version) {
  // A new instance every time: the generator may still use the old one. Weights arrive into an
  // fp32 model on `device` (the learner publishes fp32; a group receiver's buffers follow the
  // model's dtypes, on the GPU for NCCL and CUDA IPC), then generation gets its own copy in the
  // compute dtype.
  const common::GrpoConfig cfg = config();
  const at::ScalarType dtype = common::ComputeDtype(cfg.bf16);
  ASSIGN_OR_RETURN(std::unique_ptr<common::Model> model,
                   common::Model::InitRandom(model_config_, cfg.seed, device_));
  ASSIGN_OR_RETURN(ReceivedVersion received,
                   receiver_->Receive(min_version, *model, options_.timeouts.get_weights));
  if (device_ != model->device() || dtype != model->dtype()) {
    ASSIGN_OR_RETURN(model, model->Copy(device_, dtype));
  }
  {
    common::MutexLock lock(&mu_);
    if (received.incarnation.empty()) received.incarnation = learner_incarnation_;
  }
  return std::make_pair(std::shared_ptr<const common::Model>(std::move(model)), received);
}

void RolloutLoop::FetchInFlight(const std::string& incarnation,
                                const std::atomic<bool>* generating) {
  // Woken by a newer learner version and by the round's end (WakeFetcher); the stop flag is
  // nobody's to notify, so it is looked at this often (the round's end follows it anyway).
  constexpr milliseconds kStopCheck{100};
  while (true) {
    int64_t wanted = -1;
    {
      common::MutexLock lock(&version_mu_);
      while (generating->load() && !Stopping() &&
             learner_version_.load() <= policy_version_.load()) {
        version_cv_.WaitFor(&version_mu_, kStopCheck);
      }
      if (!generating->load() || Stopping()) return;
      wanted = learner_version_.load();
    }
    {
      common::MutexLock lock(&mu_);
      if (learner_incarnation_ != incarnation) return;  // a restarted learner: the next round
    }
    const auto t0 = Clock::now();
    auto fetched = ReceiveWeights(wanted);
    if (!fetched.ok()) {
      GRPO_LOG_WARN("in-flight weights of version {}: {}; the next round takes them", wanted,
                    fetched.status().ToString());
      return;
    }
    if (fetched->second.incarnation != incarnation) return;
    counters_.weight_fetches += 1;
    GRPO_LOG_INFO("policy version {} received in flight over {} in {:.2f} s",
                  fetched->second.version, receiver_->backend(),
                  std::chrono::duration<double>(Clock::now() - t0).count());
    const Status installed = InstallPolicy(std::move(fetched->first), fetched->second);
    if (!installed.ok()) {
      GRPO_LOG_WARN("in-flight weights of version {} not installed: {}", fetched->second.version,
                    installed.ToString());
      return;
    }
  }
}

Status RolloutLoop::SyncWeights(int64_t min_version) {
  std::shared_ptr<const common::Model> fresh;
  ReceivedVersion received;
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(Retry("GetWeights", [&]() -> Status {
    ASSIGN_OR_RETURN(auto fetched, ReceiveWeights(min_version));
    fresh = std::move(fetched.first);
    received = std::move(fetched.second);
    return Status::OK();
  }));
  counters_.weight_fetches += 1;
  GRPO_LOG_INFO("policy version {} (learner {}) received over {} in {:.2f} s", received.version,
                received.incarnation.empty() ? "?" : received.incarnation, receiver_->backend(),
                std::chrono::duration<double>(Clock::now() - t0).count());
  return InstallPolicy(std::move(fresh), received);
}

int64_t RolloutLoop::PromptsPerLease() const {
  if (options_.prompts_per_lease > 0) return options_.prompts_per_lease;
  const common::GrpoConfig c = config();
  return std::max<int64_t>(1, c.GenerationBatchGroups());
}

bool RolloutLoop::NeedsWeights() const {
  if (policy_version_.load() < 0 || learner_version_.load() > policy_version_.load()) return true;
  common::MutexLock lock(&mu_);
  // Weights of a learner process the worker has left: their version numbers are not this one's.
  return !policy_incarnation_.empty() && !learner_incarnation_.empty() &&
         policy_incarnation_ != learner_incarnation_;
}

std::string RolloutLoop::PolicyIncarnation() const {
  common::MutexLock lock(&mu_);
  return policy_incarnation_;
}

StatusOr<std::optional<LeaseReply>> RolloutLoop::Lease(int64_t count, bool retry,
                                                       int64_t starts_with, milliseconds* wait) {
  *wait = milliseconds(0);
  LeaseReply leased;
  const auto attempt = [&]() -> Status {
    ASSIGN_OR_RETURN(leased,
                     link_->LeasePrompts(worker_id(), static_cast<int32_t>(count), starts_with,
                                         /*long_poll=*/retry, options_.timeouts.lease));
    return Status::OK();
  };
  Status s = retry ? Retry("LeasePrompts", attempt) : attempt();
  if (s.code() == StatusCode::kNotFound) {
    GRPO_LOG_WARN("learner does not know this worker ({}); registering again", s.ToString());
    needs_register_ = true;
    return std::optional<LeaseReply>();
  }
  RETURN_IF_ERROR(s);
  {
    common::MutexLock lock(&mu_);
    if (!leased.learner_incarnation.empty() && leased.learner_incarnation != learner_incarnation_) {
      // Another learner process answered (it restarted): register with it first. Its leases
      // are valid; they are returned at once when this worker registers again.
      needs_register_ = true;
      return std::optional<LeaseReply>();
    }
  }
  NoteLearnerVersion(leased.policy_version);
  if (leased.job_done) done_ = true;
  if (leased.leases.empty()) {
    if (!leased.job_done) {
      *wait =
          leased.retry_after_ms > 0 ? milliseconds(leased.retry_after_ms) : kDefaultEmptyLeaseWait;
    }
    return std::optional<LeaseReply>();
  }
  counters_.rounds += 1;
  counters_.leases += static_cast<int64_t>(leased.leases.size());
  return std::optional<LeaseReply>(std::move(leased));
}

Status RolloutLoop::RunRound() {
  if (NeedsWeights()) {
    RETURN_IF_ERROR(SyncWeights(std::max<int64_t>(0, learner_version_.load())));
  }

  milliseconds wait{0};
  ASSIGN_OR_RETURN(std::optional<LeaseReply> reply,
                   Lease(PromptsPerLease(), /*retry=*/true, /*starts_with=*/-1, &wait));
  if (!reply) {
    if (wait.count() > 0) SleepUnlessStopping(wait);
    return Status::OK();
  }
  LeaseReply& leased = *reply;
  SetLeasesHeld(static_cast<int32_t>(leased.leases.size()));

  // Newer weights exist: take them before generating (the leases have lease_seconds to live).
  Status s;
  if (NeedsWeights()) {
    s = SyncWeights(std::max<int64_t>(0, learner_version_.load()));
    if (!s.ok()) {
      SetLeasesHeld(0);
      return s;
    }
  }

  // Prompts: row -> text -> ids. A bad row skips that prompt only.
  std::vector<const PromptLease*> items;
  std::vector<Prompt> prompts;
  int64_t last_deadline_ms = 0;
  for (const PromptLease& lease : leased.leases) {
    last_deadline_ms = std::max(last_deadline_ms, lease.deadline_unix_ms);
    std::optional<Prompt> prompt = PrepareLeased(lease);
    if (!prompt) continue;
    items.push_back(&lease);
    prompts.push_back(std::move(*prompt));
  }
  std::vector<ProduceInput> inputs;
  for (size_t i = 0; i < items.size(); ++i) {
    inputs.push_back({&prompts[i], SeedIndex(items[i]->lease_id)});
  }

  std::vector<common::RolloutGroup> groups;
  if (!inputs.empty()) {
    // Weights are installed between rounds (SyncWeights above), and in flight only when they
    // are of this same incarnation, so the incarnation read now is the one of every snapshot
    // this round generates with.
    const std::string incarnation = PolicyIncarnation();
    std::atomic<bool> generating{true};
    std::thread fetcher;
    if (config().partial_rollouts) {
      fetcher = std::thread(
          [this, &incarnation, &generating] { FetchInFlight(incarnation, &generating); });
    }
    EpisodeCounts episodes;
    auto produced = environment_ ? ProduceEpisodes(*generator_, rewards_.get(), *environment_,
                                                   *episode_options_, inputs, &episodes)
                                 : Produce(*generator_, rewards_.get(), inputs);
    generating = false;
    WakeFetcher();
    if (fetcher.joinable()) fetcher.join();
    if (environment_) CountEpisodes(episodes);
    if (!produced.ok()) {
      SetLeasesHeld(0);
      return produced.status().WithContext("Generate");
    }
    counters_.completion_tokens += produced->num_completion_tokens;
    const double seconds = produced->generate_seconds;
    if (metrics_) {
      metrics_->tokens_generated->Increment(static_cast<double>(produced->num_completion_tokens));
      // The groups of one call decode together: each gets an equal share of the call's time.
      for (size_t i = 0; i < produced->groups.size(); ++i) {
        metrics_->generation_duration->Observe(seconds /
                                               static_cast<double>(produced->groups.size()));
      }
    }
    GRPO_LOG_DEBUG("generated {} groups ({} tokens) with policy version {} in {:.2f} s",
                   inputs.size(), produced->num_completion_tokens, produced->policy_version,
                   seconds);
    for (size_t i = 0; i < produced->groups.size(); ++i) {
      groups.push_back(ToPushed(produced->groups[i], *items[i], incarnation));
    }
  }
  s = groups.empty() ? Status::OK() : PushGroups(groups, last_deadline_ms);
  SetLeasesHeld(0);
  // Every group failed, not for its prompt (an environment that is down): wait before leasing
  // again.
  const bool all_failed =
      !groups.empty() && std::all_of(groups.begin(), groups.end(), [](const auto& g) {
        return !g.failure.empty() && !g.prompt_failed;
      });
  if (const milliseconds wait = AfterGroup(all_failed); wait.count() > 0) SleepUnlessStopping(wait);
  return s;
}

milliseconds RolloutLoop::AfterGroup(bool failed) {
  if (!failed) {
    failed_groups_.Reset();
    return milliseconds(0);
  }
  const milliseconds wait = failed_groups_.Next();
  GRPO_LOG_DEBUG("a group failed: leasing again in {} ms", wait.count());
  return wait;
}

std::optional<Prompt> RolloutLoop::PrepareLeased(const PromptLease& lease) {
  auto prompt = PreparePromptFromJson(lease.row_json, *tokenizer_);
  if (prompt.ok()) return std::move(prompt).value();
  counters_.prompts_failed += 1;
  GRPO_LOG_WARN("prompt {} (lease {}) skipped: {}", lease.prompt_id, lease.lease_id,
                prompt.status().ToString());
  return std::nullopt;
}

common::RolloutGroup RolloutLoop::ToPushed(ProducedGroup& p, const PromptLease& lease,
                                           const std::string& incarnation) {
  if (!p.group.ok()) {
    counters_.prompts_failed += 1;
    GRPO_LOG_WARN("prompt {} (lease {}) failed ({}): {}", lease.prompt_id, lease.lease_id,
                  p.prompt_failed ? "the prompt's own failure: the learner rejects it"
                                  : "its lease given back",
                  p.group.status().ToString());
    common::RolloutGroup failed;
    failed.lease_id = lease.lease_id;
    failed.prompt_id = lease.prompt_id;
    failed.policy_incarnation = incarnation;
    failed.failure = p.group.status().ToString();
    failed.prompt_failed = p.prompt_failed;
    return failed;
  }
  CountRewardFailures(p.rewards);
  for (const auto& m : p.rewards.messages) GRPO_LOG_WARN("reward: {}", m);
  common::RolloutGroup group = std::move(p.group).value();
  group.lease_id = lease.lease_id;
  group.prompt_id = lease.prompt_id;
  group.policy_incarnation = incarnation;
  return group;
}

Status RolloutLoop::PushGroups(const std::vector<common::RolloutGroup>& groups,
                               int64_t last_deadline_ms, Backoff* backoff) {
  const std::string id = worker_id();
  const auto attempt = [&](milliseconds timeout) -> Status {
    ASSIGN_OR_RETURN(const PushReply response, link_->PushGroups(id, groups, timeout));
    counters_.groups_pushed += static_cast<int64_t>(groups.size());
    if (metrics_) metrics_->groups_pushed->Increment(static_cast<double>(groups.size()));
    counters_.groups_accepted += response.accepted;
    counters_.groups_rejected += response.rejected;
    if (response.filtered > 0) {
      GRPO_LOG_DEBUG("learner filtered {} of {} groups (all rewards equal: dynamic sampling)",
                     response.filtered, groups.size());
    }
    if (response.rejected > 0) {
      std::string reasons;
      for (const auto& [reason, n] : response.rejected_by_reason) {
        reasons += " " + reason + "=" + std::to_string(n);
      }
      GRPO_LOG_WARN("learner rejected {} of {} groups:{}", response.rejected, groups.size(),
                    reasons);
      for (const auto& m : response.messages) GRPO_LOG_WARN("  {}", m);
      const auto unknown = response.rejected_by_reason.find(
          std::string(common::GroupRefusalName(common::GroupRefusal::kUnknownPolicy)));
      if (unknown != response.rejected_by_reason.end() && unknown->second > 0) {
        // The learner did not publish these weights (it restarted, or they are of a version
        // above its own): generating more with them is refused too. Register again (a restart
        // this worker has not noticed yet) and take its weights before the next round.
        policy_version_ = -1;
        needs_register_ = true;
      }
    }
    return Status::OK();
  };
  Status s;
  if (Stopping()) {
    s = attempt(options_.timeouts.stop_push);  // one try: the process is going away
  } else {
    // Worth retrying while some lease is still valid; after that the learner refuses them.
    s = Retry(
        "PushRollouts", [&] { return attempt(options_.timeouts.push); },
        [&] { return last_deadline_ms > 0 && UnixMillis() > last_deadline_ms; }, backoff);
    if (s.code() == StatusCode::kCancelled && Stopping()) {
      s = attempt(options_.timeouts.stop_push);
    }
  }
  if (!s.ok()) {
    counters_.groups_dropped += static_cast<int64_t>(groups.size());
    GRPO_LOG_ERROR("{} groups dropped (their leases will expire): {}", groups.size(), s.ToString());
  }
  return Status::OK();  // a lost push costs its leases, not the worker
}

void RolloutLoop::SetLeasesHeld(int32_t n) {
  leases_held_ = n;
  if (metrics_) metrics_->leases_held->Set(n);
}

void RolloutLoop::CountEpisodes(const EpisodeCounts& counts) {
  int64_t errors = 0;
  for (const auto& [kind, n] : counts.errors) errors += n;
  counters_.episodes += counts.episodes;
  counters_.episode_turns += counts.turns;
  counters_.env_errors += errors;
  if (!metrics_) return;
  metrics_->episodes->Increment({"done"}, static_cast<double>(counts.done));
  metrics_->episodes->Increment({"env_truncated"}, static_cast<double>(counts.env_truncated));
  metrics_->episodes->Increment({"max_turns"}, static_cast<double>(counts.max_turns));
  metrics_->episodes->Increment({"length"}, static_cast<double>(counts.length_truncated));
  metrics_->episodes->Increment({"error"}, static_cast<double>(errors));
  metrics_->episodes->Increment({"stopped"}, static_cast<double>(counts.stopped));
  metrics_->episode_turns->Increment(static_cast<double>(counts.turns));
  metrics_->env_wait->Increment(counts.env_wait_seconds);
  for (const auto& [kind, n] : counts.errors) {
    metrics_->env_errors->Increment({kind}, static_cast<double>(n));
  }
  metrics_->tool_calls->Increment(static_cast<double>(counts.tools.calls));
  for (const auto& [reason, n] : counts.tools.failures) {
    metrics_->tool_call_failures->Increment({reason}, static_cast<double>(n));
  }
}

void RolloutLoop::CountRewardFailures(const RewardCallReport& report) {
  counters_.reward_errors += report.errors;
  counters_.reward_timeouts += report.timeouts;
  if (!metrics_) return;
  const std::vector<std::string> names = rewards_->names();
  for (size_t f = 0; f < report.seconds.size() && f < names.size(); ++f) {
    if (report.seconds[f]) metrics_->reward_duration->Observe({names[f]}, *report.seconds[f]);
  }
  for (size_t f = 0; f < report.error_kinds.size() && f < names.size(); ++f) {
    if (!report.error_kinds[f]) continue;
    metrics_->reward_errors->Increment(
        {names[f], std::string(RewardErrorKindName(*report.error_kinds[f]))});
  }
}

void RolloutLoop::HeartbeatLoop() {
  while (true) {
    std::string id, assigned, registered_with;
    int64_t seq = 0;
    {
      common::MutexLock lock(&mu_);
      // One heartbeat_interval_ from when the lock is held, as wait_for with a predicate.
      const auto deadline = std::chrono::steady_clock::now() + heartbeat_interval_;
      while (!heartbeat_stop_) {
        if (!heartbeat_cv_.WaitUntil(&mu_, deadline)) break;
      }
      if (heartbeat_stop_) return;
      id = worker_id_;
      assigned = assigned_backend_;
      registered_with = learner_incarnation_;
      seq = registration_seq_;
    }
    HeartbeatRequest request;
    request.worker_id = id;
    request.weight_version = policy_version_.load();
    request.leases_held = leases_held_.load();
    const StatusOr<HeartbeatReply> response =
        link_->Heartbeat(request, options_.timeouts.heartbeat);
    if (response.ok()) {
      counters_.heartbeats += 1;
      if (response->shutdown) learner_shutdown_ = true;
    } else {
      counters_.heartbeat_failures += 1;
      GRPO_LOG_DEBUG("Heartbeat failed: {}", response.status().ToString());
    }
    {
      common::MutexLock lock(&mu_);
      // The loop registered while this heartbeat was in flight (a lease or push answered
      // NOT_FOUND, a restarted learner): the answer describes the membership before it. Asking
      // for another registration on it registered the worker twice with a restarted learner.
      if (registration_seq_ != seq) continue;
      if (!response.ok()) {
        if (response.status().code() == StatusCode::kNotFound) needs_register_ = true;
      } else if (!response->learner_incarnation.empty() &&
                 response->learner_incarnation != registered_with) {
        // Another learner process answers (it restarted): its versions and epochs are numbered
        // anew, so nothing of this answer is noted. Register again and take its weights.
        needs_register_ = true;
        continue;
      }
    }
    if (response.ok()) {
      NoteLearnerVersion(response->policy_version);
      group_epoch_ = response->group_epoch;
      receiver_->SetGroup({id, response->group_epoch, assigned, registered_with});
    }
  }
}

void RolloutLoop::StartHeartbeat() {
  if (heartbeat_thread_.joinable()) return;
  {
    common::MutexLock lock(&mu_);
    heartbeat_stop_ = false;
  }
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
}

void RolloutLoop::StopHeartbeat() {
  {
    common::MutexLock lock(&mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.NotifyAll();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

Status RolloutLoop::Run() {
  const auto finish = [&](Status s) {
    StopHeartbeat();
    if (s.code() == StatusCode::kCancelled && Stopping()) s = Status::OK();
    const WorkerStats st = stats();
    GRPO_LOG_INFO(
        "rollout worker exits ({}): {} rounds, {} groups pushed ({} accepted, {} rejected, {} "
        "dropped), {} prompts failed, {} weight fetches, {} retries",
        s.ok() ? "ok" : s.ToString(), st.rounds, st.groups_pushed, st.groups_accepted,
        st.groups_rejected, st.groups_dropped, st.prompts_failed, st.weight_fetches,
        st.rpc_retries);
    return s;
  };
  try {
    if (Status s = Register(); !s.ok()) return finish(s);
    StartHeartbeat();
    if (Status s = SyncWeights(std::max<int64_t>(0, learner_version_.load())); !s.ok()) {
      return finish(s);
    }
    int64_t rounds_at_start = counters_.rounds.load();
    while (!done_ && !Stopping() && !learner_shutdown_.load()) {
      if (options_.max_rounds > 0 &&
          counters_.rounds.load() - rounds_at_start >= options_.max_rounds) {
        break;
      }
      if (needs_register_.load()) {
        if (Status s = Register(); !s.ok()) return finish(s);
        if (policy_version_.load() < 0) {
          if (Status s = SyncWeights(std::max<int64_t>(0, learner_version_.load())); !s.ok()) {
            return finish(s);
          }
        }
      }
      const int64_t rounds_limit =
          options_.max_rounds > 0 ? rounds_at_start + options_.max_rounds : 0;
      const Status s = !config().continuous_batching ? RunRound()
                       : environment_                ? RunEpisodeStream(rounds_limit)
                                                     : RunStream(rounds_limit);
      if (!s.ok()) return finish(s);
    }
    return finish(Status::OK());
  } catch (const std::exception& e) {
    return finish(Status::Internal(std::string("rollout loop: ") + e.what()));
  }
}

}  // namespace grpo::rollout
