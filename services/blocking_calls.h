// Blocking RPC bodies on gRPC's callback API, with cancellation that wakes them.
//
// gRPC's sync API gives a handler no notice of its call's end: a handler blocked in a long wait
// can only poll ServerContext::IsCancelled(). The learner's methods that wait (LeasePrompts'
// long poll, PushRollouts' wait for buffer room, GetWeights' wait for a version, WatchJob, a
// Store GET) are therefore callback-API methods here: their reactor trips a common::CancelToken
// from OnCancel (the client went away, its deadline passed, the server shut down) and the
// learner's waits watch that token, so a wait ends the moment its call does.
//
// The bodies still block, which gRPC's own callback threads must never do (they serve every
// call's reactions), so each body runs on a thread of its own from CallThreads, at most
// `max_threads` at once: past that a call gets RESOURCE_EXHAUSTED, as gRPC's sync server answers
// when its thread quota (config key grpc_max_threads) runs out. The streams' bodies read and
// write through blocking Read/Write over the reactor's StartRead/StartWrite, so a handler reads
// like a sync one.
//
// Lifetime: a reactor deletes itself in OnDone, which gRPC calls only after Finish, and the
// body's thread calls Finish as its last touch of the reactor. CallThreads::Drain (after the
// server's Shutdown and Wait) joins every body's thread.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_callback.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/cancel_token.h"
#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace grpo::services {

// Threads for blocking bodies, each on its own (bounded), joined when done. Thread-safe.
class CallThreads {
 public:
  explicit CallThreads(int64_t max_threads) : max_threads_(max_threads) {}
  ~CallThreads() { Drain(); }
  CallThreads(const CallThreads&) = delete;
  CallThreads& operator=(const CallThreads&) = delete;

  // Runs `body` on a new thread; false (and `body` is not run) when max_threads bodies run.
  bool TryRun(std::function<void()> body) GRPO_EXCLUDES(mu_);
  // Blocks until every body has returned, then joins their threads.
  void Drain() GRPO_EXCLUDES(mu_);
  // Bodies running now.
  int64_t running() const GRPO_EXCLUDES(mu_);

 private:
  void JoinFinished() GRPO_EXCLUDES(mu_);
  int64_t RunningLocked() const GRPO_REQUIRES(mu_) {
    return static_cast<int64_t>(threads_.size() - finished_.size());
  }

  const int64_t max_threads_;
  mutable common::Mutex mu_;
  common::CondVar idle_cv_;
  int64_t next_id_ GRPO_GUARDED_BY(mu_) = 0;
  std::map<int64_t, std::thread> threads_ GRPO_GUARDED_BY(mu_);  // not joined yet
  std::vector<int64_t> finished_ GRPO_GUARDED_BY(mu_);  // of those, the ones whose body returned
};

// The status a call gets when every body thread is busy.
grpc::Status CallThreadsExhausted(const char* rpc);

// Runs `body` (given the reactor) on `threads` and finishes `reactor` with its status. Finishes
// it at once, running nothing, with `admit` when that is not OK (auth), and with
// CallThreadsExhausted when no thread is free. The reactor outlives the body: gRPC keeps it
// until OnDone, which follows Finish.
template <class Reactor, class Body>
void StartBody(CallThreads* threads, const char* rpc, const grpc::Status& admit, Reactor* reactor,
               Body body) {
  if (!admit.ok()) {
    reactor->Finish(admit);
    return;
  }
  const bool started = threads->TryRun(
      [reactor, body = std::move(body)]() mutable { reactor->Finish(body(*reactor)); });
  if (!started) reactor->Finish(CallThreadsExhausted(rpc));
}

// One stream operation at a time, waited for: Begin before starting it, Done from its reaction
// (OnReadDone / OnWriteDone), Wait for its outcome (false: the call ended).
class OneOperation {
 public:
  void Begin() GRPO_EXCLUDES(mu_) {
    common::MutexLock lock(&mu_);
    done_ = false;
  }
  void Done(bool ok) GRPO_EXCLUDES(mu_) {
    common::MutexLock lock(&mu_);
    done_ = true;
    ok_ = ok;
    cv_.NotifyAll();
  }
  bool Wait() GRPO_EXCLUDES(mu_) {
    common::MutexLock lock(&mu_);
    while (!done_) cv_.Wait(&mu_);
    return ok_;
  }
  // As Wait; false without waiting on when `deadline` passes first (*timed_out then true).
  bool WaitUntil(std::chrono::steady_clock::time_point deadline, bool* timed_out)
      GRPO_EXCLUDES(mu_) {
    common::MutexLock lock(&mu_);
    while (!done_) {
      if (!cv_.WaitUntil(&mu_, deadline) && !done_) {
        *timed_out = true;
        return false;
      }
    }
    *timed_out = false;
    return ok_;
  }

 private:
  common::Mutex mu_;
  common::CondVar cv_;
  bool done_ GRPO_GUARDED_BY(mu_) = false;
  bool ok_ GRPO_GUARDED_BY(mu_) = false;
};

// A unary method whose body blocks: body(reactor) -> grpc::Status, reactor.cancel() its token.
class BlockingUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  using Body = std::function<grpc::Status(BlockingUnaryReactor&)>;
  static grpc::ServerUnaryReactor* Start(CallThreads* threads, const char* rpc,
                                         const grpc::Status& admit, Body body) {
    auto* r = new BlockingUnaryReactor;
    StartBody(threads, rpc, admit, r, std::move(body));
    return r;
  }
  const common::CancelToken& cancel() const { return cancel_; }
  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  BlockingUnaryReactor() = default;
  common::CancelToken cancel_;
};

// A client-streaming method whose body blocks: Read(&msg) waits for the next message (false at
// the stream's end, or when the call ended).
template <class Request>
class BlockingReadReactor final : public grpc::ServerReadReactor<Request> {
 public:
  using Body = std::function<grpc::Status(BlockingReadReactor&)>;
  static grpc::ServerReadReactor<Request>* Start(CallThreads* threads, const char* rpc,
                                                 const grpc::Status& admit, Body body) {
    auto* r = new BlockingReadReactor;
    StartBody(threads, rpc, admit, r, std::move(body));
    return r;
  }
  const common::CancelToken& cancel() const { return cancel_; }

  bool Read(Request* msg) {
    read_.Begin();
    this->StartRead(msg);
    return read_.Wait();
  }
  void OnReadDone(bool ok) override { read_.Done(ok); }
  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  BlockingReadReactor() = default;
  common::CancelToken cancel_;
  OneOperation read_;
};

// A server-streaming method whose body blocks: Write(msg) waits until gRPC has taken the
// message (false when the call ended: the client left).
template <class Response>
class BlockingWriteReactor final : public grpc::ServerWriteReactor<Response> {
 public:
  using Body = std::function<grpc::Status(BlockingWriteReactor&)>;
  static grpc::ServerWriteReactor<Response>* Start(CallThreads* threads, const char* rpc,
                                                   const grpc::Status& admit, Body body) {
    auto* r = new BlockingWriteReactor;
    StartBody(threads, rpc, admit, r, std::move(body));
    return r;
  }
  const common::CancelToken& cancel() const { return cancel_; }

  bool Write(const Response& msg) {
    write_.Begin();
    this->StartWrite(&msg);
    return write_.Wait();
  }
  // As Write, but a client that has not taken the message within `limit` (it stopped reading)
  // has its call cancelled (`context`'s TryCancel): false, as for a client gone.
  bool WriteWithin(const Response& msg, std::chrono::milliseconds limit,
                   grpc::CallbackServerContext* context) {
    write_.Begin();
    this->StartWrite(&msg);
    bool timed_out = false;
    const bool ok = write_.WaitUntil(std::chrono::steady_clock::now() + limit, &timed_out);
    if (!timed_out) return ok;
    context->TryCancel();
    (void)write_.Wait();  // the write completes (not ok) once the call is cancelled
    return false;
  }
  void OnWriteDone(bool ok) override { write_.Done(ok); }
  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  BlockingWriteReactor() = default;
  common::CancelToken cancel_;
  OneOperation write_;
};

}  // namespace grpo::services
