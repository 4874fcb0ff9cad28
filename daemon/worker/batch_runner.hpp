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
// The steps it shares with the step runner (the claim, the checks, the publication, each job's
// end) are ClaimedJobs'. Not thread-safe: one per worker loop.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "batch_gatherer.hpp"
#include "claimed_jobs.hpp"

namespace gpuq::daemon {

class BatchRunner {
 public:
  using WorkerParts = ClaimedJobs::WorkerParts;
  using Job = ClaimedJob;

  explicit BatchRunner(const WorkerParts& parts) : jobs_(parts) {}

  // Runs the batch that `first` starts: a job of a batched op with `settings` on this pool,
  // claimed and published on the private page (an odd job_seq), its descriptor copied and
  // validated (`first.v`), with `out.worker_id` and `out.started_stamp` set. Returns with every
  // job of the batch ended and none published (job_seq even, batch_jobs 1), and a reference
  // popped while gathering that could not join (another op's job, or one of a client not mapped
  // here yet), for the loop to run next.
  std::optional<uint32_t> run(Job&& first, BatchSettings settings);

  // When this worker stops gathering for each op (it remembers the op's previous batch).
  const BatchGatherer& gatherer() const noexcept { return gatherer_; }
  BatchGatherer& gatherer() noexcept { return gatherer_; }

 private:
  // Within the priority level at `rank` (PoolQueue).
  std::optional<uint32_t> gather(const OpInfo* op, uint32_t op_id, uint32_t rank);
  void call_batch(const OpInfo* op, uint32_t op_id);
  Job& governing();

  ClaimedJobs jobs_;
  BatchGatherer gatherer_;
  // What one batch's calls use, kept for their capacity.
  std::vector<Job> batch_;
  std::vector<OpContext> contexts_;
  std::vector<const OpContext*> context_ptrs_;
  std::vector<Result<OpOutput>> results_;
  std::vector<uint32_t> call_rows_;
  std::vector<bool> again_;
};

}  // namespace gpuq::daemon
