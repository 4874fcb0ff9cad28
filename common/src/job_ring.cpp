#include "gpuq/common/job_ring.hpp"

#include <algorithm>
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
  auto* cells = reinterpret_cast<RingCell*>(static_cast<char*>(memory) + sizeof(RingHeader));
  for (uint32_t i = 0; i < capacity; ++i) {
    new (&cells[i].word) std::atomic<uint64_t>(make_cell(i, kEmptyValue));
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
      // seq_cst, both CASes: see the header ("A successful push or pop ...").
      if (c.compare_exchange_strong(cur, make_cell(pos, value), std::memory_order_seq_cst,
                                    std::memory_order_acquire)) {
        header_->tail.compare_exchange_strong(pos, pos + 1, std::memory_order_seq_cst,
                                              std::memory_order_seq_cst);
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
                                    std::memory_order_seq_cst, std::memory_order_acquire)) {
        header_->head.compare_exchange_strong(pos, pos + 1, std::memory_order_seq_cst,
                                              std::memory_order_seq_cst);
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

void JobRing::find_suspects(std::vector<Suspect>* out) const {
  const uint64_t head = header_->head.load(std::memory_order_acquire);
  const int64_t laps = int64_t{capacity_} * 2;
  for (uint32_t i = 0; i < capacity_; ++i) {
    // The position in [head, head + capacity) that cell i stands for.
    const uint64_t pos = head + (i + capacity_ - head % capacity_) % capacity_;
    const uint64_t cur = cells_[i].word.load(std::memory_order_acquire);
    const int32_t d = tag_distance(cur, pos);
    if (d < 0 || d > laps) out->push_back(Suspect{i, pos, cur});
  }
  // Cells only move forward, and the head never passes a position before its cell was
  // consumed; so a cell read after the head cannot lag it. But a wiped value at the head
  // looks like a cell awaiting its producer: it is one only while the tail has not passed it.
  const uint64_t cur = cell(head).load(std::memory_order_acquire);
  const uint64_t tail = header_->tail.load(std::memory_order_acquire);
  if (tail > head && tag_distance(cur, head) == 0 && static_cast<uint32_t>(cur) == kEmptyValue) {
    out->push_back(Suspect{static_cast<uint32_t>(head % capacity_), head, cur});
  }
}

bool JobRing::retire(const Suspect& suspect) noexcept {
  if (suspect.index >= capacity_ || suspect.position % capacity_ != suspect.index) return false;
  uint64_t expected = suspect.word;
  return cells_[suspect.index].word.compare_exchange_strong(
      expected, make_cell(suspect.position + capacity_, kEmptyValue), std::memory_order_acq_rel,
      std::memory_order_acquire);
}

RingAudit::Report RingAudit::run(JobRing& ring) {
  Report report;
  const uint64_t cap = ring.capacity();
  uint64_t head = ring.head_position();
  uint64_t tail = ring.tail_position();
  // Hints only move forward, and never by a billion positions in one audit period.
  bool head_bad = head < good_head_ || head - good_head_ > kMaxJump;
  bool tail_bad = tail < good_tail_ || tail - good_tail_ > kMaxJump;
  // More than a lap apart: the tail never passes the true head by more than a lap, and the
  // head hint lags the true head only while a consumer is between its CAS and the hint (and
  // the tail hint the true tail alike). Twice in a row, with the same values, is not that.
  const bool apart = !head_bad && !tail_bad && (tail > head + cap || head > tail + cap);
  if (apart && apart_ && head == apart_head_ && tail == apart_tail_) {
    (tail > head ? tail_bad : head_bad) = true;
  }
  apart_ = apart && !head_bad && !tail_bad;
  apart_head_ = head;
  apart_tail_ = tail;
  if (head_bad || tail_bad) {
    // Lower bounds of the true positions: the last sound hints; and, from a sound hint of the
    // other kind, head >= tail - capacity and tail >= head.
    if (head_bad) {
      const uint64_t to = std::max(good_head_, !tail_bad && tail > cap ? tail - cap : 0);
      if (ring.restore_head(head, to)) {
        report.head_restored = true;
        report.head_from = head;
        report.head_to = to;
      }
    }
    if (tail_bad) {
      const uint64_t to = std::max(good_tail_, !head_bad ? head : 0);
      if (ring.restore_tail(tail, to)) {
        report.tail_restored = true;
        report.tail_from = tail;
        report.tail_to = to;
      }
    }
    // Cells are judged against the head: not this time.
    suspects_.clear();
    return report;
  }
  if (!apart) {
    good_head_ = head;
    good_tail_ = tail;
  }
  // A head hint left behind (a consumer between its CAS and the hint, or a restore above)
  // would make sound cells look far ahead of it.
  ring.settled_head();
  std::vector<JobRing::Suspect> now;
  ring.find_suspects(&now);
  for (const JobRing::Suspect& s : now) {
    if (std::find(suspects_.begin(), suspects_.end(), s) != suspects_.end() && ring.retire(s)) {
      report.retired.push_back(s);
    }
  }
  suspects_ = std::move(now);
  return report;
}

uint64_t JobRing::settled_head() noexcept {
  for (uint32_t attempt = 0; attempt < kMaxAttempts; ++attempt) {
    uint64_t pos = header_->head.load(std::memory_order_acquire);
    if (tag_distance(cell(pos).load(std::memory_order_acquire), pos) <= 0) return pos;
    header_->head.compare_exchange_strong(pos, pos + 1, std::memory_order_release,
                                          std::memory_order_relaxed);
  }
  return header_->head.load(std::memory_order_acquire);
}

uint32_t JobRing::size() const noexcept {
  uint64_t head = header_->head.load(std::memory_order_acquire);
  uint64_t tail = header_->tail.load(std::memory_order_acquire);
  if (tail <= head) return 0;
  uint64_t n = tail - head;
  return n > capacity_ ? capacity_ : static_cast<uint32_t>(n);
}

}  // namespace gpuq
