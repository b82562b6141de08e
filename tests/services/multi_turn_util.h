// Shared by the multi-turn end-to-end tests (multi_turn_e2e_test, openenv_e2e_test): one job of a
// real learner whose config names an environment and a real worker, and the dumped rows read
// back as runs of model and environment tokens. Byte tokenizer (ids 0-255 are bytes, 257
// <|im_start|>, 258 <|im_end|>) and ChatML, written out here independently of the code under test.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "tests/services/process_util.h"
#include "tests/test_util.h"

namespace grpo::testing {

inline constexpr int64_t kByteImStart = 257, kByteImEnd = 258;

// What follows a model turn for one observation message (README "Multi-turn environments").
inline std::vector<int64_t> ObservationIds(const std::string& role, const std::string& content,
                                           bool closed) {
  std::vector<int64_t> ids;
  if (!closed) ids.push_back(kByteImEnd);
  ids.push_back('\n');
  ids.push_back(kByteImStart);
  for (unsigned char c : role + "\n" + content) ids.push_back(c);
  ids.push_back(kByteImEnd);
  ids.push_back('\n');
  ids.push_back(kByteImStart);
  for (unsigned char c : std::string("assistant\n")) ids.push_back(c);
  return ids;
}

// The bytes of a model turn's ids, special tokens left out (the worker decodes these bytes).
inline std::string TurnBytes(const std::vector<int64_t>& ids) {
  std::string text;
  for (int64_t id : ids) {
    if (id < 256) text.push_back(static_cast<char>(id));
  }
  return text;
}

// The code points the server gets for a turn's bytes: UTF-8 decoded with each maximal ill-formed
// subpart replaced by one U+FFFD (Unicode 3.9 "U+FFFD Substitution of Maximal Subparts", Table
// 3-7 for the well-formed sequences), as the worker decodes a turn.
inline std::u32string CodePoints(const std::string& bytes) {
  std::u32string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const unsigned char b = bytes[i];
    int need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the next continuation byte
    char32_t cp = b;
    if (b < 0x80) {
      need = 0;
    } else if (b >= 0xC2 && b <= 0xDF) {
      need = 1, cp = b & 0x1F;
    } else if (b == 0xE0) {
      need = 2, lo = 0xA0, cp = b & 0x0F;
    } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
      need = 2, cp = b & 0x0F;
    } else if (b == 0xED) {
      need = 2, hi = 0x9F, cp = b & 0x0F;
    } else if (b == 0xF0) {
      need = 3, lo = 0x90, cp = b & 0x07;
    } else if (b >= 0xF1 && b <= 0xF3) {
      need = 3, cp = b & 0x07;
    } else if (b == 0xF4) {
      need = 3, hi = 0x8F, cp = b & 0x07;
    } else {
      need = -1;  // never a lead byte: one U+FFFD by itself
    }
    size_t j = i + 1;
    int got = 0;
    for (; got < need && j < bytes.size(); ++got, ++j) {
      const unsigned char c = bytes[j];
      if (c < lo || c > hi) break;
      lo = 0x80, hi = 0xBF;
      cp = (cp << 6) | (c & 0x3F);
    }
    out.push_back(need >= 0 && got == need ? cp : U'\uFFFD');
    i = j;
  }
  return out;
}

// The UTF-8 size of the text the worker gives the environment for a turn's bytes (CodePoints).
inline size_t DecodedSize(const std::string& bytes) {
  size_t n = 0;
  for (char32_t cp : CodePoints(bytes)) n += cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
  return n;
}

// Row r of a batch dump as runs of (model token?, ids), up to its padding.
using TokenRuns = std::vector<std::pair<bool, std::vector<int64_t>>>;
inline TokenRuns DumpedRuns(const std::map<std::string, DumpTensor>& dump, int64_t r) {
  const auto& ids = dump.at("completion_ids");
  const auto& real = dump.at("completion_mask");
  const auto& env_mask = dump.at("env_mask");
  const int64_t cols = ids.shape.at(1);
  TokenRuns runs;
  for (int64_t c = 0; c < cols; ++c) {
    const bool is_real =
        real.floats.empty() ? real.ints[r * cols + c] != 0 : real.floats[r * cols + c] != 0;
    if (!is_real) break;
    const bool model = env_mask.floats[r * cols + c] != 0;
    if (runs.empty() || runs.back().first != model) runs.push_back({model, {}});
    runs.back().second.push_back(ids.ints[r * cols + c]);
  }
  return runs;
}

// Runs a job to its end: `rows` (JSON lines) submitted to a learner started with
// LearnerCommand(dir, keys) plus batch dumps in dir/dumps, and one worker. `children` holds the
// environment server already; its log joins the others in failure messages. Fatal failures when
// a process does not start or the job does not end with exit code 0 within `timeout`.
inline void RunMultiTurnJob(Children& children, const std::filesystem::path& dir,
                            std::vector<std::string> keys, const std::vector<std::string>& rows,
                            std::chrono::seconds timeout = std::chrono::seconds(180)) {
  {
    std::ofstream data(dir / "data.jsonl");
    for (const std::string& row : rows) data << row << "\n";
  }
  keys.insert(keys.end(), {"--save_steps", "0", "--max_staleness", "1000", "--dump_batches_dir",
                           (dir / "dumps").string(), "--linger_seconds", "3"});
  children.Spawn("learner", LearnerCommand(dir, keys));
  const nlohmann::json line = children.FirstLine("learner", std::chrono::seconds(60));
  ASSERT_TRUE(line.is_object() && line.contains("port")) << Tail(children.Err("learner"));
  const std::string learner = "127.0.0.1:" + std::to_string(line["port"].get<int>());
  int rc = -1;
  const std::string submitted =
      RunCommand(GrpoBin() + " submit --learner_address " + learner +
                     " --timeout_seconds 30 --dataset " + (dir / "data.jsonl").string() + " 2>&1",
                 &rc);
  ASSERT_EQ(rc, 0) << submitted;
  children.Spawn("worker",
                 {GrpoBin(), "rollout", "--learner_address", learner, "--metrics_port", "0"});
  const auto exit_code = children.Wait("learner", timeout);
  const std::string logs = "learner:\n" + Tail(children.Err("learner")) + "\nworker:\n" +
                           Tail(children.Err("worker")) + "\nenv:\n" + Tail(children.Err("env"));
  ASSERT_TRUE(exit_code.has_value()) << "the job did not finish\n" << logs;
  ASSERT_EQ(*exit_code, 0) << logs;
}

}  // namespace grpo::testing
