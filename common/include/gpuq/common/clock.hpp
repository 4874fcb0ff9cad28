// Monotonic time shared by all processes of one machine (CLOCK_MONOTONIC), in nanoseconds.
// Deadlines stored in shared memory use this clock, so a worker and a client agree on them.
//
// Job stamps (when a job was submitted, started, finished) only ever give durations, and are
// read on every job's path, so they may come from a cheaper counter: see "Job stamps" below.
#pragma once

#include <time.h>

#include <cstdint>
#include <string>

#include "gpuq/error.hpp"

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace gpuq {

inline uint64_t monotonic_ns() noexcept {
  timespec ts;
  // Cannot fail: CLOCK_MONOTONIC always exists and &ts is valid (and this is a hot path).
  (void)clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline constexpr uint64_t kNoDeadline = UINT64_MAX;

// Deadline `timeout_ns` from now; a negative timeout means "never".
inline uint64_t deadline_after_ns(int64_t timeout_ns) noexcept {
  if (timeout_ns < 0) return kNoDeadline;
  return monotonic_ns() + static_cast<uint64_t>(timeout_ns);
}

// ---- Job stamps ----
//
// A job's submit stamp (written by its client) and its start and finish stamps (written by its
// worker) give JobResult's queued_ns and run_ns, and nothing else: no deadline or timeout is
// ever compared with them. A CLOCK_MONOTONIC read costs about 25 ns on the machines measured
// (it waits for the loads before it, then scales the counter), and a noop job took one on each
// side: about a tenth of its whole cost. So where the kernel itself keeps time with the TSC
// (clocksource "tsc": the kernel has found it invariant and in step on every CPU, which the
// vDSO's CLOCK_MONOTONIC relies on too), stamps are raw TSC readings (about 10 ns), converted
// to nanoseconds only when a client reads a result. Elsewhere they are CLOCK_MONOTONIC
// nanoseconds. gpuqd chooses once, at start (config key `job_clock`), and tells its workers
// (command line) and its clients (Welcome, with the TSC's rate), so that every process of one
// daemon stamps in the same unit.
enum class StampClock : uint32_t { kMonotonic = 0, kTsc = 1 };

inline uint64_t read_stamp(StampClock clock) noexcept {
#if defined(__x86_64__)
  if (clock == StampClock::kTsc) return __rdtsc();
#endif
  (void)clock;
  return monotonic_ns();
}

// "monotonic", "tsc".
const char* stamp_clock_name(StampClock clock) noexcept;
// From stamp_clock_name(); InvalidArgument otherwise.
Result<StampClock> parse_stamp_clock(const std::string& name);

// Why the TSC cannot be used for stamps on this machine, or "" if it can: not x86-64, or a
// kernel clocksource other than "tsc" (read from `clocksource_path`, sysfs unless a test
// names another file).
inline constexpr const char* kClocksourcePath =
    "/sys/devices/system/clocksource/clocksource0/current_clocksource";
std::string tsc_unusable_reason(const char* clocksource_path = kClocksourcePath);

// Converts stamp differences into nanoseconds.
struct StampScale {
  StampClock clock = StampClock::kMonotonic;
  double ns_per_tick = 1.0;  // kTsc: measured by gpuqd (TscRate); kMonotonic: 1

  uint64_t to_ns(uint64_t ticks) const noexcept {
    return clock == StampClock::kMonotonic
               ? ticks
               : static_cast<uint64_t>(static_cast<double>(ticks) * ns_per_tick + 0.5);
  }
};

// Measures the TSC's rate against CLOCK_MONOTONIC from construction to each call of
// ns_per_tick(): the longer the process has run, the better the figure (two readings a few
// tens of nanoseconds apart at each end; after 10 ms, an error under 10 parts per million).
// ns_per_tick() waits until at least 1 ms has passed since construction.
class TscRate {
 public:
  TscRate() noexcept;
  double ns_per_tick() const noexcept;

 private:
  uint64_t tsc0_ = 0, ns0_ = 0;
};

}  // namespace gpuq
