// The worker process: maps the queue segment and every client segment the supervisor hands it,
// pops job references from its pool's ring, validates and runs each job, writes the outcome and
// wakes the client. One job at a time; spin-then-futex when idle.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace gpuq::daemon {

struct WorkerOptions {
  std::string queue_segment;  // name of the queue segment
  uint32_t worker_id = 0;
  uint32_t pool_id = 0;
  pid_t supervisor_pid = 0;  // the worker exits at once if its parent is not this process
  uint32_t spin_us = 50;
  int control_fd = 3;  // SOCK_SEQPACKET to the supervisor
};

class OpBackend;

// Runs the worker until the supervisor tells it to stop (returns 0), a fatal error (1), or
// the backend cannot run another job (3: must_exit()).
int run_worker(const WorkerOptions& options, OpBackend& backend);

}  // namespace gpuq::daemon
