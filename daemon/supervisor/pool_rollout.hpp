// PoolRollout: rolling restarts of a pool (`gpuqctl restart POOL`; docs/design/live_changes.md).
// A rollout raises the pool's generation (what processes started from then on run) and replaces
// its running workers one by one: a new process is started in a seat (a spare of the pool, or a
// surge seat, rollout_surge_workers), held out of the ring until it is ready (modules imported,
// on_start run, a GPU context made), then takes an old active worker's place (SparePool's swap:
// placements and roles trade), and the old one takes no further job, ends the one it runs and
// exits. Old spares are retired and started again at the new generation first. The pool never
// has fewer ready active workers than before, and nothing here touches a job or a ring.
//
// A Python pool's rollout first lists the pool's ops anew (OpListings, without blocking the
// loop): a version that does not import is refused before any process starts; ops added or
// removed are registered (set_python_pool_ops: names keep their ids, new ones get new ids) and
// the new workers get the new list. The catalog clients see changes when the rollout ends
// (on_ops_changed), once new workers serve; a rollout that fails before any swap puts the old
// list back.
//
// If a new process does not become ready (an import error, on_start raising, start_timeout_ms,
// an exit), the rollout stops: no further swap, the old workers serve on, and the reason (the
// new worker's stderr tail) is kept until the next rollout of the pool.
//
// next_step() is the whole decision, pure, from the pool's entries; the rest drives it from the
// supervisor's events. Not thread-safe: the supervisor's loop only.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gpuq/error.hpp"
#include "op_listing.hpp"
#include "spare_pool.hpp"
#include "worker_set.hpp"

namespace gpuq::daemon {

// What next_step() needs to know of one entry of the pool.
struct RolloutSeat {
  enum class Role { kActive, kSpare, kSurge };
  uint32_t id = 0;
  Role role = Role::kActive;
  int gpu = -1;               // WorkerPlacement::gpu
  bool running = false;       // has a process
  bool ready = false;         // ... that reported ready
  bool retiring = false;      // ... told to stop after its job (WorkerSet::retire)
  bool awaits_start = false;  // no process, to be started again by the WorkerSet
  uint32_t generation = 0;    // of its process
};

struct RolloutStep {
  enum class Kind {
    kWait,         // something is starting or stopping: look again at the next event
    kRetireSpare,  // `seat`, an old spare, stops (the WorkerSet starts it again, new)
    kStartSurge,   // start dormant surge seat `seat` (at the new generation)
    kTakeOver,     // `seat` (ready, new) takes the place of active worker `old`
    kDone,         // every running entry is of the new generation
    kFail,         // no seat for `old`: `why`
  };
  RolloutStep(Kind k = Kind::kWait, uint32_t seat_id = 0, uint32_t old_id = 0,
              std::string reason = {})
      : kind(k), seat(seat_id), old(old_id), why(std::move(reason)) {}
  Kind kind;
  uint32_t seat;
  uint32_t old;
  std::string why;
};

class PoolRollout {
 public:
  // `listings`: where a Python pool's ops are listed anew; null: they are not (a test's).
  PoolRollout(WorkerSet& workers, SparePool& spares, const Config& config,
              OpListings* listings = nullptr);

  // Pure: what a rollout of a pool to `generation` does next, given the pool's entries.
  static RolloutStep next_step(std::span<const RolloutSeat> seats, uint32_t generation);

  // Called when a rollout ends: its pool, and whether it completed (else why not).
  void set_on_end(std::function<void(uint32_t pool, const Result<void>&)> fn) {
    on_end_ = std::move(fn);
  }

  // Called when a rollout that ends changed the pool's ops (some new worker serves them): the
  // catalog is to be published again.
  void set_on_ops_changed(std::function<void(uint32_t pool)> fn) {
    on_ops_changed_ = std::move(fn);
  }

  // Starts a rollout of `pool`: its generation is raised. Returns it. Errors: NotFound when
  // the pool has no workers (an unavailable gpu pool: its reason), InvalidArgument when a
  // rollout of it is in progress already; the listing's start (a Python pool).
  Result<uint32_t> start(uint32_t pool);
  // Whether start(pool) would begin now: the pool has workers, none of its rollouts runs, and
  // it has a seat for a new worker (a spare or a surge seat). A config reload asks before it
  // changes anything. Errors: start()'s, and InvalidArgument naming the keys for a seat.
  // `seats_per_gpu`: also that each GPU of its active workers has a seat, as they are placed
  // now (a reload that places the pool anew checks its new placement itself).
  Result<void> can_start(uint32_t pool, bool seats_per_gpu = true) const;
  // Whether the pool's last (or current) rollout has swapped a new worker in.
  bool swapped(uint32_t pool) const { return pools_[pool].swapped; }
  // A Python pool's listing has ended (OpListings' on_done): the rollout goes on with the ops
  // listed, or stops, naming why (the module that failed, the stderr's tail).
  void listed(uint32_t pool, Result<std::vector<ListedPythonOp>> ops,
              const PythonListingDetail& detail);
  // A worker of some pool has exited (reaped): a new process of a rollout that died before it
  // was ready fails its rollout.
  void worker_exited(const Worker& w);
  // Advances every rollout in progress (after each event: a worker ready, an exit, a tick).
  void step();
  // Ends every rollout in progress, failed with `why` (the daemon drains).
  void abort_all(const std::string& why);

  bool in_progress(uint32_t pool) const { return pools_[pool].running; }
  // Why the pool's last rollout failed; empty when it completed (or none ran).
  const std::string& last_failure(uint32_t pool) const { return pools_[pool].failure; }
  uint64_t rollouts(uint32_t pool) const { return pools_[pool].completed; }
  uint64_t failures(uint32_t pool) const { return pools_[pool].failed; }

 private:
  struct PoolRolling {
    bool running = false;
    bool listing = false;                 // waiting for the pool's ops listed anew
    bool swapped = false;                 // a new worker has taken an old one's place
    bool ops_changed = false;             // the listing changed the pool's op names
    std::vector<ListedPythonOp> old_ops;  // the pool's ops before the listing
    std::string failure;
    uint64_t completed = 0;
    uint64_t failed = 0;
  };
  std::vector<RolloutSeat> seats_of(uint32_t pool) const;
  void advance(uint32_t pool);
  void end(uint32_t pool, const Result<void>& outcome);

  WorkerSet& workers_;
  SparePool& spares_;
  const Config& config_;
  OpListings* listings_;
  std::vector<PoolRolling> pools_;
  std::function<void(uint32_t, const Result<void>&)> on_end_;
  std::function<void(uint32_t)> on_ops_changed_;
};

}  // namespace gpuq::daemon
