// ConfigReload: `gpuqctl reload` and SIGHUP (docs/design/live_changes.md, "Config reload").
// The config file gpuqd was started with is read again and checked by the same code as at start
// and by `gpuqd --check-config` (load_config), compared with the config it runs on
// (diff_configs) and, only when nothing in it is refused, applied:
//   - daemon keys that change live take effect at once;
//   - a pool's job_time_limit_ms takes effect at once; a Python pool whose modules, path,
//     environment or interpreter changed, or a pool whose worker_spin_us changed, is rolled
//     (PoolRollout). A rollout that fails (the new modules do not import) puts that pool's
//     settings back: its old workers serve on, and the reload's reply says why;
//   - an added pool (in a free pool record of max_pools) has its entries placed (a cpu pool's on
//     its CPUs, a gpu pool's on its GPUs with its budget) and its workers started, after its
//     ops are listed (a Python pool: OpListings, as a rollout lists); then it accepts jobs and
//     the catalog is published, so connected clients see it. One whose modules do not import is
//     not added (its record is given back when it is the last one taken, else kept as a removed
//     pool's);
//   - the gpu pools' GPUs and memory budgets are planned again together (replan_gpus) when one
//     is added or its gpus or memory_limit change: a running pool whose worker would move to
//     another GPU or get less memory is rolled onto its new placement; the rollouts that shrink
//     pools run first, then those that move pools onto other GPUs, then added gpu pools start
//     (docs/design/live_changes.md, "Gpu pools: GPUs and memory budgets planned again");
//   - a removed pool stops accepting (a submit gets UnknownPool, "removed by a reload"), its
//     queued and running jobs finish, then its workers stop; its record stays reserved. The
//     catalog is published again, so connected clients no longer list it.
// The reply (ReloadReply, one line per change) goes when the rollouts it started have ended.
// Not thread-safe: the supervisor's loop owns it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "catalog.hpp"
#include "config.hpp"
#include "config_change.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"
#include "job_recovery.hpp"
#include "op_listing.hpp"
#include "pool_outage.hpp"
#include "pool_plan.hpp"
#include "pool_rollout.hpp"
#include "worker_set.hpp"

namespace gpuq::daemon {

class ConfigReload {
 public:
  struct Parts {
    Config* config = nullptr;  // the config gpuqd runs on (changed in place)
    std::string path;          // the file it was started with; empty: none
    const QueueView* queue = nullptr;
    WorkerSet* workers = nullptr;
    PoolRollout* rollouts = nullptr;
    PoolOutage* outage = nullptr;
    Catalog* catalog = nullptr;
    JobRecovery* recovery = nullptr;
    PoolPlan* plan = nullptr;  // an added pool's PoolState goes here
    const WorkerExecutables* executables = nullptr;
    OpListings* listings = nullptr;  // an added Python pool's ops
  };
  // `file_config`: the config as the file said at start (before the supervisor resolved the
  // interpreters and the gpu pools' workers): what the next reload is compared with.
  ConfigReload(Parts parts, Config file_config);

  // A reload's end: who asked (a connection id; 0: SIGHUP), and its lines or why it failed.
  using Done = std::function<void(uint64_t requester, const Result<std::vector<std::string>>&)>;
  void set_on_done(Done fn) { on_done_ = std::move(fn); }

  // Reads the file again and applies it; on_done runs now (an error, nothing to roll) or when
  // the rollouts it started have ended. `draining`: gpuqd is draining (ShuttingDown).
  void request(uint64_t requester, bool draining);
  // A rollout of `pool` has ended (PoolRollout's on_end).
  void rollout_ended(uint32_t pool, const Result<void>& outcome);
  // Removed pools' drains: a pool with nothing queued and nothing running has its workers
  // stopped; one still busy after drain_timeout_ms has its queued jobs failed first.
  void tick(uint64_t now);
  // Whether a removed pool still drains (its workers not yet told to stop).
  bool draining(uint32_t pool) const;
  // Whether `pool` is being added, its ops being listed: OpListings' on_done goes to listed().
  bool adding(uint32_t pool) const;
  void listed(uint32_t pool, Result<std::vector<ListedPythonOp>> ops,
              const PythonListingDetail& detail);

 private:
  // A gpu pool's placement: its entries' (by id), its GPUs and budgets; `roll`: a worker must
  // be restarted for it (needs_restart), so the pool is rolled once it is placed.
  struct Placed {
    uint32_t pool = 0;
    std::vector<WorkerPlacement> entries;
    std::vector<uint32_t> gpus;
    std::vector<PoolGpuBudget> memory;
    bool roll = false;
  };
  struct Pending {
    uint64_t requester = 0;
    std::vector<std::string> lines;
    std::vector<uint32_t> rolling;  // pools whose rollout it waits for
    std::vector<uint32_t> adding;   // added Python pools whose listing it waits for
    // In order once `rolling` is empty (advance), so that no GPU is promised more than it has
    // at any moment: first `later`, gpu pools that move onto other GPUs (placed and rolled
    // once the pools there have rolled to smaller budgets) or whose shares only grow (placed);
    // then `grow`, gpu pools that grow (to this many workers); then `deferred`, added gpu
    // pools started.
    std::vector<Placed> later;
    std::vector<std::pair<uint32_t, uint32_t>> grow;
    std::vector<uint32_t> deferred;
    std::vector<std::string> failures;
    bool rollout_failed = false;  // then nothing of `later`, `grow` or `deferred` happens
    // Each changed pool's settings before the reload, put back if its rollout (or one it
    // waits for) fails, and its placement.
    std::vector<std::pair<uint32_t, PoolConfig>> before;
    std::vector<std::pair<uint32_t, PoolConfig>> file_before;
    std::vector<Placed> placed_before;
    // Each added pool's entries' placements (start_added).
    std::vector<std::pair<uint32_t, std::vector<WorkerPlacement>>> added_at;
  };
  // The gpu pools planned again (replan_gpus): placed[p] for every pool as it will run (the
  // running ones by id, then the added ones in their order); `by_id`: each running gpu pool
  // whose placement changes, its entries' new placements by id (assign_placements); `movers`:
  // those where a worker with a process changes GPU. Those a worker must be restarted for are
  // marked to roll in the change.
  struct GpuPlan {
    std::vector<GpuPoolPlacement> placed;
    std::vector<std::pair<uint32_t, std::vector<WorkerPlacement>>> by_id;
    std::vector<uint32_t> movers;
  };
  struct Removal {
    uint32_t pool = 0;
    uint64_t deadline_ns = 0;
  };
  // Checks the file and applies it: refused whole (an error, nothing changed), or applied with
  // its Pending in pending_ (advance() sends the reply once its rollouts have ended).
  Result<void> apply(uint64_t requester);
  // Every gpu pool's GPUs and memory budgets, planned again as the file says now, with those of
  // the pools it adds (`added`: their workers set, as plan_pools sets them at start). A running
  // pool that a worker would have to leave its GPU for, or have less memory, is marked to roll
  // in `change` (a line "memory budget" when the file did not change it). Errors: what would
  // refuse the reload (a GPU that is not there, too many workers, budgets past a device, a pool
  // to roll without a seat on each of its GPUs).
  Result<GpuPlan> replan_gpus(ConfigChange& change, const Config& next,
                              std::vector<PoolConfig>& added) const;
  // The next steps of the pending reload once its rollouts have ended (later, grow, deferred),
  // and its reply when nothing is left. Not inside apply or itself: a rollout that ends inside
  // them is only recorded (rollout_ended), and they look again.
  void advance();
  // An added pool's entries placed and started; it accepts jobs. Errors: the first start's.
  Result<void> start_added(const Pending& pending, uint32_t pool);
  // The gpu pools that grow grown, the deferred gpu pools started (or, when a rollout of the
  // reload failed, neither: the growth's settings back, the pools not added).
  void start_deferred();
  // A pool whose rollout (or one it waits for) failed, or never started: its settings and
  // placement before the reload.
  void put_back(Pending& p, uint32_t pool);
  void place(const Placed& at);
  // Its rollout started: `p` waits for it; one that cannot start is a failed rollout.
  void start_rollout(Pending& p, uint32_t pool);
  // An added pool that could not start: not offered, its record back when it is the last.
  void forget_added(uint32_t pool);
  void finish();

  Parts parts_;
  Config file_config_;
  std::vector<Pending> pending_;  // at most one
  bool applying_ = false;         // inside apply()
  bool advancing_ = false;        // inside advance()
  std::vector<Removal> removals_;
  Done on_done_;
};

}  // namespace gpuq::daemon
