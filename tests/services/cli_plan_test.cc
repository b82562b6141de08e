// `grpo plan` and the learner's start-up check as users run them: real processes, a model
// directory holding config.json alone (the plan loads no weights).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/test_util.h"

namespace {

using grpo::testing::GrpoBin;
using grpo::testing::RunCommand;
namespace fs = std::filesystem;
using nlohmann::json;

// The bench preset's config.json and Qwen2.5-7B's (Hugging Face Qwen/Qwen2.5-7B).
const char* kBenchConfig = R"({"model_type": "qwen2", "vocab_size": 32768, "hidden_size": 256,
  "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
  "num_key_value_heads": 2, "tie_word_embeddings": true, "max_position_embeddings": 2048})";
const char* k7BConfig = R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
  "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 131072, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "use_sliding_window": false})";

class CliPlan : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("cli_plan_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "bench");
    fs::create_directories(dir_ / "qwen2.5-7b");
    std::ofstream(dir_ / "bench" / "config.json") << kBenchConfig;
    std::ofstream(dir_ / "qwen2.5-7b" / "config.json") << k7BConfig;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // `grpo plan <args>` with stderr folded into the output.
  std::string Plan(const std::string& args, int* rc, const std::string& env = "WORLD_SIZE=1") {
    return RunCommand(env + " " + GrpoBin() + " plan " + args + " 2>&1", rc);
  }
  std::string Model(const char* name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

TEST_F(CliPlan, FitsExitsZeroWithTheBreakdown) {
  int rc = -1;
  const std::string out =
      Plan("--model_name_or_path " + Model("bench") + " --device cpu --device_memory_gb 64", &rc);
  EXPECT_EQ(rc, 0) << out;
  for (const char* row : {"parameters (fp32)", "gradients (fp32)", "AdamW state", "gathered layer",
                          "activations, gradient_checkpointing off",
                          "activations, gradient_checkpointing on", "logits chunk [1024 x 32768]",
                          "weight-sync bucket", "reference model", "total:", "fits: "}) {
    EXPECT_NE(out.find(row), std::string::npos) << row << "\n" << out;
  }
}

TEST_F(CliPlan, SevenBillionOnOne80GiBGpuDoesNotFitAndNamesTheKnob) {
  int rc = -1;
  const std::string out = Plan("--model_name_or_path " + Model("qwen2.5-7b") +
                                   " --device cuda --bf16 true --device_memory_gb 80",
                               &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("does not fit: set fsdp: no_shard offload ("), std::string::npos) << out;
}

TEST_F(CliPlan, JsonCarriesEveryFigureAndTheSuggestion) {
  int rc = -1;
  std::string out = Plan("--model_name_or_path " + Model("qwen2.5-7b") +
                             " --device cuda --bf16 true --device_memory_gb 80 --json",
                         &rc);
  EXPECT_EQ(rc, 1) << out;
  json j = json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  for (const char* key :
       {"parameters", "gradients", "master_weights", "master_gradients", "adamw_state",
        "gathered_lm_head", "gathered_layer", "publish_unit", "reference_model", "weight_snapshot",
        "weight_sync_bucket", "runtime", "activations_no_checkpointing",
        "activations_checkpointing", "logits_chunk", "lm_head_pass", "layer_backward",
        "micro_batch_peak", "optimizer_step"}) {
    EXPECT_TRUE(j["components"].contains(key)) << key;
  }
  EXPECT_EQ(j["num_parameters"], 7'615'616'512);
  EXPECT_EQ(j["fits"], false);
  EXPECT_EQ(j["device_memory_bytes"], 80ll << 30);
  EXPECT_GT(j["total_bytes"].get<int64_t>(), 80ll << 30);
  ASSERT_TRUE(j["suggestion"].is_object());
  ASSERT_FALSE(j["suggestion"]["changes"].empty());
  EXPECT_LE(j["suggestion"]["total_bytes"].get<int64_t>(), 80ll << 30);
  // no_shard offload, the master on the host (memory_plan_test derives the figure; no host size
  // given, so the host is not checked).
  ASSERT_EQ(j["suggestion"]["changes"].size(), 1u) << j["suggestion"].dump();
  EXPECT_EQ(j["suggestion"]["changes"][0]["key"], "fsdp");
  EXPECT_EQ(j["suggestion"]["changes"][0]["value"], "no_shard offload");

  out = Plan("--model_name_or_path " + Model("bench") + " --device cpu --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  j = json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["fits"], true);
  EXPECT_TRUE(j["suggestion"].is_null());
  EXPECT_GT(j["device_memory_bytes"].get<int64_t>(), 0);  // this machine's memory
}

TEST_F(CliPlan, ConfigFileWorldSizeAndOverrides) {
  std::ofstream(dir_ / "run.yaml") << "model_name_or_path: " << Model("qwen2.5-7b")
                                   << "\nbf16: true\nfsdp: full_shard\ndevice: cuda\n";
  int rc = -1;
  const std::string cfg = "--config " + (dir_ / "run.yaml").string();
  std::string out = Plan(cfg + " --device_memory_gb 80 --json", &rc, "WORLD_SIZE=8");
  json j = json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["world_size"], 8);
  EXPECT_EQ(j["fsdp"], "full_shard");
  EXPECT_EQ(j["bf16"], true);
  // --world_size wins over WORLD_SIZE; --key value over the file.
  out = Plan(cfg + " --device_memory_gb 80 --json --world_size 2 --gradient_checkpointing true",
             &rc, "WORLD_SIZE=8");
  j = json::parse(out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << out;
  EXPECT_EQ(j["world_size"], 2);
  EXPECT_EQ(j["gradient_checkpointing"], true);
}

TEST_F(CliPlan, BadInputExitsTwoNamingIt) {
  int rc = -1;
  const std::string missing = (dir_ / "no-such-model").string();
  std::string out = Plan("--model_name_or_path " + missing + " --device cpu", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find(missing + "/config.json"), std::string::npos) << out;
  out = Plan("--model_name_or_path " + Model("bench") + " --device cpu --fsdp zero3", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("fsdp"), std::string::npos) << out;
  out = Plan("--model_name_or_path " + Model("bench") + " --device cpu", &rc, "WORLD_SIZE=x");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("WORLD_SIZE"), std::string::npos) << out;
  // cuda without a GPU here: the GPU's memory must be given.
  out = Plan("--model_name_or_path " + Model("bench") + " --device cuda", &rc);
  if (out.find("cuda memory of a rank") == std::string::npos) {  // no GPU visible
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find("--device_memory_gb"), std::string::npos) << out;
  }
}

TEST_F(CliPlan, LearnerRefusesWhatCannotFitBeforeLoadingWeights) {
  // 32k-token completions of a 7B model in fp32: terabytes of activations on any machine. The
  // directory has no weights, so a learner that went on to load them would fail with exit 1.
  int rc = -1;
  const std::string out = RunCommand(
      "WORLD_SIZE=1 " + GrpoBin() + " learner --model_name_or_path " + Model("qwen2.5-7b") +
          " --device cpu --max_completion_length 32768 --reward_funcs length --output_dir " +
          (dir_ / "out").string() + " --grpc_port 0 --metrics_port 0 2>&1",
      &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("memory plan"), std::string::npos) << out;
  EXPECT_NE(out.find("gradient_checkpointing"), std::string::npos) << out;  // the knob
}

// CPU ranks on one host share its memory (torchrun's LOCAL_WORLD_SIZE): each rank's plan must fit
// its share. The bench model's plan (T) fits this host (M) alone; with M / T + 1 ranks on the
// host each has less than T, and the learner refuses at once (exit 2, naming the sharing), before
// it joins the group. With one rank on the host the same plan passes, and the learner goes on to
// join its group (which fails here: nobody else comes, exit 1). `grpo plan` plans the same
// share: --local_world_size (or LOCAL_WORLD_SIZE) divides the host's memory, and the plan no
// longer fits.
TEST_F(CliPlan, CpuRanksOnOneHostShareItsMemory) {
  int rc = -1;
  const std::string plan =
      Plan("--model_name_or_path " + Model("bench") + " --device cpu --json", &rc);
  ASSERT_EQ(rc, 0) << plan;
  const json j = json::parse(plan.substr(plan.find('{')), nullptr, false);
  ASSERT_TRUE(j.is_object()) << plan;
  const int64_t total = j["total_bytes"].get<int64_t>();
  const int64_t host = j["device_memory_bytes"].get<int64_t>();
  ASSERT_LE(total, host);
  const int64_t ranks = host / total + 1;
  ASSERT_LT(host / ranks, total);
  auto learner = [&](int64_t local) {
    int code = -1;
    const std::string out = RunCommand(
        "RANK=0 WORLD_SIZE=" + std::to_string(ranks) +
            " LOCAL_WORLD_SIZE=" + std::to_string(local) + " MASTER_ADDR=127.0.0.1 MASTER_PORT=1 " +
            GrpoBin() + " learner --model_name_or_path " + Model("bench") +
            " --device cpu --reward_funcs length --rank_timeout_seconds 1 --output_dir " +
            (dir_ / "out").string() + " --grpc_port 0 --metrics_port 0 2>&1",
        &code);
    return std::make_pair(code, out);
  };
  const auto [shared_rc, shared] = learner(ranks);
  EXPECT_EQ(shared_rc, 2) << shared;
  EXPECT_NE(shared.find("memory plan"), std::string::npos) << shared;
  EXPECT_NE(shared.find("shared by its " + std::to_string(ranks) + " learner ranks"),
            std::string::npos)
      << shared;
  const auto [alone_rc, alone] = learner(1);
  EXPECT_EQ(alone_rc, 1) << alone;
  EXPECT_EQ(alone.find("memory plan"), std::string::npos) << alone;
  const std::string n = std::to_string(ranks);
  for (const auto& [args, env] :
       {std::pair{" --world_size " + n + " --local_world_size " + n, std::string("WORLD_SIZE=1")},
        std::pair{std::string(), "WORLD_SIZE=" + n + " LOCAL_WORLD_SIZE=" + n}}) {
    const std::string out =
        Plan("--model_name_or_path " + Model("bench") + " --device cpu --json" + args, &rc, env);
    EXPECT_EQ(rc, 1) << out;
    const json share = json::parse(out.substr(out.find('{')), nullptr, false);
    ASSERT_TRUE(share.is_object()) << out;
    EXPECT_EQ(share["device_memory_bytes"].get<int64_t>(), host / ranks) << out;
    EXPECT_EQ(share["local_world_size"].get<int64_t>(), ranks) << out;
  }
}

// A suggestion of more ranks on the CPU says what they need together: each rank's memory is its
// host's (the 7B in 16 GiB ranks: the suggestion runs 18 ranks, 287.8 GiB in all).
TEST_F(CliPlan, MoreCpuRanksSayWhatTheirHostsNeedInAll) {
  int rc = -1;
  const std::string text = Plan(
      "--model_name_or_path " + Model("qwen2.5-7b") + " --device cpu --device_memory_gb 16", &rc);
  EXPECT_EQ(rc, 1) << text;
  const std::string out = Plan(
      "--model_name_or_path " + Model("qwen2.5-7b") + " --device cpu --device_memory_gb 16 --json",
      &rc);
  const json j = json::parse(out.substr(out.find('{')), nullptr, false);
  ASSERT_TRUE(j.is_object()) << out;
  int64_t ranks = 0;
  for (const auto& c : j["suggestion"]["changes"]) {
    if (c["key"] == "world_size") ranks = std::stoll(c["value"].get<std::string>());
  }
  ASSERT_GT(ranks, 1) << out;
  const int64_t total = j["suggestion"]["total_bytes"].get<int64_t>();
  char need[64];
  std::snprintf(need, sizeof(need), "%.1f GiB", static_cast<double>(total * ranks) / (1ll << 30));
  std::string flat = text;  // the text is wrapped at 100 columns
  for (size_t at = flat.find("\n  "); at != std::string::npos; at = flat.find("\n  ")) {
    flat.replace(at, 3, " ");
  }
  EXPECT_NE(flat.find("CPU ranks share their host's memory: the " + std::to_string(ranks) +
                      " ranks need " + need + " across their hosts"),
            std::string::npos)
      << text;
}

}  // namespace
