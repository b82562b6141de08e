#include "common/tokenizer/tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/tokenizer/bpe_tokenizer.h"
#include "common/tokenizer/tokenizer_util.h"

namespace grpo::common {
namespace {

namespace fs = std::filesystem;

// A special token entry of tokenizer_config.json: "text", {"content": "text", ...} or null.
StatusOr<std::optional<std::string>> ConfigToken(const nlohmann::json& config, const char* key,
                                                 const std::string& file) {
  if (!config.contains(key) || config[key].is_null()) return std::optional<std::string>();
  const nlohmann::json& v = config[key];
  if (v.is_string()) return std::optional<std::string>(v.get<std::string>());
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return std::optional<std::string>(v["content"].get<std::string>());
  }
  return Status::InvalidArgument(file + ": '" + key + "' must be a string or {\"content\": ...}");
}

Status ApplyConfig(const fs::path& config_path, BpeTokenizer* tokenizer) {
  const std::string file = config_path.string();
  ASSIGN_OR_RETURN(std::string text, internal::ReadFileToString(file));
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for 1e999
    return Status::InvalidArgument(file + ": invalid JSON: " + e.what());
  }
  if (!config.is_object()) return Status::InvalidArgument(file + ": not a JSON object");
  ASSIGN_OR_RETURN(std::optional<std::string> eos, ConfigToken(config, "eos_token", file));
  ASSIGN_OR_RETURN(std::optional<std::string> pad, ConfigToken(config, "pad_token", file));
  if (eos) RETURN_IF_ERROR(tokenizer->SetEosToken(*eos).WithContext(file));
  if (pad) RETURN_IF_ERROR(tokenizer->SetPadToken(*pad).WithContext(file));
  return Status::OK();
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& path) {
  std::error_code ec;
  fs::path file(path);
  if (fs::is_directory(file, ec)) {
    file /= "tokenizer.json";
    if (!fs::exists(file, ec)) {
      return Status::NotFound(path + ": directory has no tokenizer.json");
    }
  } else if (!fs::exists(file, ec)) {
    return Status::NotFound(path + ": no such file or directory");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<BpeTokenizer> tokenizer, BpeTokenizer::FromFile(file.string()));
  const fs::path config = file.parent_path() / "tokenizer_config.json";
  if (fs::exists(config, ec)) RETURN_IF_ERROR(ApplyConfig(config, tokenizer.get()));
  return std::unique_ptr<Tokenizer>(std::move(tokenizer));
}

}  // namespace grpo::common
