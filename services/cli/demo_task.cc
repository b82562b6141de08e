#include "services/cli/demo_task.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace grpo::services {

using nlohmann::json;

std::vector<json> BuiltinDataset() {
  const char *questions[] = {"Say hi.",   "Name a colour.", "Count to three.", "Pick a number.",
                             "Greet me.", "Name a fruit.",  "Say yes or no.",  "Name an animal."};
  std::vector<json> rows;
  for (const char *q : questions) {
    rows.push_back({{"messages", json::array({{{"role", "user"}, {"content", q}}})}});
  }
  return rows;
}

common::GrpoConfig DemoTaskConfig() {
  common::GrpoConfig cfg;
  cfg.num_generations = 8;
  cfg.per_device_train_batch_size = 16;
  cfg.gradient_accumulation_steps = 2;
  cfg.max_prompt_length = 128;
  cfg.max_completion_length = 24;
  cfg.learning_rate = 3e-3;
  // Stays at the optimum for 2,000+ steps (demo_stability_test, label `long`): a constant rate
  // with group-std scaling flipped the policy to all-truncated answers after 650-1,100 steps
  // (near-deterministic groups give one deviant sample a huge scaled advantage). A decaying rate
  // and no std division (Dr. GRPO) keep it there.
  cfg.lr_scheduler_type = "cosine";
  cfg.scale_rewards = "none";
  cfg.max_steps = 60;
  cfg.reward_funcs = {"length"};
  cfg.seed = 1;
  return cfg;
}

common::GrpoConfig MultiTurnTaskConfig() {
  common::GrpoConfig cfg = DemoTaskConfig();
  cfg.env = "builtin:turns";
  cfg.max_turns = 3;
  // Two observations take 44 tokens of the byte tokenizer ("\n<|im_start|>user\nok<|im_end|>\n
  // <|im_start|>assistant\n" is 22): 36 are left for the three turns.
  cfg.max_completion_length = 80;
  cfg.reward_funcs = {"env"};
  return cfg;
}

json DemoRewardOptions(int64_t target_length) {
  return {{"length", {{"target_length", target_length}}}};
}

std::string TextPlot(const std::vector<double> &y, int width, int height) {
  if (y.empty()) return "";
  const int cols = std::min<int>(width, static_cast<int>(y.size()));
  std::vector<double> v(cols, 0.0);
  for (int c = 0; c < cols; ++c) {
    const size_t b = y.size() * c / cols, e = std::max(b + 1, y.size() * (c + 1) / cols);
    for (size_t i = b; i < e; ++i) v[c] += y[i];
    v[c] /= static_cast<double>(e - b);
  }
  const double lo = *std::min_element(v.begin(), v.end());
  const double hi = *std::max_element(v.begin(), v.end());
  const double span = hi > lo ? hi - lo : 1.0;
  std::ostringstream out;
  for (int r = height - 1; r >= 0; --r) {
    const double level = lo + span * r / (height - 1);
    out << std::setw(9) << std::fixed << std::setprecision(2) << level << " |";
    for (int c = 0; c < cols; ++c) {
      const int row = static_cast<int>(std::lround((v[c] - lo) / span * (height - 1)));
      out << (row == r ? '*' : (row > r ? ':' : ' '));
    }
    out << "\n";
  }
  out << std::string(10, ' ') << '+' << std::string(cols, '-') << "\n"
      << std::string(11, ' ') << "step 1" << std::string(std::max(0, cols - 12), ' ') << y.size()
      << "\n";
  return out.str();
}

double Mean(const std::vector<double> &v, size_t b, size_t e) {
  double s = 0;
  for (size_t i = b; i < e; ++i) s += v[i];
  return e > b ? s / static_cast<double>(e - b) : 0.0;
}

double StdErr(const std::vector<double> &v, size_t b, size_t e) {
  const double m = Mean(v, b, e);
  double s = 0;
  for (size_t i = b; i < e; ++i) s += (v[i] - m) * (v[i] - m);
  const double n = static_cast<double>(e - b);
  return n > 1 ? std::sqrt(s / (n - 1) / n) : 0.0;
}

CurveSummary SummarizeCurve(const std::vector<double> &curve) {
  CurveSummary r;
  const size_t n = curve.size();
  r.steps = n;
  if (n == 0) return r;
  const size_t k = std::max<size_t>(1, std::min<size_t>(10, n / 3));
  r.window = k;
  r.first = Mean(curve, 0, k);
  r.last = Mean(curve, n - k, n);
  const double se =
      std::sqrt(std::pow(StdErr(curve, 0, k), 2) + std::pow(StdErr(curve, n - k, n), 2));
  r.gain_in_std_errors = se > 0 ? (r.last - r.first) / se : 0.0;
  return r;
}

}  // namespace grpo::services
