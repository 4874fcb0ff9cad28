// Cache-line prefetch hints for the job path. A job's lines (its slot's state word and
// descriptor, its ring cell, its client's share counter) were last written on another core;
// touching them one after another makes each a separate cross-core miss behind the previous
// one (locked instructions wait for each). Announcing them together lets the misses overlap.
// Hints only: they change no value and are safe on any address, mapped or not.
#pragma once

namespace gpuq {

// Fetches the line holding `p` for writing (exclusive): the CAS or store that follows needs no
// second transaction to upgrade a shared copy. PREFETCHW (0F 0D /1) executes as a NOP on x86-64
// processors that predate it.
inline void prefetch_for_write(const void* p) noexcept {
#if defined(__x86_64__)
  asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 1, 3);
#endif
}

// Fetches the line holding `p` for reading.
inline void prefetch_for_read(const void* p) noexcept {
  __builtin_prefetch(p, 0, 3);
}

}  // namespace gpuq
