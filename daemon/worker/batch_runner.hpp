// BatchRunner: a batched op's jobs in a worker, from the first one's claim to each one's end
// (docs/python.md, "Dynamic batching"; docs/design/faults.md, "Batched calls"). The worker loop
// claims, publishes and checks a job of a batched op (a Python op with max_batch_size > 1) and
// hands it over; the runner pops and claims further queued jobs of that op from the pool's lanes of
// its level while its BatchGatherer wants more, calls the op once for all of them
// (OpBackend::run_batch), and ends each job on its own: its outcome and state in its slot, its
// client woken, its counts. While the call runs, the worker's private page names the job whose time
// limit passes first, for the supervisor to watch; a call stopped at one job's limit ends the jobs
// past their own limit TimedOut and those their clients cancelled Cancelled, and runs the others
// again.
//
// It works on the worker loop's own parts (its lane picker, pages, mapped clients, metrics), which
// the loop keeps owning and using between batches. Not thread-safe: one per worker loop.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "batch_gatherer.hpp"
#include "gpuq/common/job_metrics.hpp"
#include "gpuq/common/pool_queue.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "job_steps.hpp"
#include "job_validation.hpp"
#include "op_backend.hpp"
#include "worker_loop.hpp"
#include "worker_metrics.hpp"

namespace gpuq::daemon {

class BatchRunner {
 public:
  // The parts of its worker a batch works on, all the worker loop's.
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
    // to (worker_loop.cpp, `went_on_`): the runner sets it as each job ends.
    uint64_t& went_on;
  };

  // A job this worker has claimed (its slot RUNNING, naming this worker), from its claim to
  // its end.
  struct Job {
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
  };

  explicit BatchRunner(const WorkerParts& parts) : w_(parts) {}

  // Runs the batch that `first` starts: a job of a batched op with `settings` on this pool,
  // claimed and published on the private page (an odd job_seq), its descriptor copied and
  // validated (`first.v`), with `out.worker_id` and `out.started_stamp` set. Returns with every
  // job of the batch ended and none published (job_seq even, batch_jobs 1), and a reference
  // popped while gathering that could not join (another op's job, or one of a client not mapped
  // here yet), for the loop to run next.
  std::optional<uint32_t> run(Job&& first, BatchSettings settings);

  // When this worker stops gathering for each op (it remembers the op's previous batch).
  const BatchGatherer& gatherer() const noexcept { return gatherer_; }

 private:
  enum class Claim { kClaimed, kDropped, kUnmapped };

  // Within the priority level at `rank` (PoolQueue).
  std::optional<uint32_t> gather(const OpInfo* op, uint32_t op_id, uint32_t rank);
  void call_batch(const OpInfo* op, uint32_t op_id);
  Job& governing();
  Claim claim(uint32_t value, Job& c);
  void take(Job& c);
  void check(Job& c);
  std::optional<uint32_t> queued_op(uint32_t value) const;
  std::optional<uint64_t> queued_rows(uint32_t value) const;
  uint32_t limit_ms(const Job& c) const;
  void republish(const Job& c, uint32_t batch_jobs);
  void unpublish();
  OpContext context(const Job& c) const;
  void run_one(Job& c);
  void settle(Job& c, const Result<OpOutput>& r, const OpContext& ctx);
  void end_job(Job& c, bool yield = true);
  void count(const Job& c);

  WorkerParts w_;
  BatchGatherer gatherer_;
  // What one batch's calls use, kept for their capacity.
  std::vector<Job> batch_;
  std::vector<OpContext> contexts_;
  std::vector<const OpContext*> context_ptrs_;
  std::vector<Result<OpOutput>> results_;
  std::vector<uint32_t> call_rows_;
  std::vector<bool> again_;
  uint32_t published_batch_jobs_ = 1;  // this worker's copy of priv.batch_jobs
};

}  // namespace gpuq::daemon
