// A LearnerService client shared by `grpo submit/status/watch/cancel` and `grpo
// demo`: connect with the shared token, upload a dataset, follow the job's
// WatchJob stream, and the per-step output formats (the table line and the JSON
// object) both commands print.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <istream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "grpo/v1/learner.grpc.pb.h"
#include "learner/job.h"

namespace grpo::services {

// Deadline of one unary call, and of a whole SubmitDataset upload.
inline constexpr double kDefaultCallTimeoutSeconds = 60;
// Deadline of a WatchJob stream (a watch normally ends with the job long
// before).
inline constexpr double kDefaultWatchTimeoutSeconds = 7 * 24 * 3600;

// A connected client: the stub and the token. Thread-compatible (the stub is
// thread-safe).
struct LearnerClient {
  std::unique_ptr<v1::LearnerService::Stub> stub;
  std::string token;

  // A call context with the token and a deadline `seconds` from now.
  std::unique_ptr<grpc::ClientContext> Context(double seconds) const;
};

// Reads the token from `auth_token_file` (empty = no auth) and opens a channel
// to `address`, TLS-verified against the PEM file `tls_ca_file` when one is
// given. The channel connects lazily: an unreachable learner shows up as the
// first call's error.
StatusOr<LearnerClient> ConnectLearner(const std::string &address,
                                       const std::string &auth_token_file,
                                       const std::string &tls_ca_file = "");

// Uploads the lines of `jsonl` (JSON Lines rows; read whole first) as one
// SubmitDataset call under a `timeout_seconds` deadline, ending with the message
// marked last: the learner stores the dataset whole or not at all. An empty
// `idempotency_key` means DatasetContentKey(lines), so a retry after any error
// is safe. The learner's error (e.g. InvalidArgument naming the bad row, ABORTED
// for an upload that broke off) otherwise.
// The idempotency key SubmitLines uses when none is given: "sha256:" + the hex SHA-256 of the
// lines (each prefixed by its 64-bit length), so resubmitting the same file adds nothing.
std::string DatasetContentKey(const std::vector<std::string> &lines);

StatusOr<v1::SubmitDatasetResponse> SubmitLines(const LearnerClient &client, std::istream &jsonl,
                                                const std::string &idempotency_key,
                                                const std::string &name, double timeout_seconds);

// Lets another thread end a FollowJob early (FollowJob then returns Cancelled).
// Thread-safe.
class WatchCanceller {
 public:
  void Cancel() GRPO_EXCLUDES(mu_);
  bool cancelled() const GRPO_EXCLUDES(mu_);
  // Used by FollowJob: the context of the stream being read, or null.
  void Attach(grpc::ClientContext *context) GRPO_EXCLUDES(mu_);

 private:
  mutable common::Mutex mu_;
  bool cancelled_ GRPO_GUARDED_BY(mu_) = false;
  grpc::ClientContext *context_ GRPO_GUARDED_BY(mu_) = nullptr;
};

// Streams WatchJob until the job ends, calling `on_event` for every event (a
// step event has metrics; a state change has none). Re-watches when the learner
// dropped a slow watcher. Returns the job's final state (done, cancelled or
// failed); the stream's error otherwise, Cancelled after `canceller` (may be
// null) cancelled it, Internal when the stream ended without a known state.
StatusOr<learner::JobState> FollowJob(const LearnerClient &client, double watch_timeout_seconds,
                                      const std::function<void(const v1::JobEvent &)> &on_event,
                                      WatchCanceller *canceller = nullptr);

// A step event as one JSON object: its metrics (TRL names) and "step".
nlohmann::json StepJson(const v1::JobEvent &event);
// The header of the step table, and one row of it (both end with a newline).
std::string StepTableHeader();
std::string StepTableRow(const v1::JobEvent &event);
// A state-change event as one line (no newline): "job running at step 3/60:
// message".
std::string JobStateLine(const v1::JobEvent &event);

}  // namespace grpo::services
