// The Prometheus registry: exact text exposition format 0.0.4 (expected text written by hand
// from https://prometheus.io/docs/instrumenting/exposition_formats/, in the layout
// prometheus-cpp's TextSerializer writes: a histogram's _count and _sum before its buckets,
// 16 significant digits, `Nan`), label sets, escaping, refusals and concurrent updates.
#include "common/metrics/metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

namespace grpo::common {
namespace {

TEST(Metrics, ExposesCounterGaugeAndHistogramExactly) {
  Registry r;
  // Created out of name order: exposition sorts families by name.
  Counter* requests = r.AddCounter("test_requests_total", "Requests served, in requests.").value();
  Gauge* temperature = r.AddGauge("test_temperature_celsius", "Room temperature, in celsius.",
                                  {{"room", {"kitchen", "hall"}}})
                           .value();
  Histogram* latency =
      r.AddHistogram("test_latency_seconds", "Request latency, in seconds.", {0.25, 0.5, 1})
          .value();
  requests->Increment();
  requests->Increment();
  requests->Increment(0.5);
  temperature->Set({"kitchen"}, 21.5);
  temperature->Set({"hall"}, -3);
  for (double v : {0.125, 0.25, 0.5, 2.0}) latency->Observe(v);

  EXPECT_EQ(r.Expose(),
            "# HELP test_latency_seconds Request latency, in seconds.\n"
            "# TYPE test_latency_seconds histogram\n"
            "test_latency_seconds_count 4\n"
            "test_latency_seconds_sum 2.875\n"
            "test_latency_seconds_bucket{le=\"0.25\"} 2\n"
            "test_latency_seconds_bucket{le=\"0.5\"} 3\n"
            "test_latency_seconds_bucket{le=\"1\"} 3\n"
            "test_latency_seconds_bucket{le=\"+Inf\"} 4\n"
            "# HELP test_requests_total Requests served, in requests.\n"
            "# TYPE test_requests_total counter\n"
            "test_requests_total 2.5\n"
            "# HELP test_temperature_celsius Room temperature, in celsius.\n"
            "# TYPE test_temperature_celsius gauge\n"
            "test_temperature_celsius{room=\"kitchen\"} 21.5\n"
            "test_temperature_celsius{room=\"hall\"} -3\n");
}

TEST(Metrics, LabelledHistogramPutsLeLastAndListsEverySeriesFromTheStart) {
  Registry r;
  Histogram* h = r.AddHistogram("test_call_seconds", "Call time, in seconds.", {1},
                                {{"fn", {"a", "b"}}, {"kind", {"x", "y"}}})
                     .value();
  h->Observe({"b", "x"}, 3);
  EXPECT_EQ(r.Expose(),
            "# HELP test_call_seconds Call time, in seconds.\n"
            "# TYPE test_call_seconds histogram\n"
            "test_call_seconds_count{fn=\"a\",kind=\"x\"} 0\n"
            "test_call_seconds_sum{fn=\"a\",kind=\"x\"} 0\n"
            "test_call_seconds_bucket{fn=\"a\",kind=\"x\",le=\"1\"} 0\n"
            "test_call_seconds_bucket{fn=\"a\",kind=\"x\",le=\"+Inf\"} 0\n"
            "test_call_seconds_count{fn=\"a\",kind=\"y\"} 0\n"
            "test_call_seconds_sum{fn=\"a\",kind=\"y\"} 0\n"
            "test_call_seconds_bucket{fn=\"a\",kind=\"y\",le=\"1\"} 0\n"
            "test_call_seconds_bucket{fn=\"a\",kind=\"y\",le=\"+Inf\"} 0\n"
            "test_call_seconds_count{fn=\"b\",kind=\"x\"} 1\n"
            "test_call_seconds_sum{fn=\"b\",kind=\"x\"} 3\n"
            "test_call_seconds_bucket{fn=\"b\",kind=\"x\",le=\"1\"} 0\n"
            "test_call_seconds_bucket{fn=\"b\",kind=\"x\",le=\"+Inf\"} 1\n"
            "test_call_seconds_count{fn=\"b\",kind=\"y\"} 0\n"
            "test_call_seconds_sum{fn=\"b\",kind=\"y\"} 0\n"
            "test_call_seconds_bucket{fn=\"b\",kind=\"y\",le=\"1\"} 0\n"
            "test_call_seconds_bucket{fn=\"b\",kind=\"y\",le=\"+Inf\"} 0\n");
  EXPECT_EQ(h->Count({"b", "x"}), 1u);
  EXPECT_EQ(h->Sum({"b", "x"}), 3.0);
}

TEST(Metrics, LabelValuesOutsideTheDeclaredSetAreDroppedAndCounted) {
  Registry r;
  Counter* c =
      r.AddCounter("test_errors_total", "Errors, in errors.", {{"kind", {"error", "timeout"}}})
          .value();
  c->Increment({"error"});
  c->Increment({"What is 2+2?"});    // prompt text: refused
  c->Increment({"error", "extra"});  // wrong number of values
  c->Increment();                    // no values for a labelled family
  EXPECT_EQ(c->dropped(), 3u);
  EXPECT_EQ(c->Value({"error"}), 1.0);
  EXPECT_EQ(r.Expose(),
            "# HELP test_errors_total Errors, in errors.\n"
            "# TYPE test_errors_total counter\n"
            "test_errors_total{kind=\"error\"} 1\n"
            "test_errors_total{kind=\"timeout\"} 0\n");
}

TEST(Metrics, EscapesLabelValuesAndHelp) {
  Registry r;
  // HELP escapes `\` (newlines are refused) and leaves quotes; label values escape `\`, `"` and
  // newline.
  Gauge* g = r.AddGauge("test_paths", "Paths seen, in C:\\ style \"quoted\".",
                        {{"path", {"C:\\tmp", "say \"hi\"", "two\nlines"}}})
                 .value();
  g->Set({"two\nlines"}, 1);
  EXPECT_EQ(g->help(), "Paths seen, in C:\\ style \"quoted\".");  // unescaped here
  EXPECT_EQ(r.Expose(),
            "# HELP test_paths Paths seen, in C:\\\\ style \"quoted\".\n"
            "# TYPE test_paths gauge\n"
            "test_paths{path=\"C:\\\\tmp\"} 0\n"
            "test_paths{path=\"say \\\"hi\\\"\"} 0\n"
            "test_paths{path=\"two\\nlines\"} 1\n");
}

// The sample text of a gauge set to `value`.
std::string ExposedValue(double value) {
  Registry r;
  r.AddGauge("test_value", "A value, unitless.").value()->Set(value);
  const std::string text = r.Expose();
  const std::string sample = "\ntest_value ";
  const size_t at = text.find(sample);
  if (at == std::string::npos || text.back() != '\n') return "(no sample in: " + text + ")";
  return text.substr(at + sample.size(), text.size() - at - sample.size() - 1);
}

TEST(Metrics, ExposesNumbersAsPrometheusParsesThem) {
  EXPECT_EQ(ExposedValue(0), "0");
  EXPECT_EQ(ExposedValue(3), "3");
  EXPECT_EQ(ExposedValue(-2.5), "-2.5");
  EXPECT_EQ(ExposedValue(0.1), "0.1");
  EXPECT_EQ(ExposedValue(1e-6), "1e-06");
  EXPECT_EQ(ExposedValue(123456789), "123456789");
  EXPECT_EQ(ExposedValue(400000), "400000");  // counts: no exponent
  EXPECT_EQ(ExposedValue(-0.0), "-0");
  EXPECT_EQ(ExposedValue(1e20), "1e+20");
  // Go's strconv.ParseFloat (Prometheus, promtool) reads NaN in any case.
  EXPECT_EQ(ExposedValue(std::numeric_limits<double>::quiet_NaN()), "Nan");
  EXPECT_EQ(ExposedValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(ExposedValue(-std::numeric_limits<double>::infinity()), "-Inf");
  // 16 significant digits (std::numeric_limits<double>::max_digits10 - 1): the 17th a double
  // may need is rounded away, so a value reads back within 5e-16 of itself (relative), plus
  // strtod's own rounding of 2^-53.
  EXPECT_EQ(ExposedValue(0.1 + 0.2), "0.3");  // 0.30000000000000004 as a double
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> mantissa(-10, 10);
  std::uniform_int_distribution<int> exponent(-30, 30);
  for (int i = 0; i < 1000; ++i) {
    const double v = mantissa(rng) * std::pow(10.0, exponent(rng));
    const double read = std::strtod(ExposedValue(v).c_str(), nullptr);
    EXPECT_LE(std::abs(read - v), 6.2e-16 * std::abs(v)) << ExposedValue(v) << " for " << v;
  }
}

TEST(Metrics, HistogramCountsAValueEqualToABoundInThatBucketAndIgnoresNaN) {
  Registry r;
  Histogram* h = r.AddHistogram("test_size_bytes", "Sizes, in bytes.", {1, 2}).value();
  h->Observe(1);
  h->Observe(std::numeric_limits<double>::quiet_NaN());
  h->Observe(std::numeric_limits<double>::infinity());
  const std::string text = r.Expose();
  EXPECT_NE(text.find("test_size_bytes_bucket{le=\"1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("test_size_bytes_bucket{le=\"2\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("test_size_bytes_bucket{le=\"+Inf\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("test_size_bytes_count 2\n"), std::string::npos) << text;
}

TEST(Metrics, CounterIgnoresNegativeAndNonFiniteIncrements) {
  Registry r;
  Counter* c = r.AddCounter("test_things_total", "Things, in things.").value();
  c->Increment(2);
  c->Increment(-1);
  c->Increment(std::numeric_limits<double>::quiet_NaN());
  c->Increment(std::numeric_limits<double>::infinity());
  EXPECT_EQ(c->Value(), 2.0);
}

TEST(Metrics, GaugeSetsAndAdds) {
  Registry r;
  Gauge* g = r.AddGauge("test_depth", "Queue depth, in items.").value();
  g->Set(5);
  g->Add(-2);
  g->Add(0.5);
  EXPECT_EQ(g->Value(), 3.5);
}

TEST(Metrics, FamilyWithNoAllowedLabelValuesIsNotExposed) {
  Registry r;
  ASSERT_TRUE(r.AddGauge("test_reward", "Reward, unitless.", {{"reward_fn", {}}}).ok());
  EXPECT_EQ(r.Expose(), "");
}

TEST(Metrics, RegistryRefusesBadFamilies) {
  Registry r;
  ASSERT_TRUE(r.AddCounter("test_ok_total", "Fine, in things.").ok());
  EXPECT_EQ(r.AddGauge("test_ok_total", "Again.").status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(r.AddCounter("test_requests", "No suffix.").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test_depth_total", "Gauge with a counter suffix.").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("1st_metric", "Starts with a digit.").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test-dash", "Dash.").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test_no_help", "").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test_two_lines", "a\nb").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test_bad_label", "Bad label.", {{"__name", {"a"}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test_repeat", "Repeated value.", {{"k", {"a", "a"}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test_empty", "Empty value.", {{"k", {""}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddGauge("test_twice", "Key twice.", {{"k", {"a"}}, {"k", {"b"}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("test_le_seconds", "le label.", {1}, {{"le", {"a"}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("test_order_seconds", "Unsorted.", {1, 1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("test_none_seconds", "No buckets.", {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      r.AddHistogram("test_inf_seconds", "Inf bound.", {1, std::numeric_limits<double>::infinity()})
          .status()
          .code(),
      StatusCode::kInvalidArgument);
  std::vector<std::string> many;
  for (int i = 0; i < 40; ++i) many.push_back(std::to_string(i));
  EXPECT_EQ(r.AddGauge("test_wide", "Too many series.", {{"a", many}, {"b", many}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      r.Expose(),
      "# HELP test_ok_total Fine, in things.\n# TYPE test_ok_total counter\ntest_ok_total 0\n");
}

// Prometheus' own parser (promtool's) reads the cases this file writes by hand: escaped HELP
// (prometheus-cpp alone writes it verbatim, and `\ ` is then an invalid escape), escaped label
// values, Nan and the infinities, and a histogram with _count and _sum before its buckets.
TEST(Metrics, PromtoolParsesTheEdgeCases) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus; deploy/setup.sh)";
  }
  Registry r;
  r.AddGauge("test_paths", "Paths seen, in C:\\ style \"quoted\".",
             {{"path", {"C:\\tmp", "say \"hi\"", "two\nlines"}}})
      .value()
      ->Set({"two\nlines"}, 1);
  Gauge* values =
      r.AddGauge("test_values", "Values, unitless.", {{"k", {"nan", "inf", "ninf"}}}).value();
  values->Set({"nan"}, std::numeric_limits<double>::quiet_NaN());
  values->Set({"inf"}, std::numeric_limits<double>::infinity());
  values->Set({"ninf"}, -std::numeric_limits<double>::infinity());
  r.AddHistogram("test_call_seconds", "Call time, in seconds.", {0.5, 1}, {{"fn", {"a", "b"}}})
      .value()
      ->Observe({"b"}, 0.75);
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("grpo_metrics_promtool_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path in = dir / "metrics.txt", out = dir / "promtool.txt";
  std::ofstream(in) << r.Expose();
  const int rc = std::system(
      ("promtool check metrics < " + in.string() + " > " + out.string() + " 2>&1").c_str());
  std::stringstream problems;
  problems << std::ifstream(out).rdbuf();
  fs::remove_all(dir);
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(problems.str(), "") << r.Expose();
}

TEST(Metrics, ConcurrentIncrementsAllCount) {
  Registry r;
  Counter* c = r.AddCounter("test_hits_total", "Hits, in hits.", {{"k", {"a", "b"}}}).value();
  Histogram* h = r.AddHistogram("test_work_seconds", "Work, in seconds.", {0.5, 2}).value();
  constexpr int kThreads = 8, kPerThread = 50'000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        c->Increment({t % 2 == 0 ? "a" : "b"});
        h->Observe(1.0);
      }
    });
  }
  threads.emplace_back([&] {  // exposition while writers run must be safe
    for (int i = 0; i < 50; ++i) EXPECT_FALSE(r.Expose().empty());
  });
  for (auto& th : threads) th.join();
  EXPECT_EQ(c->Value({"a"}), kThreads / 2 * kPerThread);
  EXPECT_EQ(c->Value({"b"}), kThreads / 2 * kPerThread);
  EXPECT_EQ(h->Count(), static_cast<uint64_t>(kThreads * kPerThread));
  EXPECT_EQ(h->Sum(), kThreads * kPerThread * 1.0);
  const std::string text = r.Expose();
  EXPECT_NE(text.find("test_work_seconds_bucket{le=\"2\"} 400000\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace grpo::common
