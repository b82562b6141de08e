// deploy/grafana/dashboards/grpo.json queries only what the services expose: every metric name
// in its PromQL is a sample name of a registry holding every LearnerMetrics and WorkerMetrics
// family, and every label it groups by or prints is one those samples carry.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "tests/deploy/deploy_test_util.h"

namespace grpo::testing {
namespace {

using nlohmann::json;

struct Query {
  std::string panel, expr, legend;
};

std::vector<Query> Queries(const json& dashboard) {
  std::vector<Query> out;
  for (const json& p : dashboard.at("panels")) {
    if (!p.contains("targets")) continue;
    for (const json& t : p.at("targets")) {
      out.push_back({p.at("title").get<std::string>(), t.at("expr").get<std::string>(),
                     t.value("legendFormat", "")});
    }
  }
  return out;
}

// Metric names in a PromQL expression: identifiers left after removing strings, label
// matchers {...}, range selectors [...], grouping clauses by (...) and the like, that are
// neither function calls nor keywords.
std::set<std::string> MetricNames(std::string expr) {
  expr = std::regex_replace(expr, std::regex(R"("([^"\\]|\\.)*")"), " ");
  expr = std::regex_replace(expr, std::regex(R"(\{[^}]*\})"), " ");
  expr = std::regex_replace(expr, std::regex(R"(\[[^\]]*\])"), " ");
  expr = std::regex_replace(
      expr, std::regex(R"(\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\))"), " ");
  static const std::set<std::string> kKeywords = {"and", "or",  "unless", "bool", "offset",
                                                  "inf", "nan", "Inf",    "NaN"};
  std::set<std::string> names;
  const std::regex ident(R"((^|[^a-zA-Z0-9_:.$])([a-zA-Z_:][a-zA-Z0-9_:]*))");
  for (auto it = std::sregex_iterator(expr.begin(), expr.end(), ident);
       it != std::sregex_iterator(); ++it) {
    const size_t after = expr.find_first_not_of(' ', it->position(2) + it->length(2));
    if (after != std::string::npos && expr[after] == '(') continue;  // a function call
    const std::string name = (*it)[2];
    if (!kKeywords.count(name)) names.insert(name);
  }
  return names;
}

// Label names in by (...)/without (...) clauses and in {{label}} legend templates.
std::set<std::string> LabelNames(const Query& q) {
  std::set<std::string> labels;
  const std::regex clause(R"(\b(?:by|without)\s*\(([^)]*)\))"), word(R"([a-zA-Z_][a-zA-Z0-9_]*)");
  for (auto it = std::sregex_iterator(q.expr.begin(), q.expr.end(), clause);
       it != std::sregex_iterator(); ++it) {
    const std::string inside = (*it)[1];
    for (auto w = std::sregex_iterator(inside.begin(), inside.end(), word);
         w != std::sregex_iterator(); ++w) {
      labels.insert(w->str());
    }
  }
  const std::regex legend(R"(\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\})");
  for (auto it = std::sregex_iterator(q.legend.begin(), q.legend.end(), legend);
       it != std::sregex_iterator(); ++it) {
    labels.insert((*it)[1]);
  }
  return labels;
}

json Dashboard() { return json::parse(ReadRepoFile("deploy/grafana/dashboards/grpo.json")); }

TEST(GrafanaDashboard, ExtractsMetricNamesFromPromQL) {
  EXPECT_EQ(MetricNames("histogram_quantile(0.95, sum by (le, reward_fn) "
                        "(rate(grpo_x_bucket{job=\"a\"}[$__rate_interval])))"),
            (std::set<std::string>{"grpo_x_bucket"}));
  EXPECT_EQ(MetricNames("rate(a_sum[5m]) / rate(a_count[5m]) * 60 + b offset 1h"),
            (std::set<std::string>{"a_sum", "a_count", "b"}));
  EXPECT_EQ(MetricNames("up == 1e-06"), (std::set<std::string>{"up"}));
}

TEST(GrafanaDashboard, QueriesOnlyMetricsTheServicesExpose) {
  const ExposedNames exposed = ProjectMetricNames();
  ASSERT_FALSE(exposed.metrics.empty());
  const std::vector<Query> queries = Queries(Dashboard());
  ASSERT_GE(queries.size(), 20u);
  std::set<std::string> used;
  for (const Query& q : queries) {
    const std::set<std::string> names = MetricNames(q.expr);
    EXPECT_FALSE(names.empty()) << q.panel << ": " << q.expr;
    for (const std::string& n : names) {
      EXPECT_TRUE(exposed.metrics.count(n)) << q.panel << ": unknown metric " << n;
      used.insert(n);
    }
  }
  // The panels the issue asks for, by the families they read.
  for (const char* family :
       {"grpo_reward_mean", "grpo_reward_fn_mean", "grpo_kl", "grpo_clip_ratio", "grpo_loss",
        "grpo_learner_tokens_per_second", "grpo_rollout_tokens_generated_total",
        "grpo_staleness_versions_bucket", "grpo_step_duration_seconds_bucket",
        "grpo_weight_sync_duration_seconds_bucket", "grpo_ledger_prompts",
        "grpo_groups_rejected_total"}) {
    EXPECT_TRUE(used.count(family)) << "no panel reads " << family;
  }
}

TEST(GrafanaDashboard, GroupsAndLegendsUseLabelsTheMetricsCarry) {
  const ExposedNames exposed = ProjectMetricNames();
  for (const Query& q : Queries(Dashboard())) {
    for (const std::string& label : LabelNames(q)) {
      // instance and job come from Prometheus' scrape, le from histograms.
      EXPECT_TRUE(exposed.labels.count(label) || label == "instance" || label == "job")
          << q.panel << ": unknown label " << label;
    }
  }
}

TEST(GrafanaDashboard, PanelIdsAreUniqueAndEveryPanelUsesTheDatasourceVariable) {
  const json d = Dashboard();
  EXPECT_EQ(d.at("uid"), "grpo-serve");
  std::set<int> ids;
  for (const json& p : d.at("panels")) {
    EXPECT_TRUE(ids.insert(p.at("id").get<int>()).second) << p.at("title");
    if (p.at("type") == "row") continue;
    EXPECT_EQ(p.at("datasource").at("uid"), "${datasource}") << p.at("title");
  }
  EXPECT_EQ(d.at("templating").at("list").at(0).at("name"), "datasource");
}

}  // namespace
}  // namespace grpo::testing
