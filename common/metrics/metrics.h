// The project's Prometheus registry: counters, gauges and fixed-bucket histograms on
// prometheus-cpp's core (its Registry, Family<T> and TextSerializer: text exposition format
// 0.0.4). Families are created once per process (common/metrics/grpo_metrics.h holds the
// project's families, in one place). What this layer adds to prometheus-cpp: every label declares
// its allowed values up front, so series are a fixed, small set (never prompt text, ids or
// tokens); all series exist (at 0) from creation on; an update with a value outside the set is
// dropped and counted; names, help and buckets are validated into a Status, not an exception.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
struct MetricFamily;
}  // namespace prometheus

namespace grpo::common {

// One label key and the values it may take.
struct LabelSpec {
  std::string name;
  std::vector<std::string> values;
};

// Label values of one series, in the family's label declaration order.
using LabelValues = std::initializer_list<std::string_view>;

enum class MetricType { kCounter, kGauge, kHistogram };

// Base of the three family kinds. Thread-safe: updates go to prometheus-cpp's series (atomics;
// a histogram's series takes its own short lock), the drop count is an atomic.
class MetricFamily {
 public:
  virtual ~MetricFamily() = default;
  MetricFamily(const MetricFamily&) = delete;
  MetricFamily& operator=(const MetricFamily&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<LabelSpec>& labels() const { return labels_; }
  // Updates dropped because their label values were not in the declared sets.
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

 protected:
  MetricFamily(std::string name, std::string help, MetricType type, std::vector<LabelSpec> labels);
  // Index of the series with these values, or -1 (and counts a drop) when not allowed.
  int64_t SeriesIndex(LabelValues values) const;
  // Number of series: the product of the label value set sizes.
  int64_t series_count() const { return series_count_; }
  // Label name -> value of series `index` (row-major over the declared sets, last label fastest).
  std::map<std::string, std::string> SeriesLabels(int64_t index) const;

 private:
  friend class Registry;
  // Puts the collected series of this family in declaration order, each with its labels in
  // declaration order (prometheus-cpp collects them in hash order, labels sorted by name).
  void Arrange(prometheus::MetricFamily* collected) const;

  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<LabelSpec> labels_;
  const int64_t series_count_;
  mutable std::atomic<uint64_t> dropped_{0};
};

// Monotonic; resets only with the process. Name ends in `_total` (enforced by the registry).
class Counter final : public MetricFamily {
 public:
  // Adds `delta` (ignored unless finite and >= 0).
  void Increment(double delta = 1.0) { Increment({}, delta); }
  void Increment(LabelValues values, double delta = 1.0);
  // Current value; 0 for label values not in the sets.
  double Value(LabelValues values = {}) const;

 private:
  friend class Registry;
  Counter(std::string name, std::string help, std::vector<LabelSpec> labels);
  std::vector<prometheus::Counter*> series_;  // by series index; owned by the prometheus registry
};

// A value that goes up and down.
class Gauge final : public MetricFamily {
 public:
  void Set(double value) { Set({}, value); }
  void Set(LabelValues values, double value);
  void Add(double delta) { Add({}, delta); }
  void Add(LabelValues values, double delta);
  double Value(LabelValues values = {}) const;

 private:
  friend class Registry;
  Gauge(std::string name, std::string help, std::vector<LabelSpec> labels);
  std::vector<prometheus::Gauge*> series_;
};

// Fixed buckets (finite, strictly increasing upper bounds; `+Inf` is implicit). Exposes
// cumulative `_bucket{le=...}`, `_sum` and `_count`; `_count` always equals the `+Inf` bucket.
class Histogram final : public MetricFamily {
 public:
  // Ignores NaN. An observation v lands in the first bucket with v <= bound.
  void Observe(double value) { Observe({}, value); }
  void Observe(LabelValues values, double value);
  uint64_t Count(LabelValues values = {}) const;
  double Sum(LabelValues values = {}) const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  friend class Registry;
  Histogram(std::string name, std::string help, std::vector<LabelSpec> labels,
            std::vector<double> bounds);
  const std::vector<double> bounds_;
  std::vector<prometheus::Histogram*> series_;
};

// Owns the families (and the prometheus::Registry holding their series); pointers it returns
// live as long as the registry. Thread-safe.
class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // InvalidArgument for a bad metric or label name (Prometheus charset; no `__` prefix), a
  // help text that is empty or spans lines, an empty or repeated label value, too many series
  // (> kMaxSeriesPerFamily), a counter name without `_total`, a histogram label `le`, or bad
  // bounds; AlreadyExists for a repeated family name.
  StatusOr<Counter*> AddCounter(std::string name, std::string help,
                                std::vector<LabelSpec> labels = {}) GRPO_EXCLUDES(mu_);
  StatusOr<Gauge*> AddGauge(std::string name, std::string help, std::vector<LabelSpec> labels = {})
      GRPO_EXCLUDES(mu_);
  StatusOr<Histogram*> AddHistogram(std::string name, std::string help, std::vector<double> bounds,
                                    std::vector<LabelSpec> labels = {}) GRPO_EXCLUDES(mu_);

  // Prometheus text format 0.0.4, written by prometheus::TextSerializer: families sorted by
  // name, series and their labels in declaration order; a family without series is left out.
  // Values carry 16 significant digits (prometheus-cpp's precision), NaN is written `Nan`.
  // Runs the OnExpose functions first.
  std::string Expose() const GRPO_EXCLUDES(mu_);
  // `refresh` runs at the start of every Expose, outside the registry's lock (it may update
  // this registry's families): for series read when scraped, such as the process's
  // (common/metrics/process_metrics.h). Concurrent scrapes may run it concurrently.
  void OnExpose(std::function<void()> refresh) GRPO_EXCLUDES(mu_);

  static constexpr int64_t kMaxSeriesPerFamily = 1024;

 private:
  Status CheckNew(const std::string& name, const std::string& help,
                  const std::vector<LabelSpec>& labels) const GRPO_REQUIRES(mu_);

  mutable Mutex mu_;
  // Holds every series; its own lock guards its family list.
  const std::unique_ptr<prometheus::Registry> prometheus_ GRPO_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<MetricFamily>> families_ GRPO_GUARDED_BY(mu_);
  std::vector<std::function<void()>> on_expose_ GRPO_GUARDED_BY(mu_);
};

}  // namespace grpo::common
