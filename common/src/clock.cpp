#include "gpuq/common/clock.hpp"

#include <fstream>

namespace gpuq {

const char* stamp_clock_name(StampClock clock) noexcept {
  return clock == StampClock::kTsc ? "tsc" : "monotonic";
}

Result<StampClock> parse_stamp_clock(const std::string& name) {
  if (name == "tsc") return StampClock::kTsc;
  if (name == "monotonic") return StampClock::kMonotonic;
  return Error(ErrorCode::kInvalidArgument,
               "unknown job clock '" + name + "' (expected \"tsc\" or \"monotonic\")");
}

std::string tsc_unusable_reason(const char* clocksource_path) {
#if !defined(__x86_64__)
  (void)clocksource_path;
  return "the TSC is an x86-64 counter";
#else
  const char* path = clocksource_path;
  std::ifstream in(path);
  std::string source;
  if (!(in >> source)) return std::string("cannot read ") + path;
  if (source != "tsc") {
    return "the kernel keeps time with clocksource '" + source +
           "', not 'tsc' (it has not found the TSC reliable)";
  }
  return "";
#endif
}

namespace {
// A TSC reading and a CLOCK_MONOTONIC reading taken as close together as this thread manages:
// the tightest of a few tries (a preemption between the two reads spoils one).
void paired_reading(uint64_t* tsc, uint64_t* ns) noexcept {
  uint64_t best = UINT64_MAX;
  for (int i = 0; i < 5; ++i) {
    const uint64_t t0 = read_stamp(StampClock::kTsc);
    const uint64_t n = monotonic_ns();
    const uint64_t t1 = read_stamp(StampClock::kTsc);
    if (t1 - t0 < best) {
      best = t1 - t0;
      *tsc = t0 + (t1 - t0) / 2;
      *ns = n;
    }
  }
}
}  // namespace

TscRate::TscRate() noexcept {
  paired_reading(&tsc0_, &ns0_);
}

double TscRate::ns_per_tick() const noexcept {
  uint64_t tsc = 0, ns = 0;
  for (;;) {
    paired_reading(&tsc, &ns);
    if (ns - ns0_ >= 1'000'000 && tsc > tsc0_) break;
    const timespec pause{0, 200'000};
    // A short pause between readings: an interrupted or failed one only makes the loop
    // read again sooner, so the result is ignored.
    (void)nanosleep(&pause, nullptr);
  }
  return static_cast<double>(ns - ns0_) / static_cast<double>(tsc - tsc0_);
}

}  // namespace gpuq
