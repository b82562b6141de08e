// A real Prometheus server scrapes a `grpo learner` and a `grpo rollout` worker: both targets
// report up == 1 and the learner's step metrics arrive. Loopback only; every process started
// here is killed and reaped. Skipped when /usr/bin/prometheus is absent.
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

#include "tests/reserved_port.h"
#include "tests/services/http_test_util.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace {

using grpo::testing::Children;
using grpo::testing::GrpoBin;
using grpo::testing::LearnerCommand;
using grpo::testing::ReadFile;
using grpo::testing::Tail;

namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

constexpr const char* kPrometheus = "/usr/bin/prometheus";
constexpr auto kStartTimeout = seconds(30);
constexpr auto kScrapeTimeout = seconds(60);

class PrometheusScrapeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("prometheus_scrape_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "token") << "tok-prom\n";
    std::ofstream data(dir_ / "data.jsonl");
    for (int i = 0; i < 8; ++i) data << R"({"prompt": "count to )" << i << "\"}\n";
  }
  void TearDown() override {
    children_.reset();  // kills and reaps Prometheus, the worker and the learner
    fs::remove_all(dir_);
  }

  // Starts `args` with stdout and stderr in <dir>/<name>.out and .err.
  pid_t Spawn(const std::string& name, std::vector<std::string> args) {
    if (!children_) children_ = std::make_unique<Children>(dir_);
    return children_->Spawn(name, std::move(args));
  }

  // Runs `cmd` through the shell; returns its exit code.
  int Run(const std::string& cmd) {
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // Polls `cond` every 250 ms until it holds or `timeout` passes.
  template <typename F>
  bool WaitFor(F cond, Clock::duration timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      if (cond()) return true;
      std::this_thread::sleep_for(milliseconds(250));
    }
    return cond();
  }

  // The instant vector of a PromQL query: metric label sets with their values.
  std::vector<std::pair<json, double>> Query(uint16_t port, const std::string& promql) {
    std::string encoded;
    for (char c : promql) {
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
        encoded += c;
      } else {
        char buf[4];
        std::snprintf(buf, sizeof(buf), "%%%02X", static_cast<unsigned char>(c));
        encoded += buf;
      }
    }
    std::vector<std::pair<json, double>> out;
    auto r = grpo::testing::HttpGet(port, "/api/v1/query?query=" + encoded);
    if (!r || r->status != 200) return out;
    const json j = json::parse(r->body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || j.value("status", "") != "success") return out;
    for (const json& s : j["data"]["result"]) {
      out.emplace_back(s["metric"], std::stod(s["value"][1].get<std::string>()));
    }
    return out;
  }

  fs::path dir_;
  std::unique_ptr<Children> children_;
};

TEST_F(PrometheusScrapeTest, PrometheusScrapesTheLearnerAndAWorker) {
  if (!fs::exists(kPrometheus)) GTEST_SKIP() << kPrometheus << " not installed";
  const std::string token = (dir_ / "token").string();

  // 1. The learner, on free gRPC and metrics ports.
  Spawn("learner", LearnerCommand(dir_, {"--auth_token_file", token, "--max_completion_length", "8",
                                         "--reward_funcs", "length", "--max_steps", "1000",
                                         "--linger_seconds", "0"}));
  int grpc_port = 0, learner_metrics = 0;
  ASSERT_TRUE(WaitFor(
      [&] {
        const std::string text = ReadFile(dir_ / "learner.out");
        if (text.find('\n') == std::string::npos) return false;
        const json line = json::parse(text.substr(0, text.find('\n')));
        grpc_port = line.at("port").get<int>();
        learner_metrics = line.at("metrics_port").get<int>();
        return true;
      },
      kStartTimeout))
      << Tail(dir_ / "learner.err");
  ASSERT_GT(grpc_port, 0);
  ASSERT_GT(learner_metrics, 0);
  const std::string address = "127.0.0.1:" + std::to_string(grpc_port);

  // 2. A dataset, then one worker with a metrics port.
  ASSERT_EQ(Run(GrpoBin() + " submit --learner_address " + address + " --auth_token_file " + token +
                " --timeout_seconds 20 --dataset " + (dir_ / "data.jsonl").string() + " >" +
                (dir_ / "submit.out").string() + " 2>&1"),
            0)
      << ReadFile(dir_ / "submit.out");
  // The worker's and Prometheus's ports are held for the test: no concurrent test takes them.
  const grpo::testing::ReservedPort worker_port, prom_reserved;
  const int worker_metrics = worker_port.port();
  ASSERT_GT(worker_metrics, 0);
  Spawn("worker", {GrpoBin(), "rollout", "--learner_address", address, "--metrics_port",
                   std::to_string(worker_metrics), "--auth_token_file", token});

  // 3. Prometheus, scraping both every second.
  const int prom_port = prom_reserved.port();
  ASSERT_GT(prom_port, 0);
  std::ofstream(dir_ / "prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n"
      << "  - job_name: grpo-learner\n    static_configs:\n      - targets: ['127.0.0.1:"
      << learner_metrics << "']\n"
      << "  - job_name: grpo-rollout\n    static_configs:\n      - targets: ['127.0.0.1:"
      << worker_metrics << "']\n";
  Spawn("prometheus", {kPrometheus, "--config.file=" + (dir_ / "prometheus.yml").string(),
                       "--storage.tsdb.path=" + (dir_ / "tsdb").string(),
                       "--web.listen-address=127.0.0.1:" + std::to_string(prom_port)});

  // 4. Both targets up, then a learner step visible through PromQL.
  const auto diagnostics = [&] {
    return "learner:\n" + Tail(dir_ / "learner.err") + "\nworker:\n" + Tail(dir_ / "worker.err") +
           "\nprometheus:\n" + Tail(dir_ / "prometheus.err");
  };
  std::vector<std::pair<json, double>> up;
  EXPECT_TRUE(WaitFor(
      [&] {
        up = Query(prom_port, "up");
        int ok = 0;
        for (const auto& [labels, value] : up) {
          const std::string job = labels.value("job", "");
          if ((job == "grpo-learner" || job == "grpo-rollout") && value == 1) ++ok;
        }
        return ok == 2;
      },
      kScrapeTimeout))
      << "up: " << json(up).dump() << "\n"
      << diagnostics();
  std::vector<std::pair<json, double>> steps;
  EXPECT_TRUE(WaitFor(
      [&] {
        steps = Query(prom_port, "grpo_optimizer_steps_total{job=\"grpo-learner\"}");
        return !steps.empty() && steps[0].second > 0;
      },
      kScrapeTimeout))
      << "grpo_optimizer_steps_total: " << json(steps).dump() << "\n"
      << diagnostics();
  // The worker's families arrive too.
  EXPECT_FALSE(Query(prom_port, "grpo_rollout_groups_pushed_total").empty());
}

}  // namespace
