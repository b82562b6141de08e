// Multi-turn completions (common/rollout_types.h Completion::env_mask, TRL's tool_mask): the
// checks a group's env_mask must pass on arrival (learner/group_check.h), and what the trainer
// does with environment tokens (docs/GRPO_SPEC.md "Environment tokens"): they are attended to but
// never trained on, and the lengths it reports count the model's tokens only. Agreement of the
// loss with TRL's on tool_mask batches: trl_loss_test and trl_reference_test.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "learner/group_check.h"
#include "learner/grpo_trainer.h"

namespace grpo::learner {
namespace {

using common::Completion;
using common::GroupRefusal;
using common::RolloutGroup;

// --- CheckGroup ----------------------------------------------------------------------------

GroupLimits Limits() {
  GroupLimits l;
  l.num_generations = 2;
  l.vocab_size = 100;
  l.max_completion_length = 16;
  l.reward_funcs = 1;
  return l;
}

// A valid two-completion group; completion 1 has an environment turn (tokens 2-4).
RolloutGroup ValidGroup() {
  RolloutGroup g;
  g.prompt_id = "q7";
  g.prompt_ids = {1, 2, 3};
  Completion single;
  single.token_ids = {5, 6, 7};
  single.rewards = {1.0};
  Completion multi;
  multi.token_ids = {5, 6, 30, 31, 32, 8, 9};
  multi.env_mask = {1, 1, 0, 0, 0, 1, 1};
  multi.logprobs = {-0.5f, -1.f, 0.f, 0.f, 0.f, -0.25f, -2.f};
  multi.rewards = {0.0};
  g.completions = {single, multi};
  return g;
}

// The refusal of `g`: its reason, and its message (which must name the group and completion 1).
std::pair<GroupRefusal, std::string> Refusal(const RolloutGroup& g) {
  GroupRefusal reason = GroupRefusal::kStale;
  const Status s = CheckGroup(g, Limits(), &reason);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("group 'q7'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("completion 1"), std::string::npos) << s.message();
  return {reason, s.message()};
}

TEST(EnvMaskCheck, EmptyOrOneZeroOrOnePerTokenWithAModelTokenPasses) {
  RolloutGroup g = ValidGroup();
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());
  g.completions[1].env_mask.assign(7, 1);  // all the model's, spelled out
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());
  g.completions[1].env_mask = {1, 0, 0, 0, 0, 0, 0};  // one model token, then the environment
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());
  g.completions[1].env_mask = {0, 0, 0, 1, 0, 0, 1};  // a reset observation first
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());
}

TEST(EnvMaskCheck, ALengthOtherThanTheTokensIsRefusedWithBothCounts) {
  RolloutGroup g = ValidGroup();
  g.completions[1].env_mask.pop_back();
  const auto [reason, message] = Refusal(g);
  EXPECT_EQ(reason, GroupRefusal::kEnvMask);
  EXPECT_NE(message.find("7 token ids but 6 env_mask entries"), std::string::npos) << message;
}

TEST(EnvMaskCheck, AValueOtherThanZeroOrOneIsRefusedNamingItsPosition) {
  RolloutGroup g = ValidGroup();
  g.completions[1].env_mask[3] = 2;
  const auto [reason, message] = Refusal(g);
  EXPECT_EQ(reason, GroupRefusal::kEnvMask);
  EXPECT_NE(message.find("env_mask entry 3 is 2, not 0 or 1"), std::string::npos) << message;
}

TEST(EnvMaskCheck, ACompletionWithoutAModelTokenIsRefused) {
  RolloutGroup g = ValidGroup();
  g.completions[1].env_mask.assign(7, 0);
  const auto [reason, message] = Refusal(g);
  EXPECT_EQ(reason, GroupRefusal::kEnvMask);
  EXPECT_NE(message.find("no token of the policy's"), std::string::npos) << message;
}

TEST(ToolCountCheck, CountsOfAToolEnvironmentPassAndImpossibleOnesAreRefused) {
  RolloutGroup g = ValidGroup();
  Completion& c = g.completions[1];
  c.uses_tools = true;
  c.tool_calls = 3;
  c.tool_call_failures = 3;
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());
  c.tool_calls = 0;
  c.tool_call_failures = 0;
  EXPECT_TRUE(CheckGroup(g, Limits()).ok());  // tools declared, none called
  for (auto [uses, calls, failures] : {std::tuple{true, 2, 3}, std::tuple{true, -1, 0},
                                       std::tuple{true, 2, -1}, std::tuple{false, 1, 0}}) {
    c.uses_tools = uses;
    c.tool_calls = calls;
    c.tool_call_failures = failures;
    const auto [reason, message] = Refusal(g);
    EXPECT_EQ(reason, GroupRefusal::kToolCounts) << message;
    EXPECT_NE(message.find(std::to_string(calls) + " tool calls and " + std::to_string(failures) +
                           " failures"),
              std::string::npos)
        << message;
  }
}

TEST(EnvMaskCheck, ModelTokenCountIsTheOnesOrEveryTokenWithoutAMask) {
  const RolloutGroup g = ValidGroup();
  EXPECT_EQ(ModelTokenCount(g.completions[0]), 3);
  EXPECT_EQ(ModelTokenCount(g.completions[1]), 4);
}

// --- GrpoTrainer ---------------------------------------------------------------------------

std::unique_ptr<common::Model> TinyModel() {
  auto cfg = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(cfg.ok());
  auto m = common::Model::InitRandom(*cfg, 7);
  EXPECT_TRUE(m.ok());
  return std::move(m).value();
}

// Two groups of four multi-turn completions: 1-3 model tokens, 3-5 environment tokens (env_mask
// 0, behaviour log-prob 0), 1-4 model tokens; behaviour log-probs on the model's tokens.
std::vector<RolloutGroup> MultiTurnGroups() {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> tok(0, 255), first(1, 3), env(3, 5), second(1, 4);
  std::uniform_real_distribution<float> lp(-6.5f, -4.5f);
  std::uniform_real_distribution<double> rew(0.0, 1.0);
  std::vector<RolloutGroup> out;
  for (int g = 0; g < 2; ++g) {
    RolloutGroup rg;
    rg.prompt_id = "p" + std::to_string(g);
    for (int i = 0; i < 3 + g; ++i) rg.prompt_ids.push_back(tok(rng));
    for (int j = 0; j < 4; ++j) {
      Completion c;
      for (auto [n, model] :
           {std::pair{first(rng), 1}, std::pair{env(rng), 0}, std::pair{second(rng), 1}}) {
        for (int i = 0; i < n; ++i) {
          c.token_ids.push_back(tok(rng));
          c.env_mask.push_back(static_cast<uint8_t>(model));
          c.logprobs.push_back(model ? lp(rng) : 0.f);
        }
      }
      c.rewards = {rew(rng)};
      rg.completions.push_back(c);
    }
    out.push_back(rg);
  }
  return out;
}

// Token-level truncated importance sampling on the behaviour log-probs, KL-free, one step.
common::GrpoConfig Config() {
  common::GrpoConfig c;
  c.num_generations = 4;
  c.per_device_train_batch_size = 4;
  c.gradient_accumulation_steps = 2;
  c.max_completion_length = 16;
  c.learning_rate = 1e-2;
  c.lr_scheduler_type = "constant";
  c.loss_type = "dapo";
  c.importance_sampling_correction = "token_truncate";
  c.importance_sampling_cap = 1.5;
  c.logprob_chunk_tokens = 5;
  return c;
}

struct Trained {
  StepMetrics step;
  std::vector<at::Tensor> params;
};

Trained Train(const std::vector<RolloutGroup>& groups, const common::GrpoConfig& cfg) {
  auto model = TinyModel();
  auto trainer = GrpoTrainer::Create(cfg, model.get(), nullptr);
  EXPECT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto r = (*trainer)->TrainGenerationBatch(groups);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r.ok() ? r->steps.size() : 0u, 1u);
  Trained t;
  if (r.ok() && !r->steps.empty()) t.step = r->steps[0];
  for (const at::Tensor& p : model->Parameters()) t.params.push_back(p.detach().clone());
  return t;
}

// Environment tokens carry no gradient: whatever behaviour log-probs the rollout put on them,
// the step (loss, gradient norm, new weights, mismatch statistics) is the same, on the fused
// token path and on the autograd sequence path. With the mask dropped the same tokens are
// trained on and the step changes (the comparison can fail).
TEST(EnvMaskTraining, EnvironmentTokensBehaviourLogprobsDoNotChangeTheStep) {
  for (const char* level : {"token", "sequence"}) {
    SCOPED_TRACE(level);
    common::GrpoConfig cfg = Config();
    cfg.importance_sampling_level = level;
    if (std::string(level) == "sequence") cfg.importance_sampling_correction = "sequence_truncate";
    const std::vector<RolloutGroup> groups = MultiTurnGroups();
    std::vector<RolloutGroup> noisy = groups;
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> junk(-9.f, -0.1f);
    for (RolloutGroup& g : noisy) {
      for (Completion& c : g.completions) {
        for (size_t t = 0; t < c.token_ids.size(); ++t) {
          if (c.env_mask[t] == 0) c.logprobs[t] = junk(rng);
        }
      }
    }
    const Trained a = Train(groups, cfg), b = Train(noisy, cfg);
    EXPECT_NE(a.step.loss, 0.0);
    EXPECT_EQ(a.step.loss, b.step.loss);
    EXPECT_EQ(a.step.grad_norm, b.step.grad_norm);
    ASSERT_TRUE(a.step.has_logprob_mismatch);
    EXPECT_EQ(a.step.logprob_mismatch_mean, b.step.logprob_mismatch_mean);
    EXPECT_EQ(a.step.logprob_mismatch_max, b.step.logprob_mismatch_max);
    EXPECT_EQ(a.step.is_ratio_mean, b.step.is_ratio_mean);
    ASSERT_EQ(a.params.size(), b.params.size());
    for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(at::equal(a.params[i], b.params[i]));

    std::vector<RolloutGroup> unmasked = noisy;
    for (RolloutGroup& g : unmasked) {
      for (Completion& c : g.completions) c.env_mask.clear();
    }
    const Trained c = Train(unmasked, cfg);
    EXPECT_GT(std::abs(c.step.loss - b.step.loss), 1e-4);
    EXPECT_GT(std::abs(c.step.grad_norm - b.step.grad_norm), 1e-4);
  }
}

// completions/mean_length and completion_tokens count model tokens only (TRL's
// completion_lengths under a tool_mask), counted here by hand; the step's dump carries the
// env_mask (1 at padding, TRL's tool_mask) beside TRL's completion_mask, which keeps the
// environment tokens (they are attended to).
TEST(EnvMaskTraining, LengthsCountModelTokensAndTheDumpCarriesTheMask) {
  common::GrpoConfig cfg = Config();
  cfg.dump_batches_dir = ::testing::TempDir() + "/grpo_env_mask_dump_test";
  std::filesystem::remove_all(cfg.dump_batches_dir);
  const std::vector<RolloutGroup> groups = MultiTurnGroups();
  int64_t model_tokens = 0, all_tokens = 0, env_tokens = 0;
  for (const RolloutGroup& g : groups) {
    for (const Completion& c : g.completions) {
      for (uint8_t m : c.env_mask) (m ? model_tokens : env_tokens) += 1;
      all_tokens += static_cast<int64_t>(c.token_ids.size());
    }
  }
  ASSERT_EQ(model_tokens + env_tokens, all_tokens);
  ASSERT_GE(env_tokens, 8 * 3);
  const Trained t = Train(groups, cfg);
  EXPECT_EQ(t.step.completion_tokens, model_tokens);
  EXPECT_DOUBLE_EQ(t.step.completions_mean_length, static_cast<double>(model_tokens) / 8.0);

  auto f = common::SafetensorsFile::Open(cfg.dump_batches_dir + "/step-00000001.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto env = (*f)->Get("env_mask");
  auto completion = (*f)->Get("completion_mask");
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  ASSERT_TRUE(completion.ok());
  ASSERT_EQ(env->size(0), 8);
  for (int64_t r = 0; r < 8; ++r) {
    const Completion& c = groups[r / 4].completions[r % 4];
    for (int64_t k = 0; k < env->size(1); ++k) {
      const bool real = k < static_cast<int64_t>(c.token_ids.size());
      EXPECT_EQ((*env)[r][k].item<float>(), real ? c.env_mask[k] : 1.f) << r << "," << k;
      EXPECT_EQ((*completion)[r][k].item<float>(), real ? 1.f : 0.f) << r << "," << k;
    }
  }
  std::filesystem::remove_all(cfg.dump_batches_dir);
}

// Single-turn groups (no env_mask) dump no env_mask and count every token.
TEST(EnvMaskTraining, SingleTurnGroupsDumpNoMaskAndCountEveryToken) {
  common::GrpoConfig cfg = Config();
  cfg.dump_batches_dir = ::testing::TempDir() + "/grpo_env_mask_single_turn_test";
  std::filesystem::remove_all(cfg.dump_batches_dir);
  std::vector<RolloutGroup> groups = MultiTurnGroups();
  int64_t tokens = 0;
  for (RolloutGroup& g : groups) {
    for (Completion& c : g.completions) {
      c.env_mask.clear();
      tokens += static_cast<int64_t>(c.token_ids.size());
    }
  }
  const Trained t = Train(groups, cfg);
  EXPECT_EQ(t.step.completion_tokens, tokens);
  auto f = common::SafetensorsFile::Open(cfg.dump_batches_dir + "/step-00000001.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->Find("env_mask"), nullptr);
  EXPECT_NE((*f)->Find("completion_mask"), nullptr);
  std::filesystem::remove_all(cfg.dump_batches_dir);
}

// TRL's tools/ metrics over a step's sequences, counted here by hand: call_frequency = calls /
// sequences, failure_frequency = failed calls / calls (0 without calls); logged only when a
// sequence came from an environment that declared tools.
TEST(ToolMetrics, AStepLogsCallsPerSequenceAndFailuresPerCall) {
  std::vector<RolloutGroup> groups = MultiTurnGroups();  // 8 sequences, one step (Config)
  const common::GrpoConfig cfg = Config();
  const Trained none = Train(groups, cfg);
  EXPECT_FALSE(none.step.has_tools);
  EXPECT_FALSE(none.step.ToJson().contains("tools/call_frequency"));

  const int calls[8] = {0, 2, 1, 0, 3, 0, 0, 1}, failures[8] = {0, 1, 0, 0, 2, 0, 0, 1};
  for (int r = 0; r < 8; ++r) {
    Completion& c = groups[r / 4].completions[r % 4];
    c.uses_tools = true;
    c.tool_calls = calls[r];
    c.tool_call_failures = failures[r];
  }
  const Trained t = Train(groups, cfg);
  ASSERT_TRUE(t.step.has_tools);
  EXPECT_DOUBLE_EQ(t.step.tool_call_frequency, 7.0 / 8.0);
  EXPECT_DOUBLE_EQ(t.step.tool_failure_frequency, 4.0 / 7.0);
  const nlohmann::json j = t.step.ToJson();
  EXPECT_DOUBLE_EQ(j.at("tools/call_frequency").get<double>(), 7.0 / 8.0);
  EXPECT_DOUBLE_EQ(j.at("tools/failure_frequency").get<double>(), 4.0 / 7.0);

  // Tools declared and never called: both 0, still logged.
  for (RolloutGroup& g : groups) {
    for (Completion& c : g.completions) c.tool_calls = c.tool_call_failures = 0;
  }
  const Trained idle = Train(groups, cfg);
  ASSERT_TRUE(idle.step.has_tools);
  EXPECT_EQ(idle.step.tool_call_frequency, 0.0);
  EXPECT_EQ(idle.step.tool_failure_frequency, 0.0);
}

}  // namespace
}  // namespace grpo::learner
