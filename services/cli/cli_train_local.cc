// grpo train-local: the whole GRPO loop in one process (generate with the rollout engine, score,
// train with the learner library, repeat) on a built-in task or a JSON Lines dataset. The
// distributed system (issue 5) runs the same pieces as separate services; this is the most
// end-to-end path that exists until then, and what deploy/demo.sh runs.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/config.h"
#include "common/logging.h"
#include "common/model/device.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "learner/checkpoint.h"
#include "learner/grpo_trainer.h"
#include "rollout/generator.h"
#include "rollout/produce.h"
#include "rollout/reward.h"
#include "services/cli/cli.h"
#include "services/cli/cli_plan.h"
#include "services/cli/demo_task.h"

namespace grpo::services {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

StatusOr<std::vector<json>> ReadJsonl(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read dataset " + path);
  std::vector<json> rows;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      rows.push_back(json::parse(line));
    } catch (const json::exception& e) {
      return Status::InvalidArgument(path + " line " + std::to_string(n) + ": " + e.what());
    }
  }
  if (rows.empty()) return Status::InvalidArgument(path + ": no rows");
  return rows;
}

struct TrainLocalOptions {
  std::vector<std::string> overrides;
  std::string dataset;           // JSON Lines; empty = built-in task
  int64_t prompts_per_step = 0;  // 0 = from the generation batch size
  bool json_lines = false;
  double target_length = kDemoTargetLength;
};

int RunTrainLocal(const TrainLocalOptions& o) {
  auto fail = [](const Status& s, int code = 1) {
    std::cerr << "grpo train-local: " << s.ToString() << "\n";
    return code;
  };
  // Demo defaults (a tiny model from scratch learns them in a couple of minutes on 2 cores);
  // --config and flags override them.
  common::GrpoConfig cfg = DemoTaskConfig();
  cfg.output_dir = "grpo-output/train-local";
  cfg.save_steps = 30;
  if (Status s = common::ApplyConfigOverrides(cfg, o.overrides); !s.ok()) return fail(s, 2);
  if (Status s = cfg.Validate(); !s.ok()) return fail(s, 2);

  // Model: the configured one, or a tiny one initialised from scratch.
  std::string model_dir = cfg.model_name_or_path;
  if (model_dir.empty()) {
    model_dir = (fs::path(cfg.output_dir) / "initial-model").string();
    if (!fs::exists(fs::path(model_dir) / "config.json")) {
      auto preset = common::ModelConfigPreset("tiny");
      auto init = common::Model::InitRandom(*preset, cfg.seed);
      if (!init.ok()) return fail(init.status());
      Status s = (*init)->Save(model_dir);
      if (s.ok()) s = common::ByteTokenizer().Save(model_dir + "/tokenizer.json");
      if (!s.ok()) return fail(s);
    }
  }
  // `device`; with `bf16` the trainer keeps this fp32 master and trains a bf16 copy (with
  // no_shard / shard_grad_op offload on a GPU the master is loaded on the host, the copy there).
  auto device = common::ResolveDevice(cfg.device);
  if (!device.ok()) return fail(device.status(), 2);
  WarnOfCpuBf16(cfg, *device);
  auto fsdp = common::ParseFsdp(cfg.fsdp);
  if (!fsdp.ok()) return fail(fsdp.status(), 2);
  auto model_or = common::Model::Load(model_dir, learner::MasterHome(*fsdp, *device));
  if (!model_or.ok()) return fail(model_or.status());
  std::shared_ptr<common::Model> model = std::move(model_or).value();
  auto tok_or = common::LoadTokenizer(model_dir);
  if (!tok_or.ok()) return fail(tok_or.status());
  const common::Tokenizer& tok = **tok_or;

  std::vector<json> rows;
  if (o.dataset.empty()) {
    rows = BuiltinDataset();
  } else {
    auto r = ReadJsonl(o.dataset);
    if (!r.ok()) return fail(r.status(), 2);
    rows = std::move(r).value();
  }
  std::vector<rollout::Prompt> data;
  for (size_t i = 0; i < rows.size(); ++i) {
    auto prompt = rollout::PreparePrompt(std::move(rows[i]), tok);
    if (!prompt.ok())
      return fail(prompt.status().WithContext("dataset row " + std::to_string(i)), 2);
    data.push_back(std::move(prompt).value());
  }

  const json reward_options = DemoRewardOptions(static_cast<int64_t>(o.target_length));
  auto rewards = rollout::RewardRunner::FromConfig(cfg, reward_options);
  if (!rewards.ok()) return fail(rewards.status(), 2);

  // beta != 0: the KL term needs the reference policy, the starting weights (as the learner
  // service builds it).
  std::unique_ptr<common::Model> reference;
  if (cfg.beta != 0.0) {
    auto ref_or = common::Model::Load(model_dir, *device);
    if (!ref_or.ok()) return fail(ref_or.status().WithContext("reference model"));
    reference = std::move(ref_or).value();
  }
  auto trainer_or =
      learner::GrpoTrainer::Create(cfg, model.get(), std::move(reference), nullptr, *device);
  if (!trainer_or.ok()) return fail(trainer_or.status(), 2);
  learner::GrpoTrainer& trainer = **trainer_or;
  if (trainer.optimizer().ShardsParameters()) {
    // The weights live in full_shard's shards (on the host with offload), whole nowhere between
    // uses: nothing to decode with in this process.
    return fail(Status::InvalidArgument("config key 'fsdp': " + cfg.fsdp +
                                        " shards the weights, which train-local generates with "
                                        "in the same process; run it with `grpo learner` and "
                                        "workers"),
                2);
  }
  if (!fs::exists(cfg.output_dir)) fs::create_directories(cfg.output_dir);
  if (auto restored = learner::RestoreLatestCheckpoint(trainer, cfg.output_dir); restored.ok()) {
    std::cerr << "resumed from " << *restored << " at step " << trainer.global_step() << "\n";
  }

  // Generation runs on the trainer's compute model: the bf16 copy with `bf16`, else the policy.
  auto gen_or = rollout::Generator::Create(rollout::BorrowModel(trainer.compute_model()),
                                           trainer.policy_version(),
                                           rollout::GeneratorOptions::FromConfig(cfg), &tok);
  if (!gen_or.ok()) return fail(gen_or.status(), 2);
  rollout::Generator& gen = **gen_or;

  const int64_t prompts_per_batch =
      o.prompts_per_step > 0 ? o.prompts_per_step : cfg.GenerationBatchGroups();
  std::vector<double> curve;
  int64_t cursor = trainer.global_step() * prompts_per_batch;
  const auto t_start = std::chrono::steady_clock::now();
  if (!o.json_lines) {
    std::cout << "training a " << model->NumParameters() << "-parameter "
              << model->config().model_type << " policy: " << prompts_per_batch << " prompts x "
              << cfg.num_generations << " generations per batch, " << cfg.max_steps
              << " optimizer steps, reward " << cfg.reward_funcs[0] << "\n";
  }
  while (trainer.global_step() < cfg.max_steps) {
    std::vector<rollout::ProduceInput> batch;
    for (int64_t i = 0; i < prompts_per_batch; ++i, ++cursor) {
      // The cursor seeds the samplers: a new sample of the same prompt each time round.
      batch.push_back({&data[cursor % static_cast<int64_t>(data.size())], cursor});
    }
    Status s =
        gen.SetPolicy(rollout::BorrowModel(trainer.compute_model()), trainer.policy_version());
    if (!s.ok()) return fail(s);
    auto produced = rollout::Produce(gen, rewards->get(), batch);
    if (!produced.ok()) return fail(produced.status());
    const double gen_seconds = produced->generate_seconds;
    std::vector<common::RolloutGroup> groups;
    for (size_t i = 0; i < produced->groups.size(); ++i) {
      rollout::ProducedGroup& p = produced->groups[i];
      if (!p.group.ok()) {
        std::cerr << "prompt skipped: " << p.group.status().ToString() << "\n";
        continue;
      }
      for (const auto& m : p.rewards.messages) std::cerr << "reward: " << m << "\n";
      common::RolloutGroup group = std::move(p.group).value();
      group.prompt_id = std::to_string(batch[i].seed_index);
      groups.push_back(std::move(group));
    }
    auto result = trainer.TrainGenerationBatch(groups);
    if (!result.ok()) return fail(result.status());
    for (const auto& [id, reason] : result->rejected) {
      std::cerr << "group " << id << " rejected: " << learner::RejectReasonName(reason) << "\n";
    }
    for (auto& step : result->steps) {
      curve.push_back(step.reward);
      json j = step.ToJson();
      j["generation_seconds"] = gen_seconds;
      if (o.json_lines) {
        std::cout << j.dump() << "\n" << std::flush;
      } else {
        std::cout << "step " << std::setw(4) << step.step << "  reward " << std::setw(8)
                  << std::fixed << std::setprecision(3) << step.reward << "  loss " << std::setw(8)
                  << std::setprecision(4) << step.loss << "  len " << std::setw(5)
                  << std::setprecision(1) << step.completions_mean_length << "  grad_norm "
                  << std::setprecision(3) << step.grad_norm << "  " << std::setprecision(1)
                  << step.tokens_per_second << " tok/s\n"
                  << std::flush;
      }
    }
    if (cfg.save_steps > 0 && trainer.global_step() % cfg.save_steps == 0 &&
        !result->steps.empty()) {
      auto dir = learner::SaveCheckpoint(trainer, cfg.output_dir, model_dir);
      if (!dir.ok()) return fail(dir.status());
      if (!o.json_lines) std::cout << "saved " << *dir << "\n";
    }
  }
  auto final_dir = learner::SaveCheckpoint(trainer, cfg.output_dir, model_dir);
  if (!final_dir.ok()) return fail(final_dir.status());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  const CurveSummary c = SummarizeCurve(curve);
  const size_t n = c.steps, k = c.window;
  const double first = c.first, last = c.last;
  json summary = {{"summary", true},         {"steps", n},
                  {"seconds", seconds},      {"reward_first", first},
                  {"reward_last", last},     {"reward_gain_in_std_errors", c.gain_in_std_errors},
                  {"checkpoint", *final_dir}};
  if (o.json_lines) {
    std::cout << summary.dump() << "\n";
  } else if (n > 0) {
    std::cout << "\nmean reward per step\n"
              << TextPlot(curve) << "\n"
              << "reward: first " << k << " steps " << std::setprecision(3) << first << ", last "
              << k << " steps " << last << " (" << std::setprecision(1)
              << summary["reward_gain_in_std_errors"].get<double>() << " standard errors), " << n
              << " steps in " << std::setprecision(0) << seconds << " s\n"
              << "policy saved to " << *final_dir << " (Hugging Face layout)\n";
  }
  return 0;
}

}  // namespace

void AddTrainLocalCommand(CLI::App& app, CliAction* action) {
  auto* cmd = app.add_subcommand(
      "train-local",
      "Generate, score and train in one process (no services) on a built-in task or a JSON "
      "Lines dataset; config keys as --key value");
  auto o = std::make_shared<TrainLocalOptions>();
  cmd->add_option("--dataset", o->dataset,
                  "JSON Lines rows with \"prompt\" or \"messages\" (default: built-in task)");
  cmd->add_option("--prompts_per_step", o->prompts_per_step,
                  "prompts per generation batch (default: generation batch / num_generations)");
  cmd->add_option("--target_length", o->target_length, "the length reward's target (tokens)");
  cmd->add_flag("--json", o->json_lines, "one JSON object per optimizer step on stdout");
  cmd->allow_extras();
  cmd->callback([cmd, o, action] {
    o->overrides = cmd->remaining();
    *action = [o] { return RunTrainLocal(*o); };
  });
}

}  // namespace grpo::services
