#include "rollout/env/builtin_environments.h"

#include <cctype>
#include <charconv>
#include <cstdint>
#include <optional>

#include "rollout/env/turns_task.h"

namespace grpo::rollout {
namespace {

using nlohmann::json;

// The last integer in `text`: its digits and an optional '-' right before them.
struct Guess {
  bool negative = false;
  std::optional<int64_t> value;  // nullopt: too large for int64 (beyond any secret)
};
std::optional<Guess> LastInteger(std::string_view text) {
  size_t end = text.size();
  while (end > 0 && !std::isdigit(static_cast<unsigned char>(text[end - 1]))) --end;
  if (end == 0) return std::nullopt;
  size_t begin = end;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(text[begin - 1]))) --begin;
  Guess g;
  if (begin > 0 && text[begin - 1] == '-') {
    g.negative = true;
    --begin;
  }
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(text.data() + begin, text.data() + end, v);
  if (ec == std::errc() && ptr == text.data() + end) g.value = v;
  return g;
}

StatusOr<int64_t> RowBound(const json& row, const char* key, int64_t fallback) {
  if (!row.is_object() || !row.contains(key)) return fallback;
  const json& v = row[key];
  if (!v.is_number_integer()) {
    return Status::InvalidArgument(std::string("guess_number: the row's \"") + key +
                                   "\" must be an integer, got " + v.dump());
  }
  return v.get<int64_t>();
}

StatusOr<EnvObservation> GuessNumberReset(const json& row, uint64_t seed, json& state) {
  if (!row.is_null() && !row.is_object()) {
    return Status::InvalidArgument("guess_number: the row must be a JSON object");
  }
  ASSIGN_OR_RETURN(const int64_t low, RowBound(row, "low", 1));
  ASSIGN_OR_RETURN(const int64_t high, RowBound(row, "high", 100));
  if (low > high) {
    return Status::InvalidArgument("guess_number: low " + std::to_string(low) + " > high " +
                                   std::to_string(high));
  }
  // Unsigned arithmetic: high - low + 1 wraps to 0 only for the whole int64 range.
  const uint64_t span = static_cast<uint64_t>(high) - static_cast<uint64_t>(low) + 1;
  const uint64_t offset = span == 0 ? seed : seed % span;
  state = {{"secret", static_cast<int64_t>(static_cast<uint64_t>(low) + offset)}, {"guesses", 0}};
  return EnvObservation{};
}

StatusOr<EnvObservation> GuessNumberStep(const std::string& action, json& state) {
  EnvObservation obs;
  obs.reward = 0.0;
  const std::optional<Guess> guess = LastInteger(action);
  if (!guess) {
    obs.messages.push_back({"user", "say a number"});
    obs.metadata = {{"guesses", state["guesses"]}};
    return obs;
  }
  state["guesses"] = state["guesses"].get<int64_t>() + 1;
  obs.metadata = {{"guesses", state["guesses"]}};
  const int64_t secret = state["secret"].get<int64_t>();
  // A guess beyond int64 is beyond every secret: lower when positive, higher when negative.
  const int order = guess->value ? (*guess->value < secret   ? -1
                                    : *guess->value > secret ? 1
                                                             : 0)
                                 : (guess->negative ? -1 : 1);
  if (order == 0) {
    obs.messages.push_back({"user", "correct"});
    obs.reward = 1.0;
    obs.done = true;
  } else {
    obs.messages.push_back({"user", order < 0 ? "higher" : "lower"});
  }
  return obs;
}

}  // namespace

std::vector<std::string> BuiltinEnvironmentNames() { return {"guess_number", "turns"}; }

StatusOr<std::unique_ptr<Environment>> MakeBuiltinEnvironment(std::string_view name) {
  if (name == "turns") return MakeTurnsEnvironment();
  if (name == "guess_number") {
    return std::unique_ptr<Environment>(
        std::make_unique<FunctionEnvironment>("guess_number", GuessNumberReset, GuessNumberStep));
  }
  std::string known;
  for (const auto& n : BuiltinEnvironmentNames()) known += (known.empty() ? "" : ", ") + n;
  return Status::InvalidArgument("unknown environment task '" + std::string(name) +
                                 "' (built-in: " + known + ")");
}

}  // namespace grpo::rollout
