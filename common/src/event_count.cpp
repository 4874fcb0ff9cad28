#include "gpuq/common/event_count.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>

namespace gpuq {

bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, uint64_t deadline_ns) noexcept {
  // FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC deadline, so EINTR retries lose no time.
  timespec ts{};
  const timespec* tsp = nullptr;
  if (deadline_ns != kNoDeadline) {
    ts.tv_sec = static_cast<time_t>(deadline_ns / 1000000000ull);
    ts.tv_nsec = static_cast<long>(deadline_ns % 1000000000ull);
    tsp = &ts;
  }
  // Shared (not FUTEX_PRIVATE_FLAG): waiter and waker may be different processes.
  // Raw, not GPUQ_POSIX_CALL: this is the hot wait path, and its "failures" are outcomes the
  // caller handles by re-checking its condition: EAGAIN (the word had already changed), EINTR
  // (a signal; a spurious wakeup is allowed), ETIMEDOUT (the deadline passed, reported here).
  long r = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_BITSET, expected, tsp,
                   nullptr, FUTEX_BITSET_MATCH_ANY);
  return !(r == -1 && errno == ETIMEDOUT);
}

void futex_wake(std::atomic<uint32_t>* word, int count) noexcept {
  // FUTEX_WAKE fails only for a bad address or operation (EFAULT, EINVAL), which would be a
  // bug that the waiters' FUTEX_WAIT shows as well; the count of woken waiters is not needed.
  (void)syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr,
                0);
}

bool EventCount::wait(Key key, uint64_t deadline_ns) noexcept {
  bool in_time = true;
  if (epoch_.load(std::memory_order_acquire) == key) {
    in_time = futex_wait(&epoch_, key, deadline_ns);
  }
  waiters_.fetch_sub(1, std::memory_order_seq_cst);
  return in_time || monotonic_ns() < deadline_ns;
}

bool EventCount::notify(int count, bool fence) noexcept {
  if (fence) std::atomic_thread_fence(std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) == 0) return false;
  epoch_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake(&epoch_, count);
  return true;
}

}  // namespace gpuq
