#include "worker_metrics.hpp"

#include <cstring>

#include "ops.hpp"

namespace gpuq::daemon {

void WorkerMetricsWriter::attach(WorkerMetrics& page) noexcept {
  page_ = &page;
  on_ = page.enabled != 0;
  std::memcpy(bound_ticks_, page.bound_ticks, sizeof bound_ticks_);
  // The last bound is a minute: the cap, an hour, in the same ticks.
  wait_cap_ = bound_ticks_[kMetricBounds - 1] / 60 * kMaxQueueWaitSeconds;
  slot_of_.clear();
}

void WorkerMetricsWriter::set_memory_budget(uint64_t budget, uint64_t used) noexcept {
  memory_budget_ = budget;
  page_->device_memory_budget.store(budget, std::memory_order_relaxed);
  page_->device_memory_used.store(used, std::memory_order_relaxed);
}

uint32_t WorkerMetricsWriter::first_slot(uint32_t op_id) {
  const bool known = op_id < kMaxMappedOpIds && find_op(op_id) != nullptr;
  const uint32_t slot = find_or_add_slot(known ? op_id : kMetricOtherOp);
  if (op_id < kMaxMappedOpIds) {
    if (op_id >= slot_of_.size()) slot_of_.resize(op_id + 1, kNoSlot);
    slot_of_[op_id] = static_cast<uint16_t>(slot);
  }
  return slot;
}

// The slot holding `key` (an op id, or kMetricOtherOp), added if there is none: the page
// outlives this process, so a restarted worker finds its predecessor's slots. The last slot is
// kept for `other`, so there always is one.
uint32_t WorkerMetricsWriter::find_or_add_slot(uint32_t key) {
  const uint32_t n = std::min(page_->op_count.load(std::memory_order_relaxed), kMaxMetricOps);
  for (uint32_t i = 0; i < n; ++i) {
    if (page_->ops[i].op_id == key) return i;
  }
  if (key != kMetricOtherOp && n >= kMaxMetricOps - 1) return find_or_add_slot(kMetricOtherOp);
  page_->ops[n].op_id = key;
  page_->op_count.store(n + 1, std::memory_order_release);  // the supervisor reads it
  return n;
}

}  // namespace gpuq::daemon
