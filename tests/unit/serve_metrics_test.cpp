// Tests of the Prometheus metrics registry of `moelora serve` (serve/metrics.h): the exact text
// exposition of a small registry, escaping, number formatting, name validation, the series limit
// with its dropped-series counter, and concurrent updates.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "serve/metrics.h"

namespace moelora::serve {
namespace {

// The lines the constructor's built-in family always contributes before any declared family.
const std::string kDroppedHeader =
    "# HELP moelora_metrics_dropped_series_total Metric updates dropped because their family "
    "already held the maximum number of label sets.\n"
    "# TYPE moelora_metrics_dropped_series_total counter\n";

// Runs fn, expects a moelora::Error with kInvalidArgument whose message contains `needle`.
template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not contain '" << needle << "'";
  }
}

TEST(ServeMetrics, RendersExactText) {
  MetricsRegistry r;
  r.add_counter("moelora_requests_total", "Requests served.");
  r.add_gauge("moelora_running_requests", "Requests running now.");
  r.add_histogram("moelora_ttft_seconds", "Time to first token.", {0.1, 0.5, 1});
  r.add_gauge("moelora_untouched", "Declared, never updated.");

  r.increment("moelora_requests_total", {{"model", "base"}, {"status", "ok"}});
  r.increment("moelora_requests_total", {{"model", "math"}, {"status", "ok"}}, 2);
  // Same label set in another order: the first series, not a third one.
  r.increment("moelora_requests_total", {{"status", "ok"}, {"model", "base"}}, 3);
  r.set("moelora_running_requests", {}, 5);
  r.add("moelora_running_requests", {}, -2);
  r.add("moelora_running_requests", {}, 0.5);
  r.observe("moelora_ttft_seconds", {{"model", "base"}}, 0.05);  // first bucket
  r.observe("moelora_ttft_seconds", {{"model", "base"}}, 0.5);   // exactly a bound: le inclusive
  r.observe("moelora_ttft_seconds", {{"model", "base"}}, 0.7);   // (0.5, 1]
  r.observe("moelora_ttft_seconds", {{"model", "base"}}, 3);     // above the last bound
  r.observe("moelora_ttft_seconds", {}, 0.25);                   // unlabelled series

  const std::string expected = kDroppedHeader +
                               "# HELP moelora_requests_total Requests served.\n"
                               "# TYPE moelora_requests_total counter\n"
                               "moelora_requests_total{model=\"base\",status=\"ok\"} 4\n"
                               "moelora_requests_total{model=\"math\",status=\"ok\"} 2\n"
                               "# HELP moelora_running_requests Requests running now.\n"
                               "# TYPE moelora_running_requests gauge\n"
                               "moelora_running_requests 3.5\n"
                               "# HELP moelora_ttft_seconds Time to first token.\n"
                               "# TYPE moelora_ttft_seconds histogram\n"
                               "moelora_ttft_seconds_bucket{model=\"base\",le=\"0.1\"} 1\n"
                               "moelora_ttft_seconds_bucket{model=\"base\",le=\"0.5\"} 2\n"
                               "moelora_ttft_seconds_bucket{model=\"base\",le=\"1\"} 3\n"
                               "moelora_ttft_seconds_bucket{model=\"base\",le=\"+Inf\"} 4\n"
                               "moelora_ttft_seconds_sum{model=\"base\"} 4.25\n"
                               "moelora_ttft_seconds_count{model=\"base\"} 4\n"
                               "moelora_ttft_seconds_bucket{le=\"0.1\"} 0\n"
                               "moelora_ttft_seconds_bucket{le=\"0.5\"} 1\n"
                               "moelora_ttft_seconds_bucket{le=\"1\"} 1\n"
                               "moelora_ttft_seconds_bucket{le=\"+Inf\"} 1\n"
                               "moelora_ttft_seconds_sum 0.25\n"
                               "moelora_ttft_seconds_count 1\n"
                               "# HELP moelora_untouched Declared, never updated.\n"
                               "# TYPE moelora_untouched gauge\n";
  EXPECT_EQ(r.render(), expected);
  EXPECT_STREQ(MetricsRegistry::content_type(), "text/plain; version=0.0.4; charset=utf-8");
}

TEST(ServeMetrics, EscapesLabelValuesAndHelp) {
  MetricsRegistry r;
  r.add_counter("adapter_requests_total", "Line one\nback\\slash \"quotes\" stay.");
  r.increment("adapter_requests_total", {{"adapter", "a\"b\\c\nd"}});
  // Invalid UTF-8 (a lone continuation byte) is replaced, so the scrape stays parseable.
  r.increment("adapter_requests_total", {{"adapter", std::string("x\x80y")}});
  const std::string expected =
      kDroppedHeader +
      "# HELP adapter_requests_total Line one\\nback\\\\slash \"quotes\" stay.\n"
      "# TYPE adapter_requests_total counter\n"
      "adapter_requests_total{adapter=\"a\\\"b\\\\c\\nd\"} 1\n"
      "adapter_requests_total{adapter=\"x\xEF\xBF\xBDy\"} 1\n";
  EXPECT_EQ(r.render(), expected);
}

TEST(ServeMetrics, FormatsNumbers) {
  EXPECT_EQ(format_metric_value(0), "0");
  EXPECT_EQ(format_metric_value(-0.0), "0");
  EXPECT_EQ(format_metric_value(42), "42");
  EXPECT_EQ(format_metric_value(-7), "-7");
  EXPECT_EQ(format_metric_value(0.005), "0.005");
  EXPECT_EQ(format_metric_value(2.5), "2.5");
  EXPECT_EQ(format_metric_value(9007199254740991.0), "9007199254740991");  // 2^53 - 1
  EXPECT_EQ(format_metric_value(1e300), "1e+300");
  EXPECT_EQ(format_metric_value(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(format_metric_value(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(format_metric_value(std::nan("")), "NaN");
}

TEST(ServeMetrics, LatencyBucketsAreAValidHistogram) {
  const std::vector<double> b = latency_buckets_seconds();
  EXPECT_GE(b.size(), 15u);
  EXPECT_DOUBLE_EQ(b.front(), 0.001);
  EXPECT_DOUBLE_EQ(b.back(), 60.0);
  MetricsRegistry r;
  r.add_histogram("moelora_itl_seconds", "Inter-token latency.", b);  // must not throw
}

TEST(ServeMetrics, RejectsBadNamesNamingThem) {
  MetricsRegistry r;
  expect_invalid([&] { r.add_counter("1bad_total", "h"); }, "'1bad_total'");
  expect_invalid([&] { r.add_gauge("has-dash", "h"); }, "'has-dash'");
  expect_invalid([&] { r.add_gauge("", "h"); }, "''");
  r.add_counter("ns:ok_total", "colons are allowed in metric names");

  r.add_counter("req_total", "h");
  expect_invalid([&] { r.increment("req_total", {{"bad-label", "v"}}); }, "'bad-label'");
  expect_invalid([&] { r.increment("req_total", {{"__reserved", "v"}}); }, "'__reserved'");
  expect_invalid([&] { r.increment("req_total", {{"a:b", "v"}}); }, "'a:b'");
  expect_invalid([&] { r.increment("req_total", {{"x", "1"}, {"x", "2"}}); }, "'x'");
  expect_invalid([&] { r.increment("req_total", {}, -1); }, "'req_total'");
  expect_invalid([&] { r.increment("req_total", {}, std::nan("")); }, "'req_total'");

  r.add_histogram("lat_seconds", "h", {1, 2});
  expect_invalid([&] { r.observe("lat_seconds", {{"le", "1"}}, 1); }, "'lat_seconds'");

  // Undeclared names and wrong kinds.
  expect_invalid([&] { r.increment("missing_total"); }, "'missing_total'");
  expect_invalid([&] { r.set("req_total", {}, 1); }, "'req_total'");
  expect_invalid([&] { r.observe("req_total", {}, 1); }, "'req_total'");
  expect_invalid([&] { r.increment("lat_seconds"); }, "'lat_seconds'");
  expect_invalid([&] { (void)r.value("lat_seconds"); }, "'lat_seconds'");
  expect_invalid([&] { (void)r.value("missing_total"); }, "'missing_total'");

  // Redeclaration: same kind and buckets is a no-op, anything else an error.
  r.add_counter("req_total", "other help is ignored");
  r.add_histogram("lat_seconds", "h", {1, 2});
  expect_invalid([&] { r.add_gauge("req_total", "h"); }, "'req_total'");
  expect_invalid([&] { r.add_histogram("lat_seconds", "h", {1, 3}); }, "'lat_seconds'");

  // Bucket bounds.
  expect_invalid([&] { r.add_histogram("h1", "h", {1, 1}); }, "'h1'");
  expect_invalid([&] { r.add_histogram("h2", "h", {2, 1}); }, "'h2'");
  expect_invalid(
      [&] {
        r.add_histogram("h3", "h", {1, std::numeric_limits<double>::infinity()});
      },
      "'h3'");
  expect_invalid([&] { r.add_histogram("h4", "h", {std::nan("")}); }, "'h4'");

  // None of the failed calls left a series or family behind.
  EXPECT_EQ(r.render().find("h1"), std::string::npos);
  EXPECT_EQ(r.render().find("req_total{"), std::string::npos);
}

TEST(ServeMetrics, SeriesLimitDropsAndCountsNewLabelSets) {
  MetricsRegistry r(2);
  r.add_counter("by_adapter_total", "h");
  r.add_gauge("other", "h");
  r.increment("by_adapter_total", {{"adapter", "a"}});
  r.increment("by_adapter_total", {{"adapter", "b"}});
  r.increment("by_adapter_total", {{"adapter", "c"}});  // dropped
  r.increment("by_adapter_total", {{"adapter", "d"}});  // dropped
  r.increment("by_adapter_total", {{"adapter", "a"}});  // existing series still update
  r.set("other", {{"k", "1"}}, 1);
  r.set("other", {{"k", "2"}}, 2);
  r.set("other", {{"k", "3"}}, 3);  // dropped

  EXPECT_EQ(r.value("by_adapter_total", {{"adapter", "a"}}), 2);
  EXPECT_EQ(r.value("by_adapter_total", {{"adapter", "c"}}), 0);
  EXPECT_EQ(r.value(MetricsRegistry::kDroppedSeriesName, {{"family", "by_adapter_total"}}), 2);
  EXPECT_EQ(r.value(MetricsRegistry::kDroppedSeriesName, {{"family", "other"}}), 1);

  const std::string expected =
      kDroppedHeader +
      "moelora_metrics_dropped_series_total{family=\"by_adapter_total\"} 2\n"
      "moelora_metrics_dropped_series_total{family=\"other\"} 1\n"
      "# HELP by_adapter_total h\n"
      "# TYPE by_adapter_total counter\n"
      "by_adapter_total{adapter=\"a\"} 2\n"
      "by_adapter_total{adapter=\"b\"} 1\n"
      "# HELP other h\n"
      "# TYPE other gauge\n"
      "other{k=\"1\"} 1\n"
      "other{k=\"2\"} 2\n";
  EXPECT_EQ(r.render(), expected);

  // Many hostile label values cost no memory beyond the limit.
  for (int i = 0; i < 1000; ++i) r.increment("by_adapter_total", {{"adapter", std::to_string(i)}});
  EXPECT_EQ(r.value(MetricsRegistry::kDroppedSeriesName, {{"family", "by_adapter_total"}}), 1002);
}

TEST(ServeMetrics, ValueOfMissingSeriesIsZero) {
  MetricsRegistry r;
  r.add_counter("c_total", "h");
  r.add_gauge("g", "h");
  EXPECT_EQ(r.value("c_total"), 0);
  EXPECT_EQ(r.value("g", {{"x", "y"}}), 0);
  r.increment("c_total");
  r.increment("c_total", {}, 0.5);
  r.set("g", {{"x", "y"}}, -4);
  EXPECT_EQ(r.value("c_total"), 1.5);
  EXPECT_EQ(r.value("g", {{"x", "y"}}), -4);
  EXPECT_EQ(r.value("g"), 0);
}

TEST(ServeMetrics, ConcurrentUpdatesSumExactly) {
  MetricsRegistry r;
  r.add_counter("hits_total", "h");
  r.add_gauge("level", "h");
  r.add_histogram("lat_seconds", "h", {0.5});
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&r, t] {
      const MetricLabels mine = {{"thread", std::to_string(t % 2)}};
      for (int i = 0; i < kPerThread; ++i) {
        r.increment("hits_total");
        r.increment("hits_total", mine);
        r.add("level", {}, (i % 2 == 0) ? 1 : -1);
        r.observe("lat_seconds", {}, 1);
        if (i % 1000 == 0) (void)r.render();  // readers interleave with writers
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(r.value("hits_total"), double{kThreads} * kPerThread);
  EXPECT_EQ(r.value("hits_total", {{"thread", "0"}}), double{kThreads / 2} * kPerThread);
  EXPECT_EQ(r.value("hits_total", {{"thread", "1"}}), double{kThreads / 2} * kPerThread);
  EXPECT_EQ(r.value("level"), 0);
  const std::string text = r.render();
  EXPECT_NE(text.find("lat_seconds_count 160000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_seconds_bucket{le=\"+Inf\"} 160000\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_seconds_bucket{le=\"0.5\"} 0\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace moelora::serve
