// Multi-turn episodes through real processes: an environment server written in Python with the
// package (tests/reference/echo_length_env.py: after each model turn a `tool` message with the
// turn's UTF-8 byte count, done after the second turn, 1.0 a step), a `grpo learner` whose config
// names it (env: grpc:...), and a `grpo rollout` worker that steps it. The learner's batch dumps
// are read back and every trained row is checked against what the environment must have said,
// rebuilt here by hand from the row's own model tokens (byte tokenizer: ids 0-255 are bytes, 257
// <|im_start|>, 258 <|im_end|>; ChatML): the observation's ids in the middle with env_mask 0, the
// reward the number of steps the episode was given.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/utf8.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
using grpo::testing::Children;
using grpo::testing::DumpPath;
using grpo::testing::GrpoBin;
using grpo::testing::LearnerCommand;
using grpo::testing::ReadSafetensors;
using grpo::testing::ReferencePython;
using grpo::testing::SourceDir;
using grpo::testing::Tail;
using nlohmann::json;
using std::chrono::seconds;

constexpr auto kStartTimeout = seconds(60);
constexpr auto kJobTimeout = seconds(180);
constexpr int64_t kImStart = 257, kImEnd = 258;

std::vector<int64_t> Bytes(const std::string& s) {
  std::vector<int64_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

// What follows a model turn for one tool message (ChatML, README "Multi-turn environments").
std::vector<int64_t> ToolTurnIds(const std::string& content, bool closed) {
  std::vector<int64_t> ids;
  if (!closed) ids.push_back(kImEnd);
  ids.push_back('\n');
  ids.push_back(kImStart);
  for (int64_t b : Bytes("tool\n" + content)) ids.push_back(b);
  ids.push_back(kImEnd);
  ids.push_back('\n');
  ids.push_back(kImStart);
  for (int64_t b : Bytes("assistant\n")) ids.push_back(b);
  return ids;
}

// The text the environment was given for a model turn: its bytes, special tokens left out, as
// the worker decodes them (invalid UTF-8 is replaced there, so the caller skips such turns).
std::string TurnText(const std::vector<int64_t>& ids) {
  std::string text;
  for (int64_t id : ids) {
    if (id < 256) text.push_back(static_cast<char>(id));
  }
  return text;
}

TEST(MultiTurnE2E, APythonEnvironmentsObservationsAreTrainedAroundAsEnvironmentTokens) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("grpc grpo_serve"))
      << ReferencePython() << " cannot import grpc and grpo_serve: deploy/setup.sh";
  const fs::path dir = fs::temp_directory_path() / ("multi_turn_e2e_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  Children children(dir);
  children.Spawn("env", {ReferencePython(), SourceDir() + "/tests/reference/echo_length_env.py",
                         "--port", "0"});
  const json env_line = children.FirstLine("env", kStartTimeout);
  ASSERT_TRUE(env_line.is_object() && env_line.contains("port")) << Tail(children.Err("env"));
  const std::string env = "grpc:127.0.0.1:" + std::to_string(env_line["port"].get<int>());

  constexpr int kPrompts = 4, kSteps = 2, kBudget = 48;
  {
    std::ofstream data(dir / "data.jsonl");
    for (int i = 0; i < kPrompts; ++i) data << R"({"prompt": "talk )" << i << "\"}\n";
  }
  const fs::path dumps = dir / "dumps";
  children.Spawn(
      "learner",
      LearnerCommand(dir, {"--max_completion_length", std::to_string(kBudget), "--env", env,
                           "--max_turns", "3", "--reward_funcs", "env", "--max_steps",
                           std::to_string(kSteps), "--save_steps", "0", "--max_staleness", "1000",
                           "--dump_batches_dir", dumps.string(), "--linger_seconds", "3"}));
  const json line = children.FirstLine("learner", kStartTimeout);
  ASSERT_TRUE(line.is_object() && line.contains("port")) << Tail(children.Err("learner"));
  const std::string learner = "127.0.0.1:" + std::to_string(line["port"].get<int>());
  int rc = -1;
  const std::string submitted = grpo::testing::RunCommand(
      GrpoBin() + " submit --learner_address " + learner + " --timeout_seconds 30 --dataset " +
          (dir / "data.jsonl").string() + " 2>&1",
      &rc);
  ASSERT_EQ(rc, 0) << submitted;
  children.Spawn("worker",
                 {GrpoBin(), "rollout", "--learner_address", learner, "--metrics_port", "0"});
  const auto exit_code = children.Wait("learner", kJobTimeout);
  const std::string logs = "learner:\n" + Tail(children.Err("learner")) + "\nworker:\n" +
                           Tail(children.Err("worker")) + "\nenv:\n" + Tail(children.Err("env"));
  ASSERT_TRUE(exit_code.has_value()) << "the job did not finish\n" << logs;
  ASSERT_EQ(*exit_code, 0) << logs;

  int rows_checked = 0, observations_checked = 0;
  for (int step = 1; step <= kSteps; ++step) {
    const auto dump = ReadSafetensors(DumpPath(dumps, step));
    ASSERT_TRUE(dump.has_value()) << "step " << step;
    ASSERT_TRUE(dump->count("env_mask")) << "step " << step << ": no env_mask in the dump";
    const auto& ids = dump->at("completion_ids");
    const auto& real = dump->at("completion_mask");
    const auto& env_mask = dump->at("env_mask");
    const auto& rewards = dump->at("rewards");
    const int64_t rows = ids.shape.at(0), cols = ids.shape.at(1);
    for (int64_t r = 0; r < rows; ++r) {
      // The row's tokens, split into runs of model and environment tokens.
      std::vector<std::pair<bool, std::vector<int64_t>>> runs;
      for (int64_t c = 0; c < cols; ++c) {
        const bool is_real =
            real.floats.empty() ? real.ints[r * cols + c] != 0 : real.floats[r * cols + c] != 0;
        if (!is_real) break;
        const bool model = env_mask.floats[r * cols + c] != 0;
        if (runs.empty() || runs.back().first != model) runs.push_back({model, {}});
        runs.back().second.push_back(ids.ints[r * cols + c]);
      }
      ASSERT_FALSE(runs.empty());
      ASSERT_TRUE(runs[0].first) << "a row starts with an environment token";
      ASSERT_TRUE(runs.back().first) << "a row ends with an environment token";
      int model_turns = 0;
      for (size_t k = 0; k < runs.size(); ++k) {
        if (runs[k].first) {
          ++model_turns;
          continue;
        }
        const std::vector<int64_t>& turn = runs[k - 1].second;
        const std::string text = TurnText(turn);
        if (grpo::common::FindInvalidUtf8(text)) continue;  // decoded lossily: not these bytes
        EXPECT_EQ(runs[k].second, ToolTurnIds(std::to_string(text.size()), turn.back() == kImEnd))
            << "step " << step << " row " << r << " observation " << (k + 1) / 2;
        ++observations_checked;
      }
      // Two turns and one observation when the environment ended the episode; fewer when the
      // budget ran out. The reward: 1.0 a stepped turn (a turn cut by the budget is not stepped).
      EXPECT_LE(model_turns, 2) << "the environment says done after the second turn";
      EXPECT_GE(rewards.floats[r], model_turns - 1) << "step " << step << " row " << r;
      EXPECT_LE(rewards.floats[r], model_turns) << "step " << step << " row " << r;
      ++rows_checked;
    }
  }
  EXPECT_EQ(rows_checked, kSteps * 4);
  EXPECT_GT(observations_checked, 0) << "no episode got past its first turn: the test shows "
                                        "nothing about observations";
  fs::remove_all(dir);
}

}  // namespace
