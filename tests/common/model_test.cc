#include "common/model/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/model/model_config.h"
#include "common/model/safetensors.h"
#include "tests/test_util.h"

namespace grpo::common {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("grpo_model_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path SourceDir() {
  if (const char* env = std::getenv("GRPO_SOURCE_DIR"); env != nullptr && *env) return env;
  return fs::path(__FILE__).parent_path().parent_path().parent_path();
}

json SmallConfigJson(const std::string& model_type) {
  json j = {{"model_type", model_type},    {"vocab_size", 97},
            {"hidden_size", 32},           {"intermediate_size", 64},
            {"num_hidden_layers", 2},      {"num_attention_heads", 4},
            {"num_key_value_heads", 2},    {"max_position_embeddings", 128},
            {"rms_norm_eps", 1e-6},        {"rope_theta", 10000.0},
            {"tie_word_embeddings", true}, {"eos_token_id", 5},
            {"torch_dtype", "float32"}};
  if (model_type == "qwen3") {
    j["head_dim"] = 16;  // != hidden / heads, as in real Qwen3 models
    j["tie_word_embeddings"] = false;
    j["rope_theta"] = 1000000.0;
    j["attention_bias"] = false;
  } else if (model_type == "llama") {
    j["attention_bias"] = true;
    j["num_key_value_heads"] = 1;
    j["rms_norm_eps"] = 1e-5;
    j["rope_theta"] = 500000.0;
  }
  return j;
}

ModelConfig SmallConfig(const std::string& model_type) {
  auto c = ModelConfig::FromJson(SmallConfigJson(model_type), "test config");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

// Every parameter drawn at a scale where mistakes show in the logits (InitRandom's 0.02 would
// make attention nearly uniform and norms exactly 1).
std::unique_ptr<Model> RandomModel(const ModelConfig& config, uint64_t seed) {
  auto m = Model::InitRandom(config, seed);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  at::Generator gen = at::detail::createCPUGenerator(seed + 1000);
  NamedTensors state;
  for (const auto& [name, t] : (*m)->NamedParameters()) {
    at::Tensor r;
    if (name.find("norm.weight") != std::string::npos) {
      r = 1.0 + 0.3 * at::randn(t.sizes(), gen);
    } else if (name.find(".bias") != std::string::npos) {
      r = 0.3 * at::randn(t.sizes(), gen);
    } else if (name == "model.embed_tokens.weight") {
      r = at::randn(t.sizes(), gen);
    } else {
      r = 0.2 * at::randn(t.sizes(), gen);
    }
    state.emplace_back(name, r);
  }
  EXPECT_TRUE((*m)->LoadStateFrom(state).ok());
  return std::move(*m);
}

at::Tensor FullLogits(const Model& m, const at::Tensor& ids, const at::Tensor& mask) {
  at::NoGradGuard no_grad;
  return m.Logits(m.ForwardHidden(ids, mask));
}

// ------------------------------------------------------------------------------------------
// ModelConfig

TEST(ModelConfig, ParsesQwen3WithExplicitHeadDimAndEosList) {
  json j = SmallConfigJson("qwen3");
  j["eos_token_id"] = {5, 7};
  j["bos_token_id"] = nullptr;
  auto c = ModelConfig::FromJson(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{5, 7}));
  EXPECT_FALSE(c->bos_token_id.has_value());
}

TEST(ModelConfig, Qwen2AlwaysHasQkvBiasAndDefaultsKvHeadsAndHeadDim) {
  json j = SmallConfigJson("qwen2");
  j.erase("num_key_value_heads");
  j["attention_bias"] = false;  // Qwen2Attention ignores it: q/k/v are always biased
  auto c = ModelConfig::FromJson(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->o_proj_bias());
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 8);
}

TEST(ModelConfig, LlamaAttentionBiasDefaultsToFalse) {
  json j = SmallConfigJson("llama");
  j.erase("attention_bias");
  auto c = ModelConfig::FromJson(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->attention_bias);
}

TEST(ModelConfig, ToJsonRoundTrips) {
  for (const char* type : {"qwen2", "qwen3", "llama"}) {
    ModelConfig c = SmallConfig(type);
    auto back = ModelConfig::FromJson(c.ToJson(), "roundtrip");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->ToJson(), c.ToJson()) << type;
  }
}

TEST(ModelConfig, PresetsMatchTheDocumentedModels) {
  auto tiny = ModelConfigPreset("tiny");
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->model_type, "qwen2");
  EXPECT_EQ(tiny->vocab_size, 259);
  EXPECT_EQ(tiny->hidden_size, 64);
  EXPECT_EQ(tiny->num_hidden_layers, 2);
  EXPECT_EQ(tiny->num_attention_heads, 4);
  EXPECT_EQ(tiny->num_key_value_heads, 2);
  EXPECT_EQ(tiny->intermediate_size, 176);
  EXPECT_EQ(tiny->max_position_embeddings, 512);
  EXPECT_TRUE(tiny->tie_word_embeddings);
  EXPECT_EQ(tiny->eos_token_ids, (std::vector<int64_t>{258}));

  auto bench = ModelConfigPreset("bench");
  ASSERT_TRUE(bench.ok());
  EXPECT_EQ(bench->vocab_size, 32768);
  EXPECT_EQ(bench->hidden_size, 256);
  EXPECT_EQ(bench->num_hidden_layers, 4);
  EXPECT_EQ(bench->num_attention_heads, 4);
  EXPECT_EQ(bench->num_key_value_heads, 2);
  EXPECT_EQ(bench->intermediate_size, 704);
  EXPECT_TRUE(bench->tie_word_embeddings);
  auto m = Model::InitRandom(*bench, 1);
  ASSERT_TRUE(m.ok());
  // docs/BENCHMARKS.md: "about 11 M parameters".
  EXPECT_NEAR(static_cast<double>((*m)->NumParameters()), 11e6, 1e6);

  EXPECT_EQ(ModelConfigPreset("huge").status().code(), StatusCode::kNotFound);
}

// ------------------------------------------------------------------------------------------
// Correctness against Hugging Face transformers' own Qwen2 / Qwen3 / Llama classes, loading the
// directory Model::Save wrote (tests/reference/hf_model_ref.py): logits, per-token log-probs and
// the gradient of one scalar loss of them, fp32, with left and right padding.

void ExpectMatchesHfReference(const std::string& model_type) {
  const fs::path script = SourceDir() / "tests/reference/hf_model_ref.py";
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch transformers"))
      << grpo::testing::ReferencePython() << " cannot import transformers (deploy/setup.sh)";
  ASSERT_TRUE(fs::exists(script)) << script;

  std::unique_ptr<Model> model = RandomModel(SmallConfig(model_type), 7);
  TempDir dir;
  ASSERT_TRUE(model->Save(dir.path()).ok());

  // Rows: no padding, left padding, right padding, both.
  const std::vector<std::vector<int64_t>> ids = {{3, 14, 15, 92, 65, 35, 89, 79},
                                                 {0, 0, 0, 23, 84, 62, 64, 33},
                                                 {27, 95, 2, 88, 41, 0, 0, 0},
                                                 {0, 71, 69, 39, 93, 75, 10, 0}};
  const std::vector<std::vector<int64_t>> mask = {{1, 1, 1, 1, 1, 1, 1, 1},
                                                  {0, 0, 0, 1, 1, 1, 1, 1},
                                                  {1, 1, 1, 1, 1, 0, 0, 0},
                                                  {0, 1, 1, 1, 1, 1, 1, 0}};
  const int64_t b = 4, t = 8, v = model->config().vocab_size;
  // Weights of the scalar loss: distinct per position so that a misplaced gradient shows.
  std::vector<std::vector<double>> weights(b, std::vector<double>(t));
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < t; ++j) weights[i][j] = 0.25 + 0.1 * i - 0.05 * j;
  }
  WriteText(dir / "input.json",
            json({{"input_ids", ids}, {"attention_mask", mask}, {"loss_weights", weights}}).dump());
  const std::string cmd = "'" + grpo::testing::ReferencePython() + "' '" + script.string() + "' '" +
                          dir.path() + "' '" + (dir / "input.json") + "' '" + (dir / "ref.json") +
                          "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  json ref = json::parse(ReadText(dir / "ref.json"));
  ASSERT_EQ(ref["shape"], json({b, t, v}));
  std::vector<float> flat = ref["logits"].get<std::vector<float>>();
  at::Tensor expected = at::from_blob(flat.data(), {b, t, v}, at::kFloat).clone();

  at::Tensor ids_t = at::empty({b, t}, at::kLong), mask_t = at::empty({b, t}, at::kLong);
  at::Tensor w_t = at::empty({b, t}, at::kFloat);
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < t; ++j) {
      ids_t[i][j] = ids[i][j];
      mask_t[i][j] = mask[i][j];
      w_t[i][j] = weights[i][j];
    }
  }
  at::Tensor got = FullLogits(*model, ids_t, mask_t);
  ASSERT_EQ(got.sizes(), expected.sizes());
  at::Tensor real = mask_t.to(at::kBool).unsqueeze(-1);
  const double max_diff = ((got - expected).abs() * real).max().item<double>();
  EXPECT_LE(max_diff, 1e-4) << model_type;
  // The comparison means something: logits are O(1) and differ across positions.
  EXPECT_GT((expected * real).abs().max().item<double>(), 0.5);

  // Log-probs of each next token and the gradient of L = sum w * mask * logp, with autograd.
  model->SetRequiresGrad(true);
  at::Tensor logp = at::log_softmax(model->Logits(model->ForwardHidden(ids_t, mask_t)), -1)
                        .narrow(1, 0, t - 1)
                        .gather(-1, ids_t.narrow(1, 1, t - 1).unsqueeze(-1))
                        .squeeze(-1);  // [B, T-1]
  // A log-prob counts where the token and its context position are real (a left-padded row's
  // first real token is predicted from padding: garbage on both sides).
  at::Tensor m = (mask_t.narrow(1, 1, t - 1) * mask_t.narrow(1, 0, t - 1)).to(at::kFloat);
  at::Tensor loss = (w_t.narrow(1, 1, t - 1) * m * logp).sum();
  loss.backward();
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 1; j < t; ++j) {
      if (mask[i][j] == 0 || mask[i][j - 1] == 0) continue;
      EXPECT_NEAR(logp[i][j - 1].item<double>(), ref["logprobs"][i][j].get<double>(), 1e-4)
          << model_type << " row " << i << " t " << j;
    }
  }
  EXPECT_NEAR(loss.item<double>(), ref["loss"].get<double>(), 1e-3 * std::abs(loss.item<double>()));
  const json& grads = ref["grads"];
  NamedTensors ours = model->NamedParameters();
  std::map<std::string, at::Tensor> by_name(ours.begin(), ours.end());
  ASSERT_EQ(by_name.size(), grads.size()) << model_type;
  for (const auto& [name, values] : grads.items()) {
    ASSERT_TRUE(by_name.count(name)) << model_type << ": transformers has " << name;
    const at::Tensor& p = by_name[name];
    ASSERT_TRUE(p.grad().defined()) << name;
    std::vector<float> g = values.get<std::vector<float>>();
    ASSERT_EQ(static_cast<int64_t>(g.size()), p.numel()) << name;
    at::Tensor want = at::from_blob(g.data(), p.sizes(), at::kFloat).clone();
    const double scale = want.abs().max().item<double>();
    EXPECT_GT(scale, 0.0) << name;  // every parameter gets a gradient from this loss
    EXPECT_LE((p.grad() - want).abs().max().item<double>(), 1e-4 * std::max(1.0, scale))
        << model_type << " " << name;
  }
}

TEST(ModelReference, Qwen2TiedMatchesHfReferenceWithLeftAndRightPadding) {
  ExpectMatchesHfReference("qwen2");
}
TEST(ModelReference, Qwen3QkNormUntiedHeadDimMatchesHfReference) {
  ExpectMatchesHfReference("qwen3");
}
TEST(ModelReference, LlamaAttentionBiasSingleKvHeadMatchesHfReference) {
  ExpectMatchesHfReference("llama");
}

TEST(ModelForward, AllPaddingRowIsFinite) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 3);
  at::Tensor ids = at::randint(97, {2, 5}, at::kLong);
  at::Tensor mask = at::ones({2, 5}, at::kLong);
  mask[1].zero_();
  at::Tensor logits = FullLogits(*model, ids, mask);
  EXPECT_TRUE(at::isfinite(logits).all().item<bool>());
}

// Each layer adds its attention mask (0 or -1e30) to the scores, except in fp16, where a score
// below -16 added to -65504 passes the format's range and becomes -inf: a row whose keys are
// all blocked (every position of an all-padding row) would be -inf throughout, and its softmax
// NaN. There the blocked scores are written over instead. The q and k biases here (-5 and +5 in
// every component) make every score of every layer about -2 x 25 x 4 / sqrt(8) = -70 at the
// padding's positions (all 0, no rotation between them), so each key of the all-padding row
// would overflow.
TEST(ModelForward, AllPaddingRowIsFiniteInEveryDtypeWithLargeNegativeScores) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 6);
  {
    at::NoGradGuard no_grad;
    for (auto& [name, t] : model->NamedParameters()) {
      if (name.find("q_proj.bias") != std::string::npos) t.fill_(-5.0);
      if (name.find("k_proj.bias") != std::string::npos) t.fill_(5.0);
    }
  }
  at::Tensor ids = at::randint(97, {2, 5}, at::kLong);
  at::Tensor mask = at::ones({2, 5}, at::kLong);
  mask[1].zero_();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    auto copy = model->Copy(at::kCPU, dtype);
    ASSERT_TRUE(copy.ok()) << copy.status().ToString();
    at::Tensor logits = FullLogits(**copy, ids, mask).to(at::kFloat);
    EXPECT_TRUE(at::isfinite(logits).all().item<bool>()) << c10::toString(dtype);
    // The real row is the row alone: nothing of the padded row reaches it.
    at::Tensor alone = FullLogits(**copy, ids.narrow(0, 0, 1), mask.narrow(0, 0, 1)).to(at::kFloat);
    EXPECT_TRUE(at::allclose(logits.narrow(0, 0, 1), alone, 1e-2, 1e-2)) << c10::toString(dtype);
  }
}

TEST(ModelForward, PaddingDoesNotChangeRealPositions) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen3"), 4);
  at::Tensor ids = at::randint(97, {1, 6}, at::kLong);
  at::Tensor alone = FullLogits(*model, ids, at::ones({1, 6}, at::kLong));
  at::Tensor padded_ids =
      at::cat({at::full({1, 3}, 9, at::kLong), ids, at::full({1, 2}, 4, at::kLong)}, 1);
  at::Tensor padded_mask = at::cat(
      {at::zeros({1, 3}, at::kLong), at::ones({1, 6}, at::kLong), at::zeros({1, 2}, at::kLong)}, 1);
  at::Tensor padded = FullLogits(*model, padded_ids, padded_mask).narrow(1, 3, 6);
  EXPECT_LE((padded - alone).abs().max().item<double>(), 1e-5);
}

TEST(ModelForward, GradientsReachEveryParameter) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen3"), 5);
  model->SetRequiresGrad(true);
  at::Tensor ids = at::randint(97, {2, 4}, at::kLong);
  at::Tensor mask = at::ones({2, 4}, at::kLong);
  model->Logits(model->ForwardHidden(ids, mask)).logsumexp(-1).sum().backward();
  for (const auto& [name, p] : model->NamedParameters()) {
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_GT(p.grad().abs().sum().item<double>(), 0.0) << name;
  }
}

// Per-layer gradient checkpointing must give the gradients of the plain autograd graph (the
// reference here: the same forward differentiated by libtorch without recomputation), on rows
// with left and right padding, for each architecture's optional weights (biases, qk-norm).
void ExpectCheckpointedGradientsMatch(const std::string& model_type) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig(model_type), 17);
  model->SetRequiresGrad(true);
  const int64_t v = model->config().vocab_size;
  at::Tensor ids = at::randint(1, v, {3, 6}, at::kLong);
  at::Tensor mask = at::ones({3, 6}, at::kLong);
  mask[1].narrow(0, 0, 2).zero_();            // left padding
  mask[2].narrow(0, 4, 2).zero_();            // right padding
  at::Tensor weights = at::randn({3, 6, v});  // a loss that reaches every logit differently

  auto grads = [&](bool checkpoint) {
    for (auto& p : model->Parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor logits = model->Logits(model->ForwardHidden(ids, mask, checkpoint));
    (at::log_softmax(logits, -1) * weights * mask.unsqueeze(-1)).sum().backward();
    std::vector<at::Tensor> out;
    for (const auto& [name, p] : model->NamedParameters()) out.push_back(p.grad().clone());
    return out;
  };
  const std::vector<at::Tensor> plain = grads(false);
  const std::vector<at::Tensor> ckpt = grads(true);
  const auto named = model->NamedParameters();
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(ckpt[i].defined()) << named[i].first;
    const double scale = plain[i].abs().max().item<double>();
    EXPECT_GT(scale, 0.0) << named[i].first;
    EXPECT_LE((ckpt[i] - plain[i]).abs().max().item<double>(), 1e-5 * scale + 1e-7)
        << model_type << " " << named[i].first;
  }
  // Without grad mode the flag changes nothing (no graph to checkpoint).
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(model->ForwardHidden(ids, mask, true), model->ForwardHidden(ids, mask)));
}

TEST(ModelGradientCheckpointing, Qwen2GradientsMatchPlainBackward) {
  ExpectCheckpointedGradientsMatch("qwen2");
}
TEST(ModelGradientCheckpointing, Qwen3GradientsMatchPlainBackward) {
  ExpectCheckpointedGradientsMatch("qwen3");
}
TEST(ModelGradientCheckpointing, LlamaGradientsMatchPlainBackward) {
  ExpectCheckpointedGradientsMatch("llama");
}

// ------------------------------------------------------------------------------------------
// Shared prefixes (the learner's groups)

// ForwardSharedPrefix against ForwardHidden of the whole rows (prefix ++ suffix, the reference
// checked against transformers above): the states that predict each real suffix token, and the
// gradients of a loss over them. Prefixes of three lengths (left-padded), suffixes of several
// lengths (right-padded, one of a single token), rows continuing the prefixes in any order.
void ExpectSharedPrefixMatchesWholeRows(const std::string& model_type, bool checkpoint) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig(model_type), 23);
  model->SetRequiresGrad(true);
  const int64_t v = model->config().vocab_size;
  const int64_t u = 3, p = 5, b = 6, c = 4;
  at::Tensor prefix = at::randint(1, v, {u, p}, at::kLong);
  at::Tensor prefix_mask = at::ones({u, p}, at::kLong);
  prefix_mask[1].narrow(0, 0, 3).zero_();  // 2 real tokens
  prefix_mask[2].narrow(0, 0, 1).zero_();  // 4
  prefix = prefix * prefix_mask;
  const at::Tensor rows = at::tensor(std::vector<int64_t>{0, 0, 2, 1, 0, 2}, at::kLong);
  at::Tensor suffix = at::randint(1, v, {b, c}, at::kLong);
  at::Tensor suffix_mask = at::ones({b, c}, at::kLong);
  const std::vector<int64_t> lengths = {4, 3, 4, 1, 2, 4};
  for (int64_t r = 0; r < b; ++r) suffix_mask[r].narrow(0, lengths[r], c - lengths[r]).zero_();
  suffix = suffix * suffix_mask;
  const at::Tensor whole = at::cat({prefix.index_select(0, rows), suffix}, 1);
  const at::Tensor whole_mask = at::cat({prefix_mask.index_select(0, rows), suffix_mask}, 1);
  // A loss that reaches every real prediction's logits differently.
  const at::Tensor weights = at::randn({b, c, v}) * suffix_mask.unsqueeze(-1);

  auto run = [&](bool shared, at::Tensor* hidden) {
    for (auto& param : model->Parameters()) param.mutable_grad() = at::Tensor();
    at::Tensor h = shared ? model->ForwardSharedPrefix(prefix, prefix_mask, rows, suffix,
                                                       suffix_mask, checkpoint)
                          : model->ForwardHidden(whole, whole_mask).narrow(1, p - 1, c);
    *hidden = h.detach();
    (at::log_softmax(model->Logits(h), -1) * weights).sum().backward();
    std::vector<at::Tensor> grads;
    for (const auto& [name, param] : model->NamedParameters())
      grads.push_back(param.grad().clone());
    return grads;
  };
  at::Tensor want_hidden, got_hidden;
  const std::vector<at::Tensor> want = run(false, &want_hidden);
  const std::vector<at::Tensor> got = run(true, &got_hidden);
  ASSERT_EQ(got_hidden.sizes(), want_hidden.sizes());
  const at::Tensor real = suffix_mask.to(at::kBool).unsqueeze(-1).expand_as(want_hidden);
  const double hidden_diff =
      (got_hidden - want_hidden).masked_select(real).abs().max().item<double>();
  EXPECT_LE(hidden_diff, 1e-5 * want_hidden.abs().max().item<double>()) << model_type;
  const auto named = model->NamedParameters();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << named[i].first;
    const double scale = want[i].abs().max().item<double>();
    EXPECT_GT(scale, 0.0) << named[i].first;
    EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-5 * scale + 1e-7)
        << model_type << (checkpoint ? " checkpointed " : " ") << named[i].first;
  }

  // Suffixes of one token: only the prefixes' last states, one per row.
  at::NoGradGuard no_grad;
  const at::Tensor first = model->ForwardSharedPrefix(
      prefix, prefix_mask, rows, suffix.narrow(1, 0, 1), suffix_mask.narrow(1, 0, 1), checkpoint);
  ASSERT_EQ(first.sizes(), (std::vector<int64_t>{b, 1, model->config().hidden_size}));
  EXPECT_LE((first.select(1, 0) - want_hidden.select(1, 0)).abs().max().item<double>(),
            1e-5 * want_hidden.abs().max().item<double>());
}

TEST(ModelSharedPrefix, Qwen2MatchesWholeRowsAndTheirGradients) {
  ExpectSharedPrefixMatchesWholeRows("qwen2", false);
}
TEST(ModelSharedPrefix, Qwen3MatchesWholeRowsAndTheirGradients) {
  ExpectSharedPrefixMatchesWholeRows("qwen3", false);
}
TEST(ModelSharedPrefix, LlamaMatchesWholeRowsAndTheirGradients) {
  ExpectSharedPrefixMatchesWholeRows("llama", false);
}
TEST(ModelSharedPrefix, CheckpointedLayersMatchWholeRowsAndTheirGradients) {
  ExpectSharedPrefixMatchesWholeRows("qwen3", true);
}

TEST(ModelSharedPrefix, RefusesMismatchedShapes) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 3);
  const at::Tensor prefix = at::ones({2, 3}, at::kLong);
  const at::Tensor suffix = at::ones({4, 2}, at::kLong);
  EXPECT_THROW(
      model->ForwardSharedPrefix(prefix, prefix, at::zeros({3}, at::kLong), suffix, suffix),
      c10::Error);  // a row without its prefix
  EXPECT_THROW(model->ForwardSharedPrefix(prefix, at::ones({2, 2}, at::kLong),
                                          at::zeros({4}, at::kLong), suffix, suffix),
               c10::Error);  // a mask of another shape
}

// ------------------------------------------------------------------------------------------
// KV cache

void ExpectCacheMatchesFullForward(const std::string& model_type) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig(model_type), 11);
  const int64_t v = model->config().vocab_size;
  // Two prompts of lengths 5 and 2, left-padded to 5; G = 3 completions each.
  const int64_t tp = 5, g = 3, steps = 5;
  at::Tensor prompt = at::randint(1, v, {2, tp}, at::kLong);
  at::Tensor prompt_mask = at::ones({2, tp}, at::kLong);
  prompt_mask[1].narrow(0, 0, 3).zero_();
  prompt[1].narrow(0, 0, 3).zero_();

  KvCache cache = model->NewCache(2, tp + steps);
  at::Tensor prefill_logits = model->Prefill(prompt, prompt_mask, cache);
  at::Tensor full_prompt = FullLogits(*model, prompt, prompt_mask).select(1, tp - 1);
  EXPECT_LE((prefill_logits - full_prompt).abs().max().item<double>(), 1e-4);

  cache = model->ExpandCache(cache, g);
  ASSERT_EQ(cache.batch(), 2 * g);
  at::Tensor expanded_first = prefill_logits.repeat_interleave(g, 0);  // [2G, V]

  // Completion tokens per original row; column s of `completion_mask` is 0 where the row was
  // inactive at step s (row 1 at step 2).
  const int64_t rows = 2 * g;
  at::Tensor completion = at::randint(1, v, {rows, steps}, at::kLong);
  at::Tensor completion_mask = at::ones({rows, steps}, at::kLong);
  completion_mask[1][2] = 0;
  std::vector<std::vector<at::Tensor>> step_logits(rows);  // logits after feeding step s
  std::vector<int64_t> live(rows);
  for (int64_t r = 0; r < rows; ++r) live[r] = r;
  for (int64_t s = 0; s < steps; ++s) {
    if (s == 3) {  // row 4 finished: keep the others, in order
      std::vector<int64_t> keep;
      for (size_t i = 0; i < live.size(); ++i) {
        if (live[i] != 4) keep.push_back(static_cast<int64_t>(i));
      }
      live.erase(std::find(live.begin(), live.end(), 4));
      ASSERT_TRUE(model->KeepRows(cache, at::tensor(keep, at::kLong)).ok());
    }
    at::Tensor live_t = at::tensor(live, at::kLong);
    at::Tensor ids = completion.index_select(0, live_t).select(1, s).contiguous();
    at::Tensor active = completion_mask.index_select(0, live_t).select(1, s).to(at::kBool);
    at::Tensor logits = model->DecodeStep(ids, cache, active);
    ASSERT_EQ(logits.size(0), static_cast<int64_t>(live.size()));
    EXPECT_TRUE(at::isfinite(logits).all().item<bool>());
    for (size_t i = 0; i < live.size(); ++i) step_logits[live[i]].push_back(logits[i]);
  }
  EXPECT_EQ(cache.batch(), rows - 1);
  EXPECT_EQ(cache.length, tp + steps);

  // Reference: the whole concatenated sequences in one ForwardHidden.
  at::Tensor full_ids = at::cat({prompt.repeat_interleave(g, 0), completion}, 1);
  at::Tensor full_mask = at::cat({prompt_mask.repeat_interleave(g, 0), completion_mask}, 1);
  at::Tensor full = FullLogits(*model, full_ids, full_mask);  // [rows, tp + steps, V]
  double max_diff = (expanded_first - full.select(1, tp - 1)).abs().max().item<double>();
  int compared = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (size_t s = 0; s < step_logits[r].size(); ++s) {
      if (completion_mask[r][s].item<int64_t>() == 0) continue;  // garbage by contract
      max_diff =
          std::max(max_diff, (step_logits[r][s] - full[r][tp + s]).abs().max().item<double>());
      ++compared;
    }
  }
  EXPECT_EQ(compared, rows * steps - 1 /*inactive*/ - 2 /*row 4 dropped before steps 3, 4*/);
  EXPECT_LE(max_diff, 1e-4) << model_type;
}

TEST(ModelKvCache, Qwen2PrefillExpandDecodeMatchesFullForward) {
  ExpectCacheMatchesFullForward("qwen2");
}
TEST(ModelKvCache, Qwen3PrefillExpandDecodeMatchesFullForward) {
  ExpectCacheMatchesFullForward("qwen3");
}
TEST(ModelKvCache, LlamaPrefillExpandDecodeMatchesFullForward) {
  ExpectCacheMatchesFullForward("llama");
}

// A cache continued from compacted rows (a multi-turn episode's next turn): each row's logits
// equal the full forward of that row's real tokens alone, whatever its padding, its masked
// steps, the part of its cache it reuses, or its length of new tokens.
TEST(ModelKvCache, CompactedRowsStackedAndPrefilledAgainMatchFullForward) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen3"), 13);
  // Row 0: prompt of 5; row 1: prompt of 2, left-padded to 5. Three decode steps; row 1 is
  // inactive at step 1 (a masked column inside its tokens).
  const std::vector<int64_t> steps0 = {5, 6, 11}, steps1 = {12, 60, 14};
  KvCache cache = model->NewCache(2, 8);
  at::Tensor prompt =
      at::tensor(std::vector<int64_t>{3, 9, 4, 7, 1, 0, 0, 0, 8, 2}, at::kLong).view({2, 5});
  at::Tensor mask =
      at::tensor(std::vector<int64_t>{1, 1, 1, 1, 1, 0, 0, 0, 1, 1}, at::kLong).view({2, 5});
  model->Prefill(prompt, mask, cache);
  for (int s = 0; s < 3; ++s) {
    at::Tensor tok = at::tensor(std::vector<int64_t>{steps0[s], steps1[s]}, at::kLong);
    at::Tensor active = at::tensor(std::vector<int64_t>{1, s != 1}, at::kLong).to(at::kBool);
    model->DecodeStep(tok, cache, active);
  }
  // Row 0 keeps its first 7 real tokens (p0 + 5, 6: the last fed token is dropped), row 1 its
  // first 3 of 4 (p1 + 12: partial reuse); row 2 has no cache at all.
  KvCache r0 = model->CompactRow(cache, 0, 7);
  KvCache r1 = model->CompactRow(cache, 1, 3);
  EXPECT_EQ(r0.length, 7);
  EXPECT_EQ(r1.next_position.item<int64_t>(), 3);
  const std::vector<std::vector<int64_t>> kept = {{3, 9, 4, 7, 1, 5, 6}, {8, 2, 12}, {}};
  const std::vector<std::vector<int64_t>> added = {{20, 21}, {30, 31, 32, 33}, {40, 41, 42}};
  const std::vector<int64_t> next = {50, 51, 52};
  KvCache stacked = model->StackRows({&r0, &r1, nullptr}, {7, 3, 0}, 7 + 4 + 1);
  EXPECT_EQ(stacked.length, 7);
  EXPECT_EQ(stacked.batch(), 3);
  // New tokens, LEFT-padded to 4.
  at::Tensor add_ids = at::zeros({3, 4}, at::kLong), add_mask = at::zeros({3, 4}, at::kLong);
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t n = static_cast<int64_t>(added[r].size());
    for (int64_t j = 0; j < n; ++j) {
      add_ids[r][4 - n + j] = added[r][j];
      add_mask[r][4 - n + j] = 1;
    }
  }
  at::Tensor prefill_logits = model->Prefill(add_ids, add_mask, stacked);              // [3, V]
  at::Tensor decode_logits = model->DecodeStep(at::tensor(next, at::kLong), stacked);  // [3, V]
  for (int64_t r = 0; r < 3; ++r) {
    std::vector<int64_t> seq = kept[r];
    seq.insert(seq.end(), added[r].begin(), added[r].end());
    seq.push_back(next[r]);
    at::Tensor full_ids = at::tensor(seq, at::kLong).unsqueeze(0);
    at::Tensor full = FullLogits(*model, full_ids, at::ones_like(full_ids))[0];  // [T, V]
    const int64_t t = full.size(0);
    EXPECT_LE((prefill_logits[r] - full[t - 2]).abs().max().item<double>(), 1e-4) << "row " << r;
    EXPECT_LE((decode_logits[r] - full[t - 1]).abs().max().item<double>(), 1e-4) << "row " << r;
  }
}

TEST(ModelKvCache, CompactRowRefusesMoreTokensThanTheRowHolds) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 1);
  KvCache cache = model->NewCache(1, 4);
  model->Prefill(at::ones({1, 2}, at::kLong), at::ones({1, 2}, at::kLong), cache);
  EXPECT_THROW(model->CompactRow(cache, 0, 3), c10::Error);
  EXPECT_EQ(model->CompactRow(cache, 0, 2).length, 2);
}

TEST(ModelKvCache, KeepRowsRejectsOutOfRangeIndex) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 1);
  KvCache cache = model->NewCache(2, 4);
  Status s = model->KeepRows(cache, at::tensor(std::vector<int64_t>{0, 2}, at::kLong));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.batch(), 2);
}

TEST(ModelKvCache, DecodeRunsWithoutAutograd) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 1);
  model->SetRequiresGrad(true);
  KvCache cache = model->NewCache(1, 4);
  at::Tensor logits =
      model->Prefill(at::ones({1, 2}, at::kLong), at::ones({1, 2}, at::kLong), cache);
  EXPECT_FALSE(logits.requires_grad());
  logits = model->DecodeStep(at::ones({1}, at::kLong), cache);
  EXPECT_FALSE(logits.requires_grad());
}

// ------------------------------------------------------------------------------------------
// Bad input: every error names the file and the field or tensor.

TEST(ModelConfigErrors, MalformedJsonNamesFile) {
  TempDir dir;
  WriteText(dir / "config.json", "{\"model_type\": \"qwen2\", ");
  auto c = LoadModelConfig(dir / "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(dir / "config.json"), std::string::npos)
      << c.status().message();
}

void ExpectConfigError(const json& j, const std::string& field) {
  TempDir dir;
  WriteText(dir / "config.json", j.dump());
  auto c = LoadModelConfig(dir.path());  // a directory works too
  ASSERT_FALSE(c.ok()) << field;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(dir / "config.json"), std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("'" + field + "'"), std::string::npos)
      << c.status().message();
}

TEST(ModelConfigErrors, UnknownModelTypeNamesField) {
  json j = SmallConfigJson("qwen2");
  j["model_type"] = "mistral";
  ExpectConfigError(j, "model_type");
}

TEST(ModelConfigErrors, MissingFieldNamesField) {
  json j = SmallConfigJson("qwen2");
  j.erase("intermediate_size");
  ExpectConfigError(j, "intermediate_size");
}

TEST(ModelConfigErrors, WrongTypeNamesField) {
  json j = SmallConfigJson("llama");
  j["hidden_size"] = "32";
  ExpectConfigError(j, "hidden_size");
  j = SmallConfigJson("llama");
  j["tie_word_embeddings"] = 1;
  ExpectConfigError(j, "tie_word_embeddings");
  j = SmallConfigJson("llama");
  j["eos_token_id"] = {1, "2"};
  ExpectConfigError(j, "eos_token_id");
}

TEST(ModelConfigErrors, InconsistentDimsNameField) {
  json j = SmallConfigJson("qwen2");
  j["num_attention_heads"] = 5;  // 32 % 5 != 0
  ExpectConfigError(j, "num_attention_heads");
  j = SmallConfigJson("qwen2");
  j["num_key_value_heads"] = 3;  // 4 % 3 != 0
  ExpectConfigError(j, "num_key_value_heads");
}

// A config.json is anyone's file: every size has a bound (model_config.h kMax...), so the
// parameter count and the memory plan made from it cannot overflow (tests/fuzz found the plan
// did, signed overflow at hidden_size 2^40). A size at its bound is taken, one past is refused.
TEST(ModelConfigErrors, SizesPastTheirBoundsNameField) {
  const std::pair<const char*, int64_t> bounds[] = {
      {"vocab_size", int64_t{1} << 24},
      {"hidden_size", int64_t{1} << 18},
      {"intermediate_size", int64_t{1} << 20},
      {"num_hidden_layers", int64_t{1} << 10},
      {"num_attention_heads", int64_t{1} << 10},
      {"num_key_value_heads", int64_t{1} << 10},
      {"head_dim", int64_t{1} << 11},
      {"max_position_embeddings", int64_t{1} << 31},
  };
  json at_bounds = SmallConfigJson("qwen3");
  for (const auto& [field, bound] : bounds) at_bounds[field] = bound;
  auto c = ModelConfig::FromJson(at_bounds, "x/config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->vocab_size, int64_t{1} << 24);
  for (const auto& [field, bound] : bounds) {
    json j = at_bounds;
    j[field] = bound + (std::string(field) == "head_dim" ? 2 : 1);  // head_dim stays even
    if (std::string(field) == "num_attention_heads") j["num_key_value_heads"] = 1;
    ExpectConfigError(j, field);
    j[field] = int64_t{1} << 62;
    ExpectConfigError(j, field);
  }
}

TEST(ModelConfigErrors, UnsupportedRopeScalingIsUnimplemented) {
  json j = SmallConfigJson("llama");
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  auto c = ModelConfig::FromJson(j, "x/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(c.status().message().find("rope_scaling"), std::string::npos);
}

// Saves a small model, then rewrites model.safetensors through `edit`.
Status LoadWithEditedWeights(const std::function<void(NamedTensors&)>& edit, std::string* file) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 2);
  TempDir dir;
  EXPECT_TRUE(model->Save(dir.path()).ok());
  NamedTensors tensors;
  for (const auto& [name, t] : model->NamedParameters())
    tensors.emplace_back(name, t.detach().clone());
  edit(tensors);
  *file = dir / "model.safetensors";
  EXPECT_TRUE(WriteSafetensors(*file, tensors).ok());
  // LoadDeferred checks the same before reading a value, and says the same.
  const Status deferred = Model::LoadDeferred(dir.path()).status();
  const Status whole = Model::Load(dir.path()).status();
  EXPECT_EQ(deferred.ToString(), whole.ToString());
  return whole;
}

TEST(ModelLoadErrors, MissingTensorNamesFileAndTensor) {
  const std::string victim = "model.layers.1.mlp.up_proj.weight";
  std::string file;
  Status s = LoadWithEditedWeights(
      [&](NamedTensors& t) {
        t.erase(std::find_if(t.begin(), t.end(), [&](auto& p) { return p.first == victim; }));
      },
      &file);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find(file), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(victim), std::string::npos) << s.message();
}

TEST(ModelLoadErrors, WrongShapeNamesFileAndTensor) {
  const std::string victim = "model.layers.0.self_attn.k_proj.bias";
  std::string file;
  Status s = LoadWithEditedWeights(
      [&](NamedTensors& t) {
        for (auto& [name, x] : t) {
          if (name == victim) x = at::zeros({17});
        }
      },
      &file);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(file), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(victim), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("[17]"), std::string::npos) << s.message();
}

TEST(ModelLoadErrors, IntegerDtypeNamesFileAndTensor) {
  const std::string victim = "model.norm.weight";
  std::string file;
  Status s = LoadWithEditedWeights(
      [&](NamedTensors& t) {
        for (auto& [name, x] : t) {
          if (name == victim) x = x.to(at::kLong);
        }
      },
      &file);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(file), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(victim), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("I64"), std::string::npos) << s.message();
}

TEST(ModelLoadErrors, MissingWeightsFileIsNotFound) {
  TempDir dir;
  WriteText(dir / "config.json", SmallConfigJson("qwen2").dump());
  EXPECT_EQ(Model::Load(dir.path()).status().code(), StatusCode::kNotFound);
}

TEST(ModelLoadErrors, LoadStateFromRejectsWrongShapeAndChangesNothing) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 2);
  NamedTensors before;
  for (const auto& [name, t] : model->NamedParameters()) before.emplace_back(name, t.clone());
  NamedTensors state;
  for (const auto& [name, t] : before) state.emplace_back(name, at::zeros_like(t));
  state.back().second = at::zeros({3});
  Status s = model->LoadStateFrom(state);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(state.back().first), std::string::npos);
  auto now = model->NamedParameters();
  for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(at::equal(now[i].second, before[i].second));
}

// ------------------------------------------------------------------------------------------
// Save / Load

void ExpectSameParameters(const Model& a, const Model& b) {
  auto pa = a.NamedParameters(), pb = b.NamedParameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    EXPECT_TRUE(at::equal(pa[i].second, pb[i].second)) << pa[i].first;
  }
  EXPECT_EQ(a.config().ToJson(), b.config().ToJson());
}

TEST(ModelSaveLoad, RoundTripIsBitExactAndTiedHasNoLmHead) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen2"), 21);
  TempDir dir;
  ASSERT_TRUE(model->Save(dir.path()).ok());
  auto file = SafetensorsFile::Open(dir / "model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->Find("lm_head.weight"), nullptr);
  EXPECT_NE((*file)->Find("model.layers.1.self_attn.q_proj.bias"), nullptr);
  auto loaded = Model::Load(dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectSameParameters(*model, **loaded);
  EXPECT_TRUE(at::equal((*loaded)->LmHeadWeight(), (*loaded)->NamedParameters()[0].second));
}

TEST(ModelSaveLoad, ShardedCheckpointLoads) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen3"), 22);
  TempDir dir;
  ASSERT_TRUE(model->Save(dir.path(), /*max_shard_bytes=*/8 * 1024).ok());
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    shards += e.path().filename().string().rfind("model-", 0) == 0;
  }
  EXPECT_GT(shards, 1);
  auto loaded = Model::Load(dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ExpectSameParameters(*model, **loaded);
}

// `model` saved in `dir` with its weights in BF16 (`*bf16`, as written).
void SaveInBf16(const Model& model, const TempDir& dir, NamedTensors* bf16) {
  ASSERT_TRUE(model.Save(dir.path()).ok());
  for (const auto& [name, t] : model.NamedParameters())
    bf16->emplace_back(name, t.to(at::kBFloat16));
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", *bf16).ok());
}

TEST(ModelSaveLoad, Bf16WeightsAreWidenedToFp32) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("llama"), 23);
  TempDir dir;
  NamedTensors bf16;
  ASSERT_NO_FATAL_FAILURE(SaveInBf16(*model, dir, &bf16));
  auto loaded = Model::Load(dir.path());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  auto got = (*loaded)->NamedParameters();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].second.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(got[i].second, bf16[i].second.to(at::kFloat))) << got[i].first;
  }
}

// ------------------------------------------------------------------------------------------
// LoadDeferred (full_shard's sharded loading) and ModelWeights

TEST(ModelDeferred, HoldsNoMemoryUntilMaterializedAndThenHoldsWhatLoadReads) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("qwen3"), 24);
  TempDir dir;
  ASSERT_TRUE(model->Save(dir.path(), /*max_shard_bytes=*/8 * 1024).ok());
  auto deferred = Model::LoadDeferred(dir.path());
  ASSERT_TRUE(deferred.ok()) << deferred.status().ToString();
  Model& m = **deferred;
  EXPECT_TRUE(m.deferred());
  for (const auto& [name, p] : m.NamedParameters()) {
    EXPECT_EQ(p.storage().nbytes(), 0u) << name;
    EXPECT_TRUE(p.is_contiguous()) << name;
  }
  ASSERT_EQ(m.NamedParameters().size(), model->NamedParameters().size());
  for (size_t i = 0; i < m.NamedParameters().size(); ++i) {
    EXPECT_EQ(m.NamedParameters()[i].second.sizes(), model->NamedParameters()[i].second.sizes());
  }
  // Nothing reads values that are not there: forwards refuse, Save refuses.
  const at::Tensor ids = at::zeros({1, 3}, at::kLong), mask = at::ones({1, 3}, at::kLong);
  EXPECT_THROW(m.ForwardHidden(ids, mask), c10::Error);
  TempDir other;
  EXPECT_EQ(m.Save(other.path()).code(), StatusCode::kFailedPrecondition);
  // A copy in bf16 is deferred too, and materializes in bf16.
  auto copy = m.Copy(at::kCPU, at::kBFloat16);
  ASSERT_TRUE(copy.ok());
  EXPECT_TRUE((*copy)->deferred());
  EXPECT_EQ((*copy)->NamedParameters()[0].second.storage().nbytes(), 0u);
  ASSERT_TRUE(m.Materialize().ok());
  EXPECT_FALSE(m.deferred());
  ExpectSameParameters(*model, m);
  ASSERT_TRUE((*copy)->Materialize().ok());
  const auto bf16 = (*copy)->NamedParameters();
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_EQ(bf16[i].second.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(bf16[i].second, model->NamedParameters()[i].second.to(at::kBFloat16)));
  }
  // Values given by LoadStateFrom replace the files'.
  auto given = Model::LoadDeferred(dir.path());
  ASSERT_TRUE(given.ok());
  ASSERT_TRUE((*given)->LoadStateFrom(model->NamedParameters()).ok());
  EXPECT_FALSE((*given)->deferred());
  ExpectSameParameters(*model, **given);
}

TEST(ModelWeights, ReadRangeReadsTheRowMajorElementsAndRefusesARangePastTheEnd) {
  std::unique_ptr<Model> model = RandomModel(SmallConfig("llama"), 25);
  TempDir dir;
  NamedTensors bf16;
  ASSERT_NO_FATAL_FAILURE(SaveInBf16(*model, dir, &bf16));
  ModelWeights::Shapes shapes;
  for (const auto& [name, t] : bf16) shapes.push_back({name, t.sizes().vec()});
  auto weights = ModelWeights::Open(dir.path(), shapes, "test");
  ASSERT_TRUE(weights.ok()) << weights.status().ToString();
  const auto& [name, t] = bf16[1];  // a 2-D projection
  const at::Tensor flat = t.reshape({-1}).to(at::kFloat);
  for (const auto& [first, count] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {3, 17}, {flat.numel() - 5, 5}, {0, flat.numel()}, {7, 0}}) {
    at::Tensor out = at::full({count}, -1.0f);
    ASSERT_TRUE((*weights)->ReadRange(name, first, out).ok()) << first << " " << count;
    EXPECT_TRUE(at::equal(out, flat.narrow(0, first, count))) << first << " " << count;
  }
  at::Tensor past = at::empty({6});
  EXPECT_EQ((*weights)->ReadRange(name, flat.numel() - 5, past).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*weights)->ReadRange(name, -1, past).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*weights)->ReadRange("no.such.weight", 0, past).code(), StatusCode::kNotFound);
}

// The resident bytes of this process's mappings of `path` (/proc/self/smaps), -1 when unmapped.
int64_t MappedResidentBytes(const std::string& path) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  int64_t total = -1;
  bool in_file = false;
  while (std::getline(smaps, line)) {
    const bool header = !line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
                        line.find('-') != std::string::npos && line.find(':') > line.find(' ');
    if (header) {
      in_file = line.size() >= path.size() &&
                line.compare(line.size() - path.size(), path.size(), path) == 0;
      if (in_file && total < 0) total = 0;
    } else if (in_file && line.rfind("Rss:", 0) == 0) {
      total += std::stoll(line.substr(4)) * 1024;
    }
  }
  return total;
}

// What a rank read of the mapped file leaves its resident set: a sharded rank holds its shard,
// not the file's pages (the page cache keeps them for the next reader). Reading 4 MiB of F32
// leaves at most the header's pages mapped.
TEST(ModelWeights, ReadPagesLeaveTheResidentSet) {
  TempDir dir;
  const at::Tensor big = at::arange(1 << 20, at::kFloat);  // 4 MiB
  ASSERT_TRUE(WriteSafetensors(dir / "model.safetensors", {{"w", big}}).ok());
  const std::string path = fs::canonical(dir / "model.safetensors").string();
  auto weights = ModelWeights::Open(dir.path(), {{"w", {1 << 20}}}, "test");
  ASSERT_TRUE(weights.ok()) << weights.status().ToString();
  at::Tensor half = at::empty({1 << 19});
  ASSERT_TRUE((*weights)->ReadRange("w", 1 << 19, half).ok());
  EXPECT_TRUE(at::equal(half, big.narrow(0, 1 << 19, 1 << 19)));
  at::Tensor rest = at::empty({1 << 19});
  ASSERT_TRUE((*weights)->ReadRange("w", 0, rest).ok());
  const int64_t resident = MappedResidentBytes(path);
  ASSERT_GE(resident, 0) << "the file is not mapped";
  EXPECT_LE(resident, 16 << 10) << "the read pages stayed resident";
  auto whole = (*weights)->Read("w", at::kCPU, at::kFloat);
  ASSERT_TRUE(whole.ok());
  EXPECT_TRUE(at::equal(*whole, big));
  EXPECT_LE(MappedResidentBytes(path), 16 << 10) << "Get left the pages it copied";
}

// A file whose data does not start at a multiple of 4 bytes (a header of odd length, which the
// format allows): its F32 tensors cannot be viewed in place, and are read through a copy.
TEST(ModelWeights, ReadsATensorWhoseBytesAreNotAligned) {
  TempDir dir;
  const std::vector<float> values = {1.5f, -2.0f, 3.25f};
  const std::string header = R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  ASSERT_NE((8 + header.size()) % 4, 0u);
  {
    std::ofstream f(dir / "model.safetensors", std::ios::binary);
    const uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header;
    f.write(reinterpret_cast<const char*>(values.data()), 12);
  }
  auto file = SafetensorsFile::Open(dir / "model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->View("w").status().code(), StatusCode::kFailedPrecondition);
  auto weights = ModelWeights::Open(dir.path(), {{"w", {3}}}, "test");
  ASSERT_TRUE(weights.ok()) << weights.status().ToString();
  at::Tensor out = at::empty({2});
  ASSERT_TRUE((*weights)->ReadRange("w", 1, out).ok());
  EXPECT_EQ(out[0].item<float>(), -2.0f);
  EXPECT_EQ(out[1].item<float>(), 3.25f);
}

// ------------------------------------------------------------------------------------------
// InitRandom

TEST(ModelInitRandom, SameSeedSameWeightsDifferentSeedDifferent) {
  ModelConfig c = SmallConfig("qwen3");
  auto a = Model::InitRandom(c, 42), b = Model::InitRandom(c, 42), d = Model::InitRandom(c, 43);
  ASSERT_TRUE(a.ok() && b.ok() && d.ok());
  ExpectSameParameters(**a, **b);
  const at::Tensor wa = (*a)->NamedParameters()[1].second;
  const at::Tensor wd = (*d)->NamedParameters()[1].second;
  EXPECT_FALSE(at::equal(wa, wd));
  // N(0, 0.02) linears, ones for norms, zeros for biases.
  EXPECT_NEAR(wa.std().item<double>(), 0.02, 0.004);
  for (const auto& [name, t] : (*a)->NamedParameters()) {
    if (name.find("norm.weight") != std::string::npos) {
      EXPECT_TRUE(at::equal(t, at::ones_like(t))) << name;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Throughput (not a test: run with --gtest_also_run_disabled_tests).

TEST(ModelBench, DISABLED_BenchPresetForwardThroughput) {
  auto config = ModelConfigPreset("bench");
  ASSERT_TRUE(config.ok());
  auto model = Model::InitRandom(*config, 0);
  ASSERT_TRUE(model.ok());
  const int64_t b = 16, t = 192;
  at::Tensor ids = at::randint(config->vocab_size, {b, t}, at::kLong);
  at::Tensor mask = at::ones({b, t}, at::kLong);
  c10::InferenceMode inference;
  std::vector<double> hidden_s, total_s;
  for (int rep = 0; rep < 6; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    at::Tensor hidden = (*model)->ForwardHidden(ids, mask);
    auto t1 = std::chrono::steady_clock::now();
    at::Tensor logits = (*model)->Logits(hidden);
    auto t2 = std::chrono::steady_clock::now();
    if (rep == 0) continue;  // warm-up
    hidden_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    total_s.push_back(std::chrono::duration<double>(t2 - t0).count());
  }
  // docs/BENCHMARKS.md: the compute ceiling, 1024x1024 fp32 mm, measured in the same run.
  at::Tensor a = at::randn({1024, 1024}), bm = at::randn({1024, 1024}), c = at::empty({1024, 1024});
  std::vector<double> mm_s;
  for (int rep = 0; rep < 11; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    at::mm_out(c, a, bm);
    if (rep > 0)
      mm_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(mm_s.begin(), mm_s.end());
  const double ceiling = 2.0 * 1024 * 1024 * 1024 / mm_s[mm_s.size() / 2] / 1e9;
  const ModelConfig& m = *config;
  const double layer_flops_per_token =
      2.0 * m.hidden_size *
          (2 * m.num_attention_heads * m.head_dim + 2 * m.num_key_value_heads * m.head_dim +
           3 * m.intermediate_size) +
      2.0 * 2 * t / 2 * m.num_attention_heads * m.head_dim;  // QK^T and PV, causal half
  const double hidden_flops =
      static_cast<double>(b * t) * m.num_hidden_layers * layer_flops_per_token;
  const double head_flops = 2.0 * b * t * m.hidden_size * m.vocab_size;
  const double tokens = static_cast<double>(b * t);
  std::sort(hidden_s.begin(), hidden_s.end());
  std::sort(total_s.begin(), total_s.end());
  const double th = hidden_s[hidden_s.size() / 2], tt = total_s[total_s.size() / 2];
  std::printf(
      "bench model forward, batch %lld x %lld fp32, %d threads, mm ceiling %.1f GFLOP/s\n"
      "  ForwardHidden:            %.0f tokens/s, %.1f GFLOP/s (%.2f of ceiling)\n"
      "  ForwardHidden + Logits:   %.0f tokens/s, %.1f GFLOP/s (%.2f of ceiling); "
      "min %.3f s, max %.3f s\n",
      static_cast<long long>(b), static_cast<long long>(t), at::get_num_threads(), ceiling,
      tokens / th, hidden_flops / th / 1e9, hidden_flops / th / 1e9 / ceiling, tokens / tt,
      (hidden_flops + head_flops) / tt / 1e9, (hidden_flops + head_flops) / tt / 1e9 / ceiling,
      total_s.front(), total_s.back());
}

}  // namespace
}  // namespace grpo::common
