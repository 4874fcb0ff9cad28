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

template <typename Cond>
bool spin_until(Cond&& cond, uint64_t spin_ns) noexcept {
  if (cond()) return true;
  if (spin_ns == 0) return false;
  const uint64_t start = monotonic_ns();
  for (uint32_t i = 1;; ++i) {
    for (int k = 0; k < 16; ++k) {
      GPUQ_CPU_RELAX();
      if (cond()) return true;
    }
    // Check the clock every 16 pauses; yield every 256 so a spinner shares its core.
    if (monotonic_ns() - start >= spin_ns) return cond();
    if ((i & 15) == 0) sched_yield();
  }
}

}  // namespace gpuq
