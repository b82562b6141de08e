// grpo bench partial_rollouts: what an in-flight weight update costs a Generate call, and what
// keeping the keys/values across it does to the behaviour log-probs (issue 26, "measure both").
// The bench model, 4 prompts x G=16, prompt 64, completion 128; a second policy (other weights)
// is installed once 64 tokens were decoded. Rows: no update (the call keeps its snapshot), an
// update that recomputes the cache, and one that keeps it. Each row's `logprob_gap` is the mean
// |behaviour log-prob - the log-prob the token's own version gives it in a full forward without
// a cache| over the tokens after the update: ~0 when recomputed, the mismatch when kept.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "rollout/generator.h"
#include "services/cli/bench_util.h"

namespace grpo::services::bench {
namespace {

using nlohmann::json;

constexpr int64_t kPrompts = 4, kSwitchAt = 64;

// Mean |behaviour - full-forward log-prob under the token's version| over the tokens sampled
// after the update (version 1), for every row.
double LogprobGap(const common::Model& after, const std::vector<std::vector<int32_t>>& prompts,
                  const rollout::GenerateResult& r) {
  at::NoGradGuard no_grad;
  double sum = 0;
  int64_t n = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    for (const common::Completion& c : r.groups[p]->completions) {
      if (c.token_versions.empty()) continue;
      std::vector<int64_t> seq(prompts[p].begin(), prompts[p].end());
      seq.insert(seq.end(), c.token_ids.begin(), c.token_ids.end());
      at::Tensor ids = at::tensor(seq, at::kLong).unsqueeze(0);
      at::Tensor logp = at::log_softmax(
          after.Logits(after.ForwardHidden(ids, at::ones_like(ids))[0]).to(at::kDouble), -1);
      const int64_t base = static_cast<int64_t>(prompts[p].size()) - 1;
      for (size_t j = 0; j < c.token_ids.size(); ++j) {
        if (c.token_versions[j] != 1) continue;
        sum += std::abs(c.logprobs[j] -
                        logp[base + static_cast<int64_t>(j)][c.token_ids[j]].item<double>());
        ++n;
      }
    }
  }
  return n > 0 ? sum / static_cast<double>(n) : 0.0;
}

}  // namespace

int BenchPartialRollouts(bool as_json, int reps) {
  std::shared_ptr<const common::Model> before = BenchModel();
  auto cfg = common::ModelConfigPreset("bench");
  std::shared_ptr<const common::Model> after =
      std::move(common::Model::InitRandom(*cfg, 1)).value();
  const std::vector<std::vector<int32_t>> prompts =
      RandomPrompts(kPrompts, kPromptLen, before->config().vocab_size, 3);
  std::vector<json> rows;
  for (const char* mode : {"no_update", "recompute", "keep"}) {
    const std::string m = mode;
    rollout::GeneratorOptions o;
    o.num_generations = kBenchGenerations;
    o.max_completion_length = kCompletionLen;
    o.max_prompt_length = kPromptLen;
    o.eos_token_ids = {static_cast<int32_t>(before->config().vocab_size - 1)};  // ~never sampled
    o.seed = 7;
    o.partial_rollouts = m != "no_update";
    o.recompute_kv_on_update = m == "recompute";
    rollout::Generator* self = nullptr;
    if (m != "no_update") {
      o.window_hook = [&self, after](int64_t steps) {
        if (steps == kSwitchAt) (void)self->SetPolicy(after, 1);
      };
    }
    auto gen = std::move(rollout::Generator::Create(before, 0, o)).value();
    self = gen.get();
    rollout::GenerateResult last;
    const Timing t = TimeIt(reps, [&] {
      (void)gen->SetPolicy(before, 0);  // each call starts from version 0
      last = std::move(gen->Generate(prompts)).value();
    });
    rows.push_back({{"bench", "partial_rollouts"},
                    {"kv_cache", m},
                    {"tokens", last.num_completion_tokens},
                    {"tokens_per_second", last.num_completion_tokens / t.median},
                    {"s_median", t.median},
                    {"s_min", t.min},
                    {"s_max", t.max},
                    {"logprob_gap", m == "no_update" ? 0.0 : LogprobGap(*after, prompts, last)}});
  }
  const double base = rows[0]["s_median"].get<double>();
  for (json& r : rows) r["vs_no_update"] = r["s_median"].get<double>() / base;
  if (as_json) {
    for (const json& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "partial_rollouts: bench model, " << kPrompts << " prompts x G=" << kBenchGenerations
            << ", prompt " << kPromptLen << ", completion " << kCompletionLen
            << ", new weights after token " << kSwitchAt << "\n"
            << std::fixed;
  for (const json& r : rows) {
    std::cout << "  " << std::left << std::setw(10) << r["kv_cache"].get<std::string>()
              << std::right << std::setprecision(0) << std::setw(8)
              << r["tokens_per_second"].get<double>() << " tokens/s  " << std::setprecision(2)
              << r["s_median"].get<double>() << " s (" << r["vs_no_update"].get<double>()
              << "x)  log-prob gap after the update " << std::setprecision(5)
              << r["logprob_gap"].get<double>() << " nats\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
