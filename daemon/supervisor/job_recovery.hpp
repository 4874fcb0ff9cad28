// The supervisor's decisions about jobs that would otherwise be lost (docs/design/faults.md):
//   - a worker died while running a job: the job is retried once if it is retryable (back to
//     SUBMITTED and into its ring), else it fails with WorkerDied;
//   - a worker died between popping a job's reference and claiming the slot: the reference is
//     pushed again (now, or on a later tick when the ring is full);
//   - the audit of what clients can overwrite in the queue segment (every kAuditNs while clients
//     are connected): ring positions that jumped are moved back, cells no producer or consumer
//     wrote are retired, and a SUBMITTED job in no ring for kLostAfterNs is pushed again;
//   - a pool that is down (PoolOutage): the jobs queued in its ring fail with PoolDown.
// It reads and writes the clients' segments and the rings; it never talks to a process.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "client_registry.hpp"
#include "config.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/job_ring.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "job_watch.hpp"

namespace gpuq::daemon {

class JobRecovery {
 public:
  static constexpr uint64_t kAuditNs = 100'000'000;
  static constexpr uint64_t kLostAfterNs = 1'000'000'000;

  // `job_clock`: what job stamps count in (decided at start; read when a job is failed).
  JobRecovery(const Config& config, QueueView& queue, const ClientRegistry& clients,
              const StampClock& job_clock)
      : config_(config), queue_(queue), clients_(clients), job_clock_(job_clock) {}

  // Worker `worker` of `pool` has exited (`why` goes into each failed job's message): its
  // running job is retried or failed, and references it took are pushed again. `forced`: the
  // supervisor stopped it for that job (JobWatch), which then ends as `forced` says, never
  // retried.
  void worker_died(uint32_t worker, uint32_t pool, const std::string& why,
                   const ForcedEnd* forced = nullptr);
  // Pool `pool` is down (no ready worker for pool_down_fail_ms): takes every entry out of its
  // ring, as a worker would, and ends each job that is still SUBMITTED FAILED with PoolDown
  // and `why` (which names the pool and its last worker's exit). Emptying the ring also lets
  // producers blocked for room, and departed clients' indexes, move on. Called on every round
  // of the loop while the pool is down: a client that read `accepting` just before the pool
  // went down may still push one job. Returns the number of jobs failed.
  uint32_t fail_queued(uint32_t pool, const std::string& why);
  // The client with `session` has left: its retry records go.
  void client_left(uint64_t session);
  // On each timer tick: references that found a full ring are pushed again; the audit runs
  // every kAuditNs.
  void tick(uint64_t now);
  // References waiting for room in a full ring (the loop keeps its fast tick while so).
  bool pending() const { return requeue_pending_ != 0; }

  // Counters for status, by pool (0 in honest traffic).
  uint64_t cells_retired(uint32_t pool) const { return cells_retired_[pool]; }
  uint64_t positions_restored(uint32_t pool) const { return hints_restored_[pool]; }
  uint64_t jobs_requeued(uint32_t pool) const { return jobs_requeued_[pool]; }
  // Jobs of `pool` failed with PoolDown (fail_queued).
  uint64_t jobs_failed_down(uint32_t pool) const { return jobs_failed_down_[pool]; }

  // Jobs this side ended, for metrics (docs/metrics.md): by {pool, op id as the descriptor
  // says, outcome ("worker_died", "timed_out", "cancelled", "pool_down")}; and workers stopped by
  // force for a job past its time limit, by pool.
  using EndedKey = std::tuple<uint32_t, uint32_t, std::string>;
  const std::map<EndedKey, uint64_t>& jobs_ended() const { return jobs_ended_; }
  uint64_t time_limit_kills(uint32_t pool) const { return time_limit_kills_[pool]; }

 private:
  // `batch_mate`: a job of a batched call stopped at another job's time limit, run again
  // whether it is retryable or not (once, as a retry).
  bool retry(const Client& client, uint32_t slot_index, JobSlot& slot, uint64_t running_word,
             const std::string& why, bool batch_mate = false);
  void requeue_lost(uint32_t pool);
  // Calls fn(client, slot, reference) for every live client's job that is SUBMITTED to `pool`
  // but whose reference is in no cell of its ring.
  void for_each_job_in_no_ring(
      uint32_t pool, const std::function<void(const Client&, uint32_t slot, uint32_t ref)>& fn);
  void audit_ring(uint32_t pool);
  void audit_lane(uint32_t pool, uint32_t lane);
  bool fail_popped(uint32_t pool, uint32_t value, const std::string& why);
  uint32_t lane_of(const Client& conn, uint32_t slot, uint32_t pool) const;
  void audit_submitted(uint32_t pool, uint64_t now);

  const Config& config_;
  QueueView& queue_;
  const ClientRegistry& clients_;
  std::map<EndedKey, uint64_t> jobs_ended_;
  uint64_t time_limit_kills_[kMaxPools] = {};
  const StampClock& job_clock_;
  // Retryable jobs already run again after a worker death: {client session, slot, generation}.
  std::set<std::tuple<uint64_t, uint32_t, uint32_t>> retried_;
  // Pools (bit p) with a job a dead worker took that did not fit back into the full ring yet.
  uint32_t requeue_pending_ = 0;
  uint64_t next_audit_ns_ = 0;
  // One per lane of each pool's queue (PoolQueue).
  std::vector<RingAudit> ring_audits_[kMaxPools];
  using LostKey = std::tuple<uint32_t, uint64_t, uint32_t, uint32_t>;  // pool, session, slot, gen
  std::map<LostKey, uint64_t> lost_since_;  // SUBMITTED jobs in no ring: first seen (ns)
  uint64_t cells_retired_[kMaxPools] = {};
  uint64_t hints_restored_[kMaxPools] = {};
  uint64_t jobs_requeued_[kMaxPools] = {};
  uint64_t jobs_failed_down_[kMaxPools] = {};
};

}  // namespace gpuq::daemon
