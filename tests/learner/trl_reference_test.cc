// GrpoTrainer's optimizer steps against TRL 1.16's own GRPO loss code. Our trainer trains a tiny
// random model on one generation batch with `dump_batches_dir` set; for every step,
// tests/reference/trl_grpo_ref.py loads the weights that step started from with transformers and
// runs `trl.GRPOTrainer._compute_loss` (and its `_get_per_token_logps_and_entropies`) on the
// dumped batch. The step's loss, gradient norm and logged metrics must be TRL's
// (docs/GRPO_SPEC.md "Per-token loss", "Aggregation", "Metrics per optimizer step").
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "learner/grpo_trainer.h"
#include "tests/test_util.h"

namespace grpo::learner {
namespace {

namespace fs = std::filesystem;
using common::Completion;
using common::RolloutGroup;
using nlohmann::json;

// Settings shared by every case: temperature != 1 and epsilon_high != epsilon so that the
// temperature scaling and the two clip bounds are exercised.
constexpr double kTemperature = 0.7;
constexpr double kEpsilon = 0.2;
constexpr double kEpsilonHigh = 0.28;
constexpr int64_t kMaxCompletionLength = 16;
constexpr double kLearningRate = 5e-3;  // large enough that the second pass clips tokens

struct TrlCase {
  std::string loss_type;
  double beta = 0.0;
  int64_t num_iterations = 1;
  std::string importance_sampling_level = "token";
  std::optional<double> delta;
  double learning_rate = kLearningRate;
  int64_t gradient_accumulation_steps = 1;  // micro-batches per step (8 sequences in all)
  // More settings by their TRL GRPOConfig names (ours accepts them: the same name or an alias),
  // given to both trainers; `tag` names them in the case's name.
  std::string tag = "";
  json extra = json::object();
  bool with_behaviour = false;  // completions carry behaviour log-probs (the workers' sampling)
  // Multi-turn completions (MakeMultiTurnGroups: environment tokens between model turns, TRL's
  // tool_mask) with mask_truncated_completions on and one truncated completion.
  bool multi_turn = false;

  std::string Name() const {
    std::string n =
        loss_type + (beta != 0 ? "_kl" : "_nokl") + "_iterations" + std::to_string(num_iterations);
    if (importance_sampling_level != "token") n += "_" + importance_sampling_level;
    if (delta) n += "_delta";
    if (gradient_accumulation_steps != 1) n += "_ga" + std::to_string(gradient_accumulation_steps);
    if (!tag.empty()) n += "_" + tag;
    if (multi_turn) n += "_multi_turn";
    return n;
  }
  loss::ObjectiveMetric Metric() const {
    return loss::ObjectiveOf(*ParseLossType(loss_type)).metric;
  }
};
void PrintTo(const TrlCase& c, std::ostream* os) { *os << c.Name(); }

// Every loss type, with and without KL, one and two passes over the batch; plus two-sided
// clipping (delta < 1 + epsilon_high, so TRL never flags a high clip) and sequence-level
// importance sampling (GSPO, a smaller step so that not every sequence is clipped); and steps of
// two micro-batches (docs/GRPO_SPEC.md "Aggregation"; TRL logs metrics per micro-batch).
std::vector<TrlCase> AllCases() {
  std::vector<TrlCase> cases;
  for (const char* lt : {"grpo", "bnpo", "dr_grpo", "dapo"}) {
    for (double beta : {0.0, 0.04}) {
      for (int64_t it : {1, 2})
        cases.push_back({lt, beta, it, "token", std::nullopt, kLearningRate});
    }
  }
  cases.push_back({"dapo", 0.0, 2, "token", 1.05, kLearningRate});
  cases.push_back({"grpo", 0.0, 2, "sequence", std::nullopt, kLearningRate / 4});
  for (const char* lt : {"bnpo", "dapo"}) {
    cases.push_back({lt, 0.04, 2, "token", std::nullopt, kLearningRate, 2});
  }
  // TRL 1.16's other objectives, through the trainer (vespo on the autograd path, the rest
  // fused); the KL term at TRL's default (bias-corrected, above) and without the correction; the
  // off-policy sequence mask; the importance-sampling correction on behaviour log-probs, at TRL's
  // default mode and at two others.
  const auto nullopt = std::nullopt;
  cases.push_back({"cispo", 0.04, 2, "token", nullopt, kLearningRate});
  cases.push_back({"sapo", 0.04, 2, "token", nullopt, kLearningRate});
  cases.push_back({"sapo",
                   0.0,
                   2,
                   "token",
                   nullopt,
                   kLearningRate,
                   1,
                   "temperatures",
                   {{"sapo_temperature_pos", 0.7}, {"sapo_temperature_neg", 1.4}}});
  cases.push_back({"luspo", 0.0, 2, "sequence", nullopt, kLearningRate / 4});
  cases.push_back({"vespo", 0.0, 2, "token", nullopt, kLearningRate});
  cases.push_back({"vespo",
                   0.04,
                   1,
                   "token",
                   nullopt,
                   kLearningRate,
                   1,
                   "gamma",
                   {{"vespo_k_pos", 1.5}, {"vespo_lambda_pos", 2.5}}});
  cases.push_back({"dapo",
                   0.04,
                   2,
                   "token",
                   nullopt,
                   kLearningRate,
                   1,
                   "kl_plain",
                   {{"use_bias_correction_kl", false}}});
  cases.push_back({"dapo",
                   0.0,
                   2,
                   "token",
                   nullopt,
                   kLearningRate,
                   1,
                   "off_policy_mask",
                   {{"off_policy_mask_threshold", 0.02}}});
  cases.push_back({"dapo",
                   0.0,
                   2,
                   "token",
                   nullopt,
                   kLearningRate,
                   1,
                   "top_entropy",
                   {{"top_entropy_quantile", 0.4}}});
  cases.push_back(
      {"dapo", 0.04, 1, "token", nullopt, kLearningRate, 1, "is_default", json::object(), true});
  cases.push_back({"grpo",
                   0.0,
                   2,
                   "token",
                   nullopt,
                   kLearningRate,
                   1,
                   "is_token_mask",
                   {{"vllm_importance_sampling_mode", "token_mask"}},
                   true});
  cases.push_back({"dapo",
                   0.0,
                   2,
                   "token",
                   nullopt,
                   kLearningRate,
                   1,
                   "is_sequence_truncate",
                   {{"vllm_importance_sampling_mode", "sequence_truncate"},
                    {"vllm_importance_sampling_clip_max", 2.0},
                    {"vllm_importance_sampling_clip_min", 0.5}},
                   true});
  // TRL's entropy bonus through the trainer: dapo (a token-sum loss: the bonus is scaled by the
  // step's tokens, known when the step starts), grpo over two micro-batches with KL (both on the
  // fused path, the bonus as dL/dH), vespo on the autograd path (through the chunked entropy).
  const json bonus = {{"entropy_coef", 0.3}};
  cases.push_back({"dapo", 0.0, 2, "token", nullopt, kLearningRate, 1, "entropy_bonus", bonus});
  cases.push_back({"grpo", 0.04, 1, "token", nullopt, kLearningRate, 2, "entropy_bonus", bonus});
  cases.push_back({"vespo", 0.0, 1, "token", nullopt, kLearningRate, 1, "entropy_bonus", bonus});
  // Multi-turn batches (env_mask, TRL's tool_mask): the default loss over two passes; dapo (the
  // token-sum normaliser counts model tokens only) with KL over two micro-batches; GSPO (the
  // autograd path, the sequence's mean log-ratio over model tokens); the importance-sampling
  // correction on behaviour log-probs; the entropy bonus on the fused path.
  const json none = json::object();
  cases.push_back({"grpo", 0.0, 2, "token", nullopt, kLearningRate, 1, "", none, false, true});
  cases.push_back({"dapo", 0.04, 2, "token", nullopt, kLearningRate, 2, "", none, false, true});
  cases.push_back(
      {"grpo", 0.0, 2, "sequence", nullopt, kLearningRate / 16, 1, "", none, false, true});
  cases.push_back(
      {"dapo", 0.0, 2, "token", nullopt, kLearningRate, 1, "is_default", none, true, true});
  cases.push_back(
      {"dapo", 0.0, 1, "token", nullopt, kLearningRate, 1, "entropy_bonus", bonus, false, true});
  return cases;
}

// Parameters drawn at a scale where the policy is far from uniform (InitRandom's 0.02 is not);
// `perturbation` > 0 adds N(0, perturbation^2) noise drawn from `noise_seed` to every parameter
// (a reference model near the policy).
std::unique_ptr<common::Model> RandomModel(uint64_t seed, double perturbation = 0.0,
                                           uint64_t noise_seed = 0) {
  auto cfg = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto m = common::Model::InitRandom(*cfg, seed);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  at::Generator gen = at::detail::createCPUGenerator(seed + 1000);
  common::NamedTensors state;
  for (const auto& [name, t] : (*m)->NamedParameters()) {
    double scale = 0.2;
    double offset = 0.0;
    if (name.find("norm.weight") != std::string::npos) {
      offset = 1.0;
    } else if (name.find(".bias") != std::string::npos) {
      scale = 0.3;
    } else if (name == "model.embed_tokens.weight") {
      scale = 0.15;
    }
    state.emplace_back(name, offset + scale * at::randn(t.sizes(), gen));
  }
  if (perturbation > 0) {
    at::Generator noise = at::detail::createCPUGenerator(noise_seed);
    for (auto& [name, t] : state) t = t + perturbation * at::randn(t.sizes(), noise);
  }
  EXPECT_TRUE((*m)->LoadStateFrom(state).ok());
  return std::move(*m);
}

// Two groups of four completions: prompt and completion lengths vary, so rows are padded, and the
// groups (the micro-batches of a two-micro-batch step) hold different numbers of tokens.
std::vector<RolloutGroup> MakeGroups(bool with_behaviour = false) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tok(0, 255), plen(2, 6), clen(1, 9);
  std::uniform_real_distribution<double> rew(0.0, 1.0);
  std::vector<RolloutGroup> out;
  for (int g = 0; g < 2; ++g) {
    RolloutGroup rg;
    rg.prompt_id = "p" + std::to_string(g);
    for (int i = plen(rng); i > 0; --i) rg.prompt_ids.push_back(tok(rng));
    for (int j = 0; j < 4; ++j) {
      Completion c;
      for (int i = clen(rng); i > 0; --i) c.token_ids.push_back(tok(rng));
      c.rewards = {rew(rng)};
      rg.completions.push_back(c);
    }
    out.push_back(rg);
  }
  out[1].completions[0].token_ids.insert(out[1].completions[0].token_ids.end(), {17, 42, 99});
  if (with_behaviour) {  // near the tiny model's log-probs of random tokens, not equal to them
    std::mt19937 beh_rng(12);
    std::uniform_real_distribution<float> lp(-6.5f, -4.5f);
    for (RolloutGroup& g : out) {
      for (Completion& c : g.completions) {
        c.logprobs.clear();
        for (size_t i = 0; i < c.token_ids.size(); ++i) c.logprobs.push_back(lp(beh_rng));
      }
    }
  }
  return out;
}

// Two groups of four multi-turn completions: model tokens, 3-5 environment tokens (env_mask 0,
// behaviour log-prob 0), model tokens again, at different positions in each row; one row has two
// environment turns, and one is truncated (mask_truncated_completions drops it). Every row fits
// max_completion_length (kMaxCompletionLength), so no group is refused.
std::vector<RolloutGroup> MakeMultiTurnGroups(bool with_behaviour = false) {
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> tok(0, 255), plen(2, 6), turn(1, 4), env(3, 5);
  std::uniform_real_distribution<double> rew(0.0, 1.0);
  std::uniform_real_distribution<float> lp(-6.5f, -4.5f);
  std::vector<RolloutGroup> out;
  for (int g = 0; g < 2; ++g) {
    RolloutGroup rg;
    rg.prompt_id = "p" + std::to_string(g);
    for (int i = plen(rng); i > 0; --i) rg.prompt_ids.push_back(tok(rng));
    for (int j = 0; j < 4; ++j) {
      Completion c;
      const int env_turns = (g == 1 && j == 2) ? 2 : 1;
      auto append = [&](int n, uint8_t model) {
        for (int i = 0; i < n; ++i) {
          c.token_ids.push_back(tok(rng));
          c.env_mask.push_back(model);
          c.logprobs.push_back(model ? lp(rng) : 0.f);
        }
      };
      // Two environment turns: shorter turns, so that the row stays within
      // max_completion_length (2 + 3 + 2 + 3 + 2 tokens at most).
      const int max_turn = env_turns == 2 ? 2 : 4, max_env = env_turns == 2 ? 3 : 5;
      append(std::min(turn(rng), max_turn), 1);
      for (int e = 0; e < env_turns; ++e) {
        append(std::min(env(rng), max_env), 0);
        append(std::min(turn(rng), max_turn), 1);
      }
      if (!with_behaviour) c.logprobs.clear();
      c.truncated = (g == 0 && j == 1);
      c.rewards = {rew(rng)};
      rg.completions.push_back(c);
    }
    out.push_back(rg);
  }
  return out;
}

// One optimizer step per pass: 8 sequences = per_device_train_batch_size x
// gradient_accumulation_steps (= steps_per_generation).
common::GrpoConfig ConfigFor(const TrlCase& c) {
  common::GrpoConfig cfg;
  cfg.num_generations = 4;
  cfg.per_device_train_batch_size = 8 / c.gradient_accumulation_steps;
  cfg.gradient_accumulation_steps = c.gradient_accumulation_steps;
  cfg.num_iterations = c.num_iterations;
  cfg.max_completion_length = kMaxCompletionLength;
  cfg.temperature = kTemperature;
  cfg.loss_type = c.loss_type;
  cfg.beta = c.beta;
  cfg.epsilon = kEpsilon;
  cfg.epsilon_high = kEpsilonHigh;
  cfg.delta = c.delta;
  cfg.importance_sampling_level = c.importance_sampling_level;
  // TRL applies its correction only to vLLM's sampling log-probs, so only cases with behaviour
  // log-probs have one; they get TRL's default mode unless `extra` names another.
  cfg.importance_sampling_correction = c.with_behaviour ? "sequence_mask" : "none";
  cfg.learning_rate = c.learning_rate;
  cfg.lr_scheduler_type = "constant";
  cfg.max_grad_norm = 1.0;
  cfg.logprob_chunk_tokens = 7;  // several chunks per micro-batch
  cfg.mask_truncated_completions = c.multi_turn;
  for (const auto& [key, value] : c.extra.items()) {
    const Status s = common::SetConfigValue(
        cfg, key, value.is_string() ? value.get<std::string>() : value.dump());
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return cfg;
}

// The settings trl_grpo_ref.py needs to build TRL's trainer state for `c`.
json TrlSettings(const TrlCase& c) {
  json j = {{"loss_type", c.loss_type},
            {"beta", c.beta},
            {"epsilon", kEpsilon},
            {"epsilon_high", kEpsilonHigh},
            {"importance_sampling_level", c.importance_sampling_level},
            {"max_completion_length", kMaxCompletionLength},
            {"temperature", kTemperature},
            {"gradient_accumulation_steps", c.gradient_accumulation_steps},
            {"per_device_train_batch_size", 8 / c.gradient_accumulation_steps},
            {"grad_norm", true}};
  j["delta"] = c.delta ? json(*c.delta) : json();
  j["vllm_importance_sampling_mode"] = c.with_behaviour ? "sequence_mask" : "none";
  j.update(c.extra);
  return j;
}

// One optimizer step as our trainer dumped it, with TRL's numbers for the same step.
struct StepComparison {
  json ours;                   // the dump's "metrics" header
  json trl;                    // trl_grpo_ref.py's result; null when it failed
  at::Tensor ours_logps;       // [S, C] logprobs_first_micro_batch
  at::Tensor completion_mask;  // [S, C]
  at::Tensor env_mask;         // [S, C], or undefined when the dump has none
};

// Trains `c` from the same start (policy seed 7; reference: the policy plus noise) and returns the
// reference's inputs, one per step. The weights of step 2 are reproduced by a num_iterations-1 run
// of the same batch (the first step does not depend on whether `old` was precomputed);
// TrlScoresTokensAsOurLearnerDid checks that they score the tokens as step 2 did.
std::vector<json> TrainCase(const TrlCase& c, const fs::path& dir) {
  const std::vector<RolloutGroup> groups =
      c.multi_turn ? MakeMultiTurnGroups(c.with_behaviour) : MakeGroups(c.with_behaviour);
  auto train = [&](int64_t iterations, const std::string& dump_dir,
                   const std::string& save_start_as) {
    auto policy = RandomModel(7);
    if (!save_start_as.empty()) {
      EXPECT_TRUE(policy->Save(save_start_as).ok()) << save_start_as;
    }
    common::GrpoConfig cfg = ConfigFor(c);
    cfg.num_iterations = iterations;
    cfg.dump_batches_dir = dump_dir;
    auto trainer =
        GrpoTrainer::Create(cfg, policy.get(), c.beta != 0 ? RandomModel(7, 0.005, 8) : nullptr);
    EXPECT_TRUE(trainer.ok()) << trainer.status().ToString();
    if (!trainer.ok()) return policy;
    auto r = (*trainer)->TrainGenerationBatch(groups);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r.ok() ? r->steps.size() : 0u, static_cast<size_t>(iterations)) << c.Name();
    return policy;
  };
  train(c.num_iterations, (dir / "dump").string(), (dir / "start-1").string());
  if (c.num_iterations == 2) {
    auto after_first_step = train(1, "", "");
    EXPECT_TRUE(after_first_step->Save((dir / "start-2").string()).ok());
  }
  std::vector<json> steps;
  for (int64_t s = 1; s <= c.num_iterations; ++s) {
    json j = TrlSettings(c);
    j["model_dir"] = (dir / ("start-" + std::to_string(s))).string();
    char name[64];
    std::snprintf(name, sizeof(name), "step-%08lld.safetensors", static_cast<long long>(s));
    j["dump"] = (dir / "dump" / name).string();
    steps.push_back(j);
  }
  return steps;
}

// Case name -> its steps. Computed once for the suite: one Python process for every case.
const std::map<std::string, std::vector<StepComparison>>& Comparisons() {
  static const auto* comparisons = [] {
    auto* out = new std::map<std::string, std::vector<StepComparison>>();
    const fs::path root =
        fs::path(::testing::TempDir()) / ("grpo_trl_reference_" + std::to_string(::getpid()));
    std::error_code ec;
    fs::remove_all(root, ec);
    fs::create_directories(root, ec);
    json request = {{"cases", json::array()}};
    std::vector<std::pair<std::string, json>> order;
    for (const TrlCase& c : AllCases()) {
      for (json& step : TrainCase(c, root / c.Name())) {
        request["cases"].push_back(step);
        order.emplace_back(c.Name(), step);
      }
    }
    const json result = grpo::testing::RunReference("trl_grpo_ref.py", request);
    for (size_t i = 0; i < order.size(); ++i) {
      StepComparison sc;
      auto f = common::SafetensorsFile::Open(order[i].second["dump"].get<std::string>());
      EXPECT_TRUE(f.ok()) << f.status().ToString();
      if (f.ok()) {
        sc.ours = json::parse((*f)->metadata().at("metrics"));
        sc.ours_logps = *(*f)->Get("logprobs_first_micro_batch");
        sc.completion_mask = *(*f)->Get("completion_mask");
        if ((*f)->Find("env_mask") != nullptr) sc.env_mask = *(*f)->Get("env_mask");
      }
      if (result.is_object() && result.contains("cases")) sc.trl = result["cases"][i];
      (*out)[order[i].first].push_back(std::move(sc));
    }
    fs::remove_all(root, ec);
    return out;
  }();
  return *comparisons;
}

// Whether the reference interpreter imports TRL (asked once: the import takes seconds).
bool HasTrl() {
  static const bool has = grpo::testing::ReferencePythonHas("torch transformers trl");
  return has;
}

class TrlReference : public ::testing::TestWithParam<TrlCase> {
 protected:
  // The steps of this case; fails the test (empty) when Python, TRL or the reference is missing.
  std::vector<StepComparison> Steps() {
    EXPECT_TRUE(HasTrl()) << grpo::testing::ReferencePython()
                          << " cannot import trl (deploy/setup.sh)";
    const auto& all = Comparisons();
    auto it = all.find(GetParam().Name());
    EXPECT_NE(it, all.end());
    if (it == all.end()) return {};
    for (const auto& s : it->second) {
      EXPECT_FALSE(s.trl.is_null()) << "trl_grpo_ref.py gave no result";
      if (s.trl.is_null() || s.ours.is_null()) return {};
    }
    EXPECT_EQ(it->second.size(), static_cast<size_t>(GetParam().num_iterations));
    return it->second;
  }
};

// Same weights, tokens, positions and temperature: the per-token log-probs agree. For step 2
// this also proves the weights given to TRL are the ones the step started from.
TEST_P(TrlReference, TrlScoresTokensAsOurLearnerDid) {
  const auto steps = Steps();
  ASSERT_FALSE(steps.empty());
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto rows = steps[s].trl["per_token_logps"].get<std::vector<std::vector<float>>>();
    const at::Tensor& ours = steps[s].ours_logps;
    ASSERT_EQ(static_cast<int64_t>(rows.size()), ours.size(0));
    double max_diff = 0;
    for (int64_t i = 0; i < ours.size(0); ++i) {
      // Ours is padded to the micro-batch's longest completion, TRL's to the step's.
      ASSERT_GE(static_cast<int64_t>(rows[i].size()), ours.size(1));
      for (int64_t t = 0; t < ours.size(1); ++t) {
        if (steps[s].completion_mask[i][t].item<float>() == 0) continue;
        const double want = rows[i][t];
        max_diff = std::max(
            max_diff, std::abs(ours[i][t].item<double>() - want) / std::max(1.0, std::abs(want)));
      }
    }
    EXPECT_LE(max_diff, 1e-4) << "step " << s + 1
                              << ": largest difference relative to max(1, |logp|)";
  }
}

// Log-probs agree to ~1e-4 (above; float32, weights after a step), and the loss, a token mean of
// ratio * A terms that largely cancel, inherits that as an absolute error.
TEST_P(TrlReference, StepLossEqualsTrls) {
  const auto steps = Steps();
  ASSERT_FALSE(steps.empty());
  for (size_t s = 0; s < steps.size(); ++s) {
    const double trl = steps[s].trl["loss"].get<double>();
    EXPECT_NEAR(steps[s].ours["loss"].get<double>(), trl, 1e-4 + 1e-4 * std::abs(trl))
        << "step " << s + 1;
  }
}

// Our grad_norm is the norm before clipping (max_grad_norm 1), TRL's the norm of the gradient
// of its loss through the transformers model.
TEST_P(TrlReference, GradNormBeforeClippingEqualsTrls) {
  const auto steps = Steps();
  ASSERT_FALSE(steps.empty());
  for (size_t s = 0; s < steps.size(); ++s) {
    const double trl = steps[s].trl["grad_norm"].get<double>();
    EXPECT_GT(trl, 0.0) << "step " << s + 1;
    EXPECT_NEAR(steps[s].ours["grad_norm"].get<double>(), trl, 1e-6 + 1e-3 * trl)
        << "step " << s + 1;
  }
}

TEST_P(TrlReference, EntropyEqualsTrls) {
  const auto steps = Steps();
  ASSERT_FALSE(steps.empty());
  for (size_t s = 0; s < steps.size(); ++s) {
    const double trl = steps[s].trl["metrics"]["entropy"].get<double>();
    EXPECT_NEAR(steps[s].ours["entropy"].get<double>(), trl, 1e-4 * std::max(1.0, trl))
        << "step " << s + 1;
  }
}

// `entropy_coef` is logged exactly when the entropy bonus is on, as TRL does.
TEST_P(TrlReference, EntropyCoefEqualsTrls) {
  const auto steps = Steps();
  ASSERT_FALSE(steps.empty());
  for (size_t s = 0; s < steps.size(); ++s) {
    const json& trl = steps[s].trl["metrics"];
    ASSERT_EQ(steps[s].ours.contains("entropy_coef"), trl.contains("entropy_coef"))
        << "step " << s + 1;
    if (!trl.contains("entropy_coef")) continue;
    EXPECT_DOUBLE_EQ(steps[s].ours["entropy_coef"].get<double>(),
                     trl["entropy_coef"].get<double>());
  }
}

// `kl` is logged exactly when beta != 0, as TRL does.
TEST_P(TrlReference, KlEqualsTrls) {
  const auto steps = Steps();
  ASSERT_FALSE(steps.empty());
  for (size_t s = 0; s < steps.size(); ++s) {
    const json& trl = steps[s].trl["metrics"];
    ASSERT_EQ(steps[s].ours.contains("kl"), trl.contains("kl")) << "step " << s + 1;
    if (!trl.contains("kl")) continue;
    const double want = trl["kl"].get<double>();
    EXPECT_GT(want, 0.0);  // the reference model differs from the policy
    EXPECT_NEAR(steps[s].ours["kl"].get<double>(), want, 1e-6 + 1e-4 * want) << "step " << s + 1;
  }
}

// The objective's own metrics, under TRL's names: the clip ratios for the clipped surrogate,
// cispo_clip_ratio, vespo/phi_seq_mean; sapo logs none. Ours has exactly the ones TRL logs.
TEST_P(TrlReference, ObjectiveMetricsEqualTrls) {
  const auto steps = Steps();
  ASSERT_FALSE(steps.empty());
  std::vector<std::string> keys;
  switch (GetParam().Metric()) {
    case loss::ObjectiveMetric::kClipRatios:
      keys = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"};
      break;
    case loss::ObjectiveMetric::kCispoClipRatio:
      keys = {"cispo_clip_ratio"};
      break;
    case loss::ObjectiveMetric::kVespoPhi:
      keys = {"vespo/phi_seq_mean"};
      break;
    case loss::ObjectiveMetric::kNone:
      break;
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    for (const char* key : {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                            "cispo_clip_ratio", "vespo/phi_seq_mean"}) {
      const bool ours_has = steps[s].ours.contains(key);
      EXPECT_EQ(ours_has, steps[s].trl["metrics"].contains(key)) << key << " step " << s + 1;
      EXPECT_EQ(ours_has, std::find(keys.begin(), keys.end(), key) != keys.end()) << key;
    }
    for (const std::string& key : keys) {
      if (!steps[s].trl["metrics"].contains(key) || !steps[s].ours.contains(key)) continue;
      EXPECT_NEAR(steps[s].ours[key].get<double>(), steps[s].trl["metrics"][key].get<double>(),
                  1e-6)
          << key << " step " << s + 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryLossType, TrlReference, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<TrlCase>& info) {
                           return info.param.Name();
                         });

// The clip-ratio comparisons mean something: on the second pass TRL clips some tokens, low and
// high, for every loss type; and GSPO some sequences but not all (a gradient is left).
TEST(TrlReferenceSetup, SecondPassClipsTokensOnBothSides) {
  ASSERT_TRUE(HasTrl()) << grpo::testing::ReferencePython()
                        << " cannot import trl (deploy/setup.sh)";
  for (const TrlCase& c : AllCases()) {
    if (c.num_iterations != 2 || c.importance_sampling_level != "token" || c.delta ||
        c.Metric() != loss::ObjectiveMetric::kClipRatios || !c.tag.empty() || c.multi_turn) {
      continue;
    }
    const auto& steps = Comparisons().at(c.Name());
    ASSERT_EQ(steps.size(), 2u);
    ASSERT_FALSE(steps[1].trl.is_null());
    EXPECT_GT(steps[1].trl["metrics"]["clip_ratio/low_mean"].get<double>(), 0.0) << c.Name();
    EXPECT_GT(steps[1].trl["metrics"]["clip_ratio/high_mean"].get<double>(), 0.0) << c.Name();
  }
  const auto& gspo = Comparisons().at("grpo_nokl_iterations2_sequence");
  ASSERT_EQ(gspo.size(), 2u);
  ASSERT_FALSE(gspo[1].trl.is_null());
  const double region = gspo[1].trl["metrics"]["clip_ratio/region_mean"].get<double>();
  EXPECT_GT(region, 0.0);
  EXPECT_LT(region, 1.0);
}

// The multi-turn cases compare something: their dumps carry the env_mask (TRL got it as
// tool_mask) with environment tokens inside real completions, and `completions/mean_length` is
// the mean of the model tokens alone (TRL's), counted here by hand from the groups.
TEST(TrlReferenceSetup, MultiTurnStepsCarryTheEnvMaskAndCountModelTokens) {
  ASSERT_TRUE(HasTrl()) << grpo::testing::ReferencePython()
                        << " cannot import trl (deploy/setup.sh)";
  double model_tokens = 0, all_tokens = 0;
  for (const RolloutGroup& g : MakeMultiTurnGroups()) {
    for (const Completion& c : g.completions) {
      for (uint8_t m : c.env_mask) model_tokens += m;
      all_tokens += static_cast<double>(c.token_ids.size());
    }
  }
  ASSERT_GT(all_tokens - model_tokens, 8 * 3 - 1);  // every row has >= 3 environment tokens
  int multi_turn_cases = 0;
  for (const TrlCase& c : AllCases()) {
    if (!c.multi_turn) continue;
    ++multi_turn_cases;
    SCOPED_TRACE(c.Name());
    for (const StepComparison& s : Comparisons().at(c.Name())) {
      ASSERT_TRUE(s.env_mask.defined());
      // Environment tokens inside real (attended, trained-row) completion tokens.
      EXPECT_GT(((s.env_mask == 0) & (s.completion_mask == 1)).sum().item<int64_t>(), 8);
      EXPECT_EQ(s.ours["sequences"].get<int64_t>(), 8);  // no group refused
      EXPECT_DOUBLE_EQ(s.ours["completions/mean_length"].get<double>(), model_tokens / 8.0);
      EXPECT_DOUBLE_EQ(s.ours["completion_tokens"].get<double>(), model_tokens);
    }
  }
  EXPECT_EQ(multi_turn_cases, 5);
}

}  // namespace
}  // namespace grpo::learner
