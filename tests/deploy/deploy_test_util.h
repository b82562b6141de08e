// Helpers for the deployment-file tests: run a shell command, read a repository file, and the
// metric/label names a registry with every project family exposes.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include "common/metrics/grpo_metrics.h"
#include "common/metrics/process_metrics.h"
#include "tests/test_util.h"

namespace grpo::testing {

struct CommandResult {
  int rc = -1;      // exit status; -1 when it could not run
  std::string out;  // stdout and stderr
};

inline CommandResult RunShell(const std::string& cmd) {
  CommandResult r;
  std::unique_ptr<FILE, int (*)(FILE*)> p(::popen((cmd + " 2>&1").c_str(), "r"), &::pclose);
  if (!p) return r;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p.get())) > 0;) r.out.append(buf, n);
  const int status = ::pclose(p.release());
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline bool HaveTool(const std::string& name) {
  return std::system(("command -v " + name + " >/dev/null 2>&1").c_str()) == 0;
}

// A file under the repository root, e.g. "deploy/config.yaml".
inline std::string RepoPath(const std::string& relative) { return SourceDir() + "/" + relative; }

inline std::string ReadRepoFile(const std::string& relative) {
  std::ifstream f(RepoPath(relative));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Sample names (with _bucket/_sum/_count) and label names of the exposition of a registry
// holding every LearnerMetrics and WorkerMetrics family and the process's.
struct ExposedNames {
  std::set<std::string> metrics;
  std::set<std::string> labels;
};

inline ExposedNames ProjectMetricNames() {
  common::Registry registry;
  const std::vector<std::string> reward_funcs = {"accuracy", "format"};
  EXPECT_TRUE(common::LearnerMetrics::Create(registry, reward_funcs).ok());
  EXPECT_TRUE(common::WorkerMetrics::Create(registry, reward_funcs).ok());
  EXPECT_TRUE(common::AddProcessMetrics(&registry).ok());  // both serve the process's series
  ExposedNames names;
  std::istringstream in(registry.Expose());
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t brace = line.find('{'), space = line.find(' ');
    names.metrics.insert(line.substr(0, std::min(brace, space)));
    if (brace == std::string::npos || brace > space) continue;
    // {k="v",k2="v2"}: project label values never hold '"' or ',' (fixed sets).
    for (size_t pos = brace + 1; pos < line.size() && line[pos] != '}';) {
      const size_t eq = line.find('=', pos);
      names.labels.insert(line.substr(pos, eq - pos));
      const size_t close = line.find('"', eq + 2);
      pos = close + 1;
      if (pos < line.size() && line[pos] == ',') ++pos;
    }
  }
  return names;
}

}  // namespace grpo::testing
