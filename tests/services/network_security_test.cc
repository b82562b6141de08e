// Ending the job from outside (issue 12 items 8-10), with a real `grpo learner` and `grpo
// rollout` on loopback: unauthenticated calls are refused before their message is read (the
// learner's resident memory does not grow by it), reward servers get their own token and never
// the learner's, and the bind addresses follow the config, with a warning when auth is off on an
// open address. Every process started here is killed and reaped (tests/services/process_util.h).
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "grpo/v1/learner.grpc.pb.h"
#include "grpo/v1/reward.grpc.pb.h"
#include "tests/services/http_test_util.h"
#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace {

namespace fs = std::filesystem;
namespace v1 = grpo::v1;
using grpo::testing::Children;
using grpo::testing::GrpoBin;
using grpo::testing::LearnerCommand;
using grpo::testing::ReadFile;
using grpo::testing::Tail;
using grpo::testing::WaitUntil;
using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr const char* kLearnerToken = "learner-token-0123456789";
constexpr const char* kRewardToken = "reward-token-abcdefghij";
// The machine may be loaded: generous deadlines, never asserted on.
constexpr auto kStartTimeout = seconds(90);
constexpr auto kCallTimeout = seconds(60);
// One unauthenticated message: under the learner's 64 MiB receive limit, so only the token can
// refuse it.
constexpr size_t kBigMessageBytes = 60u << 20;

std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token,
                                         milliseconds timeout = kCallTimeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
  return ctx;
}

std::unique_ptr<v1::LearnerService::Stub> Stub(int port) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  return v1::LearnerService::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args));
}

// grpc.health.v1.Health/Check for the whole server, without a token; true when SERVING.
bool HealthServing(int port) {
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  grpc::Slice empty("");
  grpc::ByteBuffer req(&empty, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) { done.set_value(s); });
  if (!done.get_future().get().ok()) return false;
  grpc::Slice out;
  if (!resp.DumpToSingleSlice(&out).ok()) return false;
  return std::string(reinterpret_cast<const char*>(out.begin()), out.size()) ==
         std::string("\x08\x01", 2);
}

// A field of /proc/<pid>/status in KiB ("VmRSS", "VmHWM"); -1 when unreadable.
int64_t ProcStatusKib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

// Listening TCP sockets on `port` from /proc/net/tcp and /proc/net/tcp6, by local address:
// "127.0.0.1" (IPv4 or v4-mapped IPv6: gRPC binds IPv4 literals on a dual-stack socket),
// "0.0.0.0" (any IPv4), "::" (any IPv6 and IPv4), or the kernel's hex for anything else.
std::vector<std::string> ListeningAddresses(int port) {
  const auto name = [](const std::string& hex) -> std::string {
    const std::string mapped_prefix = "0000000000000000FFFF0000";
    if (hex == "0100007F" || hex == mapped_prefix + "0100007F") return "127.0.0.1";
    if (hex == "00000000") return "0.0.0.0";
    if (hex == std::string(32, '0')) return "::";
    return hex;
  };
  char hex_port[8];
  std::snprintf(hex_port, sizeof(hex_port), "%04X", port);
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream ss(line);
      std::string slot, local, remote, state;
      ss >> slot >> local >> remote >> state;
      const size_t colon = local.find(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == hex_port) {
        out.push_back(name(local.substr(0, colon)));
      }
    }
  }
  return out;
}

// This machine's first IPv4 address that is not loopback, if it has one.
std::optional<std::string> NonLoopbackIpv4() {
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return std::nullopt;
  std::optional<std::string> found;
  for (ifaddrs* i = ifs; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if ((i->ifa_flags & IFF_LOOPBACK) || !(i->ifa_flags & IFF_UP)) continue;
    char buf[INET_ADDRSTRLEN];
    const auto* a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if (::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf))) found = buf;
  }
  ::freeifaddrs(ifs);
  return found;
}

// True when a TCP connection to ip:port is accepted.
bool Connects(const std::string& ip, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

class NetworkSecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("grpo_network_security_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "learner_token") << kLearnerToken << "\n";
    std::ofstream(dir_ / "reward_token") << kRewardToken << "\n";
    children_ = std::make_unique<Children>(dir_);
  }
  void TearDown() override {
    children_.reset();
    fs::remove_all(dir_);
  }

  // Starts `grpo learner` on free ports with `extra` keys; false (with its log) if it did not
  // print its ports.
  bool StartLearner(const std::vector<std::string>& extra) {
    std::vector<std::string> args =
        LearnerCommand(dir_, {"--max_completion_length", "8", "--max_steps", "1000", "--save_steps",
                              "0", "--linger_seconds", "0"});
    args.insert(args.end(), extra.begin(), extra.end());
    learner_pid_ = children_->Spawn("learner", args);
    const json line = children_->FirstLine("learner", kStartTimeout);
    if (!line.is_object() || !line.contains("port")) {
      ADD_FAILURE() << "the learner did not start:\n" << Tail(children_->Err("learner"));
      return false;
    }
    port_ = line["port"].get<int>();
    metrics_port_ = line.value("metrics_port", 0);
    return true;
  }

  grpc::Status SubmitPrompts(int n, const std::string& token) {
    auto stub = Stub(port_);
    v1::SubmitDatasetResponse resp;
    auto ctx = Ctx(token);
    auto writer = stub->SubmitDataset(ctx.get(), &resp);
    v1::SubmitDatasetRequest req;
    for (int i = 0; i < n; ++i) {
      req.add_lines(R"({"prompt": "item )" + std::to_string(i) + R"(: name a fruit"})");
    }
    req.set_last(true);  // the learner stores a dataset only after its final message
    req.set_total_lines(n);
    writer->Write(req);
    writer->WritesDone();
    return writer->Finish();
  }

  fs::path dir_;
  std::unique_ptr<Children> children_;
  pid_t learner_pid_ = -1;
  int port_ = 0;
  int metrics_port_ = 0;
};

// Item 8: three concurrent unary calls and one stream of three messages, each 60 MiB and without
// the token, are refused UNAUTHENTICATED, and the learner's peak resident memory grows by less
// than one of them (today each is read in full: 196 -> 360 MiB in the issue's run). Calls with
// the token, and the token-free health check, still work.
TEST_F(NetworkSecurityTest, UnauthenticatedLargeCallsAreRefusedBeforeTheirBodyIsRead) {
  ASSERT_TRUE(StartLearner(
      {"--reward_funcs", "length", "--auth_token_file", (dir_ / "learner_token").string()}));
  auto stub = Stub(port_);
  // Warm up with the token: the first calls allocate what any call needs.
  ASSERT_TRUE(SubmitPrompts(4, kLearnerToken).ok());
  for (int i = 0; i < 3; ++i) {
    v1::Job job;
    ASSERT_TRUE(stub->GetJob(Ctx(kLearnerToken).get(), v1::GetJobRequest(), &job).ok());
  }
  const int64_t hwm_before = ProcStatusKib(learner_pid_, "VmHWM");
  const int64_t rss_before = ProcStatusKib(learner_pid_, "VmRSS");
  ASSERT_GT(hwm_before, 0);

  const std::string big(kBigMessageBytes, 'x');
  std::vector<std::future<grpc::StatusCode>> calls;
  for (int i = 0; i < 3; ++i) {
    calls.push_back(std::async(std::launch::async, [&, i] {
      v1::RegisterRequest req;
      req.set_worker_id("intruder-" + std::to_string(i));
      req.set_hostname(big);
      v1::RegisterResponse resp;
      return Stub(port_)->Register(Ctx("not-the-token").get(), req, &resp).error_code();
    }));
  }
  calls.push_back(std::async(std::launch::async, [&] {
    auto push_stub = Stub(port_);
    v1::PushRolloutsResponse ack;
    auto ctx = Ctx("");
    auto writer = push_stub->PushRollouts(ctx.get(), &ack);
    v1::RolloutGroup g;
    g.set_worker_id(big);
    for (int i = 0; i < 3 && writer->Write(g); ++i) {
    }
    writer->WritesDone();
    return writer->Finish().error_code();
  }));
  for (auto& c : calls) EXPECT_EQ(c.get(), grpc::StatusCode::UNAUTHENTICATED);

  const int64_t hwm_after = ProcStatusKib(learner_pid_, "VmHWM");
  const int64_t rss_after = ProcStatusKib(learner_pid_, "VmRSS");
  RecordProperty("learner_vmhwm_before_kib", static_cast<int>(hwm_before));
  RecordProperty("learner_vmhwm_after_kib", static_cast<int>(hwm_after));
  RecordProperty("learner_vmrss_before_kib", static_cast<int>(rss_before));
  RecordProperty("learner_vmrss_after_kib", static_cast<int>(rss_after));
  // Less than half of one refused message (6 x 60 MiB were sent).
  EXPECT_LT(hwm_after - hwm_before, static_cast<int64_t>(kBigMessageBytes / 2 / 1024))
      << "VmHWM " << hwm_before << " -> " << hwm_after << " KiB";

  v1::Job job;
  const grpc::Status ok = stub->GetJob(Ctx(kLearnerToken).get(), v1::GetJobRequest(), &job);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(job.prompts().queued() + job.prompts().leased(), 4);
  EXPECT_EQ(stub->GetJob(Ctx("not-the-token").get(), v1::GetJobRequest(), &job).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(HealthServing(port_)) << "grpc.health.v1 Check is served without the token";
}

// Item 8: grpc_max_threads bounds the learner's threads: the sync methods' (a grpc::ResourceQuota)
// and the bodies of the waiting methods (services/blocking_calls.h, WatchJob among them) each.
// Long-lived calls beyond it are refused RESOURCE_EXHAUSTED instead of growing threads without
// bound, exactly grpc_max_threads of them are served, and once they end the learner serves again.
TEST_F(NetworkSecurityTest, CallsBeyondTheThreadQuotaAreRefusedAndTheLearnerRecovers) {
  constexpr int kMaxThreads = 8;
  constexpr int kStreams = 24;
  ASSERT_TRUE(StartLearner({"--reward_funcs", "length", "--auth_token_file",
                            (dir_ / "learner_token").string(), "--grpc_max_threads",
                            std::to_string(kMaxThreads)}));
  auto stub = Stub(port_);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::JobEvent>>> held;
  int exhausted = 0;
  for (int i = 0; i < kStreams; ++i) {
    auto ctx = Ctx(kLearnerToken);
    auto reader = stub->WatchJob(ctx.get(), v1::WatchJobRequest());
    v1::JobEvent first;
    if (reader->Read(&first)) {  // a server thread now waits in this WatchJob
      contexts.push_back(std::move(ctx));
      held.push_back(std::move(reader));
      continue;
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    exhausted += s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }
  RecordProperty("watch_streams_held", static_cast<int>(held.size()));
  RecordProperty("watch_streams_refused", exhausted);
  EXPECT_EQ(static_cast<int>(held.size()), kMaxThreads);
  EXPECT_EQ(exhausted, kStreams - kMaxThreads);
  for (auto& ctx : contexts) ctx->TryCancel();
  for (auto& reader : held) (void)reader->Finish();
  EXPECT_TRUE(WaitUntil(
      [&] {
        v1::Job job;
        return stub->GetJob(Ctx(kLearnerToken, seconds(10)).get(), v1::GetJobRequest(), &job).ok();
      },
      seconds(60)))
      << Tail(children_->Err("learner"));
}

// Open file descriptors of process `pid`; -1 when unreadable.
int OpenFds(pid_t pid) {
  std::error_code ec;
  int n = 0;
  for (fs::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++n;
  }
  return ec ? -1 : n;
}

// Item 7: 300 raw connections to the learner's metrics port, held open and silent, leave the
// learner with at most metrics_max_connections of them (the rest are closed at once), so its
// descriptors stay bounded (the issue's run ended in "too many open files" at the next
// checkpoint); /metrics answers again once they are gone.
TEST_F(NetworkSecurityTest, HeldMetricsConnectionsDoNotExhaustTheLearnersDescriptors) {
  constexpr int kCap = 16;
  constexpr int kClients = 300;
  ASSERT_TRUE(StartLearner({"--reward_funcs", "length", "--auth_token_file",
                            (dir_ / "learner_token").string(), "--metrics_max_connections",
                            std::to_string(kCap), "--metrics_io_timeout_seconds", "120"}));
  ASSERT_TRUE(grpo::testing::HttpGet(static_cast<uint16_t>(metrics_port_), "/metrics"));
  const int fds_before = OpenFds(learner_pid_);
  ASSERT_GT(fds_before, 0);
  std::vector<int> clients;
  for (int i = 0; i < kClients; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(metrics_port_));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << i;
    clients.push_back(fd);
  }
  // The learner accepts every one (closing those over the cap): wait until none is left in the
  // listen backlog, i.e. the server has closed kClients - kCap of them.
  const auto closed_by_server = [&] {
    int n = 0;
    for (int fd : clients) {
      char c;
      n += ::recv(fd, &c, 1, MSG_DONTWAIT) == 0;
    }
    return n;
  };
  EXPECT_TRUE(WaitUntil([&] { return closed_by_server() >= kClients - kCap; }, seconds(60)))
      << closed_by_server() << " closed";
  const int fds_held = OpenFds(learner_pid_);
  RecordProperty("learner_fds_before", fds_before);
  RecordProperty("learner_fds_with_300_held", fds_held);
  EXPECT_LE(fds_held, fds_before + kCap + 4) << "the learner holds the connections";
  for (int fd : clients) ::close(fd);
  EXPECT_TRUE(WaitUntil(
      [&] {
        auto r = grpo::testing::HttpGet(static_cast<uint16_t>(metrics_port_), "/metrics");
        return r && r->status == 200 && r->body.find("grpo_") != std::string::npos;
      },
      seconds(60)));
  EXPECT_TRUE(WaitUntil([&] { return OpenFds(learner_pid_) <= fds_before + 4; }, seconds(60)));
}

// A RewardService that records the authorization metadata of every Score call and scores 1.
class CapturingRewardService final : public v1::RewardService::Service {
 public:
  grpc::Status Score(grpc::ServerContext* context, const v1::ScoreRequest* request,
                     v1::ScoreResponse* response) override {
    const auto& md = context->client_metadata();
    std::string seen = "<none>";
    if (auto it = md.find("authorization"); it != md.end()) {
      seen.assign(it->second.data(), it->second.size());
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen_.push_back(seen);
    }
    for (int i = 0; i < request->samples_size(); ++i) response->add_scores()->set_value(1.0);
    return grpc::Status::OK;
  }
  std::vector<std::string> Seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::string> seen_;
};

// Item 9: a worker scores with a remote reward function. It sends the reward server the token
// of reward_auth_token_file, no token without one, and never the learner's token (which could
// cancel the job and push groups).
TEST_F(NetworkSecurityTest, RewardServersSeeTheirOwnTokenAndNeverTheLearners) {
  CapturingRewardService service;
  grpc::ServerBuilder builder;
  int reward_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &reward_port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> reward_server = builder.BuildAndStart();
  ASSERT_NE(reward_server, nullptr);
  const std::string remote = "remote:len@127.0.0.1:" + std::to_string(reward_port);
  ASSERT_TRUE(StartLearner(
      {"--reward_funcs", remote, "--auth_token_file", (dir_ / "learner_token").string()}));
  ASSERT_TRUE(SubmitPrompts(200, kLearnerToken).ok());

  const auto run_worker = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> args = {GrpoBin(),
                                     "--log_level",
                                     "info",
                                     "rollout",
                                     "--learner_address",
                                     "127.0.0.1:" + std::to_string(port_),
                                     "--metrics_port",
                                     "0",
                                     "--auth_token_file",
                                     (dir_ / "learner_token").string(),
                                     "--worker_id",
                                     name};
    args.insert(args.end(), extra.begin(), extra.end());
    ASSERT_GT(children_->Spawn(name, args), 0);
    EXPECT_TRUE(WaitUntil([&] { return service.Seen().size() >= 3; }, seconds(180)))
        << "no Score calls reached the reward server\n"
        << Tail(children_->Err(name)) << "\n--- learner:\n"
        << Tail(children_->Err("learner"));
    children_->Kill(name);
  };

  run_worker("w-no-reward-token", {});
  for (const std::string& seen : service.Seen()) {
    EXPECT_EQ(seen.find(kLearnerToken), std::string::npos) << "the learner's token leaked";
    EXPECT_EQ(seen, "<none>");
  }
  service.Clear();
  run_worker("w-reward-token", {"--reward_auth_token_file", (dir_ / "reward_token").string()});
  const auto seen = service.Seen();
  ASSERT_FALSE(seen.empty());
  for (const std::string& s : seen) EXPECT_EQ(s, std::string("Bearer ") + kRewardToken);
  reward_server->Shutdown(std::chrono::system_clock::now() + seconds(5));
}

// Item 10: grpc_bind_address and metrics_bind_address 127.0.0.1 put both listening sockets on
// loopback only (the kernel's socket table says so, and this machine's other address, when it has
// one, is refused); auth off on loopback logs no warning.
TEST_F(NetworkSecurityTest, LoopbackBindAddressesAreNotReachableFromOtherAddresses) {
  ASSERT_TRUE(StartLearner({"--reward_funcs", "length", "--grpc_bind_address", "127.0.0.1",
                            "--metrics_bind_address", "127.0.0.1"}));
  EXPECT_EQ(ListeningAddresses(port_), std::vector<std::string>{"127.0.0.1"});
  EXPECT_EQ(ListeningAddresses(metrics_port_), std::vector<std::string>{"127.0.0.1"});
  EXPECT_TRUE(HealthServing(port_));
  const auto metrics = grpo::testing::HttpGet(static_cast<uint16_t>(metrics_port_), "/healthz");
  ASSERT_TRUE(metrics.has_value());
  EXPECT_EQ(metrics->status, 200);
  if (const auto other = NonLoopbackIpv4()) {
    EXPECT_FALSE(Connects(*other, port_)) << *other;
    EXPECT_FALSE(Connects(*other, metrics_port_)) << *other;
    RecordProperty("other_address_checked", *other);
  }
  EXPECT_EQ(ReadFile(children_->Err("learner")).find("auth is off"), std::string::npos);
}

// Item 10: the default binds every interface (gRPC's 0.0.0.0 is a dual-stack wildcard); with
// auth off the learner says so loudly.
TEST_F(NetworkSecurityTest, AuthOffOnAnOpenAddressLogsAWarning) {
  ASSERT_TRUE(StartLearner({"--reward_funcs", "length"}));
  const auto grpc_listen = ListeningAddresses(port_);
  ASSERT_EQ(grpc_listen.size(), 1u);
  EXPECT_TRUE(grpc_listen[0] == "0.0.0.0" || grpc_listen[0] == "::") << grpc_listen[0];
  EXPECT_EQ(ListeningAddresses(metrics_port_), std::vector<std::string>{"0.0.0.0"});
  const std::string log = ReadFile(children_->Err("learner"));
  EXPECT_NE(log.find("WARNING: auth is off (no auth_token_file) and gRPC listens on 0.0.0.0"),
            std::string::npos)
      << Tail(children_->Err("learner"));
}

// With auth on, the same open address logs no warning.
TEST_F(NetworkSecurityTest, AuthOnOpenAddressLogsNoWarning) {
  ASSERT_TRUE(StartLearner(
      {"--reward_funcs", "length", "--auth_token_file", (dir_ / "learner_token").string()}));
  EXPECT_EQ(ReadFile(children_->Err("learner")).find("auth is off"), std::string::npos);
}

}  // namespace
