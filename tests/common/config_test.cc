#include "common/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace grpo::common {
namespace {

TEST(Config, DefaultsFollowTrl) {
  GrpoConfig c;
  EXPECT_EQ(c.loss_type, "dapo");
  EXPECT_DOUBLE_EQ(c.epsilon, 0.2);
  EXPECT_DOUBLE_EQ(c.EffectiveEpsilonHigh(), 0.2);
  EXPECT_EQ(c.EffectiveStepsPerGeneration(), c.gradient_accumulation_steps);
  EXPECT_TRUE(c.Validate().ok()) << c.Validate().ToString();
}

// TRL 1.16 GRPOConfig's defaults for the loss keys of issue 23 (grpo_config.py).
TEST(Config, TrlObjectiveDefaults) {
  GrpoConfig c;
  EXPECT_EQ(c.importance_sampling_correction, "sequence_mask");  // vllm_importance_sampling_mode
  EXPECT_DOUBLE_EQ(c.importance_sampling_cap, 3.0);              // ..._clip_max
  EXPECT_FALSE(c.importance_sampling_min.has_value());           // ..._clip_min
  EXPECT_TRUE(c.use_bias_correction_kl);
  EXPECT_FALSE(c.off_policy_mask_threshold.has_value());
  EXPECT_DOUBLE_EQ(c.top_entropy_quantile, 1.0);
  EXPECT_EQ(c.multi_objective_aggregation, "sum_then_normalize");
  EXPECT_DOUBLE_EQ(c.sapo_temperature_pos, 1.0);
  EXPECT_DOUBLE_EQ(c.sapo_temperature_neg, 1.05);
}

// TRL's spellings of the IS keys set ours, in YAML and on the command line, and --help lists
// them; the rest of the new keys parse and are range-checked by name.
TEST(Config, TrlAliasesSetTheSameKeys) {
  auto c = ParseConfigYaml(
      "vllm_importance_sampling_mode: token_mask\n"
      "vllm_importance_sampling_clip_max: 2.5\n"
      "vllm_importance_sampling_clip_min: 0.5\n"
      "loss_type: vespo\n"
      "top_entropy_quantile: 0.2\n"
      "multi_objective_aggregation: normalize_then_sum\n",
      "run.yaml");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->importance_sampling_correction, "token_mask");
  EXPECT_DOUBLE_EQ(c->importance_sampling_cap, 2.5);
  EXPECT_DOUBLE_EQ(*c->importance_sampling_min, 0.5);
  EXPECT_TRUE(c->Validate().ok()) << c->Validate().ToString();
  EXPECT_TRUE(SetConfigValue(*c, "vllm_importance_sampling_mode", "sequence_mask").ok());
  EXPECT_EQ(c->importance_sampling_correction, "sequence_mask");
  const Status vespo = c->Validate();  // vespo takes token-level weights only (TRL)
  EXPECT_NE(vespo.message().find("importance_sampling_correction"), std::string::npos);
  EXPECT_NE(ConfigHelp().find("vllm_importance_sampling_clip_min = importance_sampling_min"),
            std::string::npos);
  EXPECT_TRUE(SetConfigValue(*c, "vllm_importance_sampling_cap", "4").ok());  // deprecated in TRL
  EXPECT_DOUBLE_EQ(c->importance_sampling_cap, 4.0);
  GrpoConfig d;
  d.importance_sampling_min = 3.0;  // not below the cap
  EXPECT_NE(d.Validate().message().find("importance_sampling_min"), std::string::npos);
  d = GrpoConfig();
  d.top_entropy_quantile = 0;
  EXPECT_NE(d.Validate().message().find("top_entropy_quantile"), std::string::npos);
  EXPECT_FALSE(SetConfigValue(d, "multi_objective_aggregation", "sum").ok());
}

TEST(Config, YamlSetsTypedKeys) {
  auto c = ParseConfigYaml(R"(
num_generations: 16
epsilon_high: 0.28
loss_type: grpo
mask_truncated_completions: true
reward_funcs: [accuracy, format]
reward_weights: [1.0, 0.5]
delta: null
)",
                           "run.yaml");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_generations, 16);
  EXPECT_DOUBLE_EQ(*c->epsilon_high, 0.28);
  EXPECT_EQ(c->loss_type, "grpo");
  EXPECT_TRUE(c->mask_truncated_completions);
  EXPECT_EQ(c->reward_funcs, (std::vector<std::string>{"accuracy", "format"}));
  EXPECT_EQ(c->reward_weights, (std::vector<double>{1.0, 0.5}));
  EXPECT_FALSE(c->delta.has_value());
}

TEST(Config, UnknownKeyIsAnErrorNamingKeyFileAndNearestKey) {
  auto c = ParseConfigYaml("num_generation: 4\n", "run.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("run.yaml"), std::string::npos) << m;
  EXPECT_NE(m.find("'num_generation'"), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean 'num_generations'"), std::string::npos) << m;
}

TEST(Config, WrongTypeNamesKeyAndExpectedType) {
  auto c = ParseConfigYaml("num_generations: four\n", "run.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'num_generations' expects an integer, got 'four'"),
            std::string::npos)
      << c.status().message();
  auto d = ParseConfigYaml("beta: [1, 2]\n", "run.yaml");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("'beta' expects a number"), std::string::npos);
  auto e = ParseConfigYaml("loss_type: ppo\n", "run.yaml");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("one of grpo bnpo dr_grpo dapo"), std::string::npos);
  auto f = ParseConfigYaml("num_generations: 2.5\n", "run.yaml");
  EXPECT_FALSE(f.ok());
  auto g = ParseConfigYaml("mask_truncated_completions: maybe\n", "run.yaml");
  EXPECT_FALSE(g.ok());
}

// Found by tests/fuzz/config_yaml_fuzz.cc: a string value that is not UTF-8 was accepted, then
// made ToJson().dump() throw (the learner dumps its config for every Register). It is an error
// naming the key and the offset now; valid multi-byte text is kept as it is.
TEST(Config, StringValuesMustBeUtf8) {
  auto c = ParseConfigYaml("output_dir: out\xff\n", "run.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'output_dir' must be UTF-8 text: invalid byte at offset 3"),
            std::string::npos)
      << c.status().message();
  // A truncated sequence, an overlong '/', a surrogate, in a list item.
  for (const char* bad :
       {"reward_funcs: [a, \"b\xc3\"]\n", "output_dir: \xc0\xaf\n", "output_dir: \xed\xa0\x80\n"}) {
    auto d = ParseConfigYaml(bad, "run.yaml");
    EXPECT_FALSE(d.ok()) << bad;
  }
  auto ok = ParseConfigYaml("output_dir: r\xc3\xa9sum\xc3\xa9-\xf0\x9f\x9a\x80\n", "run.yaml");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->output_dir, "r\xc3\xa9sum\xc3\xa9-\xf0\x9f\x9a\x80");
  EXPECT_NO_THROW((void)ok->ToJson().dump());
}

TEST(Config, MalformedYamlAndNonMappingAreErrors) {
  EXPECT_FALSE(ParseConfigYaml("num_generations: [1,\n", "bad.yaml").ok());
  auto c = ParseConfigYaml("- a\n- b\n", "list.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("list.yaml"), std::string::npos);
}

TEST(Config, CommandLineOverridesFileWhateverTheOrder) {
  std::string path = ::testing::TempDir() + "/grpo_config_test.yaml";
  {
    std::ofstream out(path);
    out << "num_generations: 4\nlearning_rate: 0.001\n";
  }
  GrpoConfig c;
  Status s = ApplyConfigOverrides(
      c, {"--num_generations", "16", "--config", path, "--temperature=0.7", "--top-k", "5"});
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(c.num_generations, 16);          // flag beats file
  EXPECT_DOUBLE_EQ(c.learning_rate, 0.001);  // file beats default
  EXPECT_DOUBLE_EQ(c.temperature, 0.7);
  EXPECT_EQ(c.top_k, 5);  // dashes accepted as underscores
  std::remove(path.c_str());
}

TEST(Config, CommandLineErrorsNameTheKey) {
  GrpoConfig c;
  Status s = ApplyConfigOverrides(c, {"--num_generatons", "4"});
  EXPECT_NE(s.message().find("'num_generatons'"), std::string::npos) << s.message();
  s = ApplyConfigOverrides(c, {"--beta"});
  EXPECT_NE(s.message().find("--beta needs a value"), std::string::npos) << s.message();
  s = ApplyConfigOverrides(c, {"--config", "/nonexistent/x.yaml"});
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
}

TEST(Config, ValidateChecksRangesAndCrossFieldRules) {
  GrpoConfig c;
  c.num_generations = 1;
  EXPECT_NE(c.Validate().message().find("num_generations"), std::string::npos);
  c = GrpoConfig();
  c.per_device_train_batch_size = 6;  // generation batch 6 is not a multiple of G = 8
  EXPECT_NE(c.Validate().message().find("must divide the generation batch"), std::string::npos);
  c = GrpoConfig();
  c.reward_funcs = {"a", "b"};
  c.reward_weights = {1.0};
  EXPECT_NE(c.Validate().message().find("reward_weights"), std::string::npos);
  c = GrpoConfig();
  c.top_p = 0;
  EXPECT_FALSE(c.Validate().ok());
}

TEST(Config, ToJsonListsEveryKey) {
  GrpoConfig c;
  auto j = c.ToJson();
  for (const auto& k : ConfigKeys()) EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_TRUE(j["epsilon_high"].is_null());
  EXPECT_EQ(j["num_generations"], 8);
}

// Issue 12 items 7-10: the network keys keep today's behaviour by default (every interface, no
// reward token), parse from the command line, and name themselves when out of range.
TEST(Config, NetworkExposureKeysDefaultToTodaysBehaviourAndAreChecked) {
  GrpoConfig c;
  EXPECT_EQ(c.grpc_bind_address, "0.0.0.0");
  EXPECT_EQ(c.metrics_bind_address, "0.0.0.0");
  EXPECT_EQ(c.weight_sync_hostname, "");
  EXPECT_EQ(c.reward_auth_token_file, "");
  EXPECT_EQ(c.metrics_max_connections, 64);
  EXPECT_EQ(c.metrics_io_timeout_seconds, 10.0);
  EXPECT_EQ(c.grpc_memory_quota_mb, 1024);
  EXPECT_EQ(c.grpc_max_threads, 256);
  ASSERT_TRUE(ApplyConfigOverrides(
                  c, {"--grpc_bind_address", "127.0.0.1", "--metrics_bind_address=::1",
                      "--weight_sync_hostname", "10.0.0.5", "--reward_auth_token_file",
                      "/run/reward", "--metrics_max_connections", "8", "--grpc_max_threads", "32",
                      "--grpc_memory_quota_mb", "256", "--metrics_io_timeout_seconds", "2.5"})
                  .ok());
  EXPECT_EQ(c.grpc_bind_address, "127.0.0.1");
  EXPECT_EQ(c.metrics_bind_address, "::1");
  EXPECT_EQ(c.weight_sync_hostname, "10.0.0.5");
  EXPECT_EQ(c.reward_auth_token_file, "/run/reward");
  EXPECT_EQ(c.metrics_max_connections, 8);
  EXPECT_EQ(c.grpc_max_threads, 32);
  EXPECT_EQ(c.grpc_memory_quota_mb, 256);
  EXPECT_EQ(c.metrics_io_timeout_seconds, 2.5);
  EXPECT_TRUE(c.Validate().ok());
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"metrics_max_connections", "0"}, {"metrics_io_timeout_seconds", "0"},
      {"grpc_max_threads", "2"},        {"grpc_memory_quota_mb", "64"},
      {"grpc_bind_address", ""},        {"metrics_bind_address", ""}};
  for (const auto& [key, value] : bad) {
    GrpoConfig b;
    ASSERT_TRUE(SetConfigValue(b, key, value).ok()) << key;
    EXPECT_NE(b.Validate().message().find(key), std::string::npos) << key << " = " << value;
  }
}

TEST(Config, DeviceDefaultsToAutoAndBf16ToFalse) {
  GrpoConfig c;
  EXPECT_EQ(c.device, "auto");
  EXPECT_FALSE(c.bf16);
  EXPECT_EQ(c.ToJson().at("device"), "auto");
  EXPECT_EQ(c.ToJson().at("bf16"), false);
}

TEST(Config, DeviceAcceptsCpuCudaAndCudaIndex) {
  auto c = ParseConfigYaml("device: cuda:1\nbf16: true\n", "run.yaml");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->device, "cuda:1");
  EXPECT_TRUE(c->bf16);
  for (const char* d : {"auto", "cpu", "cuda", "cuda:0", "cuda:15"}) {
    GrpoConfig g;
    EXPECT_TRUE(SetConfigValue(g, "device", d).ok()) << d;
    EXPECT_EQ(g.device, d);
    EXPECT_TRUE(g.Validate().ok()) << d;
  }
}

// The run's sizes have bounds (config.h kMaxConfigCount, kMaxConfigTokens), checked before any
// arithmetic on them: the generation batch of per_device_train_batch_size 2^62 x 4 was signed
// overflow inside Validate (found by tests/fuzz/config_yaml_fuzz.cc under UBSan).
TEST(Config, SizesPastTheirBoundsAreInvalidArgumentNamingTheKey) {
  const std::pair<const char*, int64_t> bounds[] = {
      {"num_generations", int64_t{1} << 20},
      {"num_iterations", int64_t{1} << 20},
      {"per_device_train_batch_size", int64_t{1} << 20},
      {"gradient_accumulation_steps", int64_t{1} << 20},
      {"steps_per_generation", int64_t{1} << 20},
      {"max_prompt_length", int64_t{1} << 24},
      {"max_completion_length", int64_t{1} << 24},
      {"logprob_chunk_tokens", int64_t{1} << 24},
  };
  for (const auto& [key, bound] : bounds) {
    // At the bound: taken (num_generations 2^20 divides a generation batch of 2^20 rows).
    GrpoConfig base;
    base.num_generations = 8;
    base.per_device_train_batch_size = std::string_view(key) == "num_generations" ? bound : 8;
    ASSERT_TRUE(SetConfigValue(base, key, std::to_string(bound)).ok()) << key;
    EXPECT_TRUE(base.Validate().ok()) << key << ": " << base.Validate().ToString();
    for (int64_t bad : {bound + 1, int64_t{1} << 62}) {
      std::string yaml = key;
      yaml.append(": ").append(std::to_string(bad));
      auto c = ParseConfigYaml(yaml, "run.yaml");  // parses; Validate checks the range
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      const Status s = c->Validate();
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << key << " " << bad;
      const std::string quoted = std::string("'").append(key).append("'");
      EXPECT_NE(s.message().find(quoted), std::string::npos) << s.ToString();
      EXPECT_NE(s.message().find(std::to_string(bound)), std::string::npos) << s.ToString();
    }
  }
}

TEST(Config, BadDeviceIsInvalidArgumentNamingTheKey) {
  for (const char* d : {"gpu", "CUDA", "cuda:", "cuda:-1", "cuda:a", "cuda0", "tpu"}) {
    GrpoConfig g;
    const Status s = SetConfigValue(g, "device", d);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << d;
    EXPECT_NE(s.message().find("'device'"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("cuda:N"), std::string::npos) << s.ToString();
    EXPECT_EQ(g.device, "auto");
  }
  auto c = ParseConfigYaml("device: gpu\n", "run.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("run.yaml"), std::string::npos);
  GrpoConfig direct;
  direct.device = "metal";  // set around the parser
  EXPECT_EQ(direct.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SetConfigValue(direct, "bf16", "maybe").code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::common
