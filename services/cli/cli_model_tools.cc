// grpo tokenize | logprobs | init-model: tools on the model layer. They read JSON Lines on
// stdin and write one JSON object per input line on stdout, in order; a bad line gives
// {"error": "line N: ..."} in its place, the rest goes on, and the exit code is then 2.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "common/tokenizer/tokenizer.h"
#include "learner/chunked_logprobs.h"
#include "services/cli/cli.h"

namespace grpo::services {
namespace {

using nlohmann::json;

void PrintError(const std::string& tool, const Status& s) {
  std::cerr << "grpo " << tool << ": " << s.ToString() << "\n";
}

// Runs `fn` on each stdin line; returns 2 if any line failed, else 0.
template <typename Fn>
int ForEachLine(Fn fn) {
  std::string line;
  int64_t n = 0;
  bool failed = false;
  while (std::getline(std::cin, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json out;
    try {
      StatusOr<json> r = fn(json::parse(line));
      if (r.ok()) {
        out = std::move(r).value();
      } else {
        out = {{"error", "line " + std::to_string(n) + ": " + r.status().message()}};
      }
    } catch (const json::exception& e) {
      out = {{"error", "line " + std::to_string(n) + ": invalid JSON: " + e.what()}};
    }
    if (out.contains("error")) failed = true;
    std::cout << out.dump() << "\n" << std::flush;
  }
  return failed ? 2 : 0;
}

StatusOr<std::vector<int32_t>> IdsFrom(const json& row) {
  if (!row.is_object() || !row.contains("ids") || !row["ids"].is_array()) {
    return Status::InvalidArgument("expected {\"ids\": [...]}");
  }
  std::vector<int32_t> ids;
  for (const auto& v : row["ids"]) {
    if (!v.is_number_integer()) return Status::InvalidArgument("ids must be integers");
    ids.push_back(v.get<int32_t>());
  }
  return ids;
}

int RunTokenize(const std::string& path, bool decode, bool skip_special) {
  auto tok = common::LoadTokenizer(path);
  if (!tok.ok()) {
    PrintError("tokenize", tok.status());
    return 1;
  }
  const common::Tokenizer& t = **tok;
  return ForEachLine([&](const json& row) -> StatusOr<json> {
    if (decode) {
      ASSIGN_OR_RETURN(auto ids, IdsFrom(row));
      ASSIGN_OR_RETURN(std::string text, t.Decode(ids, skip_special));
      return json{{"text", text}};
    }
    if (!row.is_object() || !row.contains("text") || !row["text"].is_string()) {
      return Status::InvalidArgument("expected {\"text\": \"...\"}");
    }
    ASSIGN_OR_RETURN(auto ids, t.Encode(row["text"].get<std::string>()));
    return json{{"ids", ids}};
  });
}

// log p(token_t | tokens_<t) for every t (null for the first), fp32, one sequence at a time
// through the same chunked log-prob path the learner trains with.
int RunLogprobs(const std::string& dir) {
  auto model = common::Model::Load(dir);
  if (!model.ok()) {
    PrintError("logprobs", model.status());
    return 1;
  }
  const common::Model& m = **model;
  at::NoGradGuard no_grad;
  return ForEachLine([&](const json& row) -> StatusOr<json> {
    ASSIGN_OR_RETURN(auto ids, IdsFrom(row));
    if (ids.empty()) return Status::InvalidArgument("ids is empty");
    for (int32_t id : ids) {
      if (id < 0 || id >= m.config().vocab_size) {
        return Status::InvalidArgument("token id " + std::to_string(id) +
                                       " outside the vocabulary [0, " +
                                       std::to_string(m.config().vocab_size) + ")");
      }
    }
    if (static_cast<int64_t>(ids.size()) > m.config().max_position_embeddings) {
      return Status::InvalidArgument("sequence of " + std::to_string(ids.size()) +
                                     " tokens exceeds max_position_embeddings " +
                                     std::to_string(m.config().max_position_embeddings));
    }
    json lp = json::array({nullptr});
    if (ids.size() > 1) {
      const int64_t T = static_cast<int64_t>(ids.size());
      std::vector<int64_t> v(ids.begin(), ids.end());
      at::Tensor t = at::tensor(v, at::kLong).view({1, T});
      try {
        at::Tensor hidden = m.ForwardHidden(t, at::ones_like(t));  // [1, T, D]
        at::Tensor out = learner::ChunkedTokenLogprobs(hidden[0].narrow(0, 0, T - 1),
                                                       m.LmHeadWeight(), t[0].narrow(0, 1, T - 1));
        auto acc = out.contiguous().to(at::kFloat);
        const float* p = acc.data_ptr<float>();
        for (int64_t i = 0; i < T - 1; ++i) lp.push_back(p[i]);
      } catch (const c10::Error& e) {
        return Status::Internal(e.what_without_backtrace());
      }
    }
    return json{{"logprobs", lp}};
  });
}

Status WriteJson(const std::filesystem::path& p, const json& j) {
  std::ofstream out(p);
  out << j.dump(2) << "\n";
  if (!out) return Status::Internal("cannot write " + p.string());
  return Status::OK();
}

int RunInitModel(const std::string& preset, const std::string& config_path,
                 const std::string& out_dir, uint64_t seed) {
  StatusOr<common::ModelConfig> cfg = config_path.empty() ? common::ModelConfigPreset(preset)
                                                          : common::LoadModelConfig(config_path);
  if (!cfg.ok()) {
    PrintError("init-model", cfg.status());
    return 2;
  }
  auto model = common::Model::InitRandom(*cfg, seed);
  if (!model.ok()) {
    PrintError("init-model", model.status());
    return 1;
  }
  Status s = (*model)->Save(out_dir);
  // The byte tokenizer fits any vocabulary of at least 259 ids (tiny and bench presets).
  common::ByteTokenizer tok;
  if (s.ok() && cfg->vocab_size >= tok.vocab_size()) {
    s = tok.Save(out_dir + "/tokenizer.json");
    if (s.ok()) {
      s = WriteJson(std::filesystem::path(out_dir) / "tokenizer_config.json",
                    {{"eos_token", "<|im_end|>"},
                     {"pad_token", "<|endoftext|>"},
                     {"model_max_length", cfg->max_position_embeddings}});
    }
  }
  if (!s.ok()) {
    PrintError("init-model", s);
    return 1;
  }
  std::cout << json{{"out", out_dir},
                    {"model_type", cfg->model_type},
                    {"parameters", (*model)->NumParameters()},
                    {"seed", seed}}
                   .dump()
            << "\n";
  return 0;
}

}  // namespace

void AddModelToolCommands(CLI::App& app, CliAction* action) {
  {
    auto* cmd = app.add_subcommand(
        "tokenize", "JSON Lines {\"text\": ...} on stdin to {\"ids\": [...]} on stdout");
    auto path = std::make_shared<std::string>();
    auto decode = std::make_shared<bool>(false);
    auto skip = std::make_shared<bool>(false);
    cmd->add_option("--tokenizer", *path, "tokenizer.json or a model directory")->required();
    cmd->add_flag("--decode", *decode, "{\"ids\": [...]} to {\"text\": ...} instead");
    cmd->add_flag("--skip_special_tokens", *skip, "with --decode: leave special tokens out");
    cmd->callback([=] { *action = [=] { return RunTokenize(*path, *decode, *skip); }; });
  }
  {
    auto* cmd = app.add_subcommand(
        "logprobs",
        "JSON Lines {\"ids\": [...]} to {\"logprobs\": [null, ...]}: log p(token | earlier "
        "tokens), fp32");
    auto dir = std::make_shared<std::string>();
    cmd->add_option("--model", *dir, "Hugging Face model directory")->required();
    cmd->callback([=] { *action = [=] { return RunLogprobs(*dir); }; });
  }
  {
    auto* cmd = app.add_subcommand(
        "init-model",
        "Write a randomly initialised model in Hugging Face layout (config.json, "
        "model.safetensors, tokenizer)");
    auto preset = std::make_shared<std::string>("tiny");
    auto config = std::make_shared<std::string>();
    auto out = std::make_shared<std::string>();
    auto seed = std::make_shared<uint64_t>(0);
    cmd->add_option("--preset", *preset, "tiny | bench")->check(CLI::IsMember({"tiny", "bench"}));
    cmd->add_option("--config", *config, "a config.json instead of a preset");
    cmd->add_option("--out", *out, "output directory")->required();
    cmd->add_option("--seed", *seed, "initialisation seed");
    cmd->callback([=] { *action = [=] { return RunInitModel(*preset, *config, *out, *seed); }; });
  }
}

}  // namespace grpo::services
