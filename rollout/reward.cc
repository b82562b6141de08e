#include "rollout/reward.h"

#include "rollout/soft_overlong_reward.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <exception>
#include <future>
#include <map>
#include <regex>
#include <stdexcept>
#include <thread>
#include <utility>

namespace grpo::rollout {
namespace {

using nlohmann::json;

constexpr const char* kDefaultFormatPattern =
    R"(^<think>[\s\S]*?</think>\s*<answer>[\s\S]*?</answer>$)";

std::string_view Trim(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool EndsWith(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

void ReplaceAll(std::string& s, std::string_view from, std::string_view to) {
  std::string out;
  size_t start = 0;
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, start)) {
    out.append(s, start, pos - start).append(to);
    start = pos + from.size();
  }
  out.append(s, start, std::string::npos);
  s = std::move(out);
}

// Strips one enclosing "$...$" (or "$$...$$").
std::string_view StripMath(std::string_view s) {
  for (std::string_view d : {"$$", "$"}) {
    if (s.size() >= 2 * d.size() && StartsWith(s, d) && EndsWith(s, d)) {
      return Trim(s.substr(d.size(), s.size() - 2 * d.size()));
    }
  }
  return s;
}

// A plain decimal: [+-]digits[.digits] or [+-].digits, nothing else.
std::optional<double> ParseDecimal(std::string_view s) {
  s = Trim(s);
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  if (s.empty()) return std::nullopt;
  const size_t first = s.front() == '-' ? 1 : 0;
  if (first >= s.size() ||
      !(std::isdigit(static_cast<unsigned char>(s[first])) || s[first] == '.')) {
    return std::nullopt;
  }
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// The content of the brace group opening at text[open] ('{'), or nullopt when unbalanced.
std::optional<std::string_view> BraceGroup(std::string_view text, size_t open) {
  int depth = 0;
  for (size_t i = open; i < text.size(); ++i) {
    if (text[i] == '{') ++depth;
    if (text[i] == '}' && --depth == 0) return text.substr(open + 1, i - open - 1);
  }
  return std::nullopt;
}

size_t CountCodePoints(std::string_view s) {
  return std::count_if(s.begin(), s.end(),
                       [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

std::string NormaliseAnswer(std::string_view text) {
  std::string_view s = StripMath(Trim(text));
  if (StartsWith(s, "\\text{") && EndsWith(s, "}")) s = Trim(s.substr(6, s.size() - 7));
  std::string out;
  bool space = false;
  for (char c : s) {
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      space = !out.empty();
      continue;
    }
    if (space) out.push_back(' ');
    space = false;
    out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  while (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

Status CheckOptions(std::string_view fn, const json& options,
                    const std::vector<std::string>& known) {
  if (options.is_null()) return Status::OK();
  if (!options.is_object()) {
    return Status::InvalidArgument("reward function " + std::string(fn) +
                                   ": options must be a JSON object");
  }
  for (const auto& [key, value] : options.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      return Status::InvalidArgument("reward function " + std::string(fn) + ": unknown option \"" +
                                     key + "\" (known: " + (list.empty() ? "none" : list) + ")");
    }
  }
  return Status::OK();
}

// --- Built-ins.

class AccuracyReward final : public RewardFunction {
 public:
  std::string name() const override { return "accuracy"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>& inputs) const override {
    std::vector<std::optional<double>> out;
    out.reserve(inputs.size());
    for (const auto& in : inputs) {
      const std::optional<std::string> reference = Reference(in.row);
      if (!reference) {
        out.push_back(std::nullopt);
        continue;
      }
      const std::optional<std::string> predicted = ExtractFinalAnswer(in.completion);
      out.push_back(predicted && AnswersMatch(*predicted, *reference) ? 1.0 : 0.0);
    }
    return out;
  }

 private:
  static std::optional<std::string> Reference(const json& row) {
    if (!row.is_object() || !row.contains("answer") || row["answer"].is_null()) {
      return std::nullopt;
    }
    const json& a = row["answer"];
    if (!a.is_string()) return a.dump();
    const std::string s = a.get<std::string>();
    if (s.find("\\boxed") != std::string::npos || s.find("####") != std::string::npos) {
      return ExtractFinalAnswer(s).value_or(s);
    }
    return s;
  }
};

class FormatReward final : public RewardFunction {
 public:
  static StatusOr<std::unique_ptr<RewardFunction>> Create(const std::string& pattern) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_MATCH_INVALID_UTF, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      return Status::InvalidArgument(
          "reward function format: option \"pattern\" is not a valid regex: " +
          std::string(reinterpret_cast<const char*>(message)) + " at offset " +
          std::to_string(offset));
    }
    return std::unique_ptr<RewardFunction>(new FormatReward(code));
  }
  ~FormatReward() override { pcre2_code_free(code_); }

  std::string name() const override { return "format"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>& inputs) const override {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    if (!md) throw std::runtime_error("format: out of memory");
    std::vector<std::optional<double>> out;
    out.reserve(inputs.size());
    for (const auto& in : inputs) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(in.completion.data()),
                                 in.completion.size(), 0, 0, md.get(), nullptr);
      if (rc >= 0) {
        out.push_back(1.0);
      } else if (rc == PCRE2_ERROR_NOMATCH) {
        out.push_back(0.0);
      } else {
        out.push_back(std::nullopt);  // e.g. the match limit: no reward for this sample
      }
    }
    return out;
  }

 private:
  explicit FormatReward(pcre2_code* code) : code_(code) {}
  pcre2_code* const code_;  // owned; read-only after construction (thread-safe matching)
};

class LengthReward final : public RewardFunction {
 public:
  LengthReward(int64_t target, bool chars) : target_(target), chars_(chars) {}
  std::string name() const override { return "length"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>& inputs) const override {
    std::vector<std::optional<double>> out;
    out.reserve(inputs.size());
    for (const auto& in : inputs) {
      const int64_t len =
          chars_ ? static_cast<int64_t>(CountCodePoints(in.completion)) : in.completion_tokens;
      out.push_back(-static_cast<double>(std::llabs(target_ - len)));
    }
    return out;
  }

 private:
  const int64_t target_;
  const bool chars_;
};

class JsonValidReward final : public RewardFunction {
 public:
  std::string name() const override { return "json_valid"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>& inputs) const override {
    std::vector<std::optional<double>> out;
    out.reserve(inputs.size());
    for (const auto& in : inputs) out.push_back(json::accept(in.completion) ? 1.0 : 0.0);
    return out;
  }
};

// The environment's summed reward of a multi-turn episode; null without one (single-turn
// groups, or an environment that gave none).
class EnvReward final : public RewardFunction {
 public:
  std::string name() const override { return "env"; }
  std::vector<std::optional<double>> Score(const std::vector<RewardInput>& inputs) const override {
    std::vector<std::optional<double>> out;
    out.reserve(inputs.size());
    for (const auto& in : inputs) out.push_back(in.env_reward);
    return out;
  }
};

}  // namespace

std::string_view RewardErrorKindName(RewardErrorKind kind) {
  return kind == RewardErrorKind::kTimeout ? "timeout" : "error";
}

std::vector<std::string> BuiltinRewardFunctionNames() {
  return {"accuracy", "env", "format", "json_valid", "length", "soft_overlong_punishment"};
}

StatusOr<std::unique_ptr<RewardFunction>> MakeRewardFunction(std::string_view name,
                                                             const json& options) {
  if (name == "accuracy") {
    RETURN_IF_ERROR(CheckOptions(name, options, {}));
    return std::unique_ptr<RewardFunction>(new AccuracyReward());
  }
  if (name == "env") {
    RETURN_IF_ERROR(CheckOptions(name, options, {}));
    return std::unique_ptr<RewardFunction>(new EnvReward());
  }
  if (name == "json_valid") {
    RETURN_IF_ERROR(CheckOptions(name, options, {}));
    return std::unique_ptr<RewardFunction>(new JsonValidReward());
  }
  if (name == "format") {
    RETURN_IF_ERROR(CheckOptions(name, options, {"pattern"}));
    std::string pattern = kDefaultFormatPattern;
    if (options.is_object() && options.contains("pattern")) {
      if (!options["pattern"].is_string()) {
        return Status::InvalidArgument(
            "reward function format: option \"pattern\" must be a string");
      }
      pattern = options["pattern"].get<std::string>();
    }
    return FormatReward::Create(pattern);
  }
  if (name == "length") {
    RETURN_IF_ERROR(CheckOptions(name, options, {"target_length", "unit"}));
    int64_t target = 20;
    bool chars = false;
    if (options.is_object() && options.contains("target_length")) {
      const json& t = options["target_length"];
      if (!t.is_number_integer() || t.get<int64_t>() < 0) {
        return Status::InvalidArgument(
            "reward function length: option \"target_length\" must be an integer >= 0");
      }
      target = t.get<int64_t>();
    }
    if (options.is_object() && options.contains("unit")) {
      const json& u = options["unit"];
      if (!u.is_string() || (u != "tokens" && u != "chars")) {
        return Status::InvalidArgument(
            "reward function length: option \"unit\" must be \"tokens\" or \"chars\"");
      }
      chars = u == "chars";
    }
    return std::unique_ptr<RewardFunction>(new LengthReward(target, chars));
  }
  if (name == "soft_overlong_punishment") return MakeSoftOverlongPunishment(options);
  std::string known;
  for (const auto& n : BuiltinRewardFunctionNames()) known += (known.empty() ? "" : ", ") + n;
  return Status::InvalidArgument("unknown reward function \"" + std::string(name) +
                                 "\"; known: " + known);
}

std::optional<std::string> ExtractFinalAnswer(std::string_view text) {
  // The last \boxed{...} whose braces balance.
  for (size_t pos = text.rfind("\\boxed"); pos != std::string_view::npos;
       pos = pos == 0 ? std::string_view::npos : text.rfind("\\boxed", pos - 1)) {
    size_t open = pos + 6;
    while (open < text.size() && text[open] == ' ') ++open;
    if (open < text.size() && text[open] == '{') {
      if (auto inner = BraceGroup(text, open)) return std::string(Trim(*inner));
    }
  }
  // "#### x" (GSM8K).
  if (const size_t pos = text.rfind("####"); pos != std::string_view::npos) {
    std::string_view rest = text.substr(pos + 4);
    rest = Trim(rest.substr(0, rest.find('\n')));
    if (!rest.empty()) return std::string(rest);
  }
  // The last number (thousands separators, decimals, a simple fraction).
  static const std::regex kNumber(
      R"(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+)");
  std::optional<std::string> last;
  const std::string s(text);
  for (std::sregex_iterator it(s.begin(), s.end(), kNumber), end; it != end; ++it) {
    last = it->str();
  }
  return last;
}

std::optional<double> ParseNumber(std::string_view text) {
  std::string s(StripMath(Trim(text)));
  ReplaceAll(s, "\\!", "");
  ReplaceAll(s, "{,}", ",");
  ReplaceAll(s, "\\$", "");
  ReplaceAll(s, "\\%", "");
  std::string_view v = Trim(s);
  if (!v.empty() && v.front() == '$') v = Trim(v.substr(1));
  while (!v.empty() && v.back() == '.') v.remove_suffix(1);
  s = std::string(v);
  // \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b}.
  static const std::regex kLatexFrac(R"(^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$)");
  std::smatch m;
  if (std::regex_match(s, m, kLatexFrac)) {
    s = m[1].str() + m[2].str() + "/" + m[3].str();
  }
  if (const size_t slash = s.find('/'); slash != std::string::npos) {
    const auto a = ParseNumber(std::string_view(s).substr(0, slash));
    const auto b = ParseNumber(std::string_view(s).substr(slash + 1));
    if (!a || !b || *b == 0) return std::nullopt;
    return *a / *b;
  }
  static const std::regex kThousands(R"(^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$)");
  if (std::regex_match(s, kThousands)) s.erase(std::remove(s.begin(), s.end(), ','), s.end());
  return ParseDecimal(s);
}

bool AnswersMatch(std::string_view predicted, std::string_view reference) {
  const auto a = ParseNumber(predicted);
  const auto b = ParseNumber(reference);
  if (a && b) {
    return *a == *b || std::fabs(*a - *b) <= 1e-6 * std::max(std::fabs(*a), std::fabs(*b));
  }
  const std::string p = NormaliseAnswer(predicted);
  return !p.empty() && p == NormaliseAnswer(reference);
}

// --- RewardRunner.

RewardRunner::RewardRunner(std::vector<std::shared_ptr<const RewardFunction>> functions,
                           std::vector<double> weights, std::chrono::milliseconds timeout)
    : functions_(std::move(functions)), weights_(std::move(weights)), timeout_(timeout) {
  for (size_t i = 0; i < functions_.size(); ++i) {
    abandoned_.push_back(std::make_shared<std::atomic<int64_t>>(0));
  }
}

StatusOr<std::unique_ptr<RewardRunner>> RewardRunner::Create(
    std::vector<std::shared_ptr<const RewardFunction>> functions, std::vector<double> weights,
    std::chrono::milliseconds timeout) {
  for (size_t i = 0; i < functions.size(); ++i) {
    if (!functions[i]) {
      return Status::InvalidArgument("reward function " + std::to_string(i) + " is null");
    }
  }
  if (weights.empty()) weights.assign(functions.size(), 1.0);
  if (weights.size() != functions.size()) {
    return Status::InvalidArgument("reward_weights has " + std::to_string(weights.size()) +
                                   " values for " + std::to_string(functions.size()) +
                                   " reward_funcs");
  }
  for (double w : weights) {
    if (!std::isfinite(w)) return Status::InvalidArgument("reward_weights must be finite");
  }
  if (timeout.count() <= 0) return Status::InvalidArgument("reward timeout must be > 0");
  return std::unique_ptr<RewardRunner>(
      new RewardRunner(std::move(functions), std::move(weights), timeout));
}

StatusOr<std::unique_ptr<RewardRunner>> RewardRunner::FromConfig(
    const common::GrpoConfig& config, const json& options_by_name,
    std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<const RewardFunction>> functions;
  for (const auto& name : config.reward_funcs) {
    json options = json::object();
    if (options_by_name.is_object() && options_by_name.contains(name)) {
      options = options_by_name[name];
    }
    // DAPO's punishment is relative to the generation limit: the config's unless given.
    if (name == "soft_overlong_punishment" && options.is_object() &&
        !options.contains("max_completion_len")) {
      options["max_completion_len"] = config.max_completion_length;
    }
    ASSIGN_OR_RETURN(std::unique_ptr<RewardFunction> fn, MakeRewardFunction(name, options));
    functions.push_back(std::move(fn));
  }
  return Create(std::move(functions), config.reward_weights, timeout);
}

RewardCallReport RewardRunner::ScoreGroup(common::RolloutGroup& group,
                                          const std::string& prompt_text, const json& row,
                                          const std::vector<EnvFeedback>& env) const {
  using Scores = std::vector<std::optional<double>>;
  // Call states: 0 running, 1 finished, 2 abandoned by the waiter.
  struct Call {
    std::promise<Scores> promise;
    std::atomic<int> state{0};
    std::atomic<double> seconds{0.0};  // the Score call's duration, set before the promise
  };
  RewardCallReport report;
  const size_t n = group.completions.size(), k = functions_.size();
  report.seconds.assign(k, std::nullopt);
  report.error_kinds.assign(k, std::nullopt);
  auto inputs = std::make_shared<std::vector<RewardInput>>();
  inputs->reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const common::Completion& c = group.completions[i];
    const int64_t model_tokens =
        c.env_mask.empty()
            ? static_cast<int64_t>(c.token_ids.size())
            : static_cast<int64_t>(std::count(c.env_mask.begin(), c.env_mask.end(), 1));
    RewardInput in;
    in.prompt = prompt_text;
    in.completion = c.text;
    in.completion_tokens = model_tokens;
    in.row = row;
    if (i < env.size()) {
      in.env_reward = env[i].reward;
      in.env_metadata = env[i].metadata;
    }
    inputs->push_back(std::move(in));
  }
  const auto fail = [&](size_t f, RewardErrorKind kind, const std::string& what) {
    const bool timeout = kind == RewardErrorKind::kTimeout;
    (timeout ? report.timeouts : report.errors) += 1;
    (timeout ? *timeouts_ : *errors_) += 1;
    report.error_kinds[f] = kind;
    report.messages.push_back(functions_[f]->name() + ": " + what);
  };

  // Start every function, then wait for each until the common deadline.
  std::vector<std::shared_ptr<Call>> calls(k);
  std::vector<std::future<Scores>> futures(k);
  for (size_t f = 0; f < k; ++f) {
    if (abandoned_[f]->load() >= kMaxAbandonedRewardCalls) {
      fail(f, RewardErrorKind::kTimeout,
           std::to_string(kMaxAbandonedRewardCalls) +
               " earlier calls still running past their deadline; not started");
      continue;
    }
    auto call = std::make_shared<Call>();
    futures[f] = call->promise.get_future();
    try {
      std::thread([call, fn = functions_[f], inputs, abandoned = abandoned_[f]] {
        const auto t0 = std::chrono::steady_clock::now();
        try {
          Scores result = fn->Score(*inputs);
          call->seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          call->promise.set_value(std::move(result));
        } catch (...) {
          call->seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          call->promise.set_exception(std::current_exception());
        }
        int running = 0;
        if (!call->state.compare_exchange_strong(running, 1)) abandoned->fetch_sub(1);
      }).detach();
      calls[f] = std::move(call);
    } catch (const std::system_error& e) {  // could not start a thread
      futures[f] = {};
      fail(f, RewardErrorKind::kError, std::string("cannot start: ") + e.what());
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::vector<Scores> scores(k, Scores(n));
  for (size_t f = 0; f < k; ++f) {
    if (!calls[f]) continue;  // not started (counted above)
    if (futures[f].wait_until(deadline) != std::future_status::ready) {
      abandoned_[f]->fetch_add(1);
      int running = 0;
      if (calls[f]->state.compare_exchange_strong(running, 2)) {
        fail(f, RewardErrorKind::kTimeout,
             "no result within " + std::to_string(timeout_.count()) + " ms");
        report.seconds[f] = std::chrono::duration<double>(timeout_).count();
        continue;
      }
      abandoned_[f]->fetch_sub(1);  // finished meanwhile
    }
    report.seconds[f] = calls[f]->seconds.load();  // set before the promise was fulfilled
    try {
      Scores s = futures[f].get();
      if (s.size() != n) {
        fail(f, RewardErrorKind::kError,
             "returned " + std::to_string(s.size()) + " scores for " + std::to_string(n) +
                 " completions");
        continue;
      }
      scores[f] = std::move(s);
    } catch (const RewardError& e) {
      fail(f, e.kind(), std::string("threw: ") + e.what());
    } catch (const std::exception& e) {
      fail(f, RewardErrorKind::kError, std::string("threw: ") + e.what());
    } catch (...) {
      fail(f, RewardErrorKind::kError, "threw a non-standard exception");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    auto& rewards = group.completions[i].rewards;
    rewards.assign(k, std::nullopt);
    for (size_t f = 0; f < k; ++f) rewards[f] = scores[f][i];
  }
  return report;
}

double RewardRunner::WeightedReward(const common::Completion& completion) const {
  double sum = 0;
  for (size_t f = 0; f < weights_.size() && f < completion.rewards.size(); ++f) {
    if (completion.rewards[f]) sum += weights_[f] * *completion.rewards[f];
  }
  return sum;
}

std::vector<std::string> RewardRunner::names() const {
  std::vector<std::string> out;
  for (const auto& f : functions_) out.push_back(f->name());
  return out;
}

int64_t RewardRunner::abandoned_in_flight() const {
  int64_t total = 0;
  for (const auto& a : abandoned_) total += a->load();
  return total;
}

}  // namespace grpo::rollout
