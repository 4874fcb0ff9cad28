// StepRunner: a step op's jobs in a worker (docs/design/streams.md, "Step-level batching"), from
// the first one's claim to the last one's end. Each job is a sequence: a state made from its call
// (OpBackend::step_start), then steps until the op says it is done, a part each. The worker loop
// claims, publishes and checks a job of a step op and hands it over; the runner then runs steps
// for all its live sequences at once, one call each (OpBackend::step). Before each step it
//
//   - admits queued jobs of the op at the first job's priority level, up to max_batch_size live
//     sequences, without ever waiting for one (a job that arrives joins at the next step);
//   - ends the sequences whose job was cancelled, passed its time limit (the runner's own clock,
//     or the supervisor's bit on the job it watches) or whose reader stopped reading: their
//     callers already have the parts made so far;
//   - leaves out of the step a stream whose part cells all hold unread parts: a slow reader
//     pauses its own sequence, not the others.
//
// A stream's part is published as soon as its step returns; a job that answers once gets the list
// of its parts when its sequence ends. A step's failure fails the sequences of that step. The
// worker's death fails every live one (the supervisor's recovery ends every RUNNING slot of a
// dead worker); a rollout's hold stops admissions and lets the live ones finish. The steps it
// shares with the batch runner (claim, checks, publication, each job's end) are ClaimedJobs'.
// Not thread-safe: one per worker loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "claimed_jobs.hpp"
#include "stream_writer.hpp"

namespace gpuq::daemon {

class StepRunner {
 public:
  using WorkerParts = ClaimedJobs::WorkerParts;

  explicit StepRunner(const WorkerParts& parts) : jobs_(parts) {}

  // Runs the sequences that `first` starts: a job of a step op with `settings` on this pool,
  // claimed, published and checked as the batch runner's first job is (BatchRunner::run).
  // Returns with every sequence ended and no job published, and a reference popped while
  // admitting that could not join (another op's job, or one of a client not mapped here yet),
  // for the loop to run next; while it holds one it admits no more.
  std::optional<uint32_t> run(ClaimedJob&& first, BatchSettings settings);

 private:
  // A live sequence: its job, its state's key in the backend, its stream's writer.
  struct Sequence {
    ClaimedJob job;
    uint64_t key = 0;
    std::optional<OpContext> ctx;  // refers to job.v: a Sequence never moves
    std::unique_ptr<StreamWriter> writer;
    std::span<std::byte> cell;  // where this step's part goes
    bool ended = false;
  };

  void start(const OpInfo& op, ClaimedJob&& c);
  std::optional<uint32_t> admit(const OpInfo& op, uint32_t op_id, uint32_t rank, uint32_t most);
  void sweep(const OpInfo& op);
  void step(const OpInfo& op, uint32_t op_id);
  void end_ended(const OpInfo& op);
  void wait_for_readers() const;
  const ClaimedJob& governing() const;

  ClaimedJobs jobs_;
  std::vector<std::unique_ptr<Sequence>> live_;
  uint64_t next_key_ = 0;
  // What one step uses, kept for their capacity.
  std::vector<Sequence*> ready_;
  std::vector<StepJob> step_jobs_;
  std::vector<Result<StepOutput>> results_;
};

}  // namespace gpuq::daemon
