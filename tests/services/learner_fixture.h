// The LearnerServiceTest fixture: an in-process LearnerServer on the tiny model with a fake
// clock, and wire-level helpers (submit, register, lease, push). Shared by the learner service
// test binaries.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/model/model.h"
#include "common/model/model_config.h"
#include "services/auth.h"
#include "services/learner_service.h"
#include "tests/learner/tiny_config.h"
#include "tests/services/learner_test_util.h"

namespace grpo::services::testing {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

inline constexpr auto kCallTimeout = std::chrono::seconds(10);

inline common::GrpoConfig TinyConfig(const fs::path& dir) {
  common::GrpoConfig c = grpo::testing::TinyLearnerConfig(dir);
  c.grpc_port = 0;
  return c;
}

class LearnerServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("learner_service_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    clock_ms_ = 1'700'000'000'000;
    config_ = TinyConfig(dir_);
  }
  void TearDown() override {
    server_.reset();
    fs::remove_all(dir_);
  }

  void StartServer(bool resume = true) {
    auto model = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    LearnerServerOptions options = options_;
    // A fake wall clock that moves 1 ms per reading, as a real one would between events.
    options.now_ms = [this] { return clock_ms_.fetch_add(1); };
    options.resume = resume;
    auto server = LearnerServer::Create(config_, std::move(model).value(), nullptr, options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_GT(server_->port(), 0);
    channel_ = MakeChannel("127.0.0.1:" + std::to_string(server_->port()));
    stub_ = v1::LearnerService::NewStub(channel_);
  }

  std::unique_ptr<grpc::ClientContext> Ctx(milliseconds timeout = kCallTimeout) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + timeout);
    AddAuth(*ctx, token_);
    return ctx;
  }

  v1::SubmitDatasetResponse Submit(const std::vector<std::string>& lines,
                                   const std::string& key = "", grpc::Status* status = nullptr) {
    auto ctx = Ctx();
    v1::SubmitDatasetResponse response;
    auto writer = stub_->SubmitDataset(ctx.get(), &response);
    v1::SubmitDatasetRequest first;
    first.set_idempotency_key(key);
    first.set_name("test");
    // Two lines per message: the server must join chunks. The last one says so.
    for (size_t i = 0; i < lines.size(); ++i) {
      first.add_lines(lines[i]);
      if (first.lines_size() == 2 || i + 1 == lines.size()) {
        if (i + 1 == lines.size()) {
          first.set_last(true);
          first.set_total_lines(static_cast<int64_t>(lines.size()));
        }
        EXPECT_TRUE(writer->Write(first));
        first.Clear();
      }
    }
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    if (status != nullptr) {
      *status = s;
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return response;
  }

  std::vector<std::string> Prompts(int n) {
    std::vector<std::string> lines;
    for (int i = 0; i < n; ++i)
      lines.push_back(R"({"prompt": "say )" + std::to_string(i) + R"("})");
    return lines;
  }

  // Registers `worker` (the learner leases only to registered workers).
  void RegisterWorker(const std::string& worker) {
    v1::RegisterRequest reg;
    reg.set_worker_id(worker);
    v1::RegisterResponse r;
    grpc::Status s = stub_->Register(Ctx().get(), reg, &r);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }

  v1::LeasePromptsResponse Lease(int n, const std::string& worker = "w1",
                                 milliseconds timeout = kCallTimeout) {
    v1::LeasePromptsRequest req;
    req.set_worker_id(worker);
    req.set_max_prompts(n);
    v1::LeasePromptsResponse resp;
    grpc::Status s = stub_->LeasePrompts(Ctx(timeout).get(), req, &resp);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {  // first use of this worker id
      RegisterWorker(worker);
      resp.Clear();
      s = stub_->LeasePrompts(Ctx(timeout).get(), req, &resp);
    }
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // A well-formed group for the tiny model (vocab 259): 2 completions, one reward each.
  v1::RolloutGroup Group(const v1::Lease& lease, double reward0 = 1.0, double reward1 = 0.0) {
    return testing::TinyGroup(lease, server_->published_version(), reward0, reward1,
                              server_->incarnation());
  }

  v1::PushRolloutsResponse Push(const std::vector<v1::RolloutGroup>& groups) {
    auto ctx = Ctx();
    v1::PushRolloutsResponse response;
    auto writer = stub_->PushRollouts(ctx.get(), &response);
    for (const auto& g : groups) EXPECT_TRUE(writer->Write(g));
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }

  learner::PromptState StateOf(const std::string& prompt_id) {
    auto r = server_->TEST_ledger().GetPrompt(prompt_id);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->state : learner::PromptState::kRejected;
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
  std::atomic<int64_t> clock_ms_{0};
  common::GrpoConfig config_;
  LearnerServerOptions options_;
  std::string token_;
  std::unique_ptr<LearnerServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::LearnerService::Stub> stub_;
};

}  // namespace grpo::services::testing
