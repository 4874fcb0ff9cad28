// ClaimedJobs: the steps a worker takes with the jobs it claims beyond the one its loop handed
// over, shared by the runners that hold several jobs at once (the batch runner, batch_runner.hpp,
// and the step runner, step_runner.hpp). Which op a queued reference names (a hint), the next
// queued job of an op taken off the pool's lanes and claimed, its own copy of its descriptor and
// its checks, its publication on the private page, its run alone, its end and its counts.
//
// It works on the worker loop's own parts (its lane picker, pages, mapped clients, metrics), which
// the loop keeps owning and using between a runner's jobs. Not thread-safe: one per runner.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "gpuq/common/job_metrics.hpp"
#include "gpuq/common/pool_queue.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "job_steps.hpp"
#include "job_validation.hpp"
#include "op_backend.hpp"
#include "worker_loop.hpp"
#include "worker_metrics.hpp"

namespace gpuq::daemon {

// A job this worker has claimed (its slot RUNNING, naming this worker), from its claim to its
// end.
struct ClaimedJob {
  uint32_t value = 0;  // its packed JobRef
  const MappedClient* mc = nullptr;
  JobSlot* slot = nullptr;
  uint32_t generation = 0;
  JobDescriptor d;  // this worker's copy, validated
  JobOutcome out{};
  JobState final_state = JobState::kDone;
  MetricOutcome outcome = MetricOutcome::kOk;
  std::optional<ValidatedJob> v;  // set once it passed its checks: it may run
  std::string message;            // a failure's
  uint64_t rows = 1;              // its rows (its client's hint, py.r)
  uint64_t claimed_ns = 0;        // when it was claimed (monotonic)
  uint32_t time_limit_ms = 0;     // its own, as its client wrote it

  // Ends it as failed, with `state` and `e`'s code and message (end() writes them).
  void fail(JobState state, MetricOutcome metric, const Error& e);
};

class ClaimedJobs {
 public:
  // The parts of its worker the jobs are handled with, all the worker loop's.
  struct WorkerParts {
    const WorkerOptions& options;  // worker_id, pool_id, job_clock, job_time_limit_ms
    OpBackend& backend;
    LanePicker& lanes;  // the pool's queue, as this worker takes from it
    PoolShm& pool;
    WorkerShm& self;
    WorkerPrivate& priv;
    const MappedClients& clients;
    // The queue segment's client records, by index (`session`: whether a client holds it).
    std::span<const ClientShm> client_records;
    WorkerMetricsWriter& metrics;
    uint64_t& job_seq;  // the loop's copy of priv.job_seq (only this worker writes it)
    // When the last job ended, which the loop takes as the start of a job it goes straight on
    // to (worker_loop.cpp, `went_on_`): end() sets it.
    uint64_t& went_on;
  };

  // What take_next() found at the head of a priority level.
  enum class Next {
    kTaken,    // a job of the op: claimed, copied, checked (`c.v` when it may run), stamped
    kEmpty,    // nothing queued at the level
    kBlocked,  // another op's job, or one `fits` refused: left queued
    kAgain,    // a reference dropped (stale, forged, cancelled first) or a lost race: look again
    kCarried,  // popped but not this op's, or its client is not mapped here yet: `carried`
  };

  explicit ClaimedJobs(const WorkerParts& parts) : w_(parts) {}

  const WorkerParts& parts() const noexcept { return w_; }

  // Takes the job at the head of priority level `rank` (PoolQueue) if it is one of op `op_id`
  // and `fits(rows)` holds for its rows (its client's hint, 1 when unknown): without waiting.
  template <typename Fits>
  Next take_next(uint32_t op_id, uint32_t rank, Fits&& fits, ClaimedJob& c, uint32_t& carried);

  // The op id a queued reference's descriptor names, if its client is mapped here: a hint (the
  // slot is its client's to rewrite until this worker claims it).
  std::optional<uint32_t> queued_op(uint32_t value) const;
  // The rows a queued reference's descriptor says its job has, if its client is mapped here and
  // its params parse: a hint, read as queued_op reads the op (the claim validates the params).
  std::optional<uint64_t> queued_rows(uint32_t value) const;

  // The limit `c`'s run is held to: the smaller of its pool's and its own; 0: none.
  uint32_t limit_ms(const ClaimedJob& c) const;
  // Whether `c`'s limit has passed at `now_ns`: by the runner's own clock, or the supervisor
  // said so (the time-limit bit).
  bool past_limit(const ClaimedJob& c, uint64_t now_ns) const;

  // Whether `c`'s client has left (its record in the queue segment no longer holds the session
  // this worker mapped): the supervisor stops only the job a worker is seen to run, so a runner
  // that holds others looks itself.
  bool client_left(const ClaimedJob& c) const;

  // Makes `c` the job this worker is seen to run, for the supervisor's time limits and status,
  // in place of the one published so far; `batch_jobs`: how many jobs the call serves.
  void republish(const ClaimedJob& c, uint32_t batch_jobs);
  // Not running a job any more (seq_cst: the Dekker pair with the supervisor's `hold`), and the
  // page says one job per call again.
  void unpublish();

  // The op's view of `c`'s buffers (it refers to `c.v`: valid while `c` stays where it is).
  OpContext context(const ClaimedJob& c) const;
  // Runs `c` alone (a stream, or a job that cannot join), and settles it.
  void run_one(ClaimedJob& c);
  // A job taken that cannot join the runner's (it failed its checks, or its client rewrote it
  // since the runner looked): runs alone if it passed its checks, then ends and is counted.
  void finish_alone(ClaimedJob& c);
  // `c`'s end from its op's result.
  void settle(ClaimedJob& c, const Result<OpOutput>& r, const OpContext& ctx);
  // Writes `c`'s outcome and ends it: its client is told. `yield`: hand the core to a client
  // woken here (a call's jobs yield once, after the last).
  void end(ClaimedJob& c, bool yield = true);
  // Counts an ended job, off its client's critical path.
  void count(const ClaimedJob& c);

 private:
  enum class Claim { kClaimed, kDropped, kUnmapped };
  Claim claim(uint32_t value, ClaimedJob& c);
  void take(ClaimedJob& c);
  void check(ClaimedJob& c);

  WorkerParts w_;
  uint32_t published_batch_jobs_ = 1;  // this runner's copy of priv.batch_jobs
};

template <typename Fits>
ClaimedJobs::Next ClaimedJobs::take_next(uint32_t op_id, uint32_t rank, Fits&& fits, ClaimedJob& c,
                                         uint32_t& carried) {
  uint32_t next;
  uint32_t lane;
  if (!w_.lanes.peek_level(rank, &next, &lane)) return Next::kEmpty;
  // Another op's job at the head stays queued, for the next worker free; so does one that does
  // not fit.
  if (queued_op(next).value_or(op_id) != op_id) return Next::kBlocked;
  if (!fits(queued_rows(next).value_or(1))) return Next::kBlocked;
  uint32_t value;
  if (!w_.lanes.pop_lane(lane, &value)) return Next::kAgain;
  if (queued_op(value).value_or(op_id) != op_id) {
    carried = value;
    return Next::kCarried;
  }
  const Claim claimed = claim(value, c);
  if (claimed == Claim::kUnmapped) {
    carried = value;
    return Next::kCarried;
  }
  if (claimed == Claim::kDropped) return Next::kAgain;
  c.out.started_stamp = read_stamp(w_.options.job_clock);
  c.claimed_ns = monotonic_ns();
  take(c);
  check(c);
  return Next::kTaken;
}

}  // namespace gpuq::daemon
