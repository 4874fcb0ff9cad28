// Where a pool's worker entries run: a cpu pool's on its CPUs, round robin; a gpu pool's on its
// GPUs, each with the GPU's local CPUs, its CUDA_VISIBLE_DEVICES and its share of the pool's
// memory budget there (memory_budget.hpp). plan_pools places every pool at start
// (docs/design/gpu_discovery.md); a config reload places the pools it adds, and the gpu pools
// whose GPUs or budgets it changes, with the same functions (docs/design/live_changes.md).
// Arithmetic on the config and the GPUs found: no state, no I/O but the log.
// assign_placements gives a running pool's entries their places in a new plan by role, keeping
// each worker on its GPU where the plan allows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/error.hpp"
#include "memory_budget.hpp"

namespace gpuq::daemon {

// Where a worker runs (PoolPlan::placements[worker id], WorkerSet's entries).
struct WorkerPlacement {
  std::vector<int> cpus;        // its CPU affinity
  std::string visible_devices;  // CUDA_VISIBLE_DEVICES: "-1" (cpu pool), else the GPU's UUID
  int gpu = -1;                 // index into PoolPlan::discovery.gpus; -1 in a cpu pool
  MemoryShare memory;           // a gpu pool's worker: its device memory budget (memory_budget)
};

// Whether a worker placed at `now` would have to be restarted to run at `next`: another GPU, or
// less of its memory than it was started with (more is no reason: it stays within the plan).
bool needs_restart(const WorkerPlacement& now, const WorkerPlacement& next);

// A cpu pool's entries() placements: its active workers on its `cpus` round robin, then its
// spares and surge seats, each on the CPU of an active worker it may replace.
std::vector<WorkerPlacement> place_cpu_pool(const PoolConfig& pool);

// A gpu pool on its GPUs.
struct GpuPoolPlacement {
  std::vector<uint32_t> gpus;            // indexes into the GPUs found
  std::vector<PoolGpuBudget> memory;     // its budget on each of them, in the order of `gpus`
  std::vector<WorkerPlacement> entries;  // workers_per_gpu per GPU, then spares, surge seats
  // Its active workers: workers_per_gpu on each GPU.
  uint32_t workers(const PoolConfig& pool) const {
    return static_cast<uint32_t>(gpus.size()) * pool.workers_per_gpu;
  }
};

// Every gpu pool on the GPUs `pool_gpus[p]` chose for it (select_gpus; empty: a cpu pool, or
// one that has none, which gets no placement), with the memory budgets of all of them planned
// together (plan_memory_budgets). `allowed`: the CPUs this daemon may use. Result[p] follows
// `pools`. Errors: plan_memory_budgets's (the pools on a GPU promise more than it has).
Result<std::vector<GpuPoolPlacement>> place_gpu_pools(
    const std::vector<PoolConfig>& pools, const std::vector<std::vector<uint32_t>>& pool_gpus,
    const std::vector<GpuInfo>& gpus, const std::vector<int>& allowed);

// A worker entry's role now (WorkerSet: an active worker, a growth entry of max_workers with no
// process, a spare, a surge seat).
enum class EntryRole { kActive, kReserve, kSpare, kSurge };

struct Assigned {
  std::vector<WorkerPlacement> placements;  // by entry, in id order
  std::vector<bool> active;  // by entry: active once the pool has `workers` (resize_pool's rule)
};

// A running pool's entries (`roles` and `now`, in id order) given their places in `plan` (its new
// placement, as place_gpu_pools or place_cpu_pool order it: `workers` active workers, growth
// entries up to `most`, then spares, then surge seats). Which entries are active once the pool
// has `workers` follows WorkerSet::resize_pool (it starts the lowest-id growth entries and
// retires the highest-id active workers). Each entry takes a place of its role (the active ones
// among the plan's first `workers`, and so on); an entry keeps a place on the GPU it is on where
// the plan has one left (roles and places move between entries as spares and rollouts swap
// them, so entry k is not plan place k), the others take the places left, in id order.
// A rollout starts each new worker beside the one it replaces, on its GPU: the first entry that
// stays active (`stays[i]`, an active worker) on a GPU where no spare or surge seat is placed
// (`at`, by entry); -1 when every such GPU has one.
int entry_without_seat(const std::vector<EntryRole>& roles, const std::vector<WorkerPlacement>& at,
                       const std::vector<bool>& stays);

Assigned assign_placements(const std::vector<EntryRole>& roles,
                           const std::vector<WorkerPlacement>& now,
                           const std::vector<WorkerPlacement>& plan, uint32_t workers,
                           uint32_t most);

}  // namespace gpuq::daemon
