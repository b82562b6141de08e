#include "services/grpc_environment.h"

#include <algorithm>
#include <cctype>
#include <cstdint>

#include "common/logging.h"
#include "services/auth.h"
#include "services/convert.h"
#include "services/environment_convert.h"

namespace grpo::services {
namespace {

using Clock = std::chrono::steady_clock;
using Stream = grpc::ClientAsyncReaderWriter<v1::EnvAction, v1::EnvObservation>;

// The operations a session has in flight on its completion queue; the tag of each is its value.
enum Op : uintptr_t { kStart = 0, kWrite, kRead, kWritesDone, kFinish, kNumOps };

void* Tag(Op op) { return reinterpret_cast<void*>(op + 1); }

// One Episode stream over the async API with a completion queue of its own, so that every wait
// has a deadline (AsyncNext) and a missed one can cancel the stream. Not thread-safe (EnvSession).
class GrpcEnvSession final : public rollout::EnvSession {
 public:
  GrpcEnvSession(std::shared_ptr<v1::EnvironmentService::Stub> stub, const std::string& address,
                 const std::string& auth_token, std::chrono::milliseconds close_timeout)
      : stub_(std::move(stub)),
        address_(address),
        close_timeout_(close_timeout),
        call_(std::make_unique<CallState>()) {
    AddAuth(call_->context, auth_token);
  }
  ~GrpcEnvSession() override { Close(); }

  StatusOr<rollout::EnvObservation> Reset(const nlohmann::json& row, uint64_t seed,
                                          Clock::time_point deadline) override {
    if (reset_done_) return Status::FailedPrecondition("Reset called twice on one session");
    reset_done_ = true;
    v1::EnvAction action;
    action.mutable_reset()->set_row_json(
        row.is_null() ? "" : row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    action.mutable_reset()->set_seed(seed);
    return Call(std::move(action), "reset", deadline);
  }

  StatusOr<rollout::EnvObservation> Step(const std::string& action_text,
                                         Clock::time_point deadline) override {
    if (!reset_done_) return Status::FailedPrecondition("Step called before Reset");
    v1::EnvAction action;
    action.mutable_step()->set_text(action_text);
    return Call(std::move(action), "step", deadline);
  }

  StatusOr<rollout::EnvObservation> StepToolCalls(const std::string& action_text,
                                                  const std::vector<common::ToolCall>& calls,
                                                  Clock::time_point deadline) override {
    if (!reset_done_) return Status::FailedPrecondition("Step called before Reset");
    v1::EnvAction action;
    action.mutable_step()->set_text(action_text);
    ToolCallsToProto(calls, action.mutable_step());
    return Call(std::move(action), "step", deadline);
  }

 private:
  struct CallState {
    // Destroyed in reverse: the stream (arena-allocated in the call), the context (releases the
    // call), then the queue, which must be shut down and drained by then.
    grpc::CompletionQueue cq;
    grpc::ClientContext context;
    std::unique_ptr<Stream> stream;
  };
  enum class Wait { kOk, kFailed, kTimedOut };

  static uint32_t Bit(Op op) { return 1u << op; }

  // Pumps the queue until `op` has completed (kOk / kFailed: its ok flag) or `deadline` passes.
  // Other operations completing meanwhile are recorded.
  Wait Await(Op op, Clock::time_point deadline) {
    while (pending_ & Bit(op)) {
      const auto left = deadline - Clock::now();
      if (left <= Clock::duration::zero()) return Wait::kTimedOut;
      void* tag = nullptr;
      bool ok = false;
      const auto status = call_->cq.AsyncNext(
          &tag, &ok,
          std::chrono::system_clock::now() +
              std::chrono::duration_cast<std::chrono::system_clock::duration>(left));
      if (status == grpc::CompletionQueue::TIMEOUT) continue;  // re-checks the deadline
      if (status == grpc::CompletionQueue::SHUTDOWN) return Wait::kFailed;
      const auto done = static_cast<Op>(reinterpret_cast<uintptr_t>(tag) - 1);
      pending_ &= ~Bit(done);
      ok_[done] = ok;
    }
    return ok_[op] ? Wait::kOk : Wait::kFailed;
  }

  void Issue(Op op) { pending_ |= Bit(op); }

  StatusOr<rollout::EnvObservation> Call(v1::EnvAction action, const char* what,
                                         Clock::time_point deadline) {
    if (failed_) {
      return Status::FailedPrecondition("environment session failed earlier: open a new one");
    }
    const auto timeout = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    action.set_timeout_ms(std::max<int64_t>(timeout.count(), 1));
    if (!started_) {
      call_->stream = stub_->PrepareAsyncEpisode(&call_->context, &call_->cq);
      call_->stream->StartCall(Tag(kStart));
      Issue(kStart);
      started_ = true;
    }
    // At most one write in flight, and StartCall is one (it sends the initial metadata with the
    // stream's write operations): the previous one completed when its answer came, but its
    // completion may not have been collected yet.
    if (Wait w = Await(kStart, deadline); w != Wait::kOk) return Broken(w, what);
    if (Wait w = Await(kWrite, deadline); w != Wait::kOk) return Broken(w, what);
    call_->stream->Write(action, Tag(kWrite));
    Issue(kWrite);
    answer_.Clear();
    call_->stream->Read(&answer_, Tag(kRead));
    Issue(kRead);
    if (Wait w = Await(kRead, deadline); w != Wait::kOk) return Broken(w, what);
    if (!answer_.error().empty()) {
      failed_ = true;  // the server ends the stream after an error answer
      return Status::Internal("environment at " + address_ + " failed the " + what + ": " +
                              answer_.error());
    }
    StatusOr<rollout::EnvObservation> obs = FromProto(answer_);
    if (!obs.ok()) {
      failed_ = broken_ = true;
      return Status::Internal("environment at " + address_ + " answered the " + what +
                              " with nonsense: " + obs.status().message());
    }
    return obs;
  }

  // The error of a call whose write or read failed or timed out; the session is spent.
  Status Broken(Wait w, const char* what) {
    failed_ = broken_ = true;
    if (w == Wait::kTimedOut) {
      call_->context.TryCancel();
      return Status::DeadlineExceeded("environment at " + address_ + " did not answer the " + what +
                                      " by its deadline (stream cancelled)");
    }
    // The stream ended: its status says why (bounded: a broken stream's status is there at once).
    const auto finish_by = Clock::now() + close_timeout_;
    Await(kStart, finish_by);  // writes on a broken stream fail at once
    Await(kWrite, finish_by);
    call_->stream->Finish(&finish_status_, Tag(kFinish));
    Issue(kFinish);
    if (Await(kFinish, finish_by) != Wait::kOk) {
      call_->context.TryCancel();
      return Status::Unavailable("environment at " + address_ + ": the " + what +
                                 "'s stream broke and its status did not come");
    }
    finished_ = true;
    const std::string context = "environment at " + address_ + ", " + what;
    switch (finish_status_.error_code()) {
      case grpc::StatusCode::OK:
        return Status::Internal(context +
                                ": the server ended the episode's stream without "
                                "answering");
      case grpc::StatusCode::CANCELLED:  // not by us: the server (shutting down) or a proxy
      case grpc::StatusCode::UNAVAILABLE:
        return Status::Unavailable(context + ": " + finish_status_.error_message());
      default:
        return FromGrpcStatus(finish_status_).WithContext(context);
    }
  }

  // Ends the stream: WritesDone and the server's status when it is healthy, a cancel otherwise
  // or when the server does not end it within close_timeout_; then drains the queue.
  void Close() {
    if (started_) {
      const auto deadline = Clock::now() + close_timeout_;
      bool polite =
          !broken_ && Await(kStart, deadline) == Wait::kOk && Await(kWrite, deadline) == Wait::kOk;
      if (polite) {
        call_->stream->WritesDone(Tag(kWritesDone));
        Issue(kWritesDone);
        polite = Await(kWritesDone, deadline) == Wait::kOk;
      }
      if (!polite) call_->context.TryCancel();
      // Finish only once nothing is left to read (a pending read would receive the initial
      // metadata that Finish asks for too: gRPC aborts on that); after a cancel it fails at once.
      if (!finished_ && Await(kRead, Clock::now() + kDefaultEnvCancelTimeout) != Wait::kTimedOut) {
        call_->stream->Finish(&finish_status_, Tag(kFinish));
        Issue(kFinish);
        if (Await(kFinish, deadline) == Wait::kTimedOut) call_->context.TryCancel();
      }
      const auto cancel_deadline = Clock::now() + kDefaultEnvCancelTimeout;
      for (uintptr_t op = 0; op < kNumOps; ++op) Await(static_cast<Op>(op), cancel_deadline);
    }
    call_->cq.Shutdown();
    if (pending_ != 0) {
      GRPO_LOG_ERROR(
          "environment at {}: gRPC kept a cancelled stream's operations past {} ms; abandoning "
          "the call (leaked)",
          address_, kDefaultEnvCancelTimeout.count());
      (void)call_.release();
      return;
    }
    void* tag = nullptr;
    bool ok = false;
    while (call_->cq.Next(&tag, &ok)) {
    }
  }

  const std::shared_ptr<v1::EnvironmentService::Stub> stub_;
  const std::string address_;
  const std::chrono::milliseconds close_timeout_;
  std::unique_ptr<CallState> call_;
  v1::EnvObservation answer_;
  grpc::Status finish_status_;
  uint32_t pending_ = 0;                               // Bit(op) for each operation in flight
  bool ok_[kNumOps] = {true, true, true, true, true};  // each operation's last ok flag
  bool started_ = false;
  bool reset_done_ = false;
  bool failed_ = false;    // a call failed: the session is spent
  bool broken_ = false;    // the stream is unusable: cancel it rather than close it
  bool finished_ = false;  // Finish has completed
};

Status CheckAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  bool ok = colon != std::string::npos && colon > 0 && colon + 1 < address.size();
  for (size_t i = colon + 1; ok && i < address.size(); ++i) {
    ok = std::isdigit(static_cast<unsigned char>(address[i])) != 0;
  }
  if (!ok) {
    return Status::InvalidArgument("environment address '" + address + "' is not HOST:PORT");
  }
  return Status::OK();
}

}  // namespace

GrpcEnvironment::GrpcEnvironment(std::string address, std::string auth_token,
                                 GrpcEnvironmentOptions options)
    : address_(std::move(address)),
      auth_token_(std::move(auth_token)),
      name_(options.name.empty() ? "grpc:" + address_ : options.name),
      close_timeout_(options.close_timeout),
      stub_(v1::EnvironmentService::NewStub(MakeChannel(address_))) {}

StatusOr<std::unique_ptr<rollout::EnvSession>> GrpcEnvironment::Open() {
  return std::unique_ptr<rollout::EnvSession>(
      std::make_unique<GrpcEnvSession>(stub_, address_, auth_token_, close_timeout_));
}

StatusOr<std::unique_ptr<rollout::Environment>> MakeGrpcEnvironment(
    std::string address, GrpcEnvironmentOptions options) {
  RETURN_IF_ERROR(CheckAddress(address));
  if (options.close_timeout.count() <= 0) {
    return Status::InvalidArgument("environment close_timeout must be positive");
  }
  ASSIGN_OR_RETURN(std::string token,
                   ReadAuthToken(options.auth_token_file, "env_auth_token_file"));
  return std::unique_ptr<rollout::Environment>(
      std::make_unique<GrpcEnvironment>(std::move(address), std::move(token), std::move(options)));
}

}  // namespace grpo::services
