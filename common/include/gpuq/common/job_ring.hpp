// JobRing: a bounded, lock-free, multi-producer multi-consumer ring of 32-bit values that lives
// in shared memory and that a process killed at any instruction cannot stall.
//
// Contract
//   - Capacity is fixed when the ring is laid out (any value from 1 to kMaxCapacity, not only
//     powers of two). try_push() fails with false when the ring holds `capacity` values; the
//     ring never holds more.
//   - Each pushed value is popped exactly once. Order is FIFO per cell sequence; concurrent
//     producers are linearized by their successful CAS.
//   - push/pop are lock-free: a thread that stops anywhere (even SIGKILL) never blocks others.
//   - Values must not equal kEmptyValue.
//   - Thread- and process-safe; not async-signal-safe (a handler may interrupt its own thread).
//   - A successful push or pop changes the ring with seq_cst read-modify-writes only (the cell
//     CAS, then the CAS that advances the tail or head hint, whose failure is a seq_cst load).
//     So a seq_cst load the caller makes afterwards comes after the whole change in the single
//     total order, as it would after a seq_cst fence: a caller that then looks for sleepers to
//     wake needs no fence of its own (EventCount::notify_all_after_rmw, wake_worker_after_push).
//
// Design (docs/design/ring.md has the full argument)
//   Every cell is one 64-bit atomic word {tag:32 | value:32}. Position p (a 64-bit counter) uses
//   cell p % capacity. A cell waiting for position p holds {tag(p), EMPTY}; a producer at p turns
//   it into {tag(p), value} with ONE compare-and-swap, which both claims and publishes the cell,
//   so there is no claimed-but-unpublished window for a dying producer to leave behind (the
//   weakness of a Vyukov ring, where a producer bumps the tail, then writes, then publishes).
//   A consumer at p turns {tag(p), value} into {tag(p + capacity), EMPTY}, again in one CAS,
//   which takes the value and re-arms the cell for the next lap. `tail` and `head` are hints:
//   after its cell CAS a thread tries to advance the counter; if it dies before that, any other
//   thread that finds the cell already filled (or emptied) advances the counter for it.
//   tag(p) is the low 32 bits of p; a tag can only be confused with one 2^32 positions away.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gpuq/common/prefetch.hpp"

namespace gpuq {

// One cell of a ring: a 64-bit word alone on its cache line. Producers and consumers CAS
// neighbouring cells at once (several clients push, several workers pop); cells packed eight
// to a line made each of those CASes fetch the line from whichever core touched a neighbour
// last (docs/design/ring.md, "Layout").
struct alignas(64) RingCell {
  std::atomic<uint64_t> word;
};
static_assert(sizeof(RingCell) == 64);

// The shared-memory part of a ring: header followed by `capacity` cells. Plain data.
struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint64_t> tail;  // next position to push (a hint; may lag)
  alignas(64) std::atomic<uint64_t> head;  // next position to pop (a hint; may lag)
  alignas(64) uint32_t capacity;           // written once before the ring is shared
  uint32_t reserved;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::is_standard_layout_v<RingHeader>);
static_assert(std::is_trivially_destructible_v<RingHeader>);
static_assert(sizeof(RingHeader) == 192);

class JobRing {
 public:
  static constexpr uint32_t kEmptyValue = 0xFFFFFFFFu;
  static constexpr uint32_t kMaxCapacity = 1u << 20;

  // Bytes needed for a ring of `capacity` cells (header included), a multiple of 64.
  static constexpr size_t bytes_for(uint32_t capacity) noexcept {
    return sizeof(RingHeader) + size_t{capacity} * sizeof(RingCell);
  }

  // Lays out an empty ring of `capacity` cells at `memory` (64-byte aligned, bytes_for() long)
  // and returns a view of it. Not thread-safe: call before the memory is shared.
  static JobRing create(void* memory, uint32_t capacity) noexcept;

  // A view of a ring laid out by create(), possibly in another process.
  explicit JobRing(void* memory) noexcept
      : header_(static_cast<RingHeader*>(memory)),
        cells_(reinterpret_cast<RingCell*>(static_cast<char*>(memory) + sizeof(RingHeader))),
        capacity_(header_->capacity) {}
  // The same, with a capacity the caller knows rather than the one in the shared header, which
  // any process that maps the ring can overwrite (see QueueView).
  JobRing(void* memory, uint32_t capacity) noexcept
      : header_(static_cast<RingHeader*>(memory)),
        cells_(reinterpret_cast<RingCell*>(static_cast<char*>(memory) + sizeof(RingHeader))),
        capacity_(capacity) {}
  JobRing() = default;

  uint32_t capacity() const noexcept { return capacity_; }
  // The shared header (a view's own capacity is the one it was made with, not the header's).
  RingHeader& header() const noexcept { return *header_; }

  // Appends `value`; false if the ring is full. Lock-free.
  bool try_push(uint32_t value) noexcept;

  // Removes the oldest value into `*value`; false if the ring is empty. Lock-free.
  bool try_pop(uint32_t* value) noexcept;

  // Number of values in the ring at some instant during the call (exact when quiescent).
  uint32_t size() const noexcept;

  // The head and tail hints (positions). The supervisor uses them to know when every entry
  // pushed before some moment has been popped: head_position() >= an earlier tail_position().
  uint64_t head_position() const noexcept { return header_->head.load(std::memory_order_acquire); }
  uint64_t tail_position() const noexcept { return header_->tail.load(std::memory_order_acquire); }
  // The tail after advancing it past any cells already filled whose producer died (or has not
  // yet got round to it) before moving the hint: every value pushed so far lies below it.
  uint64_t settled_tail() noexcept;
  // The head after advancing it past cells already consumed (or far ahead), as consumers do.
  uint64_t settled_head() noexcept;

  // A thread gives up (push: "full", pop: "empty") after this many attempts without progress.
  // Only a corrupted header (a client scribbling over shared memory) gets near it; the bound
  // turns that into a failed call instead of a thread spinning forever.
  static constexpr uint32_t kMaxAttempts = 1u << 20;

  // Prefetches, for writing, the cell the next push will most likely CAS (a hint: see
  // prefetch.hpp), so that its miss overlaps the producer's other work.
  void prefetch_push() const noexcept {
    prefetch_for_write(&cell(header_->tail.load(std::memory_order_relaxed)));
  }

  // The value at the head, if the cell there holds one, without taking it (a hint for
  // prefetching: another consumer may take it first).
  bool peek(uint32_t* value) const noexcept {
    const uint64_t pos = header_->head.load(std::memory_order_relaxed);
    const uint64_t c = cell(pos).load(std::memory_order_relaxed);
    if (static_cast<uint32_t>(c >> 32) != static_cast<uint32_t>(pos) ||
        static_cast<uint32_t>(c) == kEmptyValue) {
      return false;
    }
    *value = static_cast<uint32_t>(c);
    return true;
  }

  // True if some value is present; cheaper than size() for wait conditions.
  bool has_values() const noexcept { return size() != 0; }

  // True if the cell at the head holds a value: what a consumer spins on. It reads the cell a
  // producer writes, so a spinning consumer sees a push after one cache-line transfer (the
  // tail hint would cost a second). May miss a value behind a lagging head; a try_pop helps.
  bool value_at_head() const noexcept {
    const uint64_t pos = header_->head.load(std::memory_order_acquire);
    const uint64_t c = cell(pos).load(std::memory_order_acquire);
    return static_cast<uint32_t>(c >> 32) == static_cast<uint32_t>(pos) &&
           static_cast<uint32_t>(c) != kEmptyValue;
  }

  // Visits every value currently published (for recovery scans by the supervisor; racy with
  // concurrent pops, which is fine for its use). fn(uint32_t value).
  template <typename Fn>
  void for_each_value(Fn&& fn) const noexcept {
    for (uint32_t i = 0; i < capacity_; ++i) {
      uint64_t c = cells_[i].word.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(c) != kEmptyValue) fn(static_cast<uint32_t>(c));
    }
  }

  // Visits the values queued from the head to the tail (one past it: a value whose producer
  // has not advanced the tail yet), at most `capacity` cells: cheaper than for_each_value when
  // the ring is mostly empty. Racy as for_each_value; a ring whose hints were scribbled over
  // may hide values from it (a client's recount, which only errs by what a forger did).
  template <typename Fn>
  void for_each_queued(Fn&& fn) const noexcept {
    const uint64_t head = header_->head.load(std::memory_order_acquire);
    const uint64_t tail = header_->tail.load(std::memory_order_acquire);
    const uint64_t n = tail >= head && tail - head < capacity_ ? tail - head + 1 : capacity_;
    for (uint64_t p = head; p < head + n; ++p) {
      const uint64_t c = cell(p).load(std::memory_order_acquire);
      if (static_cast<uint32_t>(c >> 32) == static_cast<uint32_t>(p) &&
          static_cast<uint32_t>(c) != kEmptyValue) {
        fn(static_cast<uint32_t>(c));
      }
    }
  }

  // ---- Audit: the supervisor's repair of cells that a client overwrote ----
  // Every process that maps the queue segment can write the cells, so a client can store a
  // word that no producer or consumer would (docs/design/ring.md, "Repair"). Such a word at
  // the head stops every consumer, at the tail every producer; elsewhere it wastes the cell.

  // A cell that holds such a word: its index, the position it should stand for, the word.
  struct Suspect {
    uint32_t index;
    uint64_t position;
    uint64_t word;
    bool operator==(const Suspect&) const = default;
  };

  // Appends to `out` the cells whose word no live producer or consumer can have written:
  //   - a tag behind the position the cell stands for (the one in [head, head + capacity)),
  //     or more than two laps ahead of it;
  //   - the cell at the head awaiting its value although the tail has passed it (a value was
  //     wiped).
  // Racy with pushes and pops, which may make a sound cell look suspect for an instant:
  // repair only a suspect seen twice, some time apart, with the same word (retire()'s CAS
  // fails if the word has changed meanwhile).
  void find_suspects(std::vector<Suspect>* out) const;

  // Marks the suspect's cell consumed at its position ({tag(position + capacity), EMPTY}) if
  // it still holds the suspect's word: producers and consumers step past it, and it awaits
  // the next lap. A value it held is dropped (the supervisor's audit of SUBMITTED jobs puts a
  // real job back). True if the cell was changed.
  bool retire(const Suspect& suspect) noexcept;

  // Moves the head (tail) hint to `to` if it still reads `seen`. Moving a hint back is always
  // safe: threads step forward past cells already consumed (filled) exactly as they do after a
  // thread died before advancing the hint. Only the audit calls these (see RingAudit).
  bool restore_head(uint64_t seen, uint64_t to) noexcept {
    return header_->head.compare_exchange_strong(seen, to, std::memory_order_acq_rel);
  }
  bool restore_tail(uint64_t seen, uint64_t to) noexcept {
    return header_->tail.compare_exchange_strong(seen, to, std::memory_order_acq_rel);
  }

 private:
  static constexpr uint64_t make_cell(uint64_t pos, uint32_t value) noexcept {
    return (pos << 32) | value;  // the shift keeps the low 32 bits of pos as the tag
  }
  std::atomic<uint64_t>& cell(uint64_t pos) const noexcept { return cells_[pos % capacity_].word; }

  RingHeader* header_ = nullptr;
  RingCell* cells_ = nullptr;
  uint32_t capacity_ = 0;
};

// The supervisor's audit of one ring, run every so often (100 ms in gpuqd) while clients are
// connected: it undoes what a client that wrote over the ring could do to stall it or waste
// its cells. State carries from one run to the next; one RingAudit per ring, one thread.
//   - Head and tail hints that moved back, or jumped by more than kMaxJump since the last
//     run, or stand more than a lap apart in two runs in a row, are moved back to a position
//     no later than the true one (from which threads step forward as usual).
//   - A cell suspect (find_suspects) in two runs in a row with the same word is retired.
// A job whose ring entry was dropped on the way is not the ring's business: the supervisor
// finds it SUBMITTED in no ring and pushes it again.
class RingAudit {
 public:
  static constexpr uint64_t kMaxJump = uint64_t{1} << 30;  // far beyond 100 ms of pushes

  struct Report {
    bool head_restored = false, tail_restored = false;
    uint64_t head_from = 0, head_to = 0, tail_from = 0, tail_to = 0;
    std::vector<JobRing::Suspect> retired;
  };
  Report run(JobRing& ring);

 private:
  uint64_t good_head_ = 0, good_tail_ = 0;  // hints from the last run that found them sound
  uint64_t apart_head_ = 0, apart_tail_ = 0;
  bool apart_ = false;  // the last run saw the hints at apart_head_/apart_tail_, a lap apart
  std::vector<JobRing::Suspect> suspects_;
};

}  // namespace gpuq
