// GrpoConfig: every option of a grpo-serve run. Keys are TRL GRPOConfig names wherever the
// concept is the same. Sources, in order of precedence: command-line overrides
// (`--num_generations 16` or `--num_generations=16`), a YAML file, then the defaults below.
// An unknown key or a value of the wrong type is InvalidArgument naming the key (and the file).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace grpo::common {

// Upper bounds of the run's sizes (GrpoConfig::Validate): far above any run's, and low enough
// that the products the learner and the memory plan form of them (the generation batch, the
// tokens of a micro-batch) stay inside 64-bit integers whatever a config file says.
inline constexpr int64_t kMaxConfigCount = int64_t{1} << 20;   // rows, steps, generations
inline constexpr int64_t kMaxConfigTokens = int64_t{1} << 24;  // lengths and chunks, in tokens

struct GrpoConfig {
  // Model and output.
  std::string model_name_or_path;  // a Hugging Face model directory
  std::string output_dir = "grpo-output";
  uint64_t seed = 42;

  // Device and precision (TRL/transformers names). `device`: auto | cpu | cuda | cuda:N; "auto"
  // is "cuda" when a GPU is visible, else "cpu" (common/model/device.h resolves it; Validate checks
  // the spelling only). `bf16`: train in bf16 with fp32 master weights and fp32 optimizer state;
  // log-softmax, the loss and the advantages stay fp32; generation runs in bf16.
  std::string device = "auto";
  bool bf16 = false;

  // Generation (TRL names).
  int64_t num_generations = 8;
  int64_t max_prompt_length = 512;
  int64_t max_completion_length = 256;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;  // 0 = off
  std::optional<double> min_p;
  double repetition_penalty = 1.0;
  bool mask_truncated_completions = false;
  std::string truncate_prompt = "left";  // left (TRL) | reject

  // Multi-turn episodes (rollout/env/episode.h; README "Multi-turn environments"). env: "" =
  // single-turn; "builtin:NAME" (rollout/env/builtin_environments.h), "grpc:HOST:PORT"
  // (EnvironmentService) or "openenv:http://HOST:PORT" (an OpenEnv server,
  // services/openenv_environment.h). max_completion_length then bounds a whole episode, model and
  // environment tokens together.
  std::string env;
  int64_t max_turns = 4;                   // model turns per episode
  int64_t env_max_concurrency = 16;        // environment sessions of one worker at once
  double env_step_timeout_seconds = 30.0;  // per reset and per step
  // Episodes join one running decode as their environment steps (and resets) come back instead
  // of every turn waiting for every live episode's (EpisodeOptions::overlap_env_steps).
  bool overlap_env_steps = false;
  // openenv: only: the action model's field for the turn's text and the observation model's field
  // shown to the model; "" = the model's one string field.
  std::string env_action_field;
  std::string env_observation_field;
  // chatml | qwen3_training (common/tokenizer/turn_template.h; qwen3 is refused: not
  // prefix-preserving).
  std::string chat_template = "chatml";
  // Token sent to grpc: environment servers (`grpo env-server --auth_token_file`); a worker's
  // own key, like reward_auth_token_file. "" = none.
  std::string env_auth_token_file;

  // Rewards.
  std::vector<std::string> reward_funcs;
  std::vector<double> reward_weights;   // empty = all 1
  std::string scale_rewards = "group";  // group | batch | none
  // sum_then_normalize | normalize_then_sum (GDPO); TRL's multi_objective_aggregation.
  std::string multi_objective_aggregation = "sum_then_normalize";

  // Loss (docs/GRPO_SPEC.md).
  std::string loss_type = "dapo";  // common/loss_type_names.h
  double epsilon = 0.2;
  std::optional<double> epsilon_high;  // defaults to epsilon
  std::optional<double> delta;         // two-sided clipping when set
  double beta = 0.0;
  std::string importance_sampling_level = "token";  // token | sequence
  // none | token_truncate | token_mask | sequence_truncate | sequence_mask (TRL's
  // vllm_importance_sampling_mode and its default; the TRL names of these three are aliases).
  std::string importance_sampling_correction = "sequence_mask";
  double importance_sampling_cap = 3.0;             // C_max
  std::optional<double> importance_sampling_min;    // C_min; unset = no lower bound (TRL)
  bool use_bias_correction_kl = true;               // KL term x importance ratio (TRL's default)
  std::optional<double> off_policy_mask_threshold;  // DeepSeek-V3.2 sequence mask; unset = off
  double top_entropy_quantile = 1.0;  // the 80/20 rule: < 1 trains the top tokens by entropy
  // TRL's entropy bonus: the loss minus entropy_coef x the mean token entropy; with
  // use_adaptive_entropy (Skywork-OR1) entropy_coef is the initial coefficient, moved by
  // entropy_coef_delta within [entropy_coef_min, entropy_coef_max] toward entropy_target (nats).
  double entropy_coef = 0.0;
  bool use_adaptive_entropy = false;
  double entropy_coef_min = 0.0, entropy_coef_max = 1.0, entropy_coef_delta = 0.005;
  double entropy_target = 0.2;
  double sapo_temperature_pos = 1.0, sapo_temperature_neg = 1.05;
  double vespo_k_pos = 2.0, vespo_lambda_pos = 3.0, vespo_k_neg = 3.0, vespo_lambda_neg = 2.0;
  // Policy versions a group may lag the learner (docs/ARCHITECTURE.md "Async training and
  // staleness"): 1 lets workers generate with version v while the learner trains v -> v+1; 0 is
  // fully synchronous.
  int64_t max_staleness = 1;
  // In-flight weight updates (veRL's and AReaL's partial rollouts, PipelineRL's in-flight
  // updates; rollout/generator.h): a worker installs a newer policy between two decode steps of
  // the groups it is generating instead of only between generate calls, and each completion
  // token records the version that sampled it (Completion::token_versions). The group's
  // policy_version is its oldest token's, so max_staleness bounds every token.
  bool partial_rollouts = false;
  // The keys/values of the tokens before an in-flight update: "recompute" them under the new
  // weights (one prefill of each row's tokens so far; no entry is ever read under weights other
  // than those that computed it) or "keep" them (the peers' default: cheaper, and the mismatch
  // shows in logprob_mismatch).
  std::string partial_rollout_kv_cache = "recompute";
  // Continuous batching on the workers (Generator::GenerateStream; vLLM's scheduling, as
  // PipelineRL and AReaL run it): a worker keeps up to its lease size of groups decoding, leases
  // a prompt as soon as a group leaves, and pushes each group when its rows are done, so one
  // long completion holds up no other group. Without partial_rollouts a newer policy waits until
  // the groups in flight are done (a drain). With `env`, one stream of multi-turn episodes
  // (StreamEpisodes): a prompt is leased when environment sessions are free for its group.
  bool continuous_batching = false;
  // DAPO's dynamic sampling (learner/dynamic_sampling.h): groups whose rewards are all equal
  // (zero advantage) are filtered at ingest, recorded as FILTERED for their pass, and more
  // prompts are leased until the generation batch is full, or until max_num_gen_batches batches'
  // worth of groups arrived for it (then it trains on what it has; 0 = no limit, veRL's).
  bool dynamic_sampling = false;
  int64_t max_num_gen_batches = 0;

  // Batching (TRL semantics; see README "num_iterations and the generation batch").
  int64_t per_device_train_batch_size = 8;
  int64_t gradient_accumulation_steps = 1;
  std::optional<int64_t> steps_per_generation;  // defaults to gradient_accumulation_steps
  int64_t num_iterations = 1;
  int64_t logprob_chunk_tokens = 1024;  // tokens per LM-head chunk (memory-flat log-probs)
  bool gradient_checkpointing = false;
  // Micro-batches of a step trained at once (1 or 2; README "Two micro-batches at once"): the
  // second on a kept worker thread with one intra-op thread, the trainer's own at the
  // process's (OMP_NUM_THREADS=1 for one core each). One learner process, no compute copy.
  // The same gradients bit for bit.
  int64_t micro_batch_threads = 1;

  // Learner ranks (README "Learner ranks"; the world itself comes from torchrun's RANK /
  // WORLD_SIZE). `fsdp` in the Hugging Face Trainer's words: no_shard (DDP: gradients
  // all-reduced), shard_grad_op (ZeRO-2), full_shard (ZeRO-3 / FSDP), each optionally followed
  // by " offload" (AdamW state and fp32 master weights in host memory). ParseFsdp reads it.
  std::string fsdp = "no_shard";
  // full_shard: start the all-gather of the unit used next while one computes (FSDP's forward
  // and backward prefetch); one more unit is whole at a time. Off: each gather waits.
  bool fsdp_prefetch = true;
  // The deadline of every collective among learner ranks, in seconds: a rank that died or
  // stalled makes the others fail within it (and exit for the orchestrator to restart the
  // group). It bounds the wait of the fastest rank for the slowest one in a step, so it must
  // exceed the longest micro-batch imbalance.
  double rank_timeout_seconds = 600.0;

  // Optimizer and schedule.
  double learning_rate = 1e-6;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;
  std::string lr_scheduler_type = "linear";  // constant | linear | cosine
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;
  int64_t max_steps = 100;

  // Checkpoints and debugging.
  int64_t save_steps = 50;
  // Checkpoints kept under output_dir (the newest ones; the one `latest` names is never
  // removed); 0 = keep all. TRL's name; TRL keeps all by default.
  int64_t save_total_limit = 3;
  int64_t logging_steps = 1;
  std::string dump_batches_dir;

  // Services.
  std::string learner_address = "127.0.0.1:50051";
  int64_t grpc_port = 50051;
  int64_t metrics_port = 9400;
  std::string ledger_path;  // default: <output_dir>/ledger.sqlite
  double lease_seconds = 300.0;
  // gloo | nccl | cuda_ipc | auto | grpc (docs/ARCHITECTURE.md "Weight sync"): the worker's
  // request; the learner assigns at Register (auto: cuda_ipc on its GPU, nccl on another GPU,
  // gloo on the CPU).
  std::string weight_sync_backend = "gloo";
  int64_t weight_sync_steps = 1;
  // snapshot | stream (docs/ARCHITECTURE.md "Weight sync"): `snapshot` keeps each published
  // version as a CPU copy of the whole model (and a GPU copy for GPU backends) that the
  // weight-sync groups and GetWeights read at any time; `stream` keeps none: GetWeights calls
  // and the groups wait for the training thread, which streams the policy to them a tensor at a
  // time (with full_shard a unit at a time, every rank gathering) while training waits.
  std::string weight_publish = "snapshot";
  // The deadline of each weight-sync rendezvous and collective, in seconds: a worker that stalls
  // a broadcast (stopped, swapping, partitioned but connected) costs its group at most this
  // once, and is then left out of the group until it heartbeats again. Well under
  // lease_seconds; above the workers' heartbeat interval (2 s), so that a live worker is never
  // taken for a stalled one.
  double weight_sync_timeout_seconds = 10.0;
  std::string auth_token_file;
  // TLS (off unless set). The learner serves TLS with tls_cert_file + tls_key_file (PEM, both or
  // neither); clients (workers, `grpo submit`) verify the learner against tls_ca_file (PEM).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_ca_file;
  // Network exposure (README "Security"). The addresses the learner's gRPC server and every
  // process's /metrics listener bind ("0.0.0.0" = all IPv4 interfaces, "::" = IPv4 and IPv6,
  // "127.0.0.1" = this machine only); the learner's Gloo rank listens on weight_sync_hostname
  // ("" = the address the machine's hostname resolves to). Gloo traffic is plaintext.
  std::string grpc_bind_address = "0.0.0.0";
  std::string metrics_bind_address = "0.0.0.0";
  std::string weight_sync_hostname;
  // Token sent to remote reward servers (reward_funcs `remote:...`) and required by
  // `grpo reward-server`; never the learner's auth_token_file. "" = none.
  std::string reward_auth_token_file;
  // gRPC server limits: transport buffer memory (MiB) and threads serving calls.
  int64_t grpc_memory_quota_mb = 1024;
  int64_t grpc_max_threads = 256;
  // /metrics listener: open connections at most (more are closed at once), and the deadline of
  // reading one request or writing one response (seconds).
  int64_t metrics_max_connections = 64;
  double metrics_io_timeout_seconds = 10.0;
  std::string log_level = "info";

  int64_t EffectiveStepsPerGeneration() const {
    return steps_per_generation.value_or(gradient_accumulation_steps);
  }
  // The generation batch (docs/GRPO_SPEC.md "num_iterations and the generation batch"), the one
  // home of its arithmetic: completions (per_device_train_batch_size x steps_per_generation),
  // prompts = groups (completions / num_generations; Validate checks that it divides), and the
  // optimizer steps (policy versions) it makes: ceil(steps_per_generation /
  // gradient_accumulation_steps) per pass, num_iterations passes, at least 1.
  int64_t GenerationBatchSize() const {
    return per_device_train_batch_size * EffectiveStepsPerGeneration();
  }
  int64_t GenerationBatchGroups() const {
    return num_generations > 0 ? GenerationBatchSize() / num_generations : 0;
  }
  int64_t VersionsPerGenerationBatch() const {
    const int64_t spg = EffectiveStepsPerGeneration();
    const int64_t gas = gradient_accumulation_steps > 0 ? gradient_accumulation_steps : 1;
    const int64_t v = (spg + gas - 1) / gas * num_iterations;
    return v > 1 ? v : 1;
  }
  double EffectiveEpsilonHigh() const { return epsilon_high.value_or(epsilon); }

  // Cross-field and range checks (e.g. num_generations >= 2, loss_type known). The message
  // names the key.
  Status Validate() const;
  // Every key with its current value (null for unset optionals).
  nlohmann::json ToJson() const;
};

// The sharding modes of `fsdp` (README "Learner ranks").
enum class FsdpMode { kNoShard, kShardGradOp, kFullShard };
struct FsdpSpec {
  FsdpMode mode = FsdpMode::kNoShard;
  bool offload = false;
  bool prefetch = true;  // GrpoConfig::fsdp_prefetch (not part of the `fsdp` text)
};
// "no_shard" | "shard_grad_op" | "full_shard", optionally followed by " offload" (also alone:
// "offload" = "no_shard offload"); InvalidArgument naming the key otherwise.
StatusOr<FsdpSpec> ParseFsdp(std::string_view text);
const char* FsdpModeName(FsdpMode mode);

// Parses YAML text; `source` names it in errors (a file path, or "<string>").
StatusOr<GrpoConfig> ParseConfigYaml(std::string_view yaml_text, std::string_view source,
                                     GrpoConfig base = {});
// Reads and parses a YAML file. NotFound when the file cannot be read.
StatusOr<GrpoConfig> LoadConfigFile(const std::string& path, GrpoConfig base = {});
// Sets one key from its textual value (as on a command line). Lists: comma-separated or
// "[a, b]"; optionals: "null" or "none" unsets.
Status SetConfigValue(GrpoConfig& config, std::string_view key, std::string_view value);
// Applies `--key value` / `--key=value` pairs. A `--config FILE` among them is loaded first.
Status ApplyConfigOverrides(GrpoConfig& config, const std::vector<std::string>& args);
// True for the spellings `device` accepts: auto, cpu, cuda, cuda:N (N up to 3 digits).
bool IsDeviceSpelling(std::string_view device);
// All key names, for help text and tests.
std::vector<std::string> ConfigKeys();
// One line per key: "name (type, default ...)".
std::string ConfigHelp();

}  // namespace grpo::common
