#include "common/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <variant>

#include "common/loss_type_names.h"
#include "common/utf8.h"

namespace grpo::common {

bool IsDeviceSpelling(std::string_view d) {
  if (d == "auto" || d == "cpu" || d == "cuda") return true;
  if (d.substr(0, 5) != "cuda:" || d.size() == 5 || d.size() > 8) return false;
  return std::all_of(d.begin() + 5, d.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

namespace {

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

bool IsNull(std::string_view v) {
  std::string t = Trim(v);
  std::transform(t.begin(), t.end(), t.begin(), ::tolower);
  return t == "null" || t == "none" || t == "~" || t.empty();
}

Status TypeError(std::string_view key, std::string_view expected, std::string_view got) {
  return Status::InvalidArgument("config key '" + std::string(key) + "' expects " +
                                 std::string(expected) + ", got '" + std::string(got) + "'");
}

Status ParseInt(std::string_view key, std::string_view text, int64_t* out) {
  std::string t = Trim(text);
  const char* end = t.data() + t.size();
  auto [p, ec] = std::from_chars(t.data(), end, *out);
  if (t.empty() || ec != std::errc() || p != end) return TypeError(key, "an integer", text);
  return Status::OK();
}

Status ParseUint(std::string_view key, std::string_view text, uint64_t* out) {
  std::string t = Trim(text);
  const char* end = t.data() + t.size();
  auto [p, ec] = std::from_chars(t.data(), end, *out);
  if (t.empty() || ec != std::errc() || p != end) {
    return TypeError(key, "a non-negative integer", text);
  }
  return Status::OK();
}

Status ParseDouble(std::string_view key, std::string_view text, double* out) {
  std::string t = Trim(text);
  if (t.empty()) return TypeError(key, "a number", text);
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || errno == ERANGE || !std::isfinite(*out)) {
    return TypeError(key, "a finite number", text);
  }
  return Status::OK();
}

Status ParseBool(std::string_view key, std::string_view text, bool* out) {
  std::string t = Trim(text);
  std::transform(t.begin(), t.end(), t.begin(), ::tolower);
  if (t == "true" || t == "yes" || t == "on" || t == "1") {
    *out = true;
  } else if (t == "false" || t == "no" || t == "off" || t == "0") {
    *out = false;
  } else {
    return TypeError(key, "a boolean (true/false)", text);
  }
  return Status::OK();
}

// Config values go into JSON (the config a worker receives at Register, checkpoints'
// trainer_state.json), which must be UTF-8: the fuzz target config_yaml found a string value
// that made ToJson().dump() throw.
Status CheckUtf8(std::string_view key, std::string_view value) {
  const std::optional<size_t> at = internal::FindInvalidUtf8(value);
  if (!at) return Status::OK();
  return Status::InvalidArgument("config key '" + std::string(key) +
                                 "' must be UTF-8 text: invalid byte at offset " +
                                 std::to_string(*at));
}

// "[a, b]" or "a,b" to items.
std::vector<std::string> SplitList(std::string_view text) {
  std::string t = Trim(text);
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') t = t.substr(1, t.size() - 2);
  std::vector<std::string> items;
  if (Trim(t).empty()) return items;
  std::stringstream ss(t);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::string v = Trim(item);
    if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front()) {
      v = v.substr(1, v.size() - 2);
    }
    items.push_back(v);
  }
  return items;
}

// One config key: how to set it from text (or a YAML list) and how to print it.
struct Field {
  std::string name;
  std::string type;  // for help and errors
  std::function<Status(GrpoConfig&, std::string_view)> set_text;
  std::function<Status(GrpoConfig&, const std::vector<std::string>&)> set_list;  // lists only
  std::function<nlohmann::json(const GrpoConfig&)> get;
};

template <typename M>
Field MakeField(std::string name, M GrpoConfig::*member, std::vector<std::string> allowed = {}) {
  Field f;
  f.name = name;
  f.get = [member](const GrpoConfig& c) -> nlohmann::json {
    const auto& v = c.*member;
    if constexpr (std::is_same_v<M, std::optional<double>> ||
                  std::is_same_v<M, std::optional<int64_t>>) {
      return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
    } else {
      return nlohmann::json(v);
    }
  };
  if constexpr (std::is_same_v<M, int64_t>) {
    f.type = "an integer";
    f.set_text = [member, name](GrpoConfig& c, std::string_view t) {
      return ParseInt(name, t, &(c.*member));
    };
  } else if constexpr (std::is_same_v<M, uint64_t>) {
    f.type = "a non-negative integer";
    f.set_text = [member, name](GrpoConfig& c, std::string_view t) {
      return ParseUint(name, t, &(c.*member));
    };
  } else if constexpr (std::is_same_v<M, double>) {
    f.type = "a number";
    f.set_text = [member, name](GrpoConfig& c, std::string_view t) {
      return ParseDouble(name, t, &(c.*member));
    };
  } else if constexpr (std::is_same_v<M, bool>) {
    f.type = "a boolean";
    f.set_text = [member, name](GrpoConfig& c, std::string_view t) {
      return ParseBool(name, t, &(c.*member));
    };
  } else if constexpr (std::is_same_v<M, std::string>) {
    std::string type = "a string";
    if (!allowed.empty()) {
      type = "one of";
      for (const auto& a : allowed) type += " " + a;
    }
    f.type = type;
    f.set_text = [member, name, allowed, type](GrpoConfig& c, std::string_view t) -> Status {
      std::string v = Trim(t);
      RETURN_IF_ERROR(CheckUtf8(name, v));
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
        return TypeError(name, type, t);
      }
      c.*member = v;
      return Status::OK();
    };
  } else if constexpr (std::is_same_v<M, std::optional<double>>) {
    f.type = "a number or null";
    f.set_text = [member, name](GrpoConfig& c, std::string_view t) -> Status {
      if (IsNull(t)) {
        (c.*member).reset();
        return Status::OK();
      }
      double v = 0.0;
      RETURN_IF_ERROR(ParseDouble(name, t, &v));
      c.*member = v;
      return Status::OK();
    };
  } else if constexpr (std::is_same_v<M, std::optional<int64_t>>) {
    f.type = "an integer or null";
    f.set_text = [member, name](GrpoConfig& c, std::string_view t) -> Status {
      if (IsNull(t)) {
        (c.*member).reset();
        return Status::OK();
      }
      int64_t v;
      RETURN_IF_ERROR(ParseInt(name, t, &v));
      c.*member = v;
      return Status::OK();
    };
  } else if constexpr (std::is_same_v<M, std::vector<std::string>>) {
    f.type = "a list of strings";
    f.set_list = [member, name](GrpoConfig& c, const std::vector<std::string>& items) -> Status {
      for (const auto& item : items) RETURN_IF_ERROR(CheckUtf8(name, item));
      c.*member = items;
      return Status::OK();
    };
    f.set_text = [f](GrpoConfig& c, std::string_view t) { return f.set_list(c, SplitList(t)); };
  } else if constexpr (std::is_same_v<M, std::vector<double>>) {
    f.type = "a list of numbers";
    f.set_list = [member, name](GrpoConfig& c, const std::vector<std::string>& items) -> Status {
      std::vector<double> out;
      for (const auto& s : items) {
        double v = 0;
        RETURN_IF_ERROR(ParseDouble(name, s, &v));
        out.push_back(v);
      }
      c.*member = out;
      return Status::OK();
    };
    f.set_text = [f](GrpoConfig& c, std::string_view t) { return f.set_list(c, SplitList(t)); };
  } else {
    static_assert(sizeof(M) == 0, "unsupported config field type");
  }
  return f;
}

// `device` is checked as it is set, so a typo fails at parse time with the key's name.
Field DeviceField() {
  Field f = MakeField("device", &GrpoConfig::device);
  f.type = "auto, cpu, cuda or cuda:N";
  f.set_text = [](GrpoConfig& c, std::string_view t) -> Status {
    const std::string v = Trim(t);
    if (!IsDeviceSpelling(v)) return TypeError("device", "auto, cpu, cuda or cuda:N", t);
    c.device = v;
    return Status::OK();
  };
  return f;
}

const std::vector<Field>& Fields() {
  using C = GrpoConfig;
  static const std::vector<Field> fields = {
      MakeField("model_name_or_path", &C::model_name_or_path),
      MakeField("output_dir", &C::output_dir),
      MakeField("seed", &C::seed),
      DeviceField(),
      MakeField("bf16", &C::bf16),
      MakeField("num_generations", &C::num_generations),
      MakeField("max_prompt_length", &C::max_prompt_length),
      MakeField("max_completion_length", &C::max_completion_length),
      MakeField("temperature", &C::temperature),
      MakeField("top_p", &C::top_p),
      MakeField("top_k", &C::top_k),
      MakeField("min_p", &C::min_p),
      MakeField("repetition_penalty", &C::repetition_penalty),
      MakeField("mask_truncated_completions", &C::mask_truncated_completions),
      MakeField("truncate_prompt", &C::truncate_prompt, {"left", "reject"}),
      MakeField("env", &C::env),
      MakeField("max_turns", &C::max_turns),
      MakeField("env_max_concurrency", &C::env_max_concurrency),
      MakeField("env_step_timeout_seconds", &C::env_step_timeout_seconds),
      MakeField("overlap_env_steps", &C::overlap_env_steps),
      MakeField("env_action_field", &C::env_action_field),
      MakeField("env_observation_field", &C::env_observation_field),
      MakeField("chat_template", &C::chat_template, {"chatml", "qwen3", "qwen3_training"}),
      MakeField("reward_funcs", &C::reward_funcs),
      MakeField("reward_weights", &C::reward_weights),
      MakeField("scale_rewards", &C::scale_rewards, {"group", "batch", "none"}),
      MakeField("multi_objective_aggregation", &C::multi_objective_aggregation,
                {"sum_then_normalize", "normalize_then_sum"}),
      MakeField("loss_type", &C::loss_type,
                std::vector<std::string>(kLossTypeNames.begin(), kLossTypeNames.end())),
      MakeField("epsilon", &C::epsilon),
      MakeField("epsilon_high", &C::epsilon_high),
      MakeField("delta", &C::delta),
      MakeField("beta", &C::beta),
      MakeField("importance_sampling_level", &C::importance_sampling_level, {"token", "sequence"}),
      MakeField("importance_sampling_correction", &C::importance_sampling_correction,
                {"none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}),
      MakeField("importance_sampling_cap", &C::importance_sampling_cap),
      MakeField("importance_sampling_min", &C::importance_sampling_min),
      MakeField("use_bias_correction_kl", &C::use_bias_correction_kl),
      MakeField("off_policy_mask_threshold", &C::off_policy_mask_threshold),
      MakeField("top_entropy_quantile", &C::top_entropy_quantile),
      MakeField("entropy_coef", &C::entropy_coef),
      MakeField("use_adaptive_entropy", &C::use_adaptive_entropy),
      MakeField("entropy_coef_min", &C::entropy_coef_min),
      MakeField("entropy_coef_max", &C::entropy_coef_max),
      MakeField("entropy_coef_delta", &C::entropy_coef_delta),
      MakeField("entropy_target", &C::entropy_target),
      MakeField("sapo_temperature_pos", &C::sapo_temperature_pos),
      MakeField("sapo_temperature_neg", &C::sapo_temperature_neg),
      MakeField("vespo_k_pos", &C::vespo_k_pos),
      MakeField("vespo_lambda_pos", &C::vespo_lambda_pos),
      MakeField("vespo_k_neg", &C::vespo_k_neg),
      MakeField("vespo_lambda_neg", &C::vespo_lambda_neg),
      MakeField("max_staleness", &C::max_staleness),
      MakeField("partial_rollouts", &C::partial_rollouts),
      MakeField("partial_rollout_kv_cache", &C::partial_rollout_kv_cache, {"recompute", "keep"}),
      MakeField("continuous_batching", &C::continuous_batching),
      MakeField("dynamic_sampling", &C::dynamic_sampling),
      MakeField("max_num_gen_batches", &C::max_num_gen_batches),
      MakeField("per_device_train_batch_size", &C::per_device_train_batch_size),
      MakeField("gradient_accumulation_steps", &C::gradient_accumulation_steps),
      MakeField("steps_per_generation", &C::steps_per_generation),
      MakeField("num_iterations", &C::num_iterations),
      MakeField("logprob_chunk_tokens", &C::logprob_chunk_tokens),
      MakeField("gradient_checkpointing", &C::gradient_checkpointing),
      MakeField("micro_batch_threads", &C::micro_batch_threads),
      MakeField("fsdp", &C::fsdp),
      MakeField("fsdp_prefetch", &C::fsdp_prefetch),
      MakeField("rank_timeout_seconds", &C::rank_timeout_seconds),
      MakeField("learning_rate", &C::learning_rate),
      MakeField("adam_beta1", &C::adam_beta1),
      MakeField("adam_beta2", &C::adam_beta2),
      MakeField("adam_epsilon", &C::adam_epsilon),
      MakeField("weight_decay", &C::weight_decay),
      MakeField("max_grad_norm", &C::max_grad_norm),
      MakeField("lr_scheduler_type", &C::lr_scheduler_type, {"constant", "linear", "cosine"}),
      MakeField("warmup_steps", &C::warmup_steps),
      MakeField("warmup_ratio", &C::warmup_ratio),
      MakeField("max_steps", &C::max_steps),
      MakeField("save_steps", &C::save_steps),
      MakeField("save_total_limit", &C::save_total_limit),
      MakeField("logging_steps", &C::logging_steps),
      MakeField("dump_batches_dir", &C::dump_batches_dir),
      MakeField("learner_address", &C::learner_address),
      MakeField("grpc_port", &C::grpc_port),
      MakeField("metrics_port", &C::metrics_port),
      MakeField("ledger_path", &C::ledger_path),
      MakeField("lease_seconds", &C::lease_seconds),
      MakeField("weight_sync_backend", &C::weight_sync_backend,
                {"gloo", "nccl", "cuda_ipc", "auto", "grpc"}),
      MakeField("weight_sync_steps", &C::weight_sync_steps),
      MakeField("weight_publish", &C::weight_publish, {"snapshot", "stream"}),
      MakeField("weight_sync_timeout_seconds", &C::weight_sync_timeout_seconds),
      MakeField("auth_token_file", &C::auth_token_file),
      MakeField("tls_cert_file", &C::tls_cert_file),
      MakeField("tls_key_file", &C::tls_key_file),
      MakeField("tls_ca_file", &C::tls_ca_file),
      MakeField("grpc_bind_address", &C::grpc_bind_address),
      MakeField("metrics_bind_address", &C::metrics_bind_address),
      MakeField("weight_sync_hostname", &C::weight_sync_hostname),
      MakeField("reward_auth_token_file", &C::reward_auth_token_file),
      MakeField("env_auth_token_file", &C::env_auth_token_file),
      MakeField("grpc_memory_quota_mb", &C::grpc_memory_quota_mb),
      MakeField("grpc_max_threads", &C::grpc_max_threads),
      MakeField("metrics_max_connections", &C::metrics_max_connections),
      MakeField("metrics_io_timeout_seconds", &C::metrics_io_timeout_seconds),
      MakeField("log_level", &C::log_level, {"trace", "debug", "info", "warn", "error", "off"}),
  };
  return fields;
}

// TRL 1.16's names for keys this project spells its own way (its vLLM importance-sampling
// settings apply here to the workers' behaviour log-probs): the same key under either name.
constexpr std::pair<std::string_view, std::string_view> kTrlAliases[] = {
    {"vllm_importance_sampling_mode", "importance_sampling_correction"},
    {"vllm_importance_sampling_clip_max", "importance_sampling_cap"},
    {"vllm_importance_sampling_clip_min", "importance_sampling_min"},
    {"vllm_importance_sampling_cap", "importance_sampling_cap"},  // TRL's deprecated name
};

const Field* FindField(std::string_view key) {
  for (const auto& [alias, name] : kTrlAliases) {
    if (key == alias) key = name;
  }
  for (const auto& f : Fields()) {
    if (f.name == key) return &f;
  }
  return nullptr;
}

// The closest key by edit distance, for "did you mean" hints on typos.
std::string ClosestKey(std::string_view key) {
  std::string best;
  size_t best_d = 4;  // suggest only near misses
  for (const auto& f : Fields()) {
    const std::string& k = f.name;
    std::vector<size_t> prev(k.size() + 1), cur(k.size() + 1);
    for (size_t j = 0; j <= k.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= key.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= k.size(); ++j) {
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (key[i - 1] != k[j - 1])});
      }
      std::swap(prev, cur);
    }
    if (prev[k.size()] < best_d) {
      best_d = prev[k.size()];
      best = k;
    }
  }
  return best;
}

Status UnknownKey(std::string_view key) {
  std::string m = "unknown config key '" + std::string(key) + "'";
  std::string hint = ClosestKey(key);
  if (!hint.empty()) m += " (did you mean '" + hint + "'?)";
  return Status::InvalidArgument(m);
}

Status Check(bool ok, std::string_view key, std::string_view what) {
  if (ok) return Status::OK();
  return Status::InvalidArgument("config key '" + std::string(key) + "' " + std::string(what));
}

// `value` in [min, max] (max: kMaxConfigCount or kMaxConfigTokens).
Status CheckRange(int64_t value, int64_t min, int64_t max, std::string_view key) {
  return Check(value >= min && value <= max, key,
               "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                   std::to_string(value));
}

}  // namespace

Status SetConfigValue(GrpoConfig& config, std::string_view key, std::string_view value) {
  const Field* f = FindField(key);
  if (f == nullptr) return UnknownKey(key);
  return f->set_text(config, value);
}

StatusOr<GrpoConfig> ParseConfigYaml(std::string_view yaml_text, std::string_view source,
                                     GrpoConfig base) {
  const std::string src(source);
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(src + ": invalid YAML: " + e.what());
  }
  if (root.IsNull()) return base;  // an empty file keeps the defaults
  if (!root.IsMap()) {
    return Status::InvalidArgument(src + ": top level must be a mapping of config keys");
  }
  for (const auto& kv : root) {
    std::string key;
    try {
      key = kv.first.as<std::string>();
    } catch (const YAML::Exception&) {
      return Status::InvalidArgument(src + ": config keys must be strings");
    }
    const Field* f = FindField(key);
    if (f == nullptr) return UnknownKey(key).WithContext(src);
    const YAML::Node& v = kv.second;
    Status s;
    if (v.IsSequence()) {
      if (!f->set_list) {
        s = TypeError(key, f->type, "a list");
      } else {
        std::vector<std::string> items;
        for (const auto& item : v) {
          if (!item.IsScalar()) {
            s = TypeError(key, f->type, "a nested value");
            break;
          }
          items.push_back(item.Scalar());
        }
        if (s.ok()) s = f->set_list(base, items);
      }
    } else if (v.IsMap()) {
      s = TypeError(key, f->type, "a mapping");
    } else if (v.IsNull()) {
      s = f->set_text(base, "null");
      if (!s.ok()) s = TypeError(key, f->type, "null");
    } else {
      s = f->set_text(base, v.Scalar());
    }
    if (!s.ok()) return s.WithContext(src);
  }
  return base;
}

StatusOr<GrpoConfig> LoadConfigFile(const std::string& path, GrpoConfig base) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read config file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseConfigYaml(ss.str(), path, std::move(base));
}

Status ApplyConfigOverrides(GrpoConfig& config, const std::vector<std::string>& args) {
  std::vector<std::pair<std::string, std::string>> pairs;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      return Status::InvalidArgument("unexpected argument '" + a + "' (expected --key value)");
    }
    std::string key = a.substr(2), value;
    if (auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else {
      if (i + 1 >= args.size()) {
        return Status::InvalidArgument("option --" + key + " needs a value");
      }
      value = args[++i];
    }
    std::replace(key.begin(), key.end(), '-', '_');
    pairs.emplace_back(key, value);
  }
  // A config file is the base; the other flags override it whatever their order.
  for (const auto& [k, v] : pairs) {
    if (k == "config") {
      ASSIGN_OR_RETURN(config, LoadConfigFile(v, config));
    }
  }
  for (const auto& [k, v] : pairs) {
    if (k == "config") continue;
    RETURN_IF_ERROR(SetConfigValue(config, k, v).WithContext("command line"));
  }
  return Status::OK();
}

Status GrpoConfig::Validate() const {
  RETURN_IF_ERROR(Check(IsDeviceSpelling(device), "device",
                        "must be auto, cpu, cuda or cuda:N, got '" + device + "'"));
  RETURN_IF_ERROR(Check(num_generations >= 2, "num_generations",
                        "must be at least 2 (GRPO compares completions within a group)"));
  RETURN_IF_ERROR(CheckRange(num_generations, 2, kMaxConfigCount, "num_generations"));
  RETURN_IF_ERROR(CheckRange(num_iterations, 1, kMaxConfigCount, "num_iterations"));
  RETURN_IF_ERROR(CheckRange(max_prompt_length, 1, kMaxConfigTokens, "max_prompt_length"));
  RETURN_IF_ERROR(CheckRange(max_completion_length, 1, kMaxConfigTokens, "max_completion_length"));
  RETURN_IF_ERROR(Check(temperature >= 0, "temperature", "must be >= 0 (0 = greedy)"));
  RETURN_IF_ERROR(Check(top_p > 0 && top_p <= 1, "top_p", "must be in (0, 1]"));
  RETURN_IF_ERROR(Check(top_k >= 0, "top_k", "must be >= 0 (0 = off)"));
  RETURN_IF_ERROR(Check(!min_p || (*min_p >= 0 && *min_p <= 1), "min_p", "must be in [0, 1]"));
  RETURN_IF_ERROR(Check(repetition_penalty > 0, "repetition_penalty", "must be > 0"));
  const bool env_known = env.empty() || env.rfind("builtin:", 0) == 0 ||
                         env.rfind("grpc:", 0) == 0 || env.rfind("openenv:", 0) == 0;
  const std::string env_kinds =
      "must be empty, builtin:NAME, grpc:HOST:PORT or openenv:http://HOST:PORT";
  RETURN_IF_ERROR(Check(env_known, "env", env_kinds + ", got '" + env + "'"));
  RETURN_IF_ERROR(CheckRange(max_turns, 1, kMaxConfigCount, "max_turns"));
  RETURN_IF_ERROR(CheckRange(env_max_concurrency, 1, kMaxConfigCount, "env_max_concurrency"));
  RETURN_IF_ERROR(Check(env_step_timeout_seconds > 0, "env_step_timeout_seconds", "must be > 0"));
  RETURN_IF_ERROR(Check(
      reward_weights.empty() || reward_weights.size() == reward_funcs.size(), "reward_weights",
      "must have one weight per reward function (" + std::to_string(reward_funcs.size()) + ")"));
  RETURN_IF_ERROR(Check(epsilon >= 0, "epsilon", "must be >= 0"));
  RETURN_IF_ERROR(Check(!epsilon_high || *epsilon_high >= 0, "epsilon_high", "must be >= 0"));
  RETURN_IF_ERROR(Check(!delta || *delta > 1, "delta", "must be > 1 when set"));
  RETURN_IF_ERROR(Check(beta >= 0, "beta", "must be >= 0"));
  RETURN_IF_ERROR(Check(importance_sampling_cap >= 1, "importance_sampling_cap", "must be >= 1"));
  RETURN_IF_ERROR(Check(
      !importance_sampling_min ||
          (*importance_sampling_min >= 0 && *importance_sampling_min < importance_sampling_cap),
      "importance_sampling_min", "must be in [0, importance_sampling_cap)"));
  RETURN_IF_ERROR(Check(top_entropy_quantile > 0 && top_entropy_quantile <= 1,
                        "top_entropy_quantile", "must be in (0, 1]"));
  RETURN_IF_ERROR(Check(entropy_coef_min >= 0, "entropy_coef_min", "must be >= 0"));
  RETURN_IF_ERROR(Check(entropy_coef_max >= entropy_coef_min, "entropy_coef_max",
                        "must be >= entropy_coef_min"));
  RETURN_IF_ERROR(Check(entropy_coef_delta >= 0, "entropy_coef_delta", "must be >= 0"));
  RETURN_IF_ERROR(Check(entropy_target >= 0, "entropy_target", "must be >= 0 (nats)"));
  RETURN_IF_ERROR(Check(!use_adaptive_entropy ||
                            (entropy_coef >= entropy_coef_min && entropy_coef <= entropy_coef_max),
                        "entropy_coef",
                        "must be in [entropy_coef_min, entropy_coef_max] with "
                        "use_adaptive_entropy (it is the initial coefficient)"));
  RETURN_IF_ERROR(Check(!off_policy_mask_threshold || *off_policy_mask_threshold >= 0,
                        "off_policy_mask_threshold", "must be >= 0 when set"));
  RETURN_IF_ERROR(Check(sapo_temperature_pos > 0 && sapo_temperature_neg > 0,
                        sapo_temperature_pos > 0 ? "sapo_temperature_neg" : "sapo_temperature_pos",
                        "must be > 0"));
  RETURN_IF_ERROR(Check(vespo_k_pos >= 0 && vespo_k_neg >= 0,
                        vespo_k_pos >= 0 ? "vespo_k_neg" : "vespo_k_pos", "must be >= 0"));
  RETURN_IF_ERROR(Check(vespo_lambda_pos > 0 && vespo_lambda_neg > 0,
                        vespo_lambda_pos > 0 ? "vespo_lambda_neg" : "vespo_lambda_pos",
                        "must be > 0"));
  RETURN_IF_ERROR(Check(loss_type != "vespo" || importance_sampling_correction == "none" ||
                            importance_sampling_correction.rfind("token_", 0) == 0,
                        "importance_sampling_correction",
                        "must be none, token_truncate or token_mask with loss_type vespo (it "
                        "folds token weights into its sequence weight), got " +
                            importance_sampling_correction));
  RETURN_IF_ERROR(Check(max_staleness >= 0, "max_staleness", "must be >= 0"));
  RETURN_IF_ERROR(
      Check(max_num_gen_batches >= 0, "max_num_gen_batches", "must be >= 0 (0 = no limit)"));
  RETURN_IF_ERROR(Check(tls_cert_file.empty() == tls_key_file.empty(),
                        tls_cert_file.empty() ? "tls_key_file" : "tls_cert_file",
                        "needs tls_cert_file and tls_key_file together"));
  RETURN_IF_ERROR(
      CheckRange(per_device_train_batch_size, 1, kMaxConfigCount, "per_device_train_batch_size"));
  RETURN_IF_ERROR(
      CheckRange(gradient_accumulation_steps, 1, kMaxConfigCount, "gradient_accumulation_steps"));
  if (steps_per_generation) {
    RETURN_IF_ERROR(CheckRange(*steps_per_generation, 1, kMaxConfigCount, "steps_per_generation"));
  }
  const int64_t gen_batch = GenerationBatchSize();
  RETURN_IF_ERROR(Check(gen_batch % num_generations == 0, "num_generations",
                        "must divide the generation batch per_device_train_batch_size x "
                        "steps_per_generation = " +
                            std::to_string(gen_batch)));
  RETURN_IF_ERROR(CheckRange(logprob_chunk_tokens, 1, kMaxConfigTokens, "logprob_chunk_tokens"));
  RETURN_IF_ERROR(CheckRange(micro_batch_threads, 1, 2, "micro_batch_threads"));
  RETURN_IF_ERROR(Check(learning_rate >= 0, "learning_rate", "must be >= 0"));
  RETURN_IF_ERROR(Check(adam_beta1 >= 0 && adam_beta1 < 1, "adam_beta1", "must be in [0, 1)"));
  RETURN_IF_ERROR(Check(adam_beta2 >= 0 && adam_beta2 < 1, "adam_beta2", "must be in [0, 1)"));
  RETURN_IF_ERROR(Check(adam_epsilon > 0, "adam_epsilon", "must be > 0"));
  RETURN_IF_ERROR(Check(weight_decay >= 0, "weight_decay", "must be >= 0"));
  RETURN_IF_ERROR(Check(max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 = no clipping)"));
  RETURN_IF_ERROR(Check(warmup_steps >= 0, "warmup_steps", "must be >= 0"));
  RETURN_IF_ERROR(
      Check(warmup_ratio >= 0 && warmup_ratio <= 1, "warmup_ratio", "must be in [0, 1]"));
  RETURN_IF_ERROR(Check(max_steps >= 1, "max_steps", "must be at least 1"));
  RETURN_IF_ERROR(Check(save_steps >= 0, "save_steps", "must be >= 0 (0 = only at the end)"));
  RETURN_IF_ERROR(
      Check(save_total_limit >= 0, "save_total_limit", "must be >= 0 (0 = keep every checkpoint)"));
  RETURN_IF_ERROR(Check(logging_steps >= 1, "logging_steps", "must be at least 1"));
  RETURN_IF_ERROR(Check(grpc_port >= 0 && grpc_port <= 65535, "grpc_port", "must be a port"));
  RETURN_IF_ERROR(
      Check(metrics_port >= 0 && metrics_port <= 65535, "metrics_port", "must be a port"));
  RETURN_IF_ERROR(Check(!grpc_bind_address.empty(), "grpc_bind_address", "must not be empty"));
  RETURN_IF_ERROR(
      Check(!metrics_bind_address.empty(), "metrics_bind_address", "must not be empty"));
  // The quota must hold at least one message of the 64 MiB receive limit (services/auth.h).
  RETURN_IF_ERROR(Check(grpc_memory_quota_mb >= 128, "grpc_memory_quota_mb", "must be >= 128"));
  RETURN_IF_ERROR(Check(grpc_max_threads >= 8, "grpc_max_threads", "must be >= 8"));
  RETURN_IF_ERROR(
      Check(metrics_max_connections >= 1, "metrics_max_connections", "must be at least 1"));
  RETURN_IF_ERROR(
      Check(metrics_io_timeout_seconds > 0, "metrics_io_timeout_seconds", "must be > 0"));
  RETURN_IF_ERROR(Check(lease_seconds > 0, "lease_seconds", "must be > 0"));
  RETURN_IF_ERROR(Check(weight_sync_timeout_seconds > 0 && weight_sync_timeout_seconds <= 3600,
                        "weight_sync_timeout_seconds", "must be in (0, 3600]"));
  if (auto fsdp_spec = ParseFsdp(fsdp); !fsdp_spec.ok()) return fsdp_spec.status();
  RETURN_IF_ERROR(Check(rank_timeout_seconds > 0 && rank_timeout_seconds <= 86400,
                        "rank_timeout_seconds", "must be in (0, 86400]"));
  RETURN_IF_ERROR(Check(weight_sync_steps >= 1, "weight_sync_steps", "must be at least 1"));
  return Status::OK();
}

StatusOr<FsdpSpec> ParseFsdp(std::string_view text) {
  FsdpSpec spec;
  bool have_mode = false;
  std::string words(text);
  std::istringstream in(words);
  std::string word;
  int count = 0;
  while (in >> word) {
    ++count;
    if (word == "offload" && !spec.offload) {
      spec.offload = true;
    } else if (!have_mode &&
               (word == "no_shard" || word == "shard_grad_op" || word == "full_shard")) {
      have_mode = true;
      spec.mode = word == "no_shard"        ? FsdpMode::kNoShard
                  : word == "shard_grad_op" ? FsdpMode::kShardGradOp
                                            : FsdpMode::kFullShard;
    } else {
      return Status::InvalidArgument(
          "config key 'fsdp': '" + words +
          "' is not one of no_shard, shard_grad_op, full_shard, optionally with ' offload'");
    }
  }
  if (count == 0) {
    return Status::InvalidArgument(
        "config key 'fsdp' is empty: use no_shard, shard_grad_op or full_shard");
  }
  return spec;
}

const char* FsdpModeName(FsdpMode mode) {
  switch (mode) {
    case FsdpMode::kNoShard:
      return "no_shard";
    case FsdpMode::kShardGradOp:
      return "shard_grad_op";
    case FsdpMode::kFullShard:
      return "full_shard";
  }
  return "no_shard";
}

nlohmann::json GrpoConfig::ToJson() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : Fields()) j[f.name] = f.get(*this);
  return j;
}

std::vector<std::string> ConfigKeys() {
  std::vector<std::string> keys;
  for (const auto& f : Fields()) keys.push_back(f.name);
  return keys;
}

std::string ConfigHelp() {
  GrpoConfig defaults;
  std::string out;
  for (const auto& f : Fields()) {
    out += "  " + f.name + " (" + f.type + ", default " + f.get(defaults).dump() + ")\n";
  }
  out += "TRL's names accepted for the same keys:\n";
  for (const auto& [alias, name] : kTrlAliases) {
    out += "  " + std::string(alias) + " = " + std::string(name) + "\n";
  }
  return out;
}

}  // namespace grpo::common
