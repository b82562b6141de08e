// Multi-turn episodes against an OpenEnv server through real processes: the word game of
// tests/reference/openenv_server.py (openenv-core's create_app), a `grpo learner` whose config
// names it (env: openenv:http://..., env_observation_field: feedback, learner-owned keys the
// worker takes from Register) and a `grpo rollout` worker that steps it. The learner's batch dumps
// are read back: every row starts with the game's reset observation ("Guess the 5-letter word.",
// a user turn after the prompt, which ends at its <|im_end|>), every later observation is the user
// turn the game must have answered to the model turn before it ("K letters in place" against the
// row's word "eagle", K counted here over the code points the turn decodes to), and the row's
// reward is the sum of its stepped turns' K / 5.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/services/multi_turn_util.h"

namespace {

namespace fs = std::filesystem;
using grpo::testing::Children;
using grpo::testing::CodePoints;
using grpo::testing::DumpedRuns;
using grpo::testing::DumpPath;
using grpo::testing::kByteImEnd;
using grpo::testing::ObservationIds;
using grpo::testing::ReadSafetensors;
using grpo::testing::ReferencePython;
using grpo::testing::SourceDir;
using grpo::testing::Tail;
using grpo::testing::TokenRuns;
using grpo::testing::TurnBytes;
using nlohmann::json;
using std::chrono::seconds;

constexpr auto kStartTimeout = seconds(60);
const std::u32string kWord = U"eagle";

// The game's answer to a guess (openenv_server.py): letters in place, or "correct"; and its
// reward.
std::pair<std::string, double> Answer(const std::string& guess) {
  const std::u32string g = CodePoints(guess);
  if (g == kWord) return {"correct", 1.0};
  int in_place = 0;
  for (size_t i = 0; i < std::min(g.size(), kWord.size()); ++i) in_place += g[i] == kWord[i];
  return {std::to_string(in_place) + " letters in place", in_place / 5.0};
}

TEST(OpenEnvE2E, AWorkerStepsAnOpenEnvServerAndTheLearnerTrainsAroundItsAnswers) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("openenv.core.env_server uvicorn"))
      << ReferencePython() << " cannot import openenv-core: deploy/setup.sh installs it";
  const fs::path dir = fs::temp_directory_path() / ("openenv_e2e_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  Children children(dir);
  children.Spawn("env", {ReferencePython(), SourceDir() + "/tests/reference/openenv_server.py",
                         "--port", "0"});
  const json env_line = children.FirstLine("env", kStartTimeout);
  ASSERT_TRUE(env_line.is_object() && env_line.contains("port")) << Tail(children.Err("env"));
  const std::string env = "openenv:http://127.0.0.1:" + std::to_string(env_line["port"].get<int>());

  // The random tiny policy ends a turn (<|im_end|>) about once in 260 tokens, and the reset
  // observation (~40 tokens) and each answer (~50) count in the budget. At 128 tokens a first turn
  // had to end within ~40 for its answer to fit (about 1 row in 8): 2 runs in 5 checked no
  // observation at all. At 512 most rows are answered (9-11 observations over 8 rows, 4 runs).
  constexpr int kPrompts = 4, kSteps = 2;
  std::vector<std::string> rows;
  for (int i = 0; i < kPrompts; ++i) {
    rows.push_back(R"({"messages": [{"role": "user", "content": "guess )" + std::to_string(i) +
                   R"("}], "word": "eagle"})");
  }
  ASSERT_NO_FATAL_FAILURE(grpo::testing::RunMultiTurnJob(
      children, dir,
      {"--max_completion_length", "512", "--env", env, "--env_observation_field", "feedback",
       "--max_turns", "3", "--env_max_concurrency", "8", "--reward_funcs", "env", "--max_steps",
       std::to_string(kSteps)},
      rows));

  int rows_checked = 0, observations_checked = 0, rewards_checked = 0;
  for (int step = 1; step <= kSteps; ++step) {
    const auto dump = ReadSafetensors(DumpPath(dir / "dumps", step));
    ASSERT_TRUE(dump.has_value()) << "step " << step;
    const auto& rewards = dump->at("rewards");
    const auto& prompts = dump->at("prompt_ids");
    const int64_t prompt_cols = prompts.shape.at(1);
    for (int64_t r = 0; r < dump->at("completion_ids").shape.at(0); ++r) {
      // The prompt lost its generation prompt: it ends with the user turn's <|im_end|>.
      EXPECT_EQ(prompts.ints.at(r * prompt_cols + prompt_cols - 1), kByteImEnd) << "row " << r;
      const TokenRuns runs = DumpedRuns(*dump, r);
      ASSERT_GE(runs.size(), 2u);
      ASSERT_FALSE(runs[0].first) << "row " << r << " does not start with the reset observation";
      EXPECT_EQ(runs[0].second, ObservationIds("user", "Guess the 5-letter word.", true))
          << "step " << step << " row " << r;
      ASSERT_TRUE(runs[1].first);
      double reward = 0;
      bool any_stepped = false;
      for (size_t k = 1; k < runs.size(); ++k) {
        if (!runs[k].first) continue;
        const std::vector<int64_t>& turn = runs[k].second;
        // Stepped: followed by an observation, or the last turn ended by a stop token (a turn
        // cut by the budget is not stepped).
        const bool stepped = k + 1 < runs.size() || turn.back() >= 256;
        if (!stepped) continue;
        any_stepped = true;
        const auto [answer, turn_reward] = Answer(TurnBytes(turn));
        reward += turn_reward;
        if (k + 1 < runs.size()) {
          EXPECT_EQ(runs[k + 1].second, ObservationIds("user", answer, turn.back() == kByteImEnd))
              << "step " << step << " row " << r << " turn " << (k + 1) / 2;
          ++observations_checked;
        }
      }
      // Never stepped: the environment gave nothing, and the episode's reward is 0.
      EXPECT_NEAR(rewards.floats[r], reward, 1e-5) << "step " << step << " row " << r;
      if (any_stepped) ++rewards_checked;
      ++rows_checked;
    }
  }
  EXPECT_EQ(rows_checked, kSteps * 4);
  EXPECT_GT(observations_checked, 0) << "no episode got past its first turn: the test shows "
                                        "nothing about observations";
  EXPECT_GT(rewards_checked, 0);
  fs::remove_all(dir);
}

}  // namespace
