// PoolQueue: a pool's queue of jobs, made of lanes. Each lane is a JobRing (job_ring.hpp); a
// pool has, for each priority level, one "fresh" lane and K client lanes. A client pushes a job
// into its own lane of the job's level (client index % K), or into the level's fresh lane when
// it has no other job in the pool. Workers take from the lanes in turn (LanePicker): higher
// levels first, within a level the fresh lane first, then the client lanes in turn (each up to
// its weight of jobs per turn, config client_weights). So a client's wait depends on how many
// clients are busy, not on how many jobs another client has queued, and a client sending one
// job at a time goes ahead of any flood (docs/design/ring.md, "Lanes").
//
// Contract
//   - Everything JobRing promises holds per lane: lock-free, crash-safe (a process killed at
//     any instruction stalls nothing), each value popped exactly once, FIFO within a lane.
//   - `active` is a hint: bit i set means lane i may hold values. A push sets its lane's bit
//     after the push (one load while it is set already); only a worker about to sleep and the
//     supervisor's audit clear bits, each with a re-check of the lane (settle_active_bits(),
//     settle_bits()), so a lane that holds a value has its bit set, or a re-check that sets it
//     is on its way, or its pusher died between its push and its mark (or a client cleared
//     the bit): then the audit sets it within 100 ms and wakes a worker. Workers look only at
//     lanes whose bits are set.
//   - Each lane holds `capacity` cells: a client may queue up to the pool's whole bound in its
//     own lane (less if its configured share says so, which the client counts itself), and
//     a flood in one lane neither fills another's nor lengthens its wait.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "gpuq/common/job_ring.hpp"
#include "gpuq/priority.hpp"

namespace gpuq {

// The shared part ahead of the lanes. Plain data.
struct alignas(64) PoolQueueHeader {
  std::atomic<uint64_t> active;  // bit i: lane i may hold values (see the contract)
  uint32_t capacity;             // each lane's cells; written once before sharing
  uint32_t client_lanes;         // K: client lanes per level; written once before sharing
  // The weight of each client column (jobs a worker takes from it per turn; 0 reads as 1),
  // written by the supervisor as clients come and go (their configured `client_weights`),
  // read by workers. A client can scribble on it: that only reorders turns.
  std::atomic<uint8_t> weight[16];
};
static_assert(sizeof(PoolQueueHeader) == 64);
static_assert(std::atomic<uint8_t>::is_always_lock_free);
static_assert(std::is_standard_layout_v<PoolQueueHeader>);

class PoolQueue {
 public:
  static constexpr uint32_t kMaxClientLanes = 16;
  static constexpr uint32_t kMaxWeight = 16;  // of a client column (client_weights)
  // Cells of all lanes of a pool, at most (unless one client lane per level exceeds it): a
  // pool's lanes cost up to 1 MiB of shared memory, as much as the largest ring did.
  static constexpr uint64_t kCellBudget = 16384;
  static constexpr uint32_t lanes_per_level(uint32_t client_lanes) noexcept {
    return client_lanes + 1;
  }
  static constexpr uint32_t kMaxLanes = kPriorityLevels * (kMaxClientLanes + 1);
  static_assert(kMaxLanes <= 64, "one bit per lane in `active`");
  static_assert(kMaxClientLanes <= sizeof(PoolQueueHeader::weight), "a weight per column");

  // K for a pool whose lanes hold `capacity` cells each: as many as the cell budget allows,
  // a power of two from 1 to kMaxClientLanes (a client's lane is its index masked: no division
  // on the submit path).
  static constexpr uint32_t client_lanes_for(uint32_t capacity) noexcept {
    const uint64_t per_level = kCellBudget / kPriorityLevels / (capacity == 0 ? 1 : capacity);
    uint32_t k = kMaxClientLanes;
    while (k > 1 && k + 1 > per_level) k /= 2;
    return k;
  }
  static constexpr bool valid_client_lanes(uint32_t k) noexcept {
    return k >= 1 && k <= kMaxClientLanes && (k & (k - 1)) == 0;
  }
  static constexpr size_t bytes_for(uint32_t capacity, uint32_t client_lanes) noexcept {
    return sizeof(PoolQueueHeader) +
           size_t{kPriorityLevels} * lanes_per_level(client_lanes) * JobRing::bytes_for(capacity);
  }

  // Lays out empty lanes at `memory` (64-byte aligned, bytes_for() long). Not thread-safe:
  // before the memory is shared.
  static PoolQueue create(void* memory, uint32_t capacity, uint32_t client_lanes) noexcept;

  // A view, with the geometry the caller trusts (QueueLayout's copy), not the shared header's.
  PoolQueue(void* memory, uint32_t capacity, uint32_t client_lanes) noexcept
      : header_(static_cast<PoolQueueHeader*>(memory)),
        capacity_(capacity),
        client_lanes_(client_lanes) {}
  PoolQueue() = default;

  uint32_t capacity() const noexcept { return capacity_; }
  uint32_t client_lanes() const noexcept { return client_lanes_; }
  uint32_t lane_count() const noexcept { return kPriorityLevels * lanes_per_level(client_lanes_); }
  PoolQueueHeader& header() const noexcept { return *header_; }

  // A client's column: its lane within each level's client lanes (its index modulo K).
  uint32_t column_of(uint32_t client) const noexcept { return client & (client_lanes_ - 1); }
  // The lane a job of `client` at `priority` goes to: the level's fresh lane if `fresh` (the
  // client has no other job in the pool), else the client's own lane of the level.
  uint32_t lane_for(uint32_t client, Priority priority, bool fresh) const noexcept {
    return level_first(priority_rank(priority)) + (fresh ? 0 : 1 + column_of(client));
  }
  // The first lane of the level at `rank` (its fresh lane); its client lanes follow.
  uint32_t level_first(uint32_t rank) const noexcept {
    return rank * lanes_per_level(client_lanes_);
  }
  // The level rank (0: high) of `lane`.
  uint32_t rank_of(uint32_t lane) const noexcept { return lane / lanes_per_level(client_lanes_); }
  bool is_fresh(uint32_t lane) const noexcept { return lane % lanes_per_level(client_lanes_) == 0; }

  JobRing lane(uint32_t i) const noexcept {
    return JobRing(reinterpret_cast<char*>(header_) + sizeof(PoolQueueHeader) +
                       size_t{i} * JobRing::bytes_for(capacity_),
                   capacity_);
  }

  // Appends `value` to lane `i` and marks the lane active; false if that lane is full.
  // Lock-free. Like JobRing::try_push, a successful push is made of seq_cst read-modify-writes
  // and a seq_cst load (of `active`): a caller's later seq_cst load comes after all of it.
  bool try_push(uint32_t i, uint32_t value) const noexcept {
    if (!lane(i).try_push(value)) return false;
    mark(i);
    return true;
  }
  // Sets lane `i`'s bit in `active` unless it is set already (then: one load).
  void mark(uint32_t i) const noexcept {
    const uint64_t bit = uint64_t{1} << i;
    if ((header_->active.load(std::memory_order_seq_cst) & bit) == 0) {
      header_->active.fetch_or(bit, std::memory_order_seq_cst);
    }
  }
  // The bits of this queue's lanes in `active` (a client may have set others: ignored).
  uint64_t active() const noexcept {
    return header_->active.load(std::memory_order_seq_cst) & lanes_mask();
  }
  uint64_t lanes_mask() const noexcept { return (uint64_t{1} << lane_count()) - 1; }

  // The weight of client column `column` (1 to kMaxWeight; a scribbled value is clamped).
  uint32_t weight(uint32_t column) const noexcept {
    const uint32_t w = header_->weight[column].load(std::memory_order_relaxed);
    return w == 0 ? 1 : w > kMaxWeight ? kMaxWeight : w;
  }
  void set_weight(uint32_t column, uint32_t w) const noexcept {
    header_->weight[column].store(static_cast<uint8_t>(w), std::memory_order_relaxed);
  }

  // A worker about to sleep: clears the bits of the lanes whose bits are set and that are
  // found empty. Each cleared lane is looked at again after the clear (seq_cst: the Dekker
  // pair with a pusher's push-then-load) and its bit set back if it has a value by then. True
  // if some lane whose bit was set holds a value. Lanes whose bits are clear are not looked
  // at: a live pusher marks its lane and then looks for sleepers (ring.md, "Lanes").
  bool settle_active_bits() const noexcept;
  // The audit: every lane, whatever its bit. Sets the bits of lanes found holding values (a
  // pusher that died before its mark, a bit a client cleared) and clears the others as above.
  // Returns how many lanes held values their bits did not show: the caller wakes a worker.
  uint32_t settle_bits() const noexcept;

  // Values in all lanes at some instant during the call (exact when quiescent).
  uint32_t size() const noexcept;
  // True if some lane holds a value; every lane is looked at, whatever `active` says.
  bool has_values() const noexcept;
  // Values in the lanes of the level at `rank`.
  uint32_t level_size(uint32_t rank) const noexcept;

  // Visits the values queued in the lanes `client`'s jobs go to (its lane and the fresh lane of
  // each level), head to tail (JobRing::for_each_queued): a client's recount of its entries.
  // Entries a forger pushed into other lanes are not seen (they cost the forger's victim
  // nothing then).
  template <typename Fn>
  void for_each_value_of(uint32_t client, Fn&& fn) const noexcept {
    for (uint32_t r = 0; r < kPriorityLevels; ++r) {
      lane(level_first(r)).for_each_queued(fn);
      lane(level_first(r) + 1 + column_of(client)).for_each_queued(fn);
    }
  }

  // Visits every value in every lane (racy with pushes and pops; for recovery and status).
  template <typename Fn>
  void for_each_value(Fn&& fn) const noexcept {
    for (uint32_t i = 0; i < lane_count(); ++i) lane(i).for_each_value(fn);
  }

 private:
  // Clears lane `i`'s bit if it is set, then looks at the lane again and sets the bit back if
  // it holds a value by then (true).
  bool clear_if_empty(uint32_t i) const noexcept;

  PoolQueueHeader* header_ = nullptr;
  uint32_t capacity_ = 0;
  uint32_t client_lanes_ = 1;
};

// A worker's choice of the next job of its pool: its own state, nothing shared. Over the
// classes, in order high-fresh, high-clients, normal-fresh, normal-clients, low-fresh,
// low-clients:
//   - the first class with a job is served; in a clients class, the lanes take turns: a lane
//     whose turn it is gives up to its weight of jobs in a row (PoolQueue::weight), then the
//     turn goes to the next lane with a job;
//   - but a class that held jobs while kStarveAfter starts went to other classes is served
//     first (the lowest such first): every waiting class gets at least one start in
//     kStarveAfter + 1 of this worker's, so no level and no lane starves.
class LanePicker {
 public:
  static constexpr uint32_t kClasses = 2 * kPriorityLevels;
  static constexpr uint32_t kStarveAfter = 9;

  LanePicker() = default;
  explicit LanePicker(PoolQueue queue) noexcept;

  // Takes the next job into `*value`; `*lane` the lane it came from. False: no lane whose bit
  // is set holds one.
  bool pop(uint32_t* value, uint32_t* lane) noexcept;
  // The value at the head of the first lane of the level at `rank` that has one, in the order
  // that level is served (its fresh lane, then its client lanes round robin), without taking
  // it: batching gathers within a level, and looks at a job before it takes it.
  bool peek_level(uint32_t rank, uint32_t* value, uint32_t* lane) const noexcept;
  // Takes the value at the head of `lane` (moving the level's round robin past it).
  bool pop_lane(uint32_t lane, uint32_t* value) noexcept;
  // The value at the head of `lane`, if any (a hint for prefetching: another worker may take
  // it first).
  bool peek(uint32_t lane, uint32_t* value) const noexcept { return queue_.lane(lane).peek(value); }
  // True if some active lane has a value at its head: what an idle worker spins on.
  bool value_ready() const noexcept;
  // The same within the level at `rank`.
  bool value_ready_in_level(uint32_t rank) const noexcept;

  const PoolQueue& queue() const noexcept { return queue_; }

 private:
  bool pop_class(uint64_t active, uint32_t c, uint32_t* value, uint32_t* lane) noexcept;
  void served(uint64_t active, uint32_t c) noexcept;

  PoolQueue queue_;
  uint64_t class_mask_[kClasses] = {};             // the lanes of each class, as bits of `active`
  uint8_t lane_class_[PoolQueue::kMaxLanes] = {};  // the class of each lane
  uint32_t since_[kClasses] = {};          // starts of other classes while this one held jobs
  uint32_t starving_ = 0;                  // bit c: since_[c] >= kStarveAfter
  uint32_t cursor_[kPriorityLevels] = {};  // the client lane whose turn it is
  uint32_t streak_[kPriorityLevels] = {};  // jobs taken from it in this turn
};

}  // namespace gpuq
