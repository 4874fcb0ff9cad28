// gpuqctl: the command line of gpuq. Shows the daemon's status, submits jobs (one, or many for a
// quick throughput and latency measurement) and stops the daemon. See usage() below.
//
// Exit status: 0 success, 1 a daemon or job error, 2 bad usage.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuq/client.hpp"
#include "gpuq/common/assert.hpp"
#include "gpuq/common/cpu_list.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/tensor_ops.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;  // keeps the daemon's key order in --json

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

constexpr const char* kUsage = R"(usage: gpuqctl [--runtime-dir DIR] COMMAND [ARGS]

Commands:
  status [--json]         show the daemon's pools and workers (--json: the status document)
  ready                   readiness probe: exit 0 if the daemon accepts jobs and every available
                          pool has a live, ready worker (an unavailable gpu pool, one with no
                          GPU, does not count); else print why and exit 1
  submit OP [OPTIONS]     run one job (or --count N jobs) and report the result; OP is a
                          built-in op (echo, checksum...) or a tensor op (conv2d, activation,
                          softmax, pool2d, batchnorm, gemm: see "Tensor ops" below)
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
  --timeout-ms MS         limit for each job from submission to completion (default: none)

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

std::string strf(const char* format, ...) __attribute__((format(printf, 1, 2)));
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

// "850 ns", "12.3 us", "4.56 ms", "1.234 s".
std::string format_ns(uint64_t ns) {
  if (ns < 1000) return strf("%llu ns", static_cast<unsigned long long>(ns));
  if (ns < 1000000) return strf("%.1f us", static_cast<double>(ns) / 1e3);
  if (ns < 1000000000) return strf("%.2f ms", static_cast<double>(ns) / 1e6);
  return strf("%.3f s", static_cast<double>(ns) / 1e9);
}

// "42.5s", "12m05s", "3h02m05s", "2d03h02m".
std::string format_uptime(double seconds) {
  if (seconds < 60) return strf("%.1fs", seconds);
  auto s = static_cast<long long>(seconds);
  if (s < 3600) return strf("%lldm%02llds", s / 60, s % 60);
  if (s < 86400) return strf("%lldh%02lldm%02llds", s / 3600, s / 60 % 60, s % 60);
  return strf("%lldd%02lldh%02lldm", s / 86400, s / 3600 % 24, s / 60 % 60);
}

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
  bool take_value(std::string_view name, std::string& value, std::string& error) {
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

 private:
  std::vector<std::string_view> args_;
  size_t at_ = 0;
};

// Parses a whole decimal number in [min, max] for option `name`.
std::optional<uint64_t> parse_count(std::string_view name, const std::string& text, uint64_t min,
                                    uint64_t max, std::string& error) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
    error = std::string(name) + " '" + text + "' is not a whole number";
    return std::nullopt;
  }
  if (value < min || value > max) {
    error = std::string(name) + " is " + text + ", must be in [" + std::to_string(min) + ", " +
            std::to_string(max) + "]";
    return std::nullopt;
  }
  return value;
}

struct SubmitArgs {
  std::string op;
  std::vector<std::string> input_paths;
  std::string output_path;
  std::optional<uint64_t> output_size;
  std::vector<gpuq::JobParam> params;
  std::string pool;
  std::optional<uint64_t> count;
  uint64_t concurrency = 1;
  std::optional<uint64_t> timeout_ms;
};

// ---- status ---------------------------------------------------------------------------------

// A field of a status object as text, or `fallback` when it is missing. Tolerates any type.
std::string text_field(const Json& object, const char* key, const char* fallback = "-") {
  if (!object.is_object()) return fallback;
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_boolean()) return it->get<bool>() ? "yes" : "no";
  return it->dump();
}

std::optional<double> number_field(const Json& object, const char* key) {
  if (!object.is_object()) return std::nullopt;
  auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

// [0,1,2,3,6] -> "0-3,6".
std::string format_cpus(const Json& worker) {
  if (!worker.is_object()) return "-";
  auto it = worker.find("cpus");
  if (it == worker.end() || !it->is_array() || it->empty()) return "-";
  std::vector<long long> cpus;
  for (const Json& c : *it) {
    if (c.is_number_integer()) cpus.push_back(c.get<long long>());
  }
  std::sort(cpus.begin(), cpus.end());
  const std::string out = gpuq::cpu_list_text(cpus);
  return out.empty() ? "-" : out;
}

void print_status_table(const Json& doc) {
  std::string header = "gpuqd " + text_field(doc, "version") + ", pid " + text_field(doc, "pid");
  if (auto up = number_field(doc, "uptime_s")) header += ", up " + format_uptime(*up);
  header += ", " + text_field(doc, "state", "state unknown");
  header += ", clients " + text_field(doc, "clients");
  std::cout << header << '\n';

  auto pools = doc.is_object() ? doc.find("pools") : doc.end();
  if (pools == doc.end() || !pools->is_array() || pools->empty()) {
    std::cout << "no pools\n";
    return;
  }
  for (const Json& pool : *pools) {
    std::string line = "pool " + text_field(pool, "name", "?") + " (" + text_field(pool, "kind") +
                       "): " + text_field(pool, "status", "status unknown");
    std::string reason = text_field(pool, "reason", "");
    if (!reason.empty()) line += " (" + reason + ")";
    line += ", queue " + text_field(pool, "queue_depth") + "/" + text_field(pool, "capacity");
    line += ", workers " + text_field(pool, "workers_ready") + "/" +
            text_field(pool, "workers_total") + " ready";
    if (pool.is_object() && pool.contains("accepting") && pool["accepting"] == false) {
      line += ", not accepting jobs";
    }
    std::cout << '\n' << line << '\n';

    auto workers = pool.is_object() ? pool.find("workers") : pool.end();
    if (workers == pool.end() || !workers->is_array() || workers->empty()) {
      std::cout << "  no workers\n";
      continue;
    }
    std::cout << strf("  %6s %8s %-12s %-10s %-4s %10s %8s %8s\n", "WORKER", "PID", "CPUS", "STATE",
                      "BUSY", "DONE", "FAILED", "RESTARTS");
    for (const Json& w : *workers) {
      std::cout << strf("  %6s %8s %-12s %-10s %-4s %10s %8s %8s\n", text_field(w, "id").c_str(),
                        text_field(w, "pid").c_str(), format_cpus(w).c_str(),
                        text_field(w, "state").c_str(), text_field(w, "busy").c_str(),
                        text_field(w, "jobs_done").c_str(), text_field(w, "jobs_failed").c_str(),
                        text_field(w, "restarts").c_str());
    }
  }
}

int run_status(const std::string& runtime_dir, bool as_json) {
  gpuq::Result<std::string> text = gpuq::daemon_status_json(runtime_dir);
  if (!text) return daemon_error(text.error());
  Json doc = Json::parse(text.value(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return daemon_error(gpuq::Error(gpuq::ErrorCode::kProtocolMismatch,
                                    "the daemon's status document is not valid JSON"));
  }
  if (as_json) {
    std::cout << doc.dump(2) << '\n';
  } else {
    print_status_table(doc);
  }
  return kExitOk;
}

// ---- ready ----------------------------------------------------------------------------------

int run_ready(const std::string& runtime_dir) {
  gpuq::Result<std::string> text = gpuq::daemon_status_json(runtime_dir);
  if (!text) return daemon_error(text.error());
  Json doc = Json::parse(text.value(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("ready") ||
      !doc["ready"].is_boolean()) {
    return daemon_error(gpuq::Error(gpuq::ErrorCode::kProtocolMismatch,
                                    "the daemon's status document has no readiness field"));
  }
  if (doc["ready"].get<bool>()) {
    std::cout << "ready\n";
    return kExitOk;
  }
  std::string why;
  if (text_field(doc, "state", "") == "draining") why = "the daemon is draining";
  if (doc.contains("pools") && doc["pools"].is_array()) {
    for (const Json& pool : doc["pools"]) {
      if (!pool.is_object()) continue;
      auto ready_workers = pool.find("workers_ready");
      if (ready_workers != pool.end() && ready_workers->is_number_unsigned() &&
          ready_workers->get<uint64_t>() > 0) {
        continue;
      }
      if (!why.empty()) why += "; ";
      why += "pool '" + text_field(pool, "name", "?") + "' has no ready worker (" +
             text_field(pool, "reason", "no reason given") + ")";
    }
  }
  std::cout << "not ready: " << (why.empty() ? "see gpuqctl status" : why) << '\n';
  return kExitFailure;
}

// ---- stop -----------------------------------------------------------------------------------

int run_stop(const std::string& runtime_dir) {
  gpuq::Result<void> r = gpuq::daemon_stop(runtime_dir);
  if (!r) return daemon_error(r.error());
  std::cout << "stopping: daemon is draining\n";
  return kExitOk;
}

// ---- submit ---------------------------------------------------------------------------------

std::optional<std::string> read_file(const std::string& path, std::string& error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    error = "cannot open '" + path + "': " + std::strerror(errno);
    return std::nullopt;
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    error = "cannot read '" + path + "': " + std::strerror(errno);
    return std::nullopt;
  }
  return bytes;
}

bool write_file(const std::string& path, const std::byte* data, uint64_t size, std::string& error) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (out) out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (out) out.close();
  if (!out) {
    error = "cannot write '" + path + "': " + std::strerror(errno);
    return false;
  }
  return true;
}

const char* status_word(gpuq::JobStatus status) {
  switch (status) {
    case gpuq::JobStatus::kQueued:
      return "queued";
    case gpuq::JobStatus::kRunning:
      return "running";
    case gpuq::JobStatus::kDone:
      return "done";
    case gpuq::JobStatus::kFailed:
      return "failed";
    case gpuq::JobStatus::kCancelled:
      return "cancelled";
    case gpuq::JobStatus::kExpired:
      return "expired";
  }
  return "unknown";
}

// Time left until `deadline` as a timeout for the client API (negative: no deadline).
std::chrono::nanoseconds time_left(std::optional<Clock::time_point> deadline) {
  if (!deadline) return std::chrono::nanoseconds(-1);
  return std::max(std::chrono::nanoseconds(0), *deadline - Clock::now());
}

// The connection and buffers a submit run uses: `pairs` input/output buffer pairs, each input
// holding a copy of the input file.
struct Session {
  gpuq::Client client;
  std::vector<gpuq::Buffer> inputs;
  std::vector<gpuq::Buffer> outputs;
};

gpuq::Result<Session> open_session(const std::string& runtime_dir, const std::string& input,
                                   uint64_t output_size, uint64_t pairs) {
  gpuq::ConnectOptions options;
  options.runtime_dir = runtime_dir;
  options.name = "gpuqctl";
  gpuq::Result<gpuq::Client> client = gpuq::Client::connect(options);
  if (!client) return std::move(client).error();
  Session session{std::move(client).value(), {}, {}};
  for (uint64_t i = 0; i < pairs; ++i) {
    gpuq::Buffer in;
    if (!input.empty()) {
      gpuq::Result<gpuq::Buffer> b = session.client.allocate(input.size());
      if (!b) return std::move(b).error();
      in = b.value();
      std::memcpy(in.data(), input.data(), input.size());
    }
    gpuq::Buffer out;
    if (output_size > 0) {
      gpuq::Result<gpuq::Buffer> b = session.client.allocate(output_size);
      if (!b) return std::move(b).error();
      out = b.value();
    }
    session.inputs.push_back(in);
    session.outputs.push_back(out);
  }
  return session;
}

gpuq::JobSpec make_spec(const SubmitArgs& args) {
  gpuq::JobSpec spec;
  spec.op = args.op;
  spec.pool = args.pool;
  spec.params = args.params;
  return spec;
}

int run_one(const SubmitArgs& args, Session& session) {
  gpuq::JobSpec spec = make_spec(args);
  spec.input = session.inputs[0];
  spec.output = session.outputs[0];
  std::optional<Clock::time_point> deadline;
  if (args.timeout_ms) deadline = Clock::now() + std::chrono::milliseconds(*args.timeout_ms);

  gpuq::Result<gpuq::Job> job = session.client.submit(spec, time_left(deadline));
  if (!job) return daemon_error(job.error());
  gpuq::Result<gpuq::JobResult> result = job->wait(time_left(deadline));
  if (!result) {
    if (result.error().code() == gpuq::ErrorCode::kTimeout) {
      return daemon_error(
          gpuq::Error(gpuq::ErrorCode::kTimeout,
                      "the job did not finish within " + std::to_string(*args.timeout_ms) + " ms"));
    }
    return daemon_error(result.error());
  }
  const gpuq::JobResult& r = result.value();
  const std::string timing = format_ns(r.queued_ns) + " queued, " + format_ns(r.run_ns) + " run";
  if (!r.ok()) {
    std::cout << status_word(r.status) << ": " << gpuq::error_code_name(r.code);
    if (!r.message.empty()) std::cout << ": " << r.message;
    std::cout << " (worker " << r.worker_id << ", " << timing << ")\n";
    return kExitFailure;
  }
  std::cout << strf("done: output %llu bytes, value 0x%llx, ",
                    static_cast<unsigned long long>(r.output_size),
                    static_cast<unsigned long long>(r.value))
            << timing << '\n';
  if (!args.output_path.empty()) {
    std::string error;
    const uint64_t n = std::min(r.output_size, spec.output.size);
    if (!write_file(args.output_path, spec.output.data(), n, error)) {
      std::cerr << "gpuqctl: " << error << '\n';
      return kExitFailure;
    }
  }
  return kExitOk;
}

// Runs args.count jobs keeping args.concurrency in flight and reports throughput and latency.
class LoadRun {
 public:
  LoadRun(const SubmitArgs& args, Session& session)
      : args_(args),
        session_(session),
        total_(*args.count),
        slots_(session.inputs.size()),
        progress_(isatty(STDOUT_FILENO) == 1) {
    for (size_t i = slots_.size(); i-- > 0;) free_.push_back(i);
  }

  int run() {
    const gpuq::JobSpec base = make_spec(args_);
    start_ = Clock::now();
    last_progress_ = start_;
    while (true) {
      fill(base);
      if (in_order_.empty()) break;
      wait_oldest();
      harvest_finished();
      show_progress(false);
    }
    const auto elapsed = Clock::now() - start_;
    show_progress(true);
    report(elapsed);
    if (failures_ > 0) {
      std::cerr << "gpuqctl: " << failures_ << " of " << total_
                << " jobs failed; first: " << first_failure_.to_string() << '\n';
      return kExitFailure;
    }
    return kExitOk;
  }

 private:
  struct Slot {
    gpuq::Job job;
    Clock::time_point submitted;
  };

  std::optional<Clock::time_point> deadline_of(const Slot& slot) const {
    if (!args_.timeout_ms) return std::nullopt;
    return slot.submitted + std::chrono::milliseconds(*args_.timeout_ms);
  }

  void fail(gpuq::Error error) {
    if (failures_++ == 0) first_failure_ = std::move(error);
  }

  // Submits until `concurrency` jobs are in flight or all are submitted. A submit error stops
  // further submissions: it would repeat for every job (unknown op, daemon gone...).
  void fill(const gpuq::JobSpec& base) {
    while (submitted_ < total_ && !stop_submitting_ && !free_.empty()) {
      const size_t i = free_.back();
      gpuq::JobSpec spec = base;
      spec.input = session_.inputs[i];
      spec.output = session_.outputs[i];
      Slot& slot = slots_[i];
      slot.submitted = Clock::now();
      gpuq::Result<gpuq::Job> job = session_.client.submit(spec, time_left(deadline_of(slot)));
      if (!job) {
        fail(std::move(job).error());
        stop_submitting_ = true;
        not_submitted_ = total_ - submitted_ - 1;
        return;
      }
      slot.job = std::move(job).value();
      free_.pop_back();
      in_order_.push_back(i);
      ++submitted_;
    }
  }

  // Waits for the oldest job in flight, in slices of at most 200 ms while a progress line shows.
  void wait_oldest() {
    const size_t i = in_order_.front();
    Slot& slot = slots_[i];
    std::chrono::nanoseconds timeout = time_left(deadline_of(slot));
    if (progress_ && (timeout.count() < 0 || timeout > kProgressPeriod)) timeout = kProgressPeriod;
    gpuq::Result<gpuq::JobResult> result = slot.job.wait(timeout);
    const Clock::time_point now = Clock::now();
    if (result) {
      finish(i, result.value(), now);
    } else if (result.error().code() != gpuq::ErrorCode::kTimeout) {
      fail(std::move(result).error());
      release(i);
    } else if (auto deadline = deadline_of(slot); deadline && now >= *deadline) {
      fail(gpuq::Error(gpuq::ErrorCode::kTimeout,
                       "a job did not finish within " + std::to_string(*args_.timeout_ms) + " ms"));
      release(i);
    }
  }

  // Completes the other jobs that have finished meanwhile, so that a job which finished before
  // an older one is timed when it finished, not when the older one did.
  void harvest_finished() {
    for (size_t k = 0; k < in_order_.size();) {
      const size_t i = in_order_[k];
      gpuq::Result<gpuq::JobStatus> status = slots_[i].job.poll();
      if (status && (status.value() == gpuq::JobStatus::kQueued ||
                     status.value() == gpuq::JobStatus::kRunning)) {
        ++k;
        continue;
      }
      const Clock::time_point now = Clock::now();
      gpuq::Result<gpuq::JobResult> result = slots_[i].job.wait(std::chrono::nanoseconds(0));
      if (result) {
        finish(i, result.value(), now);
      } else if (result.error().code() == gpuq::ErrorCode::kTimeout) {
        ++k;  // finished an instant ago in poll's view but not yet readable; wait for it later
      } else {
        fail(std::move(result).error());
        release(i);
      }
    }
  }

  void finish(size_t i, const gpuq::JobResult& result, Clock::time_point now) {
    if (result.ok()) {
      latencies_ns_.push_back(static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(now - slots_[i].submitted).count()));
    } else {
      fail(gpuq::Error(result.code, result.message.empty() ? std::string(status_word(result.status))
                                                           : result.message));
    }
    release(i);
  }

  // Returns slot i to the free list; the Job's destructor returns its job slot.
  void release(size_t i) {
    slots_[i].job = gpuq::Job();
    in_order_.erase(std::find(in_order_.begin(), in_order_.end(), i));
    free_.push_back(i);
    ++completed_;
  }

  void show_progress(bool final_line) {
    if (!progress_) return;
    const Clock::time_point now = Clock::now();
    if (final_line) {
      std::printf("\r%*s\r", 72, "");
      std::fflush(stdout);
      return;
    }
    if (now - last_progress_ < kProgressPeriod) return;
    last_progress_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    std::printf("\r%llu/%llu jobs done, %llu failed, %.0f jobs/s   ",
                static_cast<unsigned long long>(completed_),
                static_cast<unsigned long long>(total_), static_cast<unsigned long long>(failures_),
                seconds > 0 ? static_cast<double>(completed_) / seconds : 0.0);
    std::fflush(stdout);
  }

  uint64_t percentile(double p) const {
    // Nearest rank: the smallest value with at least p of the samples at or below it.
    const size_t n = latencies_ns_.size();
    size_t rank = static_cast<size_t>(p * static_cast<double>(n) + 0.999999);
    rank = std::clamp<size_t>(rank, 1, n);
    return latencies_ns_[rank - 1];
  }

  void report(Clock::duration elapsed) {
    const double seconds = std::chrono::duration<double>(elapsed).count();
    std::cout << strf("%llu jobs in %.3f s: %.0f jobs/s, concurrency %zu\n",
                      static_cast<unsigned long long>(completed_), seconds,
                      seconds > 0 ? static_cast<double>(completed_) / seconds : 0.0, slots_.size());
    if (!latencies_ns_.empty()) {
      std::sort(latencies_ns_.begin(), latencies_ns_.end());
      std::cout << "latency (submit to complete, " << latencies_ns_.size() << " jobs): p50 "
                << format_ns(percentile(0.50)) << ", p90 " << format_ns(percentile(0.90))
                << ", p99 " << format_ns(percentile(0.99)) << ", max "
                << format_ns(latencies_ns_.back()) << '\n';
    }
    if (not_submitted_ > 0) {
      std::cout << not_submitted_ << " jobs not submitted after the first submit error\n";
    }
  }

  static constexpr std::chrono::milliseconds kProgressPeriod{200};

  const SubmitArgs& args_;
  Session& session_;
  const uint64_t total_;
  std::vector<Slot> slots_;
  std::vector<size_t> free_;     // slot indices with no job in flight
  std::deque<size_t> in_order_;  // slot indices in flight, oldest submission first
  const bool progress_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  uint64_t not_submitted_ = 0;
  bool stop_submitting_ = false;
  uint64_t failures_ = 0;
  gpuq::Error first_failure_;
  std::vector<uint64_t> latencies_ns_;
  Clock::time_point start_;
  Clock::time_point last_progress_;
};

// ---- submit: tensor ops ---------------------------------------------------------------------

// The operands of a parsed tensor op, in their documented order, with their names.
std::vector<std::pair<const char*, gpuq::tensor::Operand>> operands_of(
    const gpuq::tensor::TensorOp& op) {
  using namespace gpuq::tensor;
  std::vector<std::pair<const char*, Operand>> out;
  if (const auto* c = std::get_if<Conv2d>(&op)) {
    out = {{"x", c->x}, {"w", c->w}};
    if (c->b) out.emplace_back("b", *c->b);
  } else if (const auto* a = std::get_if<ActivationOp>(&op)) {
    out = {{"x", a->x}};
  } else if (const auto* s = std::get_if<Softmax>(&op)) {
    out = {{"x", s->x}};
  } else if (const auto* p = std::get_if<Pool2d>(&op)) {
    out = {{"x", p->x}};
  } else if (const auto* b = std::get_if<BatchNorm>(&op)) {
    out = {{"x", b->x}, {"scale", b->scale}, {"bias", b->bias}, {"mean", b->mean}, {"var", b->var}};
  } else if (const auto* g = std::get_if<Gemm>(&op)) {
    out = {{"a", g->a}, {"b", g->b}};
    if (g->c) out.emplace_back("c", *g->c);
  }
  return out;
}

// Parses a tensor op's parameters as its worker will, against an input buffer of the --input
// files and the output buffer (--output-size, or room for any result), and checks each file
// against the operand it holds. Returns the result's size in bytes, or nullopt with `error`.
std::optional<uint64_t> check_tensor_job(const SubmitArgs& args,
                                         const std::vector<uint64_t>& input_sizes,
                                         std::string& error) {
  const gpuq::tensor::OpKind kind = *gpuq::tensor::op_kind_from_name(args.op);
  gpuq::ParamWriter writer;
  bool placed = false;  // an operand placed with "<operand>_at"
  for (const gpuq::JobParam& p : args.params) {
    gpuq::ParamValue v;
    if (p.type == gpuq::JobParam::Type::kInt) v = p.int_value;
    if (p.type == gpuq::JobParam::Type::kFloat) v = p.float_value;
    if (p.type == gpuq::JobParam::Type::kString) v = p.string_value;
    if (auto r = writer.add(p.key, v); !r) {
      error = r.error().message();
      return std::nullopt;
    }
    placed = placed || (p.key.size() > 3 && p.key.compare(p.key.size() - 3, 3, "_at") == 0);
  }
  gpuq::Result<gpuq::ParamBlock> block = gpuq::ParamBlock::parse(writer.data(), writer.size());
  if (!block) {
    error = block.error().message();
    return std::nullopt;
  }
  uint64_t input_bytes = 0;
  for (uint64_t n : input_sizes) input_bytes += n;
  const uint64_t capacity = args.output_size.value_or(gpuq::tensor::kMaxElements);
  // First with room for any operands, to name a file that does not match its operand; then
  // with the files' real size. The output as the client library allocates it: after the
  // input, 64-byte aligned.
  for (const uint64_t input_room : {gpuq::tensor::kMaxElements, input_bytes}) {
    const uint64_t output_offset = (input_room + 63) & ~uint64_t{63};
    gpuq::Result<gpuq::tensor::TensorOp> op = gpuq::tensor::parse_tensor_op(
        kind, block.value(), {0, input_room, output_offset, capacity});
    if (!op) {
      error = op.error().message();
      return std::nullopt;
    }
    if (input_room == input_bytes) return gpuq::tensor::result_bytes(op.value());
    if (placed) continue;
    const auto operands = operands_of(op.value());
    const char* dtype = gpuq::tensor::dtype_name(gpuq::tensor::result_dtype(op.value()));
    if (input_sizes.size() == operands.size()) {
      // One file per operand, in order: each must hold exactly its operand.
      for (size_t i = 0; i < operands.size(); ++i) {
        const auto& [name, operand] = operands[i];
        if (input_sizes[i] != operand.bytes) {
          error = args.op + ": --input '" + args.input_paths[i] + "' holds " +
                  std::to_string(input_sizes[i]) + " bytes, operand " + name + " (" +
                  operand.shape.to_string() + " " + dtype + ") needs " +
                  std::to_string(operand.bytes);
          return std::nullopt;
        }
      }
    } else {
      uint64_t needed = 0;
      std::string names;
      for (const auto& [name, operand] : operands) {
        needed += operand.bytes;
        names += std::string(names.empty() ? "" : ", ") + name + " " + operand.shape.to_string();
      }
      if (needed != input_bytes) {
        error = args.op + ": the " + std::to_string(input_sizes.size()) + " --input files hold " +
                std::to_string(input_bytes) + " bytes, the " + std::to_string(operands.size()) +
                " operands (" + names + ", " + dtype + ") need " + std::to_string(needed);
        return std::nullopt;
      }
    }
  }
  GPUQ_ASSERT(false);  // the loop returns on its second pass
  return std::nullopt;
}

// Shape and pair keys of the tensor ops take text; "--param b=4" parses as an integer, so
// such a value is sent as the text it was written as.
bool is_shape_key(std::string_view key) {
  static constexpr std::string_view kKeys[] = {"x",      "w",   "b",        "a",     "c",
                                               "stride", "pad", "dilation", "window"};
  return std::find(std::begin(kKeys), std::end(kKeys), key) != std::end(kKeys);
}

int run_submit(const std::string& runtime_dir, const SubmitArgs& args) {
  std::string input;
  std::vector<uint64_t> input_sizes;
  for (const std::string& path : args.input_paths) {
    std::string error;
    std::optional<std::string> bytes = read_file(path, error);
    if (!bytes) {
      std::cerr << "gpuqctl: " << error << '\n';
      return kExitFailure;
    }
    input_sizes.push_back(bytes->size());
    input += *bytes;
  }
  uint64_t output_size = args.output_size.value_or(std::max<uint64_t>(input.size(), uint64_t{64}));
  if (gpuq::tensor::op_kind_from_name(args.op)) {
    std::string error;
    std::optional<uint64_t> result = check_tensor_job(args, input_sizes, error);
    if (!result) return usage_error(error);
    if (!args.output_size) output_size = *result;
  }
  const uint64_t pairs = args.count ? std::min(args.concurrency, *args.count) : 1;

  gpuq::Result<Session> session = open_session(runtime_dir, input, output_size, pairs);
  if (!session) return daemon_error(session.error());
  if (!args.count) return run_one(args, session.value());
  return LoadRun(args, session.value()).run();
}

// Parses the arguments of `submit` after the op name (and accepts --runtime-dir among them).
int parse_submit(ArgCursor& cursor, std::string& runtime_dir, SubmitArgs& args) {
  std::string value;
  std::string error;
  while (!cursor.done()) {
    std::string_view arg = cursor.peek();
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return -1;
    }
    if (cursor.take_value("--input", value, error)) {
      if (!error.empty()) return usage_error(error);
      args.input_paths.push_back(value);
    } else if (cursor.take_value("--output", args.output_path, error) ||
               cursor.take_value("--pool", args.pool, error) ||
               cursor.take_value("--runtime-dir", runtime_dir, error)) {
      if (!error.empty()) return usage_error(error);
    } else if (cursor.take_value("--output-size", value, error)) {
      if (!error.empty()) return usage_error(error);
      args.output_size = parse_count("--output-size", value, 0, UINT64_C(1) << 40, error);
      if (!args.output_size) return usage_error(error);
    } else if (cursor.take_value("--count", value, error)) {
      if (!error.empty()) return usage_error(error);
      args.count = parse_count("--count", value, 1, UINT64_C(1) << 40, error);
      if (!args.count) return usage_error(error);
    } else if (cursor.take_value("--concurrency", value, error)) {
      if (!error.empty()) return usage_error(error);
      std::optional<uint64_t> c = parse_count("--concurrency", value, 1, 65536, error);
      if (!c) return usage_error(error);
      args.concurrency = *c;
    } else if (cursor.take_value("--timeout-ms", value, error)) {
      if (!error.empty()) return usage_error(error);
      args.timeout_ms = parse_count("--timeout-ms", value, 1, UINT64_C(1) << 40, error);
      if (!args.timeout_ms) return usage_error(error);
    } else if (cursor.take_value("--param", value, error)) {
      if (!error.empty()) return usage_error(error);
      gpuq::Result<gpuq::Param> p = gpuq::parse_param_assignment(value);
      if (!p) return usage_error(p.error().message());
      const gpuq::ParamValue& v = p.value().value;
      if (std::holds_alternative<int64_t>(v) && gpuq::tensor::op_kind_from_name(args.op) &&
          is_shape_key(p.value().key)) {
        args.params.push_back(
            gpuq::JobParam::text(p.value().key, value.substr(value.find('=') + 1)));
      } else if (const auto* i = std::get_if<int64_t>(&v)) {
        args.params.push_back(gpuq::JobParam::integer(p.value().key, *i));
      } else if (const auto* d = std::get_if<double>(&v)) {
        args.params.push_back(gpuq::JobParam::real(p.value().key, *d));
      } else {
        args.params.push_back(gpuq::JobParam::text(p.value().key, std::get<std::string>(v)));
      }
    } else {
      return usage_error("unknown argument '" + std::string(arg) + "' for submit");
    }
  }
  if (args.count && !args.output_path.empty()) {
    return usage_error("--output cannot be used with --count");
  }
  if (!args.count && args.concurrency != 1) {
    return usage_error("--concurrency needs --count");
  }
  return kExitOk;
}

// Parses and runs one command line.
int run(int argc, char** argv) {
  ArgCursor cursor(argc, argv);
  std::string runtime_dir;
  std::string error;
  while (!cursor.done() && cursor.peek().substr(0, 1) == "-") {
    std::string_view arg = cursor.peek();
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return kExitOk;
    }
    if (arg == "--version") {
      std::cout << "gpuqctl " << gpuq::version() << '\n';
      return kExitOk;
    }
    if (!cursor.take_value("--runtime-dir", runtime_dir, error)) {
      return usage_error("unknown option '" + std::string(arg) + "'");
    }
    if (!error.empty()) return usage_error(error);
  }
  if (cursor.done()) return usage_error("no command given (status, ready, submit or stop)");
  const std::string command(cursor.next());

  if (command == "help") {
    std::cout << kUsage;
    return kExitOk;
  }
  if (command == "status") {
    bool as_json = false;
    while (!cursor.done()) {
      std::string_view arg = cursor.peek();
      if (arg == "--json") {
        as_json = true;
        cursor.next();
      } else if (arg == "-h" || arg == "--help") {
        std::cout << kUsage;
        return kExitOk;
      } else if (cursor.take_value("--runtime-dir", runtime_dir, error)) {
        if (!error.empty()) return usage_error(error);
      } else {
        return usage_error("unknown argument '" + std::string(arg) + "' for status");
      }
    }
    return run_status(runtime_dir, as_json);
  }
  if (command == "ready" || command == "stop") {
    // These take no arguments besides --runtime-dir (and --help).
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
    return command == "ready" ? run_ready(runtime_dir) : run_stop(runtime_dir);
  }
  if (command == "submit") {
    if (cursor.done()) return usage_error("submit needs an op name, e.g. 'gpuqctl submit echo'");
    SubmitArgs args;
    if (cursor.peek() == "-h" || cursor.peek() == "--help") {
      std::cout << kUsage;
      return kExitOk;
    }
    if (cursor.peek().substr(0, 1) == "-") {
      return usage_error("submit needs an op name before its options, got '" +
                         std::string(cursor.peek()) + "'");
    }
    args.op = std::string(cursor.next());
    const int parsed = parse_submit(cursor, runtime_dir, args);
    if (parsed < 0) return kExitOk;  // --help
    if (parsed != kExitOk) return parsed;
    return run_submit(runtime_dir, args);
  }
  return usage_error("unknown command '" + command + "' (expected status, submit or stop)");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gpuqctl: Internal: unexpected exception: " << e.what() << '\n';
    return kExitFailure;
  }
}
