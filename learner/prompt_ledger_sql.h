// SQLite helpers of the prompt ledger (learner/prompt_ledger.cc, prompt_ledger_training.cc):
// errors as Status, a prepared statement, a transaction, one counted UPDATE. Internal to the
// ledger; callers hold the ledger's mutex.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "common/status.h"
#include "learner/prompt_ledger.h"

namespace grpo::learner::ledger_sql {

inline StatusCode CodeForSqlite(int rc) {
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
inline Status SqliteError(const std::string& path, sqlite3* db, int rc, std::string_view what) {
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

inline Status Exec(const std::string& path, sqlite3* db, const char* sql, std::string_view what) {
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

inline StatusOr<PromptState> ParseState(std::string_view s) {
  for (PromptState st : {PromptState::kQueued, PromptState::kLeased, PromptState::kTrained,
                         PromptState::kRejected, PromptState::kFiltered}) {
    if (PromptStateName(st) == s) return st;
  }
  return Status::DataLoss("unknown prompt state '" + std::string(s) + "'");
}

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

}  // namespace grpo::learner::ledger_sql
