// grpo bench e2e (docs/BENCHMARKS.md); shared helpers in bench_services_util.h. RunE2eJob
// (bench_e2e.h) also runs `grpo bench long_tail_e2e`.
#include "services/cli/bench_e2e.h"

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/metrics/metrics.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/rollout_types.h"
#include "common/weight_sync/epoch_store.h"
#include "common/weight_sync/gloo_weight_sync.h"
#include "services/auth.h"
#include "services/cli/bench_services_util.h"
#include "services/cli/bench_util.h"
#include "services/cli/demo_task.h"
#include "services/convert.h"
#include "services/grpc_store.h"
#include "services/grpc_weight_receiver.h"
#include "services/learner_client.h"
#include "services/learner_service.h"
#include "services/rollout_worker.h"

namespace grpo::services::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace std::chrono_literals;

// e2e submits the demo's built-in dataset this many times over (one pass outlasts a run).
constexpr int64_t kE2eDatasetCopies = 64;

// `name`_sum and `name`_count of an unlabelled histogram in Prometheus text.
std::pair<double, double> HistogramSumCount(const common::Registry& registry,
                                            const std::string& name) {
  double sum = 0, count = 0;
  std::istringstream in(registry.Expose());
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + "_sum ", 0) == 0) sum = std::stod(line.substr(name.size() + 5));
    if (line.rfind(name + "_count ", 0) == 0) count = std::stod(line.substr(name.size() + 7));
  }
  return {sum, count};
}

}  // namespace

StatusOr<E2eResult> RunE2eJob(const E2eJob& job) {
  TempDir dir("grpo-bench-e2e");
  if (!dir.ok()) return Status::Internal("mkdtemp failed");
  common::GrpoConfig cfg = job.config;
  const int64_t max_staleness = cfg.max_staleness, num_iterations = cfg.num_iterations;
  const int64_t steps = cfg.max_steps;
  const int workers = job.workers;
  cfg.save_steps = 0;
  cfg.output_dir = dir.path();
  cfg.grpc_port = 0;
  cfg.metrics_port = 0;
  RETURN_IF_ERROR(cfg.Validate());
  const int64_t steps_per_batch = cfg.VersionsPerGenerationBatch();
  const int64_t batch_groups = cfg.GenerationBatchGroups();
  ASSIGN_OR_RETURN(common::ModelConfig preset, common::ModelConfigPreset("tiny"));
  ASSIGN_OR_RETURN(auto model, common::Model::InitRandom(preset, cfg.seed));
  const auto t_start = Clock::now();
  ASSIGN_OR_RETURN(auto server, StartLearner(cfg, std::move(model)));
  const std::string address = "127.0.0.1:" + std::to_string(server->port());
  {
    auto stub = v1::LearnerService::NewStub(OwnChannel(address, 999));
    RETURN_IF_ERROR(SubmitRows(*stub, job.lines));
  }

  // Workers: RolloutWorker threads, each with its own metrics registry.
  std::atomic<bool> stop{false};
  std::vector<std::unique_ptr<common::Registry>> registries;
  std::vector<std::unique_ptr<RolloutWorker>> rollout_workers;
  std::vector<Status> worker_status(workers, Status::OK());
  for (int i = 0; i < workers; ++i) {
    registries.push_back(std::make_unique<common::Registry>());
    RolloutWorkerOptions wo;
    wo.learner_address = address;
    wo.worker_id = "bench-rollout-" + std::to_string(i);
    wo.reward_options = job.reward_options;
    wo.prompts_per_lease = job.prompts_per_lease;
    wo.stop = &stop;
    wo.metrics_registry = registries.back().get();
    wo.backoff.initial = 5ms;
    wo.backoff.max = 100ms;
    wo.weight_group.hostname = "127.0.0.1";
    wo.weight_group.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kSyncTimeout);
    ASSIGN_OR_RETURN(auto w, RolloutWorker::Create(std::move(wo)));
    rollout_workers.push_back(std::move(w));
  }

  // Step events, time-stamped as they arrive (WatchJob, as `grpo watch`).
  struct Event {
    int64_t step;
    double t, step_seconds, reward;
  };
  std::mutex mu;
  std::vector<Event> events;
  double g_sum0 = 0, g_count0 = 0;  // the workers' generation histogram at the first batch
  auto gen_totals = [&] {
    double s = 0, c = 0;
    for (const auto& r : registries) {
      auto [rs, rc] = HistogramSumCount(*r, "grpo_rollout_generation_duration_seconds");
      s += rs;
      c += rc;
    }
    return std::make_pair(s, c);
  };
  LearnerClient client{v1::LearnerService::NewStub(OwnChannel(address, 998)), ""};
  StatusOr<JobState> final_state = Status::Internal("not watched");
  std::thread watcher([&] {
    final_state = FollowJob(client, 3600, [&](const v1::JobEvent& e) {
      if (e.metrics().empty()) return;
      auto metric = [&](const char* k) {
        auto it = e.metrics().find(k);
        return it == e.metrics().end() ? 0.0 : it->second;
      };
      std::lock_guard<std::mutex> lock(mu);
      events.push_back({e.step(), Seconds(t_start), metric("step_seconds"), metric("reward")});
      if (e.step() == steps_per_batch) std::tie(g_sum0, g_count0) = gen_totals();
    });
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < workers; ++i) {
    threads.emplace_back([&, i] { worker_status[i] = rollout_workers[i]->Run(); });
  }
  const bool ended = server->WaitForJobEnd(std::chrono::minutes(30));
  const double wall = Seconds(t_start);
  const auto [g_sum1, g_count1] = gen_totals();
  const auto refused = server->RefusedCounts();
  stop = true;
  for (auto& t : threads) t.join();
  (void)server->Stop(/*checkpoint=*/false);
  watcher.join();
  if (!ended) return Status::DeadlineExceeded("the e2e job did not end within 30 minutes");
  if (server->job_state() != JobState::kDone) {
    return Status::Internal(std::string("the e2e job ended ") +
                            std::string(JobStateName(server->job_state())));
  }
  for (const Status& s : worker_status) {
    if (!s.ok()) return s.WithContext("rollout worker");
  }

  E2eResult r;
  r.mode = max_staleness == 0 ? "sync" : "async";
  r.max_staleness = max_staleness;
  r.num_iterations = num_iterations;
  r.steps = steps;
  r.steps_per_batch = steps_per_batch;
  r.wall_s = wall;
  std::vector<double> batch_end;  // completion time of each generation batch
  double t_sum = 0;
  int64_t t_n = 0;
  for (const Event& e : events) {
    if (e.step % steps_per_batch == 0) batch_end.push_back(e.t);
    if (e.step > steps_per_batch) {  // the first batch is the warm-up
      t_sum += e.step_seconds;
      ++t_n;
    }
  }
  r.learner_idle_fraction =
      batch_end.size() < 2 ? 0 : std::max(0.0, 1 - t_sum / (batch_end.back() - batch_end.front()));
  if (batch_end.size() < 3 || t_n == 0) {
    return Status::FailedPrecondition(
        "too few generation batches to time (" + std::to_string(batch_end.size()) +
        "); raise --steps (each batch is " + std::to_string(steps_per_batch) + " steps)");
  }
  std::vector<double> intervals;
  for (size_t i = 1; i < batch_end.size(); ++i)
    intervals.push_back(batch_end[i] - batch_end[i - 1]);
  r.batches_timed = static_cast<int64_t>(intervals.size());
  r.batch_interval = Summarize(intervals);
  r.steps_per_second = static_cast<double>(steps_per_batch * intervals.size()) /
                       (batch_end.back() - batch_end.front());
  r.t_step = t_sum / static_cast<double>(t_n);
  const double groups = g_count1 - g_count0;
  r.g_batch = groups > 0 ? (g_sum1 - g_sum0) / groups * static_cast<double>(batch_groups) : 0;
  const size_t k = std::max<size_t>(1, events.size() / 4);
  for (size_t i = 0; i < k; ++i) {
    r.reward_first += events[i].reward / k;
    r.reward_last += events[events.size() - 1 - i].reward / k;
  }
  for (const auto& [reason, n] : refused) {
    if (reason == "stale") r.stale_refused += n;
  }
  return r;
}

namespace {

StatusOr<E2eResult> RunE2eOnce(int64_t max_staleness, int64_t num_iterations, int64_t steps,
                               int workers) {
  E2eJob job;
  job.config = DemoTaskConfig();
  job.config.max_staleness = max_staleness;
  job.config.num_iterations = num_iterations;
  job.config.max_steps = steps;
  // The built-in rows repeated: a pass of the 8-row dataset is only 2 generation batches, and
  // every pass boundary costs the worker a LeasePrompts retry_after.
  for (int64_t copy = 0; copy < kE2eDatasetCopies; ++copy) {
    for (const json& row : BuiltinDataset()) job.lines.push_back(row.dump());
  }
  job.reward_options = DemoRewardOptions();
  job.workers = workers;
  return RunE2eJob(job);
}

// The batch period this run's own g and T allow: g + T when sync (the phases take turns),
// max(g, T) when async (they overlap).
double OwnIdealBatch(const E2eResult& r, int workers) {
  const double g = r.g_batch / workers;
  const double T = r.t_step * static_cast<double>(r.steps_per_batch);
  return r.max_staleness == 0 ? g + T : std::max(g, T);
}

int RunE2e(const ServiceBenchOptions& o) {
  const int workers = static_cast<int>(o.workers > 0 ? o.workers : 1);
  const int64_t steps = o.steps > 0 ? o.steps : 24;
  struct Plan {
    int64_t staleness, iterations, steps;
  };
  // The policy version counts optimizer steps; the demo's generation batch is one step per
  // pass, so max_staleness 1 lets workers generate batch n+1 while the learner trains batch n.
  // num_iterations 4 trains each generation batch 4 times: 4 versions per batch, so its async
  // run needs max_staleness 4, and 4x the steps for as many batches.
  const std::vector<Plan> plans = {{0, 1, steps}, {1, 1, steps}, {4, 4, 4 * steps}};
  std::vector<E2eResult> results;
  for (const Plan& p : plans) {
    auto r = RunE2eOnce(p.staleness, p.iterations, p.steps, workers);
    if (!r.ok()) {
      return Fail("e2e",
                  r.status().WithContext("max_staleness " + std::to_string(p.staleness) +
                                         ", num_iterations " + std::to_string(p.iterations)));
    }
    results.push_back(std::move(r).value());
  }
  const E2eResult& sync = results[0];
  const E2eResult& async = results[1];  // max_staleness 1
  const E2eResult& iter4 = results[2];
  // Per generation batch, from the sync run (its phases hardly overlap): g = one batch's
  // generation time spread over the workers, T = its training time.
  const double g = sync.g_batch / workers;
  const double T = sync.t_step * static_cast<double>(sync.steps_per_batch);
  const double ideal = (g + T) / std::max(g, T);
  const double speedup = async.steps_per_second / sync.steps_per_second;
  std::vector<json> rows;
  for (const E2eResult& r : results) {
    json row = {{"bench", "e2e"},
                {"mode", r.mode},
                {"max_staleness", r.max_staleness},
                {"num_iterations", r.num_iterations},
                {"workers", workers},
                {"workers_are", "RolloutWorker threads of this process, loopback gRPC + gloo"},
                {"steps", r.steps},
                {"steps_per_generation_batch", r.steps_per_batch},
                {"batches_timed", r.batches_timed},
                {"steps_per_second", r.steps_per_second},
                {"g_s", r.g_batch / workers},
                {"t_step_s", r.t_step},
                {"train_s_per_batch", r.t_step * static_cast<double>(r.steps_per_batch)},
                {"own_ideal_batch_s", OwnIdealBatch(r, workers)},
                {"vs_own_ideal", OwnIdealBatch(r, workers) /
                                     (static_cast<double>(r.steps_per_batch) / r.steps_per_second)},
                {"wall_s", r.wall_s},
                {"stale_groups_refused", r.stale_refused},
                {"reward_first", r.reward_first},
                {"reward_last", r.reward_last}};
    Merge(row, TimingJson(r.batch_interval, "batch_s"));
    if (&r != &sync) {
      row["vs_sync"] = r.steps_per_second / sync.steps_per_second;
    }
    if (&r == &async) {
      row["ideal_vs_sync"] = ideal;
      row["vs_ideal"] = r.steps_per_second / sync.steps_per_second / ideal;
      row["goal_vs_ideal_min"] = 0.80;
    }
    if (&r == &iter4) {
      row["vs_num_iterations_1"] = r.steps_per_second / async.steps_per_second;
    }
    rows.push_back(row);
  }
  if (o.json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << std::fixed << "e2e: the demo task (tiny model, " << DemoTaskConfig().num_generations
            << " generations, generation batch of " << sync.steps_per_batch
            << " steps) trained by an in-process LearnerServer with " << workers
            << " RolloutWorker thread(s) over loopback (gRPC + gloo weight sync); the first "
               "generation batch of each run is the warm-up\n"
            << "  g = generation time per generation batch (workers' generation histogram, / "
            << workers
            << " workers), t = train time per step (StepMetrics.step_seconds), "
               "T = t x steps per batch; all on the same "
            << std::thread::hardware_concurrency() << " cores\n"
            << "  batch s = time between generation-batch completions; eff = this run's own ideal "
               "period (sync g+T, async max(g,T)) / its mean period; refused = stale groups\n";
  std::cout << std::left << std::setw(7) << "mode" << std::right << std::setw(10) << "staleness"
            << std::setw(6) << "iter" << std::setw(7) << "steps" << std::setw(9) << "step/s"
            << std::setw(10) << "batch s" << std::setw(8) << "min" << std::setw(8) << "max"
            << std::setw(8) << "g s" << std::setw(8) << "t s" << std::setw(9) << "refused"
            << std::setw(7) << "eff" << std::setw(8) << "wall s"
            << "\n";
  for (const E2eResult& r : results) {
    std::cout << std::left << std::setw(7) << r.mode << std::right << std::setw(10)
              << r.max_staleness << std::setw(6) << r.num_iterations << std::setw(7) << r.steps
              << std::setprecision(3) << std::setw(9) << r.steps_per_second << std::setw(10)
              << r.batch_interval.median << std::setw(8) << r.batch_interval.min << std::setw(8)
              << r.batch_interval.max << std::setw(8) << r.g_batch / workers << std::setw(8)
              << r.t_step << std::setw(9) << r.stale_refused << std::setprecision(2) << std::setw(7)
              << OwnIdealBatch(r, workers) /
                     (static_cast<double>(r.steps_per_batch) / r.steps_per_second)
              << std::setprecision(1) << std::setw(8) << r.wall_s << "\n";
  }
  std::cout << std::setprecision(3) << "  ideal async speed-up (g+T)/max(g,T) with g = " << g
            << " s, T = " << T << " s per generation batch (sync run): " << std::setprecision(2)
            << ideal << "x\n"
            << "  async (max_staleness 1) vs sync: " << speedup << "x = " << std::setprecision(0)
            << 100 * speedup / ideal << "% of ideal (goal >= 80%)\n"
            << std::setprecision(2) << "  num_iterations 4 vs 1 (async, one batch of staleness): "
            << iter4.steps_per_second / async.steps_per_second << "x steps/s\n";
  return 0;
}

}  // namespace

int BenchE2e(const ServiceBenchOptions& o) { return RunE2e(o); }

}  // namespace grpo::services::bench
