// `grpo learner` as a group of two ranks (README "Learner ranks"), launched as torchrun would:
// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Rank 0 serves, both train, a worker generates; the
// job runs to max_steps and both ranks exit 0. A rank killed mid-job fails the job: rank 0 exits
// non-zero, naming the collective, for the orchestrator to restart the group.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/model/safetensors.h"
#include "learner/distributed/state_shards.h"
#include "tests/reserved_port.h"
#include "tests/services/http_test_util.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace {

using grpo::testing::Children;
using grpo::testing::GrpoBin;
using grpo::testing::LearnerCommand;
using grpo::testing::ReadFile;
using grpo::testing::RunCommand;
using grpo::testing::WaitUntil;
namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

class LearnerRanksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("learner_ranks_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "token") << "tok-ranks\n";
    std::ofstream data(dir_ / "data.jsonl");
    for (int i = 0; i < 16; ++i)
      data << R"({"prompt": "count )" << i << R"("})"
           << "\n";
    children_ = std::make_unique<Children>(dir_);
  }
  void TearDown() override {
    children_.reset();
    fs::remove_all(dir_);
  }

  // Both ranks of a world of two, rank 1 first (it waits for rank 0's store), with `extra`
  // learner flags, and a worker with `worker_extra` flags.
  void StartRanks(int max_steps, const std::vector<std::string>& extra = {},
                  const std::vector<std::string>& worker_extra = {}) {
    // Held while the ranks run: no concurrent test binds it before rank 0 does.
    master_port_ = std::make_unique<grpo::testing::ReservedPort>();
    const int master_port = master_port_->port();
    ASSERT_GT(master_port, 0);
    for (int rank : {1, 0}) {
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(master_port).c_str(), 1);
      std::vector<std::string> argv =
          LearnerCommand(dir_, {"--auth_token_file", (dir_ / "token").string(), "--reward_funcs",
                                "length", "--max_steps", std::to_string(max_steps),
                                "--rank_timeout_seconds", "20", "--linger_seconds", "0"});
      argv.insert(argv.end(), extra.begin(), extra.end());
      const pid_t pid = children_->Spawn("rank" + std::to_string(rank), argv);
      ASSERT_GT(pid, 0);
    }
    for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
    const nlohmann::json first = children_->FirstLine("rank0", seconds(60));
    ASSERT_TRUE(first.is_object() && first.contains("port")) << "rank 0 did not report its port:\n"
                                                             << Logs();
    address_ = "127.0.0.1:" + std::to_string(first["port"].get<int>());
    int rc = -1;
    RunCommand(GrpoBin() + " submit --learner_address " + address_ + " --auth_token_file " +
                   (dir_ / "token").string() + " --timeout_seconds 20 --dataset " +
                   (dir_ / "data.jsonl").string() + " >" + (dir_ / "submit.out").string() + " 2>&1",
               &rc);
    ASSERT_EQ(rc, 0) << ReadFile(dir_ / "submit.out");
    // At info: the test reads which versions it took.
    std::vector<std::string> worker = {
        GrpoBin(), "--log_level",    "info", "rollout",           "--learner_address",
        address_,  "--metrics_port", "0",    "--auth_token_file", (dir_ / "token").string()};
    worker.insert(worker.end(), worker_extra.begin(), worker_extra.end());
    ASSERT_GT(children_->Spawn("worker", worker), 0);
  }

  // Rank 0 ends the job within 240 s, rank 1 within 30 s more; both exit 0.
  void ExpectBothRanksExitZero() {
    const auto rank0 = children_->Wait("rank0", seconds(240));
    ASSERT_TRUE(rank0.has_value()) << "rank 0 still runs:\n" << Logs();
    EXPECT_EQ(*rank0, 0) << Logs();
    const auto rank1 = children_->Wait("rank1", seconds(30));
    ASSERT_TRUE(rank1.has_value()) << Logs();
    EXPECT_EQ(*rank1, 0) << Logs();
  }

  std::string Logs() const {
    return "rank 0:\n" + grpo::testing::Tail(children_->Err("rank0")) + "\nrank 1:\n" +
           grpo::testing::Tail(children_->Err("rank1")) + "\nworker:\n" +
           grpo::testing::Tail(children_->Err("worker"));
  }

  fs::path dir_;
  std::unique_ptr<Children> children_;
  std::unique_ptr<grpo::testing::ReservedPort> master_port_;
  std::string address_;
};

TEST_F(LearnerRanksTest, TwoRanksTrainTheJobToMaxStepsAndBothExitZero) {
  StartRanks(/*max_steps=*/3);
  ASSERT_NO_FATAL_FAILURE(ExpectBothRanksExitZero());
  const std::string log0 = ReadFile(children_->Err("rank0"));
  const std::string log1 = ReadFile(children_->Err("rank1"));
  EXPECT_NE(log0.find("rank 0 of 2 learner ranks"), std::string::npos) << log0;
  // Rank 1 trained every step with rank 0: a generation batch is 4 groups (2 a rank), one step.
  EXPECT_NE(log1.find("now at step 3"), std::string::npos) << log1;
  EXPECT_NE(log1.find("rank 0 ended the job at step 3"), std::string::npos) << log1;
  // Rank 0 alone wrote the checkpoint.
  EXPECT_TRUE(fs::exists(dir_ / "out" / "checkpoint-3")) << Logs();
}

// fsdp shard_grad_op (ZeRO-2), and full_shard (ZeRO-3) with bf16: each rank holds half of
// AdamW's state and writes it into every checkpoint (one at step 2 by save_steps, the last at
// 3) as its own shard file; rank 1 leaves only after the last. The two files hold the whole
// state: put together, the moments have the parameters' shapes. The weights are the fp32
// master's (with full_shard and bf16 gathered from the fp32 shards, not the bf16 units).
class LearnerRanksShards : public LearnerRanksTest,
                           public ::testing::WithParamInterface<std::vector<std::string>> {};

TEST_P(LearnerRanksShards, RanksWriteTheirShardsOfEveryCheckpoint) {
  std::vector<std::string> flags = GetParam();
  flags.insert(flags.end(), {"--save_steps", "2"});
  StartRanks(/*max_steps=*/3, flags);
  ASSERT_NO_FATAL_FAILURE(ExpectBothRanksExitZero());
  EXPECT_NE(ReadFile(children_->Err("rank1")).find("rank 0 ended the job at step 3"),
            std::string::npos)
      << Logs();
  for (const char* name : {"checkpoint-2", "checkpoint-3"}) {
    const fs::path ckpt = dir_ / "out" / name;
    EXPECT_FALSE(fs::exists(ckpt / "optimizer.safetensors")) << name;
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(fs::exists(ckpt / grpo::learner::distributed::StateShardFileName(r, 2)))
          << name << " rank " << r;
    }
    auto model = grpo::common::SafetensorsFile::Open((ckpt / "model.safetensors").string());
    auto shards = grpo::learner::distributed::StateShards::Open(ckpt.string());
    ASSERT_TRUE(model.ok() && shards.ok()) << name << "\n" << Logs();
    ASSERT_FALSE((*model)->Names().empty());
    grpo::common::NamedTensors params;
    for (const std::string& p : (*model)->Names()) {
      const auto w = (*model)->Get(p);
      ASSERT_TRUE(w.ok()) << p;
      EXPECT_EQ(w->scalar_type(), at::kFloat) << name << ": " << p;
      params.emplace_back(p, *w);
    }
    auto whole = grpo::learner::distributed::WholeStateFromShards(**shards, params);
    ASSERT_TRUE(whole.ok()) << name << ": " << whole.status().ToString();
    for (size_t i = 0; i < params.size(); ++i) {
      for (int which : {0, 1}) {
        const auto& [mname, m] = whole->at(2 * i + which);
        EXPECT_EQ(m.sizes(), params[i].second.sizes()) << name << ": " << mname;
        // A moment after two or three steps of AdamW is not all zero (a missing shard would be).
        EXPECT_GT(m.abs().sum().item<double>(), 0.0) << name << ": " << mname;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, LearnerRanksShards,
    ::testing::Values(std::vector<std::string>{"--fsdp", "shard_grad_op"},
                      std::vector<std::string>{"--fsdp", "full_shard", "--bf16", "true"},
                      // The fp32 master sharded too, gathered a bucket at
                      // a time into the checkpoint.
                      std::vector<std::string>{"--fsdp", "shard_grad_op", "--bf16", "true"}));

// weight_publish stream at full_shard: no rank holds the whole weights. Each version goes to
// the worker's gloo group a tensor at a time while both ranks gather it a unit at a time (and
// to GetWeights the same way when the worker falls back); the job trains to max_steps only if
// the worker received newer versions than the first.
TEST_F(LearnerRanksTest, FullShardStreamsEachVersionToTheWorker) {
  StartRanks(/*max_steps=*/3, {"--fsdp", "full_shard", "--weight_publish", "stream"},
             {"--weight_sync_backend", "gloo"});
  ASSERT_NO_FATAL_FAILURE(ExpectBothRanksExitZero());
  const std::string log0 = ReadFile(children_->Err("rank0"));
  const std::string worker = ReadFile(children_->Err("worker"));
  EXPECT_NE(log0.find("weight sync gloo"), std::string::npos) << log0;
  EXPECT_NE(log0.find("streamed over gloo"), std::string::npos) << log0;
  EXPECT_EQ(log0.find("snapshot"), std::string::npos) << log0;
  // A later version than the first reached the worker (its steps train on it: max_staleness).
  bool later = false;
  for (int v = 1; v <= 3; ++v) {
    later |= worker.find("policy version " + std::to_string(v) + " (learner") != std::string::npos;
  }
  EXPECT_TRUE(later) << worker;
}

// From model_name_or_path each rank reads only its part of the model's files: full_shard its
// shards (sharded loading, Model::LoadDeferred), for the policy and, with beta 0.04, the
// reference (FrozenShards); shard_grad_op with bf16 its chunks of the fp32 master (and its bf16
// copy whole). The job trains to max_steps. Read at a wrong place, a weight would be another's
// (a norm's ones, a projection's N(0, 0.02) values): the checkpoint after 3 steps of AdamW at
// lr 1e-6 (each step moves a weight by about lr at most) is within 1e-4 of the initial model
// everywhere, and has moved.
struct ShardedLoadingCase {
  std::vector<std::string> flags;
  std::vector<std::string> logs;  // each rank's log has each, with the model's directory in it
};

class LearnerRanksShardedLoading : public LearnerRanksTest,
                                   public ::testing::WithParamInterface<ShardedLoadingCase> {};

TEST_P(LearnerRanksShardedLoading, RanksReadOnlyTheirPartOfTheModel) {
  int rc = -1;
  const fs::path model = dir_ / "model";
  RunCommand(GrpoBin() + " init-model --preset tiny --seed 5 --out " + model.string() + " >" +
                 (dir_ / "init.out").string() + " 2>&1",
             &rc);
  ASSERT_EQ(rc, 0) << ReadFile(dir_ / "init.out");
  std::vector<std::string> flags = GetParam().flags;
  flags.insert(flags.end(), {"--model_name_or_path", model.string()});
  StartRanks(/*max_steps=*/3, flags);
  ASSERT_NO_FATAL_FAILURE(ExpectBothRanksExitZero());
  for (const char* rank : {"rank0", "rank1"}) {
    for (std::string line : GetParam().logs) {
      line.replace(line.find("<dir>"), 5, model.string());
      EXPECT_NE(ReadFile(children_->Err(rank)).find(line), std::string::npos)
          << rank << ": " << line << "\n"
          << Logs();
    }
  }
  auto initial = grpo::common::SafetensorsFile::Open((model / "model.safetensors").string());
  auto trained = grpo::common::SafetensorsFile::Open(
      (dir_ / "out" / "checkpoint-3" / "model.safetensors").string());
  ASSERT_TRUE(initial.ok() && trained.ok()) << Logs();
  double moved = 0;
  for (const std::string& name : (*initial)->Names()) {
    const auto a = (*initial)->Get(name);
    const auto b = (*trained)->Get(name);
    ASSERT_TRUE(a.ok() && b.ok()) << name;
    EXPECT_EQ(b->scalar_type(), at::kFloat) << name;
    const double diff = (*b - *a).abs().max().item<double>();
    EXPECT_LE(diff, 1e-4) << name;
    moved = std::max(moved, diff);
  }
  EXPECT_GT(moved, 0.0) << "the job trained nothing";
}

INSTANTIATE_TEST_SUITE_P(
    Modes, LearnerRanksShardedLoading,
    ::testing::Values(
        ShardedLoadingCase{{"--fsdp", "full_shard", "--beta", "0.04"},
                           {"sharded loading: this rank reads only its shards of <dir> (the "
                            "policy)",
                            "sharded loading: this rank reads only its shards of <dir> (the "
                            "reference model)"}},
        ShardedLoadingCase{{"--fsdp", "shard_grad_op", "--bf16", "true"},
                           {"sharded loading: this rank reads its chunks of the fp32 master of "
                            "<dir>"}}));

TEST_F(LearnerRanksTest, AKilledRankFailsTheJobAndRankZeroExitsNonZeroNamingTheCollective) {
  StartRanks(/*max_steps=*/1000);
  ASSERT_TRUE(WaitUntil(
      [&] { return ReadFile(children_->Err("rank1")).find("now at step 1") != std::string::npos; },
      seconds(180)))
      << Logs();
  children_->Kill("rank1");
  const auto start = std::chrono::steady_clock::now();
  const auto rank0 = children_->Wait("rank0", seconds(60));
  ASSERT_TRUE(rank0.has_value()) << "rank 0 did not end after rank 1 died:\n" << Logs();
  EXPECT_EQ(*rank0, 1) << Logs();
  // A closed connection fails the next step's all-reduce at once, well inside the deadline.
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(40)) << Logs();
  const std::string log0 = ReadFile(children_->Err("rank0"));
  EXPECT_NE(log0.find("all-reduce of the gradients"), std::string::npos) << log0;
  EXPECT_NE(log0.find("job failed"), std::string::npos) << log0;
}

}  // namespace
