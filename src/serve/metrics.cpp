// Prometheus metrics registry and text exposition (see metrics.h).
#include "serve/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <system_error>

#include "core/error.h"
#include "io/tokenizer.h"

namespace moelora::serve {
namespace {

bool valid_metric_name(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Label names: as metric names without ':'; "__" is reserved for Prometheus itself.
bool valid_label_name(std::string_view s) {
  if (s.empty() || s.starts_with("__")) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Label values are stored sanitized, so the key is built from the same bytes that are printed:
// two invalid values that print alike must be one series, not two identical lines.
MetricLabels sanitized(const MetricLabels& labels) {
  MetricLabels out;
  out.reserve(labels.size());
  for (const auto& [k, v] : labels) out.emplace_back(k, io::sanitize_utf8(v));
  return out;
}

// Identifies a label set regardless of order. Length prefixes keep ("a","bc") and ("ab","c")
// apart whatever bytes the values hold.
std::string series_key(const MetricLabels& labels) {
  std::vector<const std::pair<std::string, std::string>*> sorted;
  sorted.reserve(labels.size());
  for (const auto& p : labels) sorted.push_back(&p);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->first < b->first; });
  std::string key;
  for (const auto* p : sorted) {
    key += std::to_string(p->first.size()) + ':' + p->first;
    key += std::to_string(p->second.size()) + ':' + p->second;
  }
  return key;
}

void append_escaped_label_value(std::string& out, std::string_view v) {
  for (const char c : v) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
}

void append_escaped_help(std::string& out, std::string_view v) {
  for (const char c : v) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
}

// {a="x",b="y"} plus an optional trailing le="..."; nothing at all for an empty set.
void append_labels(std::string& out, const MetricLabels& labels, const std::string* le = nullptr) {
  if (labels.empty() && le == nullptr) return;
  out += '{';
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ',';
    first = false;
    out += k;
    out += "=\"";
    append_escaped_label_value(out, v);
    out += '"';
  }
  if (le != nullptr) {
    if (!first) out += ',';
    out += "le=\"";
    out += *le;
    out += '"';
  }
  out += '}';
}

void append_sample(std::string& out, std::string_view name, const MetricLabels& labels,
                   double value, const std::string* le = nullptr) {
  out += name;
  append_labels(out, labels, le);
  out += ' ';
  out += format_metric_value(value);
  out += '\n';
}

}  // namespace

std::string format_metric_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Counters are mostly integral; "3" rather than "3.0" or "3e+00" matches the Go client and
  // keeps the page readable. Beyond 2^53 not every integer is a double, so print it exactly.
  constexpr double kExactIntLimit = 9007199254740992.0;  // 2^53
  if (v == std::trunc(v) && std::fabs(v) < kExactIntLimit) {
    return std::to_string(static_cast<int64_t>(v));
  }
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  MOELORA_ASSERT(ec == std::errc());
  return std::string(buf, end);
}

std::vector<double> latency_buckets_seconds() {
  return {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1,  0.25,
          0.5,   0.75,   1.0,   2.5,    5.0,  7.5,   10.0, 20.0,  30.0, 60.0};
}

MetricsRegistry::MetricsRegistry(size_t max_series_per_family)
    : max_series_per_family_(max_series_per_family) {
  MOELORA_CHECK(max_series_per_family >= 1, ErrorCode::kInvalidArgument,
                "max_series_per_family must be at least 1; got 0");
  add_counter(kDroppedSeriesName,
              "Metric updates dropped because their family already held the maximum number of "
              "label sets.");
}

const char* MetricsRegistry::kind_name(Kind kind) {
  switch (kind) {
    case Kind::kCounter: return "counter";
    case Kind::kGauge: return "gauge";
    case Kind::kHistogram: return "histogram";
  }
  return "unknown";
}

void MetricsRegistry::add_counter(const std::string& name, const std::string& help) {
  declare(name, help, Kind::kCounter, {});
}

void MetricsRegistry::add_gauge(const std::string& name, const std::string& help) {
  declare(name, help, Kind::kGauge, {});
}

void MetricsRegistry::add_histogram(const std::string& name, const std::string& help,
                                    std::vector<double> upper_bounds) {
  for (size_t i = 0; i < upper_bounds.size(); ++i) {
    MOELORA_CHECK(std::isfinite(upper_bounds[i]), ErrorCode::kInvalidArgument, "histogram '", name,
                  "': bucket bound ", i, " is ", format_metric_value(upper_bounds[i]),
                  "; bounds must be finite (+Inf is added implicitly)");
    MOELORA_CHECK(i == 0 || upper_bounds[i - 1] < upper_bounds[i], ErrorCode::kInvalidArgument,
                  "histogram '", name, "': bucket bounds must be strictly increasing; bound ", i,
                  " (", format_metric_value(upper_bounds[i]), ") follows ",
                  format_metric_value(upper_bounds[i == 0 ? 0 : i - 1]));
  }
  declare(name, help, Kind::kHistogram, std::move(upper_bounds));
}

void MetricsRegistry::declare(const std::string& name, const std::string& help, Kind kind,
                              std::vector<double> upper_bounds) {
  MOELORA_CHECK(valid_metric_name(name), ErrorCode::kInvalidArgument, "metric name '", name,
                "' is invalid; names must match [a-zA-Z_:][a-zA-Z0-9_:]*");
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = by_name_.find(name); it != by_name_.end()) {
    const Family& f = *it->second;
    MOELORA_CHECK(f.kind == kind, ErrorCode::kInvalidArgument, "metric '", name,
                  "' is already declared as a ", kind_name(f.kind), "; cannot redeclare it as a ",
                  kind_name(kind));
    MOELORA_CHECK(f.upper_bounds == upper_bounds, ErrorCode::kInvalidArgument, "histogram '", name,
                  "' is already declared with other bucket bounds");
    return;
  }
  auto f = std::make_unique<Family>();
  f->name = name;
  f->help = help;
  f->kind = kind;
  f->upper_bounds = std::move(upper_bounds);
  by_name_.emplace(name, f.get());
  families_.push_back(std::move(f));
}

MetricsRegistry::Family& MetricsRegistry::family(std::string_view name, Kind kind) {
  auto it = by_name_.find(name);
  MOELORA_CHECK(it != by_name_.end(), ErrorCode::kInvalidArgument, "metric '", name,
                "' is not declared");
  MOELORA_CHECK(it->second->kind == kind, ErrorCode::kInvalidArgument, "metric '", name, "' is a ",
                kind_name(it->second->kind), ", not a ", kind_name(kind));
  return *it->second;
}

const MetricsRegistry::Family& MetricsRegistry::family_any(std::string_view name) const {
  auto it = by_name_.find(name);
  MOELORA_CHECK(it != by_name_.end(), ErrorCode::kInvalidArgument, "metric '", name,
                "' is not declared");
  return *it->second;
}

MetricsRegistry::Series* MetricsRegistry::series(Family& family, const MetricLabels& labels) {
  MetricLabels clean = sanitized(labels);
  std::string key = series_key(clean);
  if (auto it = family.index.find(key); it != family.index.end()) return &family.series[it->second];

  // A new label set: check it even when the family is full, so that a bad label name shows up
  // as an error rather than as a silent drop.
  for (size_t i = 0; i < clean.size(); ++i) {
    const std::string& label = clean[i].first;
    MOELORA_CHECK(valid_label_name(label), ErrorCode::kInvalidArgument, "metric '", family.name,
                  "': label name '", label,
                  "' is invalid; label names must match [a-zA-Z_][a-zA-Z0-9_]* and not start "
                  "with \"__\"");
    MOELORA_CHECK(!(family.kind == Kind::kHistogram && label == "le"), ErrorCode::kInvalidArgument,
                  "histogram '", family.name, "': label name 'le' is reserved for bucket bounds");
    for (size_t j = 0; j < i; ++j) {
      MOELORA_CHECK(clean[j].first != label, ErrorCode::kInvalidArgument, "metric '", family.name,
                    "': label name '", label, "' is given twice");
    }
  }

  // The dropped-series counter has one series per family, so it can never fill up itself.
  if (family.series.size() >= max_series_per_family_ && family.name != kDroppedSeriesName) {
    Family& dropped = *by_name_.find(kDroppedSeriesName)->second;
    if (Series* s = series(dropped, {{"family", family.name}})) s->value += 1;
    return nullptr;
  }
  Series s;
  s.labels = std::move(clean);
  if (family.kind == Kind::kHistogram) s.bucket_counts.assign(family.upper_bounds.size() + 1, 0);
  family.index.emplace(std::move(key), family.series.size());
  family.series.push_back(std::move(s));
  return &family.series.back();
}

void MetricsRegistry::increment(std::string_view name, const MetricLabels& labels, double by) {
  MOELORA_CHECK(by >= 0, ErrorCode::kInvalidArgument, "counter '", name,
                "': increment must be >= 0; got ", format_metric_value(by));
  std::lock_guard<std::mutex> lock(mu_);
  if (Series* s = series(family(name, Kind::kCounter), labels)) s->value += by;
}

void MetricsRegistry::set(std::string_view name, const MetricLabels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Series* s = series(family(name, Kind::kGauge), labels)) s->value = value;
}

void MetricsRegistry::add(std::string_view name, const MetricLabels& labels, double delta) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Series* s = series(family(name, Kind::kGauge), labels)) s->value += delta;
}

void MetricsRegistry::observe(std::string_view name, const MetricLabels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = family(name, Kind::kHistogram);
  Series* s = series(f, labels);
  if (s == nullptr) return;
  // le is inclusive: a value equal to a bound lands in that bound's bucket. NaN compares false
  // with everything and goes to +Inf, as in the Prometheus client libraries.
  const size_t bucket = std::isnan(value)
                            ? f.upper_bounds.size()
                            : static_cast<size_t>(std::lower_bound(f.upper_bounds.begin(),
                                                                   f.upper_bounds.end(), value) -
                                                  f.upper_bounds.begin());
  s->bucket_counts[bucket] += 1;
  s->sum += value;
  s->count += 1;
}

double MetricsRegistry::value(std::string_view name, const MetricLabels& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Family& f = family_any(name);
  MOELORA_CHECK(f.kind != Kind::kHistogram, ErrorCode::kInvalidArgument, "metric '", name,
                "' is a histogram; value() reads counters and gauges only");
  auto it = f.index.find(series_key(sanitized(labels)));
  return it == f.index.end() ? 0.0 : f.series[it->second].value;
}

std::string MetricsRegistry::render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& fp : families_) {
    const Family& f = *fp;
    out += "# HELP " + f.name + ' ';
    append_escaped_help(out, f.help);
    out += "\n# TYPE " + f.name + ' ' + kind_name(f.kind) + '\n';
    if (f.kind != Kind::kHistogram) {
      for (const Series& s : f.series) append_sample(out, f.name, s.labels, s.value);
      continue;
    }
    std::vector<std::string> les;
    les.reserve(f.upper_bounds.size() + 1);
    for (const double b : f.upper_bounds) les.push_back(format_metric_value(b));
    les.push_back("+Inf");
    const std::string bucket_name = f.name + "_bucket";
    for (const Series& s : f.series) {
      uint64_t cumulative = 0;
      for (size_t i = 0; i < les.size(); ++i) {
        cumulative += s.bucket_counts[i];
        append_sample(out, bucket_name, s.labels, static_cast<double>(cumulative), &les[i]);
      }
      append_sample(out, f.name + "_sum", s.labels, s.sum);
      append_sample(out, f.name + "_count", s.labels, static_cast<double>(s.count));
    }
  }
  return out;
}

}  // namespace moelora::serve
