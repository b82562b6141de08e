#include "common/metrics/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <set>
#include <utility>

namespace grpo::common {
namespace {

bool IsNameStart(char c, bool allow_colon) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':');
}

bool IsValidName(std::string_view name, bool allow_colon) {
  if (name.empty() || !IsNameStart(name[0], allow_colon)) return false;
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_') return false;  // reserved
  return std::all_of(name.begin(), name.end(),
                     [&](char c) { return IsNameStart(c, allow_colon) || (c >= '0' && c <= '9'); });
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

int64_t SeriesCount(const std::vector<LabelSpec>& labels) {
  int64_t n = 1;
  for (const LabelSpec& l : labels) {
    n *= static_cast<int64_t>(l.values.size());
    if (n > Registry::kMaxSeriesPerFamily) return n;
  }
  return n;
}

template <typename T>
std::unique_ptr<std::atomic<T>[]> ZeroedAtomics(int64_t n) {
  auto a = std::make_unique<std::atomic<T>[]>(static_cast<size_t>(std::max<int64_t>(n, 1)));
  for (int64_t i = 0; i < n; ++i) a[i].store(T{}, std::memory_order_relaxed);
  return a;
}

void AtomicAdd(std::atomic<double>& a, double delta) {
  a.fetch_add(delta, std::memory_order_relaxed);
}

void AppendSample(std::string* out, const std::string& name, std::string_view suffix,
                  const std::string& labels, double value) {
  out->append(name).append(suffix).append(labels).append(" ");
  out->append(FormatMetricValue(value)).append("\n");
}

}  // namespace

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  // Whole numbers (counts) print without an exponent: 400000, not 4e+05.
  const bool whole = std::abs(value) < 1e15 && value == std::trunc(value);
  const auto [end, ec] =
      whole ? std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::fixed)
            : std::to_chars(buf, buf + sizeof(buf), value);
  if (ec != std::errc()) return "NaN";  // unreachable: 64 chars hold any double
  return std::string(buf, end);
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// --- MetricFamily ---

MetricFamily::MetricFamily(std::string name, std::string help, MetricType type,
                           std::vector<LabelSpec> labels)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      labels_(std::move(labels)),
      series_count_(SeriesCount(labels_)) {}

int64_t MetricFamily::SeriesIndex(LabelValues values) const {
  if (values.size() != labels_.size()) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return -1;
  }
  // Row-major over the declared value sets: the last label varies fastest.
  int64_t index = 0;
  size_t i = 0;
  for (std::string_view v : values) {
    const std::vector<std::string>& allowed = labels_[i++].values;
    const auto it = std::find(allowed.begin(), allowed.end(), v);
    if (it == allowed.end()) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return -1;
    }
    index = index * static_cast<int64_t>(allowed.size()) + (it - allowed.begin());
  }
  return index;
}

std::string MetricFamily::LabelText(int64_t index, std::string_view extra) const {
  if (labels_.empty() && extra.empty()) return "";
  std::vector<size_t> picks(labels_.size());
  for (size_t i = labels_.size(); i-- > 0;) {
    const auto n = static_cast<int64_t>(labels_[i].values.size());
    picks[i] = static_cast<size_t>(index % n);
    index /= n;
  }
  std::string out = "{";
  for (size_t i = 0; i < labels_.size(); ++i) {
    if (i > 0) out += ",";
    out += labels_[i].name + "=\"" + EscapeLabelValue(labels_[i].values[picks[i]]) + "\"";
  }
  if (!extra.empty()) {
    if (!labels_.empty()) out += ",";
    out += extra;
  }
  out += "}";
  return out;
}

void MetricFamily::AppendExposition(std::string* out) const {
  if (series_count_ == 0) return;
  static constexpr std::string_view kTypeNames[] = {"counter", "gauge", "histogram"};
  out->append("# HELP ").append(name_).append(" ").append(EscapeHelp(help_)).append("\n");
  out->append("# TYPE ").append(name_).append(" ");
  out->append(kTypeNames[static_cast<int>(type_)]).append("\n");
  AppendSamples(out);
}

// --- Counter ---

Counter::Counter(std::string name, std::string help, std::vector<LabelSpec> labels)
    : MetricFamily(std::move(name), std::move(help), MetricType::kCounter, std::move(labels)),
      values_(ZeroedAtomics<double>(series_count())) {}

void Counter::Increment(LabelValues values, double delta) {
  if (!std::isfinite(delta) || delta < 0) return;
  const int64_t i = SeriesIndex(values);
  if (i >= 0) AtomicAdd(values_[i], delta);
}

double Counter::Value(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  return i >= 0 ? values_[i].load(std::memory_order_relaxed) : 0.0;
}

void Counter::AppendSamples(std::string* out) const {
  for (int64_t i = 0; i < series_count(); ++i) {
    AppendSample(out, name(), "", LabelText(i), values_[i].load(std::memory_order_relaxed));
  }
}

// --- Gauge ---

Gauge::Gauge(std::string name, std::string help, std::vector<LabelSpec> labels)
    : MetricFamily(std::move(name), std::move(help), MetricType::kGauge, std::move(labels)),
      values_(ZeroedAtomics<double>(series_count())) {}

void Gauge::Set(LabelValues values, double value) {
  const int64_t i = SeriesIndex(values);
  if (i >= 0) values_[i].store(value, std::memory_order_relaxed);
}

void Gauge::Add(LabelValues values, double delta) {
  const int64_t i = SeriesIndex(values);
  if (i >= 0) AtomicAdd(values_[i], delta);
}

double Gauge::Value(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  return i >= 0 ? values_[i].load(std::memory_order_relaxed) : 0.0;
}

void Gauge::AppendSamples(std::string* out) const {
  for (int64_t i = 0; i < series_count(); ++i) {
    AppendSample(out, name(), "", LabelText(i), values_[i].load(std::memory_order_relaxed));
  }
}

// --- Histogram ---

Histogram::Histogram(std::string name, std::string help, std::vector<LabelSpec> labels,
                     std::vector<double> bounds)
    : MetricFamily(std::move(name), std::move(help), MetricType::kHistogram, std::move(labels)),
      bounds_(std::move(bounds)),
      buckets_(ZeroedAtomics<uint64_t>(series_count() * static_cast<int64_t>(bounds_.size() + 1))),
      sums_(ZeroedAtomics<double>(series_count())) {}

void Histogram::Observe(LabelValues values, double value) {
  if (std::isnan(value)) return;
  const int64_t i = SeriesIndex(values);
  if (i < 0) return;
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
  buckets_[i * static_cast<int64_t>(bounds_.size() + 1) + bucket].fetch_add(
      1, std::memory_order_relaxed);
  AtomicAdd(sums_[i], value);
}

uint64_t Histogram::Count(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  if (i < 0) return 0;
  uint64_t n = 0;
  for (size_t b = 0; b <= bounds_.size(); ++b) {
    n += buckets_[i * static_cast<int64_t>(bounds_.size() + 1) + b].load(std::memory_order_relaxed);
  }
  return n;
}

double Histogram::Sum(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  return i >= 0 ? sums_[i].load(std::memory_order_relaxed) : 0.0;
}

void Histogram::AppendSamples(std::string* out) const {
  const size_t nb = bounds_.size() + 1;
  for (int64_t i = 0; i < series_count(); ++i) {
    // Read each bucket once so the cumulative counts and _count agree in this exposition.
    uint64_t cumulative = 0;
    for (size_t b = 0; b < nb; ++b) {
      cumulative += buckets_[i * static_cast<int64_t>(nb) + b].load(std::memory_order_relaxed);
      const std::string le = b < bounds_.size() ? FormatMetricValue(bounds_[b]) : "+Inf";
      AppendSample(out, name(), "_bucket", LabelText(i, "le=\"" + le + "\""),
                   static_cast<double>(cumulative));
    }
    const std::string labels = LabelText(i);
    AppendSample(out, name(), "_sum", labels, sums_[i].load(std::memory_order_relaxed));
    AppendSample(out, name(), "_count", labels, static_cast<double>(cumulative));
  }
}

// --- Registry ---

Status Registry::CheckNew(const std::string& name, const std::string& help,
                          const std::vector<LabelSpec>& labels) const {
  if (!IsValidName(name, /*allow_colon=*/true)) {
    return Status::InvalidArgument("metric name \"" + name + "\" is not [a-zA-Z_:][a-zA-Z0-9_:]*");
  }
  if (families_.count(name) > 0) {
    return Status::AlreadyExists("metric family " + name + " already exists");
  }
  if (help.empty() || help.find('\n') != std::string::npos) {
    return Status::InvalidArgument(name + ": help must be one non-empty line");
  }
  std::set<std::string> keys;
  for (const LabelSpec& l : labels) {
    if (!IsValidName(l.name, /*allow_colon=*/false)) {
      return Status::InvalidArgument(name + ": label name \"" + l.name + "\" is invalid");
    }
    if (!keys.insert(l.name).second) {
      return Status::InvalidArgument(name + ": label " + l.name + " declared twice");
    }
    std::set<std::string> values;
    for (const std::string& v : l.values) {
      if (v.empty() || !values.insert(v).second) {
        return Status::InvalidArgument(name + ": label " + l.name +
                                       " has an empty or repeated value \"" + v + "\"");
      }
    }
  }
  if (SeriesCount(labels) > kMaxSeriesPerFamily) {
    return Status::InvalidArgument(name + ": more than " + std::to_string(kMaxSeriesPerFamily) +
                                   " label value combinations");
  }
  return Status::OK();
}

StatusOr<Counter*> Registry::AddCounter(std::string name, std::string help,
                                        std::vector<LabelSpec> labels) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckNew(name, help, labels));
  if (!EndsWith(name, "_total")) {
    return Status::InvalidArgument("counter " + name + " must end in _total");
  }
  std::unique_ptr<Counter> family(new Counter(name, std::move(help), std::move(labels)));
  Counter* raw = family.get();
  families_.emplace(std::move(name), std::move(family));
  return raw;
}

StatusOr<Gauge*> Registry::AddGauge(std::string name, std::string help,
                                    std::vector<LabelSpec> labels) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckNew(name, help, labels));
  if (EndsWith(name, "_total")) {
    return Status::InvalidArgument("gauge " + name + " must not end in _total");
  }
  std::unique_ptr<Gauge> family(new Gauge(name, std::move(help), std::move(labels)));
  Gauge* raw = family.get();
  families_.emplace(std::move(name), std::move(family));
  return raw;
}

StatusOr<Histogram*> Registry::AddHistogram(std::string name, std::string help,
                                            std::vector<double> bounds,
                                            std::vector<LabelSpec> labels) {
  MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckNew(name, help, labels));
  for (std::string_view suffix : {"_total", "_bucket", "_sum", "_count"}) {
    if (EndsWith(name, suffix)) {
      return Status::InvalidArgument("histogram " + name + " must not end in " +
                                     std::string(suffix));
    }
  }
  for (const LabelSpec& l : labels) {
    if (l.name == "le") return Status::InvalidArgument(name + ": label le is reserved");
  }
  if (bounds.empty()) return Status::InvalidArgument(name + ": no bucket bounds");
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1])) {
      return Status::InvalidArgument(name + ": bucket bounds must be finite and increasing");
    }
  }
  std::unique_ptr<Histogram> family(
      new Histogram(name, std::move(help), std::move(labels), std::move(bounds)));
  Histogram* raw = family.get();
  families_.emplace(std::move(name), std::move(family));
  return raw;
}

std::string Registry::Expose() const {
  std::string out;
  MutexLock lock(&mu_);
  for (const auto& [name, family] : families_) family->AppendExposition(&out);
  return out;
}

}  // namespace grpo::common
