// Shared by the tests with real processes (fault_tolerance_test, chaos_test): the test
// configuration, the dataset with a marker per prompt, wire helpers, the ledger file read with
// SQLite's C API, the batch dumps read back, and the FaultToleranceTest fixture (a Children
// supervisor; `grpo learner` / `grpo rollout` / `grpo submit` as a user runs them).
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sqlite3.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "grpo/v1/learner.grpc.pb.h"
#include "tests/reserved_port.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace grpo::testing::faults {

namespace fs = std::filesystem;
namespace v1 = grpo::v1;
using grpo::testing::Children;
using grpo::testing::DumpPath;
using grpo::testing::GrpoBin;
using grpo::testing::ReadFile;
using grpo::testing::ReadSafetensors;
using grpo::testing::RunCommand;
using grpo::testing::Tail;
using grpo::testing::WaitUntil;
using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

inline constexpr const char* kToken = "tok-fault-tolerance";
// The learner's configuration in these tests: 2 generations per prompt, 4 sequences per
// micro-batch, 1 micro-batch per step, so one optimizer step trains kPromptsPerStep prompts.
inline constexpr int kGenerations = 2;
inline constexpr int kBatchSequences = 4;
inline constexpr int kPromptsPerStep = kBatchSequences / kGenerations;
// The byte tokenizer of the tiny preset: ids 0..255 are bytes, 256.. special; vocab 259.
inline constexpr int kVocabSize = 259;
// services/auth.h: the learner refuses received messages over 64 MiB.
inline constexpr size_t kLearnerMaxMessageBytes = 64u << 20;
// The machine may be loaded: generous deadlines, never asserted on.
inline constexpr auto kStartTimeout = seconds(60);
inline constexpr auto kJobTimeout = seconds(240);
inline constexpr auto kCallTimeout = seconds(20);

// The marker that identifies prompt `i` inside its token ids ("item 07").
inline std::string Marker(int i) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "item %02d", i);
  return buf;
}

// Writes n prompts, each with its own marker, as JSON Lines.
inline void WriteDataset(const fs::path& path, int n) {
  std::ofstream out(path);
  for (int i = 0; i < n; ++i)
    out << R"({"prompt": ")" << Marker(i) << R"(: name a fruit"})"
        << "\n";
}

inline std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token = kToken,
                                                std::chrono::milliseconds timeout = kCallTimeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

inline std::unique_ptr<v1::LearnerService::Stub> Stub(int port) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  return v1::LearnerService::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
}

inline std::optional<v1::Job> GetJob(v1::LearnerService::Stub& stub) {
  v1::Job job;
  if (!stub.GetJob(Ctx().get(), v1::GetJobRequest(), &job).ok()) return std::nullopt;
  return job;
}

// grpc.health.v1.Health/Check for the whole server; true when it answers SERVING.
inline bool HealthServing(int port) {
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  grpc::Slice empty("");  // HealthCheckRequest{} (service "": the whole server)
  grpc::ByteBuffer req(&empty, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) { done.set_value(s); });
  if (!done.get_future().get().ok()) return false;
  grpc::Slice out;
  if (!resp.DumpToSingleSlice(&out).ok()) return false;
  // HealthCheckResponse{status = 1 (SERVING)}.
  return std::string(reinterpret_cast<const char*>(out.begin()), out.size()) ==
         std::string("\x08\x01", 2);
}

// --- The ledger file, read with the SQLite C API (read-only), not through PromptLedger.

struct LedgerRow {
  std::string id, state, worker_id;
  int64_t attempts = 0, pass = 0;
};
struct LedgerFile {
  int64_t job_pass = -1;
  std::map<std::string, LedgerRow> prompts;  // by prompt id
};

inline std::optional<LedgerFile> ReadLedger(const fs::path& path, std::string* error) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK) {
    *error = "open " + path.string() + ": " + (db ? sqlite3_errmsg(db) : "no memory");
    sqlite3_close(db);
    return std::nullopt;
  }
  sqlite3_busy_timeout(db, 5000);
  LedgerFile out;
  bool ok = true;
  const auto query = [&](const char* sql, const std::function<void(sqlite3_stmt*)>& row) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db, sql, -1, &st, nullptr) != SQLITE_OK) {
      *error = std::string(sql) + ": " + sqlite3_errmsg(db);
      ok = false;
      return;
    }
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) row(st);
    if (rc != SQLITE_DONE) {
      *error = std::string(sql) + ": " + sqlite3_errmsg(db);
      ok = false;
    }
    sqlite3_finalize(st);
  };
  const auto text = [](sqlite3_stmt* st, int col) {
    const unsigned char* t = sqlite3_column_text(st, col);
    return t ? std::string(reinterpret_cast<const char*>(t)) : std::string();
  };
  query("SELECT pass FROM job",
        [&](sqlite3_stmt* st) { out.job_pass = sqlite3_column_int64(st, 0); });
  query("SELECT id, state, worker_id, attempts, pass FROM prompts", [&](sqlite3_stmt* st) {
    LedgerRow r;
    r.id = text(st, 0);
    r.state = text(st, 1);
    r.worker_id = text(st, 2);
    r.attempts = sqlite3_column_int64(st, 3);
    r.pass = sqlite3_column_int64(st, 4);
    out.prompts[r.id] = r;
  });
  sqlite3_close(db);
  if (!ok) return std::nullopt;
  return out;
}

// --- Batch dumps: which prompts each optimizer step trained on.

// For the dumps of steps 1..steps: how many trained sequences carry each prompt marker (the bytes
// of a row's prompt tokens under its mask). Adds a failure for a missing dump or a row without a
// marker.
inline std::map<std::string, int> SequencesByMarker(const fs::path& dump_dir, int64_t steps) {
  std::map<std::string, int> count;
  for (int64_t step = 1; step <= steps; ++step) {
    const auto dump = ReadSafetensors(DumpPath(dump_dir, step));
    if (!dump) {
      ADD_FAILURE() << "no readable dump of step " << step << " in " << dump_dir;
      continue;
    }
    const auto& ids = dump->at("prompt_ids");
    const auto& mask = dump->at("prompt_mask");
    const int64_t rows = ids.shape.at(0), cols = ids.shape.at(1);
    const bool float_mask = !mask.floats.empty();
    for (int64_t r = 0; r < rows; ++r) {
      std::string text;
      for (int64_t c = 0; c < cols; ++c) {
        const bool real =
            float_mask ? mask.floats[r * cols + c] != 0 : mask.ints[r * cols + c] != 0;
        const int64_t id = ids.ints[r * cols + c];
        if (real && id >= 0 && id < 256) text.push_back(static_cast<char>(id));
      }
      const size_t at = text.find("item ");
      if (at == std::string::npos || at + 7 > text.size()) {
        ADD_FAILURE() << "step " << step << " row " << r << ": no marker in prompt '" << text
                      << "'";
        continue;
      }
      ++count[text.substr(at, 7)];
    }
  }
  return count;
}

// Every one of the n prompts trained exactly once: kGenerations sequences each, nothing else.
inline void ExpectEachPromptTrainedOnce(const std::map<std::string, int>& by_marker, int n) {
  for (int i = 0; i < n; ++i) {
    auto it = by_marker.find(Marker(i));
    EXPECT_EQ(it == by_marker.end() ? 0 : it->second, kGenerations)
        << Marker(i) << ": sequences trained (" << kGenerations << " = the prompt trained once)";
  }
  for (const auto& [marker, sequences] : by_marker) {
    bool known = false;
    for (int i = 0; i < n && !known; ++i) known = marker == Marker(i);
    EXPECT_TRUE(known) << marker << " is not in the dataset (" << sequences << " sequences)";
  }
}

class FaultToleranceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fault_tolerance_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "token") << kToken << "\n";
    children_ = std::make_unique<Children>(dir_);
  }
  void TearDown() override {
    children_.reset();  // kills and reaps whatever still runs
    if (HasFailure()) {
      std::cerr << "logs kept in " << dir_ << "\n";
    } else {
      fs::remove_all(dir_);
    }
  }

  fs::path out_dir() const { return dir_ / "out"; }
  fs::path dump_dir() const { return dir_ / "dumps"; }

  // `grpo learner` on `port` (0 = this test's ReservedPort, which no concurrent test takes, so a
  // learner restarted on it finds it free) with the test configuration plus `extra`; returns the
  // bound port (0 on failure, with the failure added).
  int StartLearner(const std::string& name, int port, std::vector<std::string> extra) {
    if (port == 0) {
      if (reserved_port_ == nullptr) reserved_port_ = std::make_unique<ReservedPort>();
      port = reserved_port_->port();
      if (port == 0) return 0;
    }
    if (children_->Spawn(name, LearnerArgs(port, extra)) <= 0) {
      ADD_FAILURE() << "fork failed";
      return 0;
    }
    const json line = children_->FirstLine(name, kStartTimeout);
    if (!line.is_object() || !line.contains("port")) {
      ADD_FAILURE() << name << " did not report its port:\n" << Tail(children_->Err(name));
      return 0;
    }
    metrics_port_ = line.value("metrics_port", 0);
    return line["port"].get<int>();
  }

  // The command line of StartLearner's `grpo learner` on `port`.
  std::vector<std::string> LearnerArgs(int port, const std::vector<std::string>& extra) const {
    std::vector<std::string> args = {
        GrpoBin(), "--log_level", "info", "learner", "--output_dir", out_dir().string(),
        "--grpc_port", std::to_string(port), "--metrics_port", "0", "--auth_token_file",
        (dir_ / "token").string(), "--num_generations", std::to_string(kGenerations),
        "--per_device_train_batch_size", std::to_string(kBatchSequences),
        "--gradient_accumulation_steps", "1", "--max_completion_length", "8", "--reward_funcs",
        "length", "--max_staleness", "1000", "--seed", "1", "--dump_batches_dir",
        dump_dir().string(),
        // Long enough for workers to see shutdown and exit.
        "--linger_seconds", "5"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  // `grpo rollout` as process `name`, with worker id `worker_id` (default: `name`).
  void StartWorker(const std::string& name, int port, std::vector<std::string> extra = {},
                   const std::string& worker_id = "") {
    std::vector<std::string> args = {GrpoBin(),
                                     "--log_level",
                                     "info",
                                     "rollout",
                                     "--learner_address",
                                     "127.0.0.1:" + std::to_string(port),
                                     "--metrics_port",
                                     "0",
                                     "--auth_token_file",
                                     (dir_ / "token").string(),
                                     "--worker_id",
                                     worker_id.empty() ? name : worker_id};
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_GT(children_->Spawn(name, args), 0);
  }

  // `grpo submit` of the dataset, as a user would; true on exit code 0.
  bool Submit(int port, const fs::path& dataset) {
    int rc = -1;
    const std::string out =
        RunCommand(GrpoBin() + " submit --learner_address 127.0.0.1:" + std::to_string(port) +
                       " --auth_token_file " + (dir_ / "token").string() +
                       " --timeout_seconds 30 --dataset " + dataset.string() + " 2>&1",
                   &rc);
    EXPECT_EQ(rc, 0) << out;
    return rc == 0;
  }

  std::string Logs(const std::vector<std::string>& names) {
    std::string s;
    for (const auto& n : names) s += "--- " + n + ":\n" + Tail(children_->Err(n), 2500) + "\n";
    return s;
  }

  fs::path dir_;
  std::unique_ptr<Children> children_;
  std::unique_ptr<ReservedPort> reserved_port_;
  int metrics_port_ = 0;
};

}  // namespace grpo::testing::faults
