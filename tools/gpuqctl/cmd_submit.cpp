// gpuqctl submit OP [OPTIONS]: reads the --input files, runs one job and reports its result, or
// hands --count N jobs to submit_load.cpp.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/tensor_ops.hpp"
#include "submit.hpp"

namespace gpuq::ctl {
namespace {

// The messages read "cannot open '<path>': <strerror>": the errno of the failed call (the
// wrapper keeps it), without the wrapper's file and line, which say nothing to a user.
std::optional<std::string> read_file(const std::string& path, std::string& error) {
  auto in = GPUQ_NONNULL_CALL(std::fopen, path.c_str(), "rb");
  if (!in) {
    error = "cannot open '" + path + "': " + std::strerror(errno);
    return std::nullopt;
  }
  std::string bytes;
  char chunk[65536];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, *in)) > 0) bytes.append(chunk, n);
  const bool failed = std::ferror(*in) != 0;
  const int err = errno;
  // Read-only: closing cannot lose data, so its result is ignored.
  (void)std::fclose(*in);
  if (failed) {
    error = "cannot read '" + path + "': " + std::strerror(err);
    return std::nullopt;
  }
  return bytes;
}

bool write_file(const std::string& path, const std::byte* data, uint64_t size, std::string& error) {
  auto out = GPUQ_NONNULL_CALL(std::fopen, path.c_str(), "wb");
  if (!out) {
    error = "cannot write '" + path + "': " + std::strerror(errno);
    return false;
  }
  // fwrite, then fclose (which flushes): either failing means the file is not all there.
  const bool written = std::fwrite(data, 1, size, *out) == size;
  int err = errno;
  const bool closed = std::fclose(*out) == 0;
  if (written && !closed) err = errno;
  if (!written || !closed) {
    error = "cannot write '" + path + "': " + std::strerror(err);
    return false;
  }
  return true;
}

// "part I: N bytes: 00 01 ..." (the first 32 bytes in hex).
std::string describe_part(const gpuq::JobPart& part) {
  std::string line =
      strf("part %u: %llu bytes", part.index, static_cast<unsigned long long>(part.size));
  const auto* bytes = static_cast<const unsigned char*>(part.data);
  const uint64_t shown = std::min<uint64_t>(part.size, 32);
  if (shown > 0) line += ":";
  for (uint64_t i = 0; i < shown; ++i) line += strf(" %02x", bytes[i]);
  if (shown < part.size) line += " ...";
  return line;
}

// Reads a streaming job's parts as they come, printing each (and appending it to --output's
// file); then its end. Exit status as run_one's.
int read_stream(const SubmitArgs& args, gpuq::Job& job,
                const std::optional<Clock::time_point>& deadline) {
  std::FILE* out = nullptr;
  if (!args.output_path.empty()) {
    auto opened = GPUQ_NONNULL_CALL(std::fopen, args.output_path.c_str(), "wb");
    if (!opened) {
      std::cerr << "gpuqctl: cannot write '" << args.output_path << "': " << std::strerror(errno)
                << '\n';
      return kExitFailure;
    }
    out = *opened;
  }
  struct Close {
    std::FILE*& f;
    ~Close() {
      if (f != nullptr) (void)std::fclose(f);  // after a write error: the message says so
    }
  } close{out};
  for (;;) {
    gpuq::Result<std::optional<gpuq::JobPart>> part = job.next_part(time_left(deadline));
    if (!part) {
      if (part.error().code() == gpuq::ErrorCode::kTimeout) {
        std::cerr << "gpuqctl: the stream did not end within " << *args.timeout_ms << " ms; "
                  << cancel_unfinished(job) << '\n';
        return kExitFailure;
      }
      break;  // the job's error: wait() below reports it with its timing
    }
    if (!part->has_value()) break;
    std::cout << describe_part(**part) << std::endl;  // as it comes: flushed
    if (out != nullptr && std::fwrite((*part)->data, 1, (*part)->size, out) != (*part)->size) {
      std::cerr << "gpuqctl: cannot write '" << args.output_path << "': " << std::strerror(errno)
                << '\n';
      return kExitFailure;
    }
  }
  if (out != nullptr && std::fclose(std::exchange(out, nullptr)) != 0) {
    std::cerr << "gpuqctl: cannot write '" << args.output_path << "': " << std::strerror(errno)
              << '\n';
    return kExitFailure;
  }
  return kExitOk;
}

int run_one(const SubmitArgs& args, Session& session) {
  gpuq::JobSpec spec = make_spec(args);
  spec.input = session.inputs[0];
  spec.output = session.outputs[0];
  std::optional<Clock::time_point> deadline;
  if (args.timeout_ms) deadline = Clock::now() + std::chrono::milliseconds(*args.timeout_ms);

  gpuq::Result<gpuq::Job> job = session.client.submit(spec, time_left(deadline));
  if (!job) return daemon_error(job.error());
  if (args.stream_window > 0) {
    if (const int status = read_stream(args, job.value(), deadline); status != kExitOk) {
      return status;
    }
  }
  gpuq::Result<gpuq::JobResult> result = job->wait(time_left(deadline));
  if (!result) {
    if (result.error().code() == gpuq::ErrorCode::kTimeout) {
      const int status = daemon_error(
          gpuq::Error(gpuq::ErrorCode::kTimeout,
                      "the job did not finish within " + std::to_string(*args.timeout_ms) + " ms"));
      std::cerr << "gpuqctl: " << cancel_unfinished(job.value()) << '\n';
      return status;
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
  if (!args.output_path.empty() && args.stream_window == 0) {
    std::string error;
    const uint64_t n = std::min(r.output_size, spec.output.size);
    if (!write_file(args.output_path, spec.output.data(), n, error)) {
      std::cerr << "gpuqctl: " << error << '\n';
      return kExitFailure;
    }
  }
  return kExitOk;
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
  uint64_t output_size = args.output_size.value_or(
      args.stream_window > 0 ? uint64_t{args.stream_window} * 4096
                             : std::max<uint64_t>(input.size(), uint64_t{64}));
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
  return run_load(args, session.value());
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
    } else if (cursor.take_value("--time-limit-ms", value, error)) {
      if (!error.empty()) return usage_error(error);
      std::optional<uint64_t> limit =
          parse_count("--time-limit-ms", value, 0, UINT32_MAX, error);  // JobSpec::time_limit
      if (!limit) return usage_error(error);
      args.time_limit_ms = *limit;
    } else if (cursor.take_value("--priority", value, error)) {
      if (!error.empty()) return usage_error(error);
      std::optional<gpuq::Priority> level = gpuq::parse_priority(value);
      if (!level) {
        return usage_error("--priority: '" + value + "' is not a level (high, normal or low)");
      }
      args.priority = *level;
    } else if (cursor.take_value("--stream", value, error)) {
      if (!error.empty()) return usage_error(error);
      std::optional<uint64_t> window = parse_count("--stream", value, 1, 8, error);
      if (!window) return usage_error(error);
      args.stream_window = static_cast<uint32_t>(*window);
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
  if (args.count && args.stream_window > 0) {
    return usage_error("--stream cannot be used with --count");
  }
  if (!args.count && args.concurrency != 1) {
    return usage_error("--concurrency needs --count");
  }
  return kExitOk;
}

}  // namespace

int cmd_submit(ArgCursor& cursor, std::string& runtime_dir) {
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

}  // namespace gpuq::ctl
