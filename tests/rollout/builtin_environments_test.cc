// The built-in environments (rollout/env/builtin_environments.h) in process: guess_number's
// documented secret rule (low + seed % (high - low + 1)), its answers and its rewards, with the
// secrets worked out here by hand.
#include "rollout/env/builtin_environments.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

namespace grpo::rollout {
namespace {

using nlohmann::json;

std::chrono::steady_clock::time_point Soon() {
  return std::chrono::steady_clock::now() + std::chrono::seconds(5);
}

std::unique_ptr<Environment> GuessNumber() {
  auto env = MakeBuiltinEnvironment("guess_number");
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  return std::move(env).value();
}

// A session of guess_number reset with `row` and `seed`.
std::unique_ptr<EnvSession> Episode(Environment& env, const json& row, uint64_t seed) {
  auto session = env.Open();
  EXPECT_TRUE(session.ok()) << session.status().ToString();
  auto reset = (*session)->Reset(row, seed, Soon());
  EXPECT_TRUE(reset.ok()) << reset.status().ToString();
  if (reset.ok()) {
    EXPECT_TRUE(reset->messages.empty());
    EXPECT_FALSE(reset->done);
  }
  return std::move(session).value();
}

// The one message of a step's observation ("" when there is not exactly one).
std::string Say(EnvSession& session, const std::string& action) {
  auto obs = session.Step(action, Soon());
  EXPECT_TRUE(obs.ok()) << obs.status().ToString();
  if (!obs.ok() || obs->messages.size() != 1) return "";
  EXPECT_EQ(obs->messages[0].role, "user");
  return obs->messages[0].content;
}

TEST(BuiltinEnvironments, UnknownNameIsInvalidArgumentListingTheKnownNames) {
  auto env = MakeBuiltinEnvironment("chess");
  ASSERT_FALSE(env.ok());
  EXPECT_EQ(env.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(env.status().message().find("chess"), std::string::npos);
  EXPECT_NE(env.status().message().find("guess_number"), std::string::npos);
  EXPECT_EQ(BuiltinEnvironmentNames(), (std::vector<std::string>{"guess_number", "turns"}));
  EXPECT_EQ(GuessNumber()->name(), "guess_number");
}

// The demo task: three turns by default, each stepped turn worth 1/3, "ok" until the last.
TEST(TurnsTask, AnswersOkAndEndsAfterTheRowsTurnsEachWorthItsShare) {
  auto env = MakeBuiltinEnvironment("turns");
  ASSERT_TRUE(env.ok());
  auto session = (*env)->Open().value();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  ASSERT_TRUE(session->Reset(nlohmann::json::object(), 1, deadline).ok());
  for (int turn = 1; turn <= 3; ++turn) {
    auto obs = session->Step("anything", deadline);
    ASSERT_TRUE(obs.ok());
    EXPECT_DOUBLE_EQ(obs->reward.value(), 1.0 / 3.0);
    EXPECT_EQ(obs->done, turn == 3);
    if (turn < 3) {
      ASSERT_EQ(obs->messages.size(), 1u);
      EXPECT_EQ(obs->messages[0].role, "user");
      EXPECT_EQ(obs->messages[0].content, "ok");
    }
  }
  auto two = (*env)->Open().value();
  ASSERT_TRUE(two->Reset({{"turns", 2}}, 1, deadline).ok());
  EXPECT_DOUBLE_EQ(two->Step("a", deadline)->reward.value(), 0.5);
  EXPECT_TRUE(two->Step("b", deadline)->done);
  EXPECT_FALSE((*env)->Open().value()->Reset({{"turns", 0}}, 1, deadline).ok());
}

TEST(GuessNumber, TheSecretIsOnePlusSeedModuloHundredByDefault) {
  auto env = GuessNumber();
  // 1 + seed % 100, by hand.
  for (const auto& [seed, secret] :
       std::vector<std::pair<uint64_t, int>>{{0, 1}, {99, 100}, {100, 1}, {12345, 46}}) {
    auto s = Episode(*env, json::object(), seed);
    EXPECT_EQ(Say(*s, std::to_string(secret - 1)), "higher") << "seed " << seed;
    EXPECT_EQ(Say(*s, std::to_string(secret + 1)), "lower") << "seed " << seed;
    auto obs = s->Step(std::to_string(secret), Soon());
    ASSERT_TRUE(obs.ok());
    ASSERT_EQ(obs->messages.size(), 1u);
    EXPECT_EQ(obs->messages[0].content, "correct") << "seed " << seed;
    EXPECT_EQ(obs->reward, 1.0);
    EXPECT_TRUE(obs->done);
    EXPECT_EQ(obs->metadata, (json{{"guesses", 3}}));
  }
}

TEST(GuessNumber, TheRowsLowAndHighBoundTheSecretAndNegativeGuessesParse) {
  auto env = GuessNumber();
  // -5 + 3 % 11 = -2.
  auto s = Episode(*env, {{"low", -5}, {"high", 5}}, 3);
  EXPECT_EQ(Say(*s, "maybe -3?"), "higher");
  EXPECT_EQ(Say(*s, "between 0 and 9, I say -1"), "lower");  // the last integer counts
  EXPECT_EQ(Say(*s, "-2"), "correct");
  // 1000 + 7 % 11 = 1007.
  auto t = Episode(*env, {{"low", 1000}, {"high", 1010}}, 7);
  EXPECT_EQ(Say(*t, "1007"), "correct");
}

TEST(GuessNumber, TextWithoutANumberAsksForOneAndEarnsNothing) {
  auto env = GuessNumber();
  auto s = Episode(*env, json::object(), 5);
  auto obs = s->Step("I have no idea.", Soon());
  ASSERT_TRUE(obs.ok());
  ASSERT_EQ(obs->messages.size(), 1u);
  EXPECT_EQ(obs->messages[0].content, "say a number");
  EXPECT_EQ(obs->reward, 0.0);
  EXPECT_FALSE(obs->done);
  EXPECT_EQ(obs->metadata, (json{{"guesses", 0}}));
}

TEST(GuessNumber, WrongGuessesEarnZeroAndNeverEndTheEpisode) {
  auto env = GuessNumber();
  auto s = Episode(*env, json::object(), 49);  // secret 50
  for (int i = 0; i < 30; ++i) {
    auto obs = s->Step(i % 2 == 0 ? "10" : "90", Soon());
    ASSERT_TRUE(obs.ok());
    EXPECT_EQ(obs->reward, 0.0);
    EXPECT_FALSE(obs->done);
    EXPECT_FALSE(obs->truncated);
  }
  // Beyond int64: above every secret.
  EXPECT_EQ(Say(*s, "123456789012345678901234567890"), "lower");
  EXPECT_EQ(Say(*s, "-123456789012345678901234567890"), "higher");
}

TEST(GuessNumber, BadBoundsInTheRowAreInvalidArgument) {
  auto env = GuessNumber();
  for (const json& row : {json{{"low", "one"}}, json{{"low", 10}, {"high", 9}}, json{{"high", 2.5}},
                          json::array({1, 2})}) {
    auto s = env->Open();
    ASSERT_TRUE(s.ok());
    auto obs = (*s)->Reset(row, 0, Soon());
    ASSERT_FALSE(obs.ok()) << row.dump();
    EXPECT_EQ(obs.status().code(), StatusCode::kInvalidArgument) << row.dump();
  }
}

}  // namespace
}  // namespace grpo::rollout
