#include "services/learner_service.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <deque>

#include "common/logging.h"
#include "common/model/safetensors.h"
#include "services/auth.h"
#include "services/blocking_calls.h"
#include "services/convert.h"
#include "services/grpc_store.h"

namespace grpo::services {
namespace {

using Clock = std::chrono::steady_clock;

// "HOST:PORT" for gRPC, bracketing an IPv6 literal ("::" -> "[::]:50051").
std::string HostPort(const std::string& host, int64_t port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

constexpr const char* kServiceName = "grpo.v1.LearnerService";
// WatchJob's wait for events is re-armed this often; events, the learner's stop and the call's
// end wake it sooner, so nothing waits for this.
constexpr std::chrono::milliseconds kWatchWait{60'000};

// Runs a handler body; an escaped exception becomes INTERNAL (handlers never throw).
template <typename F>
grpc::Status Guarded(const char* rpc, F&& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    GRPO_LOG_ERROR("{}: {}", rpc, e.what_without_backtrace());
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        std::string(rpc) + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    GRPO_LOG_ERROR("{}: {}", rpc, e.what());
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + ": " + e.what());
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + ": unknown exception");
  }
}

// The call's deadline on the steady clock (gRPC gives it on the system clock; a call without
// one has the system clock's maximum, capped here at a day).
Clock::time_point SteadyDeadline(const grpc::ServerContextBase& context) {
  const auto left = context.deadline() - std::chrono::system_clock::now();
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(
             std::min<std::chrono::system_clock::duration>(left, std::chrono::hours(24)));
}

}  // namespace

LearnerServer::LearnerServer(common::GrpoConfig config, LearnerServerOptions options)
    : config_(std::move(config)),
      options_(std::move(options)),
      call_threads_(std::make_unique<CallThreads>(config_.grpc_max_threads)) {}

StatusOr<std::unique_ptr<LearnerServer>> LearnerServer::Create(
    common::GrpoConfig config, std::unique_ptr<common::Model> policy,
    std::unique_ptr<common::Model> reference, LearnerServerOptions options) {
  RETURN_IF_ERROR(config.Validate());
  if (config.grpc_port < 0 || config.grpc_port > 65535) {
    return Status::InvalidArgument("config key 'grpc_port' must be in [0, 65535], got " +
                                   std::to_string(config.grpc_port));
  }
  std::unique_ptr<LearnerServer> s(new LearnerServer(config, options));
  ASSIGN_OR_RETURN(s->auth_token_, ReadAuthToken(config.auth_token_file));
  ASSIGN_OR_RETURN(s->server_credentials_, ServerCredentials(config, s->auth_token_));
  ASSIGN_OR_RETURN(s->learner_, learner::Learner::Create(std::move(config), std::move(policy),
                                                         std::move(reference), std::move(options)));
  return s;
}

LearnerServer::~LearnerServer() {
  (void)Stop(/*checkpoint=*/false);
  call_threads_->Drain();  // (after a Start that failed: no server to wait for)
}

Status LearnerServer::Start() {
  {
    common::MutexLock lock(&mu_);
    if (started_) return Status::FailedPrecondition("LearnerServer already started");
    started_ = true;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  ApplyServerLimits(builder, config_, "grpo-learner");
  const std::string host =
      options_.bind_address.empty() ? config_.grpc_bind_address : options_.bind_address;
  const std::string address = HostPort(host, config_.grpc_port);
  if (auth_token_.empty() && !IsLoopbackAddress(host)) {
    GRPO_LOG_WARN(
        "learner: WARNING: auth is off (no auth_token_file) and gRPC listens on {}: anyone who "
        "reaches this address can push groups and cancel the job; set auth_token_file or "
        "grpc_bind_address: 127.0.0.1",
        host);
  }
  builder.AddListeningPort(address, server_credentials_, &port_);
  builder.RegisterService(this);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return Status::Unavailable("learner: cannot listen on " + address);
  }
  if (Status s = learner_->Start(); !s.ok()) {
    server_->Shutdown();
    server_->Wait();
    server_.reset();
    return s;
  }
  if (auto* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    health->SetServingStatus(kServiceName, true);
  }
  GRPO_LOG_INFO("learner: serving on port {} (step {}, policy version {}, {} intra-op threads)",
                port_, learner_->Snapshot().global_step, learner_->published_version(),
                at::get_num_threads());
  return Status::OK();
}

Status LearnerServer::Stop(bool checkpoint) {
  {
    common::MutexLock lock(&mu_);
    if (stopped_ || learner_ == nullptr) return Status::OK();  // (a failed Create)
    stopped_ = true;
  }
  Status result = learner_->Stop(checkpoint);
  if (server_ != nullptr) {
    if (auto* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
      health->SetServingStatus(kServiceName, false);
    }
    server_->Shutdown(std::chrono::system_clock::now() + kDefaultShutdownGrace);
    server_->Wait();
  }
  call_threads_->Drain();  // every call has finished: only the threads' exits are left
  // After the last call: nothing can join the buffer any more.
  learner_->EndLedger();
  return result;
}

// ---------------------------------------------------------------------------------------------
// Workers.

grpc::Status LearnerServer::Register(grpc::ServerContext* context,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("Register", [&] {
    auto r = learner_->Register(FromProto(*request));
    if (!r.ok()) return ToGrpcStatus(r.status());
    ToProto(*r, response);
    return grpc::Status::OK;
  });
}

grpc::Status LearnerServer::Heartbeat(grpc::ServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("Heartbeat", [&] {
    auto r = learner_->Heartbeat(FromProto(*request));
    if (!r.ok()) return ToGrpcStatus(r.status());
    ToProto(*r, response);
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* LearnerServer::LeasePrompts(grpc::CallbackServerContext* context,
                                                      const v1::LeasePromptsRequest* request,
                                                      v1::LeasePromptsResponse* response) {
  return BlockingUnaryReactor::Start(
      call_threads_.get(), "LeasePrompts", CheckAuth(*context, auth_token_),
      [this, context, request, response](BlockingUnaryReactor& call) {
        return Guarded("LeasePrompts", [&] {
          // Learner::LeasePrompts waits for budget until 500 ms before the deadline: a
          // deadline now is one look at the budget.
          auto r = learner_->LeasePrompts(
              request->worker_id(), request->max_prompts(),
              request->answer_at_once() ? std::chrono::steady_clock::now()
                                        : SteadyDeadline(*context),
              &call.cancel(), request->has_weight_version() ? request->weight_version() : -1);
          if (!r.ok()) return ToGrpcStatus(r.status());
          ToProto(*r, response);
          return grpc::Status::OK;
        });
      });
}

grpc::ServerReadReactor<v1::RolloutGroup>* LearnerServer::PushRollouts(
    grpc::CallbackServerContext* context, v1::PushRolloutsResponse* response) {
  return BlockingReadReactor<v1::RolloutGroup>::Start(
      call_threads_.get(), "PushRollouts", CheckAuth(*context, auth_token_),
      [this, response](BlockingReadReactor<v1::RolloutGroup>& call) {
        return Guarded("PushRollouts", [&] {
          learner::PushTally tally;
          v1::RolloutGroup msg;
          while (call.Read(&msg)) learner_->AcceptGroup(FromProto(msg), &call.cancel(), &tally);
          ToProto(tally.reply, response);
          return grpc::Status::OK;
        });
      });
}

grpc::ServerWriteReactor<v1::WeightChunk>* LearnerServer::GetWeights(
    grpc::CallbackServerContext* context, const v1::GetWeightsRequest* request) {
  return BlockingWriteReactor<v1::WeightChunk>::Start(
      call_threads_.get(), "GetWeights", CheckAuth(*context, auth_token_),
      [this, request, context](BlockingWriteReactor<v1::WeightChunk>& call) {
        return Guarded("GetWeights", [&] { return ServeWeights(*request, call, context); });
      });
}

grpc::Status LearnerServer::ServeWeights(const v1::GetWeightsRequest& request,
                                         BlockingWriteReactor<v1::WeightChunk>& call,
                                         grpc::CallbackServerContext* context) {
  // Streaming, the sink runs on the training thread, which a client that stops reading must
  // not hold up for longer than a stalled weight-sync group would.
  const bool bounded = learner_->streams_weights();
  const auto write_limit = std::chrono::milliseconds(
      static_cast<int64_t>(learner_->config().weight_sync_timeout_seconds * 1000));
  const int64_t chunk = request.chunk_bytes() > 0
                            ? std::min<int64_t>(request.chunk_bytes(), kDefaultWeightChunkBytes)
                            : kDefaultWeightChunkBytes;
  // Each tensor goes out in chunks as it comes: from the snapshot, or (weight_publish: stream)
  // on the training thread as it reads the policy, a tensor at a time.
  v1::WeightChunk msg;
  Status sink_status = Status::OK();
  const Status read = learner_->ReadWeights(
      request.min_version(), &call.cancel(), request.incarnation(),
      [&](const learner::WeightPiece& piece) {
        auto dtype = common::SafetensorsDtypeName(piece.tensor.scalar_type());
        if (!dtype.ok()) {
          sink_status = dtype.status();
          return false;
        }
        const int64_t bytes = static_cast<int64_t>(piece.tensor.nbytes());
        const char* data = static_cast<const char*>(piece.tensor.data_ptr());
        int64_t offset = 0;
        do {
          const int64_t n = std::min(chunk, bytes - offset);
          msg.Clear();
          msg.set_version(piece.version);
          msg.set_incarnation(learner_->incarnation());
          msg.set_name(piece.name);
          for (int64_t d : piece.tensor.sizes()) msg.add_shape(d);
          msg.set_dtype(*dtype);
          msg.set_offset(offset);
          if (n > 0) msg.set_data(data + offset, static_cast<size_t>(n));
          msg.set_tensor_bytes(bytes);
          offset += n;
          msg.set_last(piece.index + 1 == piece.count && offset >= bytes);
          if (!(bounded ? call.WriteWithin(msg, write_limit, context) : call.Write(msg))) {
            sink_status = Status::Cancelled("GetWeights: the client went away or stopped reading");
            return false;
          }
          learner_->metrics().weight_sync_bytes->Increment(static_cast<double>(n));
        } while (offset < bytes);
        return true;
      });
  if (!sink_status.ok()) return ToGrpcStatus(sink_status);
  if (!read.ok()) return ToGrpcStatus(read);
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// Clients.

grpc::Status LearnerServer::SubmitDataset(grpc::ServerContext* context,
                                          grpc::ServerReader<v1::SubmitDatasetRequest>* reader,
                                          v1::SubmitDatasetResponse* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("SubmitDataset", [&] {
    v1::SubmitDatasetRequest msg;
    std::string key, name;
    std::vector<std::string> lines;
    int64_t bytes = 0;
    bool first = true, last = false;
    int64_t total_lines = -1;
    while (reader->Read(&msg)) {
      if (last) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "SubmitDataset: a message after the one marked last; nothing stored");
      }
      if (first) {
        key = msg.idempotency_key();
        name = msg.name();
        first = false;
      }
      for (auto& line : *msg.mutable_lines()) {
        // A line costs its bytes and its newline: a flood of blank lines counts too.
        bytes += static_cast<int64_t>(line.size()) + 1;
        if (bytes > options_.max_dataset_bytes) {
          return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                              "dataset larger than " + std::to_string(options_.max_dataset_bytes) +
                                  " bytes (a line counts its newline); nothing stored");
        }
        lines.push_back(std::move(line));
      }
      if (msg.last()) {
        last = true;
        total_lines = msg.total_lines();
      }
    }
    if (first) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty SubmitDataset");
    // Committed whole or not at all: a stream that broke (a connection lost, a deadline, a
    // message that failed to parse) ends without the message marked last.
    if (!last || context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          "SubmitDataset: the upload ended after " + std::to_string(lines.size()) +
                              " lines without its final message; nothing stored (retry it)");
    }
    if (total_lines != static_cast<int64_t>(lines.size())) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "SubmitDataset: the final message says " + std::to_string(total_lines) +
                              " lines, " + std::to_string(lines.size()) +
                              " arrived; nothing stored");
    }
    auto info = learner_->AddDataset(key, lines);
    if (!info.ok()) return ToGrpcStatus(info.status());
    GRPO_LOG_INFO("learner: dataset {} '{}': {} prompts{}", info->dataset_id,
                  common::EscapeForLog(name), info->prompt_count,
                  info->created ? "" : " (seen before)");
    response->set_dataset_id(info->dataset_id);
    response->set_prompt_count(info->prompt_count);
    response->set_created(info->created);
    return grpc::Status::OK;
  });
}

grpc::Status LearnerServer::GetJob(grpc::ServerContext* context, const v1::GetJobRequest*,
                                   v1::Job* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("GetJob", [&] {
    ToProto(learner_->Snapshot(), response);
    return grpc::Status::OK;
  });
}

grpc::ServerWriteReactor<v1::JobEvent>* LearnerServer::WatchJob(
    grpc::CallbackServerContext* context, const v1::WatchJobRequest*) {
  return BlockingWriteReactor<v1::JobEvent>::Start(
      call_threads_.get(), "WatchJob", CheckAuth(*context, auth_token_),
      [this](BlockingWriteReactor<v1::JobEvent>& call) {
        return Guarded("WatchJob", [&] { return ServeJobEvents(call); });
      });
}

grpc::Status LearnerServer::ServeJobEvents(BlockingWriteReactor<v1::JobEvent>& call) {
  auto sub = learner_->Subscribe();
  struct Unsubscribe {
    learner::Learner* learner;
    std::shared_ptr<learner::Learner::Subscriber> sub;
    ~Unsubscribe() { learner->Unsubscribe(sub); }
  } unsubscribe{learner_.get(), sub};

  learner::JobEvent first;
  first.job = learner_->Snapshot();
  first.step = first.job.global_step;
  v1::JobEvent msg;
  ToProto(first, &msg);
  if (!call.Write(msg)) return grpc::Status::OK;
  if (learner::IsTerminal(first.job.state)) return grpc::Status::OK;
  while (true) {
    std::deque<learner::JobEvent> events;
    // Ends with an event, when the learner stops, or when the call ends (the cancel token).
    const Status s = learner_->NextEvents(*sub, kWatchWait, &call.cancel(), &events);
    if (s.code() == StatusCode::kResourceExhausted) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "WatchJob: " + s.message());
    }
    if (s.code() == StatusCode::kCancelled) return grpc::Status::CANCELLED;
    if (!s.ok()) return ToGrpcStatus(s);
    for (const auto& e : events) {
      msg.Clear();
      ToProto(e, &msg);
      if (!call.Write(msg)) return grpc::Status::OK;  // the client left
      if (e.metrics.empty() && learner::IsTerminal(e.job.state)) return grpc::Status::OK;
    }
  }
}

grpc::Status LearnerServer::CancelJob(grpc::ServerContext* context,
                                      const v1::CancelJobRequest* request, v1::Job* response) {
  if (grpc::Status a = CheckAuth(*context, auth_token_); !a.ok()) return a;
  return Guarded("CancelJob", [&] {
    learner_->Cancel(request->reason());
    ToProto(learner_->Snapshot(), response);
    return grpc::Status::OK;
  });
}

// ---------------------------------------------------------------------------------------------
// The rendezvous store (c10d Store semantics; values are bytes, ADD keeps a decimal integer).

grpc::ServerUnaryReactor* LearnerServer::Store(grpc::CallbackServerContext* context,
                                               const v1::StoreRequest* request,
                                               v1::StoreResponse* response) {
  return BlockingUnaryReactor::Start(
      call_threads_.get(), "Store", CheckAuth(*context, auth_token_),
      [this, request, response](BlockingUnaryReactor& call) {
        return Guarded("Store", [&]() -> grpc::Status {
          return ToGrpcStatus(
              ServeStoreRequest(*learner_->epoch_store(), *request, response, &call.cancel()));
        });
      });
}

}  // namespace grpo::services
