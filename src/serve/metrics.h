// Prometheus metrics for `moelora serve`: a small thread-safe registry of counters, gauges and
// histograms, rendered in the text exposition format 0.0.4 for GET /metrics.
//
// Families are declared once at startup (name, help, kind, histogram buckets); request threads
// then update series by label set, and the scrape handler calls render(). Declaring is where
// names are validated, so a typo is caught at startup rather than producing an unscrapable page.
// Updating an undeclared name or the wrong kind is a programming error and throws
// moelora::Error (kInvalidArgument).
//
// Label values can come from clients (adapter names), so each family holds at most
// max_series_per_family series: updates to further label sets are dropped and counted in
// moelora_metrics_dropped_series_total{family="..."} instead of growing memory without bound.
// Label values are stored as valid UTF-8 (invalid bytes become U+FFFD), since Prometheus rejects
// a whole scrape over one invalid label value.
//
// One mutex guards the whole registry: updates are rare next to the work they measure (a token,
// a request), and render() must see a consistent snapshot anyway.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace moelora::serve {

// Label name -> value, in the order they are printed. A series is identified by the set of
// pairs, so the same labels in another order update the same series.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class MetricsRegistry {
 public:
  // Counts label sets dropped because their family was full; label `family` names it.
  static constexpr const char* kDroppedSeriesName = "moelora_metrics_dropped_series_total";

  explicit MetricsRegistry(size_t max_series_per_family = 4096);
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Declares a family. Re-declaring a name with the same kind (and bucket list) is a no-op; a
  // different kind or bucket list, a bad metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or a bad
  // histogram bound list (not strictly increasing, not finite) throws kInvalidArgument naming
  // the metric. Counter names should end in _total (not enforced). Histograms get +Inf
  // implicitly.
  void add_counter(const std::string& name, const std::string& help);
  void add_gauge(const std::string& name, const std::string& help);
  void add_histogram(const std::string& name, const std::string& help,
                     std::vector<double> upper_bounds);

  // Update one series, created on first use. Throws kInvalidArgument for an undeclared name, the
  // wrong kind, a negative (or NaN) counter increment, and on a new series for a label name that
  // is not [a-zA-Z_][a-zA-Z0-9_]*, starts with "__", repeats, or is "le" on a histogram.
  void increment(std::string_view name, const MetricLabels& labels = {}, double by = 1.0);
  void set(std::string_view name, const MetricLabels& labels, double value);      // gauges
  void add(std::string_view name, const MetricLabels& labels, double delta);      // gauges
  void observe(std::string_view name, const MetricLabels& labels, double value);  // histograms

  // A counter's or gauge's current value; 0 if the series does not exist yet. Throws
  // kInvalidArgument for an undeclared name or a histogram.
  double value(std::string_view name, const MetricLabels& labels = {}) const;

  // Text exposition format 0.0.4: families in declaration order, each with its HELP and TYPE
  // lines (also when it has no series yet), series in the order they were created.
  std::string render() const;
  static const char* content_type() { return "text/plain; version=0.0.4; charset=utf-8"; }

 private:
  enum class Kind { kCounter, kGauge, kHistogram };

  struct Series {
    MetricLabels labels;  // as first given, values made valid UTF-8
    double value = 0;     // counter / gauge
    // Histogram: per-bucket (not cumulative) counts, one per upper bound plus +Inf.
    std::vector<uint64_t> bucket_counts;
    double sum = 0;
    uint64_t count = 0;
  };

  struct Family {
    std::string name;
    std::string help;
    Kind kind = Kind::kCounter;
    std::vector<double> upper_bounds;               // histograms, without the implicit +Inf
    std::vector<Series> series;                     // creation order = render order
    std::unordered_map<std::string, size_t> index;  // series_key(labels) -> position in series
  };

  void declare(const std::string& name, const std::string& help, Kind kind,
               std::vector<double> upper_bounds);
  // Needs mu_ held. Throws unless `name` is declared with kind `kind`.
  Family& family(std::string_view name, Kind kind);
  const Family& family_any(std::string_view name) const;
  // Needs mu_ held. The series of `labels`, created if the family has room; nullptr when the
  // family is full (the drop is counted).
  Series* series(Family& family, const MetricLabels& labels);

  static const char* kind_name(Kind kind);

  const size_t max_series_per_family_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Family>> families_;  // declaration order
  std::map<std::string, Family*, std::less<>> by_name_;
};

// Upper bounds in seconds for latency histograms (time to first token, inter-token latency,
// request duration): 1 ms to 60 s, roughly 1-2.5-5 per decade.
std::vector<double> latency_buckets_seconds();

// Formats a sample value as Prometheus does: integers below 2^53 without a decimal point,
// otherwise the shortest round-trip form; "+Inf", "-Inf", "NaN".
std::string format_metric_value(double v);

}  // namespace moelora::serve
