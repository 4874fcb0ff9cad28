// Unit tests of JobRing (common/include/gpuq/common/job_ring.hpp) within one process: exact
// capacity, FIFO order, wrap-around, multi-threaded exactly-once delivery, and recovery from a
// thread that stopped between its cell CAS and its head/tail update.
#include "gpuq/common/job_ring.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "support/raw_ring.hpp"
#include "support/test_support.hpp"

namespace gpuq {
namespace {

using test::RawRing;
using test::RingMemory;
using test::scaled;

// Lays out a ring whose head and tail both start at `start` (to test positions far from 0).
JobRing create_at_position(void* memory, uint32_t capacity, uint64_t start) {
  JobRing ring = JobRing::create(memory, capacity);
  RawRing raw(memory);
  raw.header->head.store(start);
  raw.header->tail.store(start);
  for (uint64_t p = start; p < start + capacity; ++p) {
    raw.cell(p).store(RawRing::word(p, JobRing::kEmptyValue));
  }
  return ring;
}

constexpr uint32_t kOddCapacities[] = {1, 3, 20, 160};

TEST_CASE("JobRing::bytes_for covers the header and every cell, one cache line per cell") {
  for (uint32_t cap : {1u, 3u, 7u, 8u, 20u, 160u, JobRing::kMaxCapacity}) {
    CAPTURE(cap);
    const size_t bytes = JobRing::bytes_for(cap);
    CHECK(bytes % 64 == 0);
    CHECK(bytes == sizeof(RingHeader) + size_t{cap} * 64);  // one cache line per cell
  }
}

TEST_CASE("JobRing accepts exactly `capacity` values, then reports full") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  for (uint32_t cap : kOddCapacities) {
    CAPTURE(cap);
    RingMemory mem(cap);
    JobRing ring = JobRing::create(mem.get(), cap);
    REQUIRE(ring.capacity() == cap);
    CHECK(ring.size() == 0);
    CHECK_FALSE(ring.has_values());

    for (uint32_t i = 0; i < cap; ++i) {
      REQUIRE(ring.try_push(1000 + i));
      CHECK(ring.size() == i + 1);
    }
    CHECK_FALSE(ring.try_push(99));
    CHECK_FALSE(ring.try_push(99));
    CHECK(ring.size() == cap);
    CHECK(ring.has_values());
  }
}

TEST_CASE("JobRing pops in FIFO order and reports empty") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  for (uint32_t cap : kOddCapacities) {
    CAPTURE(cap);
    RingMemory mem(cap);
    JobRing ring = JobRing::create(mem.get(), cap);
    for (uint32_t i = 0; i < cap; ++i) REQUIRE(ring.try_push(7 * i));

    for (uint32_t i = 0; i < cap; ++i) {
      uint32_t v = 0;
      REQUIRE(ring.try_pop(&v));
      CHECK(v == 7 * i);
      CHECK(ring.size() == cap - i - 1);
    }
    uint32_t v = 12345;
    CHECK_FALSE(ring.try_pop(&v));
    CHECK(v == 12345);  // untouched on failure
    CHECK(ring.size() == 0);
  }
}

TEST_CASE("JobRing carries the whole 32-bit value range except kEmptyValue") {
  RingMemory mem(3);
  JobRing ring = JobRing::create(mem.get(), 3);
  const uint32_t values[] = {0u, JobRing::kEmptyValue - 1, 0x80000000u};
  for (uint32_t v : values) REQUIRE(ring.try_push(v));

  for (uint32_t expected : values) {
    uint32_t v = 1;
    REQUIRE(ring.try_pop(&v));
    CHECK(v == expected);
  }
}

TEST_CASE("JobRing keeps FIFO order and exact size over many laps (model check)") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  const uint64_t seed = test::test_seed(0x5EED0001);
  MESSAGE("seed " << seed << " (GPUQ_TEST_SEED replays it)");
  for (uint32_t cap : kOddCapacities) {
    CAPTURE(cap);
    RingMemory mem(cap);
    JobRing ring = JobRing::create(mem.get(), cap);
    std::deque<uint32_t> model;
    std::mt19937_64 rng(seed + cap);
    uint32_t next = 0;
    // Bias towards pushing for a while, then popping, so the fill level sweeps the whole range
    // and the positions run through many laps of the cells.
    const uint64_t ops = 200'000;  // single-threaded and cheap: not scaled down
    uint64_t mismatches = 0;
    for (uint64_t i = 0; i < ops; ++i) {
      const bool push_phase = (i / (4 * cap + 3)) % 2 == 0;
      const bool push = std::uniform_int_distribution<int>(0, 99)(rng) < (push_phase ? 70 : 30);
      if (push) {
        const bool ok = ring.try_push(next);
        if (ok != (model.size() < cap)) ++mismatches;
        if (ok) model.push_back(next++);
      } else {
        uint32_t v = 0;
        const bool ok = ring.try_pop(&v);
        if (ok != !model.empty()) ++mismatches;
        if (ok) {
          if (v != model.front()) ++mismatches;
          model.pop_front();
        }
      }
      if (ring.size() != model.size()) ++mismatches;
    }
    CHECK(mismatches == 0);
    CHECK(next / cap > 100);  // many laps
  }
}

TEST_CASE("JobRing works across the 32-bit wrap of the position tags") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  for (uint32_t cap : kOddCapacities) {
    CAPTURE(cap);
    RingMemory mem(cap);
    // Start a few laps below 2^32 so the tags (low 32 bits of positions) wrap during the test.
    JobRing ring = create_at_position(mem.get(), cap, (uint64_t{1} << 32) - 2 * cap - 1);
    uint32_t next = 0;
    uint32_t expected = 0;
    for (int lap = 0; lap < 6; ++lap) {
      for (uint32_t i = 0; i < cap; ++i) REQUIRE(ring.try_push(next++));
      CHECK_FALSE(ring.try_push(next));
      CHECK(ring.size() == cap);
      for (uint32_t i = 0; i < cap; ++i) {
        uint32_t v = 0;
        REQUIRE(ring.try_pop(&v));
        CHECK(v == expected++);
      }
      uint32_t v = 0;
      CHECK_FALSE(ring.try_pop(&v));
    }
  }
}

TEST_CASE("JobRing views of the same memory share one ring") {
  RingMemory mem(20);
  JobRing creator = JobRing::create(mem.get(), 20);
  JobRing other(mem.get());
  REQUIRE(other.capacity() == 20);

  REQUIRE(creator.try_push(5));
  REQUIRE(other.try_push(6));
  uint32_t a = 0, b = 0;
  REQUIRE(other.try_pop(&a));
  REQUIRE(creator.try_pop(&b));

  CHECK(a == 5);
  CHECK(b == 6);
}

TEST_CASE("JobRing::for_each_value visits exactly the values present") {
  RingMemory mem(20);
  JobRing ring = JobRing::create(mem.get(), 20);
  for (uint32_t v = 0; v < 15; ++v) REQUIRE(ring.try_push(v));
  for (int i = 0; i < 10; ++i) {
    uint32_t v;
    REQUIRE(ring.try_pop(&v));
  }
  for (uint32_t v = 15; v < 25; ++v) REQUIRE(ring.try_push(v));  // wraps into the first cells

  std::vector<bool> seen(25, false);
  uint32_t count = 0;
  ring.for_each_value([&](uint32_t v) {
    ++count;
    if (v < seen.size()) seen[v] = true;
  });

  CHECK(count == 15);
  for (uint32_t v = 0; v < 25; ++v) {
    CAPTURE(v);
    CHECK(seen[v] == (v >= 10));
  }
}

// ---- Many threads -------------------------------------------------------------------------------

struct MpmcResult {
  uint64_t duplicates = 0;     // values popped more than once
  uint64_t missing = 0;        // values pushed but never popped
  uint64_t out_of_order = 0;   // one consumer saw one producer's values out of order
  uint64_t bad_payload = 0;    // a consumer did not see the data written before the push
  uint64_t overfull = 0;       // the counters proved more than `capacity` values in the ring
  uint64_t size_over_cap = 0;  // size() returned more than the capacity
  uint64_t observations = 0;   // size() samples taken by the observer
  bool finished_in_time = true;
};

// `producers` threads each push `per_producer` unique values (producer p pushes p * per_producer
// + i, in order); `consumers` threads pop until every value has been taken. Checks exactly-once
// delivery, per-producer order as seen by each consumer (FIFO), publication of plain data, and
// the capacity bound in two ways: an observer thread samples size() (the estimate callers see),
// and every push and pop updates one packed counter word {completed pushes:32 | started pops -
// failed pops:32} whose difference, read at any single instant, is at most the ring's true
// occupancy and so at most its capacity (a ring that let one value too many in could show it).
MpmcResult run_mpmc(uint32_t capacity, uint32_t producers, uint32_t consumers,
                    uint32_t per_producer) {
  RingMemory mem(capacity);
  JobRing ring = JobRing::create(mem.get(), capacity);
  const uint64_t total = uint64_t{producers} * per_producer;
  std::vector<std::atomic<uint8_t>> seen(total);
  // Plain (non-atomic) data written before a push and read after the pop, as a job slot is:
  // the ring's cell CAS must order it (ThreadSanitizer reports a race otherwise).
  std::vector<uint32_t> payload(total, 0);
  std::atomic<uint64_t> bad_payload{0};
  std::atomic<uint64_t> popped{0};
  std::atomic<uint64_t> counters{0};  // {pushes:32 | pops:32}
  std::atomic<uint64_t> overfull{0};
  std::atomic<uint64_t> out_of_order{0};
  std::atomic<bool> stop{false};
  const uint64_t deadline = monotonic_ns() + 60 * test::kSecond;

  auto over_capacity = [capacity](uint64_t word) {
    const auto pushes = static_cast<int64_t>(word >> 32);
    const auto pops = static_cast<int64_t>(word & 0xFFFFFFFFu);
    return pushes - pops > static_cast<int64_t>(capacity);
  };

  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back([&, p] {
      for (uint32_t i = 0; i < per_producer && !stop.load(std::memory_order_relaxed); ++i) {
        const uint32_t value = p * per_producer + i;
        payload[value] = value ^ 0xA5A5A5A5u;
        while (!ring.try_push(value)) {
          if (stop.load(std::memory_order_relaxed)) return;
          std::this_thread::yield();
        }
        const uint64_t w = counters.fetch_add(uint64_t{1} << 32) + (uint64_t{1} << 32);
        if (over_capacity(w)) overfull.fetch_add(1);
      }
    });
  }
  for (uint32_t c = 0; c < consumers; ++c) {
    threads.emplace_back([&] {
      std::vector<int64_t> last(producers, -1);
      while (popped.load(std::memory_order_relaxed) < total) {
        if (stop.load(std::memory_order_relaxed)) return;
        counters.fetch_add(1);  // a pop is starting
        uint32_t v = 0;
        if (!ring.try_pop(&v)) {
          counters.fetch_sub(1);
          std::this_thread::yield();
          continue;
        }
        if (v >= total) {
          overfull.fetch_add(1000000);  // a value never pushed: corrupt
          continue;
        }
        if (payload[v] != (v ^ 0xA5A5A5A5u)) bad_payload.fetch_add(1);
        seen[v].fetch_add(1);
        popped.fetch_add(1);
        const uint32_t p = v / per_producer;
        const int64_t i = v % per_producer;
        if (i <= last[p]) out_of_order.fetch_add(1);
        last[p] = i;
      }
    });
  }

  MpmcResult r;
  test::Watchdog watchdog("stalled ring operation", 90 * test::kSecond);
  std::thread observer([&] {
    do {
      if (ring.size() > capacity) ++r.size_over_cap;
      if (over_capacity(counters.load())) overfull.fetch_add(1);
      ++r.observations;
      if (monotonic_ns() > deadline) {
        r.finished_in_time = false;
        stop.store(true);
      }
      std::this_thread::yield();
    } while (popped.load(std::memory_order_relaxed) < total && !stop.load());
  });
  for (auto& t : threads) t.join();
  observer.join();

  for (uint64_t v = 0; v < total; ++v) {
    const uint8_t n = seen[v].load();
    if (n == 0) ++r.missing;
    if (n > 1) ++r.duplicates;
  }
  r.overfull = overfull.load();
  r.bad_payload = bad_payload.load();
  r.out_of_order = out_of_order.load();
  uint32_t v = 0;
  if (ring.try_pop(&v)) ++r.duplicates;  // nothing may be left over
  return r;
}

void check_mpmc(const MpmcResult& r) {
  CHECK(r.finished_in_time);
  CHECK(r.missing == 0);
  CHECK(r.duplicates == 0);
  CHECK(r.out_of_order == 0);
  CHECK(r.bad_payload == 0);
  CHECK(r.overfull == 0);
  CHECK(r.size_over_cap == 0);
  CHECK(r.observations > 0);
}

TEST_CASE("JobRing delivers every value exactly once with 4 producers and 4 consumers") {
  const auto per_producer = static_cast<uint32_t>(scaled(200'000));
  SUBCASE("capacity 20") {
    check_mpmc(run_mpmc(20, 4, 4, per_producer));
  }
  SUBCASE("capacity 3") {
    check_mpmc(run_mpmc(3, 4, 4, per_producer / 4));
  }
  SUBCASE("capacity 1") {
    check_mpmc(run_mpmc(1, 4, 4, per_producer / 20));
  }
}

TEST_CASE("JobRing delivers every value exactly once with uneven thread counts") {
  const auto n = static_cast<uint32_t>(scaled(50'000));
  SUBCASE("1 producer, 3 consumers") {
    check_mpmc(run_mpmc(160, 1, 3, n));
  }
  SUBCASE("3 producers, 1 consumer") {
    check_mpmc(run_mpmc(160, 3, 1, n));
  }
}

TEST_CASE("JobRing never reports empty to a thread whose own push is still in the ring") {
  // Each thread pushes one value and then pops one. When a thread pops, its own push is counted
  // in the ring and its pop is not, so the ring is not empty: a linearizable try_pop succeeds.
  // With as many cells as threads, try_push can never find the ring full either.
  constexpr uint32_t kThreads = 4;
  RingMemory mem(kThreads);
  JobRing ring = JobRing::create(mem.get(), kThreads);
  const auto pairs = static_cast<uint32_t>(scaled(50'000));
  std::atomic<uint64_t> false_empty{0}, false_full{0}, popped{0};
  test::Watchdog watchdog("stalled ring operation", 60 * test::kSecond);

  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (uint32_t i = 0; i < pairs; ++i) {
        while (!ring.try_push(t * pairs + i)) false_full.fetch_add(1);
        uint32_t v = 0;
        while (!ring.try_pop(&v)) false_empty.fetch_add(1);
        popped.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();

  CHECK(false_empty.load() == 0);
  CHECK(false_full.load() == 0);
  CHECK(popped.load() == uint64_t{kThreads} * pairs);
  CHECK(ring.size() == 0);
}

// ---- A thread that stops between its cell CAS and its tail/head update ----------------------

TEST_CASE("JobRing: a producer that died after its CAS leaves a value that is delivered") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  for (uint32_t cap : {1u, 3u, 20u}) {
    CAPTURE(cap);
    RingMemory mem(cap);
    JobRing ring = JobRing::create(mem.get(), cap);
    RawRing raw(mem.get());
    // Put the positions mid-lap so the dead producer's cell is not cell 0.
    for (uint32_t i = 0; i < cap + 1; ++i) {
      uint32_t v;
      REQUIRE(ring.try_push(i));
      REQUIRE(ring.try_pop(&v));
    }

    const uint64_t dead_pos = raw.producer_dies_after_cas(777);
    REQUIRE(raw.header->tail.load() == dead_pos);  // the tail lags behind the published cell

    // The next push helps the tail past the dead producer's cell, then appends after it.
    if (cap > 1) {
      REQUIRE(ring.try_push(778));
      CHECK(raw.header->tail.load() == dead_pos + 2);
      CHECK(ring.size() == 2);
    } else {
      CHECK_FALSE(ring.try_push(778));  // the dead producer's value fills the only cell
      CHECK(raw.header->tail.load() == dead_pos + 1);
      CHECK(ring.size() == 1);
    }

    uint32_t v = 0;
    REQUIRE(ring.try_pop(&v));
    CHECK(v == 777);
    if (cap > 1) {
      REQUIRE(ring.try_pop(&v));
      CHECK(v == 778);
    }
    CHECK_FALSE(ring.try_pop(&v));
    CHECK(ring.size() == 0);
  }
}

TEST_CASE("JobRing: a consumer can take a dead producer's value before the tail is helped") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  RingMemory mem(20);
  JobRing ring = JobRing::create(mem.get(), 20);
  RawRing raw(mem.get());
  REQUIRE(ring.try_push(1));

  const uint64_t dead_pos = raw.producer_dies_after_cas(2);
  uint32_t a = 0, b = 0, c = 0;
  REQUIRE(ring.try_pop(&a));
  REQUIRE(ring.try_pop(&b));  // the head moves past the lagging tail
  CHECK(raw.header->tail.load() == dead_pos);
  CHECK(ring.size() == 0);  // tail <= head reads as empty, never as a huge size
  CHECK_FALSE(ring.try_pop(&c));

  REQUIRE(ring.try_push(3));  // helps the tail over the consumed cell, then pushes
  REQUIRE(ring.try_pop(&c));

  CHECK(a == 1);
  CHECK(b == 2);
  CHECK(c == 3);
  CHECK(raw.header->tail.load() == raw.header->head.load());
}

TEST_CASE("JobRing: a producer that died after filling the last free cell leaves the ring full") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  const uint32_t cap = 3;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  for (uint32_t i = 0; i < cap - 1; ++i) REQUIRE(ring.try_push(i));
  raw.producer_dies_after_cas(cap - 1);
  CHECK(ring.size() == cap - 1);  // the tail hint lags

  CHECK_FALSE(ring.try_push(100));  // full: helps the tail, finds the next cell occupied
  CHECK(ring.size() == cap);

  for (uint32_t i = 0; i < cap; ++i) {
    uint32_t v = 0;
    REQUIRE(ring.try_pop(&v));
    CHECK(v == i);
  }
}

TEST_CASE("JobRing: a consumer that died after its CAS frees its cell and does not stall") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  for (uint32_t cap : {1u, 3u, 20u}) {
    CAPTURE(cap);
    RingMemory mem(cap);
    JobRing ring = JobRing::create(mem.get(), cap);
    RawRing raw(mem.get());
    for (uint32_t i = 0; i < cap; ++i) REQUIRE(ring.try_push(i));  // full
    REQUIRE_FALSE(ring.try_push(999));

    const uint64_t dead_pos = raw.header->head.load();
    const uint32_t lost = raw.consumer_dies_after_cas();
    CHECK(lost == 0);  // the dead consumer took the oldest value
    REQUIRE(raw.header->head.load() == dead_pos);

    // Its cell is free again: a push fits although the head hint still says "full".
    REQUIRE(ring.try_push(cap));
    CHECK_FALSE(ring.try_push(999));
    // The next pop helps the head past the dead consumer's cell and gets the next value.
    for (uint32_t i = 1; i <= cap; ++i) {
      uint32_t v = 0;
      REQUIRE(ring.try_pop(&v));
      CHECK(v == i);
    }
    uint32_t v = 0;
    CHECK_FALSE(ring.try_pop(&v));
    CHECK(raw.header->head.load() == dead_pos + cap + 1);
    CHECK(ring.size() == 0);
  }
}

TEST_CASE("JobRing::settled_tail moves the tail hint past a dead producer's cell") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  const uint32_t cap = 3;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  REQUIRE(ring.try_push(1));
  CHECK(ring.settled_tail() == 1);  // nothing to settle

  const uint64_t dead_pos = raw.producer_dies_after_cas(2);
  CHECK(ring.tail_position() == dead_pos);
  CHECK(ring.settled_tail() == dead_pos + 1);
  CHECK(ring.tail_position() == dead_pos + 1);

  raw.producer_dies_after_cas(3);     // fills the last free cell
  CHECK(ring.settled_tail() == cap);  // stops at the cell still holding the first value
  uint32_t v = 0;
  REQUIRE(ring.try_pop(&v));
  CHECK(v == 1);
  CHECK(ring.head_position() == 1);
  CHECK(ring.size() == cap - 1);
}

TEST_CASE("JobRing: dead producers and consumers on every cell of a lap never stall the ring") {
  test::Watchdog watchdog("stalled ring operation", 30 * test::kSecond);
  const uint32_t cap = 7;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  uint32_t next = 0;
  uint32_t expected = 0;

  for (uint32_t round = 0; round < 3 * cap; ++round) {
    CAPTURE(round);
    // All pushes but one are made by producers that die after their CAS, all pops but one by
    // consumers that die after theirs; the live push and pop (at a different place each round)
    // must find their way past every lagging hint.
    const uint32_t live = round % cap;
    for (uint32_t i = 0; i < cap; ++i) {
      if (i == live) {
        REQUIRE(ring.try_push(next++));
      } else {
        raw.producer_dies_after_cas(next++);
      }
    }
    CHECK_FALSE(ring.try_push(999));
    for (uint32_t i = 0; i < cap; ++i) {
      if (i == live) {
        uint32_t v = 0;
        REQUIRE(ring.try_pop(&v));
        CHECK(v == expected++);
      } else {
        CHECK(raw.consumer_dies_after_cas() == expected++);
      }
    }
    uint32_t v = 0;
    CHECK_FALSE(ring.try_pop(&v));
  }
}

// ---- Audit: find_suspects and retire ---------------------------------------------------------

// A ring driven one step at a time against a FIFO model: push, push by a producer that dies
// after its CAS (the tail hint left behind), pop, pop by a consumer that dies after its CAS
// (the head hint left behind); a step that would overfill or underflow the ring does nothing,
// and so does any other `pick`.
class RingModel {
 public:
  RingModel(JobRing& ring, void* memory) : ring_(ring), raw_(memory) {}

  void step(uint32_t pick) {
    const bool room = values_.size() < ring_.capacity();
    if (pick == 0 && room) {
      REQUIRE(ring_.try_push(next_));
      values_.push_back(next_++);
    } else if (pick == 1 && room) {
      raw_.producer_dies_after_cas(next_);
      values_.push_back(next_++);
    } else if (pick == 2 && !values_.empty()) {
      uint32_t v = 0;
      REQUIRE(ring_.try_pop(&v));
      CHECK(v == values_.front());
      values_.pop_front();
    } else if (pick == 3 && !values_.empty()) {
      CHECK(raw_.consumer_dies_after_cas() == values_.front());
      values_.pop_front();
    }
  }

  // Pops every value the model holds, checking their order, and then that the ring is empty.
  void drain() {
    for (uint32_t want : values_) {
      uint32_t v = 0;
      REQUIRE(ring_.try_pop(&v));
      CHECK(v == want);
    }
    values_.clear();
    uint32_t v = 0;
    CHECK_FALSE(ring_.try_pop(&v));
  }

 private:
  JobRing& ring_;
  RawRing raw_;
  std::deque<uint32_t> values_;
  uint32_t next_ = 0;
};

std::vector<JobRing::Suspect> suspects(const JobRing& ring) {
  std::vector<JobRing::Suspect> out;
  ring.find_suspects(&out);
  return out;
}

TEST_CASE(
    "JobRing::find_suspects finds nothing in a sound ring, dead producers and consumers too") {
  for (uint32_t cap : kOddCapacities) {
    CAPTURE(cap);
    RingMemory mem(cap);
    JobRing ring = create_at_position(mem.get(), cap, (uint64_t{1} << 32) - 2 * cap);
    RingModel model(ring, mem.get());
    std::mt19937 rng(cap);
    for (int step = 0; step < 4000; ++step) {
      CAPTURE(step);
      model.step(rng() % 4);
      const auto found = suspects(ring);
      REQUIRE_MESSAGE(found.empty(), "cell " << found.front().index << " position "
                                             << found.front().position << " word " << std::hex
                                             << found.front().word);
    }
  }
}

TEST_CASE("JobRing: an overwritten cell at the head stalls consumers until it is retired") {
  const uint32_t cap = 8;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  for (uint32_t v = 0; v < 5; ++v) REQUIRE(ring.try_push(v));
  // A word with a tag from long ago where value 0 was.
  const uint64_t head = raw.header->head.load();
  raw.cell(head).store(RawRing::word(head + 0x80000000ull, 1234));
  uint32_t v = 0;
  CHECK_FALSE(ring.try_pop(&v));  // four values behind it, and consumers see none
  CHECK(ring.size() == 5);

  const auto found = suspects(ring);
  REQUIRE(found.size() == 1);
  CHECK(found[0].position == head);
  CHECK(ring.retire(found[0]));
  CHECK_FALSE(ring.retire(found[0]));  // the word is no longer there
  for (uint32_t want = 1; want < 5; ++want) {
    REQUIRE(ring.try_pop(&v));
    CHECK(v == want);
  }
  CHECK_FALSE(ring.try_pop(&v));
  CHECK(suspects(ring).empty());
  // And the retired cell takes values again on the next lap.
  for (uint32_t i = 0; i < cap; ++i) REQUIRE(ring.try_push(100 + i));
  CHECK_FALSE(ring.try_push(999));
  for (uint32_t i = 0; i < cap; ++i) {
    REQUIRE(ring.try_pop(&v));
    CHECK(v == 100 + i);
  }
}

TEST_CASE("JobRing: an overwritten cell at the tail stalls producers until it is retired") {
  const uint32_t cap = 8;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  for (uint32_t v = 0; v < 3; ++v) REQUIRE(ring.try_push(v));
  const uint64_t tail = raw.header->tail.load();
  // "Full" as producers read it (the value of a lap ago), though the head is far past that lap.
  raw.cell(tail).store(RawRing::word(tail - cap, 4321));
  CHECK_FALSE(ring.try_push(3));
  const auto found = suspects(ring);
  REQUIRE(found.size() == 1);
  CHECK(found[0].position == tail);
  REQUIRE(ring.retire(found[0]));
  REQUIRE(ring.try_push(3));
  uint32_t v = 0;
  for (uint32_t want = 0; want < 4; ++want) {
    REQUIRE(ring.try_pop(&v));
    CHECK(v == want);
  }
  CHECK_FALSE(ring.try_pop(&v));
}

TEST_CASE("JobRing: a wiped value at the head is a suspect once the tail has passed it") {
  const uint32_t cap = 4;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  CHECK(suspects(ring).empty());  // an empty ring's head cell awaits its value: sound
  REQUIRE(ring.try_push(7));
  REQUIRE(ring.try_push(8));
  const uint64_t head = raw.header->head.load();
  raw.cell(head).store(RawRing::word(head, JobRing::kEmptyValue));
  uint32_t v = 0;
  CHECK_FALSE(ring.try_pop(&v));  // consumers take the wiped cell for one awaiting its producer
  const auto found = suspects(ring);
  REQUIRE(found.size() == 1);
  REQUIRE(ring.retire(found[0]));
  REQUIRE(ring.try_pop(&v));
  CHECK(v == 8);
}

TEST_CASE("JobRing: a cell far ahead is a suspect; a changed word is not retired") {
  const uint32_t cap = 5;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  raw.cell(3).store(RawRing::word(3 + 10 * cap, JobRing::kEmptyValue));  // ten laps ahead
  auto found = suspects(ring);
  REQUIRE(found.size() == 1);
  CHECK(found[0].index == 3);
  raw.cell(3).store(RawRing::word(3 + 11 * cap, JobRing::kEmptyValue));
  CHECK_FALSE(ring.retire(found[0]));
  found = suspects(ring);
  REQUIRE(found.size() == 1);
  REQUIRE(ring.retire(found[0]));
  CHECK(suspects(ring).empty());
  for (uint32_t i = 0; i < 3 * cap; ++i) {
    uint32_t v = 0;
    REQUIRE(ring.try_push(i));
    REQUIRE(ring.try_pop(&v));
    CHECK(v == i);
  }
}

TEST_CASE("RingAudit on a sound ring retires nothing and loses nothing, dead threads too") {
  for (uint32_t cap : kOddCapacities) {
    CAPTURE(cap);
    RingMemory mem(cap);
    JobRing ring = JobRing::create(mem.get(), cap);
    RingModel model(ring, mem.get());
    RingAudit audit;
    std::mt19937 rng(cap * 7 + 1);
    for (int step = 0; step < 4000; ++step) {
      CAPTURE(step);
      model.step(rng() % 5);  // 4: a step that does nothing
      // Twice, as consecutive audits of a ring nobody touched in between.
      for (int run = 0; run < 2; ++run) {
        const RingAudit::Report r = audit.run(ring);
        REQUIRE(r.retired.empty());
      }
      CHECK(ring.size() <= cap);
    }
    // Whatever hints the audit moved back, every value is still there, in order.
    model.drain();
  }
}

TEST_CASE("RingAudit moves back a head or tail that jumped, and the ring serves again") {
  const uint32_t cap = 6;
  for (int which = 0; which < 4; ++which) {
    CAPTURE(which);
    RingMemory mem(cap);
    JobRing ring = JobRing::create(mem.get(), cap);
    RawRing raw(mem.get());
    RingAudit audit;
    uint32_t next = 0;
    for (int i = 0; i < 20; ++i) {  // a few laps, then three values queued
      uint32_t v = 0;
      REQUIRE(ring.try_push(next++));
      REQUIRE(ring.try_pop(&v));
    }
    for (int i = 0; i < 3; ++i) REQUIRE(ring.try_push(next++));
    CHECK(audit.run(ring).retired.empty());
    const uint64_t head = raw.header->head.load(), tail = raw.header->tail.load();
    switch (which) {
      case 0:
        raw.header->head.store(0x9e3779b97f4a7c15ull);  // anywhere
        break;
      case 1:
        raw.header->tail.store(0x9e3779b97f4a7c15ull);
        break;
      case 2:
        raw.header->tail.store(tail + cap + 2);  // past a lap: producers read "full" forever
        break;
      default:
        raw.header->head.store(head - 40);  // far back: harmless, and left alone
        break;
    }
    RingAudit::Report r = audit.run(ring);
    if (which == 2) {
      CHECK_FALSE(r.tail_restored);  // once could be a lagging head; twice is not
      r = audit.run(ring);
    }
    CHECK(r.head_restored == (which == 0 || which == 3));
    CHECK(r.tail_restored == (which == 1 || which == 2));
    CHECK(raw.header->head.load() <= head);
    CHECK(raw.header->tail.load() <= tail);
    // Every queued value comes out in order, and the ring takes a full lap again.
    for (uint32_t want = next - 3; want < next; ++want) {
      uint32_t v = 0;
      REQUIRE(ring.try_pop(&v));
      CHECK(v == want);
    }
    for (uint32_t i = 0; i < cap; ++i) REQUIRE(ring.try_push(100 + i));
    CHECK_FALSE(ring.try_push(999));
    for (uint32_t i = 0; i < cap; ++i) {
      uint32_t v = 0;
      REQUIRE(ring.try_pop(&v));
      CHECK(v == 100 + i);
    }
    CHECK(audit.run(ring).retired.empty());
  }
}

TEST_CASE("RingAudit retires an overwritten cell on its second look, not its first") {
  const uint32_t cap = 8;
  RingMemory mem(cap);
  JobRing ring = JobRing::create(mem.get(), cap);
  RawRing raw(mem.get());
  RingAudit audit;
  for (uint32_t v = 0; v < 4; ++v) REQUIRE(ring.try_push(v));
  const uint64_t head = raw.header->head.load();
  raw.cell(head).store(RawRing::word(head - 3 * cap, 55));
  CHECK(audit.run(ring).retired.empty());
  const RingAudit::Report r = audit.run(ring);
  REQUIRE(r.retired.size() == 1);
  CHECK(r.retired[0].position == head);
  for (uint32_t want = 1; want < 4; ++want) {
    uint32_t v = 0;
    REQUIRE(ring.try_pop(&v));
    CHECK(v == want);
  }
}

}  // namespace
}  // namespace gpuq
