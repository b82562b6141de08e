#include "common/metrics/metrics.h"

#include <prometheus/check_names.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <set>
#include <utility>

namespace grpo::common {
namespace {

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

// prometheus-cpp (1.0.1, and 1.3.0 still) writes HELP verbatim; the text format wants `\` and
// newline escaped there. Newlines are refused by the registry, so `\` is the one to escape.
std::string EscapeHelp(std::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// Registers the prometheus-cpp family `name` and appends its `series_count` series to `series`,
// in index order (`labels_of(i)` gives series i's labels; `args` go to every series, e.g. the
// bucket bounds). Runs after the registry's own checks, so prometheus-cpp's exceptions (bad
// names, unsorted buckets) cannot happen; one that does anyway becomes an Internal status.
template <typename T, typename Builder, typename LabelsOf, typename... SeriesArgs>
Status AddSeries(Builder builder, prometheus::Registry& registry, const std::string& name,
                 const std::string& help, int64_t series_count, const LabelsOf& labels_of,
                 std::vector<T*>* series, const SeriesArgs&... args) {
  try {
    auto& family = builder.Name(name).Help(EscapeHelp(help)).Register(registry);
    series->reserve(static_cast<size_t>(series_count));
    for (int64_t i = 0; i < series_count; ++i) {
      series->push_back(&family.Add(labels_of(i), args...));
    }
  } catch (const std::exception& e) {
    return Status::Internal(name + ": prometheus-cpp refused the family: " + e.what());
  }
  return Status::OK();
}

}  // namespace

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

std::map<std::string, std::string> MetricFamily::SeriesLabels(int64_t index) const {
  std::map<std::string, std::string> out;
  for (size_t i = labels_.size(); i-- > 0;) {
    const auto n = static_cast<int64_t>(labels_[i].values.size());
    out[labels_[i].name] = labels_[i].values[static_cast<size_t>(index % n)];
    index /= n;
  }
  return out;
}

void MetricFamily::Arrange(prometheus::MetricFamily* collected) const {
  // Declared position of every label, and of every value within its label.
  std::vector<std::pair<int64_t, prometheus::ClientMetric>> ordered;
  ordered.reserve(collected->metric.size());
  for (prometheus::ClientMetric& m : collected->metric) {
    std::vector<prometheus::ClientMetric::Label> labels;
    labels.reserve(labels_.size());
    int64_t index = 0;
    for (const LabelSpec& spec : labels_) {
      const auto label = std::find_if(m.label.begin(), m.label.end(),
                                      [&](const auto& l) { return l.name == spec.name; });
      if (label == m.label.end()) continue;  // unreachable: every series has every label
      const auto value = std::find(spec.values.begin(), spec.values.end(), label->value);
      index = index * static_cast<int64_t>(spec.values.size()) + (value - spec.values.begin());
      labels.push_back(std::move(*label));
    }
    m.label = std::move(labels);
    ordered.emplace_back(index, std::move(m));
  }
  std::sort(ordered.begin(), ordered.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  collected->metric.clear();
  for (auto& [index, m] : ordered) collected->metric.push_back(std::move(m));
}

// --- Counter ---

Counter::Counter(std::string name, std::string help, std::vector<LabelSpec> labels)
    : MetricFamily(std::move(name), std::move(help), MetricType::kCounter, std::move(labels)) {}

void Counter::Increment(LabelValues values, double delta) {
  if (!std::isfinite(delta) || delta < 0) return;
  const int64_t i = SeriesIndex(values);
  if (i >= 0) series_[static_cast<size_t>(i)]->Increment(delta);
}

double Counter::Value(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  return i >= 0 ? series_[static_cast<size_t>(i)]->Value() : 0.0;
}

// --- Gauge ---

Gauge::Gauge(std::string name, std::string help, std::vector<LabelSpec> labels)
    : MetricFamily(std::move(name), std::move(help), MetricType::kGauge, std::move(labels)) {}

void Gauge::Set(LabelValues values, double value) {
  const int64_t i = SeriesIndex(values);
  if (i >= 0) series_[static_cast<size_t>(i)]->Set(value);
}

void Gauge::Add(LabelValues values, double delta) {
  const int64_t i = SeriesIndex(values);
  if (i >= 0) series_[static_cast<size_t>(i)]->Increment(delta);
}

double Gauge::Value(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  return i >= 0 ? series_[static_cast<size_t>(i)]->Value() : 0.0;
}

// --- Histogram ---

Histogram::Histogram(std::string name, std::string help, std::vector<LabelSpec> labels,
                     std::vector<double> bounds)
    : MetricFamily(std::move(name), std::move(help), MetricType::kHistogram, std::move(labels)),
      bounds_(std::move(bounds)) {}

void Histogram::Observe(LabelValues values, double value) {
  if (std::isnan(value)) return;
  const int64_t i = SeriesIndex(values);
  if (i >= 0) series_[static_cast<size_t>(i)]->Observe(value);
}

uint64_t Histogram::Count(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  return i >= 0 ? series_[static_cast<size_t>(i)]->Collect().histogram.sample_count : 0;
}

double Histogram::Sum(LabelValues values) const {
  const int64_t i = SeriesIndex(values);
  return i >= 0 ? series_[static_cast<size_t>(i)]->Collect().histogram.sample_sum : 0.0;
}

// --- Registry ---

// Throw: a second family of one name is a bug to report (CheckNew does), not one to merge.
Registry::Registry()
    : prometheus_(
          std::make_unique<prometheus::Registry>(prometheus::Registry::InsertBehavior::Throw)) {}

Registry::~Registry() = default;

Status Registry::CheckNew(const std::string& name, const std::string& help,
                          const std::vector<LabelSpec>& labels) const {
  if (!prometheus::CheckMetricName(name)) {
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
    if (!prometheus::CheckLabelName(l.name)) {
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
  RETURN_IF_ERROR(AddSeries(
      prometheus::BuildCounter(), *prometheus_, name, family->help(), family->series_count(),
      [&](int64_t i) { return family->SeriesLabels(i); }, &family->series_));
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
  RETURN_IF_ERROR(AddSeries(
      prometheus::BuildGauge(), *prometheus_, name, family->help(), family->series_count(),
      [&](int64_t i) { return family->SeriesLabels(i); }, &family->series_));
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
  const prometheus::Histogram::BucketBoundaries& buckets = family->bounds();
  RETURN_IF_ERROR(AddSeries(
      prometheus::BuildHistogram(), *prometheus_, name, family->help(), family->series_count(),
      [&](int64_t i) { return family->SeriesLabels(i); }, &family->series_, buckets));
  Histogram* raw = family.get();
  families_.emplace(std::move(name), std::move(family));
  return raw;
}

void Registry::OnExpose(std::function<void()> refresh) {
  MutexLock lock(&mu_);
  on_expose_.push_back(std::move(refresh));
}

std::string Registry::Expose() const {
  std::vector<std::function<void()>> refresh;
  {
    MutexLock lock(&mu_);
    refresh = on_expose_;
  }
  for (const auto& f : refresh) f();
  MutexLock lock(&mu_);
  std::vector<prometheus::MetricFamily> collected = prometheus_->Collect();
  for (prometheus::MetricFamily& f : collected) {
    const auto family = families_.find(f.name);
    if (family != families_.end()) family->second->Arrange(&f);
  }
  std::sort(collected.begin(), collected.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return prometheus::TextSerializer().Serialize(collected);
}

}  // namespace grpo::common
