// Fault-injection seams: named points at which a test can make this process die with SIGKILL.
//
// A point costs one load of a process-wide flag and a predictable branch when fault injection
// is off, which it is unless the environment asks for it when the process starts:
//
//   GPUQ_FAULT_POINT=NAME[:N]   die at the N-th time (default 1) this process reaches point NAME
//   GPUQ_FAULT_ONCE=PATH        die only if PATH can be created (O_CREAT | O_EXCL): of all the
//                               processes that share the setting (every worker of a daemon and
//                               the workers that replace them), only the first to reach the
//                               point dies. Without it, every process that reaches it does.
//
// The names in use are listed in docs/design/faults.md. Tests (tests/fault/) set these for a
// client process they start, or for a daemon, whose workers inherit them.
#pragma once

#include <atomic>

namespace gpuq::fault {

namespace detail {
extern std::atomic<bool> g_enabled;
void hit(const char* name) noexcept;
}  // namespace detail

// True when this process has a fault point armed.
inline bool enabled() noexcept {
  return detail::g_enabled.load(std::memory_order_relaxed);
}

// Re-reads the environment (done once at start-up; tests and forked children may call it).
void configure_from_env() noexcept;

}  // namespace gpuq::fault

#define GPUQ_FAULT_POINT(name)                                      \
  do {                                                              \
    if (::gpuq::fault::enabled()) ::gpuq::fault::detail::hit(name); \
  } while (0)
