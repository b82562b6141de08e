// grpo generate: the rollout engine as a tool. JSON Lines prompts in ({"prompt": ...} or
// {"messages": [...]}, plus extra fields such as "answer" for rewards), one JSON object per
// prompt out: its completions with token ids, text, behaviour log-probs, truncation and
// rewards. A bad row gives {"error": "line N: ..."} in its place and the rest goes on.
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/model/model.h"
#include "common/tokenizer/tokenizer.h"
#include "rollout/generator.h"
#include "rollout/produce.h"
#include "services/cli/cli.h"
#include "services/remote_reward.h"

namespace grpo::services {
namespace {

using nlohmann::json;

struct GenerateOptions {
  std::string model_dir;
  std::string reward_options = "{}";
  std::vector<std::string> overrides;
};

int RunGenerate(const GenerateOptions& o) {
  auto fail = [](const Status& s, int code) {
    std::cerr << "grpo generate: " << s.ToString() << "\n";
    return code;
  };
  common::GrpoConfig cfg;
  if (Status s = common::ApplyConfigOverrides(cfg, o.overrides); !s.ok()) return fail(s, 2);
  // Only the generation and reward keys matter here: Generator::Create and MakeRewardRunner
  // validate those (the training-batch rules of GrpoConfig::Validate do not apply).
  json reward_options;
  try {
    reward_options = json::parse(o.reward_options);
  } catch (const json::exception& e) {
    return fail(Status::InvalidArgument(std::string("--reward_options: ") + e.what()), 2);
  }
  auto model = common::Model::Load(o.model_dir);
  if (!model.ok()) return fail(model.status(), 1);
  auto tok = common::LoadTokenizer(o.model_dir);
  if (!tok.ok()) return fail(tok.status(), 1);
  std::shared_ptr<const common::Model> policy = std::move(model).value();
  auto gen =
      rollout::Generator::Create(policy, 0, rollout::GeneratorOptions::FromConfig(cfg), tok->get());
  if (!gen.ok()) return fail(gen.status(), 2);
  std::unique_ptr<rollout::RewardRunner> rewards;
  if (!cfg.reward_funcs.empty()) {
    auto r = MakeRewardRunner(cfg, reward_options, /*auth_token=*/"");
    if (!r.ok()) return fail(r.status(), 2);
    rewards = std::move(r).value();
  }

  bool failed = false;
  std::string line;
  int64_t n = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto error = [&](const std::string& m) {
      failed = true;
      std::cout << json{{"error", "line " + std::to_string(n) + ": " + m}}.dump() << "\n";
    };
    auto prompt = rollout::PreparePromptFromJson(line, **tok);
    if (!prompt.ok()) {
      error(prompt.status().message());
      continue;
    }
    // The line number seeds the samplers: a row's completions do not depend on the others.
    auto result = rollout::Produce(**gen, rewards.get(), {{&*prompt, n}});
    if (!result.ok()) return fail(result.status(), 1);
    rollout::ProducedGroup& produced = result->groups[0];
    auto& group = produced.group;
    if (!group.ok()) {
      error(group.status().message());
      continue;
    }
    json out = {{"prompt_ids", group->prompt_ids}, {"completions", json::array()}};
    if (produced.prompt_truncated) out["prompt_truncated"] = true;
    const std::vector<std::string>& reward_errors = produced.rewards.messages;
    for (const auto& c : group->completions) {
      json rj = json::object();
      for (size_t k = 0; k < c.rewards.size(); ++k) {
        rj[cfg.reward_funcs[k]] = c.rewards[k] ? json(*c.rewards[k]) : json(nullptr);
      }
      out["completions"].push_back({{"ids", c.token_ids},
                                    {"text", c.text},
                                    {"logprobs", c.logprobs},
                                    {"truncated", c.truncated},
                                    {"rewards", rj}});
    }
    if (!reward_errors.empty()) out["reward_errors"] = reward_errors;
    std::cout << out.dump() << "\n" << std::flush;
  }
  return failed ? 2 : 0;
}

}  // namespace

void AddGenerateCommand(CLI::App& app, CliAction* action) {
  auto* cmd =
      app.add_subcommand("generate",
                         "JSON Lines prompts in, num_generations completions per prompt out (ids, "
                         "text, behaviour log-probs, rewards); config keys as --key value");
  auto o = std::make_shared<GenerateOptions>();
  cmd->add_option("--model", o->model_dir, "Hugging Face model directory")->required();
  cmd->add_option("--reward_options", o->reward_options,
                  "options by reward function name, as JSON (e.g. {\"length\": "
                  "{\"target_length\": 8}})");
  cmd->allow_extras();
  cmd->callback([cmd, o, action] {
    o->overrides = cmd->remaining();
    *action = [o] { return RunGenerate(*o); };
  });
}

}  // namespace grpo::services
