// RemoteRewardFunction against RewardServer (reward.proto): the same scores as in-process, and
// failures that RewardRunner turns into nulls and counted errors.
#include "services/remote_reward.h"

#include <gtest/gtest.h>

#include <chrono>
#include <fstream>

#include "services/reward_server.h"

namespace grpo::services {
namespace {

using nlohmann::json;
using Scores = std::vector<std::optional<double>>;

std::shared_ptr<const rollout::RewardFunction> Builtin(const std::string& name,
                                                       const json& options = json::object()) {
  auto fn = rollout::MakeRewardFunction(name, options);
  EXPECT_TRUE(fn.ok()) << fn.status().ToString();
  return std::move(fn).value();
}

std::unique_ptr<RewardServer> StartServer(
    std::map<std::string, std::shared_ptr<const rollout::RewardFunction>> fns,
    std::string token = "") {
  auto s = RewardServer::Start("127.0.0.1:0", std::move(fns), std::move(token));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return std::move(s).value();
}

std::string Spec(const std::string& name, int port) {
  return "remote:" + name + "@127.0.0.1:" + std::to_string(port);
}

rollout::RewardInput Input(std::string prompt, std::string completion, int64_t tokens, json row) {
  rollout::RewardInput in;
  in.prompt = std::move(prompt);
  in.completion = std::move(completion);
  in.completion_tokens = tokens;
  in.row = std::move(row);
  return in;
}

std::vector<rollout::RewardInput> Inputs() {
  return {Input("What is 6 x 7?", "It is \\boxed{42}.", 7, json{{"answer", "42"}}),
          Input("What is 6 x 7?", "Maybe 41", 3, json{{"answer", "42"}}),
          Input("What is 6 x 7?", "no idea", 2, json{{"answer", "42"}}),
          Input("Hi", "{\"a\": 1}", 12, json::object())};
}

TEST(RemoteRewardFunction, GivesTheSameScoresAsTheInProcessFunction) {
  const json length_options = {{"target_length", 5}};
  auto server = StartServer({{"length", Builtin("length", length_options)},
                             {"accuracy", Builtin("accuracy")},
                             {"json_valid", Builtin("json_valid")}});
  for (const std::string name : {"length", "accuracy", "json_valid"}) {
    auto remote = RemoteRewardFunction::Create(Spec(name, server->port()));
    ASSERT_TRUE(remote.ok()) << remote.status().ToString();
    EXPECT_EQ((*remote)->name(), Spec(name, server->port()));
    const auto local = Builtin(name, name == "length" ? length_options : json::object());
    EXPECT_EQ((*remote)->Score(Inputs()), local->Score(Inputs())) << name;
  }
  // accuracy is null for the row without an answer: nulls travel as absent values.
  auto remote = RemoteRewardFunction::Create(Spec("accuracy", server->port()));
  const Scores scores = (*remote)->Score(Inputs());
  EXPECT_EQ(scores, (Scores{1.0, 0.0, 0.0, std::nullopt}));
}

TEST(RemoteRewardFunction, MixesWithBuiltinsInTheWorkersRewardRunner) {
  auto server = StartServer({{"len", Builtin("length", {{"target_length", 2}})}});
  common::GrpoConfig config;
  config.reward_funcs = {"length", Spec("len", server->port())};
  config.reward_weights = {1.0, 0.5};
  auto runner = MakeRewardRunner(config, {{"length", {{"target_length", 4}}}});
  ASSERT_TRUE(runner.ok()) << runner.status().ToString();
  common::RolloutGroup group;
  for (int n : {1, 4, 6}) {
    common::Completion c;
    c.token_ids.assign(n, 65);
    c.text = std::string(n, 'A');
    group.completions.push_back(c);
  }
  const rollout::RewardCallReport report = (*runner)->ScoreGroup(group, "prompt", json::object());
  EXPECT_EQ(report.errors + report.timeouts, 0);
  for (const auto& c : group.completions) {
    const double n = static_cast<double>(c.token_ids.size());
    EXPECT_EQ(c.rewards, (Scores{-std::abs(4 - n), -std::abs(2 - n)}));
  }
}

TEST(RemoteRewardFunction, DeadServerGivesNullsAndACountedError) {
  int port;
  {
    auto server = StartServer({{"len", Builtin("length")}});
    port = server->port();
  }  // shut down: nothing listens there now
  auto remote = RemoteRewardFunction::Create(Spec("len", port), "", std::chrono::seconds(2));
  ASSERT_TRUE(remote.ok());
  EXPECT_THROW((*remote)->Score(Inputs()), std::runtime_error);

  auto runner =
      rollout::RewardRunner::Create({std::move(remote).value()}, {}, std::chrono::seconds(5));
  ASSERT_TRUE(runner.ok());
  common::RolloutGroup group;
  group.completions.resize(2);
  const auto t0 = std::chrono::steady_clock::now();
  const rollout::RewardCallReport report = (*runner)->ScoreGroup(group, "p", json::object());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 4.0);
  EXPECT_EQ(report.errors, 1);
  EXPECT_EQ(report.timeouts, 0);
  EXPECT_EQ((*runner)->total_errors(), 1);
  for (const auto& c : group.completions) EXPECT_EQ(c.rewards, (Scores{std::nullopt}));
}

TEST(RemoteRewardFunction, UnknownFunctionAndMissingTokenAreErrors) {
  auto server = StartServer({{"len", Builtin("length")}}, "s3cret");
  auto unknown = RemoteRewardFunction::Create(Spec("nope", server->port()), "s3cret");
  EXPECT_THROW((*unknown)->Score(Inputs()), std::runtime_error);
  auto no_token = RemoteRewardFunction::Create(Spec("len", server->port()));
  EXPECT_THROW((*no_token)->Score(Inputs()), std::runtime_error);
  auto ok = RemoteRewardFunction::Create(Spec("len", server->port()), "s3cret");
  EXPECT_EQ((*ok)->Score(Inputs()).size(), Inputs().size());
}

TEST(RemoteRewardSpec, ParsesNameAndAddress) {
  auto s = ParseRemoteRewardSpec("remote:judge@reward-svc:50061");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->name, "judge");
  EXPECT_EQ(s->address, "reward-svc:50061");
  for (const char* bad :
       {"judge@h:1", "remote:judge", "remote:@h:1", "remote:j@h", "remote:j@h:x", "remote:j@:1"}) {
    EXPECT_EQ(ParseRemoteRewardSpec(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
  common::GrpoConfig config;
  config.reward_funcs = {"remote:broken"};
  EXPECT_EQ(MakeRewardRunner(config).status().code(), StatusCode::kInvalidArgument);
}

TEST(RewardServer, NeedsAFunction) {
  EXPECT_EQ(RewardServer::Start("127.0.0.1:0", {}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::services
