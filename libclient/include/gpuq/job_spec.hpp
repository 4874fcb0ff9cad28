// gpuq client library: what a job is made of (JobSpec, JobParam), shared by the client
// (gpuq/client.hpp, which submits them) and the tensor ops' builders (gpuq/tensor.hpp, which
// make them without a connection).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gpuq/buffer.hpp"
#include "gpuq/priority.hpp"

namespace gpuq {

// A small job parameter: integer, float or short string (see gpuq/common/params.hpp limits:
// keys 1-32 chars of [a-z0-9_.], strings up to 64 bytes, 192 bytes in all).
struct JobParam {
  std::string key;
  enum class Type { kInt, kFloat, kString } type = Type::kInt;
  int64_t int_value = 0;
  double float_value = 0;
  std::string string_value;

  static JobParam integer(std::string k, int64_t v) { return {std::move(k), Type::kInt, v, 0, {}}; }
  static JobParam real(std::string k, double v) { return {std::move(k), Type::kFloat, 0, v, {}}; }
  static JobParam text(std::string k, std::string v) {
    return {std::move(k), Type::kString, 0, 0, std::move(v)};
  }
};

// What to run. `input` and `output` may be empty Buffers (size 0).
struct JobSpec {
  std::string op;    // op name: "noop", "echo", "sleep", "checksum", ...
  std::string pool;  // pool name; empty: the first pool
  Buffer input;
  Buffer output;
  std::vector<JobParam> params;
  // If still queued at this long after submission, the job ends Expired without running.
  // Negative: no deadline.
  std::chrono::nanoseconds expire_after{-1};
  // If the worker running it dies, run it again (once) instead of failing it with
  // WorkerDied. Only for jobs that may safely run twice: the first run may have written part
  // of the output.
  bool retryable = false;
  // The longest the job may run once started (0: no limit of its own). The smaller of this and
  // its pool's job_time_limit_ms applies: past it the op is asked to stop, and cancel_grace_ms
  // later its worker is stopped; the job ends TimedOut either way (docs/design/faults.md, "Jobs
  // that do not end"). At most 2^32 - 1 ms; negative is InvalidArgument.
  std::chrono::milliseconds time_limit{0};
  // Higher levels are taken first; a lower level that waits still gets at least a tenth of
  // the pool's starts. Batching gathers jobs of one level (docs/design/ring.md, "Lanes").
  Priority priority = Priority::kNormal;
  // A streaming job (docs/design/streams.md): its op makes its answer in parts, each readable
  // as soon as it is made (Job::next_part). `output` is cut into `stream_window` equal cells
  // (1 to 8, each 64 bytes or more): at most that many parts wait unread, and the op waits
  // for room. 0: the job answers once, at its end. A stream cannot be `retryable`.
  uint32_t stream_window = 0;
};

}  // namespace gpuq
