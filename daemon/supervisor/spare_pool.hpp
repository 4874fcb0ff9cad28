// Spare workers (a pool's `spare_workers`; docs/design/faults.md, "Spare workers"): worker
// entries started and made ready like the others (modules imported, on_start run, a GPU
// context made) but held out of the ring (WorkerPrivate::hold == kHoldSpare, set before the
// process starts), each to take the place of an active worker of its pool that dies or is
// stopped, in milliseconds instead of a whole start.
//
// A promotion swaps two entries' roles: the ready spare becomes active with the dead worker's
// placement (its threads re-pinned to that worker's CPUs; on a gpu pool only a spare on the
// same GPU qualifies), its `hold` is lowered and WorkerPromote wakes it; the dead entry becomes
// the spare and is started again as one, after its own back-off (WorkerSet). The jobs the dead
// worker had are recovered as before (JobRecovery); nothing here touches a job.
//
// Not thread-safe: the supervisor's loop only.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "gpuq/common/shm.hpp"
#include "process_launcher.hpp"
#include "worker_set.hpp"

namespace gpuq::daemon {

// What pick() needs to know of a worker entry.
struct SpareSeat {
  uint32_t pool = 0;
  int gpu = -1;  // WorkerPlacement::gpu
  bool spare = false;
  bool ready = false;  // running and has reported ready
  const std::vector<int>* cpus = nullptr;
};

class SparePool {
 public:
  SparePool(WorkerSet& workers, const QueueView& queue, ProcessLauncher& launcher,
            uint32_t pool_count);

  // Which spare should take the place of entry `vacant` (an active entry with no ready
  // process): a ready spare of its pool on its GPU, one already pinned to its CPUs when there
  // is one, else the lowest id; nothing when none qualifies (or `vacant` is a spare itself).
  // Pure.
  static std::optional<uint32_t> pick(std::span<const SpareSeat> seats, uint32_t vacant);

  // Worker `vacant`'s process has just been reaped (WorkerSet::reap, not started again yet),
  // or killed by WorkerSet::force_stop (its `hold` up: it takes no job while it dies). If it
  // was active and a spare qualifies (pick), that spare takes its place now, and `vacant`
  // becomes a spare (its next start is a spare's; a second call for it, at its reap, does
  // nothing). Returns the promoted worker's id.
  std::optional<uint32_t> vacated(Worker& vacant);
  // Spare `w` has just reported ready: if an active entry of its pool on its GPU has no process
  // (waiting for its restart after a death, or failed), `w` takes its place at once.
  std::optional<uint32_t> spare_ready(Worker& w);

  // A rollout's swap (PoolRollout): `seat` (a spare or surge seat, ready, held out of the ring)
  // takes the place of `old`, an active worker still serving; `old` gets the seat's role and
  // `hold`, takes no further job, and retires once its running job ends (WorkerSet::retire).
  // Not counted as a promotion.
  void take_over(Worker& seat, Worker& old);

  // Spares promoted in pool `pool` since start.
  uint64_t promotions(uint32_t pool) const { return promotions_[pool]; }

 private:
  std::vector<SpareSeat> seats() const;
  void promote(Worker& spare, Worker& vacant, bool count = true);
  void pin(const Worker& w, const std::vector<int>& cpus);

  WorkerSet& workers_;
  const QueueView& queue_;
  ProcessLauncher& launcher_;
  std::vector<uint64_t> promotions_;
  // Promotions at a forced stop whose pinning waits for the stopped process's exit:
  // {stopped worker, promoted worker}. Until then the promoted one may run on any CPU of its
  // pool: the kernel tears the stopped process down on that process's own CPU, for tens of
  // milliseconds with a large address space, and the promoted worker would wait behind it.
  std::vector<std::pair<uint32_t, uint32_t>> pin_at_exit_;
};

}  // namespace gpuq::daemon
