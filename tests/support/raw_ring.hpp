// Test access to a JobRing's memory: aligned storage for a ring, and a raw view of its documented
// layout (RingHeader, then `capacity` cells; a cell is {position:32 | value:32}) used to put a
// ring in the state a thread leaves behind when it dies between its cell CAS and its head/tail
// update, and to inspect a ring after processes were killed. Test-only code.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "gpuq/common/job_ring.hpp"
#include "gpuq/common/pool_queue.hpp"

namespace gpuq::test {

// 64-byte aligned, zero-filled heap memory for one ring, or for a pool's lanes (PoolQueue).
class RingMemory {
 public:
  explicit RingMemory(uint32_t capacity) : RingMemory(Bytes{JobRing::bytes_for(capacity)}) {}
  RingMemory(uint32_t capacity, uint32_t client_lanes)
      : RingMemory(Bytes{PoolQueue::bytes_for(capacity, client_lanes)}) {}
  struct Bytes {
    size_t n;
  };
  explicit RingMemory(Bytes bytes) : bytes_(bytes.n), memory_(std::aligned_alloc(64, bytes_)) {
    REQUIRE(memory_ != nullptr);
    std::memset(memory_.get(), 0, bytes_);
  }
  void* get() const noexcept { return memory_.get(); }

 private:
  struct Free {
    void operator()(void* p) const noexcept { std::free(p); }
  };
  size_t bytes_;
  std::unique_ptr<void, Free> memory_;
};

struct RawRing {
  explicit RawRing(void* memory)
      : header(static_cast<RingHeader*>(memory)),
        cells{reinterpret_cast<RingCell*>(static_cast<char*>(memory) + sizeof(RingHeader))} {}

  static constexpr uint64_t word(uint64_t pos, uint32_t value) { return (pos << 32) | value; }
  static constexpr uint32_t tag_of(uint64_t cell) { return static_cast<uint32_t>(cell >> 32); }
  static constexpr uint32_t value_of(uint64_t cell) { return static_cast<uint32_t>(cell); }
  static constexpr uint32_t tag(uint64_t pos) { return static_cast<uint32_t>(pos); }

  uint32_t capacity() const { return header->capacity; }
  std::atomic<uint64_t>& cell(uint64_t pos) const { return cells[pos % header->capacity]; }

  // What a producer does at the first position still awaiting a value: it helps the tail up to
  // that position (as try_push does), CASes the cell, and dies before advancing the tail. The
  // tail hint never lags by more than one, so at most one position is skipped. Returns the
  // position filled.
  uint64_t producer_dies_after_cas(uint32_t value) const {
    uint64_t pos = header->tail.load();
    if (cell(pos).load() != word(pos, JobRing::kEmptyValue)) ++pos;
    REQUIRE(cell(pos).load() == word(pos, JobRing::kEmptyValue));  // not full
    header->tail.store(pos);
    cell(pos).store(word(pos, value));
    return pos;
  }

  // The same for a consumer: helps the head to the oldest value, takes it with its CAS (which
  // re-arms the cell for the next lap), and dies before advancing the head. Returns the value.
  uint32_t consumer_dies_after_cas() const {
    uint64_t pos = header->head.load();
    if (tag_of(cell(pos).load()) != tag(pos)) ++pos;
    const uint64_t old = cell(pos).load();
    REQUIRE(tag_of(old) == tag(pos));
    REQUIRE(value_of(old) != JobRing::kEmptyValue);  // not empty
    header->head.store(pos);
    cell(pos).store(word(pos + header->capacity, JobRing::kEmptyValue));
    return value_of(old);
  }

  // The cells by index: cells[i] is cell i's word (each cell has a cache line of its own).
  struct Cells {
    RingCell* base;
    std::atomic<uint64_t>& operator[](size_t i) const { return base[i].word; }
  };

  RingHeader* header;
  Cells cells;
};

// The state of a quiescent ring (no thread inside try_push/try_pop, e.g. after every other
// process was killed), recovered from its cells: the true next push and pop positions, and how
// far the tail and head hints lag behind them.
struct QuiescentRing {
  uint64_t tail = 0;  // next position to fill
  uint64_t head = 0;  // next position to take
  uint64_t tail_lag = 0;
  uint64_t head_lag = 0;
  uint32_t values = 0;  // cells holding a value
  bool consistent = false;

  static QuiescentRing inspect(const RawRing& raw) {
    QuiescentRing q;
    const uint32_t cap = raw.capacity();
    const uint64_t t = raw.header->tail.load();
    const uint64_t h = raw.header->head.load();
    // The tail hint is exact if its cell awaits it or still holds the value of one lap ago
    // (full); otherwise the position was filled by a producer that did not advance the tail.
    auto tail_exact = [&](uint64_t pos) {
      const uint64_t c = raw.cell(pos).load();
      return c == RawRing::word(pos, JobRing::kEmptyValue) ||
             (RawRing::tag_of(c) == RawRing::tag(pos - cap) &&
              RawRing::value_of(c) != JobRing::kEmptyValue);
    };
    // The head hint is exact if its cell holds the value for it or awaits its producer (empty).
    auto head_exact = [&](uint64_t pos) {
      return RawRing::tag_of(raw.cell(pos).load()) == RawRing::tag(pos);
    };
    q.tail = t;
    while (!tail_exact(q.tail) && q.tail - t <= cap) ++q.tail;
    q.head = h;
    while (!head_exact(q.head) && q.head - h <= cap) ++q.head;
    q.tail_lag = q.tail - t;
    q.head_lag = q.head - h;
    for (uint32_t i = 0; i < cap; ++i) {
      if (RawRing::value_of(raw.cells[i].load()) != JobRing::kEmptyValue) ++q.values;
    }
    q.consistent = tail_exact(q.tail) && head_exact(q.head) && q.head <= q.tail &&
                   q.tail - q.head <= cap && q.tail - q.head == q.values;
    return q;
  }
};

}  // namespace gpuq::test
