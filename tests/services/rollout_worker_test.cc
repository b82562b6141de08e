// RolloutWorker against a fake LearnerService (a small grpc::Service on a free port) that serves
// a known tiny model, hands out leases of known rows and records what the worker pushes.
#include "services/rollout_worker.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "common/model/device.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "common/tokenizer/dataset_row.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "services/grpc_weight_receiver.h"
#include "services/reward_server.h"

namespace grpo::services {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

constexpr int64_t kTargetLength = 3;  // the length reward's target in every test
constexpr int kGenerations = 4;

std::shared_ptr<common::Model> TinyModel(uint64_t seed) {
  auto config = common::ModelConfigPreset("tiny");
  EXPECT_TRUE(config.ok());
  auto model = common::Model::InitRandom(*config, seed);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::shared_ptr<common::Model>(std::move(model).value());
}

json GenerationConfig() {
  return {{"num_generations", kGenerations},
          {"max_prompt_length", 128},
          {"max_completion_length", 6},
          {"temperature", 1.0},
          {"min_p", nullptr},
          {"reward_funcs", json::array({"length"})},
          {"per_device_train_batch_size", 8},
          {"seed", 7},
          // Keys a worker does not take from the learner are ignored.
          {"learning_rate", 0.5},
          {"learner_address", "elsewhere:1"}};
}

// Thread-safe: gRPC calls the handlers from its own threads; tests read under mu.
class FakeLearner final : public v1::LearnerService::Service {
 public:
  std::mutex mu;
  // Behaviour (set before the worker starts, or under mu).
  int unavailable_first_n = 0;  // the first N calls of any RPC fail with UNAVAILABLE
  std::vector<std::string> rows;
  int leases_per_call = 2;
  int64_t retry_after_ms = 50;
  // A long poll (not answer_at_once) with nothing to lease is held this long, as the learner
  // holds one waiting for budget or the next pass, unless the call is cancelled.
  milliseconds long_poll_hold{0};
  bool job_done_when_empty = true;
  int64_t version = 1;
  std::string incarnation = "inc-1";  // learner_incarnation; a restart changes it
  bool unknown_worker = false;        // LeasePrompts is NOT_FOUND until the next Register
  std::shared_ptr<common::Model> model = TinyModel(11);
  int64_t chunk_bytes = 1000;  // a tensor spans several chunks
  json config = GenerationConfig();
  std::function<void()> on_lease;  // called (without mu) after a lease call that leased rows
  std::function<void(FakeLearner&)> after_push;  // called under mu after each push
  // A restart seen by a heartbeat in flight: with restart_on_heartbeat set, the next heartbeat
  // restarts this learner (restart(*this) under mu: a new incarnation, unknown_worker) and is
  // answered only once `answer_heartbeat(*this)` holds, polled under mu. LeasePrompts waits for
  // that restart, so the worker's next lease meets it.
  bool restart_on_heartbeat = false;
  std::function<void(FakeLearner&)> restart;
  std::function<bool(FakeLearner&)> answer_heartbeat;

  // Polls `done` under mu until it holds, for up to 4 s (the test's assertions say what then).
  void Await(const std::function<bool()>& done) {
    for (int i = 0; i < 200; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (done()) return;
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  // Recorded.
  int calls = 0;
  int register_calls = 0, lease_calls = 0, heartbeat_calls = 0;
  std::vector<int64_t> weights_served;  // versions, one per GetWeights stream
  std::vector<v1::RolloutGroup> pushed;
  std::vector<int64_t> heartbeat_versions;
  size_t next_row = 0;

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req,
                        v1::RegisterResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu);
    if (Unavailable()) return Fail();
    ++register_calls;
    resp->set_worker_id(req->worker_id().empty() ? "worker-1" : req->worker_id());
    resp->set_rank(1);
    resp->set_world_size(2);
    resp->set_group_epoch(1);
    resp->set_policy_version(version);
    resp->set_config_json(config.dump());
    resp->set_heartbeat_interval_ms(50);
    resp->set_model_config_json(model->config().ToJson().dump());
    resp->set_learner_incarnation(incarnation);
    unknown_worker = false;
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    std::unique_lock<std::mutex> lock(mu);
    if (Unavailable()) return Fail();
    if (restart_on_heartbeat) {
      restart_on_heartbeat = false;
      restart(*this);
      while (!answer_heartbeat(*this)) {
        lock.unlock();
        std::this_thread::sleep_for(milliseconds(2));
        lock.lock();
      }
    }
    ++heartbeat_calls;
    heartbeat_versions.push_back(req->weight_version());
    resp->set_policy_version(version);
    resp->set_group_epoch(1);
    resp->set_learner_incarnation(incarnation);
    return grpc::Status::OK;
  }

  grpc::Status LeasePrompts(grpc::ServerContext* context, const v1::LeasePromptsRequest* req,
                            v1::LeasePromptsResponse* resp) override {
    std::function<void()> hook;
    milliseconds hold{0};
    {
      std::unique_lock<std::mutex> lock(mu);
      if (Unavailable()) return Fail();
      while (restart_on_heartbeat) {  // the restart a heartbeat makes comes first
        lock.unlock();
        std::this_thread::sleep_for(milliseconds(2));
        lock.lock();
      }
      ++lease_calls;
      if (unknown_worker) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker: Register again");
      }
      resp->set_policy_version(version);
      resp->set_learner_incarnation(incarnation);
      const int n = std::min(req->max_prompts(), leases_per_call);
      for (int i = 0; i < n && next_row < rows.size(); ++i, ++next_row) {
        v1::Lease* l = resp->add_leases();
        l->set_lease_id("lease-" + std::to_string(next_row));
        l->set_prompt_id("prompt-" + std::to_string(next_row));
        l->set_row_json(rows[next_row]);
        l->set_deadline_unix_ms(
            std::chrono::duration_cast<milliseconds>(
                std::chrono::system_clock::now().time_since_epoch() + std::chrono::seconds(60))
                .count());
      }
      if (resp->leases().empty()) {
        if (job_done_when_empty) {
          resp->set_job_done(true);
        } else {
          resp->set_retry_after_ms(retry_after_ms);
          if (!req->answer_at_once()) hold = long_poll_hold;
        }
      } else {
        hook = on_lease;
      }
    }
    if (hook) hook();
    const auto until = std::chrono::steady_clock::now() + hold;
    while (std::chrono::steady_clock::now() < until && !context->IsCancelled()) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    return grpc::Status::OK;
  }

  grpc::Status PushRollouts(grpc::ServerContext*, grpc::ServerReader<v1::RolloutGroup>* reader,
                            v1::PushRolloutsResponse* resp) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (Unavailable()) return Fail();
    }
    std::vector<v1::RolloutGroup> got;
    v1::RolloutGroup g;
    while (reader->Read(&g)) got.push_back(g);
    std::lock_guard<std::mutex> lock(mu);
    for (auto& x : got) pushed.push_back(std::move(x));
    resp->set_accepted(static_cast<int64_t>(got.size()));
    if (after_push) after_push(*this);
    return grpc::Status::OK;
  }

  grpc::Status GetWeights(grpc::ServerContext*, const v1::GetWeightsRequest* req,
                          grpc::ServerWriter<v1::WeightChunk>* writer) override {
    std::shared_ptr<common::Model> m;
    int64_t v;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (Unavailable()) return Fail();
      m = model;
      v = version;
      weights_served.push_back(v);
    }
    const common::NamedTensors params = m->NamedParameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor t = params[i].second.contiguous();
      const int64_t bytes = static_cast<int64_t>(t.nbytes());
      for (int64_t off = 0; off == 0 || off < bytes; off += chunk_bytes) {
        v1::WeightChunk c;
        c.set_version(v);
        c.set_name(params[i].first);
        for (int64_t d : t.sizes()) c.add_shape(d);
        c.set_dtype("F32");
        c.set_offset(off);
        c.set_tensor_bytes(bytes);
        const int64_t n = std::min(chunk_bytes, bytes - off);
        c.set_data(static_cast<const char*>(t.data_ptr()) + off, static_cast<size_t>(n));
        c.set_last(i + 1 == params.size() && off + n >= bytes);
        if (!writer->Write(c)) return grpc::Status(grpc::StatusCode::CANCELLED, "gone");
      }
    }
    return grpc::Status::OK;
  }

 private:
  bool Unavailable() { return calls++ < unavailable_first_n; }
  static grpc::Status Fail() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake learner not ready");
  }
};

class FakeLearnerServer {
 public:
  explicit FakeLearnerServer(FakeLearner* service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
    EXPECT_NE(server_, nullptr);
    EXPECT_GT(port_, 0);
  }
  ~FakeLearnerServer() { server_->Shutdown(std::chrono::system_clock::now() + milliseconds(500)); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

RolloutWorkerOptions Options(const std::string& address, const std::atomic<bool>* stop = nullptr) {
  RolloutWorkerOptions o;
  o.learner_address = address;
  o.config.weight_sync_backend = "grpc";
  o.prompts_per_lease = 2;
  o.reward_options = {{"length", {{"target_length", kTargetLength}}}};
  o.backoff.initial = milliseconds(5);
  o.backoff.max = milliseconds(50);
  o.stop = stop;
  return o;
}

std::unique_ptr<RolloutWorker> MakeWorker(RolloutWorkerOptions o) {
  auto w = RolloutWorker::Create(std::move(o));
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return std::move(w).value();
}

void ExpectSameParameters(const common::Model& a, const common::Model& b) {
  const auto pa = a.NamedParameters(), pb = b.NamedParameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].first, pb[i].first);
    ASSERT_EQ(pa[i].second.sizes(), pb[i].second.sizes()) << pa[i].first;
    ASSERT_EQ(pa[i].second.scalar_type(), pb[i].second.scalar_type()) << pa[i].first;
    // Bit for bit.
    const at::Tensor x = pa[i].second.contiguous(), y = pb[i].second.contiguous();
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0) << pa[i].first;
  }
}

const char* kPromptRow = R"({"prompt": "Say hi."})";
const char* kMessagesRow = R"({"messages": [{"role": "user", "content": "Name a colour."}]})";

TEST(RolloutWorker, TakesWeightsBitForBitAndPushesScoredGroupsUnderTheirLeases) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow};
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());

  ASSERT_NE(worker->policy(), nullptr);
  ExpectSameParameters(*worker->policy(), *fake.model);
  EXPECT_EQ(worker->policy_version(), 1);
  EXPECT_EQ(worker->worker_id(), "worker-1");
  EXPECT_EQ(worker->rank(), 1);
  // The learner's generation keys won; the rest stayed the worker's.
  EXPECT_EQ(worker->config().num_generations, kGenerations);
  EXPECT_EQ(worker->config().learning_rate, common::GrpoConfig().learning_rate);
  EXPECT_EQ(worker->config().learner_address, common::GrpoConfig().learner_address);

  std::lock_guard<std::mutex> lock(fake.mu);
  ASSERT_EQ(fake.pushed.size(), 2u);
  std::map<std::string, const v1::RolloutGroup*> by_lease;
  for (const auto& g : fake.pushed) by_lease[g.lease_id()] = &g;
  ASSERT_EQ(by_lease.count("lease-0"), 1u);
  ASSERT_EQ(by_lease.count("lease-1"), 1u);
  EXPECT_EQ(by_lease["lease-0"]->prompt_id(), "prompt-0");
  EXPECT_EQ(by_lease["lease-1"]->prompt_id(), "prompt-1");

  // Prompt ids: the byte tokenizer's bytes of the prompt, and of the ChatML text for messages.
  common::ByteTokenizer tok;
  const std::string chatml = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n";
  const auto want0 = tok.Encode("Say hi.").value(), want1 = tok.Encode(chatml).value();
  EXPECT_EQ(std::vector<int32_t>(by_lease["lease-0"]->prompt_ids().begin(),
                                 by_lease["lease-0"]->prompt_ids().end()),
            want0);
  EXPECT_EQ(std::vector<int32_t>(by_lease["lease-1"]->prompt_ids().begin(),
                                 by_lease["lease-1"]->prompt_ids().end()),
            want1);

  for (const auto& g : fake.pushed) {
    EXPECT_EQ(g.worker_id(), "worker-1");
    EXPECT_EQ(g.policy_version(), 1);
    ASSERT_EQ(g.completions_size(), kGenerations);
    for (const auto& c : g.completions()) {
      EXPECT_GE(c.token_ids_size(), 1);
      EXPECT_LE(c.token_ids_size(), 6);
      EXPECT_EQ(c.logprobs_size(), c.token_ids_size());
      for (float lp : c.logprobs()) {
        EXPECT_TRUE(std::isfinite(lp));
        EXPECT_LE(lp, 0.0f);
      }
      // length reward: -|target - completion tokens|.
      ASSERT_EQ(c.rewards_size(), 1);
      ASSERT_TRUE(c.rewards(0).has_value());
      EXPECT_EQ(c.rewards(0).value(), -std::abs(kTargetLength - c.token_ids_size()));
    }
  }
  const WorkerStats st = worker->stats();
  EXPECT_EQ(st.groups_pushed, 2);
  EXPECT_EQ(st.groups_accepted, 2);
  EXPECT_EQ(st.weight_fetches, 1);
  EXPECT_EQ(st.prompts_failed, 0);
  EXPECT_EQ(fake.weights_served, std::vector<int64_t>{1});
}

TEST(RolloutWorker, ExportsWorkerMetrics) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow};
  FakeLearnerServer server(&fake);
  common::Registry registry;
  auto o = Options(server.address());
  o.metrics_registry = &registry;
  auto worker = MakeWorker(o);
  ASSERT_TRUE(worker->Run().ok());
  const std::string text = registry.Expose();
  EXPECT_NE(text.find("grpo_rollout_groups_pushed_total 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("grpo_rollout_weight_version 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("grpo_rollout_leases_held 0\n"), std::string::npos) << text;
  // One reward call per pushed group, each timed.
  EXPECT_NE(text.find("grpo_rollout_reward_duration_seconds_count{reward_fn=\"length\"} 2\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("grpo_rollout_tokens_generated_total " +
                      std::to_string(worker->stats().completion_tokens) + "\n"),
            std::string::npos)
      << text;
}

TEST(RolloutWorker, RetriesWithBackoffWhileTheLearnerIsUnavailable) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow};
  fake.unavailable_first_n = 4;
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());
  EXPECT_GE(worker->stats().rpc_retries, 4);
  std::lock_guard<std::mutex> lock(fake.mu);
  EXPECT_EQ(fake.pushed.size(), 2u);
  EXPECT_EQ(fake.register_calls, 1);
}

TEST(RolloutWorker, NewerPolicyVersionTriggersAWeightFetchBeforeGenerating) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow, kPromptRow, kMessagesRow};
  const std::shared_ptr<common::Model> v2 = TinyModel(22);
  fake.after_push = [v2](FakeLearner& f) {
    if (f.version == 1) {
      f.version = 2;
      f.model = v2;
    }
  };
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());

  ExpectSameParameters(*worker->policy(), *v2);
  EXPECT_EQ(worker->policy_version(), 2);
  EXPECT_EQ(worker->stats().weight_fetches, 2);
  std::lock_guard<std::mutex> lock(fake.mu);
  EXPECT_EQ(fake.weights_served, (std::vector<int64_t>{1, 2}));
  ASSERT_EQ(fake.pushed.size(), 4u);
  EXPECT_EQ(fake.pushed[0].policy_version(), 1);
  EXPECT_EQ(fake.pushed[1].policy_version(), 1);
  EXPECT_EQ(fake.pushed[2].policy_version(), 2);
  EXPECT_EQ(fake.pushed[3].policy_version(), 2);
}

// Issue 12 (3): after a learner restart the versions start again from its checkpoint. The
// worker held version 3 of the dead learner; the new one publishes version 1. Before, the worker
// kept its version 3 (versions only moved up) and tagged groups with a version the new learner
// never had. It must drop it, take the new learner's weights, and tag groups with them.
TEST(RolloutWorker, AfterALearnerRestartItTakesTheNewLearnersWeightsAndTagsGroupsWithThem) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow, kPromptRow, kMessagesRow};
  fake.version = 3;
  const std::shared_ptr<common::Model> restored = TinyModel(33);
  fake.after_push = [restored](FakeLearner& f) {
    if (f.incarnation == "inc-1") {
      f.incarnation = "inc-2";
      f.version = 1;
      f.model = restored;
      f.unknown_worker = true;
    }
  };
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());

  ExpectSameParameters(*worker->policy(), *restored);
  EXPECT_EQ(worker->policy_version(), 1);
  std::lock_guard<std::mutex> lock(fake.mu);
  EXPECT_EQ(fake.register_calls, 2);
  EXPECT_EQ(fake.weights_served, (std::vector<int64_t>{3, 1}));
  ASSERT_EQ(fake.pushed.size(), 4u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(fake.pushed[i].policy_version(), 3) << i;
    EXPECT_EQ(fake.pushed[i].policy_incarnation(), "inc-1") << i;
  }
  for (int i = 2; i < 4; ++i) {
    EXPECT_EQ(fake.pushed[i].policy_version(), 1) << i;
    EXPECT_EQ(fake.pushed[i].policy_incarnation(), "inc-2") << i;
  }
}

// A heartbeat sent to the old learner and answered by the restarted one after the worker has
// registered with it (its lease met the restart first) asks for nothing: before, its answer (an
// incarnation other than the one the heartbeat was sent under) set needs_register_ again, and the
// worker registered a second time with the same learner (the test above failed so once in CI).
TEST(RolloutWorker, AHeartbeatAnsweredAcrossARegistrationAsksForNoOther) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow, kPromptRow, kMessagesRow};
  fake.version = 3;
  const std::shared_ptr<common::Model> restored = TinyModel(33);
  fake.after_push = [](FakeLearner& f) {
    if (f.incarnation == "inc-1") f.restart_on_heartbeat = true;
  };
  fake.restart = [restored](FakeLearner& f) {
    f.incarnation = "inc-2";
    f.version = 1;
    f.model = restored;
    f.unknown_worker = true;
  };
  // Answered once the worker has registered again and taken the new learner's weights (so the
  // registration is applied whole before the answer arrives).
  fake.answer_heartbeat = [](FakeLearner& f) {
    return f.register_calls >= 2 && f.weights_served.size() >= 2;
  };
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());

  EXPECT_EQ(worker->policy_version(), 1);
  std::lock_guard<std::mutex> lock(fake.mu);
  EXPECT_EQ(fake.register_calls, 2);
  EXPECT_EQ(fake.weights_served, (std::vector<int64_t>{3, 1}));
  ASSERT_EQ(fake.pushed.size(), 4u);
  for (int i = 2; i < 4; ++i) EXPECT_EQ(fake.pushed[i].policy_incarnation(), "inc-2") << i;
}

TEST(RolloutWorker, BadPromptsAreSkippedAndCounted) {
  FakeLearner fake;
  fake.config["truncate_prompt"] = "reject";
  fake.config["max_prompt_length"] = 16;
  fake.leases_per_call = 4;
  fake.rows = {R"({"prompt": "This prompt is far longer than sixteen bytes."})",
               R"({"question": "no prompt key"})", "not json", kPromptRow};
  FakeLearnerServer server(&fake);
  auto o = Options(server.address());
  o.prompts_per_lease = 4;
  auto worker = MakeWorker(o);
  ASSERT_TRUE(worker->Run().ok());
  EXPECT_EQ(worker->stats().prompts_failed, 3);
  std::lock_guard<std::mutex> lock(fake.mu);
  // The rows that do not parse are not pushed; the prompt too long for truncate_prompt=reject
  // crosses the wire as its failure with prompt_failed (the learner rejects it).
  ASSERT_EQ(fake.pushed.size(), 2u);
  std::map<std::string, const v1::RolloutGroup*> by_lease;
  for (const auto& g : fake.pushed) by_lease[g.lease_id()] = &g;
  ASSERT_EQ(by_lease.count("lease-0"), 1u);
  EXPECT_TRUE(by_lease["lease-0"]->prompt_failed());
  EXPECT_NE(by_lease["lease-0"]->failure().find("max_prompt_length"), std::string::npos)
      << by_lease["lease-0"]->failure();
  EXPECT_EQ(by_lease["lease-0"]->completions_size(), 0);
  ASSERT_EQ(by_lease.count("lease-3"), 1u);
  EXPECT_TRUE(by_lease["lease-3"]->failure().empty());
}

// Sets `stop` and joins `run` (the thread of the worker's Run): the seconds that took.
double SecondsToStop(std::atomic<bool>& stop, std::thread& run) {
  const auto t0 = std::chrono::steady_clock::now();
  stop = true;
  run.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(RolloutWorker, StopFlagMakesRunReturnPromptlyWhileWaitingForPrompts) {
  FakeLearner fake;
  fake.job_done_when_empty = false;
  fake.retry_after_ms = 60000;
  FakeLearnerServer server(&fake);
  std::atomic<bool> stop{false};
  auto worker = MakeWorker(Options(server.address(), &stop));
  Status result = Status::Internal("not returned");
  std::thread t([&] { result = worker->Run(); });
  // Registered, has weights, and heartbeats with its version.
  fake.Await([&] { return fake.lease_calls > 0 && fake.heartbeat_calls >= 2; });
  const double seconds = SecondsToStop(stop, t);
  EXPECT_TRUE(result.ok()) << result.ToString();
  EXPECT_LT(seconds, 1.0);
  std::lock_guard<std::mutex> lock(fake.mu);
  ASSERT_GE(fake.heartbeat_calls, 2);
  EXPECT_EQ(fake.heartbeat_versions.back(), 1);
}

// The learner holds a lease with nothing to give for up to 3 s (a long poll); a stopped worker
// cancels the call (half a second after the stop) rather than wait it out. The fake holds it
// 30 s.
TEST(RolloutWorker, StopFlagCancelsALongPollInFlight) {
  FakeLearner fake;
  fake.job_done_when_empty = false;
  fake.long_poll_hold = milliseconds(30'000);
  FakeLearnerServer server(&fake);
  std::atomic<bool> stop{false};
  auto worker = MakeWorker(Options(server.address(), &stop));
  Status result = Status::Internal("not returned");
  std::thread t([&] { result = worker->Run(); });
  fake.Await([&] { return fake.lease_calls > 0; });
  std::this_thread::sleep_for(milliseconds(100));  // the lease is in the fake's hold
  const double seconds = SecondsToStop(stop, t);
  EXPECT_TRUE(result.ok()) << result.ToString();
  EXPECT_LT(seconds, 2.0);
  std::lock_guard<std::mutex> lock(fake.mu);
  EXPECT_EQ(fake.lease_calls, 1);
}

TEST(RolloutWorker, StopFlagDuringBackoffReturnsPromptly) {
  FakeLearner fake;
  fake.unavailable_first_n = 1 << 30;
  FakeLearnerServer server(&fake);
  std::atomic<bool> stop{false};
  auto o = Options(server.address(), &stop);
  o.backoff.initial = milliseconds(200);
  o.backoff.max = milliseconds(5000);
  auto worker = MakeWorker(o);
  Status result = Status::Internal("not returned");
  std::thread t([&] { result = worker->Run(); });
  std::this_thread::sleep_for(milliseconds(700));
  EXPECT_LT(SecondsToStop(stop, t), 1.0);
  EXPECT_TRUE(result.ok()) << result.ToString();
  EXPECT_GE(worker->stats().rpc_retries, 2);
  EXPECT_EQ(worker->policy(), nullptr);
}

TEST(RolloutWorker, StopDuringARoundFinishesGenerationPushesAndLeasesNoMore) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow, kPromptRow, kMessagesRow};
  std::atomic<bool> stop{false};
  fake.on_lease = [&stop] { stop = true; };  // SIGTERM arrives while the round runs
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address(), &stop));
  ASSERT_TRUE(worker->Run().ok());
  std::lock_guard<std::mutex> lock(fake.mu);
  EXPECT_EQ(fake.lease_calls, 1);
  ASSERT_EQ(fake.pushed.size(), 2u);
  EXPECT_EQ(fake.pushed[0].completions_size(), kGenerations);
}

TEST(RolloutWorker, RemoteRewardFunctionInTheConfigScoresThroughARewardServer) {
  auto length = rollout::MakeRewardFunction("length", {{"target_length", 2}});
  ASSERT_TRUE(length.ok());
  auto rs = RewardServer::Start("127.0.0.1:0", {{"len2", std::move(length).value()}});
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  FakeLearner fake;
  fake.rows = {kPromptRow, kMessagesRow};
  fake.config["reward_funcs"] =
      json::array({"length", "remote:len2@127.0.0.1:" + std::to_string((*rs)->port())});
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());
  EXPECT_EQ(worker->stats().reward_errors, 0);
  std::lock_guard<std::mutex> lock(fake.mu);
  ASSERT_EQ(fake.pushed.size(), 2u);
  for (const auto& g : fake.pushed) {
    for (const auto& c : g.completions()) {
      ASSERT_EQ(c.rewards_size(), 2);
      ASSERT_TRUE(c.rewards(1).has_value());
      EXPECT_EQ(c.rewards(0).value(), -std::abs(kTargetLength - c.token_ids_size()));
      EXPECT_EQ(c.rewards(1).value(), -std::abs(2 - c.token_ids_size()));
    }
  }
}

TEST(RolloutWorker, UnknownModelVocabularyWithoutTokenizerIsAnError) {
  FakeLearner fake;
  auto config = common::ModelConfigPreset("tiny").value();
  config.vocab_size = 300;
  fake.model = std::shared_ptr<common::Model>(common::Model::InitRandom(config, 1).value());
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  const Status s = worker->Run();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
}

// The worker's sampler seed of a lease: FNV-1a of the lease id, shifted right by 2 (as
// rollout_worker.cc derives it), so a test can replay a worker's generation.
int64_t LeaseSeedIndex(std::string_view lease_id) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : lease_id) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 2);
}

// What a Generator over `model` produces for the one prompt of kPromptRow under "lease-0".
common::RolloutGroup Replay(std::shared_ptr<const common::Model> model,
                            const common::GrpoConfig& config) {
  common::ByteTokenizer tok;
  auto gen = rollout::Generator::Create(std::move(model), 1,
                                        rollout::GeneratorOptions::FromConfig(config), &tok);
  EXPECT_TRUE(gen.ok()) << gen.status().ToString();
  auto out = (*gen)->Generate({tok.Encode("Say hi.").value()}, {LeaseSeedIndex("lease-0")});
  EXPECT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->groups.size(), 1u);
  EXPECT_TRUE(out->groups[0].ok());
  return std::move(out->groups[0]).value();
}

TEST(RolloutWorker, WithTheLearnersBf16ItGeneratesWithABf16CopyOfTheWeights) {
  FakeLearner fake;
  fake.rows = {kPromptRow};
  fake.config["bf16"] = true;
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());
  EXPECT_TRUE(worker->config().bf16);
  ASSERT_NE(worker->policy(), nullptr);
  EXPECT_EQ(worker->policy()->dtype(), at::kBFloat16);
  EXPECT_TRUE(worker->policy()->device().is_cpu());
  // The learner's fp32 weights rounded to bf16, bit for bit.
  ExpectSameParameters(*worker->policy(), *fake.model->Copy(at::kCPU, at::kBFloat16).value());

  // The pushed group is what a bf16 generator gives for that lease, not what an fp32 one does.
  const common::GrpoConfig config = worker->config();
  const common::RolloutGroup bf16 =
      Replay(fake.model->Copy(at::kCPU, at::kBFloat16).value(), config);
  const common::RolloutGroup fp32 = Replay(fake.model, config);
  std::lock_guard<std::mutex> lock(fake.mu);
  ASSERT_EQ(fake.pushed.size(), 1u);
  const v1::RolloutGroup& got = fake.pushed[0];
  ASSERT_EQ(got.completions_size(), static_cast<int>(bf16.completions.size()));
  bool differs_from_fp32 = false;
  for (int i = 0; i < got.completions_size(); ++i) {
    const auto& c = got.completions(i);
    EXPECT_EQ(std::vector<int32_t>(c.token_ids().begin(), c.token_ids().end()),
              bf16.completions[i].token_ids);
    EXPECT_EQ(std::vector<float>(c.logprobs().begin(), c.logprobs().end()),
              bf16.completions[i].logprobs);
    differs_from_fp32 =
        differs_from_fp32 || std::vector<float>(c.logprobs().begin(), c.logprobs().end()) !=
                                 fp32.completions[i].logprobs;
  }
  EXPECT_TRUE(differs_from_fp32);
}

TEST(RolloutWorker, Bf16FollowsTheLearnerNotTheWorkersOwnConfig) {
  FakeLearner fake;
  fake.rows = {kPromptRow};
  fake.config["bf16"] = false;
  FakeLearnerServer server(&fake);
  auto o = Options(server.address());
  o.config.bf16 = true;
  auto worker = MakeWorker(o);
  ASSERT_TRUE(worker->Run().ok());
  EXPECT_FALSE(worker->config().bf16);
  ASSERT_NE(worker->policy(), nullptr);
  EXPECT_EQ(worker->policy()->dtype(), at::kFloat);
  ExpectSameParameters(*worker->policy(), *fake.model);
}

TEST(RolloutWorker, ALearnerWhoseBf16ChangedAtReRegisterGetsItsWeightsFetchedAgainInBf16) {
  FakeLearner fake;
  fake.rows = {kPromptRow, kPromptRow};
  fake.leases_per_call = 1;
  fake.config["bf16"] = false;
  fake.after_push = [](FakeLearner& f) {  // under f.mu
    if (f.pushed.size() == 1) {
      f.config["bf16"] = true;
      f.unknown_worker = true;  // the next lease is NOT_FOUND: the worker registers again
    }
  };
  FakeLearnerServer server(&fake);
  auto worker = MakeWorker(Options(server.address()));
  ASSERT_TRUE(worker->Run().ok());
  ASSERT_NE(worker->policy(), nullptr);
  EXPECT_EQ(worker->policy()->dtype(), at::kBFloat16);
  std::lock_guard<std::mutex> lock(fake.mu);
  EXPECT_EQ(fake.register_calls, 2);
  EXPECT_EQ(fake.pushed.size(), 2u);
  EXPECT_EQ(fake.weights_served, (std::vector<int64_t>{1, 1}));  // the fp32 copy was dropped
}

TEST(RolloutWorker, CudaDeviceWithoutAGpuIsAnErrorNamingTheKey) {
  if (common::CudaAvailable()) GTEST_SKIP() << "a CUDA device is visible";
  auto o = Options("127.0.0.1:1");
  o.config.device = "cuda";
  auto worker = RolloutWorker::Create(o);
  ASSERT_FALSE(worker.ok());
  EXPECT_EQ(worker.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(worker.status().message().find("'device'"), std::string::npos)
      << worker.status().ToString();
}

// --- Pieces.

TEST(Backoff, GrowsExponentiallyWithinJitterAndStaysCapped) {
  BackoffOptions o;
  o.initial = milliseconds(100);
  o.max = milliseconds(1000);
  o.multiplier = 2.0;
  o.jitter = 0.2;
  Backoff b(o, /*seed=*/3);
  const double base[] = {100, 200, 400, 800, 1000, 1000, 1000};
  for (double want : base) {
    const double got = static_cast<double>(b.Next().count());
    EXPECT_GE(got, std::floor(std::min(1000.0, want * 0.8)));
    EXPECT_LE(got, std::min(1000.0, want * 1.2));
  }
  b.Reset();
  EXPECT_LE(b.Next().count(), 120);
}

TEST(MergeLearnerConfig, TakesGenerationKeysOnlyAndValidates) {
  common::GrpoConfig local;
  local.auth_token_file = "/tmp/token";
  local.temperature = 0.3;
  auto merged = MergeLearnerConfig(local, GenerationConfig().dump());
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ(merged->num_generations, kGenerations);
  EXPECT_EQ(merged->max_completion_length, 6);
  EXPECT_EQ(merged->temperature, 1.0);
  EXPECT_EQ(merged->reward_funcs, std::vector<std::string>{"length"});
  EXPECT_EQ(merged->seed, 7u);
  EXPECT_EQ(merged->auth_token_file, "/tmp/token");
  EXPECT_EQ(merged->learning_rate, local.learning_rate);

  // A whole GrpoConfig as the learner may send it round-trips.
  common::GrpoConfig learner;
  learner.num_generations = 4;
  learner.min_p = 0.05;
  learner.reward_funcs = {"accuracy", "remote:judge@host:50061"};
  learner.reward_weights = {1.0, 0.5};
  auto full = MergeLearnerConfig(local, learner.ToJson().dump());
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  EXPECT_EQ(full->reward_funcs, learner.reward_funcs);
  EXPECT_EQ(full->reward_weights, learner.reward_weights);
  EXPECT_EQ(full->min_p, learner.min_p);

  EXPECT_EQ(MergeLearnerConfig(local, R"({"num_generations": 1})").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MergeLearnerConfig(local, R"({"temperature": "hot"})").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MergeLearnerConfig(local, "[1]").status().code(), StatusCode::kInvalidArgument);
}

TEST(MergeLearnerConfig, DeviceStaysTheWorkersAndBf16IsTheLearners) {
  common::GrpoConfig local;
  local.device = "cpu";
  common::GrpoConfig learner;
  learner.device = "cuda:3";
  learner.bf16 = true;
  auto merged = MergeLearnerConfig(local, learner.ToJson().dump());
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ(merged->device, "cpu");
  EXPECT_TRUE(merged->bf16);
}

TEST(PromptText, PromptStringOrChatMlMessages) {
  EXPECT_EQ(common::PromptText(json::parse(kPromptRow)).value(), "Say hi.");
  EXPECT_EQ(common::PromptText(json::parse(kMessagesRow)).value(),
            "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(common::PromptText(json::parse(R"({"answer": 1})")).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(common::PromptText(json::parse(R"({"messages": [{"role": "user"}]})")).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(common::PromptText(json::parse("[]")).status().code(), StatusCode::kInvalidArgument);
}

// --- WeightAssembler.

v1::WeightChunk Chunk(const std::string& name, std::vector<int64_t> shape, int64_t offset,
                      const std::string& data, int64_t tensor_bytes, bool last,
                      int64_t version = 3) {
  v1::WeightChunk c;
  c.set_version(version);
  c.set_name(name);
  for (int64_t d : shape) c.add_shape(d);
  c.set_dtype("F32");
  c.set_offset(offset);
  c.set_data(data);
  c.set_tensor_bytes(tensor_bytes);
  c.set_last(last);
  return c;
}

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(WeightAssembler, ReassemblesInterleavedOutOfOrderChunks) {
  const std::string a = Bytes({1, 2, 3, 4}), b = Bytes({5, 6});
  WeightAssembler w;
  ASSERT_TRUE(w.Add(Chunk("a", {2, 2}, 8, a.substr(8), 16, false)).ok());
  ASSERT_TRUE(w.Add(Chunk("b", {2}, 0, b, 8, false)).ok());
  ASSERT_TRUE(w.Add(Chunk("a", {}, 0, a.substr(0, 8), 0, true)).ok());
  EXPECT_EQ(w.version(), 3);
  auto t = w.Finish();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].first, "a");
  EXPECT_TRUE(at::equal((*t)[0].second, at::tensor({1.f, 2.f, 3.f, 4.f}).reshape({2, 2})));
  EXPECT_TRUE(at::equal((*t)[1].second, at::tensor({5.f, 6.f})));
}

TEST(WeightAssembler, MalformedStreamsAreDataLoss) {
  const std::string a = Bytes({1, 2});
  {
    WeightAssembler w;  // tensor_bytes disagrees with the shape
    EXPECT_EQ(w.Add(Chunk("a", {3}, 0, a, 8, true)).code(), StatusCode::kDataLoss);
  }
  {
    WeightAssembler w;  // out of bounds
    EXPECT_EQ(w.Add(Chunk("a", {2}, 4, a, 8, true)).code(), StatusCode::kDataLoss);
  }
  {
    WeightAssembler w;  // version changes
    ASSERT_TRUE(w.Add(Chunk("a", {2}, 0, a.substr(0, 4), 8, false)).ok());
    EXPECT_EQ(w.Add(Chunk("a", {2}, 4, a.substr(4), 8, true, 4)).code(), StatusCode::kDataLoss);
  }
  {
    WeightAssembler w;  // no last chunk
    ASSERT_TRUE(w.Add(Chunk("a", {2}, 0, a, 8, false)).ok());
    EXPECT_EQ(w.Finish().status().code(), StatusCode::kDataLoss);
  }
  {
    WeightAssembler w;  // last came but a tensor is incomplete
    ASSERT_TRUE(w.Add(Chunk("a", {2}, 0, a.substr(0, 4), 8, true)).ok());
    EXPECT_EQ(w.Finish().status().code(), StatusCode::kDataLoss);
  }
}

}  // namespace
}  // namespace grpo::services
