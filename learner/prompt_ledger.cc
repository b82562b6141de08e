#include "learner/prompt_ledger.h"

#include <sqlite3.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "common/dataset_row.h"
#include "common/sha256.h"

namespace grpo::learner {
namespace {

// Bump when the schema changes and append the step to kMigrations.
constexpr int64_t kSchemaVersion = 2;

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
};
static_assert(std::size(kMigrations) == kSchemaVersion);

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

StatusCode CodeForSqlite(int rc) {
  switch (rc & 0xff) {
    case SQLITE_NOTADB:
    case SQLITE_CORRUPT:
      return StatusCode::kDataLoss;
    case SQLITE_CANTOPEN:
    case SQLITE_READONLY:
    case SQLITE_PERM:
    case SQLITE_AUTH:
      return StatusCode::kFailedPrecondition;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return StatusCode::kUnavailable;
    case SQLITE_FULL:
      return StatusCode::kResourceExhausted;
    default:
      return StatusCode::kInternal;
  }
}

// "prompt ledger <path>: <what>: <sqlite message>", with the code mapped from rc.
Status SqliteError(const std::string& path, sqlite3* db, int rc, std::string_view what) {
  std::string detail = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  return Status(CodeForSqlite(rc),
                "prompt ledger " + path + ": " + std::string(what) + ": " + detail);
}

// One prepared statement; finalized on destruction. A failed bind is reported by Step().
class Statement {
 public:
  Statement(const std::string& path, sqlite3* db) : path_(path), db_(db) {}
  Statement(Statement&& o) noexcept
      : path_(o.path_), db_(o.db_), stmt_(std::exchange(o.stmt_, nullptr)), bind_rc_(o.bind_rc_) {}
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  ~Statement() { sqlite3_finalize(stmt_); }

  static StatusOr<Statement> Prepare(const std::string& path, sqlite3* db, std::string_view sql) {
    Statement s(path, db);
    const int rc =
        sqlite3_prepare_v2(db, sql.data(), static_cast<int>(sql.size()), &s.stmt_, nullptr);
    if (rc != SQLITE_OK) return SqliteError(path, db, rc, "prepare");
    return s;
  }

  Statement& Bind(int index, int64_t v) { return Check(sqlite3_bind_int64(stmt_, index, v)); }
  Statement& Bind(int index, std::string_view v) {
    return Check(
        sqlite3_bind_text(stmt_, index, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT));
  }
  Statement& BindNull(int index) { return Check(sqlite3_bind_null(stmt_, index)); }

  // True when a row is ready to read, false when the statement is done.
  StatusOr<bool> Step() {
    if (bind_rc_ != SQLITE_OK) return SqliteError(path_, db_, bind_rc_, "bind");
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqliteError(path_, db_, rc, "step");
  }
  // Runs a statement that returns no rows.
  Status Run() {
    StatusOr<bool> row = Step();
    if (!row.ok()) return row.status();
    return Status::OK();
  }
  // Ready to run again with new bindings.
  void Reset() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    bind_rc_ = SQLITE_OK;
  }

  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }
  bool IsNull(int col) const { return sqlite3_column_type(stmt_, col) == SQLITE_NULL; }
  std::string Text(int col) const {
    const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, col));
    return p == nullptr ? std::string() : std::string(p, sqlite3_column_bytes(stmt_, col));
  }

 private:
  Statement& Check(int rc) {
    if (rc != SQLITE_OK && bind_rc_ == SQLITE_OK) bind_rc_ = rc;
    return *this;
  }

  const std::string& path_;
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  int bind_rc_ = SQLITE_OK;
};

Status Exec(const std::string& path, sqlite3* db, const char* sql, std::string_view what) {
  const int rc = sqlite3_exec(db, sql, nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) return SqliteError(path, db, rc, what);
  return Status::OK();
}

// BEGIN IMMEDIATE ... COMMIT; rolls back on destruction unless committed.
class Transaction {
 public:
  Transaction(const std::string& path, sqlite3* db) : path_(path), db_(db) {}
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  ~Transaction() {
    if (open_) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }

  Status Begin() {
    RETURN_IF_ERROR(Exec(path_, db_, "BEGIN IMMEDIATE", "begin transaction"));
    open_ = true;
    return Status::OK();
  }
  // Statements still holding a row would make COMMIT fail; their results are read by now.
  Status Commit() {
    for (sqlite3_stmt* s = sqlite3_next_stmt(db_, nullptr); s != nullptr;
         s = sqlite3_next_stmt(db_, s)) {
      if (sqlite3_stmt_busy(s)) sqlite3_reset(s);
    }
    RETURN_IF_ERROR(Exec(path_, db_, "COMMIT", "commit"));
    open_ = false;
    return Status::OK();
  }

 private:
  const std::string& path_;
  sqlite3* db_;
  bool open_ = false;
};

StatusOr<PromptState> ParseState(std::string_view s) {
  for (PromptState st : {PromptState::kQueued, PromptState::kLeased, PromptState::kTrained,
                         PromptState::kRejected}) {
    if (PromptStateName(st) == s) return st;
  }
  return Status::DataLoss("unknown prompt state '" + std::string(s) + "'");
}

std::string_view Trim(std::string_view s) {
  const char* kSpace = " \t\r\n\f\v";
  const size_t b = s.find_first_not_of(kSpace);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
}

// Empty when `line` is a valid prompt row (common/dataset_row.h), else why not.
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

// One UPDATE in its own transaction, its parameters set by `bind`; returns the rows it changed.
// The caller holds the ledger's mutex.
template <typename Bind>
StatusOr<int64_t> CountedUpdate(const std::string& path, sqlite3* db, const char* sql, Bind bind) {
  Transaction txn(path, db);
  RETURN_IF_ERROR(txn.Begin());
  ASSIGN_OR_RETURN(Statement update, Statement::Prepare(path, db, sql));
  RETURN_IF_ERROR(bind(update).Run());
  const int64_t changed = sqlite3_changes(db);
  RETURN_IF_ERROR(txn.Commit());
  return changed;
}

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
  std::lock_guard<std::mutex> lock(ledger->mu_);
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
  ASSIGN_OR_RETURN(Statement tables,
                   Statement::Prepare(path_, db_,
                                      "SELECT COUNT(*), COALESCE(SUM(name = 'schema_version'), 0) "
                                      "FROM sqlite_master WHERE type = 'table'"));
  ASSIGN_OR_RETURN(bool row, tables.Step());
  (void)row;  // an aggregate always returns one row
  const int64_t num_tables = tables.Int(0);
  const bool has_version = tables.Int(1) > 0;
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

  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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

Status PromptLedger::FinishLease(LeaseAction action, const std::string& lease_id,
                                 const std::string& prompt_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
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
  ASSIGN_OR_RETURN(Statement update, Statement::Prepare(path_, db_, sql));
  update.Bind(1, now).Bind(2, prompt_id);
  if (action == LeaseAction::kReject) update.Bind(3, reason);
  RETURN_IF_ERROR(update.Run());
  return txn.Commit();
}

namespace {

// The passes of `prompt_id` that some optimizer step took, ascending.
StatusOr<std::vector<int64_t>> TrainedPasses(const std::string& path, sqlite3* db,
                                             const std::string& prompt_id) {
  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path, db,
                                      "SELECT pass FROM trainings WHERE prompt_id = ? "
                                      "ORDER BY pass"));
  select.Bind(1, prompt_id);
  std::vector<int64_t> passes;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    passes.push_back(select.Int(0));
  }
  return passes;
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

StatusOr<int64_t> PromptLedger::MarkTrained(const std::vector<TrainedGroup>& groups,
                                            int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
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
    const bool row_pass_trained =
        std::binary_search(trained.begin(), trained.end(), row->pass);
    if (row->state == "TRAINED" && !row->has_trained_step && row_pass_trained) {
      set_step.Reset();
      RETURN_IF_ERROR(set_step.Bind(1, step).Bind(2, now).Bind(3, id).Run());
      row->has_trained_step = true;
    }
    // A pass the prompt still owes (a stale group refused after the pass moved on, or an
    // earlier pass of a prompt trained out of order) is taken next.
    const int64_t missing = FirstMissingPass(trained, row->first_pass, job_pass);
    if (missing < 0) continue;
    if ((row->state == "TRAINED" && row->has_trained_step) ||
        (row->state == "QUEUED" && missing < row->pass)) {
      RETURN_IF_ERROR(QueueRow(path_, db_, id, missing, now));
    }
  }
  RETURN_IF_ERROR(txn.Commit());
  if (!duplicates.empty()) {
    std::string list;
    for (size_t i = 0; i < duplicates.size() && i < 8; ++i) list += (i ? ", " : "") + duplicates[i];
    return Status::FailedPrecondition("prompt ledger " + path_ + ": " +
                                      std::to_string(duplicates.size()) +
                                      " groups were trained in a pass that already had one: " +
                                      list);
  }
  return marked;
}

StatusOr<bool> PromptLedger::RequeueTrained(const std::string& prompt_id, int64_t pass) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  ASSIGN_OR_RETURN(std::optional<RowState> row, ReadRow(path_, db_, prompt_id));
  if (!row) return Status::NotFound("prompt ledger " + path_ + ": no prompt " + prompt_id);
  if (row->state == "REJECTED") return false;
  ASSIGN_OR_RETURN(std::vector<int64_t> trained, TrainedPasses(path_, db_, prompt_id));
  if (std::binary_search(trained.begin(), trained.end(), pass)) {
    return Status::FailedPrecondition("prompt ledger " + path_ + ": prompt " + prompt_id +
                                      " was already trained in pass " + std::to_string(pass));
  }
  if ((row->state == "TRAINED" && (row->pass == pass || row->has_trained_step)) ||
      (row->state == "QUEUED" && pass < row->pass)) {
    RETURN_IF_ERROR(QueueRow(path_, db_, prompt_id, pass, now));
  }
  // Otherwise the row is busy with another pass (LEASED, or accepted in another pass): when
  // that pass is trained, MarkTrained queues the pass still owed.
  RETURN_IF_ERROR(txn.Commit());
  return true;
}

StatusOr<int64_t> PromptLedger::ExpireWorkerLeases(const std::string& worker_id,
                                                   const std::vector<std::string>& keep) {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = options_.now_ms();
  Transaction txn(path_, db_);
  RETURN_IF_ERROR(txn.Begin());
  RollbackResult result;
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
    // Accepted but in no restored weights: back to the queue in the same pass.
    ASSIGN_OR_RETURN(Statement requeue,
                     Statement::Prepare(path_, db_,
                                        "UPDATE prompts SET state = 'QUEUED', trained_step = NULL, "
                                        "updated_ms = ? WHERE state = 'TRAINED' AND "
                                        "(trained_step IS NULL OR trained_step > ?)"));
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
    ASSIGN_OR_RETURN(Statement select,
                     Statement::Prepare(path_, db_,
                                        "SELECT id, state, pass, first_pass FROM prompts "
                                        "WHERE state IN ('QUEUED', 'TRAINED') AND "
                                        "trained_passes < pass - first_pass + (state = 'TRAINED')"));
    while (true) {
      ASSIGN_OR_RETURN(bool has_row, select.Step());
      if (!has_row) break;
      rows.push_back({select.Text(0), select.Text(1), select.Int(2), select.Int(3)});
    }
  }
  for (const Owing& row : rows) {
    ASSIGN_OR_RETURN(std::vector<int64_t> trained, TrainedPasses(path_, db_, row.id));
    const int64_t missing = FirstMissingPass(trained, row.first_pass, job_pass);
    // A queued row moves back only to an earlier pass; a trained one to any pass it owes.
    const bool move = row.state == "QUEUED" ? missing >= 0 && missing < row.pass
                                            : missing >= 0 && missing <= row.pass;
    if (!move) continue;
    if (row.state == "TRAINED") ++result.requeued;
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
  std::lock_guard<std::mutex> lock(mu_);
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
                                        "SELECT COUNT(*) FROM prompts WHERE state = 'TRAINED' AND "
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
                                      "WHERE state = 'TRAINED'"));
  RETURN_IF_ERROR(requeue.Bind(1, next).Bind(2, now).Run());
  ASSIGN_OR_RETURN(Statement job, Statement::Prepare(path_, db_, "UPDATE job SET pass = ?"));
  RETURN_IF_ERROR(job.Bind(1, next).Run());
  RETURN_IF_ERROR(txn.Commit());
  return true;
}

StatusOr<std::vector<TrainingRecord>> PromptLedger::Trainings() {
  std::lock_guard<std::mutex> lock(mu_);
  ASSIGN_OR_RETURN(Statement select,
                   Statement::Prepare(path_, db_,
                                      "SELECT prompt_id, pass, step FROM trainings "
                                      "ORDER BY step, prompt_id, pass"));
  std::vector<TrainingRecord> out;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    out.push_back(TrainingRecord{select.Text(0), select.Int(1), select.Int(2)});
  }
  return out;
}

StatusOr<LedgerCounts> PromptLedger::Counts() {
  std::lock_guard<std::mutex> lock(mu_);
  return CountsLocked(nullptr);
}

StatusOr<LedgerCounts> PromptLedger::CountsForDataset(const std::string& dataset_id) {
  std::lock_guard<std::mutex> lock(mu_);
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
    }
  }
  return counts;
}

StatusOr<PromptRecord> PromptLedger::GetPrompt(const std::string& prompt_id) {
  std::lock_guard<std::mutex> lock(mu_);
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
