// grpo bench ingest (docs/BENCHMARKS.md); shared helpers in bench_services_util.h.
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

constexpr int64_t kIngestGroupsPerPush = 4;  // groups per PushRollouts stream (one worker round)
// Training never starts in `ingest`: the generation batch is this many groups (the service has
// no switch to turn training off).
constexpr int64_t kIngestNoTrainSteps = int64_t{1} << 20;

// ---------------------------------------------------------------------------------------------
// ingest

// A group at the bench shapes: 64 prompt tokens, G completions of 128 tokens with behaviour
// log-probs, one reward each, and a decoded text of ~4 bytes per token.
common::RolloutGroup BenchGroup(std::mt19937_64& rng, int64_t vocab, const std::string& prompt_id,
                                const std::string& lease_id) {
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  std::uniform_real_distribution<float> lp(-12.0f, -0.01f);
  common::RolloutGroup g;
  g.prompt_id = prompt_id;
  g.lease_id = lease_id;
  g.policy_version = 0;
  for (int64_t t = 0; t < kPromptLen; ++t) g.prompt_ids.push_back(tok(rng));
  for (int64_t j = 0; j < kBenchGenerations; ++j) {
    common::Completion c;
    for (int64_t t = 0; t < kCompletionLen; ++t) {
      c.token_ids.push_back(tok(rng));
      c.logprobs.push_back(lp(rng));
    }
    c.truncated = true;
    c.rewards = {static_cast<double>(j % 4) - 1.5};
    c.text.assign(4 * kCompletionLen, static_cast<char>('a' + j % 26));
    g.completions.push_back(std::move(c));
  }
  return g;
}

int RunIngest(const ServiceBenchOptions& o) {
  const int workers = static_cast<int>(o.workers > 0 ? o.workers : 2);
  const int64_t per_worker = o.groups > 0 ? o.groups : 128;
  const int reps = std::max(1, o.reps);
  TempDir dir("grpo-bench-ingest");
  if (!dir.ok()) return Fail("ingest", Status::Internal("mkdtemp failed"));

  const Timing step = LearnerStepTiming(reps, o.micro);

  // Baseline without the network or the service: ToProto + serialise + parse + FromProto.
  std::mt19937_64 rng(5);
  const int64_t vocab = common::ModelConfigPreset("bench")->vocab_size;
  std::vector<common::RolloutGroup> sample;
  for (int i = 0; i < 16; ++i) sample.push_back(BenchGroup(rng, vocab, "p", "l"));
  int64_t wire_bytes = 0;
  const Timing serial_t = TimeIt(reps, [&] {
    for (const auto& g : sample) {
      v1::RolloutGroup msg;
      ToProto(g, &msg);
      std::string wire;
      msg.SerializeToString(&wire);
      wire_bytes = static_cast<int64_t>(wire.size());
      v1::RolloutGroup back;
      back.ParseFromString(wire);
      common::RolloutGroup domain = FromProto(back);
      if (domain.completions.size() != g.completions.size()) std::abort();
    }
  });
  const double serial_per_group = serial_t.median / static_cast<double>(sample.size());

  // The service: bench shapes, a generation batch far larger than what is pushed (training
  // never starts), a buffer big enough for every group.
  common::GrpoConfig cfg = BenchServiceConfig(dir.path());
  cfg.steps_per_generation = kIngestNoTrainSteps;
  cfg.max_staleness = 1 << 20;
  auto server_or = StartLearner(cfg, BenchModel(), std::chrono::hours(1));
  if (!server_or.ok()) return Fail("ingest", server_or.status());
  std::unique_ptr<LearnerServer> server = std::move(server_or).value();
  const std::string address = "127.0.0.1:" + std::to_string(server->port());
  const int64_t per_worker_total = per_worker * (reps + 1);  // + warm-up
  {
    std::vector<std::string> lines;
    for (int64_t i = 0; i < per_worker_total * workers; ++i) {
      lines.push_back(R"({"prompt": "bench prompt )" + std::to_string(i) + R"("})");
    }
    auto stub = v1::LearnerService::NewStub(OwnChannel(address, 999));
    if (Status s = SubmitRows(*stub, lines); !s.ok()) return Fail("ingest", s);
  }

  // Each worker: its own channel; leases everything it will push up front, builds the groups
  // (generation is not what is measured), then pushes kIngestGroupsPerPush groups per
  // PushRollouts stream, `per_worker` groups per repetition, in step with the others.
  std::barrier sync_point(workers + 1);
  std::vector<Status> status(workers, Status::OK());
  std::vector<int64_t> accepted(workers, 0);
  std::vector<std::vector<double>> push_s(workers);  // each timed PushRollouts call
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      auto stub = v1::LearnerService::NewStub(OwnChannel(address, w));
      std::mt19937_64 wrng(100 + w);
      std::vector<common::RolloutGroup> groups;
      const std::string worker_id = "bench-worker-" + std::to_string(w);
      Status st = Status::OK();
      {
        // A worker leases only once registered, and its groups carry the learner's incarnation.
        v1::RegisterRequest req;
        req.set_worker_id(worker_id);
        req.set_weight_sync_backend("grpc");
        v1::RegisterResponse resp;
        auto ctx = Ctx();
        st = FromGrpcStatus(stub->Register(ctx.get(), req, &resp)).WithContext("Register");
      }
      while (st.ok() && static_cast<int64_t>(groups.size()) < per_worker_total) {
        v1::LeasePromptsRequest req;
        req.set_worker_id(worker_id);
        req.set_max_prompts(static_cast<int32_t>(
            std::min<int64_t>(per_worker_total - static_cast<int64_t>(groups.size()), 1024)));
        v1::LeasePromptsResponse resp;
        auto ctx = Ctx();
        st = FromGrpcStatus(stub->LeasePrompts(ctx.get(), req, &resp));
        if (st.ok() && resp.leases_size() == 0) {
          st = Status::Internal("LeasePrompts returned no leases");
        }
        for (const auto& l : resp.leases()) {
          groups.push_back(BenchGroup(wrng, vocab, l.prompt_id(), l.lease_id()));
          groups.back().policy_incarnation = server->incarnation();
        }
      }
      for (int r = 0; r < reps + 1; ++r) {
        sync_point.arrive_and_wait();  // start
        for (int64_t b = 0; st.ok() && b < per_worker; b += kIngestGroupsPerPush) {
          const auto p0 = Clock::now();
          auto ctx = Ctx();
          v1::PushRolloutsResponse resp;
          auto writer = stub->PushRollouts(ctx.get(), &resp);
          for (int64_t k = b; k < std::min(per_worker, b + kIngestGroupsPerPush); ++k) {
            v1::RolloutGroup msg;
            ToProto(groups[static_cast<size_t>(r * per_worker + k)], &msg);
            if (!writer->Write(msg)) break;
          }
          writer->WritesDone();
          st = FromGrpcStatus(writer->Finish());
          if (r > 0) push_s[w].push_back(Seconds(p0));
          if (st.ok()) {
            accepted[w] += resp.accepted();
            if (resp.rejected() > 0) {
              st = Status::Internal("PushRollouts rejected " + std::to_string(resp.rejected()) +
                                    " groups" +
                                    (resp.messages_size() > 0 ? ": " + resp.messages(0) : ""));
            }
          }
        }
        sync_point.arrive_and_wait();  // done
      }
      status[w] = st;
    });
  }
  std::vector<double> samples;
  for (int r = 0; r < reps + 1; ++r) {
    sync_point.arrive_and_wait();
    const auto t0 = Clock::now();
    sync_point.arrive_and_wait();
    if (r > 0) samples.push_back(Seconds(t0));  // r == 0: warm-up
  }
  for (auto& t : threads) t.join();
  (void)server->Stop(/*checkpoint=*/false);
  for (const Status& s : status) {
    if (!s.ok()) return Fail("ingest", s);
  }
  int64_t total_accepted = 0;
  for (int64_t a : accepted) total_accepted += a;

  const Timing wall = Summarize(samples);
  std::vector<double> all_push;
  for (const auto& v : push_s) all_push.insert(all_push.end(), v.begin(), v.end());
  const Timing push = Summarize(all_push);
  const double groups_per_rep = static_cast<double>(workers * per_worker);
  const double per_group = wall.median / groups_per_rep;  // effective, all workers together
  // One generation batch of the bench shapes = one group of G=16 = one optimizer step of
  // `learner_step` (16 sequences; per_device_train_batch_size x accumulation = 16).
  const int64_t groups_per_step = 1;
  std::vector<json> rows;
  json prow = {{"bench", "ingest"},
               {"impl", "grpc_push"},
               {"workers", workers},
               {"workers_are", "threads of this process, own channels, loopback TCP"},
               {"groups_per_rep", groups_per_rep},
               {"groups_per_push", kIngestGroupsPerPush},
               {"wire_bytes_per_group", wire_bytes},
               {"groups_per_second", groups_per_rep / wall.median},
               {"groups_per_second_min", groups_per_rep / wall.max},
               {"groups_per_second_max", groups_per_rep / wall.min},
               {"mb_per_second", groups_per_rep * wire_bytes / wall.median / 1e6},
               {"s_per_group", per_group},
               {"groups_per_step", groups_per_step},
               {"s_per_generation_batch", per_group * groups_per_step},
               {"step_s", step.median},
               {"vs_step", per_group * groups_per_step / step.median},
               {"goal_vs_step_max", 0.02},
               {"accepted", total_accepted}};
  Merge(prow, TimingJson(wall, "rep_s"));
  Merge(prow, TimingJson(push, "push_call_s"));
  rows.push_back(prow);
  json srow = {{"bench", "ingest"},
               {"impl", "serialise_only"},
               {"s_per_group", serial_per_group},
               {"vs_grpc_push", serial_per_group / per_group},
               {"vs_step", serial_per_group * groups_per_step / step.median}};
  rows.push_back(srow);
  json lrow = {{"bench", "ingest"},
               {"impl", "learner_step"},
               {"G", kBenchGenerations},
               {"micro_batch", o.micro}};
  Merge(lrow, TimingJson(step));
  rows.push_back(lrow);
  if (o.json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << std::fixed << "ingest: PushRollouts into an in-process LearnerServer (bench model, "
            << "training off: generation batch of " << kIngestNoTrainSteps
            << " steps never fills) from " << workers
            << " workers = threads of this process with their own channels over loopback TCP\n"
            << "  group: G=" << kBenchGenerations << " x " << kCompletionLen
            << " tokens + log-probs, prompt " << kPromptLen << ", 1 reward, text; " << wire_bytes
            << " bytes on the wire; " << kIngestGroupsPerPush << " groups per stream, "
            << per_worker << " groups per worker per repetition; "
            << "median of " << reps << " after a warm-up\n"
            << "  a generation batch of the bench = 1 group (16 completions) = 1 learner step of "
            << std::setprecision(3) << step.median << " s (min " << step.min << ", max " << step.max
            << ")\n";
  std::cout << "  grpc_push:      " << std::setprecision(1) << groups_per_rep / wall.median
            << " groups/s (min " << groups_per_rep / wall.max << ", max "
            << groups_per_rep / wall.min << "), " << std::setprecision(1)
            << groups_per_rep * wire_bytes / wall.median / 1e6 << " MB/s; " << std::setprecision(2)
            << 1e3 * per_group << " ms per generation batch = " << std::setprecision(3)
            << 100 * per_group / step.median << "% of a learner step (goal <= 2%)\n"
            << "                  one PushRollouts call of " << kIngestGroupsPerPush
            << " groups: " << std::setprecision(2) << 1e3 * push.median << " ms (min "
            << 1e3 * push.min << ", max " << 1e3 * push.max << ") while " << workers
            << " workers push\n";
  std::cout << "  serialise_only: " << std::setprecision(2) << 1e3 * serial_per_group
            << " ms per group (ToProto + serialise + parse + FromProto, one thread) = "
            << std::setprecision(0) << 100 * serial_per_group / per_group
            << "% of the push time per group\n";
  return 0;
}

}  // namespace

int BenchIngest(const ServiceBenchOptions& o) { return RunIngest(o); }

}  // namespace grpo::services::bench
