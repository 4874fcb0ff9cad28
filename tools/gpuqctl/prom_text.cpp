// A reader of the Prometheus text exposition format (prom_text.hpp).
#include "prom_text.hpp"

#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace gpuq::ctl {
namespace {

bool is_blank(char c) {
  return c == ' ' || c == '\t';
}
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_name_char(char c) {
  return is_name_start(c) || (c >= '0' && c <= '9');
}

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + 32) : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

// Reads one line, left to right; each read_* reports what is wrong in `error`.
class LineReader {
 public:
  explicit LineReader(std::string_view line) : line_(line) {}

  void skip_blanks() {
    while (at_ < line_.size() && is_blank(line_[at_])) ++at_;
  }
  bool done() const { return at_ >= line_.size(); }
  bool take(char c) {
    if (at_ < line_.size() && line_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }

  // A metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or, with `colon` false, a label name
  // ([a-zA-Z_][a-zA-Z0-9_]*).
  std::optional<std::string_view> read_name(bool colon) {
    const auto starts = [colon](char c) { return is_name_start(c) || (colon && c == ':'); };
    const auto continues = [colon](char c) { return is_name_char(c) || (colon && c == ':'); };
    const size_t begin = at_;
    if (at_ >= line_.size() || !starts(line_[at_])) return std::nullopt;
    ++at_;
    while (at_ < line_.size() && continues(line_[at_])) ++at_;
    return line_.substr(begin, at_ - begin);
  }

  // A quoted label value, unescaped; the reader stands on the opening quote.
  bool read_label_value(std::string& value, std::string& error) {
    if (!take('"')) {
      error = "a label value must be in double quotes";
      return false;
    }
    while (at_ < line_.size()) {
      const char c = line_[at_++];
      if (c == '"') return true;
      if (c != '\\') {
        value += c;
        continue;
      }
      if (at_ >= line_.size()) break;
      const char escaped = line_[at_++];
      if (escaped == '\\' || escaped == '"') {
        value += escaped;
      } else if (escaped == 'n') {
        value += '\n';
      } else {
        error = std::string("unknown escape \\") + escaped + " in a label value";
        return false;
      }
    }
    error = "a label value has no closing quote";
    return false;
  }

  // The next run of non-blank characters.
  std::string_view read_token() {
    const size_t begin = at_;
    while (at_ < line_.size() && !is_blank(line_[at_])) ++at_;
    return line_.substr(begin, at_ - begin);
  }

 private:
  std::string_view line_;
  size_t at_ = 0;
};

// Parses one sample line into `sample`; false with `error` set when it is malformed.
bool parse_sample_line(std::string_view line, PromSample& sample, std::string& error) {
  LineReader r(line);
  r.skip_blanks();
  auto name = r.read_name(/*colon=*/true);
  if (!name) {
    error = "expected a metric name";
    return false;
  }
  sample.name = std::string(*name);
  r.skip_blanks();
  if (r.take('{')) {
    for (;;) {
      r.skip_blanks();
      if (r.take('}')) break;
      auto label = r.read_name(/*colon=*/false);
      if (!label) {
        error = "expected a label name or '}' in the labels of " + sample.name;
        return false;
      }
      r.skip_blanks();
      if (!r.take('=')) {
        error = "expected '=' after label " + std::string(*label) + " of " + sample.name;
        return false;
      }
      r.skip_blanks();
      std::string value;
      if (!r.read_label_value(value, error)) {
        error += " (label " + std::string(*label) + " of " + sample.name + ")";
        return false;
      }
      sample.labels.emplace_back(std::string(*label), std::move(value));
      r.skip_blanks();
      if (r.take('}')) break;
      if (!r.take(',')) {
        error = "expected ',' or '}' after label " + std::string(*label) + " of " + sample.name;
        return false;
      }
    }
  }
  r.skip_blanks();
  const std::string_view value_text = r.read_token();
  if (value_text.empty()) {
    error = "no value for " + sample.name;
    return false;
  }
  auto value = parse_prom_value(value_text);
  if (!value) {
    error = "value '" + std::string(value_text) + "' of " + sample.name + " is not a number";
    return false;
  }
  sample.value = *value;
  r.skip_blanks();
  if (r.done()) return true;
  const std::string_view timestamp = r.read_token();
  int64_t ms = 0;
  auto [end, ec] = std::from_chars(timestamp.data(), timestamp.data() + timestamp.size(), ms);
  if (ec != std::errc() || end != timestamp.data() + timestamp.size()) {
    error =
        "timestamp '" + std::string(timestamp) + "' of " + sample.name + " is not a whole number";
    return false;
  }
  r.skip_blanks();
  if (!r.done()) {
    error = "unexpected text after the timestamp of " + sample.name;
    return false;
  }
  return true;
}

}  // namespace

std::string_view PromSample::label(std::string_view key) const {
  for (const auto& [label_name, label_value] : labels) {
    if (label_name == key) return label_value;
  }
  return {};
}

std::optional<double> parse_prom_value(std::string_view text) {
  bool negative = false;
  if (!text.empty() && (text[0] == '+' || text[0] == '-')) {
    negative = text[0] == '-';
    text.remove_prefix(1);
  }
  if (text.empty()) return std::nullopt;
  double value = 0;
  if (equals_ignoring_case(text, "inf")) {
    value = std::numeric_limits<double>::infinity();
  } else if (equals_ignoring_case(text, "nan")) {
    value = std::numeric_limits<double>::quiet_NaN();
  } else {
    // from_chars would also read a second sign, "infinity" and "nan(...)": a number starts
    // with a digit or a point.
    if (!((text[0] >= '0' && text[0] <= '9') || text[0] == '.')) return std::nullopt;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  }
  return negative ? -value : value;
}

Result<std::vector<PromSample>> parse_prom_text(std::string_view text) {
  std::vector<PromSample> samples;
  size_t begin = 0;
  for (size_t number = 1; begin < text.size(); ++number) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(begin, end - begin);
    begin = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    size_t first = 0;
    while (first < line.size() && is_blank(line[first])) ++first;
    if (first == line.size() || line[first] == '#') continue;
    PromSample sample;
    std::string error;
    if (!parse_sample_line(line, sample, error)) {
      return Error(ErrorCode::kInvalidArgument,
                   "metrics line " + std::to_string(number) + ": " + error);
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

}  // namespace gpuq::ctl
