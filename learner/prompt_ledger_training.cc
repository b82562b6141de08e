// The prompt ledger, its training half: which step trained each pass of a prompt
// (MarkTrained, Trainings), requeues and rollbacks (RequeueTrained, ExpireWorkerLeases,
// RollbackTo), passes (StartNextPass) and the counts. Opening, datasets and leases are in
// prompt_ledger.cc.
#include <sqlite3.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "learner/prompt_ledger.h"
#include "learner/prompt_ledger_sql.h"

namespace grpo::learner {

using namespace ledger_sql;  // NOLINT: the ledger's own helpers

namespace {

// The `pass` column of `sql`'s rows for `prompt_id` (its one parameter), as it orders them.
StatusOr<std::vector<int64_t>> PassesOf(const std::string& path, sqlite3* db, const char* sql,
                                        const std::string& prompt_id) {
  ASSIGN_OR_RETURN(Statement select, Statement::Prepare(path, db, sql));
  select.Bind(1, prompt_id);
  std::vector<int64_t> passes;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    passes.push_back(select.Int(0));
  }
  return passes;
}

// The passes of `prompt_id` the job is done with (trained or filtered), ascending.
StatusOr<std::vector<int64_t>> TrainedPasses(const std::string& path, sqlite3* db,
                                             const std::string& prompt_id) {
  return PassesOf(path, db, "SELECT pass FROM trainings WHERE prompt_id = ? ORDER BY pass",
                  prompt_id);
}

// The passes of `prompt_id` whose group was accepted and is not trained yet, ascending.
StatusOr<std::vector<int64_t>> AcceptedPasses(const std::string& path, sqlite3* db,
                                              const std::string& prompt_id) {
  return PassesOf(path, db, "SELECT pass FROM accepted WHERE prompt_id = ? ORDER BY pass",
                  prompt_id);
}

// The group of (prompt, pass) is no longer waiting to be trained (trained, or refused).
Status ForgetAccepted(const std::string& path, sqlite3* db, const std::string& prompt_id,
                      int64_t pass) {
  ASSIGN_OR_RETURN(
      Statement del,
      Statement::Prepare(path, db, "DELETE FROM accepted WHERE prompt_id = ? AND pass = ?"));
  return del.Bind(1, prompt_id).Bind(2, pass).Run();
}

// The first pass in [first_pass, up_to] missing from `trained` (ascending), or -1.
int64_t FirstMissingPass(const std::vector<int64_t>& trained, int64_t first_pass, int64_t up_to) {
  int64_t want = first_pass;
  for (int64_t p : trained) {
    if (p < want) continue;
    if (p > want) break;
    ++want;
  }
  return want <= up_to ? want : -1;
}

StatusOr<int64_t> JobPass(const std::string& path, sqlite3* db) {
  ASSIGN_OR_RETURN(Statement job, Statement::Prepare(path, db, "SELECT pass FROM job"));
  ASSIGN_OR_RETURN(bool has_job, job.Step());
  if (!has_job) return Status::DataLoss("prompt ledger " + path + ": job row is missing");
  return job.Int(0);
}

struct RowState {
  std::string state;
  int64_t pass = 0, first_pass = 0;
  bool has_trained_step = false;
};

StatusOr<std::optional<RowState>> ReadRow(const std::string& path, sqlite3* db,
                                          const std::string& prompt_id) {
  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path, db,
                                      "SELECT state, pass, first_pass, trained_step IS NOT NULL "
                                      "FROM prompts WHERE id = ?"));
  ASSIGN_OR_RETURN(bool found, select.Bind(1, prompt_id).Step());
  if (!found) return std::optional<RowState>();
  return std::optional<RowState>(
      RowState{select.Text(0), select.Int(1), select.Int(2), select.Int(3) != 0});
}

// Moves a prompt's row to QUEUED in `pass` (its lease, if any, is gone).
Status QueueRow(const std::string& path, sqlite3* db, const std::string& prompt_id, int64_t pass,
                int64_t now) {
  ASSIGN_OR_RETURN(Statement update,
                   Statement::Prepare(path, db,
                                      "UPDATE prompts SET state = 'QUEUED', pass = ?, "
                                      "trained_step = NULL, lease_id = NULL, "
                                      "lease_deadline_ms = NULL, updated_ms = ? WHERE id = ?"));
  return update.Bind(1, pass).Bind(2, now).Bind(3, prompt_id).Run();
}

}  // namespace

StatusOr<int64_t> PromptLedger::MarkTrained(const std::vector<TrainedGroup>& groups, int64_t step) {
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  ASSIGN_OR_RETURN(const int64_t job_pass, JobPass(path_, db_));
  // Every training of the batch first, then the rows: a batch may hold two passes of a prompt.
  ASSIGN_OR_RETURN(Statement insert,
                   Statement::Prepare(path_, db_,
                                      "INSERT OR IGNORE INTO trainings (prompt_id, pass, step) "
                                      "VALUES (?, ?, ?)"));
  ASSIGN_OR_RETURN(Statement count,
                   Statement::Prepare(path_, db_,
                                      "UPDATE prompts SET trained_passes = trained_passes + 1 "
                                      "WHERE id = ?"));
  std::vector<std::string> duplicates;
  std::vector<std::string> prompts;
  int64_t marked = 0;
  for (const TrainedGroup& g : groups) {
    RETURN_IF_ERROR(ForgetAccepted(path_, db_, g.prompt_id, g.pass));
    insert.Reset();
    RETURN_IF_ERROR(insert.Bind(1, g.prompt_id).Bind(2, g.pass).Bind(3, step).Run());
    if (sqlite3_changes(db_) == 0) {
      duplicates.push_back(g.prompt_id + " (pass " + std::to_string(g.pass) + ")");
      continue;
    }
    count.Reset();
    RETURN_IF_ERROR(count.Bind(1, g.prompt_id).Run());
    ++marked;
    prompts.push_back(g.prompt_id);
  }
  ASSIGN_OR_RETURN(Statement set_step,
                   Statement::Prepare(path_, db_,
                                      "UPDATE prompts SET trained_step = ?, updated_ms = ? "
                                      "WHERE id = ?"));
  for (const std::string& id : prompts) {
    ASSIGN_OR_RETURN(std::optional<RowState> row, ReadRow(path_, db_, id));
    if (!row || row->state == "REJECTED") continue;
    ASSIGN_OR_RETURN(std::vector<int64_t> trained, TrainedPasses(path_, db_, id));
    const bool row_pass_trained = std::binary_search(trained.begin(), trained.end(), row->pass);
    if (row->state == "TRAINED" && !row->has_trained_step && row_pass_trained) {
      set_step.Reset();
      RETURN_IF_ERROR(set_step.Bind(1, step).Bind(2, now).Bind(3, id).Run());
      row->has_trained_step = true;
    }
    // A pass the prompt still owes (a stale group refused after the pass moved on, or an
    // earlier pass of a prompt trained out of order) is taken next.
    const int64_t missing = FirstMissingPass(trained, row->first_pass, job_pass);
    if (missing < 0) continue;
    if ((row->state == "TRAINED" && row->has_trained_step) || row->state == "FILTERED" ||
        (row->state == "QUEUED" && missing < row->pass)) {
      RETURN_IF_ERROR(QueueRow(path_, db_, id, missing, now));
    }
  }
  RETURN_IF_ERROR(txn.Commit());
  if (!duplicates.empty()) {
    std::string list;
    for (size_t i = 0; i < duplicates.size() && i < 8; ++i) list += (i ? ", " : "") + duplicates[i];
    return Status::FailedPrecondition(
        "prompt ledger " + path_ + ": " + std::to_string(duplicates.size()) +
        " groups were trained in a pass that already had one: " + list);
  }
  return marked;
}

Status PromptLedger::FilterPrompt(const std::string& lease_id, const std::string& prompt_id,
                                  int64_t step) {
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  RETURN_IF_ERROR(CheckLeaseLocked(lease_id, prompt_id, now));
  ASSIGN_OR_RETURN(std::optional<RowState> row, ReadRow(path_, db_, prompt_id));
  if (!row) return Status::NotFound("prompt ledger " + path_ + ": no prompt " + prompt_id);
  ASSIGN_OR_RETURN(Statement insert,
                   Statement::Prepare(path_, db_,
                                      "INSERT OR IGNORE INTO trainings (prompt_id, pass, step, "
                                      "filtered) VALUES (?, ?, ?, 1)"));
  RETURN_IF_ERROR(insert.Bind(1, prompt_id).Bind(2, row->pass).Bind(3, step).Run());
  if (sqlite3_changes(db_) == 0) {
    return Status::FailedPrecondition("prompt ledger " + path_ + ": prompt " + prompt_id +
                                      " is already done with pass " + std::to_string(row->pass));
  }
  ASSIGN_OR_RETURN(Statement update,
                   Statement::Prepare(path_, db_,
                                      "UPDATE prompts SET state = 'FILTERED', lease_id = NULL, "
                                      "lease_deadline_ms = NULL, trained_step = ?1, "
                                      "trained_passes = trained_passes + 1, updated_ms = ?2 "
                                      "WHERE id = ?3"));
  RETURN_IF_ERROR(update.Bind(1, step).Bind(2, now).Bind(3, prompt_id).Run());
  // An earlier pass it still owes (a stale group refused after the pass moved on) is next;
  // not one whose group waits in the buffer (a filtering may come before it is trained).
  ASSIGN_OR_RETURN(const int64_t job_pass, JobPass(path_, db_));
  ASSIGN_OR_RETURN(std::vector<int64_t> done, TrainedPasses(path_, db_, prompt_id));
  ASSIGN_OR_RETURN(std::vector<int64_t> waiting, AcceptedPasses(path_, db_, prompt_id));
  done.insert(done.end(), waiting.begin(), waiting.end());
  std::sort(done.begin(), done.end());
  const int64_t missing = FirstMissingPass(done, row->first_pass, job_pass);
  if (missing >= 0) RETURN_IF_ERROR(QueueRow(path_, db_, prompt_id, missing, now));
  return txn.Commit();
}

StatusOr<bool> PromptLedger::RequeueTrained(const std::string& prompt_id, int64_t pass) {
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  ASSIGN_OR_RETURN(std::optional<RowState> row, ReadRow(path_, db_, prompt_id));
  if (!row) return Status::NotFound("prompt ledger " + path_ + ": no prompt " + prompt_id);
  RETURN_IF_ERROR(ForgetAccepted(path_, db_, prompt_id, pass));
  if (row->state == "REJECTED") {
    RETURN_IF_ERROR(txn.Commit());
    return false;
  }
  ASSIGN_OR_RETURN(std::vector<int64_t> trained, TrainedPasses(path_, db_, prompt_id));
  if (std::binary_search(trained.begin(), trained.end(), pass)) {
    return Status::FailedPrecondition("prompt ledger " + path_ + ": prompt " + prompt_id +
                                      " was already trained in pass " + std::to_string(pass));
  }
  if ((row->state == "TRAINED" && (row->pass == pass || row->has_trained_step)) ||
      row->state == "FILTERED" || (row->state == "QUEUED" && pass < row->pass)) {
    RETURN_IF_ERROR(QueueRow(path_, db_, prompt_id, pass, now));
  }
  // Otherwise the row is busy with another pass (LEASED, or accepted in another pass): when
  // that pass is trained, MarkTrained queues the pass still owed.
  RETURN_IF_ERROR(txn.Commit());
  return true;
}

StatusOr<int64_t> PromptLedger::ExpireWorkerLeases(const std::string& worker_id,
                                                   const std::vector<std::string>& keep) {
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path_, db_,
                                      "SELECT id, lease_id FROM prompts "
                                      "WHERE state = 'LEASED' AND worker_id = ?"));
  select.Bind(1, worker_id);
  std::vector<std::string> expire;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    if (std::find(keep.begin(), keep.end(), select.Text(1)) == keep.end()) {
      expire.push_back(select.Text(0));
    }
  }
  ASSIGN_OR_RETURN(Statement update,
                   Statement::Prepare(path_, db_,
                                      "UPDATE prompts SET state = 'QUEUED', lease_id = NULL, "
                                      "lease_deadline_ms = NULL, attempts = attempts + 1, "
                                      "updated_ms = ? WHERE id = ?"));
  for (const std::string& id : expire) {
    update.Reset();
    RETURN_IF_ERROR(update.Bind(1, now).Bind(2, id).Run());
  }
  RETURN_IF_ERROR(txn.Commit());
  return static_cast<int64_t>(expire.size());
}

StatusOr<RollbackResult> PromptLedger::RollbackTo(int64_t step) {
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  RollbackResult result;
  // The learner's buffer is gone (a restart, or the job's end): nothing accepted waits any more.
  RETURN_IF_ERROR(Exec(path_, db_, "DELETE FROM accepted", "forget accepted groups"));
  {
    ASSIGN_OR_RETURN(Statement del,
                     Statement::Prepare(path_, db_, "DELETE FROM trainings WHERE step > ?"));
    RETURN_IF_ERROR(del.Bind(1, step).Run());
    result.trainings_undone = sqlite3_changes(db_);
  }
  if (result.trainings_undone > 0) {
    RETURN_IF_ERROR(Exec(path_, db_,
                         "UPDATE prompts SET trained_passes = (SELECT COUNT(*) FROM trainings t "
                         "WHERE t.prompt_id = prompts.id)",
                         "recount trainings"));
  }
  {
    // Accepted but in no restored weights, or filtered after the restored step: back to the
    // queue in the same pass.
    ASSIGN_OR_RETURN(Statement requeue,
                     Statement::Prepare(path_, db_,
                                        "UPDATE prompts SET state = 'QUEUED', trained_step = NULL, "
                                        "updated_ms = ?1 WHERE (state = 'TRAINED' AND "
                                        "(trained_step IS NULL OR trained_step > ?2)) OR "
                                        "(state = 'FILTERED' AND trained_step > ?2)"));
    RETURN_IF_ERROR(requeue.Bind(1, now).Bind(2, step).Run());
    result.requeued = sqlite3_changes(db_);
  }
  // Prompts that owe an earlier pass than their row's (a pass boundary after the restored
  // step moved them on): back to the earliest pass they owe. Leased rows are left to their
  // lease; MarkTrained takes the owed pass after it.
  ASSIGN_OR_RETURN(const int64_t job_pass, JobPass(path_, db_));
  struct Owing {
    std::string id, state;
    int64_t pass = 0, first_pass = 0;
  };
  std::vector<Owing> rows;
  {
    ASSIGN_OR_RETURN(
        Statement select,
        Statement::Prepare(path_, db_,
                           "SELECT id, state, pass, first_pass FROM prompts "
                           "WHERE state IN ('QUEUED', 'TRAINED', 'FILTERED') AND "
                           "trained_passes < pass - first_pass + (state != 'QUEUED')"));
    while (true) {
      ASSIGN_OR_RETURN(bool has_row, select.Step());
      if (!has_row) break;
      rows.push_back({select.Text(0), select.Text(1), select.Int(2), select.Int(3)});
    }
  }
  for (const Owing& row : rows) {
    ASSIGN_OR_RETURN(std::vector<int64_t> trained, TrainedPasses(path_, db_, row.id));
    const int64_t missing = FirstMissingPass(trained, row.first_pass, job_pass);
    // A queued row moves back only to an earlier pass; a done one to any pass it owes.
    const bool move = row.state == "QUEUED" ? missing >= 0 && missing < row.pass
                                            : missing >= 0 && missing <= row.pass;
    if (!move) continue;
    if (row.state != "QUEUED") ++result.requeued;
    RETURN_IF_ERROR(QueueRow(path_, db_, row.id, missing, now));
    ++result.moved_back;
  }
  RETURN_IF_ERROR(txn.Commit());
  return result;
}

StatusOr<bool> PromptLedger::StartNextPass(int64_t num_passes) {
  if (num_passes < 1) {
    return Status::InvalidArgument("StartNextPass: num_passes must be >= 1, got " +
                                   std::to_string(num_passes));
  }
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  ASSIGN_OR_RETURN(LedgerCounts counts, CountsLocked(nullptr));
  if (counts.total() == 0)
    return Status::FailedPrecondition("StartNextPass: ledger has no prompts");
  if (counts.queued + counts.leased > 0) {
    return Status::FailedPrecondition("StartNextPass: pass " + std::to_string(counts.pass) +
                                      " is not finished (" + std::to_string(counts.queued) +
                                      " queued, " + std::to_string(counts.leased) + " leased)");
  }
  if (counts.pass + 1 >= num_passes) return false;
  {
    // Every prompt must be trained (or accepted) in every pass up to this one.
    ASSIGN_OR_RETURN(Statement owing,
                     Statement::Prepare(path_, db_,
                                        "SELECT COUNT(*) FROM prompts WHERE state IN "
                                        "('TRAINED', 'FILTERED') AND "
                                        "trained_passes + (trained_step IS NULL) < "
                                        "? - first_pass + 1"));
    ASSIGN_OR_RETURN(bool row, owing.Bind(1, counts.pass).Step());
    (void)row;
    if (owing.Int(0) > 0) {
      return Status::FailedPrecondition("StartNextPass: " + std::to_string(owing.Int(0)) +
                                        " prompts still owe a training of an earlier pass");
    }
  }
  const int64_t next = counts.pass + 1;
  // Accepted prompts move on too: their group of this pass, still buffered, is recorded by
  // MarkTrained under this pass (or requeued into it) whatever their row's pass is by then.
  ASSIGN_OR_RETURN(Statement requeue,
                   Statement::Prepare(path_, db_,
                                      "UPDATE prompts SET state = 'QUEUED', pass = ?, "
                                      "trained_step = NULL, updated_ms = ? "
                                      "WHERE state IN ('TRAINED', 'FILTERED')"));
  RETURN_IF_ERROR(requeue.Bind(1, next).Bind(2, now).Run());
  ASSIGN_OR_RETURN(Statement job, Statement::Prepare(path_, db_, "UPDATE job SET pass = ?"));
  RETURN_IF_ERROR(job.Bind(1, next).Run());
  RETURN_IF_ERROR(txn.Commit());
  return true;
}

StatusOr<std::vector<TrainingRecord>> PromptLedger::Trainings() {
  common::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path_, db_,
                                      "SELECT prompt_id, pass, step, filtered FROM trainings "
                                      "ORDER BY step, prompt_id, pass"));
  std::vector<TrainingRecord> out;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    out.push_back(TrainingRecord{select.Text(0), select.Int(1), select.Int(2), select.Int(3) != 0});
  }
  return out;
}

StatusOr<LedgerCounts> PromptLedger::Counts() {
  common::MutexLock lock(&mu_);
  return CountsLocked(nullptr);
}

StatusOr<LedgerCounts> PromptLedger::CountsForDataset(const std::string& dataset_id) {
  common::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Statement find,
                   Statement::Prepare(path_, db_, "SELECT 1 FROM datasets WHERE id = ?"));
  ASSIGN_OR_RETURN(bool found, find.Bind(1, dataset_id).Step());
  if (!found) return Status::NotFound("prompt ledger " + path_ + ": no dataset " + dataset_id);
  return CountsLocked(&dataset_id);
}

StatusOr<LedgerCounts> PromptLedger::CountsLocked(const std::string* dataset_id) {
  LedgerCounts counts;
  ASSIGN_OR_RETURN(counts.pass, JobPass(path_, db_));

  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path_, db_,
                                      dataset_id == nullptr
                                          ? "SELECT state, COUNT(*), "
                                            "SUM(state = 'TRAINED' AND trained_step IS NULL) "
                                            "FROM prompts GROUP BY state"
                                          : "SELECT state, COUNT(*), "
                                            "SUM(state = 'TRAINED' AND trained_step IS NULL) "
                                            "FROM prompts WHERE dataset_id = ? GROUP BY state"));
  if (dataset_id != nullptr) select.Bind(1, *dataset_id);
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    ASSIGN_OR_RETURN(PromptState state, ParseState(select.Text(0)));
    const int64_t n = select.Int(1);
    counts.accepted += select.Int(2);
    switch (state) {
      case PromptState::kQueued:
        counts.queued = n;
        break;
      case PromptState::kLeased:
        counts.leased = n;
        break;
      case PromptState::kTrained:
        counts.trained += n;
        break;
      case PromptState::kRejected:
        counts.rejected = n;
        break;
      case PromptState::kFiltered:
        counts.filtered = n;
        break;
    }
  }
  return counts;
}

StatusOr<PromptRecord> PromptLedger::GetPrompt(const std::string& prompt_id) {
  common::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path_, db_,
                                      "SELECT id, dataset_id, row_json, state, lease_id, "
                                      "lease_deadline_ms, worker_id, attempts, reject_reason, "
                                      "pass, created_ms, updated_ms FROM prompts WHERE id = ?"));
  ASSIGN_OR_RETURN(bool found, select.Bind(1, prompt_id).Step());
  if (!found) return Status::NotFound("prompt ledger " + path_ + ": no prompt " + prompt_id);
  PromptRecord r;
  r.prompt_id = select.Text(0);
  r.dataset_id = select.Text(1);
  r.row_json = select.Text(2);
  ASSIGN_OR_RETURN(r.state, ParseState(select.Text(3)));
  r.lease_id = select.Text(4);
  r.lease_deadline_ms = select.Int(5);
  r.worker_id = select.Text(6);
  r.attempts = select.Int(7);
  r.reject_reason = select.Text(8);
  r.pass = select.Int(9);
  r.created_ms = select.Int(10);
  r.updated_ms = select.Int(11);
  return r;
}

}  // namespace grpo::learner
