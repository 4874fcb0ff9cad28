// EventCount: a wait/wake primitive that lives in shared memory (folly::EventCount's contract).
//
// A consumer that finds nothing to do registers, re-checks its condition, and sleeps on a futex;
// a producer that made the condition true calls notify(), which costs one atomic load when no one
// sleeps and a FUTEX_WAKE otherwise. The futex is process-shared (no FUTEX_PRIVATE_FLAG), so the
// waiter and the notifier may be different processes that map the same page at any address.
//
// Waiter:                                   Poster:
//   if (cond()) return;                       make cond() true (a store or RMW, any order);
//   auto key = ec.prepare_wait();             ec.notify_one();   // or notify_all()
//   if (cond()) { ec.cancel_wait(); return; }
//   ec.wait(key, deadline);                   // then loop and re-check cond()
//
// Memory ordering: prepare_wait() increments `waiters_` with a seq_cst RMW and then issues a
// seq_cst fence before the waiter re-checks; notify() issues a seq_cst fence after the poster's
// store and then reads `waiters_` (seq_cst). By the total order of seq_cst operations, either
// the poster's load sees the registration (and bumps the epoch and wakes, so the waiter's
// futex_wait with the old key returns at once), or that load precedes the registration, and so
// the waiter's fence, and the waiter's re-check of cond() sees the poster's store. No lost
// wakeups. A poster whose store was itself a seq_cst RMW needs no fence: the RMW precedes its
// load of `waiters_` in the total order just as the fence would (the *_after_rmw calls).
//
// Plain data: two 32-bit lock-free atomics, no pointers. Thread- and process-safe. Not
// async-signal-safe. A process killed between prepare_wait() and wait() leaves `waiters_` one
// too high: that only costs posters a needless FUTEX_WAKE, never a missed one.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

namespace gpuq {

class EventCount {
 public:
  using Key = uint32_t;

  // Registers a waiter and returns the epoch to pass to wait(). Every prepare_wait() must be
  // followed by exactly one wait() or cancel_wait().
  Key prepare_wait() noexcept {
    waiters_.fetch_add(1, std::memory_order_seq_cst);
    // Orders the registration before the caller's re-check of its condition (the other half
    // of the fence in notify()).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return epoch_.load(std::memory_order_seq_cst);
  }

  void cancel_wait() noexcept { waiters_.fetch_sub(1, std::memory_order_seq_cst); }

  // Sleeps until notified after prepare_wait() returned `key`, or until `deadline_ns`
  // (CLOCK_MONOTONIC; kNoDeadline waits forever), or a spurious wakeup. Always deregisters.
  // Returns false only if the deadline passed.
  bool wait(Key key, uint64_t deadline_ns) noexcept;

  // Wakes one (or all) sleeping waiters, if any are registered. Lock-free when none are.
  // Return true if a waiter was registered (and so was woken).
  bool notify_one() noexcept { return notify(1, true); }
  bool notify_all() noexcept { return notify(INT32_MAX, true); }

  // The same without the fence, for a poster whose last step in making the condition true was
  // a seq_cst read-modify-write (a CAS, an exchange): that already orders the change before
  // notify's seq_cst load of `waiters_` in the total order, which is all the fence is for
  // (see "Memory ordering" above). Saves a locked instruction on hot paths.
  bool notify_one_after_rmw() noexcept { return notify(1, false); }
  bool notify_all_after_rmw() noexcept { return notify(INT32_MAX, false); }

  // Number of registered waiters (for status and tests; racy by nature).
  uint32_t waiters() const noexcept { return waiters_.load(std::memory_order_seq_cst); }

 private:
  bool notify(int count, bool fence) noexcept;

  std::atomic<uint32_t> epoch_;
  std::atomic<uint32_t> waiters_;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(EventCount) == 8);
static_assert(std::is_standard_layout_v<EventCount>);

// Raw futex calls on a 32-bit word in shared memory. futex_wait returns false on timeout.
bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, uint64_t deadline_ns) noexcept;
void futex_wake(std::atomic<uint32_t>* word, int count) noexcept;

// Spins on `cond` for at most `spin_ns`, pausing the CPU between checks and yielding the core
// now and then so that spinners do not starve other processes on a machine with few cores.
// Returns true as soon as cond() holds.
template <typename Cond>
bool spin_until(Cond&& cond, uint64_t spin_ns) noexcept;

}  // namespace gpuq

#include "gpuq/common/detail/spin.hpp"
