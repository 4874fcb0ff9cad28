// The worker process: maps the queue segment and every client segment the supervisor hands it,
// pops job references from its pool's ring, validates and runs each job, writes the outcome and
// wakes the client. One job at a time; spin-then-futex when idle.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "gpuq/common/clock.hpp"

namespace gpuq::daemon {

struct WorkerOptions {
  std::string queue_segment;  // name of the queue segment
  uint32_t worker_id = 0;
  uint32_t pool_id = 0;
  pid_t supervisor_pid = 0;  // the worker exits at once if its parent is not this process
  uint32_t spin_us = 50;
  // The pool's job_time_limit_ms (0: none): for the message of a job stopped at it, and for a
  // batched call's jobs (BatchRunner: which one the supervisor watches, which ones a stopped
  // call ends TimedOut). The supervisor enforces the limit.
  uint32_t job_time_limit_ms = 0;
  // How long a streaming job's op waits for its caller to read a part when `window` are unread
  // (the daemon's stream_reader_timeout_ms; 0: no limit): then the job ends Cancelled.
  uint32_t stream_reader_timeout_ms = 60000;
  StampClock job_clock = StampClock::kMonotonic;  // what job stamps count in (clock.hpp)
  int control_fd = 3;                             // SOCK_SEQPACKET to the supervisor
  int private_fd = -1;  // the page only this worker and the supervisor map (WorkerPrivate)
  // A GPU worker's device memory budget (a gpu pool's memory_limit): bytes, or else a fraction
  // of the device's memory in (0, 1]. The CPU worker ignores both.
  uint64_t memory_limit_bytes = 0;
  double memory_limit_fraction = 0.9;
};

class OpBackend;

// Runs the worker until the supervisor tells it to stop (returns 0), a fatal error (1), or
// the backend cannot run another job (3: must_exit()).
int run_worker(const WorkerOptions& options, OpBackend& backend);

// A worker executable's main (gpuq-worker, gpuq-gpu-worker): parses the arguments gpuqd passes
// (usage text under `program`), sets up logging, runs the test hooks, then run_worker() with
// the backend `backend_for` returns for the parsed options. Returns the exit status.
int worker_main(int argc, char** argv, const char* program,
                OpBackend& (*backend_for)(const WorkerOptions&));

}  // namespace gpuq::daemon
