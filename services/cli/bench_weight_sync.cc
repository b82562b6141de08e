// grpo bench weight_sync (docs/BENCHMARKS.md); shared helpers in bench_services_util.h.
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
#include "learner/weight_publisher.h"
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

// ---------------------------------------------------------------------------------------------
// weight_sync

int RunWeightSync(const ServiceBenchOptions& o) {
  const int workers = static_cast<int>(o.workers > 0 ? o.workers : 2);
  const int reps = std::max(1, o.reps);
  TempDir dir("grpo-bench-weight-sync");
  if (!dir.ok()) return Fail("weight_sync", Status::Internal("mkdtemp failed"));

  // The same-run baselines first, on a machine otherwise idle: one learner step of the bench
  // model (as `grpo bench learner_step`) and memcpy of the model's bytes.
  const Timing step = LearnerStepTiming(reps, o.micro);

  auto server_or = StartLearner(BenchServiceConfig(dir.path()), BenchModel());
  if (!server_or.ok()) return Fail("weight_sync", server_or.status());
  std::unique_ptr<LearnerServer> server = std::move(server_or).value();
  const std::string address = "127.0.0.1:" + std::to_string(server->port());
  // What the learner sends: detached contiguous copies of the parameters (as its snapshot).
  common::NamedTensors src;
  for (const auto& [name, t] : server->policy().NamedParameters()) {
    src.emplace_back(name, t.detach().contiguous().clone());
  }
  const int64_t bytes = TotalBytes(src);

  at::Tensor flat_src = at::empty({bytes}, at::kByte), flat_dst = at::empty({bytes}, at::kByte);
  {
    int64_t off = 0;
    for (const auto& [name, t] : src) {
      std::memcpy(flat_src.data_ptr<uint8_t>() + off, t.data_ptr(), t.nbytes());
      off += static_cast<int64_t>(t.nbytes());
    }
    std::memset(flat_dst.data_ptr(), 0, bytes);  // fault the pages in before timing
  }
  const Timing memcpy_t = TimeIt(reps, [&] {
    std::memcpy(flat_dst.data_ptr(), flat_src.data_ptr(), static_cast<size_t>(bytes));
  });

  // --- Gloo: the learner is rank 0 on its in-process store, each worker thread rank i on a
  // GrpcEpochStore over the learner's Store RPC (the production rendezvous), data over loopback
  // TCP.
  const int64_t epoch = server->group_epoch();
  common::GlooWeightSyncOptions gopts;
  gopts.sync.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kSyncTimeout);
  gopts.hostname = "127.0.0.1";
  // Each round broadcasts the version twice, the modes interleaved: the whole list in one
  // Broadcast (weight_publish snapshot), then in the groups of a streamed version (stream; the
  // learner side here sends views where the publisher copies the small tensors of a group).
  auto broadcast = [](common::WeightSync& sync, common::NamedTensors& tensors, bool streamed) {
    return streamed ? common::BroadcastInStreamGroups(sync, tensors, learner::kStreamGroupBytes)
                    : sync.Broadcast(tensors);
  };
  std::vector<Status> worker_status(workers, Status::OK());
  std::vector<char> worker_equal(workers, 0), worker_equal_streamed(workers, 0);
  std::vector<std::thread> threads;
  const auto setup_t0 = Clock::now();
  for (int i = 0; i < workers; ++i) {
    threads.emplace_back([&, i] {
      const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kSyncTimeout);
      auto store = c10::make_intrusive<common::C10dEpochStore>(
          GrpcEpochStore::Connect(OwnChannel(address, i), "", timeout), epoch, timeout);
      auto sync = common::CreateGlooWeightSync(store, i + 1, workers + 1, epoch, gopts);
      if (!sync.ok()) {
        worker_status[i] = sync.status();
        return;
      }
      common::NamedTensors dst;
      for (const auto& [name, t] : src) dst.emplace_back(name, at::zeros_like(t));
      for (int r = 0; r < reps + 1; ++r) {
        for (const bool streamed : {false, true}) {
          if (r == reps) {
            for (auto& [name, t] : dst) t.zero_();  // the last round proves its own delivery
          }
          Status s = (*sync)->Begin(common::kAnyVersion);
          if (s.ok()) s = broadcast(**sync, dst, streamed);
          if (s.ok()) s = (*sync)->Commit();
          if (!s.ok()) {
            worker_status[i] = s;
            return;
          }
          if (r == reps) (streamed ? worker_equal_streamed : worker_equal)[i] = BitEqual(dst, src);
        }
      }
    });
  }
  Status gloo_status = Status::OK();
  double setup_s = 0;
  std::vector<double> gloo_samples, streamed_samples;
  {
    auto store = c10::make_intrusive<common::C10dEpochStore>(
        server->epoch_store(), epoch,
        std::chrono::duration_cast<std::chrono::milliseconds>(kSyncTimeout));
    auto sync = common::CreateGlooWeightSync(store, 0, workers + 1, epoch, gopts);
    setup_s = Seconds(setup_t0);
    if (!sync.ok()) {
      gloo_status = sync.status();
    } else {
      int64_t version = 0;
      for (int r = 0; r < reps + 1 && gloo_status.ok(); ++r) {
        for (const bool streamed : {false, true}) {
          if (!gloo_status.ok()) break;
          const auto t0 = Clock::now();
          Status s = (*sync)->Begin(++version);
          if (s.ok()) s = broadcast(**sync, src, streamed);
          if (s.ok()) s = (*sync)->Commit();  // every rank agrees: all have every byte
          gloo_status = s;
          // r == 0: warm-up
          if (r > 0) (streamed ? streamed_samples : gloo_samples).push_back(Seconds(t0));
        }
      }
      if (!gloo_status.ok()) (*sync)->Abort();
    }
  }
  for (auto& t : threads) t.join();
  threads.clear();
  for (const Status& s : worker_status) {
    if (gloo_status.ok() && !s.ok()) gloo_status = s;
  }
  if (!gloo_status.ok()) return Fail("weight_sync", gloo_status.WithContext("gloo"));
  bool gloo_equal = true, streamed_equal = true;
  for (char e : worker_equal) gloo_equal = gloo_equal && e != 0;
  for (char e : worker_equal_streamed) streamed_equal = streamed_equal && e != 0;
  const Timing gloo_t = Summarize(gloo_samples);
  const Timing streamed_t = Summarize(streamed_samples);

  // --- gRPC GetWeights fallback: every worker thread streams the published version over its
  // own channel, reassembles it and loads it into its model (GrpcWeightReceiver::Receive, the
  // worker's code path), all at once.
  std::vector<std::unique_ptr<GrpcWeightReceiver>> receivers;
  std::vector<std::unique_ptr<common::Model>> models;
  for (int i = 0; i < workers; ++i) {
    receivers.push_back(std::make_unique<GrpcWeightReceiver>(OwnChannel(address, 100 + i), ""));
    auto m = common::Model::InitRandom(server->policy().config(), 1000 + i);
    if (!m.ok()) return Fail("weight_sync", m.status());
    models.push_back(std::move(m).value());
  }
  Status grpc_status = Status::OK();
  std::mutex status_mu;
  const Timing grpc_t = TimeIt(reps, [&] {
    for (int i = 0; i < workers; ++i) {
      threads.emplace_back([&, i] {
        auto v = receivers[i]->Receive(0, *models[i], kBenchRpcTimeout);
        if (!v.ok()) {
          std::lock_guard<std::mutex> lock(status_mu);
          grpc_status = v.status();
        }
      });
    }
    for (auto& t : threads) t.join();
    threads.clear();
  });
  if (!grpc_status.ok()) return Fail("weight_sync", grpc_status.WithContext("grpc GetWeights"));
  bool grpc_equal = true;
  for (const auto& m : models) grpc_equal = grpc_equal && BitEqual(m->NamedParameters(), src);
  (void)server->Stop(/*checkpoint=*/false);

  const double gb = static_cast<double>(bytes) / 1e9;
  const double memcpy_gbps = gb / memcpy_t.median;
  std::vector<json> rows;
  json mrow = {
      {"bench", "weight_sync"}, {"impl", "memcpy"}, {"bytes", bytes}, {"gbps", memcpy_gbps}};
  Merge(mrow, TimingJson(memcpy_t));
  rows.push_back(mrow);
  auto sync_row = [&](const std::string& impl, const Timing& t, bool equal) {
    json r = {{"bench", "weight_sync"},
              {"impl", impl},
              {"workers", workers},
              {"workers_are", "threads of this process, own connections, loopback TCP"},
              {"bytes", bytes},
              {"gbps", gb / t.median},
              {"delivered_gbps", workers * gb / t.median},
              {"vs_memcpy", (gb / t.median) / memcpy_gbps},
              {"step_s", step.median},
              {"vs_step", t.median / step.median},
              {"goal_vs_step_max", 0.10},
              {"bit_equal", equal}};
    Merge(r, TimingJson(t));
    return r;
  };
  json grow = sync_row("gloo", gloo_t, gloo_equal);
  grow["setup_s"] = setup_s;
  grow["checksum"] = true;
  rows.push_back(grow);
  json prow = sync_row("gloo_streamed", streamed_t, streamed_equal);
  prow["tensors"] = static_cast<int64_t>(src.size());
  rows.push_back(prow);
  json rrow = sync_row("grpc_getweights", grpc_t, grpc_equal);
  rrow["chunk_bytes"] = kDefaultWeightChunkBytes;
  rows.push_back(rrow);
  json srow = {{"bench", "weight_sync"},
               {"impl", "learner_step"},
               {"G", kBenchGenerations},
               {"micro_batch", o.micro}};
  Merge(srow, TimingJson(step));
  rows.push_back(srow);

  if (o.json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "weight_sync: bench model (" << std::fixed << std::setprecision(1)
            << static_cast<double>(bytes) / 1048576.0 << " MiB fp32) from the learner to "
            << workers
            << " workers = threads of this process, each with its own connections "
               "over loopback TCP; median of "
            << reps << " after a warm-up\n"
            << "  gloo: c10d ProcessGroupGloo broadcast, rendezvous over the learner's Store RPC "
               "(GrpcEpochStore), checksum verified at Commit; group setup "
            << std::setprecision(2) << setup_s << " s (not in the time)\n"
            << "  gloo_streamed: the same group, the " << src.size()
            << " tensors in the Broadcasts of a streamed version (weight_publish: stream: "
               "groups of up to "
            << learner::kStreamGroupBytes / 1048576 << " MiB); the rounds interleave\n"
            << "  grpc_getweights: LearnerService.GetWeights stream ("
            << kDefaultWeightChunkBytes / 1048576
            << " MiB chunks), reassembled and loaded into each worker's model\n"
            << "  step: one learner step of the bench model (G=16, micro-batch " << o.micro
            << "), median " << std::setprecision(3) << step.median << " s (min " << step.min
            << ", max " << step.max << "); goal: sync <= 10% of it\n";
  std::cout << std::left << std::setw(17) << "impl" << std::right << std::setw(10) << "s"
            << std::setw(10) << "min" << std::setw(10) << "max" << std::setw(9) << "GB/s"
            << std::setw(12) << "deliv GB/s" << std::setw(10) << "/memcpy" << std::setw(9)
            << "% step" << std::setw(6) << "ok"
            << "\n";
  for (auto& r : rows) {
    if (r["impl"] == "learner_step") continue;
    const bool is_sync = r.contains("vs_step");
    std::cout << std::left << std::setw(17) << r["impl"].get<std::string>() << std::right
              << std::setprecision(4) << std::setw(10) << r["s_median"].get<double>()
              << std::setw(10) << r["s_min"].get<double>() << std::setw(10)
              << r["s_max"].get<double>() << std::setprecision(2) << std::setw(9)
              << r["gbps"].get<double>() << std::setw(12)
              << (is_sync ? r["delivered_gbps"].get<double>() : r["gbps"].get<double>())
              << std::setw(10) << (is_sync ? r["vs_memcpy"].get<double>() : 1.0)
              << std::setprecision(1) << std::setw(9)
              << (is_sync ? 100 * r["vs_step"].get<double>() : 100 * memcpy_t.median / step.median)
              << std::setw(6) << (is_sync ? (r["bit_equal"].get<bool>() ? "yes" : "NO") : "-")
              << "\n";
  }
  return 0;
}

}  // namespace

int BenchWeightSync(const ServiceBenchOptions& o) { return RunWeightSync(o); }

}  // namespace grpo::services::bench
