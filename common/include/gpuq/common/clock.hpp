// Monotonic time shared by all processes of one machine (CLOCK_MONOTONIC), in nanoseconds.
// Deadlines stored in shared memory use this clock, so a worker and a client agree on them.
#pragma once

#include <time.h>

#include <cstdint>

namespace gpuq {

inline uint64_t monotonic_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline constexpr uint64_t kNoDeadline = UINT64_MAX;

// Deadline `timeout_ns` from now; a negative timeout means "never".
inline uint64_t deadline_after_ns(int64_t timeout_ns) noexcept {
  if (timeout_ns < 0) return kNoDeadline;
  return monotonic_ns() + static_cast<uint64_t>(timeout_ns);
}

}  // namespace gpuq
