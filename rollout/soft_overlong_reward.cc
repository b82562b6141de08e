#include "rollout/soft_overlong_reward.h"

#include <string>
#include <vector>

namespace grpo::rollout {
namespace {

class SoftOverlongReward final : public RewardFunction {
 public:
  SoftOverlongReward(int64_t max_len, int64_t cache) : max_len_(max_len), cache_(cache) {}
  std::string name() const override { return "soft_overlong_punishment"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>& inputs) const override {
    std::vector<std::optional<double>> out;
    out.reserve(inputs.size());
    for (const auto& in : inputs) {
      out.push_back(SoftOverlongPunishment(in.completion_tokens, max_len_, cache_));
    }
    return out;
  }

 private:
  const int64_t max_len_;
  const int64_t cache_;
};

StatusOr<int64_t> IntOption(const nlohmann::json& options, const char* key) {
  const nlohmann::json& v = options[key];
  if (!v.is_number_integer()) {
    return Status::InvalidArgument(
        std::string("reward function soft_overlong_punishment: option \"") + key +
        "\" must be an integer");
  }
  return v.get<int64_t>();
}

}  // namespace

double SoftOverlongPunishment(int64_t tokens, int64_t max_completion_len,
                              int64_t soft_punish_cache) {
  const int64_t free_len = max_completion_len - soft_punish_cache;
  if (tokens <= free_len) return 0.0;
  if (tokens <= max_completion_len) {
    return static_cast<double>(free_len - tokens) / static_cast<double>(soft_punish_cache);
  }
  return -1.0;
}

StatusOr<std::unique_ptr<RewardFunction>> MakeSoftOverlongPunishment(
    const nlohmann::json& options) {
  const std::string fn = "reward function soft_overlong_punishment: ";
  if (!options.is_object()) return Status::InvalidArgument(fn + "options must be an object");
  for (const auto& [key, value] : options.items()) {
    if (key != "max_completion_len" && key != "soft_punish_cache") {
      return Status::InvalidArgument(fn + "unknown option \"" + key +
                                     "\" (known: max_completion_len, soft_punish_cache)");
    }
  }
  if (!options.contains("max_completion_len")) {
    return Status::InvalidArgument(fn + "option \"max_completion_len\" is required");
  }
  ASSIGN_OR_RETURN(const int64_t max_len, IntOption(options, "max_completion_len"));
  if (max_len < 1) {
    return Status::InvalidArgument(fn + "option \"max_completion_len\" must be >= 1, got " +
                                   std::to_string(max_len));
  }
  int64_t cache = max_len / 5;
  if (options.contains("soft_punish_cache")) {
    ASSIGN_OR_RETURN(cache, IntOption(options, "soft_punish_cache"));
  }
  if (cache < 0 || cache > max_len) {
    return Status::InvalidArgument(fn + "option \"soft_punish_cache\" must be in [0, " +
                                   std::to_string(max_len) + "], got " + std::to_string(cache));
  }
  return std::unique_ptr<RewardFunction>(new SoftOverlongReward(max_len, cache));
}

}  // namespace grpo::rollout
