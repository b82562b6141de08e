#include "services/cli/progress.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace grpo::services {

double ProgressFraction(const JobProgress& p) {
  if (p.max_steps <= 0) return 0.0;
  return std::clamp(static_cast<double>(p.step) / static_cast<double>(p.max_steps), 0.0, 1.0);
}

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char buf[48];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  }
  return buf;
}

std::optional<double> EstimateSecondsLeft(const JobProgress& first, double first_s,
                                          const JobProgress& now, double now_s) {
  const double f0 = ProgressFraction(first), f1 = ProgressFraction(now);
  if (f1 >= 1.0) return 0.0;
  if (!(f1 > f0) || !(now_s > first_s)) return std::nullopt;
  return (now_s - first_s) * (1.0 - f1) / (f1 - f0);
}

std::string ProgressLine(const JobProgress& first, double first_s, const JobProgress& now,
                         double now_s, int bar_width) {
  const double f = ProgressFraction(now);
  const int cells = std::max(bar_width, 1);
  const int filled = std::clamp(static_cast<int>(std::floor(f * cells)), 0, cells);
  std::string line = "[" + std::string(filled, '#') + std::string(cells - filled, '-') + "]";
  char buf[160];
  std::snprintf(buf, sizeof buf, " %3d%% | step %lld/%lld | prompts %lld/%lld (pass %lld)",
                static_cast<int>(std::floor(f * 100.0)), static_cast<long long>(now.step),
                static_cast<long long>(now.max_steps), static_cast<long long>(now.trained),
                static_cast<long long>(now.total), static_cast<long long>(now.pass + 1));
  line += buf;
  if (now.reward) {
    std::snprintf(buf, sizeof buf, " | reward %.3g", *now.reward);
    line += buf;
  }
  line += " | " + FormatDuration(now_s - first_s);
  const std::optional<double> left = EstimateSecondsLeft(first, first_s, now, now_s);
  line += " | ETA " + (left ? FormatDuration(*left) : std::string("--:--"));
  return line;
}

}  // namespace grpo::services
