// The rollout pipeline (rollout/produce.h) and the dataset row schema it builds prompts with
// (common/tokenizer/dataset_row.h). Expected ids, texts and rewards are written out by hand here:
// byte tokenizer ids are the bytes (specials 257 <|im_start|>, 258 <|im_end|>), the length reward
// is
// -|target - completion tokens|.
#include "rollout/produce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "common/tokenizer/dataset_row.h"

namespace grpo::rollout {
namespace {

using nlohmann::json;

std::vector<int32_t> Bytes(const std::string& s) {
  std::vector<int32_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

std::vector<int32_t> Concat(std::vector<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::shared_ptr<const common::Model> TinyModel(uint64_t seed) {
  auto config = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(config.ok());
  auto model = common::Model::InitRandom(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::shared_ptr<const common::Model>(std::move(model).value());
}

GeneratorOptions Options(int64_t max_prompt_length = 64, std::string truncate = "left") {
  GeneratorOptions o;
  o.num_generations = 3;
  o.max_prompt_length = max_prompt_length;
  o.max_completion_length = 5;
  o.truncate_prompt = std::move(truncate);
  o.seed = 9;
  return o;
}

// Records what it was given; scores 1.
class RecordingReward final : public RewardFunction {
 public:
  std::string name() const override { return "recording"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>& inputs) const override {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(inputs);
    return std::vector<std::optional<double>>(inputs.size(), 1.0);
  }
  mutable std::mutex mu;
  mutable std::vector<std::vector<RewardInput>> seen;
};

// --- The row schema: one definition for the ledger and the pipeline.

TEST(DatasetRow, PromptTextIsThePromptOrTheChatMlOfTheMessages) {
  EXPECT_EQ(common::PromptText(json::parse(R"({"prompt": "Say hi.", "answer": 3})")).value(),
            "Say hi.");
  EXPECT_EQ(common::PromptText(json::parse(
                                   R"({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi"}]})"))
                .value(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  // Both keys valid: "prompt" is used.
  EXPECT_EQ(common::PromptText(
                json::parse(R"({"prompt": "P", "messages": [{"role": "user", "content": "M"}]})"))
                .value(),
            "P");
}

// The ledger refused these at submit while the workers' copy took some of them (an empty
// prompt went on to the Generator; no messages gave a bare generation prompt; a bad "prompt"
// beside good messages used the messages). Now both refuse all of them.
TEST(DatasetRow, EmptyPromptsNoMessagesAndUnknownRolesAreInvalid) {
  const std::vector<std::string> bad = {
      R"({"prompt": ""})",
      R"({"messages": []})",
      R"({"prompt": 7, "messages": [{"role": "user", "content": "hi"}]})",
      R"({"prompt": "", "messages": [{"role": "user", "content": "hi"}]})",
      R"({"messages": [{"role": "narrator", "content": "hi"}]})",
      R"({"prompt": "ok", "messages": [{"role": "narrator", "content": "hi"}]})",
      R"({"messages": [{"role": "", "content": "hi"}]})",
      R"({"messages": [{"role": "user", "content": 3}]})",
      R"({"messages": ["user: hi"]})",
      R"({"answer": 1})",
      R"([])",
  };
  for (const std::string& row : bad) {
    EXPECT_EQ(common::PromptText(json::parse(row)).status().code(), StatusCode::kInvalidArgument)
        << row;
    EXPECT_EQ(common::ValidateDatasetRow(json::parse(row)).code(), StatusCode::kInvalidArgument)
        << row;
  }
  EXPECT_TRUE(common::ValidateDatasetRow(json::parse(R"({"prompt": "x"})")).ok());
}

TEST(DatasetRow, AnOwnBudgetIsAPositiveInteger) {
  EXPECT_EQ(common::RowCompletionBudget(json::parse(R"({"prompt": "x"})")).value(), 0);
  EXPECT_EQ(
      common::RowCompletionBudget(json::parse(R"({"prompt": "x", "max_completion_length": 7})"))
          .value(),
      7);
  for (const char* v : {"0", "-3", "2.5", "8.0", "\"8\"", "true", "null", "9223372036854775808",
                        "123456789012345678901234567890"}) {
    const json row =
        json::parse(std::string(R"({"prompt": "x", "max_completion_length": )") + v + "}");
    const Status s = common::ValidateDatasetRow(row);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << v;
    EXPECT_EQ(s.message(), "\"max_completion_length\" must be a positive integer") << v;
  }
}

// --- PreparePrompt.

TEST(PreparePrompt, RowToTextToIds) {
  common::ByteTokenizer tok;
  auto p = PreparePromptFromJson(R"({"prompt": "Say hi.", "answer": "4"})", tok);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->text, "Say hi.");
  EXPECT_EQ(p->ids, (std::vector<int32_t>{'S', 'a', 'y', ' ', 'h', 'i', '.'}));
  EXPECT_EQ(p->row["answer"], "4");

  auto m = PreparePrompt(json::parse(R"({"messages": [{"role": "user", "content": "Go"}]})"), tok);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->ids,
            Concat({{257}, Bytes("user\nGo"), {258}, Bytes("\n"), {257}, Bytes("assistant\n")}));

  EXPECT_EQ(PreparePromptFromJson("not json", tok).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PreparePromptFromJson(R"({"question": 1})", tok).status().code(),
            StatusCode::kInvalidArgument);
}

// --- Produce.

TEST(Produce, GroupsInInputOrderScoredWithTheirPromptTextAndRow) {
  common::ByteTokenizer tok;
  auto gen = Generator::Create(TinyModel(3), /*policy_version=*/5, Options(), &tok);
  ASSERT_TRUE(gen.ok()) << gen.status().ToString();
  auto recording = std::make_shared<RecordingReward>();
  auto length = MakeRewardFunction("length", {{"target_length", 2}});
  ASSERT_TRUE(length.ok());
  auto runner = RewardRunner::Create({std::move(length).value(), recording});
  ASSERT_TRUE(runner.ok());

  const Prompt a = PreparePromptFromJson(R"({"prompt": "ab", "answer": "A"})", tok).value();
  const Prompt b = PreparePromptFromJson(R"({"prompt": "xyz", "answer": "B"})", tok).value();
  auto out = Produce(**gen, runner->get(), {{&a, 10}, {&b, 11}});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->policy_version, 5);
  ASSERT_EQ(out->groups.size(), 2u);
  EXPECT_EQ(out->num_prompts_failed, 0);
  EXPECT_EQ(out->num_prompts_truncated, 0);
  int64_t tokens = 0;
  const std::vector<std::vector<int32_t>> want_prompt = {{'a', 'b'}, {'x', 'y', 'z'}};
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(out->groups[i].group.ok()) << out->groups[i].group.status().ToString();
    const common::RolloutGroup& g = *out->groups[i].group;
    EXPECT_EQ(g.prompt_ids, want_prompt[i]);
    EXPECT_EQ(g.policy_version, 5);
    EXPECT_FALSE(out->groups[i].prompt_truncated);
    EXPECT_EQ(out->groups[i].rewards.errors + out->groups[i].rewards.timeouts, 0);
    ASSERT_EQ(g.completions.size(), 3u);
    for (const auto& c : g.completions) {
      tokens += static_cast<int64_t>(c.token_ids.size());
      ASSERT_GE(c.token_ids.size(), 1u);
      ASSERT_LE(c.token_ids.size(), 5u);
      ASSERT_EQ(c.rewards.size(), 2u);
      const double n = static_cast<double>(c.token_ids.size());
      EXPECT_EQ(c.rewards[0], std::optional<double>(-std::abs(2.0 - n)));
      EXPECT_EQ(c.rewards[1], std::optional<double>(1.0));
    }
  }
  EXPECT_EQ(out->num_completion_tokens, tokens);
  // Each group was scored with its own prompt text and row, one input per completion.
  std::lock_guard<std::mutex> lock(recording->mu);
  ASSERT_EQ(recording->seen.size(), 2u);
  std::set<std::string> prompts, answers;
  for (const auto& call : recording->seen) {
    ASSERT_EQ(call.size(), 3u);
    prompts.insert(call[0].prompt);
    answers.insert(call[0].row["answer"].get<std::string>());
    EXPECT_EQ(call[0].prompt == "ab" ? "A" : "B", call[0].row["answer"].get<std::string>());
  }
  EXPECT_EQ(prompts, (std::set<std::string>{"ab", "xyz"}));
  EXPECT_EQ(answers, (std::set<std::string>{"A", "B"}));
}

TEST(Produce, AGroupDependsOnItsPromptAndSeedIndexNotOnTheBatch) {
  common::ByteTokenizer tok;
  auto gen = Generator::Create(TinyModel(4), 1, Options(), &tok);
  ASSERT_TRUE(gen.ok());
  const Prompt a = PreparePromptFromJson(R"({"prompt": "hello"})", tok).value();
  const Prompt b = PreparePromptFromJson(R"({"prompt": "other"})", tok).value();
  auto alone = Produce(**gen, nullptr, {{&a, 42}});
  auto batched = Produce(**gen, nullptr, {{&b, 7}, {&a, 42}});
  ASSERT_TRUE(alone.ok() && batched.ok());
  const auto& x = *alone->groups[0].group;
  const auto& y = *batched->groups[1].group;
  ASSERT_EQ(x.completions.size(), y.completions.size());
  for (size_t i = 0; i < x.completions.size(); ++i) {
    EXPECT_EQ(x.completions[i].token_ids, y.completions[i].token_ids) << i;
    EXPECT_TRUE(x.completions[i].rewards.empty());  // no runner: not scored
  }
}

// A row's own max_completion_length cuts its completions where the job's budget would have let
// them run on: each is the first tokens of the same row's completion without it (the same
// sampler stream), truncated unless it stopped right there; a budget over the job's is the job's.
TEST(Produce, ARowsOwnBudgetCutsItsCompletionsAndNoOthers) {
  common::ByteTokenizer tok;
  auto gen = Generator::Create(TinyModel(4), 1, Options(), &tok);
  ASSERT_TRUE(gen.ok());
  const Prompt whole = PreparePromptFromJson(R"({"prompt": "hello"})", tok).value();
  const Prompt cut =
      PreparePromptFromJson(R"({"prompt": "hello", "max_completion_length": 2})", tok).value();
  const Prompt over =
      PreparePromptFromJson(R"({"prompt": "hello", "max_completion_length": 100})", tok).value();
  EXPECT_EQ(whole.max_new_tokens, 0);
  EXPECT_EQ(cut.max_new_tokens, 2);
  EXPECT_EQ(CompletionBudget(cut, 5), 2);
  EXPECT_EQ(CompletionBudget(over, 5), 5);
  EXPECT_EQ(CompletionBudget(whole, 5), 5);
  auto reference = Produce(**gen, nullptr, {{&whole, 42}});
  auto out = Produce(**gen, nullptr, {{&cut, 42}, {&over, 42}, {&whole, 7}});
  ASSERT_TRUE(reference.ok() && out.ok());
  const auto& ref = reference->groups[0].group->completions;
  const auto& short_rows = out->groups[0].group->completions;
  const auto& over_rows = out->groups[1].group->completions;
  ASSERT_EQ(short_rows.size(), ref.size());
  int cut_rows = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const size_t n = std::min<size_t>(2, ref[i].token_ids.size());
    EXPECT_EQ(short_rows[i].token_ids,
              std::vector<int32_t>(ref[i].token_ids.begin(), ref[i].token_ids.begin() + n))
        << i;
    EXPECT_EQ(short_rows[i].truncated,
              ref[i].token_ids.size() > 2 || (ref[i].token_ids.size() == 2 && ref[i].truncated))
        << i;
    for (size_t t = 0; t < n; ++t) EXPECT_NEAR(short_rows[i].logprobs[t], ref[i].logprobs[t], 1e-5);
    cut_rows += ref[i].token_ids.size() > 2 ? 1 : 0;
    EXPECT_EQ(over_rows[i].token_ids, ref[i].token_ids) << i;
    EXPECT_EQ(over_rows[i].truncated, ref[i].truncated) << i;
  }
  EXPECT_GT(cut_rows, 0);  // the budget cut something
  // The row without a budget in the same batch runs to the job's.
  for (const auto& c : out->groups[2].group->completions) {
    EXPECT_TRUE(c.token_ids.size() == 5 || !c.truncated);
  }
  // A bad budget is the row's error, named.
  auto bad = PreparePromptFromJson(R"({"prompt": "x", "max_completion_length": 0})", tok);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("max_completion_length"), std::string::npos);
}

// Generate's per-prompt budgets: out of range fails that prompt alone; a size mismatch the call.
TEST(Produce, GenerateRefusesABudgetOutOfRangeForItsPromptOnly) {
  common::ByteTokenizer tok;
  auto gen = Generator::Create(TinyModel(4), 1, Options(), &tok);
  ASSERT_TRUE(gen.ok());
  const std::vector<std::vector<int32_t>> prompts = {Bytes("a"), Bytes("b"), Bytes("c")};
  auto r = (*gen)->Generate(prompts, {}, {6, 3, -1});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->num_prompts_failed, 2);
  EXPECT_EQ(r->groups[0].status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r->groups[0].status().message().find("max_new_tokens 6 outside [1, 5]"),
            std::string::npos)
      << r->groups[0].status().ToString();
  ASSERT_TRUE(r->groups[1].ok());
  for (const auto& c : r->groups[1]->completions) EXPECT_LE(c.token_ids.size(), 3u);
  EXPECT_EQ(r->groups[2].status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*gen)->Generate(prompts, {}, {1, 2}).status().code(), StatusCode::kInvalidArgument);
}

TEST(Produce, TruncatedAndRejectedPromptsAreReportedPerGroup) {
  common::ByteTokenizer tok;
  const Prompt long_prompt = PreparePromptFromJson(R"({"prompt": "Say hi."})", tok).value();
  const Prompt short_prompt = PreparePromptFromJson(R"({"prompt": "ok"})", tok).value();

  // "left": the last 4 bytes of "Say hi." are kept.
  auto left = Generator::Create(TinyModel(5), 1, Options(/*max_prompt_length=*/4, "left"), &tok);
  ASSERT_TRUE(left.ok());
  auto cut = Produce(**left, nullptr, {{&long_prompt, 1}, {&short_prompt, 2}});
  ASSERT_TRUE(cut.ok()) << cut.status().ToString();
  EXPECT_EQ(cut->num_prompts_truncated, 1);
  EXPECT_TRUE(cut->groups[0].prompt_truncated);
  EXPECT_EQ(cut->groups[0].group->prompt_ids, (std::vector<int32_t>{' ', 'h', 'i', '.'}));
  EXPECT_FALSE(cut->groups[1].prompt_truncated);

  // "reject": that prompt fails alone; the other one still generates and is scored.
  auto reject =
      Generator::Create(TinyModel(5), 1, Options(/*max_prompt_length=*/4, "reject"), &tok);
  ASSERT_TRUE(reject.ok());
  auto runner = RewardRunner::FromConfig([] {
    common::GrpoConfig c;
    c.reward_funcs = {"length"};
    return c;
  }());
  ASSERT_TRUE(runner.ok());
  auto out = Produce(**reject, runner->get(), {{&long_prompt, 1}, {&short_prompt, 2}});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->num_prompts_failed, 1);
  EXPECT_EQ(out->groups[0].group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(out->groups[0].rewards.error_kinds.empty());  // not scored
  ASSERT_TRUE(out->groups[1].group.ok());
  EXPECT_EQ(out->groups[1].group->completions[0].rewards.size(), 1u);
}

TEST(Produce, NoInputsIsNoCall) {
  common::ByteTokenizer tok;
  auto gen = Generator::Create(TinyModel(6), 8, Options(), &tok);
  ASSERT_TRUE(gen.ok());
  auto out = Produce(**gen, nullptr, {});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->policy_version, 8);
  EXPECT_TRUE(out->groups.empty());
  EXPECT_EQ(Produce(**gen, nullptr, {{nullptr, 0}}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::rollout
