// Multi-turn episodes against an OpenEnv server through real processes: the word game of
// tests/reference/openenv_server.py (openenv-core's create_app), a `grpo learner` whose config
// names it (env: openenv:http://..., env_observation_field: feedback, learner-owned keys the
// worker takes from Register) and a `grpo rollout` worker that steps it. The learner's batch dumps
// are read back: every observation in a row is the user turn the game must have answered to the
// model turn before it ("K letters in place" against the row's word "eagle", K counted here over
// the code points the turn decodes to), and the row's reward is the sum of its stepped turns' K
// / 5.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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
const std::u32string kWord = U"eagle";

// What follows a model turn for one user message (ChatML, README "Multi-turn environments").
std::vector<int64_t> UserTurnIds(const std::string& content, bool closed) {
  std::vector<int64_t> ids;
  if (!closed) ids.push_back(kImEnd);
  ids.push_back('\n');
  ids.push_back(kImStart);
  for (unsigned char c : "user\n" + content) ids.push_back(c);
  ids.push_back(kImEnd);
  ids.push_back('\n');
  ids.push_back(kImStart);
  for (unsigned char c : std::string("assistant\n")) ids.push_back(c);
  return ids;
}

// The text the environment was given for a model turn: its bytes, special tokens left out.
std::string TurnText(const std::vector<int64_t>& ids) {
  std::string text;
  for (int64_t id : ids) {
    if (id < 256) text.push_back(static_cast<char>(id));
  }
  return text;
}

// The code points the server gets for a turn's bytes: UTF-8 decoded with each maximal ill-formed
// subpart replaced by one U+FFFD (Unicode 3.9 "U+FFFD Substitution of Maximal Subparts", Table
// 3-7 for the well-formed sequences), as the worker decodes a turn.
std::u32string CodePoints(const std::string& bytes) {
  std::u32string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const unsigned char b = bytes[i];
    int need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the next continuation byte
    char32_t cp = b;
    if (b < 0x80) {
      need = 0;
    } else if (b >= 0xC2 && b <= 0xDF) {
      need = 1, cp = b & 0x1F;
    } else if (b == 0xE0) {
      need = 2, lo = 0xA0, cp = b & 0x0F;
    } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
      need = 2, cp = b & 0x0F;
    } else if (b == 0xED) {
      need = 2, hi = 0x9F, cp = b & 0x0F;
    } else if (b == 0xF0) {
      need = 3, lo = 0x90, cp = b & 0x07;
    } else if (b >= 0xF1 && b <= 0xF3) {
      need = 3, cp = b & 0x07;
    } else if (b == 0xF4) {
      need = 3, hi = 0x8F, cp = b & 0x07;
    } else {
      need = -1;  // never a lead byte: one U+FFFD by itself
    }
    size_t j = i + 1;
    int got = 0;
    for (; got < need && j < bytes.size(); ++got, ++j) {
      const unsigned char c = bytes[j];
      if (c < lo || c > hi) break;
      lo = 0x80, hi = 0xBF;
      cp = (cp << 6) | (c & 0x3F);
    }
    out.push_back(need >= 0 && got == need ? cp : U'\uFFFD');
    i = j;
  }
  return out;
}

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

  // A budget that lets the random policy close some turns (<|im_end|>) so that they are stepped.
  constexpr int kPrompts = 4, kSteps = 2, kBudget = 128;
  {
    std::ofstream data(dir / "data.jsonl");
    for (int i = 0; i < kPrompts; ++i) {
      data << R"({"prompt": "guess )" << i << R"(", "word": "eagle"})"
           << "\n";
    }
  }
  const fs::path dumps = dir / "dumps";
  children.Spawn("learner", LearnerCommand(dir, {"--max_completion_length",
                                                 std::to_string(kBudget),
                                                 "--env",
                                                 env,
                                                 "--env_observation_field",
                                                 "feedback",
                                                 "--max_turns",
                                                 "3",
                                                 "--env_max_concurrency",
                                                 "8",
                                                 "--reward_funcs",
                                                 "env",
                                                 "--max_steps",
                                                 std::to_string(kSteps),
                                                 "--save_steps",
                                                 "0",
                                                 "--max_staleness",
                                                 "1000",
                                                 "--dump_batches_dir",
                                                 dumps.string(),
                                                 "--linger_seconds",
                                                 "3"}));
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

  int rows_checked = 0, observations_checked = 0, rewards_checked = 0;
  for (int step = 1; step <= kSteps; ++step) {
    const auto dump = ReadSafetensors(DumpPath(dumps, step));
    ASSERT_TRUE(dump.has_value()) << "step " << step;
    const auto& ids = dump->at("completion_ids");
    const auto& real = dump->at("completion_mask");
    const auto& env_mask = dump->at("env_mask");
    const auto& rewards = dump->at("rewards");
    const int64_t rows = ids.shape.at(0), cols = ids.shape.at(1);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<std::pair<bool, std::vector<int64_t>>> runs;  // (model?, ids)
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
      double reward = 0;
      bool any_stepped = false;
      for (size_t k = 0; k < runs.size(); ++k) {
        if (!runs[k].first) continue;
        const std::vector<int64_t>& turn = runs[k].second;
        // Stepped: followed by an observation, or the last turn ended by a stop token (a turn
        // cut by the budget is not stepped).
        const bool stepped = k + 1 < runs.size() || turn.back() >= 256;
        if (!stepped) continue;
        any_stepped = true;
        const auto [answer, turn_reward] = Answer(TurnText(turn));
        reward += turn_reward;
        if (k + 1 < runs.size()) {
          EXPECT_EQ(runs[k + 1].second, UserTurnIds(answer, turn.back() == kImEnd))
              << "step " << step << " row " << r << " turn " << (k / 2 + 1);
          ++observations_checked;
        }
      }
      if (!any_stepped) {  // the environment gave no reward: `env` scores null (NaN)
        EXPECT_TRUE(std::isnan(rewards.floats[r])) << "step " << step << " row " << r;
      } else {
        EXPECT_NEAR(rewards.floats[r], reward, 1e-5) << "step " << step << " row " << r;
        ++rewards_checked;
      }
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
