// The part of gpuqctl that its commands share (cli.hpp).
#include "cli.hpp"

#include <charconv>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace gpuq::ctl {

const char* const kUsage = R"(usage: gpuqctl [--runtime-dir DIR] COMMAND [ARGS]

Commands:
  status [--json]         show the daemon's pools and workers, and the job each busy worker
                          runs (--json: the status document)
  ready [--wait S]        readiness probe: exit 0 if the daemon accepts jobs and every available
                          pool has a live, ready worker (an unavailable gpu pool, one with no
                          GPU, does not count); else print why and exit 1. --wait S: keep
                          trying for up to S seconds (0 to 86400; no daemon yet, a daemon
                          still starting, pools not ready yet), then exit 1 with the last
                          reason
  submit OP [OPTIONS]     run one job (or --count N jobs) and report the result; OP is a
                          built-in op (echo, checksum...) or a tensor op (conv2d, activation,
                          softmax, pool2d, batchnorm, gemm: see "Tensor ops" below)
  metrics                 print the daemon's metrics in the Prometheus text format
                          (docs/metrics.md); the same as its HTTP listener's /metrics
  top [OPTIONS]           a live view of the metrics, per pool: jobs/s, p50/p99 queue wait and
                          run time, queue depth, workers by state, mean batch size of
                          batched Python ops; GPU memory (see below)
  restart POOL [--timeout S]
                          rolling restart of the pool: its workers are replaced one by one by
                          new processes (a Python pool's modules imported anew), each made
                          ready before the one it replaces stops taking jobs; no job is lost.
                          Waits for the end (--timeout S: at most S seconds, 0 to 86400; 0,
                          the default: no limit): exit 0, or 1 with why it stopped (a new
                          worker that did not start: its error; the old workers serve on)
  reload [--timeout S]    the daemon reads its config file again and applies what changed, as
                          SIGHUP does: live keys at once, pools rolled for new Python settings,
                          removed pools drained. Prints one line per change; exit 1 with why
                          when nothing changed (a key that cannot change live, a bad file) or
                          a rolling restart it started failed
  stop                    ask the daemon to drain (finish its jobs, accept no new ones) and exit

submit options:
  --input FILE            the job's input bytes (default: no input); repeatable: the files
                          are concatenated in order into the one input buffer
  --output FILE           write the job's output bytes to FILE
  --output-size BYTES     size of the output buffer (default: a tensor op's result size; for
                          other ops the larger of the input size and 64)
  --param KEY=VALUE       a job parameter: integer, float or string by its syntax; repeatable
  --pool NAME             the pool to run in (default: the daemon's first pool)
  --count N               run N jobs, then print jobs/s and submit-to-complete latency
  --concurrency C         with --count: jobs kept in flight (default 1)
  --timeout-ms MS         limit for each job from submission to completion (default: none);
                          a job still queued or running then is cancelled, and gpuqctl says so
  --time-limit-ms MS      the longest each job may run once a worker starts it (0: no limit of
                          its own; the pool's job_time_limit_ms still applies). Past it the daemon
                          stops the job, which fails with TimedOut
  --priority LEVEL        high, normal (default) or low: higher levels are taken first; a
                          lower level that waits still gets a tenth of the pool's starts
  --stream N              a streaming job: print each part as it comes ("part I: N bytes"
                          and its first 32 bytes in hex; with --output, the parts are written
                          to FILE one after another). N (1-8) parts may wait unread; the
                          output buffer (default N x 4096 bytes) is cut into N equal cells

top options (on a terminal the view is redrawn in place until q, Ctrl-C or the daemon goes
away; otherwise each report is printed as plain text):
  --interval S            seconds between samples, 0.1 to 3600 (default 1); rates and
                          quantiles are over the jobs that ended in the last interval
  --count N               print N reports, then exit
  --once                  plain text: take two samples one interval apart, print one report

Tensor ops (docs/ops.md): give each operand as one --input file of raw little-endian
elements (f32, or f16 with --param dtype=f16), in the op's operand order, and its shape as a
--param; the files are packed back to back, as the ops expect by default. The output size
is computed from the shapes, and the shapes are checked against the files before submitting.
  gpuqctl submit conv2d --input x.bin --input w.bin --input b.bin \
      --param x=1x3x8x8 --param w=4x3x3x3 --param b=4 --param pad=1x1 --output y.bin
  gpuqctl submit gemm --input a.bin --input b.bin --param a=64x32 --param b=32x16 \
      --param alpha=0.5 --output y.bin
Operand order: conv2d x, w[, b]; activation, softmax, pool2d x; batchnorm x, scale, bias,
mean, var; gemm a, b[, c]. Shape and pair keys (x, w, b, a, c, stride, pad, dilation,
window) are sent as text even when they look like a number ("b=4").

Global options:
  --runtime-dir DIR       the daemon's runtime directory (default: $GPUQ_RUNTIME_DIR, else
                          $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/gpuq, else /tmp/gpuq-$UID,
                          if a daemon's socket is there; else /run/gpuq, the system service's)
  -h, --help              show this help
  --version               show the version

Exit status: 0 success, 1 a daemon or job error, 2 bad usage.
)";

// ---- Output helpers -------------------------------------------------------------------------

std::string strf(const char* format, ...) {
  char buffer[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  return buffer;
}

int usage_error(const std::string& message) {
  std::cerr << "gpuqctl: " << message << "\nTry 'gpuqctl --help'.\n";
  return kExitUsage;
}

int daemon_error(const gpuq::Error& error) {
  std::cerr << "gpuqctl: " << error.to_string() << '\n';
  return kExitFailure;
}

std::string format_ns(uint64_t ns) {
  if (ns < 1000) return strf("%llu ns", static_cast<unsigned long long>(ns));
  if (ns < 1000000) return strf("%.1f us", static_cast<double>(ns) / 1e3);
  if (ns < 1000000000) return strf("%.2f ms", static_cast<double>(ns) / 1e6);
  return strf("%.3f s", static_cast<double>(ns) / 1e9);
}

std::string format_uptime(double seconds) {
  if (seconds < 60) return strf("%.1fs", seconds);
  auto s = static_cast<long long>(seconds);
  if (s < 3600) return strf("%lldm%02llds", s / 60, s % 60);
  if (s < 86400) return strf("%lldh%02lldm%02llds", s / 3600, s / 60 % 60, s % 60);
  return strf("%lldd%02lldh%02lldm", s / 86400, s / 3600 % 24, s / 60 % 60);
}

std::string text_field(const Json& object, const char* key, const char* fallback) {
  if (!object.is_object()) return fallback;
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_boolean()) return it->get<bool>() ? "yes" : "no";
  return it->dump();
}

// ---- Argument parsing -----------------------------------------------------------------------

bool ArgCursor::take_value(std::string_view name, std::string& value, std::string& error) {
  std::string_view arg = peek();
  if (arg == name) {
    ++at_;
    if (done()) {
      error = "option " + std::string(name) + " needs a value";
    } else {
      value = std::string(next());
    }
    return true;
  }
  if (arg.size() > name.size() && arg.substr(0, name.size()) == name && arg[name.size()] == '=') {
    ++at_;
    value = std::string(arg.substr(name.size() + 1));
    return true;
  }
  return false;
}

std::optional<uint64_t> parse_count(std::string_view name, const std::string& text, uint64_t min,
                                    uint64_t max, std::string& error) {
  uint64_t value = 0;
  const bool negative = text.size() > 1 && text[0] == '-';
  const char* first = text.data() + (negative ? 1 : 0);
  auto [end, ec] = std::from_chars(first, text.data() + text.size(), value);
  if (text.empty() || (ec != std::errc() && ec != std::errc::result_out_of_range) ||
      end != text.data() + text.size()) {
    error = std::string(name) + " '" + text + "' is not a whole number";
    return std::nullopt;
  }
  // A number out of range (negative, or past 2^64 - 1) says so, as one too large for `max`.
  if ((negative && value != 0) || ec == std::errc::result_out_of_range || value < min ||
      value > max) {
    error = std::string(name) + " is " + text + ", must be in [" + std::to_string(min) + ", " +
            std::to_string(max) + "]";
    return std::nullopt;
  }
  return value;
}

std::optional<double> parse_seconds(std::string_view name, const std::string& text, double min,
                                    double max, std::string& error) {
  double value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() ||
      !std::isfinite(value)) {
    error = std::string(name) + " '" + text + "' is not a number of seconds";
    return std::nullopt;
  }
  if (value < min || value > max) {
    error = std::string(name) + " is " + text + ", must be in [" + strf("%g", min) + ", " +
            strf("%g", max) + "] seconds";
    return std::nullopt;
  }
  return value;
}

bool take_wait_option(ArgCursor& cursor, std::string& runtime_dir, double& timeout_s,
                      std::string& error) {
  constexpr double kMaxTimeoutS = 86400;
  std::string value;
  if (cursor.take_value("--timeout", value, error)) {
    if (!error.empty()) return true;
    if (std::optional<double> t = parse_seconds("--timeout", value, 0, kMaxTimeoutS, error)) {
      timeout_s = *t;
    }
    return true;
  }
  return cursor.take_value("--runtime-dir", runtime_dir, error);
}

std::optional<int> parse_no_arguments(ArgCursor& cursor, std::string& runtime_dir,
                                      const std::string& command) {
  std::string error;
  while (!cursor.done()) {
    std::string_view arg = cursor.peek();
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return kExitOk;
    }
    if (!cursor.take_value("--runtime-dir", runtime_dir, error)) {
      return usage_error("unknown argument '" + std::string(arg) + "' for " + command);
    }
    if (!error.empty()) return usage_error(error);
  }
  return std::nullopt;
}

}  // namespace gpuq::ctl
