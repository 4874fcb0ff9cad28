// Unit tests of EventCount (common/include/gpuq/common/event_count.hpp): a waiter really sleeps
// and is woken by a notify from another thread or another process, deadlines are honoured, and
// no wakeup is lost.
#include "gpuq/common/event_count.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "gpuq/common/clock.hpp"
#include "support/test_support.hpp"

namespace gpuq {
namespace {

using test::kMillisecond;
using test::kSecond;

// The documented waiter protocol: returns true once cond() holds, false if `deadline` passed.
// Counts the waits that ended by deadline while the condition had in fact become true (a lost
// wakeup) in `*late`.
template <typename Cond>
bool wait_for(EventCount& ec, Cond&& cond, uint64_t deadline, uint64_t* late = nullptr) {
  while (!cond()) {
    const EventCount::Key key = ec.prepare_wait();
    if (cond()) {
      ec.cancel_wait();
      return true;
    }
    if (!ec.wait(key, deadline)) {
      if (cond() && late != nullptr) ++*late;
      return cond();
    }
  }
  return true;
}

TEST_CASE("EventCount: a sleeping waiter is woken by notify_one from another thread") {
  EventCount ec{};
  std::atomic<bool> ready{false};
  std::atomic<pid_t> waiter_tid{0};
  std::atomic<int> outcome{-1};  // 1: woken by the notify; 0: wait() timed out; 2: no sleep

  std::thread waiter([&] {
    waiter_tid.store(test::current_tid());
    const EventCount::Key key = ec.prepare_wait();
    if (ready.load()) {
      ec.cancel_wait();
      outcome.store(2);
      return;
    }
    const bool in_time = ec.wait(key, monotonic_ns() + 20 * kSecond);
    outcome.store(in_time && ready.load() ? 1 : 0);
  });

  // Wait until the waiter is registered and asleep in the kernel, then wake it.
  const bool asleep = test::wait_until(
      [&] {
        const pid_t tid = waiter_tid.load();
        return tid != 0 && ec.waiters() == 1 && test::task_state(::getpid(), tid) == 'S';
      },
      10 * kSecond);
  ready.store(true);
  const uint64_t notified_at = monotonic_ns();
  ec.notify_one();
  waiter.join();

  CHECK(asleep);
  CHECK(outcome.load() == 1);
  CHECK(monotonic_ns() - notified_at < 5 * kSecond);  // woken, not released by its deadline
  CHECK(ec.waiters() == 0);
}

TEST_CASE("EventCount: notify_all wakes every sleeping waiter") {
  EventCount ec{};
  std::atomic<bool> ready{false};
  std::atomic<int> woken{0};
  constexpr int kWaiters = 3;

  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&] {
      if (wait_for(
              ec, [&] { return ready.load(); }, monotonic_ns() + 20 * kSecond)) {
        woken.fetch_add(1);
      }
    });
  }
  const bool all_registered =
      test::wait_until([&] { return ec.waiters() == kWaiters; }, 10 * kSecond);
  ready.store(true);
  ec.notify_all();
  for (auto& t : waiters) t.join();

  CHECK(all_registered);
  CHECK(woken.load() == kWaiters);
  CHECK(ec.waiters() == 0);
}

TEST_CASE("EventCount: a waiter in another process is woken by notify_one") {
  struct Shared {
    EventCount ec;
    std::atomic<uint32_t> ready;
  };
  test::SharedMemory memory(sizeof(Shared));
  auto* shared = new (memory.base()) Shared{};

  const pid_t child = test::fork_child([shared] {
    const EventCount::Key key = shared->ec.prepare_wait();
    if (shared->ready.load() != 0) {
      shared->ec.cancel_wait();
      return 2;  // the parent set `ready` before the child slept: a broken test, not a pass
    }
    const bool in_time = shared->ec.wait(key, monotonic_ns() + 20 * kSecond);
    return in_time && shared->ready.load() != 0 ? 0 : 1;
  });
  REQUIRE(child > 0);

  const bool asleep = test::wait_until(
      [&] { return shared->ec.waiters() == 1 && test::task_state(child, child) == 'S'; },
      10 * kSecond);
  shared->ready.store(1);
  shared->ec.notify_one();
  const test::ChildExit e = test::wait_child(child, 10 * kSecond);

  CHECK(asleep);
  INFO("child: " << e.describe());
  CHECK(e.ok());
  CHECK(shared->ec.waiters() == 0);
}

TEST_CASE("EventCount::wait returns false once its deadline has passed") {
  EventCount ec{};
  const uint64_t start = monotonic_ns();
  const uint64_t deadline = start + 50 * kMillisecond;

  const EventCount::Key key = ec.prepare_wait();
  const bool in_time = ec.wait(key, deadline);
  const uint64_t end = monotonic_ns();

  CHECK_FALSE(in_time);
  CHECK(end >= deadline);
  CHECK(end - start < 10 * kSecond);
  CHECK(ec.waiters() == 0);  // wait() deregisters on every path
}

TEST_CASE("EventCount::wait with a deadline already past returns false at once") {
  EventCount ec{};
  const EventCount::Key key = ec.prepare_wait();

  const bool in_time = ec.wait(key, monotonic_ns() - 1);

  CHECK_FALSE(in_time);
  CHECK(ec.waiters() == 0);
}

TEST_CASE("EventCount: a notify between prepare_wait and wait is not lost") {
  EventCount ec{};
  const EventCount::Key key = ec.prepare_wait();

  ec.notify_one();
  const bool in_time = ec.wait(key, monotonic_ns() - 1);  // would time out if the wake was lost

  CHECK(in_time);
  CHECK(ec.waiters() == 0);
}

TEST_CASE("EventCount: notify with no registered waiter does not advance the epoch") {
  EventCount ec{};
  const EventCount::Key before = ec.prepare_wait();
  ec.cancel_wait();

  ec.notify_one();
  ec.notify_all();
  const EventCount::Key after = ec.prepare_wait();
  ec.cancel_wait();

  CHECK(before == after);
  CHECK(ec.waiters() == 0);
}

TEST_CASE("EventCount: no lost wakeup in a ping-pong between two threads") {
  // Two threads hand a turn back and forth; each sleeps on its own EventCount until the turn is
  // its own. A lost wakeup would leave a thread asleep until its deadline.
  EventCount ec[2]{};
  std::atomic<uint32_t> turn{0};
  const uint32_t rounds = static_cast<uint32_t>(test::scaled(20'000));
  std::atomic<uint64_t> late{0};
  std::atomic<uint64_t> gave_up{0};

  auto player = [&](uint32_t me) {
    uint64_t my_late = 0;
    for (uint32_t i = 0; i < rounds; ++i) {
      if (!wait_for(
              ec[me], [&] { return turn.load() == me; }, monotonic_ns() + 2 * kSecond, &my_late)) {
        gave_up.fetch_add(1);
        return;
      }
      turn.store(1 - me);
      ec[1 - me].notify_one();
    }
    late.fetch_add(my_late);
  };
  const uint64_t start = monotonic_ns();
  std::thread a(player, 0u);
  std::thread b(player, 1u);
  a.join();
  b.join();
  MESSAGE(rounds << " ping-pong rounds in " << (monotonic_ns() - start) / kMillisecond << " ms");

  CHECK(gave_up.load() == 0);
  CHECK(late.load() == 0);
  CHECK(ec[0].waiters() == 0);
  CHECK(ec[1].waiters() == 0);
}

}  // namespace
}  // namespace gpuq
