// Stress tests of JobRing: long multi-threaded runs on a small ring, and processes SIGKILLed at
// random moments while they push and pop, after which the ring must still work and account for
// every value. Randomized runs print their seed; GPUQ_TEST_SEED=<n> replays one.
//
// What the design guarantees for a process killed at any instruction (job_ring.hpp):
//   - a killed producer either published its value (its one cell CAS happened) or did not;
//   - a killed consumer either took a value (its CAS happened; the value then dies with it) or
//     did not;
//   - the tail and head hints lag by at most one position, and any later push or pop moves them
//     on: the ring never stalls;
//   - no value is ever delivered twice, and no value appears that was not pushed.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "gpuq/common/job_ring.hpp"
#include "support/raw_ring.hpp"
#include "support/test_support.hpp"

namespace gpuq {
namespace {

using test::kMillisecond;
using test::kSecond;
using test::scaled;

// ---- Threads ------------------------------------------------------------------------------------

TEST_CASE("JobRing stress: 4 producers and 4 consumers on 7 cells, 2M operations") {
  constexpr uint32_t kCapacity = 7;
  constexpr uint32_t kProducers = 4;
  constexpr uint32_t kConsumers = 4;
  const auto per_producer = static_cast<uint32_t>(scaled(250'000));  // 2M pushes + pops in all
  const uint64_t total = uint64_t{kProducers} * per_producer;
  test::RingMemory mem(kCapacity);
  JobRing ring = JobRing::create(mem.get(), kCapacity);
  std::vector<std::atomic<uint8_t>> seen(total);
  std::atomic<uint64_t> popped{0};
  std::atomic<uint64_t> errors{0};  // foreign values and per-producer order violations
  std::atomic<bool> stop{false};
  const uint64_t deadline = monotonic_ns() + 200 * kSecond;

  test::Watchdog watchdog("stalled ring operation", 240 * kSecond);
  const uint64_t start = monotonic_ns();
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      for (uint32_t i = 0; i < per_producer; ++i) {
        while (!ring.try_push(p * per_producer + i)) {
          if (stop.load(std::memory_order_relaxed)) return;
          std::this_thread::yield();
        }
      }
    });
  }
  for (uint32_t c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&] {
      std::vector<int64_t> last(kProducers, -1);
      uint32_t idle = 0;
      while (popped.load(std::memory_order_relaxed) < total) {
        uint32_t v = 0;
        if (!ring.try_pop(&v)) {
          if ((++idle & 255) == 0 && monotonic_ns() > deadline) {
            stop.store(true);
            return;
          }
          std::this_thread::yield();
          continue;
        }
        if (v >= total) {
          errors.fetch_add(1);
          continue;
        }
        seen[v].fetch_add(1, std::memory_order_relaxed);
        popped.fetch_add(1, std::memory_order_relaxed);
        const uint32_t p = v / per_producer;
        const int64_t i = v % per_producer;
        if (i <= last[p]) errors.fetch_add(1);
        last[p] = i;
      }
    });
  }
  for (auto& t : threads) t.join();
  MESSAGE((2 * total) << " operations in " << (monotonic_ns() - start) / kMillisecond << " ms");

  CHECK_FALSE(stop.load());
  CHECK(popped.load() == total);
  CHECK(errors.load() == 0);
  uint64_t not_once = 0;
  for (uint64_t v = 0; v < total; ++v) {
    if (seen[v].load() != 1) ++not_once;
  }
  CHECK(not_once == 0);
  CHECK(ring.size() == 0);
}

// Every thread pushes one value, then pops one, over and over. At the instant of any pop the
// popping thread's own push is counted in the ring and its pop is not, so the ring holds at
// least one value: a linearizable ring never reports empty there. With as many cells as
// threads it never reports full either.
void run_push_pop_pairs(uint32_t threads_count, uint32_t capacity, uint32_t pairs,
                        bool full_allowed) {
  test::RingMemory mem(capacity);
  JobRing ring = JobRing::create(mem.get(), capacity);
  const uint64_t total = uint64_t{threads_count} * pairs;
  std::vector<std::atomic<uint8_t>> seen(total);
  std::atomic<uint64_t> false_empty{0}, false_full{0}, foreign{0};
  test::Watchdog watchdog("stalled ring operation", 120 * kSecond);

  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < threads_count; ++t) {
    threads.emplace_back([&, t] {
      for (uint32_t i = 0; i < pairs; ++i) {
        while (!ring.try_push(t * pairs + i)) {
          if (!full_allowed) false_full.fetch_add(1);
          std::this_thread::yield();
        }
        uint32_t v = 0;
        while (!ring.try_pop(&v)) false_empty.fetch_add(1);
        if (v < total) {
          seen[v].fetch_add(1, std::memory_order_relaxed);
        } else {
          foreign.fetch_add(1);
        }
      }
    });
  }
  for (auto& t : threads) t.join();

  CHECK(false_empty.load() == 0);
  CHECK(false_full.load() == 0);
  CHECK(foreign.load() == 0);
  uint64_t not_once = 0;
  for (uint64_t v = 0; v < total; ++v) {
    if (seen[v].load() != 1) ++not_once;
  }
  CHECK(not_once == 0);
  CHECK(ring.size() == 0);
}

TEST_CASE("JobRing stress: push/pop pairs never see a false empty or a false full") {
  const auto pairs = static_cast<uint32_t>(scaled(125'000));
  SUBCASE("8 threads, 7 cells (full is possible, a false empty is not)") {
    run_push_pop_pairs(8, 7, pairs, true);
  }
  SUBCASE("7 threads, 7 cells (neither full nor empty is possible)") {
    run_push_pop_pairs(7, 7, pairs, false);
  }
}

// ---- Processes killed at random moments
// ------------------------------------------------------------

constexpr uint32_t kSeqBits = 18;
constexpr uint32_t kMaxSeq = (1u << kSeqBits) - 1;
constexpr uint32_t kNotAttempting = UINT32_MAX;

// Written by a producer child, read by the parent after the child was killed.
struct ProducerRecord {
  std::atomic<uint32_t> attempting;  // seq being pushed, or kNotAttempting
  std::atomic<uint32_t> done;        // values 0..done-1 were pushed (try_push returned true)
};

// Where the children of one round keep their tallies (anonymous shared memory).
struct KillerShared {
  ProducerRecord* producers;
  std::atomic<uint8_t>* seen;      // [producer << kSeqBits | seq]: times popped
  std::atomic<uint64_t>* pops;     // total values popped by consumer children
  std::atomic<uint64_t>* foreign;  // values popped that no producer of this round pushed
};

uint32_t make_value(uint32_t round, uint32_t producers, uint32_t p, uint32_t seq) {
  // Distinct per round and producer; never kEmptyValue, nor the parent's own 0xFFF0xxxx values.
  return ((round * producers + p + 1) << kSeqBits) | seq;
}

[[noreturn]] void producer_child(JobRing ring, const KillerShared& s, uint32_t round,
                                 uint32_t producers, uint32_t p, uint64_t deadline) {
  ProducerRecord& rec = s.producers[p];
  for (uint32_t seq = 0; seq < kMaxSeq; ++seq) {
    rec.attempting.store(seq);
    const uint32_t v = make_value(round, producers, p, seq);
    for (uint32_t i = 1; !ring.try_push(v); ++i) {
      if ((i & 1023) == 0) {
        if (monotonic_ns() > deadline) ::_exit(3);  // stalled
        sched_yield();
      }
    }
    rec.done.store(seq + 1);
  }
  rec.attempting.store(kNotAttempting);
  while (monotonic_ns() < deadline) sched_yield();  // out of values: wait to be killed
  ::_exit(4);
}

[[noreturn]] void consumer_child(JobRing ring, const KillerShared& s, uint32_t round,
                                 uint32_t producers, uint64_t deadline) {
  for (uint32_t i = 1;; ++i) {
    uint32_t v = 0;
    if (ring.try_pop(&v)) {
      const uint32_t p = (v >> kSeqBits) - 1 - round * producers;
      if (p < producers) {
        s.seen[(p << kSeqBits) | (v & kMaxSeq)].fetch_add(1);
      } else {
        s.foreign->fetch_add(1);
      }
      s.pops->fetch_add(1);
    } else if ((i & 1023) == 0) {
      if (monotonic_ns() > deadline) ::_exit(3);  // stalled
      sched_yield();
    }
  }
}

TEST_CASE("JobRing stress: producers and consumers SIGKILLed at random moments") {
  const uint64_t seed = test::test_seed(test::fresh_seed());
  MESSAGE("seed " << seed << " (GPUQ_TEST_SEED replays it)");
  std::mt19937_64 rng(seed);
  constexpr uint32_t kCapacity = 5;
  constexpr uint32_t kProducers = 2;
  constexpr uint32_t kConsumers = 2;
  const auto rounds = static_cast<uint32_t>(std::max<uint64_t>(scaled(500), 25));

  test::SharedMemory ring_memory(JobRing::bytes_for(kCapacity));
  JobRing ring = JobRing::create(ring_memory.base(), kCapacity);
  test::RawRing raw(ring_memory.base());
  test::SharedMemory tally_memory((size_t{kProducers} << kSeqBits) + 4096);
  test::SharedArena arena(tally_memory);
  KillerShared shared{arena.make_array<ProducerRecord>(kProducers),
                      arena.make_array<std::atomic<uint8_t>>(size_t{kProducers} << kSeqBits),
                      arena.make_array<std::atomic<uint64_t>>(1),
                      arena.make_array<std::atomic<uint64_t>>(1)};

  uint64_t lagging_tails = 0, lagging_heads = 0, ambiguous_pushes = 0, ambiguous_landed = 0;
  uint64_t lost_pops = 0;
  uint64_t total_pushed = 0;
  const uint64_t start = monotonic_ns();
  for (uint32_t round = 0; round < rounds; ++round) {
    CAPTURE(round);
    // Arrange: fresh tallies; the ring carries over from the previous round.
    for (uint32_t p = 0; p < kProducers; ++p) {
      shared.producers[p].attempting.store(kNotAttempting);
      shared.producers[p].done.store(0);
    }
    for (size_t i = 0; i < (size_t{kProducers} << kSeqBits); ++i) {
      shared.seen[i].store(0, std::memory_order_relaxed);
    }
    shared.pops->store(0);
    shared.foreign->store(0);
    const uint64_t child_deadline = monotonic_ns() + 60 * kSecond;

    std::vector<pid_t> children;
    for (uint32_t p = 0; p < kProducers; ++p) {
      children.push_back(test::fork_child(
          [&]() -> int { producer_child(ring, shared, round, kProducers, p, child_deadline); }));
    }
    for (uint32_t c = 0; c < kConsumers; ++c) {
      children.push_back(test::fork_child(
          [&]() -> int { consumer_child(ring, shared, round, kProducers, child_deadline); }));
    }
    for (pid_t pid : children) REQUIRE(pid > 0);

    // Act: once values flow, kill every child at a random moment, in a random order.
    const bool flowing = test::wait_until([&] { return shared.pops->load() >= 200; }, 30 * kSecond);
    CHECK(flowing);
    std::shuffle(children.begin(), children.end(), rng);
    for (pid_t pid : children) {
      const uint64_t pause_ns = std::uniform_int_distribution<uint64_t>(0, 2 * kMillisecond)(rng);
      const timespec pause{0, static_cast<long>(pause_ns)};
      nanosleep(&pause, nullptr);  // a random moment to strike, not a wait for a state
      ::kill(pid, SIGKILL);
    }
    for (pid_t pid : children) {
      const test::ChildExit e = test::wait_child(pid, 30 * kSecond);
      INFO("child " << pid << ": " << e.describe());
      CHECK(e.reaped);
      CHECK(e.signal == SIGKILL);  // not exited by itself (3 = stalled past its deadline)
    }

    test::Watchdog watchdog("stalled ring operation after the kills", 30 * kSecond);
    // Assert 1: the ring as the dead left it is consistent, its hints at most one behind.
    const auto q = test::QuiescentRing::inspect(raw);
    CHECK(q.consistent);
    CHECK(q.tail_lag <= 1);
    CHECK(q.head_lag <= 1);
    lagging_tails += q.tail_lag;
    lagging_heads += q.head_lag;

    // Assert 2: draining finds exactly the values the cells hold, and nothing stalls.
    uint32_t drained = 0;
    for (uint32_t v = 0; ring.try_pop(&v) && drained <= kCapacity; ++drained) {
      const uint32_t p = (v >> kSeqBits) - 1 - round * kProducers;
      if (p < kProducers) {
        shared.seen[(p << kSeqBits) | (v & kMaxSeq)].fetch_add(1);
      } else {
        shared.foreign->fetch_add(1);
      }
    }
    CHECK(drained == q.values);
    CHECK(ring.size() == 0);

    // Assert 3: accounting. Every value pushed for sure was popped once, except at most one per
    // killed consumer (taken by its CAS, lost with it); a push cut short may or may not have
    // landed; nothing was delivered twice or invented.
    CHECK(shared.foreign->load() == 0);
    uint64_t duplicates = 0, missing = 0, phantom = 0;
    for (uint32_t p = 0; p < kProducers; ++p) {
      const uint32_t done = shared.producers[p].done.load();
      const bool in_flight = shared.producers[p].attempting.load() == done;
      total_pushed += done;
      for (uint32_t seq = 0; seq <= kMaxSeq; ++seq) {
        const uint8_t n = shared.seen[(p << kSeqBits) | seq].load();
        if (n > 1) ++duplicates;
        if (seq < done && n == 0) ++missing;
        if (seq == done && in_flight) {
          ++ambiguous_pushes;
          ambiguous_landed += n;
        } else if (seq >= done && n != 0) {
          ++phantom;
        }
      }
    }
    CHECK(duplicates == 0);
    CHECK(phantom == 0);
    CHECK(missing <= kConsumers);
    lost_pops += missing;

    // Assert 4: the survivor can fill the ring to exactly its capacity and empty it in order.
    for (uint32_t i = 0; i < kCapacity; ++i) CHECK(ring.try_push(0xFFF00000u | i));
    CHECK_FALSE(ring.try_push(0xFFF0FFFFu));
    CHECK(ring.size() == kCapacity);
    for (uint32_t i = 0; i < kCapacity; ++i) {
      uint32_t v = 0;
      CHECK(ring.try_pop(&v));
      CHECK(v == (0xFFF00000u | i));
    }
    uint32_t v = 0;
    CHECK_FALSE(ring.try_pop(&v));
  }
  MESSAGE(rounds << " rounds, " << total_pushed << " values pushed in "
                 << (monotonic_ns() - start) / kMillisecond << " ms; hints found lagging: tail "
                 << lagging_tails << ", head " << lagging_heads << "; pushes cut short "
                 << ambiguous_pushes << " (" << ambiguous_landed
                 << " landed); values lost with a killed consumer " << lost_pops);
}

}  // namespace
}  // namespace gpuq
