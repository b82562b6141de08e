// The demo task run long (labelled `long`, not in the default test command:
// `GRPO_LONG_TESTS=1 bash deploy/test.sh` or `ctest -L long`). With the demo's settings
// `grpo train-local` must reach the optimum of the length task (reward 0: answers of exactly the
// target length) and stay there: no collapse to all-truncated or one-token answers, the failure
// that the earlier settings (constant learning rate 3e-3, group scaling) showed after 650-1,100
// steps. GRPO_STABILITY_STEPS overrides the 2,000 steps.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace {

using grpo::testing::GrpoBin;
using grpo::testing::RunCommand;
namespace fs = std::filesystem;
using nlohmann::json;

double WindowMean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s / static_cast<double>(end - begin);
}

TEST(DemoStability, TrainLocalReachesTheOptimumAndStaysThere) {
  const char* env = std::getenv("GRPO_STABILITY_STEPS");
  const int steps = env != nullptr ? std::atoi(env) : 2000;
  ASSERT_GE(steps, 400);
  const fs::path dir = fs::temp_directory_path() / ("demo_stability_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  int rc;
  const std::string out =
      RunCommand(GrpoBin() + " train-local --json --save_steps 0 --max_steps " +
                     std::to_string(steps) + " --output_dir " + dir.string() + " 2>/dev/null",
                 &rc);
  fs::remove_all(dir);
  ASSERT_EQ(rc, 0);
  std::vector<double> reward, length;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    const json j = json::parse(line);
    if (j.contains("summary")) continue;
    reward.push_back(j["reward"].get<double>());
    length.push_back(j["completions/mean_length"].get<double>());
  }
  ASSERT_EQ(reward.size(), static_cast<size_t>(steps));
  // Reaches the optimum: some 50-step window averages above -1 (from about -15 at the start).
  constexpr size_t kWindow = 50;
  size_t reached = reward.size();
  for (size_t i = 0; i + kWindow <= reward.size(); ++i) {
    if (WindowMean(reward, i, i + kWindow) > -1.0) {
      reached = i + kWindow;
      break;
    }
  }
  ASSERT_LT(reached, reward.size() / 2) << "never reached the optimum in the first half";
  // Stays there: every later 50-step window averages above -2, and the last 200 steps above -1.
  // A collapse gives -16 (every completion truncated) or -7 (one-token answers) for good.
  double worst = 0;
  size_t worst_at = 0;
  for (size_t i = reached; i + kWindow <= reward.size(); i += kWindow) {
    const double m = WindowMean(reward, i, i + kWindow);
    if (m < worst) {
      worst = m;
      worst_at = i;
    }
  }
  EXPECT_GT(worst, -2.0) << "collapsed: 50-step mean reward " << worst << " at step " << worst_at
                         << " (mean length " << WindowMean(length, worst_at, worst_at + kWindow)
                         << ")";
  EXPECT_GT(WindowMean(reward, reward.size() - 200, reward.size()), -1.0);
  std::printf(
      "DemoStability: optimum (50-step mean > -1) by step %zu; worst later 50-step mean "
      "%.3f at step %zu; last 200 steps %.3f\n",
      reached, worst, worst_at, WindowMean(reward, reward.size() - 200, reward.size()));
}

}  // namespace
