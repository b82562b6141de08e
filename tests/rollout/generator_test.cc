#include "rollout/generator.h"

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>

#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "tests/rollout/scaled_tiny_model.h"

namespace grpo::rollout {
namespace {

using common::Model;
using common::RolloutGroup;

std::vector<int32_t> Prompt(int n, int32_t start) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((start + 37 * i) % 250);
  return p;
}

GeneratorOptions Options(double temperature, int64_t g, int64_t max_new) {
  GeneratorOptions o;
  o.sampling.temperature = temperature;
  o.num_generations = g;
  o.max_completion_length = max_new;
  o.seed = 1234;
  return o;
}

std::unique_ptr<Generator> MakeGenerator(std::shared_ptr<const Model> model, GeneratorOptions o,
                                         const common::Tokenizer* tok = nullptr,
                                         int64_t version = 1) {
  auto gen = Generator::Create(std::move(model), version, std::move(o), tok);
  EXPECT_TRUE(gen.ok()) << gen.status().ToString();
  return std::move(gen).value();
}

GenerateResult MustGenerate(const Generator& gen, const std::vector<std::vector<int32_t>>& prompts,
                            const std::vector<int64_t>& indices = {}) {
  auto r = gen.Generate(prompts, indices);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return std::move(r).value();
}

// Full-forward logits [L, V] of one sequence.
at::Tensor FullLogits(const Model& model, const std::vector<int32_t>& seq) {
  at::NoGradGuard no_grad;
  at::Tensor ids = at::tensor(std::vector<int64_t>(seq.begin(), seq.end()), at::kLong).unsqueeze(0);
  at::Tensor hidden = model.ForwardHidden(ids, at::ones_like(ids));
  return model.Logits(hidden[0]);
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(Generator, BehaviourLogprobsEqualFullForwardLogSoftmax) {
  auto model = ScaledTinyModel(1);
  GeneratorOptions o = Options(0.8, 4, 12);
  o.sampling.top_k = 40;
  o.sampling.repetition_penalty = 1.2;
  for (int32_t t = 0; t < 60; ++t) o.stop_token_ids.push_back(t);  // rows finish at different steps
  auto gen = MakeGenerator(model, o);
  const std::vector<std::vector<int32_t>> prompts = {Prompt(5, 3), Prompt(9, 100), Prompt(2, 7)};
  GenerateResult r = MustGenerate(*gen, prompts);
  ASSERT_EQ(r.groups.size(), 3u);
  std::set<size_t> lengths;
  for (size_t p = 0; p < prompts.size(); ++p) {
    ASSERT_TRUE(r.groups[p].ok());
    ASSERT_EQ(r.groups[p]->completions.size(), 4u);
    for (const auto& c : r.groups[p]->completions) {
      ASSERT_EQ(c.logprobs.size(), c.token_ids.size());
      lengths.insert(c.token_ids.size());
      at::Tensor logits = FullLogits(*model, Concat(prompts[p], c.token_ids));
      for (size_t j = 0; j < c.token_ids.size(); ++j) {
        const int64_t pos = static_cast<int64_t>(prompts[p].size() + j) - 1;
        const float expected = (logits[pos] / 0.8).log_softmax(0)[c.token_ids[j]].item<float>();
        EXPECT_NEAR(c.logprobs[j], expected, 1e-4) << "prompt " << p << " token " << j;
      }
    }
  }
  EXPECT_GT(lengths.size(), 1u) << "want rows finishing at different steps";
}

TEST(Generator, PromptCompletionsDoNotDependOnTheBatch) {
  auto model = ScaledTinyModel(2);
  GeneratorOptions o = Options(1.0, 3, 10);
  o.sampling.top_p = 0.95;
  o.sampling.repetition_penalty = 1.1;
  auto gen = MakeGenerator(model, o);
  const std::vector<int32_t> x = Prompt(6, 11);
  GenerateResult alone = MustGenerate(*gen, {x}, {7});
  GenerateResult batched = MustGenerate(*gen, {Prompt(13, 5), x, Prompt(2, 9)}, {3, 7, 9});
  ASSERT_TRUE(alone.groups[0].ok() && batched.groups[1].ok());
  const auto& a = alone.groups[0]->completions;
  const auto& b = batched.groups[1]->completions;
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token_ids, b[i].token_ids) << "completion " << i;
    ASSERT_EQ(a[i].logprobs.size(), b[i].logprobs.size());
    for (size_t j = 0; j < a[i].logprobs.size(); ++j) {
      EXPECT_NEAR(a[i].logprobs[j], b[i].logprobs[j], 1e-5);
    }
  }
  // The G completions of a prompt use different streams.
  EXPECT_NE(a[0].token_ids, a[1].token_ids);
}

TEST(Generator, SameSeedSameResult) {
  auto model = ScaledTinyModel(2);
  auto gen = MakeGenerator(model, Options(1.0, 2, 8));
  GenerateResult a = MustGenerate(*gen, {Prompt(4, 1), Prompt(7, 2)});
  GenerateResult b = MustGenerate(*gen, {Prompt(4, 1), Prompt(7, 2)});
  for (size_t p = 0; p < 2; ++p) {
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(a.groups[p]->completions[i].token_ids, b.groups[p]->completions[i].token_ids);
    }
  }
}

TEST(Generator, GreedyEqualsStepByStepArgmaxOfFullForward) {
  auto model = ScaledTinyModel(3);
  auto gen = MakeGenerator(model, Options(0.0, 2, 10));
  const std::vector<std::vector<int32_t>> prompts = {Prompt(3, 1), Prompt(8, 50)};
  GenerateResult r = MustGenerate(*gen, prompts);
  for (size_t p = 0; p < prompts.size(); ++p) {
    std::vector<int32_t> seq = prompts[p], expected;
    for (int step = 0; step < 10; ++step) {
      const int32_t next = FullLogits(*model, seq)[-1].argmax().item<int32_t>();
      expected.push_back(next);
      seq.push_back(next);
      if (next == common::ByteTokenizer::kImEndId) break;  // the tiny preset's eos
    }
    for (const auto& c : r.groups[p]->completions) EXPECT_EQ(c.token_ids, expected);
  }
}

TEST(Generator, MaxCompletionLengthSetsTruncated) {
  auto model = ScaledTinyModel(3);
  GeneratorOptions o = Options(0.0, 1, 16);
  o.eos_token_ids = {-1};  // nothing stops
  auto gen = MakeGenerator(model, o);
  GenerateResult r = MustGenerate(*gen, {Prompt(4, 2)});
  const auto& c = r.groups[0]->completions[0];
  EXPECT_EQ(c.token_ids.size(), 16u);
  EXPECT_TRUE(c.truncated);
  EXPECT_EQ(r.num_completion_tokens, 16);
}

TEST(Generator, EosStopsAndIsKept) {
  auto model = ScaledTinyModel(3);
  GeneratorOptions o = Options(0.0, 1, 16);
  o.eos_token_ids = {-1};
  GenerateResult ref = MustGenerate(*MakeGenerator(model, o), {Prompt(4, 2)});
  const std::vector<int32_t> full = ref.groups[0]->completions[0].token_ids;
  // Make the 6th greedy token the eos: generation stops at its first occurrence.
  const int32_t eos = full[5];
  const size_t stop = std::find(full.begin(), full.end(), eos) - full.begin();
  o.eos_token_ids = {eos};
  GenerateResult r = MustGenerate(*MakeGenerator(model, o), {Prompt(4, 2)});
  const auto& c = r.groups[0]->completions[0];
  EXPECT_EQ(c.token_ids, std::vector<int32_t>(full.begin(), full.begin() + stop + 1));
  EXPECT_FALSE(c.truncated);
}

TEST(Generator, SampledRowsStopAtFirstStopTokenOrAreTruncated) {
  auto model = ScaledTinyModel(4);
  GeneratorOptions o = Options(1.0, 8, 6);
  std::set<int32_t> stops = {common::ByteTokenizer::kImEndId};  // the preset's eos
  for (int32_t t = 0; t < 40; ++t) stops.insert(t);
  o.stop_token_ids.assign(stops.begin(), stops.end());
  GenerateResult r = MustGenerate(*MakeGenerator(model, o), {Prompt(4, 2), Prompt(9, 3)});
  int stopped = 0, truncated = 0;
  for (const auto& g : r.groups) {
    for (const auto& c : g->completions) {
      ASSERT_FALSE(c.token_ids.empty());
      for (size_t j = 0; j + 1 < c.token_ids.size(); ++j) EXPECT_FALSE(stops.count(c.token_ids[j]));
      if (c.truncated) {
        EXPECT_EQ(c.token_ids.size(), 6u);
        EXPECT_FALSE(stops.count(c.token_ids.back()));
        ++truncated;
      } else {
        EXPECT_TRUE(stops.count(c.token_ids.back()));
        ++stopped;
      }
    }
  }
  EXPECT_GT(stopped, 0);
  EXPECT_GT(truncated, 0);
}

// Token id t decodes to the letter 'a' + t % 26: one character per token.
class LetterTokenizer final : public common::Tokenizer {
 public:
  StatusOr<std::vector<int32_t>> Encode(std::string_view) const override {
    return Status::Unimplemented("encode");
  }
  int64_t vocab_size() const override { return 259; }
  std::optional<int32_t> TokenToId(std::string_view) const override { return std::nullopt; }
  std::optional<std::string> IdToToken(int32_t id) const override {
    return std::string(1, static_cast<char>('a' + id % 26));
  }
  std::optional<int32_t> eos_token_id() const override { return 258; }
  std::optional<int32_t> pad_token_id() const override { return 256; }
  Status Save(const std::string&) const override { return Status::Unimplemented("save"); }

 protected:
  StatusOr<std::string> DecodeImpl(const std::vector<int32_t>& ids, bool) const override {
    std::string s;
    for (int32_t id : ids) s.push_back(static_cast<char>('a' + id % 26));
    return s;
  }
};

TEST(Generator, StopStringEndsCompletionAndCutsText) {
  auto model = ScaledTinyModel(5);
  LetterTokenizer tok;
  GeneratorOptions o = Options(0.0, 1, 16);
  o.eos_token_ids = {-1};
  GenerateResult ref = MustGenerate(*MakeGenerator(model, o, &tok), {Prompt(4, 2)});
  const auto& full = ref.groups[0]->completions[0];
  ASSERT_EQ(full.text.size(), 16u);
  const std::string stop = full.text.substr(6, 2);
  const size_t pos = full.text.find(stop);
  o.stop_strings = {"zzzzzzzzzzzzzzzzzz", stop};
  GenerateResult r = MustGenerate(*MakeGenerator(model, o, &tok), {Prompt(4, 2)});
  const auto& c = r.groups[0]->completions[0];
  EXPECT_EQ(c.text, full.text.substr(0, pos));
  EXPECT_EQ(c.token_ids,
            std::vector<int32_t>(full.token_ids.begin(), full.token_ids.begin() + pos + 2));
  EXPECT_EQ(c.logprobs.size(), pos + 2);
  EXPECT_FALSE(c.truncated);
}

TEST(Generator, TextIsDecodedWithTheTokenizer) {
  auto model = ScaledTinyModel(5);
  common::ByteTokenizer tok;
  GenerateResult r = MustGenerate(*MakeGenerator(model, Options(1.0, 2, 8), &tok), {Prompt(4, 2)});
  for (const auto& c : r.groups[0]->completions) {
    EXPECT_EQ(c.text, tok.Decode(c.token_ids, true).value());
  }
}

TEST(Generator, StopStringsNeedATokenizer) {
  GeneratorOptions o = Options(1.0, 2, 8);
  o.stop_strings = {"</answer>"};
  EXPECT_EQ(Generator::Create(ScaledTinyModel(1), 0, o).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Generator, BadOptionsAreRejected) {
  GeneratorOptions o = Options(1.0, 0, 8);
  EXPECT_NE(Generator::Create(ScaledTinyModel(1), 0, o).status().message().find("num_generations"),
            std::string::npos);
  o = Options(1.0, 2, 8);
  o.truncate_prompt = "right";
  EXPECT_NE(Generator::Create(ScaledTinyModel(1), 0, o).status().message().find("truncate_prompt"),
            std::string::npos);
  EXPECT_FALSE(Generator::Create(nullptr, 0, Options(1.0, 2, 8)).ok());
}

TEST(Generator, BadPromptsFailAloneAndNameTheirIndex) {
  auto model = ScaledTinyModel(6);
  GeneratorOptions o = Options(1.0, 2, 4);
  o.max_prompt_length = 8;
  o.truncate_prompt = "reject";
  auto gen = MakeGenerator(model, o);
  GenerateResult r = MustGenerate(*gen, {Prompt(3, 1), {}, {1, 999, 2}, Prompt(20, 4), {-3}});
  ASSERT_EQ(r.groups.size(), 5u);
  ASSERT_TRUE(r.groups[0].ok());
  EXPECT_EQ(r.groups[0]->completions.size(), 2u);
  const auto expect_error = [&](size_t i, const std::string& what) {
    ASSERT_FALSE(r.groups[i].ok()) << i;
    EXPECT_EQ(r.groups[i].status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.groups[i].status().message().find("prompt " + std::to_string(i)), std::string::npos)
        << r.groups[i].status().message();
    EXPECT_NE(r.groups[i].status().message().find(what), std::string::npos)
        << r.groups[i].status().message();
  };
  expect_error(1, "empty");
  expect_error(2, "999");
  expect_error(3, "max_prompt_length");
  expect_error(4, "-3");
  EXPECT_EQ(r.num_prompts_failed, 4);
  EXPECT_EQ(r.num_prompts_truncated, 0);
}

TEST(Generator, LongPromptIsTruncatedFromTheLeft) {
  auto model = ScaledTinyModel(6);
  GeneratorOptions o = Options(1.0, 2, 5);
  o.max_prompt_length = 8;
  auto gen = MakeGenerator(model, o);
  const std::vector<int32_t> longp = Prompt(20, 4);
  const std::vector<int32_t> tail(longp.end() - 8, longp.end());
  GenerateResult r = MustGenerate(*gen, {longp}, {0});
  GenerateResult ref = MustGenerate(*gen, {tail}, {0});
  ASSERT_TRUE(r.groups[0].ok());
  EXPECT_EQ(r.num_prompts_truncated, 1);
  EXPECT_EQ(r.groups[0]->prompt_ids, tail);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(r.groups[0]->completions[i].token_ids, ref.groups[0]->completions[i].token_ids);
  }
}

TEST(Generator, PromptIndicesMustMatchPrompts) {
  auto gen = MakeGenerator(ScaledTinyModel(1), Options(1.0, 2, 4));
  EXPECT_EQ(gen->Generate({Prompt(3, 1), Prompt(3, 2)}, {1}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Generator, RecomputeBaselineGivesTheSameCompletions) {
  auto model = ScaledTinyModel(7);
  GeneratorOptions o = Options(1.0, 3, 8);
  for (int32_t t = 0; t < 50; ++t) o.stop_token_ids.push_back(t);
  auto gen = MakeGenerator(model, o);
  const std::vector<std::vector<int32_t>> prompts = {Prompt(5, 1), Prompt(2, 8)};
  GenerateResult a = MustGenerate(*gen, prompts);
  auto b = gen->GenerateRecomputeBaseline(prompts);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  for (size_t p = 0; p < prompts.size(); ++p) {
    for (size_t i = 0; i < 3; ++i) {
      const auto& x = a.groups[p]->completions[i];
      const auto& y = b->groups[p]->completions[i];
      EXPECT_EQ(x.token_ids, y.token_ids);
      EXPECT_EQ(x.truncated, y.truncated);
      for (size_t j = 0; j < x.logprobs.size() && j < y.logprobs.size(); ++j) {
        EXPECT_NEAR(x.logprobs[j], y.logprobs[j], 1e-4);
      }
    }
  }
}

TEST(Generator, GroupsRecordTheSnapshotVersion) {
  auto a = ScaledTinyModel(8), b = ScaledTinyModel(9);
  auto gen = MakeGenerator(a, Options(0.0, 2, 6), nullptr, /*version=*/3);
  const std::vector<std::vector<int32_t>> prompts = {Prompt(4, 1)};
  GenerateResult ra = MustGenerate(*gen, prompts);
  EXPECT_EQ(ra.policy_version, 3);
  EXPECT_EQ(ra.groups[0]->policy_version, 3);
  ASSERT_TRUE(gen->SetPolicy(b, 4).ok());
  EXPECT_EQ(gen->policy_version(), 4);
  GenerateResult rb = MustGenerate(*gen, prompts);
  EXPECT_EQ(rb.groups[0]->policy_version, 4);
  EXPECT_NE(ra.groups[0]->completions[0].token_ids, rb.groups[0]->completions[0].token_ids);
  EXPECT_FALSE(gen->SetPolicy(nullptr, 5).ok());
}

TEST(Generator, ConcurrentSetPolicyNeverMixesVersions) {
  auto a = ScaledTinyModel(8), b = ScaledTinyModel(9);
  const std::vector<std::vector<int32_t>> prompts = {Prompt(4, 1), Prompt(6, 2)};
  GeneratorOptions o = Options(0.0, 2, 8);
  o.eos_token_ids = {-1};
  // Greedy results of each version alone.
  GenerateResult ref_a = MustGenerate(*MakeGenerator(a, o), prompts);
  GenerateResult ref_b = MustGenerate(*MakeGenerator(b, o), prompts);
  auto gen = MakeGenerator(a, o, nullptr, 1);
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    for (int i = 0; !stop; ++i) {
      EXPECT_TRUE(gen->SetPolicy(i % 2 ? a : b, i % 2 ? 1 : 2).ok());
      std::this_thread::yield();
    }
  });
  for (int i = 0; i < 20; ++i) {
    GenerateResult r = MustGenerate(*gen, prompts);
    ASSERT_TRUE(r.policy_version == 1 || r.policy_version == 2);
    const GenerateResult& ref = r.policy_version == 1 ? ref_a : ref_b;
    for (size_t p = 0; p < prompts.size(); ++p) {
      EXPECT_EQ(r.groups[p]->policy_version, r.policy_version);
      for (size_t c = 0; c < 2; ++c) {
        EXPECT_EQ(r.groups[p]->completions[c].token_ids, ref.groups[p]->completions[c].token_ids);
      }
    }
  }
  stop = true;
  swapper.join();
}

TEST(Generator, BorrowedModelWorks) {
  auto owned = ScaledTinyModel(10);
  auto gen = MakeGenerator(BorrowModel(*owned), Options(1.0, 2, 4));
  GenerateResult r = MustGenerate(*gen, {Prompt(3, 3)});
  EXPECT_EQ(r.groups[0]->completions.size(), 2u);
}

// The stop checks batched into windows (what a GPU does, 16 tokens at a time) give the tokens of
// a check after every token: rows that stop inside a window drop their extra tokens, and every
// row's random stream is drawn in the same order. Stop tokens make the lengths vary.
TEST(GeneratorStopChecks, WindowsOfAnyLengthGiveTheSameGroups) {
  auto model = ScaledTinyModel(5);
  std::vector<std::vector<int32_t>> prompts = {Prompt(3, 1), Prompt(6, 40), Prompt(2, 90)};
  auto run = [&](int64_t interval, double temperature) {
    GeneratorOptions o = Options(temperature, 4, 20);
    o.stop_token_ids = {};
    for (int32_t t = 0; t < 30; ++t) o.stop_token_ids.push_back(t);
    o.stop_check_interval = interval;
    return MustGenerate(*MakeGenerator(model, o), prompts);
  };
  for (double temperature : {1.0, 0.0}) {
    const GenerateResult one = run(1, temperature);
    std::set<size_t> lengths;
    for (const auto& g : one.groups) {
      for (const auto& c : g->completions) lengths.insert(c.token_ids.size());
    }
    EXPECT_GE(lengths.size(), 3u) << "lengths should vary for this test to mean anything";
    for (int64_t interval : {3, 16, 64}) {
      const GenerateResult w = run(interval, temperature);
      EXPECT_EQ(w.num_completion_tokens, one.num_completion_tokens) << interval;
      for (size_t i = 0; i < one.groups.size(); ++i) {
        for (size_t j = 0; j < one.groups[i]->completions.size(); ++j) {
          const auto& a = one.groups[i]->completions[j];
          const auto& b = w.groups[i]->completions[j];
          EXPECT_EQ(a.token_ids, b.token_ids) << interval << " " << i << "/" << j;
          // Finished rows stay in the batch until the window ends, and a batch of another
          // size may round the matmuls differently: log-probs to 1e-5, not bit for bit (the
          // default on the CPU is 1, the groups of today exactly).
          ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
          for (size_t t = 0; t < a.logprobs.size(); ++t) {
            EXPECT_NEAR(a.logprobs[t], b.logprobs[t], 1e-5) << interval << " " << i << "/" << j;
          }
          EXPECT_EQ(a.truncated, b.truncated) << interval << " " << i << "/" << j;
        }
      }
    }
  }
}

TEST(GeneratorStopChecks, NegativeIntervalIsInvalidArgument) {
  GeneratorOptions o = Options(1.0, 2, 4);
  o.stop_check_interval = -1;
  EXPECT_EQ(o.Validate().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::rollout
