// A job's options as gpuq._native takes them: one value, made and checked once by
// gpuq._options.job_options (in the caller's units: seconds), that every submit of the binding
// takes whole, so that a new option is a field here and a keyword there, not a parameter of
// every submit function on both sides of the language line.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "gpuq/job_spec.hpp"

namespace gpuq::python {

struct JobOptions {
  std::string pool;            // "": the daemon's first pool
  int64_t timeout_ns = -1;     // how long a submit waits for room in the ring; < 0: no limit
  int64_t expire_ns = -1;      // a job still queued this long after its submit expires; < 0: never
  bool retryable = false;      // run it again if its worker dies
  uint32_t time_limit_ms = 0;  // its own time limit (0: none; its pool's applies anyway)
  bool try_only = false;       // no room: QueueFull at once, not a wait
  uint32_t priority = 0;       // a gpuq::Priority (gpuq._native.PRIORITIES), checked by the client
  uint32_t stream_window = 0;  // a stream's parts that may wait unread (Client.stream); 0: none

  JobOptions() = default;
  JobOptions(std::string pool_, int64_t timeout_ns_, int64_t expire_ns_, bool retryable_,
             uint32_t time_limit_ms_, bool try_only_, uint32_t priority_)
      : pool(std::move(pool_)),
        timeout_ns(timeout_ns_),
        expire_ns(expire_ns_),
        retryable(retryable_),
        time_limit_ms(time_limit_ms_),
        try_only(try_only_),
        priority(priority_) {}

  // The options that travel with the job (the others are the submit's own).
  void apply(JobSpec& spec) const {
    spec.pool = pool;
    spec.expire_after = std::chrono::nanoseconds(expire_ns);
    spec.retryable = retryable;
    spec.time_limit = std::chrono::milliseconds(time_limit_ms);
    // Out of range stays out of range: Client::submit refuses it, naming the field.
    spec.priority = static_cast<Priority>(priority > 255 ? 255 : priority);
    spec.stream_window = stream_window;
  }
};

}  // namespace gpuq::python
