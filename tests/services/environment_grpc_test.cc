// Environments over gRPC (proto/grpo/v1/environment.proto) with real processes: GrpcEnvironment
// against `grpo env-server --task guess_number`, against EnvironmentServer in process (a slow
// step, a failing step, the session's end), against a server killed or stopped mid-episode, and
// against the Python calculator of examples/calculator_env.py (the venv's grpo_serve). Secrets,
// results and rewards are worked out here from the documented rules, never read from a server.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "rollout/env/environment.h"
#include "services/environment_server.h"
#include "services/grpc_environment.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using grpo::testing::Children;
using grpo::testing::GrpoBin;
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

std::unique_ptr<rollout::Environment> Connect(const std::string& address,
                                              GrpcEnvironmentOptions options = {}) {
  auto env = MakeGrpcEnvironment(address, std::move(options));
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  return std::move(env).value();
}

std::unique_ptr<rollout::EnvSession> OpenSession(rollout::Environment& env) {
  auto session = env.Open();
  EXPECT_TRUE(session.ok()) << session.status().ToString();
  return std::move(session).value();
}

std::string Address(int port) { return "127.0.0.1:" + std::to_string(port); }

class EnvironmentGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("environment_grpc_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    children_ = std::make_unique<Children>(dir_);
  }
  void TearDown() override {
    children_.reset();
    fs::remove_all(dir_);
  }

  // `grpo env-server --task guess_number` on a free loopback port (`extra` args appended); its
  // address, or "" (with a test failure) when it did not start.
  std::string StartGuessNumberServer(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {GrpoBin(), "env-server", "--task", "guess_number",
                                     "--host",  "127.0.0.1",  "--port", "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    env_pid_ = children_->Spawn("env", args);
    const json line = FirstLineOrExit("env");
    EXPECT_TRUE(line.is_object() && line.value("env_server", false) && line.contains("port"))
        << "grpo env-server did not start:\n"
        << Tail(children_->Err("env"));
    return line.is_object() && line.contains("port") ? Address(line["port"].get<int>()) : "";
  }

  // The first stdout line of child `name` as JSON; null once it exited without one (at once, not
  // after kStartTimeout) or when none came in time.
  json FirstLineOrExit(const std::string& name) {
    json line;
    grpo::testing::WaitUntil(
        [&] {
          line = children_->FirstLine(name, milliseconds(0));
          return !line.is_null() || children_->Wait(name, milliseconds(0)).has_value();
        },
        kStartTimeout, milliseconds(100));
    return line.is_null() ? children_->FirstLine(name, milliseconds(0)) : line;
  }

  fs::path WriteFile(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return dir_ / name;
  }

  // SIGSTOP to the env-server, returning once every thread of it has stopped (kill() only queues
  // the signal: a request sent right after could still be answered).
  bool StopEnvServer() {
    if (!children_->Signal("env", SIGSTOP)) return false;
    return grpo::testing::WaitUntil(
        [&] {
          const fs::path tasks = "/proc/" + std::to_string(env_pid_) + "/task";
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

  fs::path dir_;
  std::unique_ptr<Children> children_;
  pid_t env_pid_ = -1;
};

// The one message of an observation, "" when there is not exactly one.
std::string OnlyMessage(const rollout::EnvObservation& obs) {
  return obs.messages.size() == 1 ? obs.messages[0].content : "";
}

TEST_F(EnvironmentGrpcTest, BinarySearchAgainstGuessNumberServerIsCorrectWithinSevenSteps) {
  const std::string address = StartGuessNumberServer();
  ASSERT_FALSE(address.empty());
  auto env = Connect(address);
  EXPECT_EQ(env->name(), "grpc:" + address);
  struct Case {
    json row;
    uint64_t seed;
    int64_t low, high, secret;  // secret = low + seed % (high - low + 1), by hand
  };
  for (const Case& c : {Case{json::object(), 12345, 1, 100, 46},
                        Case{{{"low", 500}, {"high", 600}}, 77, 500, 600, 577}}) {
    auto session = OpenSession(*env);
    auto reset = session->Reset(c.row, c.seed, Within());
    ASSERT_TRUE(reset.ok()) << reset.status().ToString();
    EXPECT_TRUE(reset->messages.empty());
    // Text without a number first: asked for one, no reward, the episode goes on.
    auto idle = session->Step("Let me think.", Within());
    ASSERT_TRUE(idle.ok()) << idle.status().ToString();
    EXPECT_EQ(OnlyMessage(*idle), "say a number");
    EXPECT_EQ(idle->reward, 0.0);
    EXPECT_FALSE(idle->done);

    int64_t low = c.low, high = c.high;
    bool correct = false;
    for (int step = 1; step <= 7 && !correct; ++step) {
      const int64_t guess = low + (high - low) / 2;
      auto obs = session->Step("Is it " + std::to_string(guess) + "?", Within());
      ASSERT_TRUE(obs.ok()) << obs.status().ToString();
      ASSERT_EQ(obs->messages.size(), 1u);
      EXPECT_EQ(obs->messages[0].role, "user");
      const std::string want = guess < c.secret ? "higher" : guess > c.secret ? "lower" : "correct";
      ASSERT_EQ(obs->messages[0].content, want) << "guess " << guess << ", step " << step;
      correct = want == "correct";
      EXPECT_EQ(obs->reward, correct ? 1.0 : 0.0);
      EXPECT_EQ(obs->done, correct);
      EXPECT_FALSE(obs->truncated);
      EXPECT_EQ(obs->metadata, (json{{"guesses", step}}));
      if (want == "higher") low = guess + 1;
      if (want == "lower") high = guess - 1;
    }
    EXPECT_TRUE(correct) << "secret " << c.secret << " not found in 7 steps";
  }
}

TEST_F(EnvironmentGrpcTest, StepThatMissesItsDeadlineIsDeadlineExceededInAboutTheDeadline) {
  rollout::FunctionEnvironment::StepFn slow_step = [](const std::string&, json&) {
    std::this_thread::sleep_for(seconds(3));
    return StatusOr<rollout::EnvObservation>(rollout::EnvObservation{});
  };
  auto server = EnvironmentServer::Start(
      "127.0.0.1:0",
      std::make_unique<rollout::FunctionEnvironment>(
          "slow", [](const json&, uint64_t, json&) { return rollout::EnvObservation{}; },
          slow_step));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto env = Connect(Address((*server)->port()));
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 1, Within()).ok());

  constexpr auto kDeadline = milliseconds(300);
  const auto t0 = Clock::now();
  auto obs = session->Step("anything", Clock::now() + kDeadline);
  const double waited = SecondsSince(t0);
  ASSERT_FALSE(obs.ok());
  EXPECT_EQ(obs.status().code(), StatusCode::kDeadlineExceeded) << obs.status().ToString();
  EXPECT_EQ(rollout::EnvErrorKind(obs.status()), "timeout");
  EXPECT_GE(waited, 0.29);
  EXPECT_LT(waited, 2.5) << "waited for the 3 s step instead of its 0.3 s deadline";
  // The session is spent; ending it does not wait for the step either.
  EXPECT_EQ(session->Step("again", Within()).status().code(), StatusCode::kFailedPrecondition);
  const auto t1 = Clock::now();
  session.reset();
  EXPECT_LT(SecondsSince(t1), 2.5);
}

TEST_F(EnvironmentGrpcTest, AStepTheEnvironmentFailsIsAnErrorWithItsMessage) {
  auto server = EnvironmentServer::Start(
      "127.0.0.1:0",
      std::make_unique<rollout::FunctionEnvironment>(
          "picky", [](const json&, uint64_t, json&) { return rollout::EnvObservation{}; },
          [](const std::string& action, json&) -> StatusOr<rollout::EnvObservation> {
            return Status::InvalidArgument("no such move: " + action);
          }));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto env = Connect(Address((*server)->port()));
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 1, Within()).ok());
  auto obs = session->Step("fly", Within());
  ASSERT_FALSE(obs.ok());
  EXPECT_EQ(obs.status().code(), StatusCode::kInternal) << obs.status().ToString();
  EXPECT_EQ(rollout::EnvErrorKind(obs.status()), "error");
  EXPECT_NE(obs.status().message().find("no such move: fly"), std::string::npos)
      << obs.status().ToString();
  EXPECT_EQ(session->Step("walk", Within()).status().code(), StatusCode::kFailedPrecondition);
}

// An environment that declares a tool at reset gets each turn's calls as structured calls over
// the stream (EnvStep.tool_calls), the reset's tools reach the worker (tools_json), and a
// session that declared none gets plain steps.
TEST_F(EnvironmentGrpcTest, DeclaredToolsAndStructuredCallsCrossTheStream) {
  auto seen = std::make_shared<std::vector<std::vector<common::ToolCall>>>();
  auto server = EnvironmentServer::Start(
      "127.0.0.1:0",
      std::make_unique<rollout::FunctionEnvironment>(
          "tools",
          [](const json& row, uint64_t, json&) {
            rollout::EnvObservation obs;
            if (row.value("tools", true)) obs.tools = {json{{"name", "calculator"}}};
            return obs;
          },
          [](const std::string& action, json&) -> StatusOr<rollout::EnvObservation> {
            rollout::EnvObservation obs;
            obs.messages.push_back({"tool", "plain: " + action});
            return obs;
          },
          [seen](const std::string&, const std::vector<common::ToolCall>& calls,
                 json&) -> StatusOr<rollout::EnvObservation> {
            seen->push_back(calls);
            rollout::EnvObservation obs;
            obs.messages.push_back({"tool", std::to_string(calls.size()) + " calls"});
            return obs;
          }));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto env = Connect(Address((*server)->port()));
  auto session = OpenSession(*env);
  auto reset = session->Reset(json::object(), 1, Within());
  ASSERT_TRUE(reset.ok()) << reset.status().ToString();
  EXPECT_EQ(reset->tools, (std::vector<json>{json{{"name", "calculator"}}}));
  common::ToolCall call;
  call.name = "calculator";
  call.arguments = json{{"expression", "2+3"}};
  auto obs = session->StepToolCalls("text", {call, call}, Within());
  ASSERT_TRUE(obs.ok()) << obs.status().ToString();
  EXPECT_EQ(obs->messages.at(0).content, "2 calls");
  ASSERT_EQ(seen->size(), 1u);
  ASSERT_EQ(seen->at(0).size(), 2u);
  EXPECT_EQ(seen->at(0)[1].name, "calculator");
  EXPECT_EQ(seen->at(0)[1].arguments, (json{{"expression", "2+3"}}));

  auto plain = OpenSession(*env);
  auto no_tools = plain->Reset(json{{"tools", false}}, 1, Within());
  ASSERT_TRUE(no_tools.ok());
  EXPECT_TRUE(no_tools->tools.empty());
  EXPECT_EQ(plain->Step("walk", Within())->messages.at(0).content, "plain: walk");
}

// Counts its live sessions and records the time each step was given.
class CountingEnvironment final : public rollout::Environment {
 public:
  std::string name() const override { return "counting"; }
  StatusOr<std::unique_ptr<rollout::EnvSession>> Open() override {
    return std::unique_ptr<rollout::EnvSession>(std::make_unique<Session>(this));
  }
  std::atomic<int> live{0};
  std::atomic<int64_t> last_step_budget_ms{-1};

 private:
  class Session final : public rollout::EnvSession {
   public:
    explicit Session(CountingEnvironment* env) : env_(env) { ++env_->live; }
    ~Session() override { --env_->live; }
    StatusOr<rollout::EnvObservation> Reset(const json&, uint64_t, Clock::time_point) override {
      return rollout::EnvObservation{};
    }
    StatusOr<rollout::EnvObservation> Step(const std::string& action,
                                           Clock::time_point deadline) override {
      env_->last_step_budget_ms =
          std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      rollout::EnvObservation obs;
      obs.messages.push_back({"tool", "echo: " + action});
      return obs;
    }

   private:
    CountingEnvironment* const env_;
  };
};

TEST_F(EnvironmentGrpcTest, TheServersSessionLivesAsLongAsTheStream) {
  auto counting = std::make_unique<CountingEnvironment>();
  CountingEnvironment* env_state = counting.get();
  auto server = EnvironmentServer::Start("127.0.0.1:0", std::move(counting));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto env = Connect(Address((*server)->port()));
  auto a = OpenSession(*env);
  auto b = OpenSession(*env);
  ASSERT_TRUE(a->Reset(json::object(), 1, Within()).ok());
  ASSERT_TRUE(b->Reset(json::object(), 2, Within()).ok());
  EXPECT_EQ(env_state->live.load(), 2);
  // The step's deadline travels: the server's session gets what is left of the client's 10 s.
  auto obs = a->Step("hi", Clock::now() + seconds(10));
  ASSERT_TRUE(obs.ok()) << obs.status().ToString();
  EXPECT_EQ(OnlyMessage(*obs), "echo: hi");
  EXPECT_EQ(obs->messages[0].role, "tool");
  EXPECT_GT(env_state->last_step_budget_ms.load(), 5000);
  EXPECT_LE(env_state->last_step_budget_ms.load(), 10000);
  // Closing a session ends its stream: the server frees that episode, and only that one.
  a.reset();
  EXPECT_TRUE(grpo::testing::WaitUntil([&] { return env_state->live.load() == 1; }, seconds(10)));
  b.reset();
  EXPECT_TRUE(grpo::testing::WaitUntil([&] { return env_state->live.load() == 0; }, seconds(10)));
}

TEST_F(EnvironmentGrpcTest, ServerKilledMidEpisodeIsUnavailable) {
  const std::string address = StartGuessNumberServer();
  ASSERT_FALSE(address.empty());
  auto env = Connect(address);
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 0, Within()).ok());
  ASSERT_TRUE(session->Step("50", Within()).ok());
  children_->Kill("env");
  const auto t0 = Clock::now();
  auto obs = session->Step("25", Within());
  ASSERT_FALSE(obs.ok());
  EXPECT_EQ(obs.status().code(), StatusCode::kUnavailable) << obs.status().ToString();
  EXPECT_EQ(rollout::EnvErrorKind(obs.status()), "unavailable");
  EXPECT_LT(SecondsSince(t0), 10.0);
  const auto t1 = Clock::now();
  session.reset();
  EXPECT_LT(SecondsSince(t1), 3.0);
  // A new episode on the dead address: Unavailable at its reset.
  auto again = OpenSession(*env);
  auto reset = again->Reset(json::object(), 0, Within());
  EXPECT_EQ(reset.status().code(), StatusCode::kUnavailable) << reset.status().ToString();
}

TEST_F(EnvironmentGrpcTest, SessionDestructorDoesNotHangOnAStoppedServer) {
  const std::string address = StartGuessNumberServer();
  ASSERT_FALSE(address.empty());
  GrpcEnvironmentOptions options;
  options.close_timeout = milliseconds(500);
  auto env = Connect(address, options);
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 0, Within()).ok());
  auto healthy = OpenSession(*env);  // an episode whose stream is healthy when the server stops
  ASSERT_TRUE(healthy->Reset(json::object(), 2, Within()).ok());
  ASSERT_TRUE(StopEnvServer());  // alive, connected, never answers
  auto obs = session->Step("50", Clock::now() + milliseconds(500));
  EXPECT_EQ(obs.status().code(), StatusCode::kDeadlineExceeded) << obs.status().ToString();
  auto idle = OpenSession(*env);  // a second episode, reset but never stepped
  auto t0 = Clock::now();
  session.reset();
  EXPECT_LT(SecondsSince(t0), 3.0);
  // Its reset cannot be answered either; the destructor then waits close_timeout at most.
  EXPECT_EQ(idle->Reset(json::object(), 1, Clock::now() + milliseconds(300)).status().code(),
            StatusCode::kDeadlineExceeded);
  t0 = Clock::now();
  idle.reset();
  EXPECT_LT(SecondsSince(t0), 3.0);
  // Ending a healthy stream waits for the server's status close_timeout (0.5 s) at most.
  t0 = Clock::now();
  healthy.reset();
  EXPECT_LT(SecondsSince(t0), 3.0);
  children_->Signal("env", SIGCONT);
}

TEST_F(EnvironmentGrpcTest, OnlyTheRightTokenOpensAnEpisode) {
  const fs::path right = WriteFile("right_token", "env-s3cret\n");
  const fs::path wrong = WriteFile("wrong_token", "guess\n");
  const std::string address = StartGuessNumberServer({"--auth_token_file", right.string()});
  ASSERT_FALSE(address.empty());
  for (const std::string& token_file : {wrong.string(), std::string()}) {
    GrpcEnvironmentOptions options;
    options.auth_token_file = token_file;
    auto env = Connect(address, options);
    auto session = OpenSession(*env);
    auto reset = session->Reset(json::object(), 0, Within());
    ASSERT_FALSE(reset.ok()) << "token file '" << token_file << "'";
    EXPECT_EQ(reset.status().code(), StatusCode::kUnauthenticated) << reset.status().ToString();
    EXPECT_EQ(rollout::EnvErrorKind(reset.status()), "error");
  }
  GrpcEnvironmentOptions options;
  options.auth_token_file = right.string();
  auto env = Connect(address, options);
  auto session = OpenSession(*env);
  ASSERT_TRUE(session->Reset(json::object(), 0, Within()).ok());
  auto obs = session->Step("1", Within());  // secret 1 + 0 % 100 = 1
  ASSERT_TRUE(obs.ok()) << obs.status().ToString();
  EXPECT_EQ(OnlyMessage(*obs), "correct");
}

TEST_F(EnvironmentGrpcTest, NothingListeningIsUnavailableAtReset) {
  int port;
  {
    auto server = EnvironmentServer::Start("127.0.0.1:0", std::make_unique<CountingEnvironment>());
    ASSERT_TRUE(server.ok());
    port = (*server)->port();
  }  // shut down: nothing listens there now
  auto env = Connect(Address(port));
  auto session = OpenSession(*env);
  const auto t0 = Clock::now();
  auto reset = session->Reset(json::object(), 0, Within());
  EXPECT_EQ(reset.status().code(), StatusCode::kUnavailable) << reset.status().ToString();
  EXPECT_LT(SecondsSince(t0), 10.0);
  EXPECT_FALSE(MakeGrpcEnvironment("no-port").ok());
  GrpcEnvironmentOptions missing_token;
  missing_token.auth_token_file = (dir_ / "none").string();
  EXPECT_EQ(MakeGrpcEnvironment("127.0.0.1:1", missing_token).status().code(),
            StatusCode::kNotFound);
}

// examples/calculator_env.py, run by the venv's Python as a user runs it.
TEST_F(EnvironmentGrpcTest, PythonCalculatorAnswersToolCallsAndRewardsTheRowsAnswer) {
  children_->Spawn("calculator",
                   {ReferencePython(), SourceDir() + "/examples/calculator_env.py", "--port", "0"});
  const json line = FirstLineOrExit("calculator");
  ASSERT_TRUE(line.is_object() && line.contains("port"))
      << "calculator_env.py did not start (does the venv's grpo_serve have serve_environment? "
         "deploy/setup.sh reinstalls it):\n"
      << Tail(children_->Err("calculator"));
  auto env = Connect(Address(line["port"].get<int>()));
  const auto tool_call = [](const std::string& expression) {
    return "I will compute it.\n<tool_call>{\"name\": \"calculator\", \"arguments\": "
           "{\"expression\": \"" +
           expression + "\"}}</tool_call>";
  };

  auto session = OpenSession(*env);
  auto reset = session->Reset({{"prompt", "What is (7-2)*3/4?"}, {"answer", "3.75"}}, 0, Within());
  ASSERT_TRUE(reset.ok()) << reset.status().ToString();
  EXPECT_TRUE(reset->messages.empty());
  EXPECT_FALSE(reset->reward.has_value());
  EXPECT_FALSE(reset->done);
  auto tool = session->Step(tool_call("(7-2)*3/4"), Within());
  ASSERT_TRUE(tool.ok()) << tool.status().ToString();
  ASSERT_EQ(tool->messages.size(), 1u);
  EXPECT_EQ(tool->messages[0].role, "tool");
  EXPECT_EQ(tool->messages[0].content, "3.75");  // 5 * 3 / 4
  EXPECT_FALSE(tool->reward.has_value());
  EXPECT_FALSE(tool->done);
  auto more = session->Step(tool_call("2+3*4"), Within());
  ASSERT_TRUE(more.ok()) << more.status().ToString();
  EXPECT_EQ(OnlyMessage(*more), "14");
  // Code is not arithmetic: an error message for the model, nothing run, the episode goes on.
  auto code = session->Step(tool_call("__import__('os').getpid()"), Within());
  ASSERT_TRUE(code.ok()) << code.status().ToString();
  EXPECT_EQ(OnlyMessage(*code).rfind("error:", 0), 0u) << OnlyMessage(*code);
  EXPECT_FALSE(code->done);
  auto answer = session->Step("So the answer is 3.75.", Within());
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  EXPECT_TRUE(answer->messages.empty());
  EXPECT_EQ(answer->reward, 1.0);
  EXPECT_TRUE(answer->done);

  auto wrong = OpenSession(*env);
  ASSERT_TRUE(wrong->Reset({{"answer", "42"}}, 1, Within()).ok());
  auto final_answer = wrong->Step("It is 41.", Within());
  ASSERT_TRUE(final_answer.ok()) << final_answer.status().ToString();
  EXPECT_EQ(final_answer->reward, 0.0);
  EXPECT_TRUE(final_answer->done);
}

}  // namespace
}  // namespace grpo::services
