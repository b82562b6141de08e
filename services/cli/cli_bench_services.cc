// grpo bench weight_sync | ingest | e2e: the service benchmarks of docs/BENCHMARKS.md.
// Every one runs a real LearnerServer in this process on loopback; "workers" are threads of
// this process with their own gRPC channels (and, for Gloo, their own TCP connections), so
// every byte crosses a real socket. Each row carries its baseline measured in the same run.
#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>
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
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/weight_sync/epoch_store.h"
#include "common/weight_sync/gloo_weight_sync.h"
#include "common/metrics.h"
#include "common/model.h"
#include "common/model_config.h"
#include "common/rollout_types.h"
#include "services/auth.h"
#include "services/cli/bench_util.h"
#include "services/convert.h"
#include "services/cli/demo_task.h"
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

constexpr auto kBenchRpcTimeout = 120s;
constexpr auto kSyncTimeout = 60s;  // rendezvous and each collective of the Gloo group
constexpr int64_t kIngestGroupsPerPush = 4;  // groups per PushRollouts stream (one worker round)
// Training never starts in `ingest`: the generation batch is this many groups (the service has
// no switch to turn training off).
constexpr int64_t kIngestNoTrainSteps = int64_t{1} << 20;
// e2e submits the demo's built-in dataset this many times over (one pass outlasts a run).
constexpr int64_t kE2eDatasetCopies = 64;

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& stem) {
    std::string tmpl = (fs::temp_directory_path() / (stem + "-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }

 private:
  std::string path_;
};

// A channel of its own (its own subchannel pool, so its own TCP connection) to `address`.
std::shared_ptr<grpc::Channel> OwnChannel(const std::string& address, int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("grpo.bench_channel", index);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

std::unique_ptr<grpc::ClientContext> Ctx(std::chrono::seconds timeout = kBenchRpcTimeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  return ctx;
}

// A learner service config at the bench shapes; training runs only when a generation batch
// (per_device_train_batch_size x steps_per_generation completions) is buffered.
common::GrpoConfig BenchServiceConfig(const std::string& dir) {
  common::GrpoConfig c;
  c.output_dir = dir;
  c.grpc_port = 0;
  c.metrics_port = 0;
  c.num_generations = kBenchGenerations;
  c.per_device_train_batch_size = kBenchGenerations;
  c.gradient_accumulation_steps = 1;
  c.max_prompt_length = kPromptLen;
  c.max_completion_length = kCompletionLen;
  c.max_steps = 1 << 20;
  c.save_steps = 0;
  c.lease_seconds = 3600;
  c.reward_funcs = {"length"};
  return c;
}

// `heartbeat_interval`: the ingest bench's workers do not heartbeat (they only lease and push),
// so it gives them one long enough that the learner keeps them registered.
StatusOr<std::unique_ptr<LearnerServer>> StartLearner(
    common::GrpoConfig cfg, std::unique_ptr<common::Model> model,
    std::chrono::milliseconds heartbeat_interval = learner::kDefaultHeartbeatInterval) {
  LearnerServerOptions options;
  options.heartbeat_interval = heartbeat_interval;
  options.bind_address = "127.0.0.1";
  options.resume = false;
  options.weight_sync_timeout = kSyncTimeout;
  options.weight_sync_hostname = "127.0.0.1";
  ASSIGN_OR_RETURN(auto server,
                   LearnerServer::Create(std::move(cfg), std::move(model), nullptr, options));
  RETURN_IF_ERROR(server->Start());
  return server;
}

Status SubmitRows(v1::LearnerService::Stub& stub, const std::vector<std::string>& lines) {
  auto ctx = Ctx();
  v1::SubmitDatasetResponse response;
  auto writer = stub.SubmitDataset(ctx.get(), &response);
  v1::SubmitDatasetRequest req;
  req.set_name("bench");
  for (size_t i = 0; i < lines.size(); ++i) {
    req.add_lines(lines[i]);
    if (req.lines_size() == 256 || i + 1 == lines.size()) {
      // The last message says so, with the line count: the learner commits a dataset only
      // whole (SubmitDatasetRequest.last, total_lines).
      if (i + 1 == lines.size()) {
        req.set_last(true);
        req.set_total_lines(static_cast<int64_t>(lines.size()));
      }
      if (!writer->Write(req)) break;
      req.Clear();
    }
  }
  writer->WritesDone();
  return FromGrpcStatus(writer->Finish()).WithContext("SubmitDataset");
}

int64_t TotalBytes(const common::NamedTensors& t) {
  int64_t n = 0;
  for (const auto& [name, x] : t) n += static_cast<int64_t>(x.nbytes());
  return n;
}

bool BitEqual(const common::NamedTensors& a, const common::NamedTensors& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor x = a[i].second.contiguous(), y = b[i].second.contiguous();
    if (x.nbytes() != y.nbytes() || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

json TimingJson(const Timing& t, const std::string& prefix = "s") {
  return {{prefix + "_median", t.median}, {prefix + "_min", t.min}, {prefix + "_max", t.max}};
}

void Merge(json& row, const json& more) {
  for (auto it = more.begin(); it != more.end(); ++it) row[it.key()] = it.value();
}

int Fail(const std::string& bench, const Status& s) {
  std::cerr << "grpo bench " << bench << ": " << s.ToString() << "\n";
  return 1;
}

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
  // GrpcEpochStore over the learner's Store RPC (the production rendezvous), data over loopback TCP.
  const int64_t epoch = server->group_epoch();
  common::GlooWeightSyncOptions gopts;
  gopts.sync.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(kSyncTimeout);
  gopts.hostname = "127.0.0.1";
  std::vector<Status> worker_status(workers, Status::OK());
  std::vector<char> worker_equal(workers, 0);
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
        Status s = (*sync)->Begin(common::kAnyVersion);
        if (s.ok()) s = (*sync)->Broadcast(dst);
        if (s.ok()) s = (*sync)->Commit();
        if (!s.ok()) {
          worker_status[i] = s;
          return;
        }
      }
      worker_equal[i] = BitEqual(dst, src) ? 1 : 0;
    });
  }
  Status gloo_status = Status::OK();
  double setup_s = 0;
  std::vector<double> gloo_samples;
  {
    auto store = c10::make_intrusive<common::C10dEpochStore>(
        server->epoch_store(), epoch,
        std::chrono::duration_cast<std::chrono::milliseconds>(kSyncTimeout));
    auto sync = common::CreateGlooWeightSync(store, 0, workers + 1, epoch, gopts);
    setup_s = Seconds(setup_t0);
    if (!sync.ok()) {
      gloo_status = sync.status();
    } else {
      for (int r = 0; r < reps + 1 && gloo_status.ok(); ++r) {
        const auto t0 = Clock::now();
        Status s = (*sync)->Begin(r + 1);
        if (s.ok()) s = (*sync)->Broadcast(src);
        if (s.ok()) s = (*sync)->Commit();  // every rank agrees: all have every byte
        gloo_status = s;
        if (r > 0) gloo_samples.push_back(Seconds(t0));  // r == 0: warm-up
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
  bool gloo_equal = true;
  for (char e : worker_equal) gloo_equal = gloo_equal && e != 0;
  const Timing gloo_t = Summarize(gloo_samples);

  // --- gRPC GetWeights fallback: every worker thread streams the published version over its
  // own channel, reassembles it and loads it into its model (GrpcWeightReceiver::Receive, the
  // worker's code path), all at once.
  std::vector<std::unique_ptr<GrpcWeightReceiver>> receivers;
  std::vector<std::unique_ptr<common::Model>> models;
  for (int i = 0; i < workers; ++i) {
    receivers.push_back(
        std::make_unique<GrpcWeightReceiver>(OwnChannel(address, 100 + i), ""));
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
  json mrow = {{"bench", "weight_sync"}, {"impl", "memcpy"}, {"bytes", bytes},
               {"gbps", memcpy_gbps}};
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
  json rrow = sync_row("grpc_getweights", grpc_t, grpc_equal);
  rrow["chunk_bytes"] = kDefaultWeightChunkBytes;
  rows.push_back(rrow);
  json srow = {{"bench", "weight_sync"}, {"impl", "learner_step"},
               {"G", kBenchGenerations}, {"micro_batch", o.micro}};
  Merge(srow, TimingJson(step));
  rows.push_back(srow);

  if (o.json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "weight_sync: bench model (" << std::fixed << std::setprecision(1)
            << static_cast<double>(bytes) / 1048576.0 << " MiB fp32) from the learner to "
            << workers << " workers = threads of this process, each with its own connections "
               "over loopback TCP; median of "
            << reps << " after a warm-up\n"
            << "  gloo: c10d ProcessGroupGloo broadcast, rendezvous over the learner's Store RPC "
               "(GrpcEpochStore), checksum verified at Commit; group setup "
            << std::setprecision(2) << setup_s << " s (not in the time)\n"
            << "  grpc_getweights: LearnerService.GetWeights stream (" << kDefaultWeightChunkBytes / 1048576
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
  json lrow = {{"bench", "ingest"}, {"impl", "learner_step"},
               {"G", kBenchGenerations}, {"micro_batch", o.micro}};
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
            << " tokens + log-probs, prompt " << kPromptLen << ", 1 reward, text; "
            << wire_bytes << " bytes on the wire; " << kIngestGroupsPerPush
            << " groups per stream, " << per_worker << " groups per worker per repetition; "
            << "median of " << reps << " after a warm-up\n"
            << "  a generation batch of the bench = 1 group (16 completions) = 1 learner step of "
            << std::setprecision(3) << step.median << " s (min " << step.min << ", max "
            << step.max << ")\n";
  std::cout << "  grpc_push:      " << std::setprecision(1) << groups_per_rep / wall.median
            << " groups/s (min " << groups_per_rep / wall.max << ", max "
            << groups_per_rep / wall.min << "), " << std::setprecision(1)
            << groups_per_rep * wire_bytes / wall.median / 1e6 << " MB/s; "
            << std::setprecision(2) << 1e3 * per_group
            << " ms per generation batch = " << std::setprecision(3) << 100 * per_group / step.median
            << "% of a learner step (goal <= 2%)\n"
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

// ---------------------------------------------------------------------------------------------
// e2e

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

struct E2eResult {
  std::string mode;
  int64_t max_staleness = 0, num_iterations = 1, steps = 0, steps_per_batch = 0;
  int64_t batches_timed = 0;
  double steps_per_second = 0;
  Timing batch_interval;    // between generation-batch completions, after the first
  double t_step = 0;        // mean train time per optimizer step (StepMetrics.step_seconds)
  double g_batch = 0;       // one worker's generation time per generation batch
  double wall_s = 0;
  double reward_first = 0, reward_last = 0;
  int64_t stale_refused = 0;
};

StatusOr<E2eResult> RunE2eOnce(int64_t max_staleness, int64_t num_iterations, int64_t steps,
                               int workers) {
  TempDir dir("grpo-bench-e2e");
  if (!dir.ok()) return Status::Internal("mkdtemp failed");
  common::GrpoConfig cfg = DemoTaskConfig();
  cfg.max_staleness = max_staleness;
  cfg.num_iterations = num_iterations;
  cfg.max_steps = steps;
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
    // The built-in rows repeated: a pass of the 8-row dataset is only 2 generation batches,
    // and every pass boundary costs the worker a LeasePrompts retry_after.
    std::vector<std::string> lines;
    for (int64_t copy = 0; copy < kE2eDatasetCopies; ++copy) {
      for (const json& row : BuiltinDataset()) lines.push_back(row.dump());
    }
    auto stub = v1::LearnerService::NewStub(OwnChannel(address, 999));
    RETURN_IF_ERROR(SubmitRows(*stub, lines));
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
    wo.reward_options = DemoRewardOptions();
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
  StatusOr<std::string> final_state = Status::Internal("not watched");
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
  if (batch_end.size() < 3 || t_n == 0) {
    return Status::FailedPrecondition(
        "too few generation batches to time (" + std::to_string(batch_end.size()) +
        "); raise --steps (each batch is " + std::to_string(steps_per_batch) + " steps)");
  }
  std::vector<double> intervals;
  for (size_t i = 1; i < batch_end.size(); ++i) intervals.push_back(batch_end[i] - batch_end[i - 1]);
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
      return Fail("e2e", r.status().WithContext(
                             "max_staleness " + std::to_string(p.staleness) +
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
            << workers << " workers), t = train time per step (StepMetrics.step_seconds), "
               "T = t x steps per batch; all on the same " << std::thread::hardware_concurrency()
            << " cores\n"
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
              << std::setprecision(1)
              << std::setw(8) << r.wall_s << "\n";
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

int BenchWeightSync(const ServiceBenchOptions& o) { return RunWeightSync(o); }
int BenchIngest(const ServiceBenchOptions& o) { return RunIngest(o); }
int BenchE2e(const ServiceBenchOptions& o) { return RunE2e(o); }

}  // namespace grpo::services::bench
