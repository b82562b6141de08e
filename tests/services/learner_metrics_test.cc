// LearnerServer's Prometheus families (common/metrics/grpo_metrics.h): after a step they hold that
// step's StepMetrics, refusals count by reason, the ledger gauges follow the ledger, and the
// live /metrics passes `promtool check metrics`.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "common/metrics/http_exposer.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "services/auth.h"
#include "services/convert.h"
#include "services/learner_service.h"
#include "tests/learner/tiny_config.h"
#include "tests/services/http_test_util.h"
#include "tests/services/learner_test_util.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr auto kCallTimeout = std::chrono::seconds(10);

class LearnerMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("learner_metrics_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    config_ = grpo::testing::TinyLearnerConfig(dir_);
    config_.grpc_port = 0;
    config_.reward_funcs = {"length"};
  }
  void TearDown() override {
    server_.reset();
    fs::remove_all(dir_);
  }

  void StartServer() {
    auto model = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    auto server = LearnerServer::Create(config_, std::move(model).value());
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    ASSERT_TRUE(server_->Start().ok());
    stub_ =
        v1::LearnerService::NewStub(MakeChannel("127.0.0.1:" + std::to_string(server_->port())));
  }

  std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + kCallTimeout);
    return ctx;
  }

  void Submit(int n) {
    auto ctx = Ctx();
    v1::SubmitDatasetResponse response;
    auto writer = stub_->SubmitDataset(ctx.get(), &response);
    v1::SubmitDatasetRequest req;
    for (int i = 0; i < n; ++i) req.add_lines(R"({"prompt": "say )" + std::to_string(i) + R"("})");
    req.set_last(true);
    req.set_total_lines(n);
    EXPECT_TRUE(writer->Write(req));
    writer->WritesDone();
    EXPECT_TRUE(writer->Finish().ok());
  }

  v1::LeasePromptsResponse Lease(int n) {
    v1::LeasePromptsRequest req;
    req.set_worker_id("w1");
    req.set_max_prompts(n);
    v1::LeasePromptsResponse resp;
    grpc::Status s = stub_->LeasePrompts(Ctx().get(), req, &resp);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {  // register "w1" on first use
      v1::RegisterRequest reg;
      reg.set_worker_id("w1");
      v1::RegisterResponse r;
      EXPECT_TRUE(stub_->Register(Ctx().get(), reg, &r).ok());
      resp.Clear();
      s = stub_->LeasePrompts(Ctx().get(), req, &resp);
    }
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // A well-formed group for the tiny model: 2 completions, one reward each.
  v1::RolloutGroup Group(const v1::Lease& lease, double reward0, double reward1) {
    return testing::TinyGroup(lease, server_->published_version(), reward0, reward1,
                              server_->incarnation());
  }

  v1::PushRolloutsResponse Push(const std::vector<v1::RolloutGroup>& groups) {
    auto ctx = Ctx();
    v1::PushRolloutsResponse response;
    auto writer = stub_->PushRollouts(ctx.get(), &response);
    for (const auto& g : groups) EXPECT_TRUE(writer->Write(g));
    writer->WritesDone();
    EXPECT_TRUE(writer->Finish().ok());
    return response;
  }

  // Trains one step on two fresh groups; returns the step's TRL metrics (Job.last_metrics).
  std::map<std::string, double> TrainOneStep() {
    Submit(4);
    const auto leases = Lease(2);
    EXPECT_EQ(leases.leases_size(), 2);
    const auto ack = Push({Group(leases.leases(0), 1.0, 0.0), Group(leases.leases(1), 0.25, 0.25)});
    EXPECT_EQ(ack.accepted(), 2);
    EXPECT_TRUE(WaitFor([&] { return server_->published_version() >= 1; }));
    v1::Job job;
    EXPECT_TRUE(stub_->GetJob(Ctx().get(), v1::GetJobRequest(), &job).ok());
    return {job.last_metrics().begin(), job.last_metrics().end()};
  }

  bool WaitFor(const std::function<bool()>& cond, milliseconds timeout = milliseconds(8000)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (cond()) return true;
      std::this_thread::sleep_for(milliseconds(10));
    }
    return cond();
  }

  fs::path dir_;
  common::GrpoConfig config_;
  std::unique_ptr<LearnerServer> server_;
  std::unique_ptr<v1::LearnerService::Stub> stub_;
};

TEST_F(LearnerMetricsTest, AfterAStepTheFamiliesHoldThatStepsMetrics) {
  StartServer();
  const auto& m = server_->metrics();
  EXPECT_EQ(m.optimizer_steps->Value(), 0);
  const std::map<std::string, double> step = TrainOneStep();
  ASSERT_TRUE(step.count("loss"));
  EXPECT_EQ(m.optimizer_steps->Value(), 1);
  EXPECT_EQ(m.policy_version->Value(), 1);
  EXPECT_EQ(step.at("policy_version"), 1);
  EXPECT_DOUBLE_EQ(m.loss->Value(), step.at("loss"));
  EXPECT_DOUBLE_EQ(m.reward_mean->Value(), step.at("reward"));
  EXPECT_DOUBLE_EQ(m.reward_std->Value(), step.at("reward_std"));
  EXPECT_DOUBLE_EQ(m.reward_fn_mean->Value({"length"}), step.at("rewards/length/mean"));
  EXPECT_DOUBLE_EQ(m.reward_fn_std->Value({"length"}), step.at("rewards/length/std"));
  EXPECT_DOUBLE_EQ(m.reward_zero_std_ratio->Value(), step.at("frac_reward_zero_std"));
  EXPECT_DOUBLE_EQ(m.reward_zero_std_ratio->Value(), 0.5);  // the second group has equal rewards
  EXPECT_DOUBLE_EQ(m.grad_norm->Value(), step.at("grad_norm"));
  EXPECT_DOUBLE_EQ(m.learning_rate->Value(), step.at("learning_rate"));
  EXPECT_DOUBLE_EQ(m.entropy->Value(), step.at("entropy"));
  EXPECT_DOUBLE_EQ(m.completion_mean_length->Value(), step.at("completions/mean_length"));
  EXPECT_DOUBLE_EQ(m.completion_clipped_ratio->Value(), step.at("completions/clipped_ratio"));
  EXPECT_DOUBLE_EQ(m.clip_ratio->Value({"low"}), step.at("clip_ratio/low_mean"));
  EXPECT_DOUBLE_EQ(m.clip_ratio->Value({"high"}), step.at("clip_ratio/high_mean"));
  EXPECT_DOUBLE_EQ(m.clip_ratio->Value({"region"}), step.at("clip_ratio/region_mean"));
  EXPECT_DOUBLE_EQ(m.tokens_per_second->Value(), step.at("tokens_per_second"));
  EXPECT_DOUBLE_EQ(m.peak_memory->Value(), step.at("peak_memory_bytes"));
  EXPECT_EQ(m.step_duration->Count(), 1u);
  EXPECT_DOUBLE_EQ(m.step_duration->Sum(), step.at("step_seconds"));
  EXPECT_EQ(m.groups_accepted->Value(), 2);
  EXPECT_EQ(m.staleness->Count(), 2u);
  EXPECT_EQ(m.staleness->Sum(), 0);
  EXPECT_EQ(m.buffer_groups->Value(), 0);
  EXPECT_EQ(m.weight_sync_duration->Count(), 2u);  // the initial weights and version 1
  EXPECT_EQ(m.kl->Value(), 0);                     // beta = 0

  // A GetWeights stream counts its payload bytes.
  v1::GetWeightsRequest req;
  req.set_min_version(1);
  auto ctx = Ctx();
  auto reader = stub_->GetWeights(ctx.get(), req);
  v1::WeightChunk chunk;
  double bytes = 0;
  while (reader->Read(&chunk)) bytes += static_cast<double>(chunk.data().size());
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_GT(bytes, 0);
  EXPECT_EQ(m.weight_sync_bytes->Value(), bytes);
}

TEST_F(LearnerMetricsTest, LogprobMismatchGaugesHoldTheStepsMeanAndMax) {
  StartServer();
  const auto& gauge = *server_->metrics().logprob_mismatch;
  const std::map<std::string, double> step = TrainOneStep();
  // TinyGroup's behaviour log-probs are fixed numbers, far from the policy's: both are > 0.
  ASSERT_TRUE(step.count("logprob_mismatch/mean"));
  ASSERT_TRUE(step.count("logprob_mismatch/max"));
  EXPECT_GT(step.at("logprob_mismatch/mean"), 0);
  EXPECT_GE(step.at("logprob_mismatch/max"), step.at("logprob_mismatch/mean"));
  EXPECT_DOUBLE_EQ(gauge.Value({"mean"}), step.at("logprob_mismatch/mean"));
  EXPECT_DOUBLE_EQ(gauge.Value({"max"}), step.at("logprob_mismatch/max"));
  const std::string text = server_->metrics_registry().Expose();
  EXPECT_NE(text.find("grpo_logprob_mismatch{stat=\"mean\"} "), std::string::npos) << text;
  EXPECT_NE(text.find("grpo_logprob_mismatch{stat=\"max\"} "), std::string::npos) << text;
  EXPECT_EQ(gauge.dropped(), 0u);
}

TEST_F(LearnerMetricsTest, ACheckpointIsTimed) {
  config_.save_steps = 1;
  StartServer();
  TrainOneStep();
  EXPECT_TRUE(WaitFor([&] { return server_->metrics().checkpoint_duration->Count() == 1; }));
}

TEST_F(LearnerMetricsTest, RefusedGroupsCountByReason) {
  StartServer();
  Submit(2);
  const auto leases = Lease(2);
  ASSERT_EQ(leases.leases_size(), 2);
  v1::Lease forged = leases.leases(0);
  forged.set_lease_id(std::string(32, 'f'));
  const auto ack = Push({Group(forged, 1, 0), Group(leases.leases(1), std::nan(""), 0)});
  EXPECT_EQ(ack.rejected(), 2);
  const auto& rejected = *server_->metrics().groups_rejected;
  EXPECT_EQ(rejected.Value({"unknown_lease"}), 1);
  EXPECT_EQ(rejected.Value({"non_finite_reward"}), 1);
  EXPECT_EQ(rejected.Value({"stale"}), 0);
  EXPECT_EQ(rejected.dropped(), 0u);  // every reason the service uses is a declared value
  EXPECT_EQ(server_->metrics().groups_accepted->Value(), 0);
}

TEST_F(LearnerMetricsTest, LedgerGaugesMatchTheLedger) {
  StartServer();
  Submit(5);
  const auto leases = Lease(3);
  ASSERT_EQ(leases.leases_size(), 3);
  ASSERT_EQ(Push({Group(leases.leases(0), 1, 0)}).accepted(), 1);
  const auto& gauge = *server_->metrics().ledger_prompts;
  auto matches = [&] {
    auto c = server_->TEST_ledger().Counts();
    return c.ok() && gauge.Value({"queued"}) == c->queued && gauge.Value({"leased"}) == c->leased &&
           gauge.Value({"trained"}) == c->trained && gauge.Value({"rejected"}) == c->rejected;
  };
  EXPECT_TRUE(WaitFor([&] { return matches() && gauge.Value({"trained"}) == 1; }));
  EXPECT_EQ(gauge.Value({"queued"}), 2);
  EXPECT_EQ(gauge.Value({"leased"}), 2);
}

TEST_F(LearnerMetricsTest, PromtoolAcceptsTheLiveMetricsAndHealthzIsOk) {
  StartServer();
  TrainOneStep();
  LearnerServer* server = server_.get();
  common::HttpExposer exposer(server_->metrics_registry(), [server] { return server->Health(); });
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  const auto health = grpo::testing::HttpGet(exposer.port(), "/healthz");
  ASSERT_TRUE(health.has_value());
  EXPECT_EQ(health->status, 200);
  const auto metrics = grpo::testing::HttpGet(exposer.port(), "/metrics");
  ASSERT_TRUE(metrics.has_value());
  ASSERT_EQ(metrics->status, 200);
  EXPECT_NE(metrics->body.find("grpo_optimizer_steps_total 1\n"), std::string::npos);
  EXPECT_NE(metrics->body.find("grpo_policy_version 1\n"), std::string::npos);
  exposer.Stop();

  if (!fs::exists("/usr/bin/promtool")) GTEST_SKIP() << "promtool not installed";
  const fs::path file = dir_ / "metrics.txt";
  std::ofstream(file) << metrics->body;
  const std::string cmd = "/usr/bin/promtool check metrics < " + file.string() + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
}

}  // namespace
}  // namespace grpo::services
