#include "gpuq/common/job_ring.hpp"

#include <new>

#include "gpuq/common/assert.hpp"

namespace gpuq {

JobRing JobRing::create(void* memory, uint32_t capacity) noexcept {
  GPUQ_ASSERT(capacity >= 1 && capacity <= kMaxCapacity);
  GPUQ_ASSERT(reinterpret_cast<uintptr_t>(memory) % 64 == 0);
  auto* h = new (memory) RingHeader;
  h->tail.store(0, std::memory_order_relaxed);
  h->head.store(0, std::memory_order_relaxed);
  h->capacity = capacity;
  h->reserved = 0;
  auto* cells =
      reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(memory) + sizeof(RingHeader));
  for (uint32_t i = 0; i < capacity; ++i) {
    new (&cells[i]) std::atomic<uint64_t>(make_cell(i, kEmptyValue));
  }
  std::atomic_thread_fence(std::memory_order_release);
  return JobRing(memory);
}

// Memory ordering. The cell CAS is the only step that moves a value: a successful producer CAS
// is a release (it publishes whatever the producer wrote before it, e.g. a job slot) and a
// successful consumer CAS is an acquire of the same cell word, so the consumer sees the
// producer's writes. The consumer CAS is also a release, so the next producer of that cell
// (whose CAS reads it) sees the cell re-armed only after the consumer's reads are done. The
// head/tail hints only steer threads to a cell; a stale hint makes a CAS fail or a tag check
// miss, never produce a wrong value, so they can be relaxed RMWs read with acquire.
namespace {
// Signed distance from position `pos` to the position a cell's tag stands for (tags are the low
// 32 bits of positions, and live positions are far less than 2^31 apart).
inline int32_t tag_distance(uint64_t cell, uint64_t pos) noexcept {
  return static_cast<int32_t>(static_cast<uint32_t>(cell >> 32) - static_cast<uint32_t>(pos));
}
}  // namespace

bool JobRing::try_push(uint32_t value) noexcept {
  for (uint32_t attempt = 0; attempt < kMaxAttempts; ++attempt) {
    uint64_t pos = header_->tail.load(std::memory_order_acquire);
    std::atomic<uint64_t>& c = cell(pos);
    uint64_t cur = c.load(std::memory_order_acquire);
    const int32_t d = tag_distance(cur, pos);
    const bool empty = static_cast<uint32_t>(cur) == kEmptyValue;
    if (d == 0 && empty) {
      // The cell awaits position `pos`: claim and publish in one step.
      if (c.compare_exchange_strong(cur, make_cell(pos, value), std::memory_order_acq_rel,
                                    std::memory_order_acquire)) {
        header_->tail.compare_exchange_strong(pos, pos + 1, std::memory_order_release,
                                              std::memory_order_relaxed);
        return true;
      }
    } else if (d >= 0) {
      // `pos` was filled (and maybe consumed since) by a producer that has not advanced the
      // tail yet, or died before it could: advance it on its behalf.
      header_->tail.compare_exchange_strong(pos, pos + 1, std::memory_order_release,
                                            std::memory_order_relaxed);
    } else if (d == -static_cast<int32_t>(capacity_) && !empty) {
      // The value pushed one lap ago is still there: full, unless the tail moved meanwhile.
      if (header_->tail.load(std::memory_order_acquire) == pos) return false;
    }
    // Otherwise our tail read is stale; reload.
  }
  return false;
}

bool JobRing::try_pop(uint32_t* value) noexcept {
  for (uint32_t attempt = 0; attempt < kMaxAttempts; ++attempt) {
    uint64_t pos = header_->head.load(std::memory_order_acquire);
    std::atomic<uint64_t>& c = cell(pos);
    uint64_t cur = c.load(std::memory_order_acquire);
    const int32_t d = tag_distance(cur, pos);
    const bool empty = static_cast<uint32_t>(cur) == kEmptyValue;
    if (d == 0 && !empty) {
      if (c.compare_exchange_strong(cur, make_cell(pos + capacity_, kEmptyValue),
                                    std::memory_order_acq_rel, std::memory_order_acquire)) {
        header_->head.compare_exchange_strong(pos, pos + 1, std::memory_order_release,
                                              std::memory_order_relaxed);
        *value = static_cast<uint32_t>(cur);
        return true;
      }
    } else if (d == 0) {
      // The cell still awaits its producer: empty, unless the head moved meanwhile.
      if (header_->head.load(std::memory_order_acquire) == pos) return false;
    } else if (d > 0) {
      // `pos` was taken by a consumer that has not advanced the head yet, or died before it
      // could: advance it on its behalf.
      header_->head.compare_exchange_strong(pos, pos + 1, std::memory_order_release,
                                            std::memory_order_relaxed);
    }
    // Otherwise our head read is stale; reload.
  }
  return false;
}

uint64_t JobRing::settled_tail() noexcept {
  for (uint32_t attempt = 0; attempt < kMaxAttempts; ++attempt) {
    uint64_t pos = header_->tail.load(std::memory_order_acquire);
    const uint64_t cur = cell(pos).load(std::memory_order_acquire);
    const int32_t d = tag_distance(cur, pos);
    if (d < 0 || (d == 0 && static_cast<uint32_t>(cur) == kEmptyValue)) return pos;
    header_->tail.compare_exchange_strong(pos, pos + 1, std::memory_order_release,
                                          std::memory_order_relaxed);
  }
  return header_->tail.load(std::memory_order_acquire);
}

uint32_t JobRing::size() const noexcept {
  uint64_t head = header_->head.load(std::memory_order_acquire);
  uint64_t tail = header_->tail.load(std::memory_order_acquire);
  if (tail <= head) return 0;
  uint64_t n = tail - head;
  return n > capacity_ ? capacity_ : static_cast<uint32_t>(n);
}

}  // namespace gpuq
