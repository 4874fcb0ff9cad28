// Implementation of gpuq::spin_until (included by event_count.hpp).
#pragma once

#include <sched.h>

#include "gpuq/common/clock.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GPUQ_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define GPUQ_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define GPUQ_CPU_RELAX() ((void)0)
#endif

namespace gpuq {

// How long spin_until pause-spins before it starts yielding the core between checks.
inline constexpr uint64_t kSpinPauseOnlyNs = 2000;

template <typename Cond>
bool spin_until(Cond&& cond, uint64_t spin_ns) noexcept {
  if (cond()) return true;
  if (spin_ns == 0) return false;
  // Pause-spin for the first microseconds (a job or a push usually lands within one); after
  // that, yield between checks, so that on a machine with more runnable processes than cores
  // the spinner hands its core to whoever would make `cond` true (a worker, another client)
  // instead of burning the slice in front of it. sched_yield returns at once when nothing
  // else wants the core.
  // The first round of pauses runs before the clock is read: most waits end within it, and a
  // clock read (rdtscp) waits for every load before it, the missed line of cond() included.
  for (int k = 0; k < 16; ++k) {
    GPUQ_CPU_RELAX();
    if (cond()) return true;
  }
  const uint64_t start = monotonic_ns();
  for (;;) {
    for (int k = 0; k < 16; ++k) {
      GPUQ_CPU_RELAX();
      if (cond()) return true;
    }
    const uint64_t spent = monotonic_ns() - start;
    if (spent >= spin_ns) return cond();
    if (spent >= kSpinPauseOnlyNs) sched_yield();
  }
}

}  // namespace gpuq
