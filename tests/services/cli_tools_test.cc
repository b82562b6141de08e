// The `grpo` model tools as users run them: a real process, JSON Lines in and out.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/reserved_port.h"
#include "tests/services/http_test_util.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace {

using grpo::testing::GrpoBin;
using grpo::testing::GrpoTorchBin;
using grpo::testing::RunCommand;
namespace fs = std::filesystem;
using nlohmann::json;

std::vector<json> Lines(const std::string& text) {
  std::vector<json> out;
  std::istringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) out.push_back(json::parse(line));
  return out;
}

class CliTools : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (fs::path(::testing::TempDir()) / "grpo_cli_tools").string();
    fs::remove_all(dir_);
    int rc;
    RunCommand(GrpoBin() + " init-model --preset tiny --seed 5 --out " + dir_, &rc);
    ASSERT_EQ(rc, 0);
  }
  static std::string dir_;
};
std::string CliTools::dir_;

TEST_F(CliTools, InitModelWritesHuggingFaceLayout) {
  for (const char* f :
       {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir_) / f)) << f;
  }
  std::ifstream in(fs::path(dir_) / "config.json");
  json cfg = json::parse(in);
  EXPECT_EQ(cfg["model_type"], "qwen2");
  EXPECT_EQ(cfg["vocab_size"], 259);
}

TEST_F(CliTools, TokenizeGivesBytesAndSpecialsAndDecodesBack) {
  const std::string in = dir_ + "/tok_in.jsonl";
  std::ofstream(in) << R"({"text": "<|im_start|>hi\n"})"
                    << "\n"
                    << R"({"text": 5})"
                    << "\n";
  int rc;
  auto out = Lines(RunCommand(GrpoBin() + " tokenize --tokenizer " + dir_ + " < " + in, &rc));
  EXPECT_EQ(rc, 2);  // line 2 is bad
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0]["ids"], json({257, 'h', 'i', '\n'}));
  EXPECT_NE(out[1]["error"].get<std::string>().find("line 2"), std::string::npos);
  std::ofstream(in) << R"({"ids": [257, 104, 105, 10]})"
                    << "\n";
  out = Lines(RunCommand(GrpoBin() + " tokenize --decode --tokenizer " + dir_ + " < " + in, &rc));
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(out[0]["text"], "<|im_start|>hi\n");
}

TEST_F(CliTools, LogprobsMatchIndependentReferenceModel) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch"))
      << grpo::testing::ReferencePython() << " cannot import torch (deploy/setup.sh)";
  const std::vector<std::vector<int>> seqs = {{257, 72, 101, 108, 108, 111, 258}, {10, 20, 30}};
  const std::string in = dir_ + "/lp_in.jsonl";
  {
    std::ofstream f(in);
    for (const auto& s : seqs) f << json{{"ids", s}}.dump() << "\n";
    f << R"({"ids": [1, 99999]})"
      << "\n";
  }
  int rc;
  auto out = Lines(RunCommand(GrpoBin() + " logprobs --model " + dir_ + " < " + in, &rc));
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out[2]["error"].get<std::string>().find("99999"), std::string::npos);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const auto& s = seqs[b];
    // Reference logits of this sequence alone, log-softmax computed here.
    const std::string ref_in = dir_ + "/ref_in.json", ref_out = dir_ + "/ref_out.json";
    std::ofstream(ref_in)
        << json{{"input_ids", {s}}, {"attention_mask", {std::vector<int>(s.size(), 1)}}}.dump();
    const std::string cmd = "'" + grpo::testing::ReferencePython() + "' " +
                            grpo::testing::SourceDir() + "/tests/reference/hf_model_ref.py " +
                            dir_ + " " + ref_in + " " + ref_out;
    ASSERT_EQ(std::system(cmd.c_str()), 0);
    std::ifstream rf(ref_out);
    json ref = json::parse(rf);
    const int64_t V = ref["shape"][2];
    const auto& logits = ref["logits"];
    ASSERT_TRUE(out[b]["logprobs"][0].is_null());
    for (size_t t = 1; t < s.size(); ++t) {
      double mx = -1e30;
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, logits[(t - 1) * V + v].get<double>());
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[(t - 1) * V + v].get<double>() - mx);
      const double want = logits[(t - 1) * V + s[t]].get<double>() - mx - std::log(sum);
      EXPECT_NEAR(out[b]["logprobs"][t].get<double>(), want, 1e-4) << "seq " << b << " t " << t;
    }
  }
}

TEST_F(CliTools, GenerateGivesGroupsWithLogprobsAndRewardsPerRow) {
  const std::string in = dir_ + "/gen_in.jsonl";
  std::ofstream(in) << R"({"prompt": "hi", "answer": "3"})"
                    << "\n"
                    << R"({"messages": [{"role": "user", "content": "2+1?"}]})"
                    << "\n"
                    << R"({"nope": 1})"
                    << "\n";
  int rc;
  auto out = Lines(RunCommand(GrpoBin() + " generate --model " + dir_ +
                                  " --num_generations 3 --max_completion_length 6"
                                  " --reward_funcs length,accuracy"
                                  " --reward_options '{\"length\": {\"target_length\": 4}}' < " +
                                  in,
                              &rc));
  EXPECT_EQ(rc, 2);  // line 3 has no prompt
  ASSERT_EQ(out.size(), 3u);
  for (int row = 0; row < 2; ++row) {
    ASSERT_EQ(out[row]["completions"].size(), 3u) << out[row].dump();
    for (const auto& c : out[row]["completions"]) {
      const size_t len = c["ids"].size();
      EXPECT_GE(len, 1u);
      EXPECT_LE(len, 6u);
      EXPECT_EQ(c["logprobs"].size(), len);
      for (const auto& lp : c["logprobs"]) EXPECT_LE(lp.get<double>(), 0.0);
      // TRL's reward_len: -|target - length|.
      EXPECT_DOUBLE_EQ(c["rewards"]["length"].get<double>(), -std::abs(4.0 - double(len)));
    }
  }
  // Row 1 has an answer (a number the random policy does not write): 0; row 2 has none: null.
  EXPECT_EQ(out[0]["completions"][0]["rewards"]["accuracy"].get<double>(), 0.0);
  EXPECT_TRUE(out[1]["completions"][0]["rewards"]["accuracy"].is_null());
  EXPECT_NE(out[2]["error"].get<std::string>().find("line 3"), std::string::npos);
}

// The README's promise "a trained policy loads in Hugging Face tools as it is", checked by
// Hugging Face's own code: a checkpoint our learner wrote loads with AutoModelForCausalLM and
// AutoTokenizer unchanged, encodes text to our ids and gives our log-probs.
TEST_F(CliTools, LearnerCheckpointLoadsInTransformersWithSameIdsAndLogprobs) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch transformers"))
      << grpo::testing::ReferencePython() << " cannot import transformers (deploy/setup.sh)";
  const std::string out_dir = dir_ + "/trained";
  int rc;
  const std::string train =
      RunCommand(GrpoBin() + " train-local --json --max_steps 2 --seed 3" +
                     " --model_name_or_path " + dir_ + " --output_dir " + out_dir + " 2>/dev/null",
                 &rc);
  ASSERT_EQ(rc, 0) << train;
  const std::vector<json> lines = Lines(train);
  ASSERT_FALSE(lines.empty());
  const std::string ckpt = lines.back()["checkpoint"].get<std::string>();
  ASSERT_TRUE(fs::exists(fs::path(ckpt) / "model.safetensors")) << ckpt;

  const std::vector<std::string> texts = {"<|im_start|>user\nhi there<|im_end|>",
                                          "2+2=4, caf\u00e9"};
  const std::string tok_in = dir_ + "/ckpt_tok_in.jsonl";
  {
    std::ofstream f(tok_in);
    for (const auto& t : texts) f << json{{"text", t}}.dump() << "\n";
  }
  auto ours = Lines(RunCommand(GrpoBin() + " tokenize --tokenizer " + ckpt + " < " + tok_in, &rc));
  ASSERT_EQ(rc, 0);
  ASSERT_EQ(ours.size(), texts.size());

  const std::string lp_in = dir_ + "/ckpt_lp_in.jsonl";
  {
    std::ofstream f(lp_in);
    for (const auto& row : ours) f << json{{"ids", row["ids"]}}.dump() << "\n";
  }
  auto our_lp = Lines(RunCommand(GrpoBin() + " logprobs --model " + ckpt + " < " + lp_in, &rc));
  ASSERT_EQ(rc, 0);
  ASSERT_EQ(our_lp.size(), texts.size());

  for (size_t b = 0; b < texts.size(); ++b) {
    const std::vector<int> ids = ours[b]["ids"].get<std::vector<int>>();
    const std::string ref_in = dir_ + "/ckpt_ref_in.json", ref_out = dir_ + "/ckpt_ref_out.json";
    std::ofstream(ref_in) << json{
        {"input_ids", {ids}},
        {"attention_mask", {std::vector<int>(ids.size(), 1)}},
        {"texts", {texts[b]}}}.dump();
    const std::string cmd = "'" + grpo::testing::ReferencePython() + "' " +
                            grpo::testing::SourceDir() + "/tests/reference/hf_model_ref.py " +
                            ckpt + " " + ref_in + " " + ref_out + " 2>/dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream rf(ref_out);
    const json ref = json::parse(rf);
    EXPECT_EQ(ref["token_ids"][0].get<std::vector<int>>(), ids) << texts[b];
    ASSERT_EQ(our_lp[b]["logprobs"].size(), ids.size());
    for (size_t t = 1; t < ids.size(); ++t) {
      EXPECT_NEAR(our_lp[b]["logprobs"][t].get<double>(), ref["logprobs"][0][t].get<double>(), 1e-4)
          << "text " << b << " t " << t;
    }
  }
}

// The last step's peak_memory_bytes of `grpo train-local --bf16 true` (30 steps of the built-in
// task, tiny model) with `env` in front.
int64_t Bf16TrainLocalPeak(const std::string& env, const std::string& out_dir) {
  int rc;
  const std::string out =
      RunCommand(env + " " + GrpoBin() + " train-local --json --bf16 true --max_steps 30 --seed 3" +
                     " --output_dir " + out_dir + " 2>/dev/null",
                 &rc);
  EXPECT_EQ(rc, 0) << out;
  int64_t peak = -1;
  for (const json& j : Lines(out)) {
    if (j.contains("peak_memory_bytes")) peak = j["peak_memory_bytes"].get<int64_t>();
  }
  return peak;
}

// The kernels libtorch's oneDNN compiles for every bf16 matmul shape on the CPU are kept in
// ideep's cache, 1024 of them by default (LRU_CACHE_CAPACITY, as ideep documents it); grpo bounds
// it at 128 unless the user sets it (services/cli/launch.cc BoundKernelCaches). Against the same
// run with the library's default set by hand: 264.6 MiB at the last step against 344.0 (measured
// 2026-12-08, 264.2-264.7 and 344.0-344.3 in three runs each); an override the user sets is kept
// (else both runs would be bounded alike).
TEST_F(CliTools, Bf16OnTheCpuKeepsFewerCompiledKernelsThanTheLibrarysDefault) {
  const int64_t bounded = Bf16TrainLocalPeak("", dir_ + "/kernels-bounded");
  const int64_t library = Bf16TrainLocalPeak("LRU_CACHE_CAPACITY=1024", dir_ + "/kernels-1024");
  ASSERT_GT(bounded, 0);
  ASSERT_GT(library, 0);
  std::printf("bf16 train-local, 30 steps: peak %.1f MiB bounded, %.1f MiB with 1024 kernels\n",
              bounded / 1048576.0, library / 1048576.0);
  EXPECT_LT(bounded + (48ll << 20), library);
}

// beta != 0 needs a reference model; train-local builds it from the starting weights as the
// learner service does (it used to fail with "a reference model is required"). At step 1 the
// policy is the reference, so every token's KL term exp(ref - logp) - (ref - logp) - 1 is 0 up
// to float rounding (about d^2 / 2 for a rounding difference d ~ 1e-6); after one update at the
// demo's learning rate it is orders of magnitude larger.
TEST_F(CliTools, TrainLocalWithBetaBuildsTheReferenceModel) {
  int rc;
  const std::string out =
      RunCommand(GrpoBin() + " train-local --json --max_steps 2 --beta 0.04" +
                     " --model_name_or_path " + dir_ + " --output_dir " + dir_ + "/beta-run 2>&1",
                 &rc);
  ASSERT_EQ(rc, 0) << out;
  std::vector<json> steps;
  std::istringstream ss(out);
  for (std::string line; std::getline(ss, line);) {
    if (line.empty() || line[0] != '{') continue;
    json j = json::parse(line);
    if (!j.contains("summary")) steps.push_back(j);
  }
  ASSERT_EQ(steps.size(), 2u) << out;
  ASSERT_TRUE(steps[0].contains("kl")) << steps[0].dump();
  EXPECT_LT(steps[0]["kl"].get<double>(), 1e-9);
  EXPECT_GT(steps[1]["kl"].get<double>(), 1e-7);
}

// The service benchmarks against a real in-process learner: they broke silently once when the
// protocol changed (issue 12: workers register before leasing, uploads end with `last`).
TEST_F(CliTools, ServiceBenchmarksRunAgainstARealLearner) {
  int rc = 0;
  // stdout holds the JSON rows; the learner's logs go to stderr.
  const auto e2e = Lines(RunCommand(GrpoBin() + " bench e2e --steps 4 --json 2>/dev/null", &rc));
  ASSERT_EQ(rc, 0);
  ASSERT_EQ(e2e.size(), 3u);
  // sync and async train the 4 steps asked for; num_iterations 4 makes 4 steps per batch.
  EXPECT_EQ(e2e[0]["mode"], "sync");
  EXPECT_EQ(e2e[0]["steps"], 4);
  EXPECT_EQ(e2e[1]["steps"], 4);
  EXPECT_EQ(e2e[2]["steps"], 16);
  EXPECT_EQ(e2e[0]["stale_groups_refused"], 0);  // max_staleness 0 leases nothing stale
  for (const auto& row : e2e) EXPECT_GT(row["steps_per_second"].get<double>(), 0) << row;

  const auto ingest =
      Lines(RunCommand(GrpoBin() + " bench ingest --groups 8 --reps 1 --json 2>/dev/null", &rc));
  ASSERT_EQ(rc, 0);
  bool pushed = false;
  for (const auto& row : ingest) {
    if (row.value("impl", "") != "grpc_push") continue;
    pushed = true;
    EXPECT_GT(row["groups_per_second"].get<double>(), 0) << row;
  }
  EXPECT_TRUE(pushed) << "no grpc_push row";
}

// The memory benchmarks read a step's peak resident set above the one before it (VmHWM after
// clear_refs). `grpo` runs on tcmalloc, which keeps what a step frees and hands it to the next
// step, so that the peak read ~0 (peer_trl's "peak learner MiB at G = 16 / 64": 0.33 and -0.06
// on 2026-12-06) until the benchmark gave the free memory back first. The learner's chunked
// log-probs of a micro-batch of 4 x 128 completion tokens (one chunk: under 1024 tokens) hold
// their [512, 32768] fp32 logits at once: 64 MiB at the least, whatever G.
TEST_F(CliTools, MemoryBenchmarksReadAStepsPeakOnTcmalloc) {
  int rc = 0;
  const auto rows =
      Lines(RunCommand(GrpoBin() + " bench logprob_memory --child --impl chunked --G 16 "
                                   "--micro_batch 4 --reps 1 2>/dev/null",
                       &rc));
  ASSERT_EQ(rc, 0);
  ASSERT_EQ(rows.size(), 1u);
  const double logits_mib = 4.0 * 128 * 32768 * 4 / (1 << 20);
  EXPECT_GE(rows[0]["peak_mib"].get<double>(), logits_mib) << rows[0].dump();
}

// A benchmark reports the median of its timed repetitions: with none it read past an empty
// vector and crashed (every benchmark, stop 64); `--micro_batch 0` and a sharding child's
// `--world_size 0` died of SIGFPE, `--G 0` ran a row of nothing (stop 65). Counts below 1, and
// `grpo plan`'s world sizes, are bad input that names the option, before anything runs: exit 2,
// as the commands document bad input (CLI11's own code for a value out of range is 105).
TEST_F(CliTools, CountsBelowOneAreBadInputNamingTheOption) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bench learner_step --json --reps 0", "--reps"},
      {"bench learner_step --json --reps -1", "--reps"},
      {"bench learner_step --json --reps 1.5", "--reps"},
      {"bench learner_step --json --micro_batch 0", "--micro_batch"},
      {"bench learner_step --json --layers -1", "--layers"},
      {"bench logprob_memory --json --G 4 0", "--G"},
      {"bench sharding --child --world_size 0 --reps 1", "--world_size"},
      {"bench ingest --json --groups 0", "--groups"},
      {"bench e2e --json --workers 0", "--workers"},
      {"bench e2e --json --steps 0", "--steps"},
      {"bench episodes --json --max_turns 0", "--max_turns"},
      {"plan --world_size 0", "--world_size"},
      {"plan --local_world_size 0", "--local_world_size"}};
  for (const auto& [args, option] : cases) {
    int rc = 0;
    const std::string out = RunCommand(GrpoBin() + " " + args + " 2>&1", &rc);
    EXPECT_EQ(rc, 2) << args << ": " << out;
    EXPECT_NE(out.find(option + ": must be a whole number from 1"), std::string::npos)
        << args << ": " << out;
    EXPECT_EQ(out.find("tokens_per_second"), std::string::npos) << args << ": ran: " << out;
  }
}

TEST_F(CliTools, ConfigNamesAnUnknownKey) {
  int rc;
  RunCommand(GrpoBin() + " config --num_generaton 4 2>/dev/null", &rc);
  EXPECT_EQ(rc, 2);
  auto out = json::parse(
      RunCommand(GrpoBin() + " config --num_generations 4 --per_device_train_batch_size 4", &rc));
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(out["num_generations"], 4);
}

// `grpo rollout` takes the learner's address or a file that will hold it (grpo demo's workers
// start beside the learner): neither or both is bad input; a file that never appears is an error
// after --learner_wait_seconds; SIGTERM while waiting ends the worker at once, exit 0.
// Starts `env grpo --log_level info rollout` waiting for an address file that never comes; once
// its log says it waits (its stop handler then installed) runs the shell command `probe` ($p is
// the worker's pid), SIGTERMs it and waits for it. Returns the shell's output; *rc is the
// worker's exit code (EXPECTed 0 by the caller as it needs).
std::string WithAWaitingWorker(const std::string& dir, const std::string& env,
                               const std::string& probe, int* rc) {
  // A log of its own each call: the shell below truncates it only once the worker's subshell
  // runs, so a reused one could show the previous worker's line first (and this worker would
  // get its SIGTERM before its handler is installed).
  static int calls = 0;
  const std::string log = dir + "/rollout_wait_" + std::to_string(++calls) + ".log";
  fs::remove(log);
  const std::string out = RunCommand(
      "sh -c '" + env + " " + GrpoBin() + " --log_level info rollout --learner_address_file " +
          dir + "/nowhere --learner_wait_seconds 60 2>" + log +
          " & p=$!; i=0; until grep -qs \"waiting for the learner\" " + log +
          " || [ $i -ge 600 ]; do sleep 0.1; i=$((i+1)); done; " + probe +
          "; kill -TERM $p; wait $p' 2>&1",
      rc);
  return out + grpo::testing::ReadFile(log);
}

TEST_F(CliTools, RolloutWaitsForItsLearnerAddressFile) {
  int rc;
  std::string out = RunCommand(GrpoBin() + " rollout 2>&1", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--learner_address_file"), std::string::npos) << out;
  out = RunCommand(GrpoBin() + " rollout --learner_address 127.0.0.1:1 --learner_address_file " +
                       dir_ + "/nowhere 2>&1",
                   &rc);
  EXPECT_EQ(rc, 2) << out;
  out = RunCommand(GrpoBin() + " rollout --learner_address_file " + dir_ +
                       "/nowhere --learner_wait_seconds 0.3 2>&1",
                   &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("no learner address in --learner_address_file"), std::string::npos) << out;
  // Stopped while it waits (SIGTERM once its log says it waits, its handler then installed):
  // it exits 0 at once.
  out = WithAWaitingWorker(dir_, "", "true", &rc);
  EXPECT_EQ(rc, 0) << out;
}

// Whether a waiting `grpo rollout` started with `env` has libtorch's CUDA part mapped, as the
// kernel lists the process's files (/proc/PID/maps): "mapped" or "unmapped".
std::string CudaMappedInAWaitingWorker(const std::string& dir, const std::string& env) {
  int rc;
  const std::string out = WithAWaitingWorker(
      dir, env,
      "if grep -q libtorch_cuda.so /proc/$p/maps; then echo mapped; else echo unmapped; fi", &rc);
  EXPECT_EQ(rc, 0) << out;
  return out.substr(0, out.find('\n'));
}

// The binary links libtorch without its CUDA part, and loads it (the CUDA module) only on a
// machine with an NVIDIA device or when GRPO_CUDA=1 asks (common/cuda/cuda_module.h).
TEST_F(CliTools, TheCudaModuleLoadsOnlyWhereItIsUseful) {
  int rc;
  const std::string ldd = RunCommand("ldd " + GrpoTorchBin(), &rc);
  ASSERT_EQ(rc, 0) << ldd;
  EXPECT_NE(ldd.find("libtorch_cpu.so"), std::string::npos) << ldd;
  for (const char* lib :
       {"libtorch_cuda.so", "libc10_cuda.so", "libcublas", "libcudnn", "libnccl"}) {
    EXPECT_EQ(ldd.find(lib), std::string::npos) << lib << " is linked:\n" << ldd;
  }
  std::string out = RunCommand("GRPO_CUDA=bogus " + GrpoBin() + " --version 2>&1", &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("GRPO_CUDA='bogus': expected auto, 1, on, 0 or off"), std::string::npos)
      << out;
  out = RunCommand(
      "GRPO_CUDA=1 GRPO_CUDA_MODULE=" + dir_ + "/no_module.so " + GrpoBin() + " --version 2>&1",
      &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("CUDA module " + dir_ + "/no_module.so"), std::string::npos) << out;

  const bool nvidia = fs::exists("/dev/nvidiactl") || fs::exists("/proc/driver/nvidia/gpus");
  out = RunCommand("env -u GRPO_CUDA " + GrpoBin() + " --version 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  if (!nvidia) {
    EXPECT_NE(out.find("CUDA module: not loaded (no NVIDIA device here"), std::string::npos) << out;
    EXPECT_EQ(CudaMappedInAWaitingWorker(dir_, "env -u GRPO_CUDA"), "unmapped");
  }
  EXPECT_EQ(CudaMappedInAWaitingWorker(dir_, "GRPO_CUDA=0"), "unmapped");
  const fs::path module = fs::path(GrpoBin()).parent_path() / "libgrpo_cuda.so";
  if (!fs::exists(module)) GTEST_SKIP() << "no CUDA module built (" << module << ")";
  out = RunCommand("GRPO_CUDA=1 " + GrpoBin() + " --version 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("CUDA module: loaded from " + module.lexically_normal().string()),
            std::string::npos)
      << out;
  EXPECT_EQ(CudaMappedInAWaitingWorker(dir_, "GRPO_CUDA=1"), "mapped");
}

// grpo-torch makes MappedCpuAllocator libtorch's CPU allocator at start, and
// GRPO_CPU_ALLOCATOR=malloc keeps libtorch's own (common/mapped_allocator.h).
TEST_F(CliTools, LibtorchsCpuAllocatorIsTheMappedOneUnlessTheEnvironmentSaysMalloc) {
  int rc;
  std::string out = RunCommand(GrpoBin() + " --version 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\ncpu allocator: mapped"), std::string::npos) << out;
  out = RunCommand("GRPO_CPU_ALLOCATOR=malloc " + GrpoBin() + " --version 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\ncpu allocator: malloc"), std::string::npos) << out;
}

// The binary's malloc is tcmalloc (CMakeLists.txt GRPO_MALLOC) for every library, libtorch's
// allocations included: the dynamic linker's own record of where each library's malloc and
// free bind (every symbol bound at start, LD_BIND_NOW), not the binary's word for it.
TEST_F(CliTools, EveryLibraryOfTheBinaryAllocatesWithTcmalloc) {
  if (!GRPO_TCMALLOC_LINKED) GTEST_SKIP() << "built with GRPO_MALLOC=system or a sanitizer";
  int rc;
  const std::string version = RunCommand(GrpoBin() + " --version 2>&1", &rc);
  EXPECT_EQ(rc, 0) << version;
  EXPECT_NE(version.find("\nmalloc: tcmalloc"), std::string::npos) << version;
  // grpo-torch itself: the launcher, which computes nothing, allocates with glibc's malloc.
  const std::string bindings =
      RunCommand("LD_BIND_NOW=1 LD_DEBUG=bindings " + GrpoTorchBin() + " --version 2>&1", &rc);
  ASSERT_EQ(rc, 0) << bindings.substr(0, 2000);
  // "binding file /path/libtorch_cpu.so [0] to /path/libtcmalloc_minimal.so.4 [0]: normal
  // symbol `posix_memalign'"
  std::map<std::string, int> to_tcmalloc;
  std::vector<std::string> elsewhere;
  std::istringstream lines(bindings);
  for (std::string line; std::getline(lines, line);) {
    bool allocating = false;
    for (const char* fn : {"malloc", "free", "calloc", "realloc", "posix_memalign"}) {
      if (line.find("normal symbol `" + std::string(fn) + "'") != std::string::npos) {
        allocating = true;
      }
    }
    if (!allocating) continue;
    const size_t file = line.find("binding file "), to = line.find(" to ");
    if (file == std::string::npos || to == std::string::npos) continue;
    const std::string from = line.substr(file + 13, line.find(' ', file + 13) - file - 13);
    if (line.find("libtcmalloc_minimal.so", to) != std::string::npos) {
      ++to_tcmalloc[fs::path(from).filename().string()];
    } else {
      elsewhere.push_back(line);
    }
  }
  EXPECT_TRUE(elsewhere.empty()) << elsewhere.size()
                                 << " bindings elsewhere, the first: " << elsewhere[0];
  for (const char* lib : {"libtorch_cpu.so", "libc10.so", "libgrpc.so", "libstdc++.so"}) {
    bool found = false;
    for (const auto& [name, n] : to_tcmalloc) found = found || name.rfind(lib, 0) == 0;
    EXPECT_TRUE(found) << lib << "'s malloc or free is not bound to tcmalloc";
  }
}

// A serving process's /metrics carries the process's series (common/metrics/process_metrics.h),
// and its malloc figures are tcmalloc's: a worker looking for its learner holds megabytes from
// malloc (libtorch, gRPC), and its resident set is above what it holds.
TEST_F(CliTools, AWorkersMetricsCarryTheProcessAndTcmallocSeries) {
  if (!GRPO_TCMALLOC_LINKED) GTEST_SKIP() << "built with GRPO_MALLOC=system or a sanitizer";
  grpo::testing::ReservedPort port;
  ASSERT_NE(port.port(), 0);
  // The worker retries its Register (no learner on port 1) with /metrics served.
  grpo::testing::Children children(dir_);
  ASSERT_GT(children.Spawn("worker", {GrpoBin(), "rollout", "--learner_address", "127.0.0.1:1",
                                      "--metrics_port", std::to_string(port.port())}),
            0);
  std::string out;
  ASSERT_TRUE(grpo::testing::WaitUntil(
      [&] {
        const auto r = grpo::testing::HttpGet(static_cast<uint16_t>(port.port()), "/metrics");
        if (r && r->status == 200) out = r->body;
        return !out.empty();
      },
      std::chrono::seconds(60)))
      << grpo::testing::Tail(children.Err("worker"));
  children.Kill("worker");
  auto value = [&](const std::string& name) {
    const size_t at = out.find("\n" + name + " ");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(at + name.size() + 2));
  };
  EXPECT_NE(out.find("# HELP grpo_malloc_allocated_bytes Bytes the process holds from malloc "
                     "(tcmalloc)"),
            std::string::npos)
      << out;
  const double allocated = value("grpo_malloc_allocated_bytes");
  const double resident = value("process_resident_memory_bytes");
  EXPECT_GT(allocated, 1 << 20) << out;
  EXPECT_GT(resident, allocated) << out;
  EXPECT_GE(value("grpo_malloc_free_bytes"), 0) << out;
  EXPECT_GT(value("process_cpu_seconds_total"), 0) << out;
  EXPECT_GT(value("process_open_fds"), 3) << out;
}

// The values of the last OPENMP DISPLAY ENVIRONMENT block in `text` (OMP_DISPLAY_ENV=VERBOSE).
std::map<std::string, std::string> LastLibgompDisplay(const std::string& text) {
  const size_t last = text.rfind("OPENMP DISPLAY ENVIRONMENT BEGIN");
  std::map<std::string, std::string> out;
  if (last == std::string::npos) return out;
  std::istringstream ss(text.substr(last));
  std::string line;
  while (std::getline(ss, line)) {
    const size_t eq = line.find(" = '");
    if (eq == std::string::npos) continue;
    const size_t name = line.find_first_not_of(' ');
    out[line.substr(name, eq - name)] = line.substr(eq + 4, line.rfind('\'') - eq - 4);
  }
  return out;
}

// The OpenMP settings `grpo` re-executes itself with (services/cli/main.cc), as libgomp itself
// reports them (OMP_DISPLAY_ENV=VERBOSE prints the values it runs with, once per process that
// initialises it). Unset: PASSIVE after a bounded spin of 300,000 for a command that computes
// alone, PASSIVE without spin for the serving processes; a value the user set is kept, and
// libgomp's own default for it applies. The re-execution comes before any library is
// initialised: libgomp (and libtorch beside it) start once, in the re-executed process, not
// twice (they did, 0.29 s a command here, when it came from main()).
std::map<std::string, std::string> LibgompSettings(const std::string& env,
                                                   const std::string& command = "generate --help") {
  int rc;
  const std::string err =
      RunCommand("env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT " + env + " OMP_DISPLAY_ENV=VERBOSE " +
                     GrpoBin() + " " + command + " 2>&1 >/dev/null",
                 &rc);
  EXPECT_EQ(rc, 0) << err;
  size_t starts = 0;
  for (size_t at = err.find("OPENMP DISPLAY ENVIRONMENT BEGIN"); at != std::string::npos;
       at = err.find("OPENMP DISPLAY ENVIRONMENT BEGIN", at + 1)) {
    ++starts;
  }
  EXPECT_EQ(starts, 1u) << env << " grpo " << command << ": libgomp initialised " << starts
                        << " times:\n"
                        << err;
  return LastLibgompDisplay(err);
}

TEST_F(CliTools, OpenMpThreadsSpinBrieflyWhenComputingAloneAndNeverWhenServing) {
  auto ours = LibgompSettings("");
  EXPECT_EQ(ours["OMP_WAIT_POLICY"], "PASSIVE");
  EXPECT_EQ(ours["GOMP_SPINCOUNT"], "300000");
  auto active = LibgompSettings("OMP_WAIT_POLICY=ACTIVE");
  EXPECT_EQ(active["OMP_WAIT_POLICY"], "ACTIVE");
  EXPECT_EQ(active["GOMP_SPINCOUNT"], "30000000000") << "libgomp's own spin for ACTIVE";
  auto passive = LibgompSettings("OMP_WAIT_POLICY=PASSIVE");
  EXPECT_EQ(passive["GOMP_SPINCOUNT"], "0") << "libgomp's own spin for PASSIVE";
  auto spin = LibgompSettings("GOMP_SPINCOUNT=5");
  EXPECT_EQ(spin["GOMP_SPINCOUNT"], "5");
  for (const char* serving : {"learner --help", "--log_level info rollout --help",
                              "reward-server --help", "env-server --help"}) {
    auto sleeps = LibgompSettings("", serving);
    EXPECT_EQ(sleeps["OMP_WAIT_POLICY"], "PASSIVE") << serving;
    EXPECT_EQ(sleeps["GOMP_SPINCOUNT"], "0") << serving << ": serving processes share the cores";
  }
  EXPECT_EQ(LibgompSettings("", "train-local --help")["GOMP_SPINCOUNT"], "300000");
  // Under a computing grpo (`grpo bench peer_trl` runs `grpo demo`), a serving command takes its
  // own spin count: those values were grpo's (GRPO_OMP_DEFAULTS), not the user's, which stay.
  const std::string inherited = "OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=300000";
  EXPECT_EQ(LibgompSettings("GRPO_OMP_DEFAULTS=1 " + inherited, "learner --help")["GOMP_SPINCOUNT"],
            "0");
  EXPECT_EQ(LibgompSettings(inherited, "learner --help")["GOMP_SPINCOUNT"], "300000");
  EXPECT_EQ(
      LibgompSettings("GRPO_OMP_DEFAULTS=1 " + inherited, "train-local --help")["GOMP_SPINCOUNT"],
      "300000");
}

// `grpo demo`'s children (the learner and a worker, serving processes) run with the serving
// settings, as libgomp in each reports in its log; the launcher sets them for them.
TEST_F(CliTools, TheDemosChildrenSleepAtOnce) {
  const fs::path dir = fs::temp_directory_path() / ("cli_tools_demo_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  int rc;
  const std::string out = RunCommand(
      "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT OMP_DISPLAY_ENV=VERBOSE " + GrpoBin() +
          " demo --json --workers 1 --max_steps 1 --output_dir " + dir.string() + " 2>&1",
      &rc);
  ASSERT_EQ(rc, 0) << out;
  // The demo itself computes nothing: the launcher runs it, without libtorch or libgomp.
  EXPECT_EQ(out.find("OPENMP DISPLAY ENVIRONMENT BEGIN"), std::string::npos) << out;
  for (const char* log : {"learner.log", "rollout-0.log"}) {
    std::ifstream in(dir / log);
    std::stringstream text;
    text << in.rdbuf();
    auto settings = LastLibgompDisplay(text.str());
    EXPECT_EQ(settings["OMP_WAIT_POLICY"], "PASSIVE") << log << ":\n" << text.str();
    EXPECT_EQ(settings["GOMP_SPINCOUNT"], "0") << log;
  }
  fs::remove_all(dir);
}

// The launcher (services/cli/main.cc) runs demo, config and the clients without loading
// libtorch, and executes grpo-torch for the rest, as the dynamic loader reports (LD_DEBUG=files
// names every library it loads, in the process and after an exec). Alone in a folder, it runs
// its own commands and names where it looked for grpo-torch for the others.
TEST_F(CliTools, TheLaunchersOwnCommandsDoNotLoadLibtorch) {
  int rc;
  for (const char* command : {"config", "status --help", "watch --help", "demo --help"}) {
    const std::string out =
        RunCommand("LD_DEBUG=files " + GrpoBin() + " " + command + " 2>&1 >/dev/null", &rc);
    EXPECT_EQ(rc, 0) << command << ":\n" << out.substr(0, 3000);
    EXPECT_NE(out.find("file=libgrpc++.so"), std::string::npos) << command << ": " << out;
    EXPECT_EQ(out.find("libtorch_cpu.so"), std::string::npos) << command << " loaded libtorch";
    EXPECT_EQ(out.find("libgomp"), std::string::npos) << command << " loaded libgomp";
  }
  for (const char* command : {"generate --help", "--version", "learner --help"}) {
    const std::string out =
        RunCommand("LD_DEBUG=files " + GrpoBin() + " " + command + " 2>&1 >/dev/null", &rc);
    EXPECT_EQ(rc, 0) << command << ":\n" << out.substr(0, 3000);
    EXPECT_NE(out.find("file=libtorch_cpu.so"), std::string::npos) << command << ": " << out;
  }

  const fs::path alone = fs::path(dir_) / "launcher_alone";
  fs::create_directories(alone);
  fs::copy_file(GrpoBin(), alone / "grpo", fs::copy_options::overwrite_existing);
  std::string out = RunCommand((alone / "grpo").string() + " config 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(json::parse(out)["num_generations"], 8) << out;
  out = RunCommand((alone / "grpo").string() + " generate --help 2>&1", &rc);
  EXPECT_EQ(rc, 127) << out;
  EXPECT_NE(out.find("grpo-torch (the commands that load libtorch) is in none of " +
                     (alone / "grpo-torch").string() + ", " +
                     (alone.parent_path() / "lib" / "grpo" / "grpo-torch").string()),
            std::string::npos)
      << out;
}

// A grpo-torch command ends without the libraries' static destructors (libtorch's deregister
// every operator, about 75 ms of each process here: services/cli/torch_main.cc), as the dynamic
// loader reports (LD_DEBUG=files prints "calling fini" for each library it finalises), with its
// output written and its exit code kept. The launcher's own commands end normally.
TEST_F(CliTools, ACommandEndsWithoutTheLibrariesTeardown) {
  const std::string in = dir_ + "/fini_in.jsonl", out = dir_ + "/fini_out.jsonl";
  std::ofstream(in) << "{\"text\": \"hi\"}\n{\"text\": 5}\n";
  int rc;
  const std::string err = RunCommand("LD_DEBUG=files " + GrpoBin() + " tokenize --tokenizer " +
                                         dir_ + " < " + in + " 2>&1 > " + out,
                                     &rc);
  EXPECT_EQ(rc, 2) << "line 2 is bad";
  EXPECT_NE(err.find("file=libtorch_cpu.so"), std::string::npos) << err.substr(0, 2000);
  EXPECT_EQ(err.find("calling fini"), std::string::npos) << err.substr(err.find("calling fini"));
  auto lines = Lines(grpo::testing::ReadFile(out));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["ids"], json({'h', 'i'}));
  EXPECT_NE(lines[1]["error"].get<std::string>().find("line 2"), std::string::npos);
  // --help ends the same way.
  EXPECT_EQ(RunCommand("LD_DEBUG=files " + GrpoBin() + " generate --help 2>&1 >/dev/null", &rc)
                .find("calling fini"),
            std::string::npos);
  EXPECT_EQ(rc, 0);
  const std::string config = RunCommand("LD_DEBUG=files " + GrpoBin() + " config 2>&1", &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_NE(config.find("calling fini"), std::string::npos) << "the launcher ends normally";
}

}  // namespace
