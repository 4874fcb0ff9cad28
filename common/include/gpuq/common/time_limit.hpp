// The time limit a running job is held to (docs/design/faults.md, "Jobs that do not end"): the
// smaller of its pool's job_time_limit_ms and its own (JobSlot::time_limit_ms, as its client
// wrote it), 0 on either side meaning none. The job's own limit is untrusted: taking the smaller
// lets a client shorten its pool's limit, never lengthen it. One rule for every process that
// applies it: the supervisor enforces it (JobWatch) and ends a batch's jobs by it when a call
// is stopped (JobRecovery), and the worker names it in a stopped job's message and judges a
// batched call's jobs by it.
#pragma once

#include <cstdint>

namespace gpuq {

constexpr uint32_t effective_time_limit_ms(uint32_t pool_limit_ms, uint32_t own_ms) noexcept {
  return own_ms != 0 && (pool_limit_ms == 0 || own_ms < pool_limit_ms) ? own_ms : pool_limit_ms;
}

}  // namespace gpuq
