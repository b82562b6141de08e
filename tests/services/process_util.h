// Helpers for tests that run `grpo` (and reference servers) as real processes: children in their
// own process groups that are always killed and reaped, polling with deadlines, and reading the
// batch dumps (README "Batch dumps") a learner leaves behind.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/process.h"
#include "tests/test_util.h"

namespace grpo::testing {

// The command line of `grpo learner` as the process tests run it: checkpoints under
// `output_dir`/out, gRPC and metrics on free ports (its first stdout line names them), and the
// small job they train (num_generations 2, micro-batch 4); `keys` (more `--key value` pairs)
// follow.
inline std::vector<std::string> LearnerCommand(const std::filesystem::path& output_dir,
                                               const std::vector<std::string>& keys) {
  std::vector<std::string> args = {GrpoBin(),
                                   "--log_level",
                                   "info",
                                   "learner",
                                   "--output_dir",
                                   (output_dir / "out").string(),
                                   "--grpc_port",
                                   "0",
                                   "--metrics_port",
                                   "0",
                                   "--num_generations",
                                   "2",
                                   "--per_device_train_batch_size",
                                   "4"};
  args.insert(args.end(), keys.begin(), keys.end());
  return args;
}

// Polls `cond` every `every` until it holds or `timeout` passes; returns its last value.
inline bool WaitUntil(const std::function<bool()>& cond, std::chrono::milliseconds timeout,
                      std::chrono::milliseconds every = std::chrono::milliseconds(50)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(every);
  }
  return cond();
}

// Last `n` characters of a file, for failure messages.
inline std::string Tail(const std::filesystem::path& p, size_t n = 4000) {
  const std::string s = ReadFile(p);
  return s.size() > n ? s.substr(s.size() - n) : s;
}

// Children by name over common::ProcessSupervisor (the demo's supervisor too), each in a process
// group of its own with stdout and stderr in <dir>/<name>.out and <dir>/<name>.err. The
// destructor SIGKILLs every group still running and reaps it, and a test process that dies
// without it (CTest's timeout, Ctrl-C, a crash) takes its children with it (die_with_parent), so
// no test leaves a process behind. Not thread-safe; call Spawn from the test's main thread: the
// kernel kills a child when the thread that spawned it exits (PR_SET_PDEATHSIG).
class Children {
 public:
  explicit Children(std::filesystem::path dir) : dir_(std::move(dir)) {}
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;

  // Starts argv[0] (a path) with `args`; returns the pid, or -1 when it could not start. A name
  // reused after its process ended overwrites its logs (pass a new name to keep them).
  pid_t Spawn(const std::string& name, std::vector<std::string> args) {
    common::ProcessSpec spec;
    spec.argv = std::move(args);
    spec.stdout_path = Out(name).string();
    spec.stderr_path = Err(name).string();
    spec.die_with_parent = true;
    auto p = supervisor_.Spawn(name, std::move(spec));
    return p.ok() ? (*p)->pid : -1;
  }

  // Sends `sig` to the child's process group; false when it is not running.
  bool Signal(const std::string& name, int sig) { return supervisor_.Signal(name, sig); }

  // Waits for the child to exit; its exit code, 128 + signal when killed, or nullopt when it is
  // still running after `timeout` (or was never started).
  std::optional<int> Wait(const std::string& name, std::chrono::milliseconds timeout) {
    return supervisor_.Wait(name, timeout);
  }

  // SIGKILL and reap; returns once the child is gone.
  void Kill(const std::string& name) { supervisor_.Kill(name); }

  // Every thread's stack of a child that still runs (gdb attached in batch mode), for the
  // message of a test that found it hung; a line saying why when there is none.
  std::string Stacks(const std::string& name) {
    const common::Process* p = supervisor_.Find(name);
    if (p == nullptr || p->reaped) return "(no stacks: " + name + " is not running)\n";
    int rc = 0;
    const std::string out = RunCommand("timeout 60 gdb -p " + std::to_string(p->pid) +
                                           " -batch -ex 'thread apply all bt' 2>&1 | tail -c 30000",
                                       &rc);
    return out.empty() ? "(no stacks: gdb printed nothing)\n" : out;
  }
  void KillAll() { supervisor_.StopAll(std::chrono::milliseconds(0)); }

  // The first stdout line of `name` parsed as JSON (servers print {"port": N, ...} there), waiting
  // up to `timeout`; null when it did not come or the child died.
  nlohmann::json FirstLine(const std::string& name, std::chrono::milliseconds timeout) {
    nlohmann::json line;
    WaitUntil(
        [&] {
          const std::string text = ReadFile(Out(name));
          const size_t nl = text.find('\n');
          if (nl == std::string::npos) return false;
          line = nlohmann::json::parse(text.substr(0, nl), nullptr,
                                       /*allow_exceptions=*/false);
          return true;
        },
        timeout);
    return line.is_discarded() ? nlohmann::json() : line;
  }

  std::filesystem::path Out(const std::string& name) const { return dir_ / (name + ".out"); }
  std::filesystem::path Err(const std::string& name) const { return dir_ / (name + ".err"); }

 private:
  std::filesystem::path dir_;
  common::ProcessSupervisor supervisor_;
};

// One tensor of a safetensors file, widened: integers to int64, floats to double.
struct DumpTensor {
  std::vector<int64_t> shape;
  std::vector<int64_t> ints;
  std::vector<double> floats;
};

// Reads a safetensors file by its format (8-byte little-endian header length, JSON header, data),
// independently of common/model/safetensors.h. Tensors of dtype I64, I32, F64 and F32 only; nullopt
// when the file is missing or malformed.
inline std::optional<std::map<std::string, DumpTensor>> ReadSafetensors(
    const std::filesystem::path& path) {
  const std::string bytes = ReadFile(path);
  if (bytes.size() < 8) return std::nullopt;
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | static_cast<uint8_t>(bytes[i]);
  if (8 + header_len > bytes.size()) return std::nullopt;
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len), nullptr, false);
  if (!header.is_object()) return std::nullopt;
  const char* data = bytes.data() + 8 + header_len;
  const size_t data_size = bytes.size() - 8 - header_len;
  std::map<std::string, DumpTensor> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const nlohmann::json& t = it.value();
    DumpTensor d;
    d.shape = t.at("shape").get<std::vector<int64_t>>();
    const auto off = t.at("data_offsets").get<std::vector<size_t>>();
    if (off.size() != 2 || off[0] > off[1] || off[1] > data_size) return std::nullopt;
    const std::string dtype = t.at("dtype").get<std::string>();
    const char* p = data + off[0];
    const size_t n = off[1] - off[0];
    if (dtype == "I64") {
      d.ints.resize(n / 8);
      std::memcpy(d.ints.data(), p, d.ints.size() * 8);
    } else if (dtype == "I32") {
      std::vector<int32_t> v(n / 4);
      std::memcpy(v.data(), p, v.size() * 4);
      d.ints.assign(v.begin(), v.end());
    } else if (dtype == "F64") {
      d.floats.resize(n / 8);
      std::memcpy(d.floats.data(), p, d.floats.size() * 8);
    } else if (dtype == "F32") {
      std::vector<float> v(n / 4);
      std::memcpy(v.data(), p, v.size() * 4);
      d.floats.assign(v.begin(), v.end());
    } else {
      continue;
    }
    out[it.key()] = std::move(d);
  }
  return out;
}

// <dir>/step-<8 digits>.safetensors, the learner's dump of one optimizer step.
inline std::filesystem::path DumpPath(const std::filesystem::path& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "step-%08lld.safetensors", static_cast<long long>(step));
  return dir / name;
}

}  // namespace grpo::testing
