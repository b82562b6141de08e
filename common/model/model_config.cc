#include "common/model/model_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace grpo::common {
namespace {

using nlohmann::json;

std::string TypeName(const json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

Status FieldError(const std::string& source, std::string_view field, const std::string& what) {
  return Status::InvalidArgument(source + ": field '" + std::string(field) + "': " + what);
}

// Reads an integer field; `def` absent => the field is required. JSON null counts as absent.
Status ReadInt(const json& j, const std::string& source, std::string_view field,
               std::optional<int64_t> def, int64_t* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (!def) return FieldError(source, field, "missing (required)");
    *out = *def;
    return Status::OK();
  }
  if (!it->is_number_integer()) {
    return FieldError(source, field, "expected an integer, got " + TypeName(*it));
  }
  *out = it->get<int64_t>();
  return Status::OK();
}

Status ReadDouble(const json& j, const std::string& source, std::string_view field, double def,
                  double* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    *out = def;
    return Status::OK();
  }
  if (!it->is_number()) return FieldError(source, field, "expected a number, got " + TypeName(*it));
  *out = it->get<double>();
  return Status::OK();
}

Status ReadBool(const json& j, const std::string& source, std::string_view field, bool def,
                bool* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    *out = def;
    return Status::OK();
  }
  if (!it->is_boolean())
    return FieldError(source, field, "expected a boolean, got " + TypeName(*it));
  *out = it->get<bool>();
  return Status::OK();
}

Status RequirePositive(const std::string& source, std::string_view field, int64_t v) {
  if (v <= 0) return FieldError(source, field, "must be positive, got " + std::to_string(v));
  return Status::OK();
}

// Positive and at most `max` (the kMax... bounds of model_config.h).
Status RequireSize(const std::string& source, std::string_view field, int64_t v, int64_t max) {
  RETURN_IF_ERROR(RequirePositive(source, field, v));
  if (v > max) {
    return FieldError(source, field,
                      "is " + std::to_string(v) + ", more than the " + std::to_string(max) +
                          " any supported model has room for");
  }
  return Status::OK();
}

}  // namespace

StatusOr<ModelConfig> ModelConfig::FromJson(const json& j, const std::string& source) {
  if (!j.is_object()) return Status::InvalidArgument(source + ": expected a JSON object");
  ModelConfig c;

  auto mt = j.find("model_type");
  if (mt == j.end()) return FieldError(source, "model_type", "missing (required)");
  if (!mt->is_string()) {
    return FieldError(source, "model_type", "expected a string, got " + TypeName(*mt));
  }
  c.model_type = mt->get<std::string>();
  if (c.model_type != "qwen2" && c.model_type != "qwen3" && c.model_type != "llama") {
    return FieldError(
        source, "model_type",
        "unsupported model_type '" + c.model_type + "' (expected qwen2, qwen3 or llama)");
  }
  const bool llama = c.model_type == "llama";

  RETURN_IF_ERROR(ReadInt(j, source, "vocab_size", std::nullopt, &c.vocab_size));
  RETURN_IF_ERROR(ReadInt(j, source, "hidden_size", std::nullopt, &c.hidden_size));
  RETURN_IF_ERROR(ReadInt(j, source, "intermediate_size", std::nullopt, &c.intermediate_size));
  RETURN_IF_ERROR(ReadInt(j, source, "num_hidden_layers", std::nullopt, &c.num_hidden_layers));
  RETURN_IF_ERROR(ReadInt(j, source, "num_attention_heads", std::nullopt, &c.num_attention_heads));
  RETURN_IF_ERROR(
      ReadInt(j, source, "num_key_value_heads", c.num_attention_heads, &c.num_key_value_heads));
  RETURN_IF_ERROR(RequirePositive(source, "hidden_size", c.hidden_size));
  RETURN_IF_ERROR(RequirePositive(source, "num_attention_heads", c.num_attention_heads));
  RETURN_IF_ERROR(
      ReadInt(j, source, "head_dim", c.hidden_size / c.num_attention_heads, &c.head_dim));
  RETURN_IF_ERROR(ReadDouble(j, source, "rms_norm_eps", 1e-6, &c.rms_norm_eps));
  RETURN_IF_ERROR(ReadDouble(j, source, "rope_theta", 10000.0, &c.rope_theta));
  RETURN_IF_ERROR(ReadInt(j, source, "max_position_embeddings", llama ? 2048 : 32768,
                          &c.max_position_embeddings));
  RETURN_IF_ERROR(ReadBool(j, source, "tie_word_embeddings", false, &c.tie_word_embeddings));
  if (c.model_type == "qwen2") {
    c.attention_bias = true;  // Qwen2Attention: q/k/v always biased, o_proj never
  } else {
    RETURN_IF_ERROR(ReadBool(j, source, "attention_bias", false, &c.attention_bias));
  }
  c.qk_norm = c.model_type == "qwen3";

  if (auto it = j.find("bos_token_id"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) {
      return FieldError(source, "bos_token_id", "expected an integer, got " + TypeName(*it));
    }
    c.bos_token_id = it->get<int64_t>();
  }
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      c.eos_token_ids.push_back(it->get<int64_t>());
    } else if (it->is_array()) {
      for (const auto& e : *it) {
        if (!e.is_number_integer()) {
          return FieldError(source, "eos_token_id",
                            "list element is " + TypeName(e) + ", expected an integer");
        }
        c.eos_token_ids.push_back(e.get<int64_t>());
      }
    } else {
      return FieldError(source, "eos_token_id",
                        "expected an integer or a list of integers, got " + TypeName(*it));
    }
  }
  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (auto it = j.find(key); it != j.end() && !it->is_null()) {
      if (!it->is_string())
        return FieldError(source, key, "expected a string, got " + TypeName(*it));
      c.torch_dtype = it->get<std::string>();
      break;
    }
  }

  // Features of the family that this implementation does not have: refuse rather than differ.
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "silu") {
      return Status::Unimplemented(
          source + ": field 'hidden_act': only \"silu\" is supported, got " + it->dump());
    }
  }
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    std::string type;
    if (it->is_object()) type = it->value("rope_type", it->value("type", std::string()));
    if (type != "default") {
      return Status::Unimplemented(source + ": field 'rope_scaling': not supported, got " +
                                   it->dump());
    }
  }
  if (auto it = j.find("use_sliding_window");
      it != j.end() && it->is_boolean() && it->get<bool>()) {
    return Status::Unimplemented(
        source + ": field 'use_sliding_window': sliding-window attention is not supported");
  }
  if (auto it = j.find("mlp_bias"); it != j.end() && it->is_boolean() && it->get<bool>()) {
    return Status::Unimplemented(source + ": field 'mlp_bias': MLP biases are not supported");
  }

  RETURN_IF_ERROR(c.Validate(source));
  return c;
}

Status ModelConfig::Validate(const std::string& source) const {
  RETURN_IF_ERROR(RequireSize(source, "vocab_size", vocab_size, kMaxVocabSize));
  RETURN_IF_ERROR(RequireSize(source, "hidden_size", hidden_size, kMaxHiddenSize));
  RETURN_IF_ERROR(
      RequireSize(source, "intermediate_size", intermediate_size, kMaxIntermediateSize));
  RETURN_IF_ERROR(RequireSize(source, "num_hidden_layers", num_hidden_layers, kMaxHiddenLayers));
  RETURN_IF_ERROR(
      RequireSize(source, "num_attention_heads", num_attention_heads, kMaxAttentionHeads));
  RETURN_IF_ERROR(
      RequireSize(source, "num_key_value_heads", num_key_value_heads, kMaxAttentionHeads));
  RETURN_IF_ERROR(RequireSize(source, "head_dim", head_dim, kMaxHeadDim));
  RETURN_IF_ERROR(RequireSize(source, "max_position_embeddings", max_position_embeddings,
                              kMaxPositionEmbeddings));
  if (hidden_size % num_attention_heads != 0) {
    return FieldError(source, "num_attention_heads",
                      "hidden_size " + std::to_string(hidden_size) + " is not divisible by " +
                          std::to_string(num_attention_heads) + " heads");
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return FieldError(source, "num_key_value_heads",
                      "num_attention_heads " + std::to_string(num_attention_heads) +
                          " is not divisible by " + std::to_string(num_key_value_heads) +
                          " key/value heads");
  }
  if (head_dim % 2 != 0) {
    return FieldError(source, "head_dim", "must be even for RoPE, got " + std::to_string(head_dim));
  }
  if (!(rms_norm_eps > 0)) return FieldError(source, "rms_norm_eps", "must be positive");
  if (!(rope_theta > 0)) return FieldError(source, "rope_theta", "must be positive");
  return Status::OK();
}

json ModelConfig::ToJson() const {
  json j;
  const char* arch = model_type == "qwen2"   ? "Qwen2ForCausalLM"
                     : model_type == "qwen3" ? "Qwen3ForCausalLM"
                                             : "LlamaForCausalLM";
  j["architectures"] = json::array({arch});
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = nullptr;
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (model_type != "qwen2") j["attention_bias"] = attention_bias;
  if (model_type == "qwen2") j["use_sliding_window"] = false;
  j["attention_dropout"] = 0.0;
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else if (!eos_token_ids.empty()) {
    j["eos_token_id"] = eos_token_ids;
  }
  j["torch_dtype"] = torch_dtype;
  j["use_cache"] = true;
  return j;
}

StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = fs::is_directory(path, ec) ? (fs::path(path) / "config.json").string() : path;
  std::ifstream in(file, std::ios::binary);
  if (!in) return Status::NotFound(file + ": cannot open model config");
  std::stringstream buf;
  buf << in.rdbuf();
  json j = json::parse(buf.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument(file + ": malformed JSON");
  return ModelConfig::FromJson(j, file);
}

StatusOr<ModelConfig> ModelConfigPreset(std::string_view name) {
  ModelConfig c;
  c.model_type = "qwen2";
  c.attention_bias = true;
  c.tie_word_embeddings = true;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  if (name == "tiny") {
    c.vocab_size = 259;
    c.hidden_size = 64;
    c.intermediate_size = 176;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 512;
    c.bos_token_id = 256;     // <|endoftext|>
    c.eos_token_ids = {258};  // <|im_end|>
  } else if (name == "bench") {
    c.vocab_size = 32768;
    c.hidden_size = 256;
    c.intermediate_size = 704;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 2048;
  } else {
    return Status::NotFound("model preset '" + std::string(name) + "' (expected tiny or bench)");
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  RETURN_IF_ERROR(c.Validate("preset " + std::string(name)));
  return c;
}

}  // namespace grpo::common
