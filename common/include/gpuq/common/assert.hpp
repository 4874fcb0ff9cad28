// Invariant checks. A broken invariant is a bug, not an error value: GPUQ_ASSERT prints the
// condition with file and line and aborts. It stays on in release builds.
#pragma once

#include <cstdio>
#include <cstdlib>

#define GPUQ_ASSERT(cond)                                                                      \
  do {                                                                                         \
    if (!(cond)) [[unlikely]] {                                                                \
      std::fprintf(stderr, "gpuq: assertion failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                            \
    }                                                                                          \
  } while (0)
