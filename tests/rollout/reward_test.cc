#include "rollout/reward.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <stdexcept>
#include <thread>

#include "tests/test_util.h"

namespace grpo::rollout {
namespace {

using nlohmann::json;
using Scores = std::vector<std::optional<double>>;

std::unique_ptr<RewardFunction> Make(const std::string& name,
                                     const json& options = json::object()) {
  auto fn = MakeRewardFunction(name, options);
  EXPECT_TRUE(fn.ok()) << fn.status().ToString();
  return std::move(fn).value();
}

RewardInput Input(std::string completion, json row = json::object(), int64_t tokens = 0) {
  RewardInput in;
  in.prompt = "prompt";
  in.completion = std::move(completion);
  in.completion_tokens = tokens;
  in.row = std::move(row);
  return in;
}

// --- Answer extraction and comparison.

TEST(ExtractFinalAnswer, BoxedWithNestedBracesWins) {
  EXPECT_EQ(ExtractFinalAnswer("so \\boxed{\\frac{1}{2}} and 7"), "\\frac{1}{2}");
  EXPECT_EQ(ExtractFinalAnswer("\\boxed{a{b}c}"), "a{b}c");
  EXPECT_EQ(ExtractFinalAnswer("\\boxed{1} then \\boxed{ 2 }"), "2");
  // An unbalanced last \boxed falls back to the previous one.
  EXPECT_EQ(ExtractFinalAnswer("\\boxed{1} then \\boxed{2"), "1");
  EXPECT_EQ(ExtractFinalAnswer("#### 5 but \\boxed{6}"), "6");
}

TEST(ExtractFinalAnswer, HashesThenLastNumber) {
  EXPECT_EQ(ExtractFinalAnswer("work...\n#### 1,000"), "1,000");
  EXPECT_EQ(ExtractFinalAnswer("#### 42\nthen 7 more"), "42");
  EXPECT_EQ(ExtractFinalAnswer("It is 3.5, no, 7."), "7");
  EXPECT_EQ(ExtractFinalAnswer("a total of 1,234,567 apples"), "1,234,567");
  EXPECT_EQ(ExtractFinalAnswer("lost -12 points"), "-12");
  EXPECT_EQ(ExtractFinalAnswer("half is 1/2"), "1/2");
  EXPECT_EQ(ExtractFinalAnswer("no numbers here"), std::nullopt);
  EXPECT_EQ(ExtractFinalAnswer(""), std::nullopt);
}

TEST(ParseNumber, CommonWritings) {
  EXPECT_EQ(ParseNumber("1,000"), 1000.0);
  EXPECT_EQ(ParseNumber("0.50"), 0.5);
  EXPECT_EQ(ParseNumber("$3"), 3.0);
  EXPECT_EQ(ParseNumber("\\$1{,}000"), 1000.0);
  EXPECT_EQ(ParseNumber("42."), 42.0);
  EXPECT_EQ(ParseNumber(" -7 "), -7.0);
  EXPECT_EQ(ParseNumber("+2.5"), 2.5);
  EXPECT_EQ(ParseNumber("1/2"), 0.5);
  EXPECT_EQ(ParseNumber("\\frac{1}{2}"), 0.5);
  EXPECT_EQ(ParseNumber("-\\dfrac{3}{4}"), -0.75);
  EXPECT_EQ(ParseNumber("$\\frac{3}{4}$"), 0.75);
}

TEST(ParseNumber, RejectsNonNumbers) {
  EXPECT_EQ(ParseNumber("abc"), std::nullopt);
  EXPECT_EQ(ParseNumber("1,2"), std::nullopt);
  EXPECT_EQ(ParseNumber("inf"), std::nullopt);
  EXPECT_EQ(ParseNumber("nan"), std::nullopt);
  EXPECT_EQ(ParseNumber("1/0"), std::nullopt);
  EXPECT_EQ(ParseNumber("12 apples"), std::nullopt);
  EXPECT_EQ(ParseNumber(""), std::nullopt);
}

TEST(AnswersMatch, NumbersCompareAsNumbers) {
  EXPECT_TRUE(AnswersMatch("1,000", "1000"));
  EXPECT_TRUE(AnswersMatch("0.50", "0.5"));
  EXPECT_TRUE(AnswersMatch("1/2", "0.5"));
  EXPECT_TRUE(AnswersMatch("3.0000001", "3"));  // 3.3e-8 relative
  EXPECT_FALSE(AnswersMatch("3.0001", "3"));    // 3.3e-5 relative
  EXPECT_TRUE(AnswersMatch("0", "-0"));
  EXPECT_FALSE(AnswersMatch("10", "1"));
}

TEST(AnswersMatch, OtherwiseNormalisedStrings) {
  EXPECT_TRUE(AnswersMatch("Paris.", "paris"));
  EXPECT_TRUE(AnswersMatch("\\text{ New   York }", "new york"));
  EXPECT_TRUE(AnswersMatch("$x^2$", "x^2"));
  EXPECT_FALSE(AnswersMatch("London", "Paris"));
  EXPECT_FALSE(AnswersMatch("", ""));
}

// --- Built-ins.

TEST(AccuracyReward, ScoresAgainstRowAnswer) {
  auto fn = Make("accuracy");
  EXPECT_EQ(fn->name(), "accuracy");
  const Scores s = fn->Score({
      Input("so \\boxed{42}", {{"answer", "42"}}),
      Input("The answer is 41", {{"answer", 42}}),
      Input("#### 1,000", {{"answer", "1000"}}),
      Input("\\boxed{\\frac{1}{2}}", {{"answer", 0.5}}),
      Input("no idea", {{"answer", "5"}}),
      Input("so 72 clips.", {{"answer", "Natalia sold 48/2 = 24 clips in May.\n#### 72"}}),
      Input("\\boxed{Paris}", {{"answer", "paris"}}),
      Input("42", {{"question", "q"}}),
      Input("42", {{"answer", nullptr}}),
      Input("42", nullptr),
  });
  const Scores expected = {1.0, 0.0, 1.0,          1.0,          0.0,
                           1.0, 1.0, std::nullopt, std::nullopt, std::nullopt};
  EXPECT_EQ(s, expected);
}

TEST(FormatReward, DefaultPatternIsThinkThenAnswer) {
  auto fn = Make("format");
  const Scores s = fn->Score({
      Input("<think>a\nb</think>\n<answer>42</answer>"),
      Input("<think>x</think><answer>y</answer>\n"),  // $ also matches before a final newline
      Input("<think>héllo</think> <answer>é</answer>"),
      Input("<answer>42</answer>"),
      Input("<think>x</think><answer>y</answer> trailing"),
      Input("intro <think>x</think><answer>y</answer>"),
      Input(""),
  });
  const Scores expected = {1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0};
  EXPECT_EQ(s, expected);
}

TEST(FormatReward, CustomPattern) {
  auto fn = Make("format", {{"pattern", "^\\d+$"}});
  EXPECT_EQ(fn->Score({Input("123"), Input("12a")}), (Scores{1.0, 0.0}));
}

TEST(FormatReward, InvalidPatternNamesTheOption) {
  auto fn = MakeRewardFunction("format", {{"pattern", "(unclosed"}});
  ASSERT_FALSE(fn.ok());
  EXPECT_EQ(fn.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(fn.status().message().find("\"pattern\""), std::string::npos) << fn.status().message();
  EXPECT_FALSE(MakeRewardFunction("format", {{"pattern", 3}}).ok());
}

TEST(LengthReward, NegativeDistanceToTargetInTokens) {
  auto fn = Make("length");  // target 20 tokens
  const Scores s = fn->Score({Input("x", {}, 20), Input("x", {}, 25), Input("x", {}, 3)});
  EXPECT_EQ(s, (Scores{0.0, -5.0, -17.0}));
}

TEST(LengthReward, CharsCountCodePoints) {
  auto fn = Make("length", {{"target_length", 5}, {"unit", "chars"}});
  // "héllo" is 5 code points (6 bytes).
  EXPECT_EQ(fn->Score({Input("héllo", {}, 99), Input("hi", {}, 99)}), (Scores{0.0, -3.0}));
}

TEST(LengthReward, BadOptionsAreNamed) {
  auto a = MakeRewardFunction("length", {{"target_length", -1}});
  EXPECT_NE(a.status().message().find("target_length"), std::string::npos);
  auto b = MakeRewardFunction("length", {{"unit", "words"}});
  EXPECT_NE(b.status().message().find("unit"), std::string::npos);
  auto c = MakeRewardFunction("length", {{"foo", 1}});
  EXPECT_NE(c.status().message().find("\"foo\""), std::string::npos);
  EXPECT_NE(c.status().message().find("target_length"), std::string::npos);
}

TEST(JsonValidReward, OneIfTheWholeCompletionParses) {
  auto fn = Make("json_valid");
  const Scores s =
      fn->Score({Input("{\"a\": [1, 2]}"), Input(" [1, 2] "), Input("42"), Input("{'a': 1}"),
                 Input(""), Input("```json\n{}\n```"), Input("{\"a\": 1} extra")});
  EXPECT_EQ(s, (Scores{1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0}));
}

common::RolloutGroup Group(const std::vector<std::pair<std::string, int>>& completions);

// DAPO eq. 13 by hand: L_max 20, L_cache 5: 0 up to 15 tokens, then (15 - L) / 5, -1 past 20.
TEST(SoftOverlongPunishment, ZeroThenLinearThenMinusOne) {
  auto fn =
      Make("soft_overlong_punishment", {{"max_completion_len", 20}, {"soft_punish_cache", 5}});
  const Scores s = fn->Score({Input("x", {}, 0), Input("x", {}, 15), Input("x", {}, 16),
                              Input("x", {}, 18), Input("x", {}, 20), Input("x", {}, 21)});
  EXPECT_EQ(s, (Scores{0.0, 0.0, -0.2, -0.6, -1.0, -1.0}));
}

// TRL's own get_soft_overlong_punishment on every length around the window, for a cache of 0,
// one token, DAPO's fifth (the default) and the whole length.
TEST(SoftOverlongPunishment, EqualsTrls) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("trl"))
      << grpo::testing::ReferencePython() << " cannot import trl (deploy/setup.sh)";
  json request = {{"soft_overlong_punishment", json::array()}};
  std::vector<std::vector<double>> ours;
  std::vector<int64_t> lengths;
  for (int64_t n = 0; n <= 40; ++n) lengths.push_back(n);
  for (int64_t cache : {0, 1, 6, 32}) {
    auto fn = Make("soft_overlong_punishment",
                   cache == 6 ? json{{"max_completion_len", 32}}  // the default cache: 32 / 5
                              : json{{"max_completion_len", 32}, {"soft_punish_cache", cache}});
    std::vector<RewardInput> inputs;
    for (int64_t n : lengths) inputs.push_back(Input("x", {}, n));
    std::vector<double> row;
    for (const auto& v : fn->Score(inputs)) row.push_back(*v);
    ours.push_back(row);
    request["soft_overlong_punishment"].push_back(
        {{"max_completion_len", 32}, {"soft_punish_cache", cache}, {"lengths", lengths}});
  }
  const json trl = grpo::testing::RunReference("trl_rewards_ref.py", request);
  ASSERT_TRUE(trl.is_object());
  for (size_t c = 0; c < ours.size(); ++c) {
    const auto want = trl["soft_overlong_punishment"][c].get<std::vector<double>>();
    ASSERT_EQ(want.size(), ours[c].size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_DOUBLE_EQ(ours[c][i], want[i]) << "case " << c << " length " << lengths[i];
    }
  }
}

TEST(SoftOverlongPunishment, BadOptionsAreNamedAndTheConfigGivesTheLimit) {
  EXPECT_NE(MakeRewardFunction("soft_overlong_punishment", json::object())
                .status()
                .message()
                .find("max_completion_len"),
            std::string::npos);
  auto big = MakeRewardFunction("soft_overlong_punishment",
                                {{"max_completion_len", 8}, {"soft_punish_cache", 9}});
  EXPECT_NE(big.status().message().find("soft_punish_cache"), std::string::npos);
  auto typo =
      MakeRewardFunction("soft_overlong_punishment", {{"max_completion_len", 8}, {"cache", 2}});
  EXPECT_NE(typo.status().message().find("\"cache\""), std::string::npos);

  common::GrpoConfig config;
  config.reward_funcs = {"soft_overlong_punishment"};
  config.max_completion_length = 10;  // cache 10 / 5 = 2: 0 to 8 tokens, -0.5 at 9
  auto runner = RewardRunner::FromConfig(config);
  ASSERT_TRUE(runner.ok()) << runner.status().ToString();
  common::RolloutGroup g = Group({{"x", 8}, {"x", 9}, {"x", 11}});
  (void)(*runner)->ScoreGroup(g, "p", json::object());
  EXPECT_EQ(g.completions[0].rewards, (Scores{0.0}));
  EXPECT_EQ(g.completions[1].rewards, (Scores{-0.5}));
  EXPECT_EQ(g.completions[2].rewards, (Scores{-1.0}));
}

TEST(MakeRewardFunction, UnknownNameListsKnownOnes) {
  auto fn = MakeRewardFunction("bleu");
  ASSERT_FALSE(fn.ok());
  EXPECT_EQ(fn.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(fn.status().message().find("\"bleu\""), std::string::npos);
  EXPECT_NE(fn.status().message().find("accuracy, env, format, json_valid, length"),
            std::string::npos)
      << fn.status().message();
  EXPECT_FALSE(MakeRewardFunction("accuracy", {{"x", 1}}).ok());
}

// --- RewardRunner.

class ThrowingReward final : public RewardFunction {
 public:
  std::string name() const override { return "throws"; }
  Scores Score(const std::vector<RewardInput>&) const override { throw std::runtime_error("boom"); }
};

class WrongSizeReward final : public RewardFunction {
 public:
  std::string name() const override { return "wrong_size"; }
  Scores Score(const std::vector<RewardInput>&) const override { return {1.0}; }
};

// Blocks until released (or 10 s), then scores 1.
class BlockingReward final : public RewardFunction {
 public:
  explicit BlockingReward(std::shared_future<void> release) : release_(std::move(release)) {}
  std::string name() const override { return "blocking"; }
  Scores Score(const std::vector<RewardInput>& in) const override {
    ++calls;
    release_.wait_for(std::chrono::seconds(10));
    return Scores(in.size(), 1.0);
  }
  mutable std::atomic<int> calls{0};

 private:
  std::shared_future<void> release_;
};

common::RolloutGroup Group(const std::vector<std::pair<std::string, int>>& completions) {
  common::RolloutGroup g;
  for (const auto& [text, tokens] : completions) {
    common::Completion c;
    c.text = text;
    c.token_ids.assign(tokens, 7);
    g.completions.push_back(std::move(c));
  }
  return g;
}

std::unique_ptr<RewardRunner> MakeRunner(
    std::vector<std::shared_ptr<const RewardFunction>> fns, std::vector<double> weights = {},
    std::chrono::milliseconds timeout = kDefaultRewardTimeout) {
  auto r = RewardRunner::Create(std::move(fns), std::move(weights), timeout);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

bool WaitFor(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST(RewardRunner, FillsPerFunctionScoresAndWeightedSum) {
  auto runner =
      MakeRunner({Make("length", {{"target_length", 3}}), Make("json_valid")}, {0.5, 2.0});
  common::RolloutGroup g = Group({{"{}", 3}, {"nope", 5}});
  const RewardCallReport report = runner->ScoreGroup(g, "p", json::object());
  EXPECT_EQ(report.errors + report.timeouts, 0);
  EXPECT_EQ(g.completions[0].rewards, (Scores{0.0, 1.0}));
  EXPECT_EQ(g.completions[1].rewards, (Scores{-2.0, 0.0}));
  EXPECT_DOUBLE_EQ(runner->WeightedReward(g.completions[0]), 2.0);   // 0.5*0 + 2*1
  EXPECT_DOUBLE_EQ(runner->WeightedReward(g.completions[1]), -1.0);  // 0.5*-2 + 2*0
  EXPECT_EQ(runner->names(), (std::vector<std::string>{"length", "json_valid"}));
}

TEST(RewardRunner, PassesPromptRowAndTokenCount) {
  auto runner = MakeRunner({Make("accuracy")});
  common::RolloutGroup g = Group({{"\\boxed{9}", 4}, {"8", 1}});
  (void)runner->ScoreGroup(g, "what is 4+5?", {{"answer", "9"}});
  EXPECT_EQ(g.completions[0].rewards, (Scores{1.0}));
  EXPECT_EQ(g.completions[1].rewards, (Scores{0.0}));
}

// A multi-turn episode: 3 model tokens, 4 environment tokens, 2 model tokens; its environment
// gave 1.5 in all. The length reward counts the 5 model tokens; `env` is the environment's sum.
TEST(RewardRunner, EpisodesCountModelTokensAndPassTheEnvironmentsReward) {
  auto runner = MakeRunner({Make("length", {{"target_length", 0}}), Make("env")});
  common::RolloutGroup g = Group({{"ab", 9}, {"cd", 2}});
  g.completions[0].env_mask = {1, 1, 1, 0, 0, 0, 0, 1, 1};
  (void)runner->ScoreGroup(g, "p", json::object(),
                           {EnvFeedback{1.5, json{{"k", 1}}}, EnvFeedback{std::nullopt, nullptr}});
  EXPECT_EQ(g.completions[0].rewards, (Scores{-5.0, 1.5}));
  EXPECT_EQ(g.completions[1].rewards, (Scores{-2.0, std::nullopt}));
  // Single-turn groups: no feedback, no env reward.
  common::RolloutGroup single = Group({{"x", 3}});
  (void)runner->ScoreGroup(single, "p", json::object());
  EXPECT_EQ(single.completions[0].rewards, (Scores{-3.0, std::nullopt}));
}

TEST(RewardRunner, NullRewardCountsAsZero) {
  auto runner = MakeRunner({Make("accuracy"), Make("json_valid")}, {3.0, 1.0});
  common::RolloutGroup g = Group({{"[]", 1}});
  (void)runner->ScoreGroup(g, "p", json::object());  // no answer: accuracy null
  EXPECT_EQ(g.completions[0].rewards, (Scores{std::nullopt, 1.0}));
  EXPECT_DOUBLE_EQ(runner->WeightedReward(g.completions[0]), 1.0);
}

TEST(RewardRunner, ThrowingFunctionGivesNullsAndCountsAnError) {
  auto runner = MakeRunner({std::make_shared<ThrowingReward>(), Make("json_valid")});
  common::RolloutGroup g = Group({{"{}", 1}, {"x", 1}});
  const RewardCallReport report = runner->ScoreGroup(g, "p", json::object());
  EXPECT_EQ(report.errors, 1);
  EXPECT_EQ(report.timeouts, 0);
  ASSERT_EQ(report.messages.size(), 1u);
  EXPECT_NE(report.messages[0].find("throws"), std::string::npos);
  EXPECT_NE(report.messages[0].find("boom"), std::string::npos);
  EXPECT_EQ(g.completions[0].rewards, (Scores{std::nullopt, 1.0}));
  EXPECT_EQ(g.completions[1].rewards, (Scores{std::nullopt, 0.0}));
  EXPECT_EQ(runner->total_errors(), 1);
}

TEST(RewardRunner, WrongNumberOfScoresIsAnError) {
  auto runner = MakeRunner({std::make_shared<WrongSizeReward>()});
  common::RolloutGroup g = Group({{"a", 1}, {"b", 1}});
  EXPECT_EQ(runner->ScoreGroup(g, "p", json::object()).errors, 1);
  EXPECT_EQ(g.completions[1].rewards, (Scores{std::nullopt}));
}

// Sleeps `ms` then scores 1: a function whose latency is known.
class SlowReward final : public RewardFunction {
 public:
  explicit SlowReward(int ms) : ms_(ms) {}
  std::string name() const override { return "slow"; }
  Scores Score(const std::vector<RewardInput>& in) const override {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    return Scores(in.size(), 1.0);
  }

 private:
  int ms_;
};

TEST(RewardRunner, ReportsEachFunctionsLatencyAndTheTimeoutForAMissedDeadline) {
  std::promise<void> release;
  auto blocking = std::make_shared<BlockingReward>(release.get_future().share());
  auto runner =
      MakeRunner({std::make_shared<SlowReward>(80), blocking}, {}, std::chrono::milliseconds(400));
  common::RolloutGroup g = Group({{"{}", 1}});
  const RewardCallReport report = runner->ScoreGroup(g, "p", json::object());
  ASSERT_EQ(report.seconds.size(), 2u);
  ASSERT_TRUE(report.seconds[0].has_value());
  EXPECT_GE(*report.seconds[0], 0.08);  // slept 80 ms
  EXPECT_LT(*report.seconds[0], 0.4);   // and was not charged the deadline
  ASSERT_TRUE(report.seconds[1].has_value());
  EXPECT_DOUBLE_EQ(*report.seconds[1], 0.4);  // missed it: the timeout
  release.set_value();
  EXPECT_TRUE(WaitFor([&] { return runner->abandoned_in_flight() == 0; }));
}

TEST(RewardRunner, TimeoutGivesNullsWithoutWaitingForTheFunction) {
  std::promise<void> release;
  auto blocking = std::make_shared<BlockingReward>(release.get_future().share());
  auto runner = MakeRunner({blocking, Make("json_valid")}, {}, std::chrono::milliseconds(300));
  common::RolloutGroup g = Group({{"{}", 1}});
  const auto start = std::chrono::steady_clock::now();
  const RewardCallReport report = runner->ScoreGroup(g, "p", json::object());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(report.timeouts, 1);
  EXPECT_EQ(report.errors, 0);
  EXPECT_EQ(g.completions[0].rewards, (Scores{std::nullopt, 1.0}));
  EXPECT_EQ(runner->total_timeouts(), 1);
  EXPECT_EQ(runner->abandoned_in_flight(), 1);
  release.set_value();
  EXPECT_TRUE(WaitFor([&] { return runner->abandoned_in_flight() == 0; }));
}

// Throws a RewardError of the given kind: a function that says how it failed (as a remote
// function whose RPC missed its deadline does).
class KindedErrorReward final : public RewardFunction {
 public:
  explicit KindedErrorReward(RewardErrorKind kind) : kind_(kind) {}
  std::string name() const override { return "kinded"; }
  Scores Score(const std::vector<RewardInput>&) const override {
    throw RewardError(kind_, "deadline of its own");
  }

 private:
  RewardErrorKind kind_;
};

TEST(RewardRunner, EachFailedFunctionCarriesItsErrorKindInOrder) {
  std::promise<void> release;
  auto blocking = std::make_shared<BlockingReward>(release.get_future().share());
  // 0 ok, 1 throws runtime_error, 2 misses the deadline, 3 RewardError(kTimeout),
  // 4 wrong number of scores, 5 RewardError(kError).
  auto runner = MakeRunner({Make("json_valid"), std::make_shared<ThrowingReward>(), blocking,
                            std::make_shared<KindedErrorReward>(RewardErrorKind::kTimeout),
                            std::make_shared<WrongSizeReward>(),
                            std::make_shared<KindedErrorReward>(RewardErrorKind::kError)},
                           {}, std::chrono::milliseconds(300));
  common::RolloutGroup g = Group({{"{}", 1}, {"x", 1}});
  const RewardCallReport report = runner->ScoreGroup(g, "p", json::object());
  using K = RewardErrorKind;
  const std::vector<std::optional<K>> want = {std::nullopt, K::kError, K::kTimeout,
                                              K::kTimeout,  K::kError, K::kError};
  EXPECT_EQ(report.error_kinds, want);
  EXPECT_EQ(report.errors, 3);
  EXPECT_EQ(report.timeouts, 2);
  EXPECT_EQ(report.messages.size(), 5u);
  EXPECT_EQ(runner->total_errors(), 3);
  EXPECT_EQ(runner->total_timeouts(), 2);
  EXPECT_EQ(g.completions[0].rewards,
            (Scores{1.0, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt}));
  EXPECT_EQ(RewardErrorKindName(K::kError), "error");
  EXPECT_EQ(RewardErrorKindName(K::kTimeout), "timeout");
  release.set_value();
  EXPECT_TRUE(WaitFor([&] { return runner->abandoned_in_flight() == 0; }));
}

TEST(RewardRunner, StopsStartingAFunctionWithTooManyAbandonedCalls) {
  std::promise<void> release;
  auto blocking = std::make_shared<BlockingReward>(release.get_future().share());
  auto runner = MakeRunner({blocking}, {}, std::chrono::milliseconds(20));
  for (int i = 0; i < kMaxAbandonedRewardCalls; ++i) {
    common::RolloutGroup g = Group({{"x", 1}});
    EXPECT_EQ(runner->ScoreGroup(g, "p", json::object()).timeouts, 1);
  }
  EXPECT_EQ(runner->abandoned_in_flight(), kMaxAbandonedRewardCalls);
  common::RolloutGroup g = Group({{"x", 1}});
  const RewardCallReport report = runner->ScoreGroup(g, "p", json::object());
  EXPECT_EQ(report.timeouts, 1);
  ASSERT_EQ(report.messages.size(), 1u);
  EXPECT_NE(report.messages[0].find("not started"), std::string::npos);
  EXPECT_TRUE(WaitFor([&] { return blocking->calls.load() == kMaxAbandonedRewardCalls; }));
  EXPECT_EQ(blocking->calls.load(), kMaxAbandonedRewardCalls);
  EXPECT_EQ(g.completions[0].rewards, (Scores{std::nullopt}));
  release.set_value();
  EXPECT_TRUE(WaitFor([&] { return runner->abandoned_in_flight() == 0; }));
  // Once they finish, the function runs again.
  common::RolloutGroup h = Group({{"x", 1}});
  EXPECT_EQ(runner->ScoreGroup(h, "p", json::object()).timeouts, 0);
  EXPECT_EQ(h.completions[0].rewards, (Scores{1.0}));
}

TEST(RewardRunner, CreateChecksWeights) {
  EXPECT_FALSE(RewardRunner::Create({Make("accuracy")}, {1.0, 2.0}).ok());
  EXPECT_FALSE(RewardRunner::Create({Make("accuracy")}, {NAN}).ok());
  EXPECT_FALSE(RewardRunner::Create({nullptr}).ok());
  EXPECT_FALSE(RewardRunner::Create({Make("accuracy")}, {}, std::chrono::milliseconds(0)).ok());
}

TEST(RewardRunner, FromConfigBuildsNamedFunctionsWithOptions) {
  common::GrpoConfig config;
  config.reward_funcs = {"accuracy", "length"};
  config.reward_weights = {1.0, 0.1};
  auto runner = RewardRunner::FromConfig(config, {{"length", {{"target_length", 2}}}});
  ASSERT_TRUE(runner.ok()) << runner.status().ToString();
  EXPECT_EQ((*runner)->names(), (std::vector<std::string>{"accuracy", "length"}));
  common::RolloutGroup g = Group({{"x", 5}});
  (void)(*runner)->ScoreGroup(g, "p", json::object());
  EXPECT_EQ(g.completions[0].rewards, (Scores{std::nullopt, -3.0}));

  config.reward_funcs = {"accuracy", "nope"};
  auto bad = RewardRunner::FromConfig(config);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("\"nope\""), std::string::npos);
}

}  // namespace
}  // namespace grpo::rollout
