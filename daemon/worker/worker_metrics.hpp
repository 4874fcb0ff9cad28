// WorkerMetricsWriter: a worker's side of its job metrics page (gpuq/common/job_metrics.hpp,
// docs/metrics.md): which of the page's slots counts each op, a job's outcome and its queue and
// run times, a batched op's calls and gatherings, and a GPU worker's device memory. Plain loads
// and stores on lines only this worker writes. Not thread-safe: one per worker loop, which
// lends it to its batch runner.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gpuq/common/job_metrics.hpp"
#include "gpuq/common/shm_layout.hpp"

namespace gpuq::daemon {

class WorkerMetricsWriter {
 public:
  // Writes to `page` from now on (the private memfd's, whose bounds and `enabled` the
  // supervisor wrote before the worker started).
  void attach(WorkerMetrics& page) noexcept;

  // Whether this worker collects (config `job_metrics`): record() only when it does.
  bool on() const noexcept { return on_; }
  // The histograms' bounds in job stamp ticks (the supervisor's, from the page).
  const uint64_t* bound_ticks() const noexcept { return bound_ticks_; }

  // Counts an ended job (its op's counts and times, its level's queue wait). From the job's own
  // stamps: no clock read here. The submit stamp is
  // the client's: one in the future counts as no wait, and a wait counts an hour at most.
  void record(const JobDescriptor& d, const JobOutcome& out, MetricOutcome outcome) {
    OpMetrics& m = page_->ops[slot(d.op_id)];
    bump(m.outcomes[static_cast<uint32_t>(outcome)]);
    const uint64_t wait = std::min(
        out.started_stamp > d.submit_stamp ? out.started_stamp - d.submit_stamp : 0, wait_cap_);
    const uint32_t bucket = observe(m, kQueueWait, bound_ticks_, wait);
    observe_wait(page_->level_wait[priority_rank(flags_priority(d.flags))], bucket, wait);
    if (outcome != MetricOutcome::kExpired) {
      observe(m, kRun, bound_ticks_, out.finished_stamp - out.started_stamp);
    }
  }

  // A batched op's calls and gatherings, in the slot of its jobs' counts.
  OpBatchMetrics& batch(uint32_t op_id) { return page_->batch[slot(op_id)]; }

  // The slot of op `op_id`: remembered after the first job of each op. Ids of no op here (a
  // forged descriptor) and ops past the last free slot share the `other` slot.
  uint32_t slot(uint32_t op_id) {
    if (op_id < slot_of_.size() && slot_of_[op_id] != kNoSlot) return slot_of_[op_id];
    return first_slot(op_id);
  }

  // A GPU worker's device memory budget (0: none, not a GPU worker), once after its backend
  // started, and what its jobs hold now.
  void set_memory_budget(uint64_t budget, uint64_t used) noexcept;
  bool tracks_memory() const noexcept { return memory_budget_ != 0; }
  void set_memory_used(uint64_t used) noexcept {
    page_->device_memory_used.store(used, std::memory_order_relaxed);
  }

 private:
  static constexpr uint16_t kNoSlot = UINT16_MAX;
  static constexpr uint32_t kMaxMappedOpIds = 1u << 16;

  uint32_t first_slot(uint32_t op_id);
  uint32_t find_or_add_slot(uint32_t key);

  WorkerMetrics* page_ = nullptr;
  bool on_ = false;
  uint64_t bound_ticks_[kMetricBounds] = {};
  uint64_t wait_cap_ = 0;          // kMaxQueueWaitSeconds in job stamp ticks
  std::vector<uint16_t> slot_of_;  // op id -> slot
  uint64_t memory_budget_ = 0;
};

}  // namespace gpuq::daemon
