#include "gpuq/common/pool_queue.hpp"

#include <new>

#include "gpuq/common/assert.hpp"

namespace gpuq {

PoolQueue PoolQueue::create(void* memory, uint32_t capacity, uint32_t client_lanes) noexcept {
  GPUQ_ASSERT(valid_client_lanes(client_lanes));
  GPUQ_ASSERT(reinterpret_cast<uintptr_t>(memory) % 64 == 0);
  auto* h = new (memory) PoolQueueHeader;
  h->active.store(0, std::memory_order_relaxed);
  h->capacity = capacity;
  h->client_lanes = client_lanes;
  for (auto& w : h->weight) w.store(1, std::memory_order_relaxed);
  PoolQueue q(memory, capacity, client_lanes);
  for (uint32_t i = 0; i < q.lane_count(); ++i) {
    JobRing::create(static_cast<char*>(memory) + sizeof(PoolQueueHeader) +
                        size_t{i} * JobRing::bytes_for(capacity),
                    capacity);
  }
  std::atomic_thread_fence(std::memory_order_release);
  return q;
}

uint32_t PoolQueue::settle_bits() const noexcept {
  uint32_t found = 0;
  for (uint32_t i = 0; i < lane_count(); ++i) {
    if (lane(i).has_values()) {
      const uint64_t bit = uint64_t{1} << i;
      if ((header_->active.load(std::memory_order_seq_cst) & bit) == 0) {
        header_->active.fetch_or(bit, std::memory_order_seq_cst);
        ++found;
      }
    } else if (clear_if_empty(i)) {
      ++found;
    }
  }
  // Bits past the lanes (a client's scribble) mean nothing; clear them.
  if ((header_->active.load(std::memory_order_relaxed) & ~lanes_mask()) != 0) {
    header_->active.fetch_and(lanes_mask(), std::memory_order_seq_cst);
  }
  return found;
}

bool PoolQueue::settle_active_bits() const noexcept {
  bool any = false;
  for (uint64_t bits = active(); bits != 0; bits &= bits - 1) {
    const auto i = static_cast<uint32_t>(std::countr_zero(bits));
    any = (lane(i).has_values() || clear_if_empty(i)) || any;
  }
  return any;
}

bool PoolQueue::clear_if_empty(uint32_t i) const noexcept {
  const uint64_t bit = uint64_t{1} << i;
  if ((header_->active.load(std::memory_order_seq_cst) & bit) == 0) return false;
  header_->active.fetch_and(~bit, std::memory_order_seq_cst);
  // A pusher pushes (seq_cst) and then loads `active` (seq_cst). If its load saw the bit
  // still set, it came before the clear above in the single total order, and so did its
  // push: this look sees the value. If it saw the bit clear, it sets it itself.
  if (!lane(i).has_values()) return false;
  mark(i);
  return true;
}

uint32_t PoolQueue::size() const noexcept {
  uint32_t n = 0;
  for (uint32_t i = 0; i < lane_count(); ++i) n += lane(i).size();
  return n;
}

bool PoolQueue::has_values() const noexcept {
  for (uint32_t i = 0; i < lane_count(); ++i) {
    if (lane(i).has_values()) return true;
  }
  return false;
}

uint32_t PoolQueue::level_size(uint32_t rank) const noexcept {
  uint32_t n = 0;
  const uint32_t first = level_first(rank);
  for (uint32_t i = first; i < first + lanes_per_level(client_lanes_); ++i) n += lane(i).size();
  return n;
}

// ---- LanePicker ----

LanePicker::LanePicker(PoolQueue queue) noexcept : queue_(queue) {
  const uint64_t lanes = (uint64_t{1} << queue_.client_lanes()) - 1;
  for (uint32_t c = 0; c < kClasses; ++c) {
    const uint32_t first = queue_.level_first(c / 2);
    class_mask_[c] = c % 2 == 0 ? uint64_t{1} << first : lanes << (first + 1);
  }
  for (uint32_t i = 0; i < queue_.lane_count(); ++i) {
    lane_class_[i] = static_cast<uint8_t>(2 * queue_.rank_of(i) + (queue_.is_fresh(i) ? 0 : 1));
  }
}

bool LanePicker::pop_class(uint64_t active, uint32_t c, uint32_t* value, uint32_t* lane) noexcept {
  const uint32_t rank = c / 2;
  const uint32_t first = queue_.level_first(rank);
  if (c % 2 == 0) {
    if (!queue_.lane(first).try_pop(value)) return false;
    *lane = first;
    return true;
  }
  // The level's client lanes whose bits are set take turns from cursor_[rank] (the bits rotated
  // so that the cursor's lane is bit 0, then the lowest set bit first); the lane whose turn it
  // is gives up to its weight of jobs in a row.
  const uint32_t k = queue_.client_lanes();
  const uint64_t k_mask = (uint64_t{1} << k) - 1;
  const uint64_t bits = (active >> (first + 1)) & k_mask;
  const uint32_t start = cursor_[rank] < k ? cursor_[rank] : 0;
  uint64_t rotated = ((bits >> start) | (bits << (k - start))) & k_mask;
  while (rotated != 0) {
    const auto n = static_cast<uint32_t>(std::countr_zero(rotated));
    rotated &= rotated - 1;
    const uint32_t j = start + n < k ? start + n : start + n - k;
    if (queue_.lane(first + 1 + j).try_pop(value)) {
      if (j != start) streak_[rank] = 0;  // the turn passed to lane j
      if (++streak_[rank] >= queue_.weight(j)) {
        cursor_[rank] = j + 1 < k ? j + 1 : 0;
        streak_[rank] = 0;
      } else {
        cursor_[rank] = j;
      }
      *lane = first + 1 + j;
      return true;
    }
  }
  return false;
}

void LanePicker::served(uint64_t active, uint32_t c) noexcept {
  since_[c] = 0;
  starving_ &= ~(1u << c);
  // Every other class holding jobs waited one more start. Lanes are laid out in class order,
  // so a class is found from its lowest lane's bit, and most often there is none.
  uint64_t others = active & ~class_mask_[c];
  while (others != 0) {
    const uint32_t o = lane_class_[std::countr_zero(others)];
    if (++since_[o] >= kStarveAfter) starving_ |= 1u << o;
    others &= ~class_mask_[o];
  }
}

bool LanePicker::pop(uint32_t* value, uint32_t* lane) noexcept {
  const uint64_t active = queue_.active();
  if (active == 0) return false;
  // A class that has waited kStarveAfter starts goes first, the lowest first. One found empty
  // (its bit left set by a lane that emptied) is not waiting: its count starts again.
  for (uint32_t s = starving_; s != 0;) {
    const auto c = static_cast<uint32_t>(31 - std::countl_zero(s));
    s &= ~(1u << c);
    if ((active & class_mask_[c]) == 0) continue;
    if (pop_class(active, c, value, lane)) {
      served(active, c);
      return true;
    }
    since_[c] = 0;
    starving_ &= ~(1u << c);
  }
  // Then the first class with a job, in class order: the class of the lowest set bit, then
  // past that class's lanes if they were all empty after all.
  for (uint64_t rest = active; rest != 0;) {
    const uint32_t c = lane_class_[std::countr_zero(rest)];
    if (pop_class(active, c, value, lane)) {
      served(active, c);
      return true;
    }
    rest &= ~class_mask_[c];
  }
  return false;
}

bool LanePicker::peek_level(uint32_t rank, uint32_t* value, uint32_t* lane) const noexcept {
  const uint64_t active = queue_.active();
  const uint32_t first = queue_.level_first(rank);
  if ((active & class_mask_[2 * rank]) != 0 && queue_.lane(first).peek(value)) {
    *lane = first;
    return true;
  }
  const uint32_t k = queue_.client_lanes();
  const uint64_t bits = (active >> (first + 1)) & ((uint64_t{1} << k) - 1);
  const uint32_t start = cursor_[rank] < k ? cursor_[rank] : 0;
  for (uint32_t n = 0; n < k; ++n) {
    const uint32_t j = (start + n) % k;
    if ((bits & (uint64_t{1} << j)) != 0 && queue_.lane(first + 1 + j).peek(value)) {
      *lane = first + 1 + j;
      return true;
    }
  }
  return false;
}

bool LanePicker::pop_lane(uint32_t lane, uint32_t* value) noexcept {
  if (!queue_.lane(lane).try_pop(value)) return false;
  if (!queue_.is_fresh(lane)) {
    const uint32_t rank = queue_.rank_of(lane);
    cursor_[rank] = (lane - queue_.level_first(rank)) % queue_.client_lanes();
    streak_[rank] = 0;
  }
  return true;
}

bool LanePicker::value_ready() const noexcept {
  uint64_t active = queue_.active();
  while (active != 0) {
    const auto i = static_cast<uint32_t>(std::countr_zero(active));
    if (queue_.lane(i).value_at_head()) return true;
    active &= active - 1;
  }
  return false;
}

bool LanePicker::value_ready_in_level(uint32_t rank) const noexcept {
  uint64_t active = queue_.active() & (class_mask_[2 * rank] | class_mask_[2 * rank + 1]);
  while (active != 0) {
    const auto i = static_cast<uint32_t>(std::countr_zero(active));
    if (queue_.lane(i).value_at_head()) return true;
    active &= active - 1;
  }
  return false;
}

}  // namespace gpuq
