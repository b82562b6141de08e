// The project's metric families (common/metrics/grpo_metrics.h): the exact set of names and types,
// and Prometheus' own linter (`promtool check metrics`) finds no problem with any of them.
#include "common/metrics/grpo_metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace grpo::common {
namespace {

const std::vector<std::string> kRewardFuncs = {"accuracy", "format"};

// name -> type, from the `# TYPE` lines.
std::map<std::string, std::string> FamilyTypes(const std::string& exposition) {
  std::map<std::string, std::string> types;
  std::istringstream in(exposition);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) != 0) continue;
    std::istringstream words(line.substr(7));
    std::string name, type;
    words >> name >> type;
    types[name] = type;
  }
  return types;
}

// Gives every family of both structs a sample value, as the services will.
std::string PopulatedExposition() {
  Registry r;
  LearnerMetrics l = LearnerMetrics::Create(r, kRewardFuncs).value();
  WorkerMetrics w = WorkerMetrics::Create(r, kRewardFuncs).value();
  l.optimizer_steps->Increment();
  l.policy_version->Set(1);
  l.loss->Set(0.031);
  l.reward_mean->Set(0.62);
  l.reward_std->Set(0.4);
  l.reward_fn_mean->Set({"accuracy"}, 0.5);
  l.reward_fn_mean->Set({"format"}, 1);
  l.reward_fn_std->Set({"accuracy"}, 0.5);
  l.reward_zero_std_ratio->Set(0.25);
  l.completion_mean_length->Set(87.5);
  l.completion_clipped_ratio->Set(0.125);
  l.kl->Set(0.002);
  l.clip_ratio->Set({"low"}, 0.01);
  l.clip_ratio->Set({"high"}, 0.02);
  l.clip_ratio->Set({"region"}, 0.03);
  l.entropy->Set(1.7);
  l.is_ratio_mean->Set(1.01);
  l.is_ratio_max->Set(2.9);
  l.logprob_mismatch->Set({"mean"}, 0.004);
  l.logprob_mismatch->Set({"max"}, 0.06);
  l.grad_norm->Set(0.8);
  l.learning_rate->Set(1e-6);
  l.tokens_per_second->Set(1234.5);
  l.step_duration->Observe(2.2);
  l.buffer_groups->Set(16);
  l.staleness->Observe(1);
  l.groups_accepted->Increment(16);
  l.groups_rejected->Increment({"expired_lease"});
  l.ledger_prompts->Set({"queued"}, 100);
  l.weight_sync_duration->Observe(0.3);
  l.weight_sync_bytes->Increment(1.2e9);
  l.checkpoint_duration->Observe(4);
  l.peak_memory->Set(3.5e9);
  w.tokens_generated->Increment(4096);
  w.episodes->Increment({"max_turns"}, 3);
  w.episode_turns->Increment(9);
  w.env_errors->Increment({"timeout"});
  w.env_wait->Increment(0.25);
  w.tool_calls->Increment(2);
  w.tool_call_failures->Increment({"not_json"});
  w.generation_duration->Observe(3.1);
  w.reward_duration->Observe({"format"}, 0.0002);
  w.reward_errors->Increment({"accuracy", "timeout"});
  w.weight_version->Set(1);
  w.leases_held->Set(4);
  w.groups_pushed->Increment(4);
  return r.Expose();
}

TEST(GrpoMetrics, DefinesExactlyTheIssueSixFamilies) {
  const std::map<std::string, std::string> expected = {
      {"grpo_optimizer_steps_total", "counter"},
      {"grpo_policy_version", "gauge"},
      {"grpo_loss", "gauge"},
      {"grpo_reward_mean", "gauge"},
      {"grpo_reward_std", "gauge"},
      {"grpo_reward_fn_mean", "gauge"},
      {"grpo_reward_fn_std", "gauge"},
      {"grpo_reward_zero_std_ratio", "gauge"},
      {"grpo_completion_mean_length_tokens", "gauge"},
      {"grpo_completion_clipped_ratio", "gauge"},
      {"grpo_kl", "gauge"},
      {"grpo_clip_ratio", "gauge"},
      {"grpo_entropy", "gauge"},
      {"grpo_is_ratio_mean", "gauge"},
      {"grpo_is_ratio_max", "gauge"},
      {"grpo_logprob_mismatch", "gauge"},
      {"grpo_grad_norm", "gauge"},
      {"grpo_learning_rate", "gauge"},
      {"grpo_learner_lock_max_hold_seconds", "gauge"},
      {"grpo_learner_tokens_per_second", "gauge"},
      {"grpo_step_duration_seconds", "histogram"},
      {"grpo_buffer_groups", "gauge"},
      {"grpo_staleness_versions", "histogram"},
      {"grpo_groups_accepted_total", "counter"},
      {"grpo_groups_rejected_total", "counter"},
      {"grpo_groups_filtered_total", "counter"},
      {"grpo_short_batches_total", "counter"},
      {"grpo_ledger_prompts", "gauge"},
      {"grpo_weight_sync_duration_seconds", "histogram"},
      {"grpo_weight_sync_bytes_total", "counter"},
      {"grpo_checkpoint_duration_seconds", "histogram"},
      {"grpo_checkpoint_failures_total", "counter"},
      {"grpo_ledger_errors_total", "counter"},
      {"grpo_peak_memory_bytes", "gauge"},
      {"grpo_rollout_tokens_generated_total", "counter"},
      {"grpo_rollout_generation_duration_seconds", "histogram"},
      {"grpo_rollout_reward_duration_seconds", "histogram"},
      {"grpo_rollout_reward_errors_total", "counter"},
      {"grpo_rollout_weight_version", "gauge"},
      {"grpo_rollout_leases_held", "gauge"},
      {"grpo_rollout_groups_pushed_total", "counter"},
      {"grpo_rollout_episodes_total", "counter"},
      {"grpo_rollout_episode_turns_total", "counter"},
      {"grpo_rollout_env_errors_total", "counter"},
      {"grpo_rollout_env_wait_seconds_total", "counter"},
      {"grpo_rollout_tool_calls_total", "counter"},
      {"grpo_rollout_tool_call_failures_total", "counter"},
  };
  EXPECT_EQ(FamilyTypes(PopulatedExposition()), expected);
}

// Issue 22 item 7: the refusal reasons are one table (common/group_refusal.h); the names are the
// ones README "Metrics" documents, unique, and the metric's label set is that table.
TEST(GroupRefusal, EveryReasonHasOneNameAndTheMetricLabelsAreTheTable) {
  const std::vector<std::string> documented = {
      "group_size",     "empty_prompt",  "empty_completion",  "completion_too_long",
      "env_mask",       "tool_counts",   "token_versions",    "token_out_of_vocab",
      "logprob_length", "reward_count",  "non_finite_reward", "reward_out_of_range",
      "stale",          "unknown_lease", "expired_lease",     "job_ended",
      "ledger_error",   "buffer_full",   "unknown_policy",    "learner_stopping",
      "worker_failed",  "prompt_failed"};
  ASSERT_EQ(kGroupRefusalNames.size(), documented.size());
  for (size_t i = 0; i < documented.size(); ++i) {
    EXPECT_EQ(kGroupRefusalNames[i], documented[i]) << i;
  }
  EXPECT_EQ(GroupRefusalName(GroupRefusal::kEnvMask), "env_mask");
  EXPECT_EQ(GroupRefusalName(GroupRefusal::kStale), "stale");
  EXPECT_EQ(GroupRefusalName(GroupRefusal::kUnknownPolicy), "unknown_policy");
  EXPECT_EQ(GroupRefusalName(GroupRefusal::kLearnerStopping), "learner_stopping");
  EXPECT_EQ(GroupRefusalName(GroupRefusal::kWorkerFailed), "worker_failed");
  EXPECT_EQ(GroupRefusalName(GroupRefusal::kPromptFailed), "prompt_failed");
  EXPECT_EQ(&kRejectReasons, &kGroupRefusalNames);
}

TEST(GrpoMetrics, LabelsTakeOnlyTheirFixedValues) {
  Registry r;
  LearnerMetrics l = LearnerMetrics::Create(r, kRewardFuncs).value();
  const std::string text = r.Expose();
  for (std::string_view reason : kRejectReasons) {
    EXPECT_NE(text.find("grpo_groups_rejected_total{reason=\"" + std::string(reason) + "\"} 0\n"),
              std::string::npos)
        << reason;
  }
  EXPECT_NE(text.find("grpo_ledger_prompts{state=\"leased\"} 0\n"), std::string::npos);
  EXPECT_NE(text.find("grpo_reward_fn_mean{reward_fn=\"format\"} 0\n"), std::string::npos);
  l.reward_fn_mean->Set({"length"}, 1);  // not configured: dropped
  l.groups_rejected->Increment({"prompt 17"});
  EXPECT_EQ(l.reward_fn_mean->dropped(), 1u);
  EXPECT_EQ(l.groups_rejected->dropped(), 1u);
}

TEST(GrpoMetrics, LogprobMismatchIsLabelledMeanAndMaxOnly) {
  Registry r;
  LearnerMetrics l = LearnerMetrics::Create(r, kRewardFuncs).value();
  const std::string text = r.Expose();
  EXPECT_NE(text.find("grpo_logprob_mismatch{stat=\"mean\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("grpo_logprob_mismatch{stat=\"max\"} 0\n"), std::string::npos) << text;
  l.logprob_mismatch->Set({"p99"}, 1);  // not a declared stat: dropped
  EXPECT_EQ(l.logprob_mismatch->dropped(), 1u);
}

TEST(GrpoMetrics, RefusesRepeatedOrEmptyRewardFunctionNames) {
  Registry r1, r2;
  EXPECT_EQ(LearnerMetrics::Create(r1, {"accuracy", "accuracy"}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkerMetrics::Create(r2, {""}).status().code(), StatusCode::kInvalidArgument);
}

TEST(GrpoMetrics, CreatingTwiceInOneRegistryIsAlreadyExists) {
  Registry r;
  ASSERT_TRUE(WorkerMetrics::Create(r, kRewardFuncs).ok());
  EXPECT_EQ(WorkerMetrics::Create(r, kRewardFuncs).status().code(), StatusCode::kAlreadyExists);
}

TEST(GrpoMetrics, PromtoolCheckMetricsFindsNoProblem) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus; deploy/setup.sh)";
  }
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("grpo_promtool_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path in = dir / "metrics.txt", out = dir / "promtool.txt";
  std::ofstream(in) << PopulatedExposition();
  const int rc = std::system(
      ("promtool check metrics < " + in.string() + " > " + out.string() + " 2>&1").c_str());
  std::stringstream problems;
  problems << std::ifstream(out).rdbuf();
  fs::remove_all(dir);
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(problems.str(), "");
}

}  // namespace
}  // namespace grpo::common
