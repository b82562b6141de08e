// PromptLedger: the durable record of every prompt's state (docs/ARCHITECTURE.md "A prompt is in
// exactly one state" and "State and files"). SQLite in WAL mode; every mutating call is one
// transaction, so the state after reopening the file equals the state after the last call that
// returned OK. No gRPC here: services/ maps these calls onto the wire.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"

struct sqlite3;

namespace grpo::learner {

// kFiltered: done with its pass without being trained (dynamic sampling: its group had no
// learning signal); like kTrained, it is queued again at the next pass.
enum class PromptState { kQueued, kLeased, kTrained, kRejected, kFiltered };
// "QUEUED", "LEASED", "TRAINED", "REJECTED", "FILTERED" (also the spelling stored in the file).
std::string_view PromptStateName(PromptState state);

// How long a write waits for another connection's lock on the same file before Unavailable.
inline constexpr std::chrono::milliseconds kDefaultLedgerBusyTimeout{5000};

struct PromptLedgerOptions {
  // Wall-clock unix milliseconds; lease deadlines are stored in this clock, so they survive a
  // restart. Tests inject a fake. Empty = std::chrono::system_clock. Called under the ledger's
  // mutex, possibly from several threads.
  std::function<int64_t()> now_ms;
  std::chrono::milliseconds busy_timeout = kDefaultLedgerBusyTimeout;
};

struct DatasetInfo {
  std::string dataset_id;  // "ds-<n>", n = 1, 2, ... in submission order
  int64_t prompt_count = 0;
  bool created = false;  // false when an identical earlier submission was returned
};

// One leased prompt. The lease_id is the capability to complete, reject or release it.
struct Lease {
  std::string lease_id;  // 128 random bits, 32 lower-case hex digits
  std::string prompt_id;
  std::string row_json;     // the dataset line as submitted, outer whitespace trimmed
  int64_t deadline_ms = 0;  // unix ms; the lease is valid while now <= deadline
  int64_t pass = 0;         // 0-based pass (epoch) this prompt is being trained in
  int64_t attempts = 0;     // earlier leases of it that expired
};

struct PromptRecord {
  std::string prompt_id;
  std::string dataset_id;
  std::string row_json;
  PromptState state = PromptState::kQueued;
  std::string lease_id;           // empty unless LEASED
  int64_t lease_deadline_ms = 0;  // 0 unless LEASED
  std::string worker_id;          // the worker that holds or last held a lease on it
  int64_t attempts = 0;           // leases of it that expired
  std::string reject_reason;      // set when REJECTED
  int64_t pass = 0;
  int64_t created_ms = 0, updated_ms = 0;
};

struct LedgerCounts {
  int64_t queued = 0, leased = 0, trained = 0, rejected = 0, filtered = 0;
  int64_t accepted = 0;  // of `trained`: accepted, in no weights yet
  int64_t pass = 0;      // the job's current 0-based pass
  int64_t total() const { return queued + leased + trained + rejected + filtered; }
  // Done with the current pass: trained (or accepted) or filtered.
  int64_t done() const { return trained + filtered; }
};

// One group an optimizer step took: the prompt and the pass its lease was for.
struct TrainedGroup {
  std::string prompt_id;
  int64_t pass = 0;
};

// One (prompt, pass) the job is done with: trained, or filtered (dynamic sampling).
struct TrainingRecord {
  std::string prompt_id;
  int64_t pass = 0;
  // Trained: the weights after this optimizer step hold it. Filtered: the learner was at this
  // step when it filtered the group (a restore to an earlier step undoes the filtering too).
  int64_t step = 0;
  bool filtered = false;
};

struct RollbackResult {
  int64_t trainings_undone = 0;  // recorded after the step, removed
  int64_t requeued = 0;          // TRAINED (accepted or undone) -> QUEUED
  int64_t moved_back = 0;        // rows moved back to a pass they owe
};

// Thread-safe: every method takes one mutex around the SQLite handle. Errors name the file.
// One process should own a ledger file; a second connection only waits busy_timeout for locks.
class PromptLedger {
 public:
  // Creates the file (and schema) or opens and migrates an existing one. DataLoss for a file
  // that is not a ledger database, FailedPrecondition for a path that cannot be opened for
  // writing or a file written by a newer schema version.
  static StatusOr<std::unique_ptr<PromptLedger>> Open(const std::string& path,
                                                      PromptLedgerOptions options = {});
  ~PromptLedger();
  PromptLedger(const PromptLedger&) = delete;
  PromptLedger& operator=(const PromptLedger&) = delete;

  // Adds one dataset of JSONL lines; each non-blank line must be a prompt row
  // (common::ValidateDatasetRow: a non-empty "prompt" string or a non-empty "messages" array of
  // {"role", "content"} strings with a ChatML role).
  // Prompt ids are "<dataset_id>:<line index>" (0-based, blank lines skipped but counted).
  // A bad line rejects the whole submission: InvalidArgument naming the 1-based line; nothing
  // is stored. The same non-empty idempotency_key with the same lines returns the earlier
  // dataset (created = false); with different lines, AlreadyExists. An empty key never dedups.
  StatusOr<DatasetInfo> AddDataset(const std::string& idempotency_key,
                                   const std::vector<std::string>& jsonl_lines) GRPO_EXCLUDES(mu_);

  // Returns every LEASED prompt whose deadline has passed to QUEUED (attempts + 1), then leases
  // up to max_prompts QUEUED prompts, oldest first, each under a fresh lease id valid until
  // now + lease_duration. An empty result means nothing is queued. InvalidArgument on an empty
  // worker_id or a non-positive max_prompts or lease_duration.
  StatusOr<std::vector<Lease>> LeasePrompts(const std::string& worker_id, int64_t max_prompts,
                                            std::chrono::milliseconds lease_duration)
      GRPO_EXCLUDES(mu_);

  // The group pushed under this lease was accepted: LEASED -> TRAINED. FailedPrecondition
  // ("unknown or expired lease ...") unless the prompt is LEASED under exactly this lease id and
  // the lease has not expired; the prompt is then left as it was.
  Status CompleteLease(const std::string& lease_id, const std::string& prompt_id)
      GRPO_EXCLUDES(mu_);
  // The prompt itself is bad: LEASED -> REJECTED with the reason. Same lease check.
  Status RejectPrompt(const std::string& lease_id, const std::string& prompt_id,
                      const std::string& reason) GRPO_EXCLUDES(mu_);
  // Dynamic sampling: the group pushed under this lease had no learning signal (all rewards
  // equal). LEASED -> FILTERED: the prompt is done with its pass without being trained (recorded
  // in `trainings` as filtered at `step`, the learner's step now), not leased again in it, and
  // queued at the next pass like a trained one (or at once for an earlier pass it still owes).
  // Same lease check as CompleteLease.
  Status FilterPrompt(const std::string& lease_id, const std::string& prompt_id, int64_t step)
      GRPO_EXCLUDES(mu_);
  // The worker gives the prompt back unprocessed (shutting down): LEASED -> QUEUED, attempts
  // unchanged. Same lease check.
  Status ReleaseLease(const std::string& lease_id, const std::string& prompt_id) GRPO_EXCLUDES(mu_);

  // A worker is gone (it missed its heartbeats), or registered again as a new process: every
  // prompt LEASED to it, except under the lease ids in `keep` (those a live worker still
  // holds), -> QUEUED with attempts + 1, as if its leases had expired, so they need not wait out
  // lease_seconds. A group pushed later under one of them is refused as an unknown lease.
  // Returns how many moved.
  StatusOr<int64_t> ExpireWorkerLeases(const std::string& worker_id,
                                       const std::vector<std::string>& keep = {})
      GRPO_EXCLUDES(mu_);

  // --- What the model holds (schema v2). A TRAINED prompt is first only *accepted* (its group
  // waits in the learner's buffer, trained_step NULL); MarkTrained records that an optimizer
  // step took the group of (prompt, pass): the weights after `step` hold it. Each (prompt, pass)
  // is trained at most once; a second one is reported (FailedPrecondition, after recording the
  // rest). A prompt that owes an earlier pass (see RequeueTrained) is queued for it next.
  // Returns how many trainings were recorded.
  StatusOr<int64_t> MarkTrained(const std::vector<TrainedGroup>& groups, int64_t step)
      GRPO_EXCLUDES(mu_);
  // An accepted group of (prompt, pass) was not trained (refused as stale, or the job ended):
  // the prompt is queued for that pass again, now when its row is free (accepted in `pass`,
  // done with its pass, or queued for a later one), else when its current pass is trained.
  // True unless the prompt was REJECTED (nothing is owed); NotFound for an unknown prompt,
  // FailedPrecondition when (prompt, pass) was already trained.
  StatusOr<bool> RequeueTrained(const std::string& prompt_id, int64_t pass) GRPO_EXCLUDES(mu_);
  // Restore to the weights after optimizer step `step` (a checkpoint; 0 = the initial model;
  // INT64_MAX = keep every training, requeue only what is accepted): trainings after `step`
  // are undone, accepted and undone prompts go back to QUEUED in the earliest pass they owe
  // (a pass boundary after `step` is undone for them). Leased prompts keep their lease.
  StatusOr<RollbackResult> RollbackTo(int64_t step) GRPO_EXCLUDES(mu_);

  // Ends the current pass when every prompt is TRAINED (or accepted) or REJECTED in it and owes
  // no earlier pass: returns true after moving TRAINED -> QUEUED with pass + 1 (an accepted
  // prompt's buffered group still counts for the pass it was leased in), or false (and changes
  // nothing) when the pass just finished was the last of num_passes. FailedPrecondition while
  // prompts are QUEUED, LEASED or owe a pass, or when the ledger holds no prompts;
  // InvalidArgument when num_passes < 1.
  StatusOr<bool> StartNextPass(int64_t num_passes) GRPO_EXCLUDES(mu_);

  // Every recorded training and filtering, by step.
  StatusOr<std::vector<TrainingRecord>> Trainings() GRPO_EXCLUDES(mu_);

  // Prompts per state over the whole ledger, or over one dataset (NotFound if unknown).
  StatusOr<LedgerCounts> Counts() GRPO_EXCLUDES(mu_);
  StatusOr<LedgerCounts> CountsForDataset(const std::string& dataset_id) GRPO_EXCLUDES(mu_);
  // One prompt's full row; NotFound if unknown.
  StatusOr<PromptRecord> GetPrompt(const std::string& prompt_id) GRPO_EXCLUDES(mu_);

  const std::string& path() const { return path_; }
  // The ledger's clock (unix ms): lease deadlines and updated_ms use it.
  int64_t NowMs() const { return options_.now_ms(); }

 private:
  enum class LeaseAction { kComplete, kReject, kRelease };

  PromptLedger(std::string path, sqlite3* db, PromptLedgerOptions options);

  Status Migrate() GRPO_REQUIRES(mu_);
  Status FinishLease(LeaseAction action, const std::string& lease_id, const std::string& prompt_id,
                     const std::string& reason) GRPO_EXCLUDES(mu_);
  // OK when the prompt is LEASED under exactly `lease_id` and the lease holds at `now`; else
  // FailedPrecondition ("unknown or expired lease ...").
  Status CheckLeaseLocked(const std::string& lease_id, const std::string& prompt_id, int64_t now)
      GRPO_REQUIRES(mu_);
  StatusOr<LedgerCounts> CountsLocked(const std::string* dataset_id) GRPO_REQUIRES(mu_);
  std::string NewLeaseId() GRPO_REQUIRES(mu_);

  const std::string path_;
  const PromptLedgerOptions options_;
  common::Mutex mu_;
  // Owned. Guarded itself, not only its pointee: every use of the handle is a call on it.
  sqlite3* db_ GRPO_GUARDED_BY(mu_);
  std::random_device rd_ GRPO_GUARDED_BY(mu_);  // lease ids
};

}  // namespace grpo::learner
