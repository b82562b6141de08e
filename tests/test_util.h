// Helpers shared by the tests: where the sources are, and running an independent Python
// reference (the project's virtual environment: torch, transformers, tokenizers, trl) with JSON
// in and out.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace grpo::testing {

// The reference interpreter: $GRPO_PYTHON (ctest sets it from CMake's GRPO_PYTHON), else the
// virtual environment deploy/setup.sh makes.
inline std::string ReferencePython() {
  if (const char* p = std::getenv("GRPO_PYTHON"); p != nullptr && *p != '\0') return p;
  return "/opt/grpo-serve/venv/bin/python";
}

// The repository root: $GRPO_SOURCE_DIR (set by ctest), else derived from this file's path.
inline std::string SourceDir() {
  if (const char* d = std::getenv("GRPO_SOURCE_DIR")) return d;
  return std::filesystem::path(__FILE__).parent_path().parent_path().string();
}

// True when the reference interpreter imports every module named (space-separated). The tests
// fail, never skip, without it: deploy/setup.sh installs it on every machine that runs them.
inline bool ReferencePythonHas(const std::string& modules = "torch") {
  std::string imports;
  for (size_t i = 0, j; i < modules.size(); i = j + 1) {
    j = modules.find(' ', i);
    if (j == std::string::npos) j = modules.size();
    if (j > i) imports += "import " + modules.substr(i, j - i) + ";";
  }
  return std::system(("'" + ReferencePython() + "' -c '" + imports + "' 2>/dev/null").c_str()) == 0;
}

// The `grpo` binary under test: $GRPO_BIN (set by ctest), else `grpo` on PATH.
inline std::string GrpoBin() {
  const char* b = std::getenv("GRPO_BIN");
  return b ? b : "grpo";
}

// The executable the `grpo` launcher runs for the commands that load libtorch
// (services/cli/launch.h): grpo-torch beside GrpoBin().
inline std::string GrpoTorchBin() {
  return (std::filesystem::path(GrpoBin()).parent_path() / "grpo-torch").string();
}

inline std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `cmd` through the shell; returns its stdout, *rc gets the exit code (-1 when it was
// killed by a signal).
inline std::string RunCommand(const std::string& cmd, int* rc) {
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), &pclose);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p.get())) > 0) out.append(buf, n);
  const int status = pclose(p.release());
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// Runs tests/reference/<script> with `input` as JSON on stdin and parses its stdout as JSON.
// Fails the test (and returns null) when the script fails.
inline nlohmann::json RunReference(const std::string& script, const nlohmann::json& input) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("grpo_ref_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path in = dir / "in.json", out = dir / "out.json";
  std::ofstream(in) << input.dump();
  const std::string cmd = "'" + ReferencePython() + "' " + SourceDir() + "/tests/reference/" +
                          script + " < " + in.string() + " > " + out.string();
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << "reference failed: " << cmd;
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  fs::remove_all(dir);
  if (rc != 0) return nullptr;
  return nlohmann::json::parse(ss.str());
}

// `s` as one word of a POSIX shell command line (single-quoted).
inline std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A fresh directory under the system temp dir ("<prefix>_<pid>_<n>"), removed at destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "grpo_test") {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            (prefix + "_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Unpacks the committed Qwen3 tokenizer (tests/data/qwen3-tokenizer: tokenizer.json.gz and
// tokenizer_config.json) into `dir`, a directory LoadTokenizer then reads. "" on success, else
// what failed.
inline std::string UnpackQwen3Tokenizer(const std::filesystem::path& dir) {
  const std::filesystem::path data =
      std::filesystem::path(SourceDir()) / "tests" / "data" / "qwen3-tokenizer";
  const std::string cmd = "gzip -dc " + ShellQuote((data / "tokenizer.json.gz").string()) + " > " +
                          ShellQuote((dir / "tokenizer.json").string());
  if (std::system(cmd.c_str()) != 0) return "failed: " + cmd;
  std::error_code ec;
  std::filesystem::copy_file(data / "tokenizer_config.json", dir / "tokenizer_config.json",
                             std::filesystem::copy_options::overwrite_existing, ec);
  return ec ? "copying tokenizer_config.json: " + ec.message() : "";
}

}  // namespace grpo::testing
