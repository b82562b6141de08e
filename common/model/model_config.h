// ModelConfig: the architecture of a decoder-only transformer, read from a Hugging Face
// `config.json` (model_type qwen2, qwen3 or llama) or taken from a named preset.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace grpo::common {

// The largest sizes a config may declare (ModelConfig::Validate): far above any model trained
// today (vocabularies of 262k, hidden 16k, MLP 53k, 126 layers, 128 heads of 256 dims), and low
// enough that the parameter count (under 2^52) and the memory plan's products of sizes stay
// inside 64-bit integers whatever a config.json says (learner/distributed/memory_plan.h).
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 24;
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 18;
inline constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;
inline constexpr int64_t kMaxHiddenLayers = int64_t{1} << 10;
inline constexpr int64_t kMaxAttentionHeads = int64_t{1} << 10;  // key/value heads too
inline constexpr int64_t kMaxHeadDim = int64_t{1} << 11;
inline constexpr int64_t kMaxPositionEmbeddings = int64_t{1} << 31;

// Field names and defaults follow transformers' Qwen2Config / Qwen3Config / LlamaConfig.
// A plain value type; FromJson validates it, so a ModelConfig from there is consistent.
struct ModelConfig {
  std::string model_type = "qwen2";  // "qwen2" | "qwen3" | "llama"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // default: num_attention_heads
  int64_t head_dim = 0;             // default: hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 32768;
  bool tie_word_embeddings = false;
  // q/k/v projections carry a bias (always for qwen2); for llama and qwen3 o_proj has one too.
  bool attention_bias = false;
  // RMSNorm over head_dim on q and k before RoPE (qwen3).
  bool qk_norm = false;
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // `eos_token_id` may be an int or a list
  std::string torch_dtype = "float32";

  // Parses and validates; errors are InvalidArgument (or Unimplemented for a feature this
  // model does not have, e.g. rope_scaling) and name `source_name` and the field.
  static StatusOr<ModelConfig> FromJson(const nlohmann::json& json, const std::string& source_name);
  // A Hugging Face config.json that FromJson (and transformers) read back to the same config.
  nlohmann::json ToJson() const;
  // Consistency of the dimensions (positive sizes at most the kMax... bounds above,
  // hidden % heads, heads % kv_heads).
  Status Validate(const std::string& source_name) const;

  // o_proj carries a bias (llama / qwen3 with attention_bias; never qwen2).
  bool o_proj_bias() const { return attention_bias && model_type != "qwen2"; }
};

// Reads `path` (a config.json, or a directory holding one). NotFound when the file is absent;
// InvalidArgument naming the file (and the field) when it is malformed.
StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// "tiny": qwen2-style, vocab 259 (byte tokenizer: 256 bytes + <|endoftext|>=256,
// <|im_start|>=257, <|im_end|>=258; eos 258), hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 176,
// tied, max_position 512. "bench": docs/BENCHMARKS.md's bench model. NotFound for any other name.
StatusOr<ModelConfig> ModelConfigPreset(std::string_view name);

}  // namespace grpo::common
