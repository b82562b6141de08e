// LearnerServer as workers and clients see it: an in-process server on a free port, called
// through a real gRPC stub.
#include "services/learner_service.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <thread>

#include "common/model/device.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "services/auth.h"
#include "services/convert.h"
#include "tests/services/learner_fixture.h"
#include "tests/services/learner_test_util.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using testing::kCallTimeout;
using testing::LearnerServiceTest;
using testing::TinyConfig;

// Job.state on the wire is the JobState enum: each learner state has its own value, and a value
// the learner did not set (or a newer build's) reads as no state, never as a wrong one.
TEST(JobStateWire, EachStateHasItsEnumValueAndUnknownValuesReadAsNone) {
  const std::pair<learner::JobState, v1::JobState> pairs[] = {
      {learner::JobState::kWaitingForData, v1::JOB_STATE_WAITING_FOR_DATA},
      {learner::JobState::kRunning, v1::JOB_STATE_RUNNING},
      {learner::JobState::kDone, v1::JOB_STATE_DONE},
      {learner::JobState::kCancelled, v1::JOB_STATE_CANCELLED},
      {learner::JobState::kFailed, v1::JOB_STATE_FAILED},
  };
  for (const auto& [domain, wire] : pairs) {
    EXPECT_EQ(ToProto(domain), wire);
    EXPECT_EQ(FromProto(wire), domain);
  }
  EXPECT_EQ(FromProto(v1::JOB_STATE_UNSPECIFIED), std::nullopt);
  EXPECT_EQ(FromProto(static_cast<v1::JobState>(42)), std::nullopt);
  EXPECT_EQ(JobStateName(v1::JOB_STATE_WAITING_FOR_DATA), "waiting_for_data");
  EXPECT_EQ(JobStateName(v1::JOB_STATE_UNSPECIFIED), "unspecified");
  // A Job message from an older learner (field 1, a string) carries no state here.
  v1::Job old;
  old.ParseFromString(std::string("\x0a\x04done", 6));
  EXPECT_EQ(old.state(), v1::JOB_STATE_UNSPECIFIED);
}

// A multi-turn completion's env_mask crosses the wire as one byte per token, both ways; a
// single-turn one sends none (the field is empty, not a byte of 1s per token).
TEST(RolloutGroupWire, EnvMaskRoundTripsAsOneBytePerTokenAndEmptyStaysEmpty) {
  common::RolloutGroup g;
  g.prompt_id = "q";
  g.prompt_ids = {1, 2};
  common::Completion multi;
  multi.token_ids = {5, 6, 30, 31, 7};
  multi.env_mask = {1, 1, 0, 0, 1};
  common::Completion single;
  single.token_ids = {5, 6};
  g.completions = {multi, single};
  v1::RolloutGroup wire;
  ToProto(g, &wire);
  EXPECT_EQ(wire.completions(0).env_mask(), std::string("\x01\x01\x00\x00\x01", 5));
  EXPECT_TRUE(wire.completions(1).env_mask().empty());
  v1::RolloutGroup parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire.SerializeAsString()));
  const common::RolloutGroup back = FromProto(parsed);
  ASSERT_EQ(back.completions.size(), 2u);
  EXPECT_EQ(back.completions[0].env_mask, multi.env_mask);
  EXPECT_TRUE(back.completions[1].env_mask.empty());
}

// A group the worker could not generate crosses the wire as its lease, prompt and failure, with
// no completions; a group that did not fail sends no failure field.
TEST(RolloutGroupWire, AFailedGroupIsItsLeaseAndItsFailure) {
  common::RolloutGroup failed;
  failed.lease_id = "lease-7";
  failed.prompt_id = "ds-1:3";
  failed.policy_incarnation = "inc";
  failed.failure = "UNAVAILABLE: episode 0 of turns: reset: environment down";
  v1::RolloutGroup wire;
  ToProto(failed, &wire);
  v1::RolloutGroup parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire.SerializeAsString()));
  const common::RolloutGroup back = FromProto(parsed);
  EXPECT_EQ(back.lease_id, "lease-7");
  EXPECT_EQ(back.prompt_id, "ds-1:3");
  EXPECT_EQ(back.failure, failed.failure);
  EXPECT_TRUE(back.completions.empty());
  common::RolloutGroup ok = failed;
  ok.failure.clear();
  v1::RolloutGroup ok_wire;
  ToProto(ok, &ok_wire);
  // Field 8 (failure) absent: the bytes of lease, prompt and incarnation alone.
  EXPECT_EQ(ok_wire.ByteSizeLong(), (2 + 7) + (2 + 6) + (2 + 3));
}

// A tool episode's counts and per-token versions cross the wire; a completion without them sends
// none of the fields.
TEST(RolloutGroupWire, ToolCountsRoundTrip) {
  common::RolloutGroup g;
  g.prompt_ids = {1};
  common::Completion tools;
  tools.token_ids = {5};
  tools.uses_tools = true;
  tools.tool_calls = 4;
  tools.tool_call_failures = 1;
  tools.token_versions = {7};
  common::Completion plain;
  plain.token_ids = {6};
  g.completions = {tools, plain};
  v1::RolloutGroup wire;
  ToProto(g, &wire);
  v1::RolloutGroup parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire.SerializeAsString()));
  const common::RolloutGroup back = FromProto(parsed);
  ASSERT_EQ(back.completions.size(), 2u);
  EXPECT_TRUE(back.completions[0].uses_tools);
  EXPECT_EQ(back.completions[0].tool_calls, 4);
  EXPECT_EQ(back.completions[0].tool_call_failures, 1);
  EXPECT_EQ(back.completions[0].token_versions, std::vector<int64_t>{7});
  EXPECT_TRUE(back.completions[1].token_versions.empty());
  EXPECT_FALSE(back.completions[1].uses_tools);
  EXPECT_EQ(back.completions[1].tool_calls, 0);
  EXPECT_EQ(wire.completions(1).ByteSizeLong(), 3u);  // token_ids alone: tag, length, one id
}

// Every gRPC code crosses the boundary as itself, both ways, with its message; a number outside
// gRPC's 0..16 (a newer peer, a broken proxy) reads as UNKNOWN, never as a value outside the enum.
TEST(StatusWire, EveryGrpcCodeRoundTripsAndAnUnknownNumberReadsAsUnknown) {
  for (int n = 1; n <= 16; ++n) {
    const Status ours = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(n), "m"));
    EXPECT_EQ(static_cast<int>(ours.code()), n);
    EXPECT_EQ(ours.message(), "m");
    const grpc::Status back = ToGrpcStatus(ours);
    EXPECT_EQ(static_cast<int>(back.error_code()), n);
    EXPECT_EQ(back.error_message(), "m");
  }
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  EXPECT_TRUE(ToGrpcStatus(Status::OK()).ok());
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNKNOWN, "proxy")).code(),
            StatusCode::kUnknown);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "403")).code(),
            StatusCode::kPermissionDenied);
  // Numbers inside the enum's range of values ([-32, 31]: no fixed underlying type), so that the
  // cast itself is defined (42 would be undefined behaviour before our code sees it: UBSan).
  for (int n : {17, 31, -1}) {
    const Status s = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(n), "odd"));
    EXPECT_EQ(s.code(), StatusCode::kUnknown) << n;
    EXPECT_EQ(s.message(), "odd (gRPC status code " + std::to_string(n) + ")");
    EXPECT_EQ(s.ToString().rfind("UNKNOWN: ", 0), 0u) << s.ToString();
  }
  EXPECT_EQ(ToGrpcStatus(Status(static_cast<StatusCode>(99), "bad cast")).error_code(),
            grpc::StatusCode::UNKNOWN);
}

TEST_F(LearnerServiceTest, RefusesCallsWithoutTheTokenAndAcceptsThemWithIt) {
  const fs::path token_file = dir_ / "token";
  std::ofstream(token_file) << "s3cret\n";
  config_.auth_token_file = token_file.string();
  StartServer();

  v1::Job job;
  token_ = "";
  grpc::Status s = stub_->GetJob(Ctx().get(), v1::GetJobRequest(), &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  token_ = "wrong";
  s = stub_->GetJob(Ctx().get(), v1::GetJobRequest(), &job);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  token_ = "s3cret";
  s = stub_->GetJob(Ctx().get(), v1::GetJobRequest(), &job);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(job.state(), v1::JOB_STATE_WAITING_FOR_DATA);
}

// TLS with a certificate made here by openssl: a client that verifies against it gets through,
// a plaintext client and a client trusting another CA do not.
TEST_F(LearnerServiceTest, ServesTlsToClientsThatTrustItsCertificate) {
  auto make_cert = [&](const std::string& name) {
    const std::string cmd =
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost"
        " -addext subjectAltName=DNS:localhost -keyout " +
        (dir_ / (name + ".key")).string() + " -out " + (dir_ / (name + ".pem")).string() +
        " 2>/dev/null";
    return std::system(cmd.c_str()) == 0;
  };
  if (std::system("command -v openssl >/dev/null") != 0) GTEST_SKIP() << "openssl not installed";
  ASSERT_TRUE(make_cert("server"));
  ASSERT_TRUE(make_cert("other"));
  config_.tls_cert_file = (dir_ / "server.pem").string();
  config_.tls_key_file = (dir_ / "server.key").string();
  StartServer();
  const std::string address = "localhost:" + std::to_string(server_->port());

  auto get_job = [&](const std::shared_ptr<grpc::Channel>& channel) {
    v1::Job job;
    grpc::Status s = v1::LearnerService::NewStub(channel)->GetJob(Ctx(milliseconds(3000)).get(),
                                                                  v1::GetJobRequest(), &job);
    return std::make_pair(s, job);
  };
  auto ca = ReadPemFile((dir_ / "server.pem").string(), "tls_ca_file");
  ASSERT_TRUE(ca.ok()) << ca.status().ToString();
  auto [ok_status, job] = get_job(MakeChannel(address, *ca));
  EXPECT_TRUE(ok_status.ok()) << ok_status.error_message();
  EXPECT_EQ(job.state(), v1::JOB_STATE_WAITING_FOR_DATA);

  EXPECT_FALSE(get_job(MakeChannel(address)).first.ok());  // plaintext
  auto other = ReadPemFile((dir_ / "other.pem").string(), "tls_ca_file");
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(get_job(MakeChannel(address, *other)).first.ok());  // untrusted certificate
}

// Issue 12 item 8: with a token, plaintext and TLS servers alike refuse a call without it in
// gRPC's transport (TokenAuthProcessor: its message says so), before the handler reads the body.
TEST_F(LearnerServiceTest, TokenIsCheckedInTheTransportWithAndWithoutTls) {
  if (std::system("command -v openssl >/dev/null") != 0) GTEST_SKIP() << "openssl not installed";
  const std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost"
      " -addext subjectAltName=DNS:localhost -keyout " +
      (dir_ / "server.key").string() + " -out " + (dir_ / "server.pem").string() + " 2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ofstream(dir_ / "token") << "s3cret\n";
  config_.auth_token_file = (dir_ / "token").string();
  for (const bool tls : {false, true}) {
    SCOPED_TRACE(tls ? "TLS" : "plaintext");
    config_.tls_cert_file = tls ? (dir_ / "server.pem").string() : "";
    config_.tls_key_file = tls ? (dir_ / "server.key").string() : "";
    server_.reset();
    StartServer();
    std::string ca;
    if (tls) {
      auto pem = ReadPemFile((dir_ / "server.pem").string(), "tls_ca_file");
      ASSERT_TRUE(pem.ok());
      ca = *pem;
    }
    auto stub = v1::LearnerService::NewStub(
        MakeChannel("localhost:" + std::to_string(server_->port()), ca));
    v1::Job job;
    for (const std::string token : {"", "wrong"}) {
      token_ = token;
      const grpc::Status s = stub->GetJob(Ctx().get(), v1::GetJobRequest(), &job);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
      EXPECT_NE(s.error_message().find(kRefusedBeforeTheBody), std::string::npos)
          << s.error_message();
    }
    token_ = "s3cret";
    const grpc::Status ok = stub->GetJob(Ctx().get(), v1::GetJobRequest(), &job);
    EXPECT_TRUE(ok.ok()) << ok.error_message();
  }
}

TEST(LearnerTlsConfig, CertWithoutKeyAndMissingFilesAreNamed) {
  common::GrpoConfig c;
  c.tls_cert_file = "/nonexistent/cert.pem";
  const Status v = c.Validate();
  EXPECT_FALSE(v.ok());
  EXPECT_NE(v.message().find("tls_key_file"), std::string::npos) << v.message();
  c.tls_key_file = "/nonexistent/key.pem";
  ASSERT_TRUE(c.Validate().ok());
  auto creds = ServerCredentials(c);
  ASSERT_FALSE(creds.ok());
  EXPECT_EQ(creds.status().code(), StatusCode::kNotFound);
  EXPECT_NE(creds.status().message().find("tls_cert_file /nonexistent/cert.pem"), std::string::npos)
      << creds.status().message();
}

TEST_F(LearnerServiceTest, SubmitDatasetIsIdempotentUnderAKey) {
  StartServer();
  const auto first = Submit(Prompts(5), "key-1");
  EXPECT_EQ(first.prompt_count(), 5);
  EXPECT_TRUE(first.created());
  const auto again = Submit(Prompts(5), "key-1");
  EXPECT_EQ(again.dataset_id(), first.dataset_id());
  EXPECT_FALSE(again.created());
  EXPECT_EQ(server_->TEST_ledger().Counts()->queued, 5);
}

TEST_F(LearnerServiceTest, SubmitDatasetNamesTheBadLine) {
  StartServer();
  auto lines = Prompts(3);
  lines[2] = R"({"text": "no prompt field"})";
  grpc::Status s;
  Submit(lines, "", &s);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("line 3"), std::string::npos) << s.error_message();
  EXPECT_EQ(server_->TEST_ledger().Counts()->total(), 0);
}

TEST_F(LearnerServiceTest, LeasePromptsReturnsLeasesWithDeadlines) {
  StartServer();
  Submit(Prompts(3));
  const int64_t before = clock_ms_.load();
  const auto resp = Lease(2);
  const int64_t after = clock_ms_.load();
  ASSERT_EQ(resp.leases_size(), 2);
  EXPECT_FALSE(resp.job_done());
  for (const auto& l : resp.leases()) {
    EXPECT_EQ(l.lease_id().size(), 32u);
    EXPECT_GE(l.deadline_unix_ms(), before + 60'000);
    EXPECT_LE(l.deadline_unix_ms(), after + 60'000);
    EXPECT_NE(l.row_json().find("prompt"), std::string::npos);
    EXPECT_EQ(StateOf(l.prompt_id()), learner::PromptState::kLeased);
  }
  EXPECT_EQ(Lease(5).leases_size(), 1);
  const auto empty = Lease(5);
  EXPECT_EQ(empty.leases_size(), 0);
  EXPECT_GT(empty.retry_after_ms(), 0);
}

TEST_F(LearnerServiceTest, GroupUnderAValidLeaseIsAcceptedAndItsPromptTrained) {
  StartServer();
  Submit(Prompts(4));
  const auto lease = Lease(1).leases(0);
  const auto ack = Push({Group(lease)});
  EXPECT_EQ(ack.accepted(), 1);
  EXPECT_EQ(ack.rejected(), 0);
  EXPECT_EQ(StateOf(lease.prompt_id()), learner::PromptState::kTrained);
}

TEST_F(LearnerServiceTest, GroupUnderAnUnknownLeaseIsRefusedAndCounted) {
  StartServer();
  Submit(Prompts(2));
  auto lease = Lease(1).leases(0);
  v1::Lease forged = lease;
  forged.set_lease_id(std::string(32, 'f'));
  const auto ack = Push({Group(forged)});
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected(), 1);
  EXPECT_EQ(ack.rejected_by_reason().at("unknown_lease"), 1);
  EXPECT_EQ(StateOf(lease.prompt_id()), learner::PromptState::kLeased);
  EXPECT_EQ(server_->RefusedCounts().at("unknown_lease"), 1);
}

TEST_F(LearnerServiceTest, GroupUnderAnExpiredLeaseIsRefusedAndCounted) {
  config_.lease_seconds = 0.2;
  StartServer();
  Submit(Prompts(2));
  const auto lease = Lease(1).leases(0);
  clock_ms_ += 201;
  const auto ack = Push({Group(lease)});
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected_by_reason().at("expired_lease"), 1);
  EXPECT_EQ(server_->RefusedCounts().at("expired_lease"), 1);
  EXPECT_NE(StateOf(lease.prompt_id()), learner::PromptState::kTrained);
}

TEST_F(LearnerServiceTest, GroupWithANanRewardIsRejectedAndItsPromptRequeued) {
  StartServer();
  Submit(Prompts(2));
  const auto lease = Lease(1).leases(0);
  const auto ack = Push({Group(lease, std::nan(""))});
  EXPECT_EQ(ack.accepted(), 0);
  EXPECT_EQ(ack.rejected_by_reason().at("non_finite_reward"), 1);
  ASSERT_EQ(ack.messages_size(), 1);
  EXPECT_NE(ack.messages(0).find("non-finite reward"), std::string::npos) << ack.messages(0);
  // A worker bug, not a bad prompt: the prompt goes back to the queue.
  EXPECT_EQ(StateOf(lease.prompt_id()), learner::PromptState::kQueued);
}

TEST_F(LearnerServiceTest, StaleGroupIsRefusedAndItsPromptRequeued) {
  config_.max_staleness = 0;  // synchronous: a group must come from the current policy
  StartServer();
  Submit(Prompts(4));
  const auto leases = Lease(2);  // one generation batch: all that max_staleness 0 lets out
  ASSERT_EQ(leases.leases_size(), 2);
  ASSERT_EQ(Push({Group(leases.leases(0)), Group(leases.leases(1))}).accepted(), 2);
  ASSERT_TRUE(WaitFor([&] { return server_->published_version() >= 1; }));
  const auto more = Lease(1);
  ASSERT_EQ(more.leases_size(), 1);
  auto old = Group(more.leases(0));
  old.set_policy_version(0);  // max_staleness 0, learner at 1
  const auto ack = Push({old});
  EXPECT_EQ(ack.rejected_by_reason().at("stale"), 1);
  EXPECT_EQ(StateOf(more.leases(0).prompt_id()), learner::PromptState::kQueued);
}

// Leases go out only as far as max_staleness lets their groups be trained: with 0, one
// generation batch (2 groups here) until it is trained; with 1 (one version per batch), two.
TEST_F(LearnerServiceTest, LeasesStopWhereTheirGroupsWouldBeTooStaleAndResumeAfterTraining) {
  config_.max_staleness = 0;
  StartServer();
  Submit(Prompts(8));
  auto lease_within = [&](int n, milliseconds deadline) { return Lease(n, "w1", deadline); };
  const auto first = lease_within(5, milliseconds(10'000));
  ASSERT_EQ(first.leases_size(), 2) << "one generation batch of 2 groups";
  // Nothing more until that batch is trained: the call waits (long poll) and returns empty.
  const auto held = lease_within(1, milliseconds(1500));
  EXPECT_EQ(held.leases_size(), 0);
  EXPECT_GT(held.retry_after_ms(), 0);
  ASSERT_EQ(Push({Group(first.leases(0)), Group(first.leases(1))}).accepted(), 2);
  // A lease asked for while the batch trains is answered once it has been (version 1).
  const auto next = lease_within(5, milliseconds(10'000));
  EXPECT_EQ(next.leases_size(), 2);
  EXPECT_GE(server_->published_version(), 1);
}

// A worker whose rows are decoding asks with answer_at_once: no long poll for budget, and no
// wait behind another worker's long poll (each would stall its decoding for up to 3 s).
TEST_F(LearnerServiceTest, AnAnswerAtOnceLeaseIsAnsweredAtOnceEvenBesideAnotherWorkersLongPoll) {
  config_.max_staleness = 0;
  StartServer();
  Submit(Prompts(8));
  RegisterWorker("w2");
  ASSERT_EQ(Lease(2).leases_size(), 2) << "one generation batch out: no budget now";
  const auto timed_lease = [&](const std::string& worker, bool at_once) {
    v1::LeasePromptsRequest req;
    req.set_worker_id(worker);
    req.set_max_prompts(1);
    req.set_answer_at_once(at_once);
    v1::LeasePromptsResponse resp;
    const auto t0 = std::chrono::steady_clock::now();
    const grpc::Status s = stub_->LeasePrompts(Ctx(milliseconds(10'000)).get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.leases_size(), 0);
    return std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - t0);
  };
  // Alone, then while w1 long-polls (its 3 s, kLeaseLongPoll).
  EXPECT_LT(timed_lease("w2", /*at_once=*/true), milliseconds(1500));
  auto polling = std::async(std::launch::async, [&] { return timed_lease("w1", false); });
  std::this_thread::sleep_for(milliseconds(300));  // w1 is in its long poll
  EXPECT_LT(timed_lease("w2", /*at_once=*/true), milliseconds(1500));
  EXPECT_GE(polling.get(), milliseconds(2500)) << "w1's call long-polled for budget";
}

TEST_F(LearnerServiceTest, WithMaxStalenessOneTwoBatchesMayBeOutAtOnce) {
  config_.max_staleness = 1;
  StartServer();
  Submit(Prompts(8));
  EXPECT_EQ(Lease(8).leases_size(), 4);  // 2 batches x 2 groups
}

// Reassembles a GetWeights stream into name -> bytes, checking the chunk framing.
struct Reassembled {
  int64_t version = -1;
  std::vector<std::string> order;
  std::map<std::string, std::string> bytes;
  std::map<std::string, std::vector<int64_t>> shapes;
  int64_t chunks = 0;
  bool last = false;
};

Reassembled ReadWeights(grpc::ClientReader<v1::WeightChunk>* reader, int64_t max_chunk) {
  Reassembled r;
  v1::WeightChunk c;
  while (reader->Read(&c)) {
    EXPECT_FALSE(r.last) << "chunk after last";
    EXPECT_LE(static_cast<int64_t>(c.data().size()), max_chunk);
    EXPECT_EQ(c.dtype(), "F32");
    if (r.version < 0) r.version = c.version();
    EXPECT_EQ(c.version(), r.version);
    auto& buf = r.bytes[c.name()];
    if (buf.empty() && c.offset() == 0 && r.shapes.count(c.name()) == 0) {
      r.order.push_back(c.name());
      r.shapes[c.name()] = {c.shape().begin(), c.shape().end()};
    }
    EXPECT_EQ(c.offset(), static_cast<int64_t>(buf.size()));
    buf += c.data();
    r.last = c.last();
    ++r.chunks;
  }
  return r;
}

// The same with either weight_publish: the snapshot's bytes, or the policy's streamed by the
// training thread.
class LearnerServicePublish : public LearnerServiceTest,
                              public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    LearnerServiceTest::SetUp();
    config_.weight_publish = GetParam();
  }
};

TEST_P(LearnerServicePublish, AGenerationBatchTrainsAStepAndGetWeightsStreamsTheNewPolicy) {
  StartServer();
  Submit(Prompts(4));
  EXPECT_EQ(server_->published_version(), 0);
  const auto leases = Lease(2);
  const auto ack = Push({Group(leases.leases(0), 1.0, 0.0), Group(leases.leases(1), 0.0, 1.0)});
  ASSERT_EQ(ack.accepted(), 2);
  ASSERT_TRUE(WaitFor([&] { return server_->published_version() >= 1; }));

  v1::GetWeightsRequest req;
  req.set_min_version(1);
  req.set_chunk_bytes(10'000);  // several chunks per embedding matrix
  auto ctx = Ctx();
  auto reader = stub_->GetWeights(ctx.get(), req);
  Reassembled r = ReadWeights(reader.get(), 10'000);
  grpc::Status s = reader->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(r.version, 1);
  EXPECT_TRUE(r.last);
  const auto params = server_->policy().NamedParameters();
  ASSERT_EQ(r.order.size(), params.size());
  EXPECT_GT(r.chunks, static_cast<int64_t>(params.size()));
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, t] = params[i];
    EXPECT_EQ(r.order[i], name);
    const at::Tensor want = t.detach().contiguous();
    EXPECT_EQ(r.shapes[name], std::vector<int64_t>(want.sizes().begin(), want.sizes().end()));
    ASSERT_EQ(r.bytes[name].size(), want.nbytes()) << name;
    EXPECT_EQ(std::memcmp(r.bytes[name].data(), want.data_ptr(), want.nbytes()), 0) << name;
  }
  v1::Job job;
  ASSERT_TRUE(stub_->GetJob(Ctx().get(), v1::GetJobRequest(), &job).ok());
  EXPECT_EQ(job.global_step(), 1);
  EXPECT_EQ(job.policy_version(), 1);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.prompts().trained(), 2);
  EXPECT_TRUE(job.last_metrics().count("loss"));
}

INSTANTIATE_TEST_SUITE_P(WeightPublish, LearnerServicePublish,
                         ::testing::Values("snapshot", "stream"));

// weight_publish stream: the training thread writes each chunk, so a client that stops reading
// would hold training up. Its call is cancelled after weight_sync_timeout_seconds and a reader
// beside it gets the whole version (the tiny model's 0.5 MB are far more than the flow-control
// window a client that reads nothing lets through).
TEST_F(LearnerServiceTest, AStreamingLearnerCancelsAGetWeightsClientThatStopsReading) {
  config_.weight_publish = "stream";
  config_.weight_sync_timeout_seconds = 1;
  StartServer();
  v1::GetWeightsRequest req;
  req.set_min_version(0);
  req.set_chunk_bytes(4096);
  // A client whose transport takes no more than it is asked for: no BDP probing, a small
  // lookahead, so a client that reads nothing holds the server's writes.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto tight = v1::LearnerService::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials(), args));
  auto stalled_ctx = Ctx();
  auto stalled = tight->GetWeights(stalled_ctx.get(), req);
  v1::WeightChunk first;
  ASSERT_TRUE(stalled->Read(&first));  // the stream has begun; then this client reads no more
  const auto t0 = std::chrono::steady_clock::now();
  auto ctx = Ctx();
  auto reader = stub_->GetWeights(ctx.get(), req);
  Reassembled r = ReadWeights(reader.get(), 4096);
  ASSERT_TRUE(reader->Finish().ok());
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.version, 0);
  EXPECT_EQ(r.order.size(), server_->policy().NamedParameters().size());
  EXPECT_LT(waited, 10.0) << "the stalled client held the stream up";
  v1::WeightChunk c;
  while (stalled->Read(&c)) {
  }
  const grpc::Status s = stalled->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
}

class LearnerServiceBf16Test : public LearnerServiceTest {
 protected:
  // Starts the server on config_ and trains one step on the same two groups; returns the step's
  // metrics (Job.last_metrics) and the published version-1 weights.
  std::pair<std::map<std::string, double>, Reassembled> TrainOneStep() {
    StartServer();
    Submit(Prompts(4));
    const auto leases = Lease(2);
    EXPECT_EQ(
        Push({Group(leases.leases(0), 1.0, 0.0), Group(leases.leases(1), 0.0, 1.0)}).accepted(), 2);
    EXPECT_TRUE(WaitFor([&] { return server_->published_version() >= 1; }));
    v1::GetWeightsRequest req;
    req.set_min_version(1);
    auto ctx = Ctx();
    auto reader = stub_->GetWeights(ctx.get(), req);
    Reassembled r = ReadWeights(reader.get(), kDefaultWeightChunkBytes);  // checks F32 chunks
    EXPECT_TRUE(reader->Finish().ok());
    v1::Job job;
    EXPECT_TRUE(stub_->GetJob(Ctx().get(), v1::GetJobRequest(), &job).ok());
    return {{job.last_metrics().begin(), job.last_metrics().end()}, std::move(r)};
  }
};

TEST_F(LearnerServiceBf16Test, Bf16TrainsAStepInBf16AndPublishesFp32MasterWeights) {
  config_.output_dir = (dir_ / "fp32").string();
  const auto [fp32_metrics, fp32_weights] = TrainOneStep();
  server_.reset();
  config_.output_dir = (dir_ / "bf16").string();
  config_.bf16 = true;
  const auto [metrics, weights] = TrainOneStep();
  ASSERT_TRUE(metrics.count("entropy"));
  ASSERT_TRUE(fp32_metrics.count("entropy"));
  // Forward/backward ran in bf16: the same step on the same groups and weights reads other
  // log-probs than in fp32 (bf16 keeps 8 significant bits).
  EXPECT_NE(metrics.at("entropy"), fp32_metrics.at("entropy"));
  EXPECT_NE(metrics.at("logprob_mismatch/mean"), fp32_metrics.at("logprob_mismatch/mean"));

  // The master stays fp32 on the configured device (cpu here) and GetWeights streams it (F32
  // chunks, checked by ReadWeights) bit for bit; the step moved it off the initial weights.
  const common::Model& master = server_->policy();
  EXPECT_EQ(master.dtype(), at::kFloat);
  EXPECT_TRUE(master.device().is_cpu());
  EXPECT_EQ(weights.version, 1);
  const auto initial = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7).value();
  const auto params = master.NamedParameters(), init = initial->NamedParameters();
  ASSERT_EQ(weights.order.size(), params.size());
  bool moved = false;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, t] = params[i];
    const at::Tensor want = t.detach().contiguous();
    ASSERT_EQ(weights.bytes.at(name).size(), want.numel() * sizeof(float)) << name;
    EXPECT_EQ(std::memcmp(weights.bytes.at(name).data(), want.data_ptr(), want.nbytes()), 0)
        << name;
    moved = moved || !at::equal(want, init[i].second);
  }
  EXPECT_TRUE(moved);
}

TEST_F(LearnerServiceTest, CudaDeviceWithoutAGpuIsAnErrorNamingTheKey) {
  if (common::CudaAvailable()) GTEST_SKIP() << "a CUDA device is visible";
  config_.device = "cuda";
  auto model = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
  ASSERT_TRUE(model.ok());
  auto server = LearnerServer::Create(config_, std::move(model).value(), nullptr, options_);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("'device'"), std::string::npos)
      << server.status().ToString();
}

TEST_F(LearnerServiceTest, GetWeightsForAnUnpublishedVersionTimesOutAtTheDeadline) {
  StartServer();
  v1::GetWeightsRequest req;
  req.set_min_version(5);
  auto ctx = Ctx(milliseconds(300));
  auto reader = stub_->GetWeights(ctx.get(), req);
  v1::WeightChunk c;
  EXPECT_FALSE(reader->Read(&c));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(LearnerServiceTest, WatchJobReceivesAStepEventWithTrlMetrics) {
  StartServer();
  Submit(Prompts(4));
  auto ctx = Ctx();
  auto reader = stub_->WatchJob(ctx.get(), v1::WatchJobRequest());
  v1::JobEvent first;
  ASSERT_TRUE(reader->Read(&first));  // the current status, at once
  EXPECT_TRUE(first.metrics().empty());

  const auto leases = Lease(2);
  ASSERT_EQ(Push({Group(leases.leases(0)), Group(leases.leases(1))}).accepted(), 2);
  v1::JobEvent e;
  bool got_step = false;
  while (!got_step && reader->Read(&e)) got_step = !e.metrics().empty();
  ASSERT_TRUE(got_step);
  EXPECT_EQ(e.step(), 1);
  EXPECT_EQ(e.job().global_step(), 1);
  for (const char* name : {"loss", "reward", "reward_std", "grad_norm", "learning_rate",
                           "completions/mean_length", "entropy"}) {
    EXPECT_TRUE(e.metrics().count(name)) << name;
  }
  EXPECT_DOUBLE_EQ(e.metrics().at("reward"), 0.5);
  ctx->TryCancel();
}

TEST_F(LearnerServiceTest, ReachingMaxStepsEndsTheJobForWorkersAndWatchers) {
  config_.max_steps = 1;
  StartServer();
  Submit(Prompts(4));
  v1::RegisterRequest reg;
  v1::RegisterResponse worker;
  ASSERT_TRUE(stub_->Register(Ctx().get(), reg, &worker).ok());
  const auto leases = Lease(2);
  ASSERT_EQ(Push({Group(leases.leases(0)), Group(leases.leases(1))}).accepted(), 2);
  ASSERT_TRUE(server_->WaitForJobEnd(milliseconds(8000)));
  EXPECT_EQ(server_->job_state(), JobState::kDone);
  EXPECT_TRUE(Lease(1).job_done());
  v1::HeartbeatRequest hb;
  hb.set_worker_id(worker.worker_id());
  v1::HeartbeatResponse hb_resp;
  ASSERT_TRUE(stub_->Heartbeat(Ctx().get(), hb, &hb_resp).ok());
  EXPECT_TRUE(hb_resp.shutdown());
  EXPECT_EQ(hb_resp.policy_version(), 1);
  EXPECT_TRUE(fs::exists(dir_ / "checkpoint-1" / "model.safetensors"));
  // A watcher of an ended job gets its state and the stream ends.
  auto ctx = Ctx();
  auto reader = stub_->WatchJob(ctx.get(), v1::WatchJobRequest());
  v1::JobEvent e;
  ASSERT_TRUE(reader->Read(&e));
  EXPECT_EQ(e.job().state(), v1::JOB_STATE_DONE);
  EXPECT_FALSE(reader->Read(&e));
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(LearnerServiceTest, CancelJobStopsLeasing) {
  StartServer();
  Submit(Prompts(4));
  v1::CancelJobRequest req;
  req.set_reason("operator said so");
  v1::Job job;
  ASSERT_TRUE(stub_->CancelJob(Ctx().get(), req, &job).ok());
  EXPECT_EQ(job.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(job.message(), "operator said so");
  const auto resp = Lease(1);
  EXPECT_TRUE(resp.job_done());
  EXPECT_EQ(resp.leases_size(), 0);
}

TEST_F(LearnerServiceTest, RegisterAssignsRanksAfterTheLearnerAndBumpsTheEpoch) {
  StartServer();
  v1::RegisterRequest req;
  req.set_hostname("h");
  v1::RegisterResponse a, b, a_again;
  ASSERT_TRUE(stub_->Register(Ctx().get(), req, &a).ok());
  ASSERT_TRUE(stub_->Register(Ctx().get(), req, &b).ok());
  EXPECT_EQ(a.rank(), 1);
  EXPECT_EQ(b.rank(), 2);
  EXPECT_EQ(b.world_size(), 3);
  EXPECT_GT(b.group_epoch(), a.group_epoch());
  EXPECT_NE(a.worker_id(), b.worker_id());
  EXPECT_NE(a.model_config_json().find("\"vocab_size\":259"), std::string::npos);
  EXPECT_NE(a.config_json().find("\"num_generations\":2"), std::string::npos);
  req.set_worker_id(a.worker_id());
  ASSERT_TRUE(stub_->Register(Ctx().get(), req, &a_again).ok());
  EXPECT_EQ(a_again.rank(), 1);
  EXPECT_EQ(a_again.group_epoch(), b.group_epoch());

  v1::HeartbeatRequest hb;
  hb.set_worker_id("nobody");
  v1::HeartbeatResponse hb_resp;
  EXPECT_EQ(stub_->Heartbeat(Ctx().get(), hb, &hb_resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(LearnerServiceTest, AWorkerThatStopsHeartbeatingIsDroppedAndRanksCompact) {
  options_.heartbeat_interval = milliseconds(40);  // dropped after 5 missed: 200 ms
  StartServer();
  v1::RegisterRequest req;
  v1::RegisterResponse a, b;
  ASSERT_TRUE(stub_->Register(Ctx().get(), req, &a).ok());
  ASSERT_TRUE(stub_->Register(Ctx().get(), req, &b).ok());
  ASSERT_EQ(b.rank(), 2);
  EXPECT_EQ(a.heartbeat_interval_ms(), 40);
  v1::HeartbeatRequest hb;
  hb.set_worker_id(b.worker_id());
  v1::HeartbeatResponse resp;
  // Only b heartbeats.
  ASSERT_TRUE(WaitFor([&] {
    EXPECT_TRUE(stub_->Heartbeat(Ctx().get(), hb, &resp).ok());
    return resp.group_epoch() > b.group_epoch();
  }));
  hb.set_worker_id(a.worker_id());
  EXPECT_EQ(stub_->Heartbeat(Ctx().get(), hb, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  req.set_worker_id(b.worker_id());
  v1::RegisterResponse b_again;
  ASSERT_TRUE(stub_->Register(Ctx().get(), req, &b_again).ok());
  EXPECT_EQ(b_again.rank(), 1);
  EXPECT_EQ(b_again.world_size(), 2);
}

TEST_F(LearnerServiceTest, StoreSetGetAddAndGetWaitsUntilItsTimeout) {
  StartServer();
  const int64_t epoch = server_->group_epoch();
  auto call = [&](v1::StoreRequest req, v1::StoreResponse* resp, milliseconds t = kCallTimeout) {
    req.set_group_epoch(epoch);
    return stub_->Store(Ctx(t).get(), req, resp);
  };
  v1::StoreRequest set;
  set.set_op(v1::StoreRequest::SET);
  set.set_key("rank0/addr");
  set.set_value(std::string("10.0.0.1:29500\0x", 16));
  v1::StoreResponse resp;
  ASSERT_TRUE(call(set, &resp).ok());

  v1::StoreRequest get;
  get.set_op(v1::StoreRequest::GET);
  get.set_key("rank0/addr");
  ASSERT_TRUE(call(get, &resp).ok());
  EXPECT_EQ(resp.value(), set.value());

  v1::StoreRequest add;
  add.set_op(v1::StoreRequest::ADD);
  add.set_key("arrived");
  add.set_add(1);
  ASSERT_TRUE(call(add, &resp).ok());
  EXPECT_EQ(resp.number(), 1);
  add.set_add(2);
  ASSERT_TRUE(call(add, &resp).ok());
  EXPECT_EQ(resp.number(), 3);

  v1::StoreRequest num;
  num.set_op(v1::StoreRequest::NUM_KEYS);
  ASSERT_TRUE(call(num, &resp).ok());
  EXPECT_EQ(resp.number(), 2);

  // A GET for a missing key waits for it: set from another thread while waiting.
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    v1::StoreRequest late = set;
    late.set_key("late");
    v1::StoreResponse r;
    EXPECT_TRUE(call(late, &r).ok());
  });
  get.set_key("late");
  get.set_timeout_ms(5000);
  ASSERT_TRUE(call(get, &resp).ok());
  setter.join();

  get.set_key("never");
  get.set_timeout_ms(200);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(call(get, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(190));

  v1::StoreRequest cas;
  cas.set_op(v1::StoreRequest::COMPARE_SET);
  cas.set_key("arrived");
  cas.set_expected("3");
  cas.set_value("0");
  ASSERT_TRUE(call(cas, &resp).ok());
  EXPECT_TRUE(resp.ok());
  cas.set_expected("3");
  ASSERT_TRUE(call(cas, &resp).ok());
  EXPECT_FALSE(resp.ok());
  EXPECT_EQ(resp.value(), "0");

  v1::StoreRequest check;
  check.set_op(v1::StoreRequest::CHECK);
  check.add_keys("arrived");
  check.add_keys("late");
  ASSERT_TRUE(call(check, &resp).ok());
  EXPECT_TRUE(resp.ok());
  v1::StoreRequest del;
  del.set_op(v1::StoreRequest::DELETE);
  del.set_key("late");
  ASSERT_TRUE(call(del, &resp).ok());
  EXPECT_TRUE(resp.ok());
  ASSERT_TRUE(call(check, &resp).ok());
  EXPECT_FALSE(resp.ok());

  v1::StoreRequest stale = set;
  stale.set_group_epoch(epoch + 7);
  EXPECT_EQ(stub_->Store(Ctx().get(), stale, &resp).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(LearnerServiceTest, HealthCheckReportsServing) {
  StartServer();
  grpc::GenericStub generic(channel_);
  for (const std::string service : {"", "grpo.v1.LearnerService"}) {
    // grpc.health.v1.HealthCheckRequest{service = 1}, encoded by hand.
    std::string request;
    if (!service.empty()) {
      request.push_back(0x0a);
      request.push_back(static_cast<char>(service.size()));
      request += service;
    }
    grpc::Slice slice(request);
    grpc::ByteBuffer req(&slice, 1), resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
    std::promise<grpc::Status> done;
    generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                      [&](grpc::Status s) { done.set_value(s); });
    grpc::Status s = done.get_future().get();
    ASSERT_TRUE(s.ok()) << s.error_message();
    grpc::Slice out;
    ASSERT_TRUE(resp.DumpToSingleSlice(&out).ok());
    // HealthCheckResponse{status = 1 (SERVING)}.
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(out.begin()), out.size()),
              std::string("\x08\x01", 2))
        << service;
  }
}

// A second learner on a port the first holds must fail to listen, not share the port: gRPC's
// default SO_REUSEPORT would let it start, and the kernel would split the workers between them.
TEST_F(LearnerServiceTest, ASecondLearnerOnAHeldPortFailsToListen) {
  StartServer();
  common::GrpoConfig second = TinyConfig(dir_ / "second");
  second.grpc_port = static_cast<int>(server_->port());
  auto model = common::Model::InitRandom(*common::ModelConfigPreset("tiny"), 7);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto other = LearnerServer::Create(second, std::move(model).value(), nullptr, {});
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  const Status s = (*other)->Start();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("cannot listen on 0.0.0.0:" + std::to_string(server_->port())),
            std::string::npos)
      << s.ToString();
  // The first still serves.
  EXPECT_EQ(Submit({R"({"prompt": "a"})"}).prompt_count(), 1);
}

TEST_F(LearnerServiceTest, RestartRequeuesPromptsAcceptedAfterTheLastCheckpoint) {
  config_.save_steps = 1;
  StartServer();
  Submit(Prompts(4));
  const auto leases = Lease(3);
  ASSERT_EQ(Push({Group(leases.leases(0)), Group(leases.leases(1))}).accepted(), 2);
  ASSERT_TRUE(WaitFor([&] { return fs::exists(dir_ / "checkpoint-1"); }));
  ASSERT_TRUE(WaitFor([&] { return fs::exists(dir_ / "latest"); }));
  clock_ms_ += 10;
  ASSERT_EQ(Push({Group(leases.leases(2))}).accepted(), 1);  // buffered, not trained
  EXPECT_EQ(StateOf(leases.leases(2).prompt_id()), learner::PromptState::kTrained);
  // A crash: no checkpoint on the way down.
  ASSERT_TRUE(server_->Stop(/*checkpoint=*/false).ok());
  server_.reset();

  StartServer();
  EXPECT_EQ(server_->published_version(), 1);
  EXPECT_EQ(StateOf(leases.leases(0).prompt_id()), learner::PromptState::kTrained);
  EXPECT_EQ(StateOf(leases.leases(1).prompt_id()), learner::PromptState::kTrained);
  EXPECT_EQ(StateOf(leases.leases(2).prompt_id()), learner::PromptState::kQueued);
}

}  // namespace
}  // namespace grpo::services
