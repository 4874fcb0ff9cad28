// OpBackend: what a worker process runs its jobs with. The worker loop (worker_loop.cpp) is
// the same for every pool: it pops, claims, validates, runs and completes jobs. The backend
// supplies the rest: the CPU worker's (gpuq-worker) runs the built-in ops and the tensor ops on
// oneDNN; the GPU worker's (gpuq-gpu-worker) owns a CUDA context, a stream, cuDNN and cuBLAS
// handles and a device memory pool for the worker's whole life.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "gpuq/error.hpp"
#include "ops.hpp"

namespace gpuq::daemon {

// A live sequence of a step op in one step (docs/design/streams.md, "Step-level batching").
struct StepJob {
  uint64_t key = 0;                // the sequence's, from its step_start to its step_end
  const OpContext* ctx = nullptr;  // its job
  // Where this step's part goes: a stream's next part cell (free); for a job that answers once,
  // its output buffer, which gets the list of its parts when it ends.
  std::span<std::byte> cell;
  bool streams = false;
};

// What one step made for one sequence: its part (or, for a job that answers once and ended, its
// whole answer), `bytes` of its cell, and whether the sequence ended with it.
struct StepOutput {
  uint64_t bytes = 0;
  bool done = false;
};

class OpBackend {
 public:
  virtual ~OpBackend() = default;

  // Once, before the worker reports ready. An error is logged and the worker exits 1 (the
  // supervisor's restart back-off and max_start_failures apply).
  virtual Result<void> start() { return {}; }

  // Sent with WorkerReady and shown under the worker in status (a GPU worker: device name,
  // compute capability, memory). An object.
  virtual nlohmann::json describe() const { return nlohmann::json::object(); }

  // A client's payload segment was mapped at `base` (`bytes` long), before any of its jobs
  // runs here; and it is about to be unmapped. A GPU worker registers it as pinned memory.
  virtual void client_mapped(uint32_t /*client*/, void* /*base*/, uint64_t /*bytes*/) {}
  virtual void client_unmapping(uint32_t /*client*/, void* /*base*/, uint64_t /*bytes*/) {}

  // Runs one validated job (its buffers lie inside the client's arena).
  virtual Result<OpOutput> run(const OpInfo& op, const OpContext& ctx) = 0;

  // Runs validated jobs of one batched op (a Python op with max_batch_size > 1; the worker
  // gathered them, docs/python.md "Dynamic batching"), in as few calls as it can: one call
  // with their rows concatenated, where their arguments agree. Appends jobs[i]'s result to
  // `results` in order, and the rows of each call it made to `call_rows`. A call that stopped
  // because a job's time limit passed or its jobs were cancelled ends each of its jobs with
  // Cancelled; the worker then decides, per job, between TimedOut, Cancelled and running it
  // again. The default runs each job alone, as run() does.
  virtual void run_batch(const OpInfo& op, std::span<const OpContext* const> jobs,
                         std::vector<Result<OpOutput>>& results, std::vector<uint32_t>& call_rows) {
    for (const OpContext* ctx : jobs) {
      results.push_back(run(op, *ctx));
      call_rows.push_back(1);
    }
  }

  // A step op's sequences (the step runner, step_runner.hpp). step_start makes the state of the
  // sequence `key` from its job's call (its arguments); step runs one step of the op for
  // `jobs`, all live, appending jobs[i]'s result to `results` in order; step_end forgets a
  // sequence's state (after its last step, or when it stops early). A failure's record goes
  // at the start of the job's output buffer (step_start) or into its cell (step), its size in
  // the job's OpContext::failure_output_bytes. The defaults refuse: no built-in op is one.
  virtual Result<void> step_start(const OpInfo& op, const OpContext& /*ctx*/, uint64_t /*key*/) {
    return Error(ErrorCode::kUnknownOp, std::string(op.name) + ": not a step op");
  }
  virtual void step(const OpInfo& op, std::span<const StepJob> jobs,
                    std::vector<Result<StepOutput>>& results) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      results.push_back(Error(ErrorCode::kUnknownOp, std::string(op.name) + ": not a step op"));
    }
  }
  virtual void step_end(const OpInfo& /*op*/, uint64_t /*key*/) {}

  // The ops this worker has beyond the built-ins, as plugin_op_list() writes them: sent with
  // WorkerReady, and the supervisor refuses a worker whose list is not the one it expects.
  virtual std::string op_list() const { return plugin_op_list(); }

  // Checked after each job, once its outcome is written: true if this worker cannot run
  // another (a sticky CUDA error poisons the context); the worker then exits with status 3 and
  // the supervisor starts a fresh one.
  virtual bool must_exit() const { return false; }

  // A GPU worker's device memory: its budget (0: none, not a GPU worker), read once after
  // start(), and what its jobs hold now, read after each job (for metrics: docs/metrics.md).
  virtual uint64_t device_memory_budget() const { return 0; }
  virtual uint64_t device_memory_used() const { return 0; }
};

// The CPU worker's backend: the built-in ops (OpInfo::run) and, where the build has them, the
// tensor ops. Defined in cpu_backend.cpp.
OpBackend& cpu_backend();

}  // namespace gpuq::daemon
