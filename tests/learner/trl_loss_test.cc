// ComputeGrpoLoss against TRL 1.16's own `_compute_loss` on arbitrary [B, T] log-probs
// (tests/reference/trl_loss_ref.py binds it to a stand-in whose log-prob function returns ours):
// every loss type of the objective table, token- and sequence-level importance sampling, each
// option at TRL's default and at a non-default value (the entropy quantile mask included). Loss,
// dL/dlogp and every metric TRL logs for the loss type must equal ours (docs/GRPO_SPEC.md
// "Per-token loss", "Off-policy correction").
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "learner/grpo_loss.h"
#include "learner/loss/entropy_bonus.h"
#include "tests/learner/tensor_json.h"
#include "tests/test_util.h"

namespace grpo::learner {
namespace {

using nlohmann::json;
using ISC = ImportanceSamplingCorrection;

using grpo::testing::ToJson;

struct Variant {
  std::string name;
  std::function<void(GrpoLossConfig&)> set;
  bool with_old = true;
  bool with_beh = false;
  // The entropy bonus (loss/entropy_bonus.h): its controller, and the previous step's entropy
  // (TRL's _last_world_entropy; NaN: none yet, TRL's +inf).
  loss::EntropyControlConfig entropy{};
  double last_entropy = std::nan("");
};

loss::EntropyControlConfig Bonus(double coef, bool adaptive = false, double target = 0.2) {
  loss::EntropyControlConfig e;
  e.entropy_coef = coef;
  e.adaptive = adaptive;
  e.coef_delta = 0.02;
  e.coef_max = 0.11;  // the update below target is clamped here
  e.target = target;
  return e;
}

// The variants every objective runs at both importance-sampling levels. "defaults" is TRL's
// configuration; each other one changes one thing (or one family's parameters).
std::vector<Variant> Variants() {
  return {
      {"defaults", [](GrpoLossConfig&) {}},
      {"on_policy", [](GrpoLossConfig&) {}, false},
      {"clip_higher_delta",
       [](GrpoLossConfig& c) {
         c.epsilon_high = 0.28;
         c.delta = 1.5;
       }},
      {"kl_bias_corrected", [](GrpoLossConfig& c) { c.beta = 0.04; }},  // TRL's default
      {"kl_plain",
       [](GrpoLossConfig& c) {
         c.beta = 0.04;
         c.use_bias_correction_kl = false;
       }},
      {"is_sequence_mask",
       [](GrpoLossConfig& c) { c.importance_sampling_correction = ISC::kSequenceMask; }, true,
       true},  // TRL's default mode and bounds: cap 3, no lower bound
      {"is_sequence_mask_on_policy",
       [](GrpoLossConfig& c) { c.importance_sampling_correction = ISC::kSequenceMask; }, false,
       true},
      {"is_sequence_truncate",
       [](GrpoLossConfig& c) {
         c.importance_sampling_correction = ISC::kSequenceTruncate;
         c.importance_sampling_cap = 2.0;
         c.importance_sampling_min = 0.5;
       },
       true, true},
      {"is_token_truncate",
       [](GrpoLossConfig& c) {
         c.importance_sampling_correction = ISC::kTokenTruncate;
         c.importance_sampling_cap = 1.5;
         c.importance_sampling_min = 0.8;
       },
       true, true},
      {"is_token_mask",
       [](GrpoLossConfig& c) {
         c.importance_sampling_correction = ISC::kTokenMask;
         c.importance_sampling_cap = 1.5;
       },
       true, true},
      {"off_policy_mask_behaviour", [](GrpoLossConfig& c) { c.off_policy_mask_threshold = 0.1; },
       true, true},
      {"off_policy_mask_old", [](GrpoLossConfig& c) { c.off_policy_mask_threshold = 0.1; }},
      {"top_entropy_quantile", [](GrpoLossConfig& c) { c.top_entropy_quantile = 0.4; }},
      {"objective_parameters",
       [](GrpoLossConfig& c) {
         c.epsilon_high = 1.3;  // cispo's epsilon_max
         c.sapo_temperature_pos = 0.8;
         c.sapo_temperature_neg = 1.3;
         c.vespo_k_pos = 1.5;
         c.vespo_lambda_pos = 2.5;
         c.vespo_k_neg = 2.5;
         c.vespo_lambda_neg = 1.5;
       }},
      {"everything",
       [](GrpoLossConfig& c) {
         c.beta = 0.1;
         c.epsilon_high = 0.3;
         c.importance_sampling_correction = ISC::kTokenTruncate;
         c.importance_sampling_cap = 2.0;
         c.off_policy_mask_threshold = 0.2;
         c.max_completion_length = 10;
       },
       true, true},
      // TRL's entropy bonus: static; with the 80/20 mask (it acts on the same tokens); adaptive
      // below its target (applied, then raised to the max), above it (applied, then lowered) and
      // on the first step (no previous entropy: not applied, then updated).
      {"entropy_bonus", [](GrpoLossConfig&) {}, true, false, Bonus(0.05)},
      {"entropy_bonus_top_entropy", [](GrpoLossConfig& c) { c.top_entropy_quantile = 0.4; }, true,
       false, Bonus(0.05)},
      {"adaptive_entropy_below_target", [](GrpoLossConfig&) {}, true, false, Bonus(0.1, true, 5.0),
       1.0},
      {"adaptive_entropy_above_target", [](GrpoLossConfig&) {}, true, false, Bonus(0.1, true, 0.5),
       0.3},
      {"adaptive_entropy_first_step", [](GrpoLossConfig&) {}, true, false, Bonus(0.1, true, 5.0)},
  };
}

// TRL's GRPOConfig spelling of `c` (and of the entropy bonus `e`), for trl_loss_ref.py.
json TrlConfig(const GrpoLossConfig& c, const loss::EntropyControlConfig& e) {
  json j = {{"loss_type", std::string(LossTypeName(c.loss_type))},
            {"epsilon", c.epsilon},
            {"beta", c.beta},
            {"importance_sampling_level",
             std::string(ImportanceSamplingLevelName(c.importance_sampling_level))},
            {"max_completion_length", c.max_completion_length},
            {"use_bias_correction_kl", c.use_bias_correction_kl},
            {"vllm_importance_sampling_mode",
             std::string(ImportanceSamplingCorrectionName(c.importance_sampling_correction))},
            {"vllm_importance_sampling_clip_max", c.importance_sampling_cap},
            {"sapo_temperature_pos", c.sapo_temperature_pos},
            {"sapo_temperature_neg", c.sapo_temperature_neg},
            {"vespo_k_pos", c.vespo_k_pos},
            {"vespo_lambda_pos", c.vespo_lambda_pos},
            {"vespo_k_neg", c.vespo_k_neg},
            {"vespo_lambda_neg", c.vespo_lambda_neg},
            {"top_entropy_quantile", c.top_entropy_quantile},
            {"entropy_coef", e.entropy_coef},
            {"use_adaptive_entropy", e.adaptive},
            {"entropy_coef_min", e.coef_min},
            {"entropy_coef_max", e.coef_max},
            {"entropy_coef_delta", e.coef_delta},
            {"entropy_target", e.target}};
  j["epsilon_high"] = c.epsilon_high ? json(*c.epsilon_high) : json();
  j["delta"] = c.delta ? json(*c.delta) : json();
  j["vllm_importance_sampling_clip_min"] =
      c.importance_sampling_min ? json(*c.importance_sampling_min) : json();
  j["off_policy_mask_threshold"] =
      c.off_policy_mask_threshold ? json(*c.off_policy_mask_threshold) : json();
  return j;
}

// TRL casts the clip flags to float32 before taking their mean.
constexpr double kFlag = 1e-7;

struct Ours {
  std::string name;
  GrpoLossConfig config;
  double loss = 0;
  at::Tensor grad;
  GrpoLossMetrics metrics;
  at::Tensor entropy_grad;  // with the bonus
  double coef_after = 0, last_entropy_after = 0;
  // With LossBatch::env_noise: the loss and dL/dlogp again with the environment tokens' logp,
  // behaviour log-probs and entropy changed.
  double loss_env_changed = 0;
  at::Tensor grad_env_changed;
};

// The [b, t] inputs every case of a test shares. `mask` is ours (GrpoLossInputs::mask, what the
// trainer trains on); TRL gets `completion_mask` and, when defined, `tool_mask` (multi-turn:
// ours is their product).
struct LossBatch {
  at::Tensor logp0, old, beh, ref, adv, entropy;
  at::Tensor mask, completion_mask, tool_mask;
  LossNormaliser norm;
  at::Tensor env_noise;  // [b, t], nonzero only where tool_mask is 0; or undefined
};

// Runs every objective at both importance-sampling levels under every variant on `in`, ours
// here, and appends TRL's case for each to `request`.
std::vector<Ours> RunEveryVariant(const LossBatch& lb, json* request) {
  std::vector<Ours> ours;
  for (const loss::Objective& objective : loss::Objectives()) {
    for (auto level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
      for (const Variant& v : Variants()) {
        GrpoLossConfig cfg;
        cfg.loss_type = objective.type;
        cfg.importance_sampling_level = level;
        v.set(cfg);
        if (!cfg.Validate().ok()) {  // vespo with a sequence-level correction: refused (below)
          EXPECT_EQ(objective.type, LossType::kVespo) << v.name;
          continue;
        }
        const bool bonus = v.entropy.enabled();
        loss::EntropyController control(v.entropy);
        if (!std::isnan(v.last_entropy)) control.Restore(v.entropy.entropy_coef, v.last_entropy);
        cfg.entropy_coef = control.ApplyCoef();
        // noise = 0: the case itself; else its environment tokens changed (ours only).
        auto run = [&](const at::Tensor& noise, at::Tensor* logp, at::Tensor* entropy_leaf) {
          *logp = (lb.logp0 + noise).requires_grad_(true);
          *entropy_leaf = (lb.entropy + noise.abs()).requires_grad_(bonus);
          GrpoLossInputs in{.logp = *logp,
                            .old = v.with_old ? lb.old : at::Tensor(),
                            .beh = v.with_beh ? lb.beh + noise : at::Tensor(),
                            .ref = cfg.beta != 0 ? lb.ref : at::Tensor(),
                            .advantages = lb.adv,
                            .mask = lb.mask,
                            .entropy = *entropy_leaf};
          return ComputeGrpoLoss(cfg, in, lb.norm);
        };
        at::Tensor logp, entropy_leaf;
        auto out = run(at::zeros_like(lb.logp0), &logp, &entropy_leaf);
        const std::string name = std::string(objective.name) + "/" +
                                 std::string(ImportanceSamplingLevelName(level)) + "/" + v.name;
        EXPECT_TRUE(out.ok()) << name << ": " << out.status().ToString();
        if (!out.ok()) return {};
        out->loss.backward();
        Ours o;
        o.name = name;
        o.config = cfg;
        o.loss = out->loss.item<double>();
        o.grad = logp.grad().clone();
        o.metrics = out->metrics;
        if (bonus) {
          control.EndStep(out->metrics.entropy_sum, out->metrics.entropy_tokens);
          // A coefficient of 0 (the adaptive gate closed) adds no term: no gradient, TRL's zeros.
          o.entropy_grad = entropy_leaf.grad().defined() ? entropy_leaf.grad().clone()
                                                         : at::zeros_like(entropy_leaf);
          o.coef_after = control.coef();
          o.last_entropy_after = control.last_entropy();
        }
        if (lb.env_noise.defined()) {
          auto changed = run(lb.env_noise, &logp, &entropy_leaf);
          EXPECT_TRUE(changed.ok()) << name << ": " << changed.status().ToString();
          if (!changed.ok()) return {};
          changed->loss.backward();
          o.loss_env_changed = changed->loss.item<double>();
          o.grad_env_changed = logp.grad().clone();
        }
        ours.push_back(o);
        json c = {{"logp", ToJson(lb.logp0)},
                  {"advantages", ToJson(lb.adv)},
                  {"mask", ToJson(lb.completion_mask)},
                  {"entropy", ToJson(lb.entropy)},
                  {"config", TrlConfig(cfg, v.entropy)},
                  {"num_items_in_batch", lb.norm.step_completion_tokens},
                  {"gradient_accumulation_steps", lb.norm.gradient_accumulation_steps}};
        if (lb.tool_mask.defined()) c["tool_mask"] = ToJson(lb.tool_mask);
        if (v.with_old) c["old"] = ToJson(lb.old);
        if (v.with_beh) c["beh"] = ToJson(lb.beh);
        if (cfg.beta != 0) c["ref"] = ToJson(lb.ref);
        if (!std::isnan(v.last_entropy)) c["last_world_entropy"] = v.last_entropy;
        (*request)["cases"].push_back(c);
      }
    }
  }
  return ours;
}

// Loss, dL/dlogp, dL/dH with the bonus, the controller's state and every metric TRL logs for
// the objective: ours equals TRL's (`res`, trl_loss_ref.py's answer), case by case. Returns TRL's
// loss by case name.
std::map<std::string, double> ExpectOursEqualsTrl(const std::vector<Ours>& ours, const json& res) {
  std::map<std::string, double> trl_loss;
  EXPECT_TRUE(res.is_object());
  if (!res.is_object()) return trl_loss;
  EXPECT_EQ(res["cases"].size(), ours.size());
  if (res["cases"].size() != ours.size()) return trl_loss;
  for (size_t i = 0; i < ours.size(); ++i) {
    const Ours& o = ours[i];
    SCOPED_TRACE(o.name);
    const int64_t b = o.grad.size(0), t = o.grad.size(1);
    const json& e = res["cases"][i];
    const json& m = e["metrics"];
    trl_loss[o.name] = e["loss"].get<double>();
    EXPECT_NEAR(o.loss, e["loss"].get<double>(), 1e-10);
    EXPECT_NEAR(o.metrics.loss, e["loss"].get<double>(), 1e-10);
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t c = 0; c < t; ++c) {
        EXPECT_NEAR(o.grad[r][c].item<double>(), e["grad"][r][c].get<double>(), 1e-10)
            << "grad[" << r << "][" << c << "]";
      }
    }
    EXPECT_EQ(o.entropy_grad.defined(), e.contains("entropy_grad"));
    if (o.entropy_grad.defined() && e.contains("entropy_grad")) {
      for (int64_t r = 0; r < b; ++r) {
        for (int64_t c = 0; c < t; ++c) {
          EXPECT_NEAR(o.entropy_grad[r][c].item<double>(), e["entropy_grad"][r][c].get<double>(),
                      1e-12)
              << "entropy_grad[" << r << "][" << c << "]";
        }
      }
      EXPECT_NEAR(o.coef_after, e["entropy_coef"].get<double>(), 1e-15);
      EXPECT_NEAR(o.coef_after, m.at("entropy_coef").get<double>(), 1e-15);
      EXPECT_TRUE(e["last_world_entropy"].is_number() || std::isinf(o.last_entropy_after));
      if (e["last_world_entropy"].is_number()) {
        EXPECT_NEAR(o.last_entropy_after, e["last_world_entropy"].get<double>(), 1e-12);
      }
    }
    EXPECT_EQ(o.metrics.has_kl, m.contains("kl"));
    if (o.metrics.has_kl && m.contains("kl")) {
      EXPECT_NEAR(o.metrics.KlMean(), m["kl"].get<double>(), 1e-12);
    }
    switch (loss::ObjectiveOf(o.config.loss_type).metric) {
      case loss::ObjectiveMetric::kClipRatios:
        EXPECT_NEAR(o.metrics.ClipLowMean(), m.at("clip_ratio/low_mean").get<double>(), kFlag);
        EXPECT_NEAR(o.metrics.ClipHighMean(), m.at("clip_ratio/high_mean").get<double>(), kFlag);
        EXPECT_NEAR(o.metrics.ClipRegionMean(), m.at("clip_ratio/region_mean").get<double>(),
                    kFlag);
        break;
      case loss::ObjectiveMetric::kCispoClipRatio:
        EXPECT_NEAR(o.metrics.ClipHighMean(), m.at("cispo_clip_ratio").get<double>(), kFlag);
        EXPECT_FALSE(m.contains("clip_ratio/high_mean"));
        break;
      case loss::ObjectiveMetric::kVespoPhi:
        EXPECT_NEAR(o.metrics.PhiMean(), m.at("vespo/phi_seq_mean").get<double>(), 1e-12);
        break;
      case loss::ObjectiveMetric::kNone:
        EXPECT_FALSE(m.contains("clip_ratio/high_mean"));
        break;
    }
  }
  return trl_loss;
}

// The comparisons mean something: each correction changes TRL's loss somewhere, and the clipped
// objectives clip on both sides.
void ExpectVariantsMatter(const std::vector<Ours>& ours, std::map<std::string, double>& trl_loss) {
  for (const char* variant :
       {"kl_bias_corrected", "is_sequence_mask", "is_sequence_truncate", "is_token_truncate",
        "is_token_mask", "off_policy_mask_behaviour", "off_policy_mask_old", "top_entropy_quantile",
        "objective_parameters", "entropy_bonus", "adaptive_entropy_below_target"}) {
    int changed = 0;
    for (const loss::Objective& objective : loss::Objectives()) {
      const std::string base = std::string(objective.name) + "/token/";
      const double against =
          trl_loss[base + (std::string(variant) == "kl_bias_corrected" ? "kl_plain" : "defaults")];
      if (trl_loss.count(base + variant) && std::abs(trl_loss[base + variant] - against) > 1e-6) {
        ++changed;
      }
    }
    EXPECT_GE(changed, 4) << variant << " changes the loss of too few objectives";
  }
  double low = 0, high = 0;
  for (const Ours& o : ours) {
    low += o.metrics.ClipLowMean();
    high += o.metrics.ClipHighMean();
  }
  EXPECT_GT(low, 0);
  EXPECT_GT(high, 0);
}

// The shared random inputs of both tests, [b, t] (seed 7).
LossBatch RandomBatch(int64_t b, int64_t t) {
  at::manual_seed(7);
  const auto opts = at::dtype(at::kDouble);
  LossBatch lb;
  lb.logp0 = -at::rand({b, t}, opts) * 3 - 0.05;
  lb.old = lb.logp0 + 0.5 * at::randn({b, t}, opts);
  lb.old[1] += 1.0;  // row 1 (A < 0) far off-policy: the off-policy mask drops it, its tokens clip
  lb.beh = lb.old + 0.5 * at::randn({b, t}, opts);
  lb.ref = lb.logp0 + 0.3 * at::randn({b, t}, opts);
  lb.adv = at::tensor({1.3, -0.7, 0.4, -1.1}, opts);
  // Float32 as the model gives it (TRL takes the quantile in float32).
  lb.entropy = (at::rand({b, t}, opts) * 4).to(at::kFloat).to(at::kDouble);
  return lb;
}

TEST(TrlLoss, EveryObjectiveAndOptionEqualsTrls) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch trl"))
      << grpo::testing::ReferencePython() << " cannot import trl (deploy/setup.sh)";
  const int64_t b = 4, t = 6;
  LossBatch lb = RandomBatch(b, t);
  // The last row is all masked (a truncated completion under mask_truncated_completions).
  const std::vector<double> mask_values = {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0,
                                           1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  lb.mask = at::tensor(mask_values, at::kDouble).view({b, t});
  lb.completion_mask = lb.mask;
  lb.norm = LossNormaliser{.step_completion_tokens = 25, .gradient_accumulation_steps = 3};

  json request = {{"cases", json::array()}};
  const std::vector<Ours> ours = RunEveryVariant(lb, &request);
  ASSERT_FALSE(ours.empty());
  std::map<std::string, double> trl_loss =
      ExpectOursEqualsTrl(ours, grpo::testing::RunReference("trl_loss_ref.py", request));
  ExpectVariantsMatter(ours, trl_loss);
}

// Multi-turn (docs/GRPO_SPEC.md "Environment tokens"): environment tokens in the middle of
// completions, at different places per row, are TRL's tool_mask 0. TRL's _compute_loss given
// completion_mask and tool_mask equals ours given their product (what the trainer passes), for
// every objective and option, the token-sum normaliser counting model tokens only (TRL's
// num_items_in_batch); the environment tokens get no gradient, and changing their log-probs,
// behaviour log-probs or entropies changes nothing.
TEST(TrlLoss, MultiTurnToolMaskEqualsTrls) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch trl"))
      << grpo::testing::ReferencePython() << " cannot import trl (deploy/setup.sh)";
  const int64_t b = 4, t = 10;
  LossBatch lb = RandomBatch(b, t);
  // Row 3 is truncated (completion_mask all 0 under mask_truncated_completions).
  lb.completion_mask = at::tensor(std::vector<double>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                                      1, 1, 1, 1, 1, 1, 1, 1, 0, 0,  //
                                                      1, 1, 1, 1, 1, 1, 0, 0, 0, 0,  //
                                                      0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
                                  at::kDouble)
                           .view({b, t});
  // Environment tokens (0) after the first model turn; 1 at padding, as TRL pads tool_mask.
  lb.tool_mask = at::tensor(std::vector<double>{1, 1, 0, 0, 0, 1, 1, 1, 1, 1,  //
                                                1, 1, 1, 1, 0, 0, 0, 0, 1, 1,  //
                                                1, 0, 0, 0, 1, 1, 1, 1, 1, 1,  //
                                                1, 1, 1, 0, 0, 0, 0, 1, 1, 1},
                            at::kDouble)
                     .view({b, t});
  lb.mask = lb.completion_mask * lb.tool_mask;
  // By hand: 7 + 4 + 3 model tokens in the rows trained on.
  ASSERT_EQ(lb.mask.sum().item<double>(), 14.0);
  lb.norm = LossNormaliser{.step_completion_tokens = 14, .gradient_accumulation_steps = 2};
  // The rollout sends behaviour log-prob 0 on environment tokens.
  lb.beh = lb.beh * lb.tool_mask;
  lb.env_noise = (1.0 - lb.tool_mask) * at::randn({b, t}, at::kDouble);

  json request = {{"cases", json::array()}};
  const std::vector<Ours> ours = RunEveryVariant(lb, &request);
  ASSERT_FALSE(ours.empty());
  std::map<std::string, double> trl_loss =
      ExpectOursEqualsTrl(ours, grpo::testing::RunReference("trl_loss_ref.py", request));
  ExpectVariantsMatter(ours, trl_loss);
  const at::Tensor env = lb.tool_mask == 0;
  for (const Ours& o : ours) {
    SCOPED_TRACE(o.name);
    EXPECT_EQ(o.grad.masked_select(env).abs().max().item<double>(), 0.0);
    EXPECT_EQ(o.loss_env_changed, o.loss);
    EXPECT_TRUE(at::equal(o.grad_env_changed, o.grad));
  }
  // The tool mask matters: TRL's default loss without it is another number.
  json without = request["cases"][0];
  ASSERT_EQ(ours[0].name, "grpo/token/defaults");
  without.erase("tool_mask");
  const json res = grpo::testing::RunReference("trl_loss_ref.py", {{"cases", {without}}});
  ASSERT_TRUE(res.is_object());
  EXPECT_GT(std::abs(res["cases"][0]["loss"].get<double>() - trl_loss["grpo/token/defaults"]),
            1e-3);
}

TEST(TrlLoss, VespoRefusesSequenceLevelCorrectionAsTrlDoes) {
  for (ISC mode : {ISC::kSequenceMask, ISC::kSequenceTruncate}) {
    GrpoLossConfig cfg;
    cfg.loss_type = LossType::kVespo;
    cfg.importance_sampling_correction = mode;
    const Status s = cfg.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("vespo"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace grpo::learner
