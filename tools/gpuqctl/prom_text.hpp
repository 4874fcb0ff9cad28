// A reader of the Prometheus text exposition format (version 0.0.4), enough to read back what
// gpuqd writes (`gpuqctl metrics`, docs/metrics.md) for `gpuqctl top`. It reads samples only:
// HELP and TYPE lines are comments to it, and a histogram is its _bucket, _sum and _count series.
// Private to gpuqctl (tools/gpuqctl/).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpuq/error.hpp"

namespace gpuq::ctl {

// One sample line: `name{label="value",...} value [timestamp]`.
struct PromSample {
  std::string name;
  // In the order written; values unescaped (\\ \" \n).
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;

  // The value of label `key`, or "" when the sample has none (Prometheus reads a missing label
  // as an empty one). Thread-safe.
  std::string_view label(std::string_view key) const;
};

// Parses a whole exposition text into its samples, in order. Empty lines and lines that start
// with '#' (HELP, TYPE, any other comment) are skipped; blanks around tokens and a trailing '\r'
// are allowed; a timestamp after the value is read and dropped. Values are decimal or exponent
// numbers with an optional sign, and +Inf, -Inf, Inf and NaN in any case.
// Errors: kInvalidArgument "metrics line N: <what is wrong>" for the first malformed line (a bad
// metric or label name, a label value without its closing quote or with an unknown escape, a
// missing or malformed value, text after the timestamp). Thread-safe (no shared state).
Result<std::vector<PromSample>> parse_prom_text(std::string_view text);

// A sample value as the format writes it (see parse_prom_text), or nullopt when `text` is not
// one in full. Thread-safe.
std::optional<double> parse_prom_value(std::string_view text);

}  // namespace gpuq::ctl
