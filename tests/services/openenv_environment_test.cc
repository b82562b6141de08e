// OpenEnvEnvironment against a real OpenEnv server: tests/reference/openenv_server.py, built on
// openenv-core's create_app (the venv's openenv-core; deploy/setup.sh installs it). Its word game
// is worked out here from its documented rules (reset picks the row's `word`, else
// WORDS[seed % 5]; a guess earns in-place letters / 5, done when right), never read back from the
// server. Also: servers killed or stopped (SIGSTOP) mid-episode, a slow step, a schema that cannot
// be mapped, a server at capacity.
#include "services/openenv_environment.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "rollout/env/environment.h"
#include "rollout/env/episode.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using grpo::testing::Children;
using grpo::testing::ReferencePython;
using grpo::testing::SourceDir;
using grpo::testing::Tail;
using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr auto kStartTimeout = seconds(60);
// A call's deadline where the test expects an answer (generous: a loaded 2-core machine).
constexpr auto kCallTimeout = seconds(20);

Clock::time_point Within(milliseconds timeout = kCallTimeout) { return Clock::now() + timeout; }

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::unique_ptr<rollout::Environment> Connect(const std::string& url, OpenEnvOptions options = {}) {
  auto env = MakeOpenEnvEnvironment(url, std::move(options));
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  return env.ok() ? std::move(env).value() : nullptr;
}

std::unique_ptr<rollout::EnvSession> OpenSession(rollout::Environment& env) {
  auto session = env.Open();
  EXPECT_TRUE(session.ok()) << session.status().ToString();
  return std::move(session).value();
}

// The one message of an observation, "" when there is not exactly one.
std::string OnlyMessage(const rollout::EnvObservation& obs) {
  return obs.messages.size() == 1 ? obs.messages[0].content : "";
}

// Three servers started at once for the whole suite (each takes seconds to import openenv):
// "shared" for the tests that leave it running, "kill" and "stop" for the two that break theirs.
class OpenEnvEnvironmentTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("openenv_environment_test_" + std::to_string(::getpid())));
    fs::remove_all(*dir_);
    fs::create_directories(*dir_);
    children_ = new Children(*dir_);
    urls_ = new std::map<std::string, std::string>();
    const std::string script = SourceDir() + "/tests/reference/openenv_server.py";
    for (const char* name : {"shared", "kill", "stop"}) {
      pids_[name] = children_->Spawn(name, {ReferencePython(), script, "--port", "0"});
    }
    for (const char* name : {"shared", "kill", "stop"}) {
      // Its first line, or none as soon as it exited (openenv missing: at once, not after
      // kStartTimeout).
      json line;
      grpo::testing::WaitUntil(
          [&] {
            line = children_->FirstLine(name, milliseconds(0));
            return !line.is_null() || children_->Wait(name, milliseconds(0)).has_value();
          },
          kStartTimeout, milliseconds(100));
      if (line.is_object() && line.contains("port")) {
        (*urls_)[name] = "http://127.0.0.1:" + std::to_string(line["port"].get<int>());
      }
    }
  }
  static void TearDownTestSuite() {
    delete children_;
    children_ = nullptr;
    fs::remove_all(*dir_);
    delete dir_;
    delete urls_;
  }

  // The base url of server `name`; fails the test when it did not start.
  std::string Url(const std::string& name) {
    auto it = urls_->find(name);
    EXPECT_TRUE(it != urls_->end())
        << "tests/reference/openenv_server.py did not start (does " << ReferencePython()
        << " have openenv-core==0.3.0? deploy/setup.sh installs it):\n"
        << Tail(children_->Err(name));
    return it == urls_->end() ? "" : it->second;
  }

  // SIGSTOP to server `name`, returning once every thread of it has stopped (kill() only queues
  // the signal: a request sent right after could still be answered).
  static bool Stop(const std::string& name) {
    if (!children_->Signal(name, SIGSTOP)) return false;
    return grpo::testing::WaitUntil(
        [&] {
          const fs::path tasks = "/proc/" + std::to_string(pids_[name]) + "/task";
          std::error_code ec;
          for (const auto& t : fs::directory_iterator(tasks, ec)) {
            const std::string stat = grpo::testing::ReadFile(t.path() / "stat");
            const size_t paren = stat.rfind(')');  // "pid (comm) STATE ..."
            if (paren == std::string::npos || stat.size() < paren + 3) return false;
            if (stat[paren + 2] != 'T' && stat[paren + 2] != 't') return false;
          }
          return !ec;
        },
        seconds(10));
  }

  static inline fs::path* dir_ = nullptr;
  static inline Children* children_ = nullptr;
  static inline std::map<std::string, std::string>* urls_ = nullptr;
  static inline std::map<std::string, pid_t> pids_;
};

TEST_F(OpenEnvEnvironmentTest, EpisodeFollowsTheGamesRules) {
  auto env = Connect(Url("shared"));
  ASSERT_NE(env, nullptr);
  EXPECT_EQ(env->name(), "openenv:" + Url("shared"));
  auto session = OpenSession(*env);
  // No `word` in the row: seed 7 picks WORDS[7 % 5] = "chair". The row's other fields are passed
  // too; the server drops those its reset() does not take (`prompt`).
  auto reset = session->Reset(json{{"prompt", "Guess!"}}, 7, Within());
  ASSERT_TRUE(reset.ok()) << reset.status().ToString();
  // The reset's text is a message (shown to the model before its first turn) and metadata.
  ASSERT_EQ(reset->messages.size(), 1u);
  EXPECT_EQ(reset->messages[0].role, "user");
  EXPECT_EQ(reset->messages[0].content, "Guess the 5-letter word.");
  EXPECT_EQ(reset->metadata,
            (json{{"attempts", 0}, {"reset_observation", "Guess the 5-letter word."}}));
  EXPECT_FALSE(reset->reward.has_value());
  EXPECT_FALSE(reset->done);
  // "chart" against "chair": c, h, a in place; r/i and t/r not: 3 of 5.
  auto first = session->Step("chart", Within());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->messages.size(), 1u);
  EXPECT_EQ(first->messages[0].role, "user");
  EXPECT_EQ(first->messages[0].content, "3 letters in place");
  ASSERT_TRUE(first->reward.has_value());
  EXPECT_DOUBLE_EQ(*first->reward, 3.0 / 5.0);
  EXPECT_FALSE(first->done);
  EXPECT_FALSE(first->truncated);
  EXPECT_EQ(first->metadata, (json{{"attempts", 1}}));
  // "apple": no letter in place.
  auto second = session->Step("apple", Within());
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(OnlyMessage(*second), "0 letters in place");
  EXPECT_DOUBLE_EQ(second->reward.value_or(-1), 0.0);
  auto last = session->Step("chair", Within());
  ASSERT_TRUE(last.ok()) << last.status().ToString();
  EXPECT_EQ(OnlyMessage(*last), "correct");
  EXPECT_DOUBLE_EQ(last->reward.value_or(-1), 1.0);
  EXPECT_TRUE(last->done);
  EXPECT_EQ(last->metadata, (json{{"attempts", 3}}));
}

TEST_F(OpenEnvEnvironmentTest, ConcurrentEpisodesEachKeepTheirOwnState) {
  OpenEnvOptions options;
  options.role = "tool";
  auto env = Connect(Url("shared"), options);
  ASSERT_NE(env, nullptr);
  // Six episodes at once, each with its own word from its row; each guesses "eagle" twice, then
  // its word. In place letters of "eagle" (e,a,g,l,e) against each word, by hand:
  //   apple  a,p,p,l,e: l, e          -> 2
  //   bread  b,r,e,a,d: none          -> 0
  //   chair  c,h,a,i,r: none          -> 0
  //   delta  d,e,l,t,a: none          -> 0
  //   eager  e,a,g,e,r: e, a, g       -> 3
  const std::vector<std::pair<std::string, int>> words = {{"apple", 2}, {"bread", 0}, {"chair", 0},
                                                          {"delta", 0}, {"eager", 3}, {"apple", 2}};
  std::vector<std::string> failures(words.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < words.size(); ++i) {
    threads.emplace_back([&, i] {
      auto fail = [&](const std::string& why) { failures[i] = words[i].first + ": " + why; };
      auto session = env->Open();
      if (!session.ok()) return fail(session.status().ToString());
      auto reset = (*session)->Reset(json{{"word", words[i].first}}, i, Within());
      if (!reset.ok()) return fail(reset.status().ToString());
      for (int attempt = 1; attempt <= 2; ++attempt) {
        auto obs = (*session)->Step("eagle", Within());
        if (!obs.ok()) return fail(obs.status().ToString());
        const std::string want = std::to_string(words[i].second) + " letters in place";
        if (obs->messages.size() != 1 || obs->messages[0].content != want ||
            obs->messages[0].role != "tool" || obs->metadata != json{{"attempts", attempt}} ||
            obs->reward != words[i].second / 5.0 || obs->done) {
          return fail("attempt " + std::to_string(attempt) + " got " + OnlyMessage(*obs) + " " +
                      obs->metadata.dump());
        }
      }
      auto obs = (*session)->Step(words[i].first, Within());
      if (!obs.ok()) return fail(obs.status().ToString());
      if (!obs->done || obs->metadata != json{{"attempts", 3}}) return fail(obs->metadata.dump());
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& f : failures) EXPECT_EQ(f, "");
}

TEST_F(OpenEnvEnvironmentTest, SchemaWithTwoStringFieldsNeedsTheOption) {
  const std::string url = Url("shared") + "/ambiguous";
  auto env = Connect(url);
  ASSERT_NE(env, nullptr);
  auto session = OpenSession(*env);
  auto reset = session->Reset(json::object(), 0, Within());
  ASSERT_FALSE(reset.ok());
  EXPECT_EQ(reset.status().code(), StatusCode::kInvalidArgument) << reset.status().ToString();
  const std::string message = reset.status().message();
  EXPECT_NE(message.find("string fields: feedback, hint"), std::string::npos) << message;
  EXPECT_NE(message.find("set env_observation_field"), std::string::npos) << message;
  EXPECT_NE(message.find("HintedObservation"), std::string::npos) << message;
  // Cached: the next episode is refused alike.
  auto again = OpenSession(*env)->Reset(json::object(), 0, Within());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);

  // An option naming no field is refused as clearly.
  OpenEnvOptions wrong;
  wrong.observation_field = "clue";
  auto wrong_env = Connect(url, wrong);
  auto refused = OpenSession(*wrong_env)->Reset(json::object(), 0, Within());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("env_observation_field 'clue' names no field"),
            std::string::npos)
      << refused.status().ToString();

  // Naming the field maps it: the hint is shown, the feedback is metadata. "brick" against
  // "bread": b, r in place -> 2 of 5.
  OpenEnvOptions hinted;
  hinted.observation_field = "hint";
  auto hinted_env = Connect(url, hinted);
  auto episode = OpenSession(*hinted_env);
  auto start = episode->Reset(json{{"word", "bread"}}, 0, Within());
  ASSERT_TRUE(start.ok()) << start.status().ToString();
  EXPECT_EQ(start->metadata, (json{{"attempts", 0},
                                   {"feedback", "Guess the 5-letter word."},
                                   {"reset_observation", "starts with b"}}));
  EXPECT_EQ(OnlyMessage(*start), "starts with b");
  auto obs = episode->Step("brick", Within());
  ASSERT_TRUE(obs.ok()) << obs.status().ToString();
  EXPECT_EQ(OnlyMessage(*obs), "starts with b");
  EXPECT_EQ(obs->metadata, (json{{"attempts", 1}, {"feedback", "2 letters in place"}}));
  EXPECT_DOUBLE_EQ(obs->reward.value_or(-1), 2.0 / 5.0);
}

TEST_F(OpenEnvEnvironmentTest, StepPastItsDeadlineIsDeadlineExceededOnTime) {
  auto env = Connect(Url("shared"));
  ASSERT_NE(env, nullptr);
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 0, Within()).ok());
  const auto t0 = Clock::now();
  auto obs = session->Step("sleep 5", t0 + milliseconds(500));
  const double took = SecondsSince(t0);
  EXPECT_EQ(obs.status().code(), StatusCode::kDeadlineExceeded) << obs.status().ToString();
  EXPECT_EQ(rollout::EnvErrorKind(obs.status()), "timeout");
  EXPECT_GE(took, 0.5);
  EXPECT_LT(took, 1.5);
  // The session is spent; ending it does not wait for the sleeping step.
  EXPECT_EQ(session->Step("apple", Within()).status().code(), StatusCode::kFailedPrecondition);
  const auto t1 = Clock::now();
  session.reset();
  EXPECT_LT(SecondsSince(t1), 1.0);
}

TEST_F(OpenEnvEnvironmentTest, EnvironmentThatRaisesIsAnErrorThatSpendsTheSession) {
  auto env = Connect(Url("shared"));
  ASSERT_NE(env, nullptr);
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 0, Within()).ok());
  auto obs = session->Step("raise", Within());
  EXPECT_EQ(obs.status().code(), StatusCode::kInternal) << obs.status().ToString();
  EXPECT_EQ(rollout::EnvErrorKind(obs.status()), "error");
  EXPECT_NE(obs.status().message().find("asked to raise"), std::string::npos);
  EXPECT_EQ(session->Step("apple", Within()).status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(OpenEnvEnvironmentTest, ServerAtCapacityIsResourceExhaustedUntilASessionEnds) {
  auto env = Connect(Url("shared") + "/single");  // max_concurrent_envs=1
  ASSERT_NE(env, nullptr);
  auto first = OpenSession(*env);
  ASSERT_TRUE(first->Reset(json::object(), 0, Within()).ok());
  auto second = OpenSession(*env);
  auto refused = second->Reset(json::object(), 0, Within());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("max_concurrent_envs"), std::string::npos);
  // Ending the first episode frees the server's one session (it closes it on our "close").
  first.reset();
  StatusOr<rollout::EnvObservation> third = Status::Unknown("not run");
  grpo::testing::WaitUntil(
      [&] {
        third = OpenSession(*env)->Reset(json::object(), 0, Within());
        return third.ok();
      },
      seconds(10), milliseconds(100));
  EXPECT_TRUE(third.ok()) << third.status().ToString();
}

// The worker's episode loop (rollout/env/episode.h) with a tiny random policy over the byte
// tokenizer (ids 0-255 bytes, 257 <|im_start|>, 258 <|im_end|>), 3 episodes of "eagle" and at
// most 3 turns each; observations are rendered here by hand (ChatML).
constexpr int32_t kImStart = 257, kImEnd = 258;

std::vector<int32_t> RenderChatMl(const std::vector<common::ChatMessage>& messages, bool closed) {
  std::vector<int32_t> ids;
  if (!closed) ids.push_back(kImEnd);
  ids.push_back('\n');
  for (const common::ChatMessage& m : messages) {
    ids.push_back(kImStart);
    for (unsigned char c : m.role + "\n" + m.content) ids.push_back(c);
    ids.push_back(kImEnd);
    ids.push_back('\n');
  }
  ids.push_back(kImStart);
  for (unsigned char c : std::string("assistant\n")) ids.push_back(c);
  return ids;
}

struct EpisodeLoop {
  common::ByteTokenizer tokenizer;
  std::unique_ptr<rollout::Generator> generator;
  rollout::EpisodeOptions options;
  rollout::Prompt prompt;

  EpisodeLoop() {
    auto model_config = common::ModelConfigPreset("tiny");
    EXPECT_TRUE(model_config.ok());
    auto model = common::Model::InitRandom(*model_config, 5);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    rollout::GeneratorOptions go;
    go.num_generations = 3;
    go.max_prompt_length = 64;
    go.max_completion_length = 120;
    go.seed = 11;
    go.eos_token_ids = {kImEnd};
    for (int32_t b = 0; b < 96; ++b) go.eos_token_ids.push_back(b);  // short turns
    auto made = rollout::Generator::Create(
        std::shared_ptr<const common::Model>(std::move(model).value()), 1, go, &tokenizer);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (made.ok()) generator = std::move(made).value();
    options.max_turns = 3;
    options.max_concurrent_sessions = 3;
    options.end_of_turn_id = kImEnd;
    options.render = [](const std::vector<common::ChatMessage>& m,
                        bool closed) -> StatusOr<std::vector<int32_t>> {
      return RenderChatMl(m, closed);
    };
    options.generation_tail = {'\n', kImStart};
    for (unsigned char c : std::string("assistant\n")) options.generation_tail.push_back(c);
    prompt.text = "<|im_start|>user\nGuess<|im_end|>\n<|im_start|>assistant\n";
    prompt.ids = tokenizer.Encode(prompt.text).value();
    prompt.row = json{{"word", "eagle"}};
  }

  // The prompt's group (seed index 0) through `env`, or the call's or the group's error.
  StatusOr<common::RolloutGroup> Run(rollout::Environment& env, rollout::EpisodeCounts* counts) {
    ASSIGN_OR_RETURN(
        rollout::ProduceResult result,
        rollout::ProduceEpisodes(*generator, nullptr, env, options, {{&prompt, 0}}, counts));
    if (result.groups.size() != 1) {
      return Status::Internal(std::to_string(result.groups.size()) + " groups for one prompt");
    }
    return std::move(result.groups[0].group);
  }
};

// The reset's text stays out of the episode, and every observation appended after a model turn
// is ChatML's user turn with the game's answer.
TEST_F(OpenEnvEnvironmentTest, EpisodeLoopAppendsTheServersAnswersAsUserTurns) {
  auto env = Connect(Url("shared"));
  ASSERT_NE(env, nullptr);
  EpisodeLoop loop;
  ASSERT_NE(loop.generator, nullptr);
  const common::ByteTokenizer& tokenizer = loop.tokenizer;
  const auto render = RenderChatMl;
  rollout::EpisodeCounts counts;
  auto group = loop.Run(*env, &counts);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EXPECT_TRUE(counts.errors.empty());
  EXPECT_EQ(counts.episodes, 3);
  // The prompt ends at the user turn's <|im_end|>: the reset observation comes first in each
  // episode, a user turn, then the assistant header.
  const std::vector<int32_t> cut = tokenizer.Encode("<|im_start|>user\nGuess<|im_end|>").value();
  EXPECT_EQ(group->prompt_ids, cut);
  const std::vector<int32_t> reset = render({{"user", "Guess the 5-letter word."}}, true);
  int64_t observations = 0;
  for (const common::Completion& c : group->completions) {
    ASSERT_EQ(c.env_mask.size(), c.token_ids.size());
    ASSERT_GT(c.token_ids.size(), reset.size());
    EXPECT_EQ(std::vector<int32_t>(c.token_ids.begin(), c.token_ids.begin() + reset.size()), reset);
    EXPECT_EQ(std::vector<uint8_t>(c.env_mask.begin(), c.env_mask.begin() + reset.size()),
              std::vector<uint8_t>(reset.size(), 0));
    EXPECT_EQ(c.env_mask[reset.size()], 1);  // then the model's first turn
    for (size_t t = reset.size(); t < c.token_ids.size();) {
      size_t end = t;
      while (end < c.token_ids.size() && c.env_mask[end] == c.env_mask[t]) ++end;
      if (c.env_mask[t] == 0) {  // an observation: one of the game's answers, as a user turn
        const std::vector<int32_t> run(c.token_ids.begin() + t, c.token_ids.begin() + end);
        const bool closed = c.token_ids[t - 1] == kImEnd;
        bool known = false;
        for (int k = 0; k <= 5; ++k) {
          known |= run == render({{"user", std::to_string(k) + " letters in place"}}, closed);
        }
        auto text = tokenizer.Decode(run, /*skip_special_tokens=*/false);
        EXPECT_TRUE(known) << (text.ok() ? *text : text.status().ToString());
        ++observations;
      }
      t = end;
    }
  }
  EXPECT_EQ(counts.observation_tokens > 0, observations > 0);
  EXPECT_GT(observations, 0) << "no turn was stepped: the test shows little";
}

// A server of one session at a time (max_concurrent_envs=1) and env_max_concurrency 1: the
// three episodes run one after the other, each starting once the one before it has ended, and
// all three finish (before the bound held sessions, the second and third reset were refused).
TEST_F(OpenEnvEnvironmentTest, EpisodesWaitForTheServersOneSession) {
  auto env = Connect(Url("shared") + "/single");
  ASSERT_NE(env, nullptr);
  EpisodeLoop loop;
  ASSERT_NE(loop.generator, nullptr);
  loop.options.max_concurrent_sessions = 1;
  rollout::EpisodeCounts counts;
  auto group = loop.Run(*env, &counts);
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  EXPECT_TRUE(counts.errors.empty());
  EXPECT_EQ(group->completions.size(), 3u);
  EXPECT_EQ(counts.done + counts.max_turns + counts.length_truncated, 3);
}

TEST_F(OpenEnvEnvironmentTest, HostNamesAreResolved) {
  std::string url = Url("shared");
  ASSERT_FALSE(url.empty());
  url.replace(url.find("127.0.0.1"), 9, "localhost");  // ::1 may come first: tried in turn
  auto env = Connect(url + "/");
  auto session = OpenSession(*env);
  auto reset = session->Reset(json{{"word", "delta"}}, 0, Within());
  ASSERT_TRUE(reset.ok()) << reset.status().ToString();
  auto obs = session->Step("delta", Within());
  ASSERT_TRUE(obs.ok()) << obs.status().ToString();
  EXPECT_TRUE(obs->done);
}

TEST_F(OpenEnvEnvironmentTest, UnreachableServerIsUnavailable) {
  // Port 1 (tcpmux): nobody listens there.
  auto env = Connect("http://127.0.0.1:1");
  auto reset = OpenSession(*env)->Reset(json::object(), 0, Within());
  EXPECT_EQ(reset.status().code(), StatusCode::kUnavailable) << reset.status().ToString();
  EXPECT_EQ(rollout::EnvErrorKind(reset.status()), "unavailable");
}

TEST_F(OpenEnvEnvironmentTest, ServerKilledMidEpisodeIsUnavailable) {
  const std::string url = Url("kill");
  ASSERT_FALSE(url.empty());
  auto env = Connect(url);
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 0, Within()).ok());
  ASSERT_TRUE(session->Step("ample", Within()).ok());
  children_->Kill("kill");
  const auto t0 = Clock::now();
  auto obs = session->Step("apple", Within());
  EXPECT_EQ(obs.status().code(), StatusCode::kUnavailable) << obs.status().ToString();
  EXPECT_EQ(rollout::EnvErrorKind(obs.status()), "unavailable");
  EXPECT_LT(SecondsSince(t0), 5.0);
  const auto t1 = Clock::now();
  session.reset();
  EXPECT_LT(SecondsSince(t1), 1.0);
  // A new episode on the dead server: Unavailable at its reset (the schema is cached by now).
  auto reset = OpenSession(*env)->Reset(json::object(), 0, Within());
  EXPECT_EQ(reset.status().code(), StatusCode::kUnavailable) << reset.status().ToString();
}

TEST_F(OpenEnvEnvironmentTest, DestructorDoesNotHangOnAStoppedServer) {
  const std::string url = Url("stop");
  ASSERT_FALSE(url.empty());
  OpenEnvOptions options;
  options.close_timeout = milliseconds(500);
  auto env = Connect(url, options);
  auto stepped = OpenSession(*env);
  ASSERT_TRUE(stepped->Reset(json::object(), 0, Within()).ok());
  auto healthy = OpenSession(*env);  // an episode whose WebSocket is healthy when the server stops
  ASSERT_TRUE(healthy->Reset(json::object(), 1, Within()).ok());
  ASSERT_TRUE(Stop("stop"));  // alive, connected, never answers
  auto obs = stepped->Step("apple", Clock::now() + milliseconds(500));
  EXPECT_EQ(obs.status().code(), StatusCode::kDeadlineExceeded) << obs.status().ToString();
  auto t0 = Clock::now();
  stepped.reset();
  EXPECT_LT(SecondsSince(t0), 1.0);
  // A new episode: the kernel accepts its connection, nobody upgrades it.
  auto late = OpenSession(*env);
  t0 = Clock::now();
  auto reset = late->Reset(json::object(), 2, Clock::now() + milliseconds(300));
  EXPECT_EQ(reset.status().code(), StatusCode::kDeadlineExceeded) << reset.status().ToString();
  EXPECT_LT(SecondsSince(t0), 1.0);
  t0 = Clock::now();
  late.reset();
  EXPECT_LT(SecondsSince(t0), 1.0);
  // Ending a healthy WebSocket waits for the server's close close_timeout (0.5 s) at most.
  t0 = Clock::now();
  healthy.reset();
  EXPECT_LT(SecondsSince(t0), 2.0);
  children_->Signal("stop", SIGCONT);
}

TEST(OpenEnvUrl, OnlyHttpUrlsWithAHostAndAPortAreTaken) {
  EXPECT_TRUE(MakeOpenEnvEnvironment("http://127.0.0.1:8000").ok());
  EXPECT_TRUE(MakeOpenEnvEnvironment("http://envs.example:8000/game/").ok());
  EXPECT_TRUE(MakeOpenEnvEnvironment("http://[::1]:8000").ok());
  EXPECT_TRUE(MakeOpenEnvEnvironment("http://localhost").ok());  // port 80
  for (const char* bad : {"https://h:1", "ws://h:1", "h:1", "http://", "http://:1", "http://h:",
                          "http://h:x", "http://h:70000", "http://[::1", "http://h:1/a?b=c"}) {
    auto env = MakeOpenEnvEnvironment(bad);
    EXPECT_EQ(env.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  OpenEnvOptions role;
  role.role = "assistant";
  EXPECT_EQ(MakeOpenEnvEnvironment("http://h:1", role).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(OpenEnvConfig, EnvTakesOpenEnvUrls) {
  common::GrpoConfig config;
  config.env = "openenv:http://127.0.0.1:8000";
  config.env_observation_field = "feedback";
  EXPECT_TRUE(config.Validate().ok()) << config.Validate().ToString();
  config.env = "openai:http://127.0.0.1:8000";
  const Status refused = config.Validate();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("openenv:http://HOST:PORT"), std::string::npos)
      << refused.ToString();
}

}  // namespace
}  // namespace grpo::services
