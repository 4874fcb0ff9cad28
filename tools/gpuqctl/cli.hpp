// The part of gpuqctl that its commands share: exit statuses, the usage text, the argument
// cursor and number parsing, error reports, and the formatting of times and status fields.
// Private to gpuqctl (tools/gpuqctl/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "gpuq/client.hpp"

namespace gpuq::ctl {

using Json = nlohmann::ordered_json;  // keeps the daemon's key order in --json

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// The text of `gpuqctl --help`, which every command's --help prints too.
extern const char* const kUsage;

// ---- Output helpers -------------------------------------------------------------------------

std::string strf(const char* format, ...) __attribute__((format(printf, 1, 2)));

// Prints "gpuqctl: <message>" and the hint to --help on stderr; returns kExitUsage.
int usage_error(const std::string& message);

// Prints "gpuqctl: <error>" on stderr; returns kExitFailure.
int daemon_error(const gpuq::Error& error);

// "850 ns", "12.3 us", "4.56 ms", "1.234 s".
std::string format_ns(uint64_t ns);

// "42.5s", "12m05s", "3h02m05s", "2d03h02m".
std::string format_uptime(double seconds);

// A field of a status object as text, or `fallback` when it is missing. Tolerates any type.
std::string text_field(const Json& object, const char* key, const char* fallback = "-");

// ---- Argument parsing -----------------------------------------------------------------------

// Walks the arguments. take_value() accepts "--name VALUE" and "--name=VALUE".
class ArgCursor {
 public:
  ArgCursor(int argc, char** argv) : args_(argv + 1, argv + argc) {}

  bool done() const { return at_ >= args_.size(); }
  std::string_view peek() const { return args_[at_]; }
  std::string_view next() { return args_[at_++]; }

  // If the current argument is option `name`, consumes it and its value into `value` and returns
  // true. A missing value sets `error`.
  bool take_value(std::string_view name, std::string& value, std::string& error);

 private:
  std::vector<std::string_view> args_;
  size_t at_ = 0;
};

// Parses a whole decimal number in [min, max] for option `name`.
std::optional<uint64_t> parse_count(std::string_view name, const std::string& text, uint64_t min,
                                    uint64_t max, std::string& error);

// Parses a number of seconds (decimals allowed: "0.5") in [min, max] for option `name`.
std::optional<double> parse_seconds(std::string_view name, const std::string& text, double min,
                                    double max, std::string& error);

// Parses the arguments of a command that takes none besides --runtime-dir (and --help). Returns
// the exit status to end with (after --help or a bad argument), or nullopt to run the command.
std::optional<int> parse_no_arguments(ArgCursor& cursor, std::string& runtime_dir,
                                      const std::string& command);

// The options of a command that waits for the daemon (restart, reload): --timeout S (0 to 86400
// seconds; 0, the default: no limit) and --runtime-dir DIR. True when the current argument was
// one of them (taken, or `error` set when malformed).
bool take_wait_option(ArgCursor& cursor, std::string& runtime_dir, double& timeout_s,
                      std::string& error);

}  // namespace gpuq::ctl
