// The guarantees of README "Fault tolerance" checked on what a finished job left behind, read
// independently of the code under test: the batch dumps of the final history (which prompts
// each optimizer step trained, with which policy version and learner incarnation), the ledger
// file (SQLite, read-only). Shared by chaos_test and elastic_workers_test.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "tests/services/fault_util.h"

namespace grpo::testing::faults {

// Calls `row` for each row of `sql` over the ledger file (SQLite's C API, read-only); sets
// `*error` when the file or the query fails.
inline void ForEachLedgerRow(const fs::path& ledger, const char* sql,
                             const std::function<void(sqlite3_stmt*)>& row, std::string* error) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(ledger.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) != SQLITE_OK) {
    *error = "open " + ledger.string();
    sqlite3_close(db);
    return;
  }
  sqlite3_stmt* st = nullptr;
  if (sqlite3_prepare_v2(db, sql, -1, &st, nullptr) != SQLITE_OK) {
    *error = sqlite3_errmsg(db);
  } else {
    while (sqlite3_step(st) == SQLITE_ROW) row(st);
  }
  sqlite3_finalize(st);
  sqlite3_close(db);
}

// The dataset's marker ("item 07") in a prompt's row_json (column `col`), "?" when none.
inline std::string MarkerOf(sqlite3_stmt* st, int col) {
  static const std::regex marker("item [0-9][0-9]");
  const std::string row(reinterpret_cast<const char*>(sqlite3_column_text(st, col)));
  std::smatch m;
  return std::regex_search(row, m, marker) ? m.str() : "?";
}

// The ledger's record of trainings: (prompt marker, pass, step, filtered). A filtered one
// (dynamic sampling) is a pass the prompt is done with untrained.
struct Training {
  std::string marker;
  int64_t pass = 0, step = 0;
  bool filtered = false;
};

inline std::vector<Training> ReadTrainings(const fs::path& ledger, std::string* error) {
  std::vector<Training> out;
  ForEachLedgerRow(
      ledger,
      "SELECT p.row_json, t.pass, t.step, t.filtered FROM trainings t "
      "JOIN prompts p ON p.id = t.prompt_id",
      [&](sqlite3_stmt* st) {
        out.push_back(Training{MarkerOf(st, 0), sqlite3_column_int64(st, 1),
                               sqlite3_column_int64(st, 2), sqlite3_column_int64(st, 3) != 0});
      },
      error);
  return out;
}

// The ledger's row of each prompt, by marker: its state and the pass it is in.
struct PromptRow {
  std::string state;
  int64_t pass = 0;
};

inline std::map<std::string, PromptRow> ReadPromptRows(const fs::path& ledger, std::string* error) {
  std::map<std::string, PromptRow> out;
  ForEachLedgerRow(
      ledger, "SELECT row_json, state, pass FROM prompts",
      [&](sqlite3_stmt* st) {
        out[MarkerOf(st, 0)] = PromptRow{reinterpret_cast<const char*>(sqlite3_column_text(st, 1)),
                                         sqlite3_column_int64(st, 2)};
      },
      error);
  return out;
}

// One step's dump: the marker, policy version and policy incarnation of each row, and the
// incarnation of the learner that trained it.
struct StepDump {
  std::vector<std::string> markers;
  std::vector<double> rewards;  // per row: the total reward
  std::vector<int64_t> versions, incarnations;
  int64_t learner_incarnation = 0;
};

inline std::optional<StepDump> ReadStep(const fs::path& dump_dir, int64_t step,
                                        std::string* error) {
  const auto dump = ReadSafetensors(DumpPath(dump_dir, step));
  if (!dump) {
    *error = "no readable dump of step " + std::to_string(step);
    return std::nullopt;
  }
  for (const char* name : {"prompt_ids", "prompt_mask", "rewards", "policy_version",
                           "policy_incarnation", "learner_incarnation"}) {
    if (dump->count(name) == 0) {
      *error = "step " + std::to_string(step) + ": no tensor " + name;
      return std::nullopt;
    }
  }
  StepDump out;
  const auto& ids = dump->at("prompt_ids");
  const auto& mask = dump->at("prompt_mask");
  const int64_t rows = ids.shape.at(0), cols = ids.shape.at(1);
  for (int64_t r = 0; r < rows; ++r) {
    std::string text;
    for (int64_t c = 0; c < cols; ++c) {
      const bool real =
          mask.floats.empty() ? mask.ints[r * cols + c] != 0 : mask.floats[r * cols + c] != 0;
      const int64_t id = ids.ints[r * cols + c];
      if (real && id >= 0 && id < 256) text.push_back(static_cast<char>(id));
    }
    const size_t at = text.find("item ");
    out.markers.push_back(at == std::string::npos ? "?" : text.substr(at, 7));
  }
  out.rewards = dump->at("rewards").floats;
  out.versions = dump->at("policy_version").ints;
  out.incarnations = dump->at("policy_incarnation").ints;
  out.learner_incarnation = dump->at("learner_incarnation").ints.at(0);
  return out;
}

// Over the dumps of steps 1..max_steps and the ledger of a job on `prompts` prompts (the
// dataset of WriteDataset): every row's weights were published by the learner process that
// trained it, within max_staleness; every prompt trained or filtered once per completed pass
// and at most once in the current one, and its ledger row in the pass it owes next; the
// ledger's trainings agree with the dumps step by step, one per (prompt, pass), passes in order.
// A completed pass is one every prompt is done with: the job's pass, or the one before it when
// a prompt still owes that (its group of that pass was buffered when the next pass began, and
// dropped untrained at the job's end). With `dynamic_sampling`, every trained group's
// rewards differ (a group of equal ones is filtered, never trained) and some were filtered;
// without it, none. Adds failures; returns the passes completed (-1 when the files cannot be
// read).
inline int64_t ExpectHistoryHolds(const fs::path& out_dir, const fs::path& dump_dir,
                                  int64_t max_steps, int prompts, int64_t max_staleness,
                                  bool dynamic_sampling = false,
                                  int prompts_per_step = kPromptsPerStep) {
  // The final history, from the dumps: every row's weights were published by the learner that
  // trained it, within max_staleness.
  std::map<std::string, int> trained;                     // marker -> sequences
  std::map<int64_t, std::multiset<std::string>> by_step;  // step -> markers (one per prompt)
  for (int64_t step = 1; step <= max_steps; ++step) {
    std::string error;
    const auto d = ReadStep(dump_dir, step, &error);
    if (!d.has_value()) {
      ADD_FAILURE() << error;
      return -1;
    }
    EXPECT_NE(d->learner_incarnation, 0) << "step " << step;
    for (size_t r = 0; r < d->markers.size(); ++r) {
      EXPECT_EQ(d->incarnations[r], d->learner_incarnation)
          << "step " << step << " row " << r << ": weights of another learner process";
      const int64_t staleness = (step - 1) - d->versions[r];
      EXPECT_GE(staleness, 0) << "step " << step << " row " << r << ": version " << d->versions[r]
                              << " not published before the step";
      EXPECT_LE(staleness, max_staleness) << "step " << step << " row " << r;
      ++trained[d->markers[r]];
      if (r % kGenerations == 0) by_step[step].insert(d->markers[r]);
    }
    if (dynamic_sampling) {
      if (d->rewards.size() != d->markers.size()) {
        ADD_FAILURE() << "step " << step << ": " << d->rewards.size() << " rewards for "
                      << d->markers.size() << " rows";
        return -1;
      }
      for (size_t g = 0; g + kGenerations <= d->rewards.size(); g += kGenerations) {
        bool differ = false;
        for (size_t j = 1; j < kGenerations; ++j) {
          differ = differ || std::abs(d->rewards[g + j] - d->rewards[g]) > 1e-6;
        }
        EXPECT_TRUE(differ) << "step " << step << ": the group of " << d->markers[g]
                            << " has equal rewards; dynamic sampling trained it";
      }
    }
  }
  // Every prompt trained once per completed pass, and at most once in the last one.
  std::string error;
  const auto ledger = ReadLedger(out_dir / "ledger.sqlite", &error);
  if (!ledger.has_value()) {
    ADD_FAILURE() << error;
    return -1;
  }
  const int64_t job_pass = ledger->job_pass;
  const auto trainings = ReadTrainings(out_dir / "ledger.sqlite", &error);
  EXPECT_TRUE(error.empty()) << error;
  const auto rows = ReadPromptRows(out_dir / "ledger.sqlite", &error);
  EXPECT_TRUE(error.empty()) << error;
  bool a_pass_owed = false;
  for (const auto& [marker, row] : rows) {
    EXPECT_TRUE(row.pass == job_pass || row.pass == job_pass - 1)
        << marker << " is in pass " << row.pass << " of a job in pass " << job_pass;
    a_pass_owed = a_pass_owed || row.pass < job_pass;
  }
  const int64_t passes_done = a_pass_owed ? job_pass - 1 : job_pass;
  std::map<std::string, int> filtered;  // marker -> passes filtered
  int64_t filtered_total = 0;
  for (const Training& t : trainings) {
    if (t.filtered) ++filtered[t.marker], ++filtered_total;
  }
  if (dynamic_sampling) {
    EXPECT_GT(filtered_total, 0) << "nothing was filtered: the test exercises no filtering";
  } else {
    EXPECT_EQ(filtered_total, 0) << "filtered without dynamic_sampling";
  }
  int64_t total = 0;
  for (int i = 0; i < prompts; ++i) {
    const int times = trained[Marker(i)] / kGenerations;
    const int done = times + filtered[Marker(i)];
    EXPECT_EQ(trained[Marker(i)] % kGenerations, 0) << Marker(i);
    EXPECT_GE(done, passes_done) << Marker(i) << " missed a completed pass";
    EXPECT_LE(done, job_pass + 1) << Marker(i) << " trained (or filtered) twice in a pass";
    // Its row is in the pass it owes next: done with that pass (trained, filtered) or not yet.
    const auto row = rows.find(Marker(i));
    if (row == rows.end()) {
      ADD_FAILURE() << Marker(i) << " has no ledger row";
    } else {
      const bool done_with_row = row->second.state == "TRAINED" || row->second.state == "FILTERED";
      EXPECT_EQ(done, row->second.pass + (done_with_row ? 1 : 0))
          << Marker(i) << ": " << row->second.state << " in pass " << row->second.pass << " after "
          << done << " passes trained or filtered";
    }
    total += times;
  }
  // At most a full batch per step (the trainer may refuse a group that went stale in the buffer;
  // its prompt is then trained later in its pass).
  EXPECT_LE(total, max_steps * prompts_per_step);
  EXPECT_GE(total + filtered_total, prompts * passes_done);
  if (!dynamic_sampling) {
    EXPECT_EQ(trained.size(), static_cast<size_t>(prompts)) << "an unknown prompt was trained";
  }
  for (const auto& [marker, rows] : trained) {
    EXPECT_TRUE(marker.size() == 7 && marker.rfind("item ", 0) == 0 &&
                std::stoi(marker.substr(5)) < prompts)
        << "an unknown prompt was trained: " << marker;
  }
  for (const auto& [id, row] : ledger->prompts) EXPECT_NE(row.state, "REJECTED") << id;

  // The ledger's record agrees with the dumps step by step, one training per (prompt, pass),
  // passes 0, 1, ... in order for each prompt.
  std::map<int64_t, std::multiset<std::string>> ledger_by_step;
  std::map<std::string, std::set<int64_t>> passes_of;
  for (const Training& t : trainings) {
    if (!t.filtered) ledger_by_step[t.step].insert(t.marker);
    EXPECT_TRUE(passes_of[t.marker].insert(t.pass).second) << t.marker << " pass " << t.pass;
  }
  EXPECT_EQ(ledger_by_step, by_step);
  for (const auto& [marker, passes] : passes_of) {
    EXPECT_EQ(static_cast<int64_t>(passes.size()), *passes.rbegin() + 1)
        << marker << " skipped a pass";
  }
  return passes_done;
}

}  // namespace grpo::testing::faults
