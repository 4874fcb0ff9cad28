// The steps of a job's handling that both paths of the worker take: the loop's path of a job that
// runs alone (worker_loop.cpp, handle_one, written out in one piece for the hot round trip) and
// the batch runner's (batch_runner.cpp, a batched op's jobs). Which client segment a job lies
// in, the claim of its slot, its own time limit, and the error of a job whose op stopped at its
// limit. Header-only: the claim is inlined into the hot path.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/prefetch.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"
#include "ops.hpp"

namespace gpuq::daemon {

// A client segment this worker has mapped (a MapClient from the supervisor).
struct MappedClient {
  uint64_t session = 0;
  MemfdSegment segment;
  ClientSegmentView view;
};
// By client index; empty where no client is mapped.
using MappedClients = std::vector<std::optional<MappedClient>>;

// What claim_slot() did: `slot` is null when it dropped the reference.
struct SlotClaim {
  JobSlot* slot = nullptr;
  uint32_t generation = 0;  // the slot's, full width (a reference holds its low 14 bits)
};

// Claims the job that `value`, a reference popped from the ring of pool `pool_id` (`pool`),
// names in `mc`, its client's segment: its slot SUBMITTED -> RUNNING, naming worker
// `worker_id`. Drops the reference (a null slot) when it names no slot of the segment, when it
// is stale (a cancelled job's, left in the ring, or one for an earlier use of the slot whose
// 14-bit generation happens to match a job now queued on another pool, which that pool's own
// entry runs), or when the client cancelled the job first.
//
// The popped cell is free, and a cell of the client's share is too once its job has left
// SUBMITTED (the client's recount goes by the slot's state): producers blocked on either are
// told right after the claim, or when the reference is dropped. Always inlined: the hot round
// trip goes through here.
[[gnu::always_inline]] inline SlotClaim claim_slot(uint32_t value, const MappedClient& mc,
                                                   PoolShm& pool, uint32_t pool_id,
                                                   uint32_t worker_id) {
  const JobRef ref = JobRef::unpack(value);
  struct SpaceFreed {
    PoolShm& pool;
    bool told = false;
    // After this worker's seq_cst pop (and claim, when there was one): no fence needed.
    void tell() {
      if (!std::exchange(told, true)) pool.space.notify_all_after_rmw();
    }
    ~SpaceFreed() { tell(); }
  } space_freed{pool};
  if (ref.slot >= mc.view.slot_count()) return {};
  JobSlot& slot = mc.view.slot(ref.slot);
  // Both lines were last written by the client: their misses overlap.
  prefetch_for_write(&slot.state);
  prefetch_for_read(&slot.desc);

  uint64_t word = slot.state.load(std::memory_order_acquire);
  const SlotWord sw = SlotWord::unpack(word);
  if (sw.state != JobState::kSubmitted ||
      (sw.generation & JobRef::kGenerationMask) != ref.generation || slot.desc.pool_id != pool_id) {
    return {};
  }
  const SlotWord running{sw.generation, JobState::kRunning, worker_id + 1};
  // seq_cst: the `space` notify below relies on it (EventCount::notify_all_after_rmw).
  if (!slot.state.compare_exchange_strong(word, running.pack(), std::memory_order_seq_cst,
                                          std::memory_order_acquire)) {
    return {};  // the client cancelled it first
  }
  space_freed.tell();
  GPUQ_FAULT_POINT("worker.claimed");
  return {&slot, sw.generation};
}

// A job's own time limit, as its client wrote it with the descriptor (0: none). The client can
// rewrite it at any time: one atomic read.
inline uint32_t own_time_limit_ms(const JobSlot& slot) noexcept {
  return std::atomic_ref<const uint32_t>(slot.time_limit_ms).load(std::memory_order_relaxed);
}

// The outcome of a job whose op stopped at its time limit, `limit_ms` (the one that applied:
// effective_time_limit_ms, gpuq/common/time_limit.hpp).
inline Error time_limit_error(const OpInfo& op, uint32_t limit_ms) {
  return Error(ErrorCode::kTimedOut, std::string(op.name) + ": stopped at the job's time limit (" +
                                         std::to_string(limit_ms) + " ms)");
}

}  // namespace gpuq::daemon
