#include "learner/prompt_ledger.h"

#include <sqlite3.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <utility>

#include "common/sha256.h"
#include "common/tokenizer/dataset_row.h"
#include "learner/prompt_ledger_sql.h"

namespace grpo::learner {

using namespace ledger_sql;  // NOLINT: the ledger's own helpers

namespace {

// Bump when the schema changes and append the step to kMigrations.
constexpr int64_t kSchemaVersion = 3;

// kMigrations[v] takes a file from schema version v to v + 1 (v = 0: an empty file).
constexpr const char* kMigrations[] = {
    R"sql(
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE job (
  id         INTEGER PRIMARY KEY CHECK (id = 1),
  pass       INTEGER NOT NULL,   -- current 0-based pass (epoch)
  created_ms INTEGER NOT NULL
);
CREATE TABLE datasets (
  seq             INTEGER PRIMARY KEY,
  id              TEXT NOT NULL UNIQUE,
  idempotency_key TEXT UNIQUE,   -- NULL: submitted without a key
  content_sha256  TEXT NOT NULL,
  prompt_count    INTEGER NOT NULL,
  created_ms      INTEGER NOT NULL
);
CREATE TABLE prompts (
  seq               INTEGER PRIMARY KEY,   -- insertion order: leases are FIFO by seq
  id                TEXT NOT NULL UNIQUE,  -- "<dataset id>:<line index>"
  dataset_id        TEXT NOT NULL REFERENCES datasets (id),
  row_json          TEXT NOT NULL,
  state             TEXT NOT NULL CHECK (state IN ('QUEUED', 'LEASED', 'TRAINED', 'REJECTED')),
  lease_id          TEXT,                  -- set iff LEASED
  lease_deadline_ms INTEGER,               -- unix ms; set iff LEASED
  worker_id         TEXT,                  -- holds or last held a lease
  attempts          INTEGER NOT NULL DEFAULT 0,  -- leases that expired
  reject_reason     TEXT,
  pass              INTEGER NOT NULL,
  created_ms        INTEGER NOT NULL,
  updated_ms        INTEGER NOT NULL
);
CREATE INDEX prompts_by_state ON prompts (state, seq);
CREATE INDEX prompts_by_dataset ON prompts (dataset_id, state);
)sql",
    // v2: what the model holds, per pass. A TRAINED prompt whose trained_step is NULL was
    // accepted (its group is buffered) but is in no weights yet; `trainings` has one row per
    // (prompt, pass) whose group an optimizer step took, with the step after which the weights
    // hold it, so a restore to checkpoint S undoes exactly the trainings after S. A v1 file's
    // TRAINED prompts and earlier passes count as trained at step 0 (v1 had no record).
    R"sql(
ALTER TABLE prompts ADD COLUMN trained_step INTEGER;
ALTER TABLE prompts ADD COLUMN first_pass INTEGER NOT NULL DEFAULT 0;
ALTER TABLE prompts ADD COLUMN trained_passes INTEGER NOT NULL DEFAULT 0;
CREATE TABLE trainings (
  prompt_id TEXT NOT NULL,
  pass      INTEGER NOT NULL,
  step      INTEGER NOT NULL,
  PRIMARY KEY (prompt_id, pass)
) WITHOUT ROWID;
CREATE INDEX trainings_by_step ON trainings (step);
CREATE INDEX prompts_by_state_pass ON prompts (state, pass, seq);
UPDATE prompts SET trained_step = 0 WHERE state = 'TRAINED';
UPDATE prompts SET trained_passes = pass + (state = 'TRAINED') WHERE state != 'REJECTED';
INSERT INTO trainings (prompt_id, pass, step)
  WITH RECURSIVE p(id, k, n) AS (
    SELECT id, 0, trained_passes FROM prompts WHERE trained_passes > 0
    UNION ALL SELECT id, k + 1, n FROM p WHERE k + 1 < n)
  SELECT id, k, 0 FROM p;
)sql",
    // v3: dynamic sampling. A prompt may be FILTERED: done with its pass untrained (its group
    // had no learning signal). `trainings` then holds its (prompt, pass) with filtered = 1 and
    // the step the learner was at; trained_passes counts the passes done either way. SQLite
    // cannot change a CHECK constraint in place, so the prompts table is copied. `accepted`
    // holds every (prompt, pass) whose group was accepted and is not trained yet, across pass
    // boundaries (the row's own trained_step IS NULL says so only for its current pass), so
    // that a filtering does not take a pass whose group waits in the buffer for one it owes.
    R"sql(
CREATE TABLE prompts_v3 (
  seq               INTEGER PRIMARY KEY,
  id                TEXT NOT NULL UNIQUE,
  dataset_id        TEXT NOT NULL REFERENCES datasets (id),
  row_json          TEXT NOT NULL,
  state             TEXT NOT NULL
                    CHECK (state IN ('QUEUED', 'LEASED', 'TRAINED', 'REJECTED', 'FILTERED')),
  lease_id          TEXT,
  lease_deadline_ms INTEGER,
  worker_id         TEXT,
  attempts          INTEGER NOT NULL DEFAULT 0,
  reject_reason     TEXT,
  pass              INTEGER NOT NULL,
  created_ms        INTEGER NOT NULL,
  updated_ms        INTEGER NOT NULL,
  trained_step      INTEGER,   -- TRAINED: NULL while only accepted; FILTERED: the step
  first_pass        INTEGER NOT NULL DEFAULT 0,
  trained_passes    INTEGER NOT NULL DEFAULT 0   -- rows in trainings (trained or filtered)
);
INSERT INTO prompts_v3 (seq, id, dataset_id, row_json, state, lease_id, lease_deadline_ms,
                        worker_id, attempts, reject_reason, pass, created_ms, updated_ms,
                        trained_step, first_pass, trained_passes)
  SELECT seq, id, dataset_id, row_json, state, lease_id, lease_deadline_ms, worker_id, attempts,
         reject_reason, pass, created_ms, updated_ms, trained_step, first_pass, trained_passes
  FROM prompts;
DROP TABLE prompts;
ALTER TABLE prompts_v3 RENAME TO prompts;
CREATE INDEX prompts_by_state ON prompts (state, seq);
CREATE INDEX prompts_by_dataset ON prompts (dataset_id, state);
CREATE INDEX prompts_by_state_pass ON prompts (state, pass, seq);
ALTER TABLE trainings ADD COLUMN filtered INTEGER NOT NULL DEFAULT 0;
CREATE TABLE accepted (
  prompt_id TEXT NOT NULL,
  pass      INTEGER NOT NULL,
  PRIMARY KEY (prompt_id, pass)
) WITHOUT ROWID;
INSERT INTO accepted (prompt_id, pass)
  SELECT id, pass FROM prompts WHERE state = 'TRAINED' AND trained_step IS NULL;
)sql",
};
static_assert(std::size(kMigrations) == kSchemaVersion);

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string_view Trim(std::string_view s) {
  const char* kSpace = " \t\r\n\f\v";
  const size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
}

// Empty when `line` is a valid prompt row (common/tokenizer/dataset_row.h), else why not.
std::string ValidateRow(std::string_view line) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    return std::string("not valid JSON (") + e.what() + ")";
  }
  const Status s = common::ValidateDatasetRow(j);
  return s.ok() ? std::string() : s.message();
}

struct ParsedRow {
  int64_t index;          // 0-based line index in the submission
  std::string_view json;  // trimmed line
};

}  // namespace

std::string_view PromptStateName(PromptState state) {
  switch (state) {
    case PromptState::kQueued:
      return "QUEUED";
    case PromptState::kLeased:
      return "LEASED";
    case PromptState::kTrained:
      return "TRAINED";
    case PromptState::kRejected:
      return "REJECTED";
    case PromptState::kFiltered:
      return "FILTERED";
  }
  return "UNKNOWN";
}

PromptLedger::PromptLedger(std::string path, sqlite3* db, PromptLedgerOptions options)
    : path_(std::move(path)), options_(std::move(options)), db_(db) {}

PromptLedger::~PromptLedger() { sqlite3_close_v2(db_); }

StatusOr<std::unique_ptr<PromptLedger>> PromptLedger::Open(const std::string& path,
                                                           PromptLedgerOptions options) {
  if (path.empty()) return Status::InvalidArgument("prompt ledger: empty path");
  if (!options.now_ms) options.now_ms = SystemNowMs;
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    Status s = SqliteError(path, db, rc, "open");
    sqlite3_close_v2(db);
    return s;
  }
  // Owns db from here on, so every early return closes it.
  std::unique_ptr<PromptLedger> ledger(new PromptLedger(path, db, std::move(options)));
  common::MutexLock lock(&ledger->mu_);
  sqlite3_busy_timeout(db, static_cast<int>(ledger->options_.busy_timeout.count()));

  // WAL: readers never block the writer, and a commit is one append to the log.
  {
    ASSIGN_OR_RETURN(Statement wal, Statement::Prepare(path, db, "PRAGMA journal_mode=WAL"));
    ASSIGN_OR_RETURN(bool has_row, wal.Step());
    if (!has_row || wal.Text(0) != "wal") {
      return Status::FailedPrecondition("prompt ledger " + path + ": cannot use WAL journal mode");
    }
  }
  // FULL, not NORMAL: in WAL mode NORMAL skips the fsync at commit, so a power loss can undo
  // commits whose results were already acked to clients (an accepted dataset, a granted lease,
  // a trained prompt). Ledger commits are one per RPC, so the extra fsync is cheap.
  RETURN_IF_ERROR(Exec(path, db, "PRAGMA synchronous=FULL", "set synchronous"));
  RETURN_IF_ERROR(Exec(path, db, "PRAGMA foreign_keys=ON", "enable foreign keys"));
  RETURN_IF_ERROR(ledger->Migrate());
  return ledger;
}

Status PromptLedger::Migrate() {
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  // Each statement is finalized before the migrations run: an open cursor on sqlite_master
  // would lock the tables that a migration drops.
  int64_t num_tables = 0;
  bool has_version = false;
  {
    ASSIGN_OR_RETURN(
        Statement tables,
        Statement::Prepare(path_, db_,
                           "SELECT COUNT(*), COALESCE(SUM(name = 'schema_version'), 0) "
                           "FROM sqlite_master WHERE type = 'table'"));
    ASSIGN_OR_RETURN(bool row, tables.Step());
    (void)row;  // an aggregate always returns one row
    num_tables = tables.Int(0);
    has_version = tables.Int(1) > 0;
  }
  int64_t version = 0;
  if (has_version) {
    ASSIGN_OR_RETURN(Statement v,
                     Statement::Prepare(path_, db_, "SELECT MAX(version) FROM schema_version"));
    ASSIGN_OR_RETURN(bool has, v.Step());
    if (!has || v.IsNull(0)) {
      return Status::DataLoss("prompt ledger " + path_ + ": schema_version table is empty");
    }
    version = v.Int(0);
  } else if (num_tables > 0) {
    return Status::FailedPrecondition("prompt ledger " + path_ +
                                      ": an SQLite database that is not a prompt ledger");
  }
  if (version > kSchemaVersion) {
    return Status::FailedPrecondition("prompt ledger " + path_ + ": schema version " +
                                      std::to_string(version) + " is newer than this binary's " +
                                      std::to_string(kSchemaVersion));
  }
  if (version == kSchemaVersion) return txn.Commit();
  for (int64_t v = version; v < kSchemaVersion; ++v) {
    RETURN_IF_ERROR(
        Exec(path_, db_, kMigrations[v], "migrate schema to version " + std::to_string(v + 1)));
  }
  if (version == 0) {
    ASSIGN_OR_RETURN(
        Statement job,
        Statement::Prepare(path_, db_, "INSERT INTO job (id, pass, created_ms) VALUES (1, 0, ?)"));
    RETURN_IF_ERROR(job.Bind(1, options_.now_ms()).Run());
  }
  RETURN_IF_ERROR(Exec(path_, db_, "DELETE FROM schema_version", "set schema version"));
  ASSIGN_OR_RETURN(Statement set,
                   Statement::Prepare(path_, db_, "INSERT INTO schema_version VALUES (?)"));
  RETURN_IF_ERROR(set.Bind(1, kSchemaVersion).Run());
  return txn.Commit();
}

StatusOr<DatasetInfo> PromptLedger::AddDataset(const std::string& idempotency_key,
                                               const std::vector<std::string>& jsonl_lines) {
  // Validate and hash outside the lock: parsing a large dataset must not stall leasing.
  std::vector<ParsedRow> rows;
  rows.reserve(jsonl_lines.size());
  common::Sha256 hasher;
  for (size_t i = 0; i < jsonl_lines.size(); ++i) {
    const std::string& line = jsonl_lines[i];
    const uint64_t size = line.size();
    hasher.Update(&size, sizeof(size));
    hasher.Update(line.data(), line.size());
    const std::string_view trimmed = Trim(line);
    if (trimmed.empty()) continue;
    if (std::string why = ValidateRow(trimmed); !why.empty()) {
      return Status::InvalidArgument("dataset line " + std::to_string(i + 1) + ": " + why);
    }
    rows.push_back({static_cast<int64_t>(i), trimmed});
  }
  if (rows.empty()) return Status::InvalidArgument("dataset has no prompts");
  const std::string content_sha256 = hasher.HexDigest();

  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  if (!idempotency_key.empty()) {
    ASSIGN_OR_RETURN(Statement find,
                     Statement::Prepare(path_, db_,
                                        "SELECT id, content_sha256, prompt_count FROM datasets "
                                        "WHERE idempotency_key = ?"));
    ASSIGN_OR_RETURN(bool found, find.Bind(1, idempotency_key).Step());
    if (found) {
      if (find.Text(1) != content_sha256) {
        return Status::AlreadyExists("idempotency key '" + idempotency_key +
                                     "' was already used for dataset " + find.Text(0) +
                                     " with different lines");
      }
      return DatasetInfo{find.Text(0), find.Int(2), /*created=*/false};
    }
  }
  ASSIGN_OR_RETURN(Statement next,
                   Statement::Prepare(path_, db_,
                                      "SELECT COALESCE(MAX(seq), 0) + 1, (SELECT pass FROM job) "
                                      "FROM datasets"));
  ASSIGN_OR_RETURN(bool row, next.Step());
  (void)row;  // an aggregate always returns one row
  const std::string dataset_id = "ds-" + std::to_string(next.Int(0));
  const int64_t pass = next.Int(1);

  ASSIGN_OR_RETURN(Statement insert_ds,
                   Statement::Prepare(path_, db_,
                                      "INSERT INTO datasets (id, idempotency_key, content_sha256, "
                                      "prompt_count, created_ms) VALUES (?, ?, ?, ?, ?)"));
  insert_ds.Bind(1, dataset_id);
  if (idempotency_key.empty()) {
    insert_ds.BindNull(2);
  } else {
    insert_ds.Bind(2, idempotency_key);
  }
  insert_ds.Bind(3, content_sha256).Bind(4, static_cast<int64_t>(rows.size())).Bind(5, now);
  RETURN_IF_ERROR(insert_ds.Run());

  ASSIGN_OR_RETURN(
      Statement insert,
      Statement::Prepare(path_, db_,
                         "INSERT INTO prompts (id, dataset_id, row_json, state, pass, first_pass, "
                         "created_ms, updated_ms) VALUES (?, ?, ?, 'QUEUED', ?4, ?4, ?5, ?6)"));
  for (const ParsedRow& r : rows) {
    insert.Reset();
    insert.Bind(1, dataset_id + ":" + std::to_string(r.index))
        .Bind(2, dataset_id)
        .Bind(3, r.json)
        .Bind(4, pass)
        .Bind(5, now)
        .Bind(6, now);
    RETURN_IF_ERROR(insert.Run());
  }
  RETURN_IF_ERROR(txn.Commit());
  return DatasetInfo{dataset_id, static_cast<int64_t>(rows.size()), /*created=*/true};
}

std::string PromptLedger::NewLeaseId() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id;
  id.reserve(32);
  for (int word = 0; word < 4; ++word) {
    uint32_t bits = rd_();
    for (int nibble = 0; nibble < 8; ++nibble, bits >>= 4) id.push_back(kHex[bits & 0xf]);
  }
  return id;
}

StatusOr<std::vector<Lease>> PromptLedger::LeasePrompts(const std::string& worker_id,
                                                        int64_t max_prompts,
                                                        std::chrono::milliseconds lease_duration) {
  if (worker_id.empty()) return Status::InvalidArgument("LeasePrompts: empty worker_id");
  if (max_prompts <= 0) {
    return Status::InvalidArgument("LeasePrompts: max_prompts must be positive, got " +
                                   std::to_string(max_prompts));
  }
  if (lease_duration.count() <= 0) {
    return Status::InvalidArgument("LeasePrompts: lease_duration must be positive, got " +
                                   std::to_string(lease_duration.count()) + " ms");
  }
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  if (lease_duration.count() > std::numeric_limits<int64_t>::max() - now) {
    return Status::InvalidArgument("LeasePrompts: lease_duration overflows the deadline");
  }
  const int64_t deadline = now + lease_duration.count();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());

  ASSIGN_OR_RETURN(Statement reclaim,
                   Statement::Prepare(path_, db_,
                                      "UPDATE prompts SET state = 'QUEUED', lease_id = NULL, "
                                      "lease_deadline_ms = NULL, attempts = attempts + 1, "
                                      "updated_ms = ?1 "
                                      "WHERE state = 'LEASED' AND lease_deadline_ms < ?1"));
  RETURN_IF_ERROR(reclaim.Bind(1, now).Run());

  std::vector<Lease> leases;
  std::vector<int64_t> seqs;
  {
    ASSIGN_OR_RETURN(Statement select,
                     Statement::Prepare(path_, db_,
                                        "SELECT seq, id, row_json, pass, attempts FROM prompts "
                                        "WHERE state = 'QUEUED' ORDER BY pass, seq LIMIT ?"));
    select.Bind(1, max_prompts);
    while (true) {
      ASSIGN_OR_RETURN(bool has_row, select.Step());
      if (!has_row) break;
      seqs.push_back(select.Int(0));
      leases.push_back(Lease{NewLeaseId(), select.Text(1), select.Text(2), deadline, select.Int(3),
                             select.Int(4)});
    }
  }
  ASSIGN_OR_RETURN(Statement update,
                   Statement::Prepare(path_, db_,
                                      "UPDATE prompts SET state = 'LEASED', lease_id = ?, "
                                      "lease_deadline_ms = ?, worker_id = ?, updated_ms = ? "
                                      "WHERE seq = ?"));
  for (size_t i = 0; i < leases.size(); ++i) {
    update.Reset();
    update.Bind(1, leases[i].lease_id)
        .Bind(2, deadline)
        .Bind(3, worker_id)
        .Bind(4, now)
        .Bind(5, seqs[i]);
    RETURN_IF_ERROR(update.Run());
  }
  RETURN_IF_ERROR(txn.Commit());
  return leases;
}

Status PromptLedger::CompleteLease(const std::string& lease_id, const std::string& prompt_id) {
  return FinishLease(LeaseAction::kComplete, lease_id, prompt_id, "");
}

Status PromptLedger::RejectPrompt(const std::string& lease_id, const std::string& prompt_id,
                                  const std::string& reason) {
  return FinishLease(LeaseAction::kReject, lease_id, prompt_id, reason);
}

Status PromptLedger::ReleaseLease(const std::string& lease_id, const std::string& prompt_id) {
  return FinishLease(LeaseAction::kRelease, lease_id, prompt_id, "");
}

Status PromptLedger::CheckLeaseLocked(const std::string& lease_id, const std::string& prompt_id,
                                      int64_t now) {
  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path_, db_,
                                      "SELECT state, lease_id, lease_deadline_ms FROM prompts "
                                      "WHERE id = ?"));
  ASSIGN_OR_RETURN(bool found, select.Bind(1, prompt_id).Step());
  const auto refuse = [&](const std::string& why) {
    return Status::FailedPrecondition("unknown or expired lease " + lease_id + " for prompt " +
                                      prompt_id + ": " + why);
  };
  if (!found) return refuse("no such prompt");
  if (select.Text(0) != PromptStateName(PromptState::kLeased)) {
    return refuse("prompt is " + select.Text(0));
  }
  if (lease_id.empty() || select.Text(1) != lease_id) {
    return refuse("not the prompt's current lease");
  }
  if (select.Int(2) < now) {
    return refuse("lease expired at " + std::to_string(select.Int(2)) + " ms (now " +
                  std::to_string(now) + ")");
  }
  return Status::OK();
}

Status PromptLedger::FinishLease(LeaseAction action, const std::string& lease_id,
                                 const std::string& prompt_id, const std::string& reason) {
  common::MutexLock lock(&mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  RETURN_IF_ERROR(CheckLeaseLocked(lease_id, prompt_id, now));

  const char* sql = nullptr;
  switch (action) {
    case LeaseAction::kComplete:
      sql =
          "UPDATE prompts SET state = 'TRAINED', lease_id = NULL, lease_deadline_ms = NULL, "
          "trained_step = NULL, updated_ms = ?1 WHERE id = ?2";
      break;
    case LeaseAction::kReject:
      sql =
          "UPDATE prompts SET state = 'REJECTED', lease_id = NULL, lease_deadline_ms = NULL, "
          "reject_reason = ?3, updated_ms = ?1 WHERE id = ?2";
      break;
    case LeaseAction::kRelease:
      sql =
          "UPDATE prompts SET state = 'QUEUED', lease_id = NULL, lease_deadline_ms = NULL, "
          "updated_ms = ?1 WHERE id = ?2";
      break;
  }
  if (action == LeaseAction::kComplete) {
    ASSIGN_OR_RETURN(Statement accept,
                     Statement::Prepare(path_, db_,
                                        "INSERT OR IGNORE INTO accepted (prompt_id, pass) "
                                        "SELECT id, pass FROM prompts WHERE id = ?"));
    RETURN_IF_ERROR(accept.Bind(1, prompt_id).Run());
  }
  ASSIGN_OR_RETURN(Statement update, Statement::Prepare(path_, db_, sql));
  update.Bind(1, now).Bind(2, prompt_id);
  if (action == LeaseAction::kReject) update.Bind(3, reason);
  RETURN_IF_ERROR(update.Run());
  return txn.Commit();
}

}  // namespace grpo::learner
