// `grpo learner` and its client commands as users run them: real processes on a free port.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace {

using grpo::testing::Children;
using grpo::testing::GrpoBin;
using grpo::testing::LearnerCommand;
using grpo::testing::ReadFile;
using grpo::testing::RunCommand;

namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;

class CliLearnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("cli_learner_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "token") << "tok-42\n";
    std::ofstream data(dir_ / "data.jsonl");
    for (int i = 0; i < 3; ++i)
      data << R"({"prompt": "say )" << i << R"("})"
           << "\n";
  }
  void TearDown() override {
    children_.reset();  // kills and reaps the learner if it still runs
    fs::remove_all(dir_);
  }

  // Starts `grpo learner` on a free port and waits for its {"port": N} line.
  void StartLearner() {
    std::vector<std::string> args =
        LearnerCommand(dir_, {"--auth_token_file", (dir_ / "token").string(), "--reward_funcs",
                              "length", "--linger_seconds", "0"});
    children_ = std::make_unique<Children>(dir_);
    ASSERT_GT(children_->Spawn("learner", args), 0);
    const json first = children_->FirstLine("learner", std::chrono::seconds(20));
    ASSERT_TRUE(first.is_object() && first.contains("port"))
        << "learner did not report its port: " << ReadFile(dir_ / "learner.err");
    port_ = first["port"].get<int>();
  }

  // Waits for the learner to exit; returns its exit code (-1 on timeout).
  int WaitExit(milliseconds timeout) { return children_->Wait("learner", timeout).value_or(-1); }

  std::string Client(const std::string& cmd, const std::string& flags, int* rc,
                     bool with_token = true) {
    std::string line = GrpoBin() + " " + cmd +
                       " --learner_address 127.0.0.1:" + std::to_string(port_) +
                       " --timeout_seconds 10 " + flags;
    if (with_token) line += " --auth_token_file " + (dir_ / "token").string();
    return RunCommand(line + " 2>" + (dir_ / "client.err").string(), rc);
  }

  fs::path dir_;
  std::unique_ptr<Children> children_;  // stdout/stderr in dir_/learner.{out,err}
  int port_ = 0;
};

TEST_F(CliLearnerTest, SubmitStatusAndCancelEndTheLearner) {
  StartLearner();
  int rc = 0;
  const std::string dataset = "--dataset " + (dir_ / "data.jsonl").string();
  json sub = json::parse(Client("submit", dataset + " --idempotency_key k --json", &rc));
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(sub["dataset_id"], "ds-1");
  EXPECT_EQ(sub["prompt_count"], 3);
  EXPECT_EQ(sub["created"], true);

  Client("status", "--json", &rc, /*with_token=*/false);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(ReadFile(dir_ / "client.err").find("UNAUTHENTICATED"), std::string::npos);

  const json status = json::parse(Client("status", "--json", &rc));
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(status["prompts"]["queued"], "3");  // proto3 JSON: int64 as a string
  EXPECT_EQ(status["max_steps"], "100");

  const std::string cancelled = Client("cancel", "--reason 'enough'", &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_NE(cancelled.find("cancelled (enough)"), std::string::npos) << cancelled;
  EXPECT_EQ(WaitExit(milliseconds(15000)), 0) << ReadFile(dir_ / "learner.err");
}

// A dataset name and a cancel reason come from clients: each stays one line of the learner's log,
// its newline escaped, so a client cannot forge a log line.
TEST_F(CliLearnerTest, ClientStringsWithANewlineStayOneLineOfTheLearnersLog) {
  StartLearner();
  int rc = 0;
  Client("submit",
         "--dataset " + (dir_ / "data.jsonl").string() + " --name \"$(printf 'a\\nFAKE line')\"",
         &rc);
  ASSERT_EQ(rc, 0) << ReadFile(dir_ / "client.err");
  Client("cancel", "--reason \"$(printf 'r\\nFAKE reason')\"", &rc);
  ASSERT_EQ(rc, 0) << ReadFile(dir_ / "client.err");
  EXPECT_EQ(WaitExit(milliseconds(15000)), 0) << ReadFile(dir_ / "learner.err");
  const std::string log = ReadFile(dir_ / "learner.err");
  EXPECT_NE(log.find(R"('a\nFAKE line')"), std::string::npos) << log;
  EXPECT_NE(log.find(R"(cancelled: r\nFAKE reason)"), std::string::npos) << log;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_NE(line.rfind("FAKE", 0), 0u) << "a forged line: " << line;
  }
}

// gRPC aborts a process that sends a metadata value outside printable ASCII (a NUL, an escape), so
// every command that reads a token file refuses such a file as a bad argument, naming it.
TEST_F(CliLearnerTest, ATokenFileWithAByteMetadataCannotCarryIsAnArgumentErrorNamingIt) {
  const std::string nul = (dir_ / "nul_token").string();
  std::ofstream(nul) << std::string("tok\0en\n", 7);
  const std::string esc = (dir_ / "esc_token").string();
  std::ofstream(esc) << "tok\x1b[0men\n";
  const std::string nowhere = " --learner_address 127.0.0.1:1 --timeout_seconds 5";
  const std::string data = " --dataset " + (dir_ / "data.jsonl").string();
  const std::string learner = " --output_dir " + (dir_ / "out").string() +
                              " --grpc_port 0 --metrics_port 0 --reward_funcs length";
  struct Case {
    std::string command;  // before the token option
    std::string option;
    std::string file;
    std::string byte;
  };
  const Case cases[] = {
      {"status" + nowhere, "--auth_token_file", nul, "0x00"},
      {"status" + nowhere, "--auth_token_file", esc, "0x1b"},
      {"submit" + nowhere + data, "--auth_token_file", nul, "0x00"},
      {"learner" + learner, "--auth_token_file", nul, "0x00"},
      {"rollout --learner_address 127.0.0.1:1 --metrics_port 0", "--auth_token_file", nul, "0x00"},
      {"rollout --learner_address 127.0.0.1:1 --metrics_port 0", "--reward_auth_token_file", nul,
       "0x00"},
      {"reward-server --reward_funcs length --host 127.0.0.1 --port 0", "--reward_auth_token_file",
       nul, "0x00"},
      {"env-server --task guess_number --host 127.0.0.1 --port 0", "--auth_token_file", nul,
       "0x00"},
  };
  for (const Case& c : cases) {
    int rc = 0;
    // `timeout`: a server that took the token would serve until killed.
    RunCommand("timeout 20 " + GrpoBin() + " " + c.command + " " + c.option + " " + c.file + " 2>" +
                   (dir_ / "err").string(),
               &rc);
    const std::string err = ReadFile(dir_ / "err");
    EXPECT_EQ(rc, 2) << c.command << ": " << err;
    EXPECT_NE(err.find(c.file), std::string::npos) << c.command << ": " << err;
    EXPECT_NE(err.find("holds byte " + c.byte), std::string::npos) << c.command << ": " << err;
  }
}

TEST_F(CliLearnerTest, ADirectoryAsTheDatasetIsAnArgumentErrorNamingIt) {
  int rc = 0;
  RunCommand(GrpoBin() + " submit --learner_address 127.0.0.1:1 --timeout_seconds 5 --dataset " +
                 dir_.string() + " 2>" + (dir_ / "err").string(),
             &rc);
  const std::string err = ReadFile(dir_ / "err");
  EXPECT_EQ(rc, 2) << err;
  EXPECT_NE(err.find("--dataset " + dir_.string() + " is a directory"), std::string::npos) << err;
}

TEST_F(CliLearnerTest, SigtermStopsTheLearnerCleanly) {
  StartLearner();
  ASSERT_TRUE(children_->Signal("learner", SIGTERM));
  EXPECT_EQ(WaitExit(milliseconds(15000)), 0) << ReadFile(dir_ / "learner.err");
  EXPECT_NE(ReadFile(dir_ / "learner.err").find("stopping"), std::string::npos);
}

TEST_F(CliLearnerTest, LearnerRefusesAConfigWithoutRewardFunctions) {
  int rc = 0;
  RunCommand(GrpoBin() + " learner --output_dir " + (dir_ / "out").string() + " --grpc_port 0 2>" +
                 (dir_ / "err").string(),
             &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(ReadFile(dir_ / "err").find("reward_funcs"), std::string::npos);
}

TEST_F(CliLearnerTest, LearnerOnCudaWithoutAGpuExitsTwoNamingTheKey) {
  // Whether a GPU is visible is libtorch's answer; nvidia-smi stands in for it in this binary.
  if (std::system("nvidia-smi -L >/dev/null 2>&1") == 0) GTEST_SKIP() << "a GPU is visible";
  int rc = 0;
  RunCommand(GrpoBin() + " learner --output_dir " + (dir_ / "out").string() +
                 " --grpc_port 0 --reward_funcs length --device cuda 2>" + (dir_ / "err").string(),
             &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(ReadFile(dir_ / "err").find("'device'"), std::string::npos) << ReadFile(dir_ / "err");
}

}  // namespace
