// Test hooks: faults that only a test may switch on, through the environment, and only with
// GPUQ_TEST_HOOKS=1 set. Without it every hook is off and the variables below are not even read,
// so a stray variable cannot stall or break a production daemon. docs/service.md lists them.
//
//   GPUQ_TEST_HOOKS=1                   the master switch ("1" exactly; anything else: off)
//   GPUQ_TEST_STALL_MS=N                gpuqd: on SIGUSR2 the supervisor's event loop sleeps
//                                       N ms (1-600000, default 2000): a wedged supervisor,
//                                       for the watchdog tests. Without the switch SIGUSR2
//                                       keeps its default action (terminate).
//   GPUQ_TEST_WORKER_START_DELAY_MS=N   gpuq-worker: sleep N ms (0-600000) before starting,
//                                       i.e. before reporting ready (a slow GPU context)
//   GPUQ_TEST_WORKER_FAIL=ID[,ID...]    gpuq-worker: the workers with these ids exit with
//                                       status 3 before reporting ready (a worker that cannot
//                                       start; after max_start_failures it is marked failed)
//   GPUQ_TEST_GPU_WORKER=real           gpuqd: gpu pools on fake GPUs (GPUQ_TEST_GPU_ROOT,
//                                       GPUQ_TEST_NVML_LIBRARY) run the program they would run
//                                       without hooks (gpuq-gpu-worker, which must be installed;
//                                       a Python pool's interpreter with --gpu) instead of the
//                                       CPU backend (worker_program.hpp)
#pragma once

#include <cstdint>
#include <vector>

#include "gpuq/error.hpp"

namespace gpuq::daemon {

struct TestHooks {
  bool enabled = false;  // GPUQ_TEST_HOOKS=1
  uint32_t stall_ms = 2000;
  uint32_t worker_start_delay_ms = 0;
  std::vector<uint32_t> failing_workers;
  bool real_gpu_worker = false;  // GPUQ_TEST_GPU_WORKER=real
};

// Reads the hooks from the environment. Errors: InvalidArgument naming the variable and its
// value (only when GPUQ_TEST_HOOKS=1). Not thread-safe (getenv).
Result<TestHooks> read_test_hooks();

// gpuq-worker's hooks, run before it starts: sleeps for the start delay, then returns the exit
// status the worker must end with (3 for a failing worker, 2 for a malformed variable), or -1
// to go on. Logs what it does.
int run_worker_test_hooks(uint32_t worker_id);

}  // namespace gpuq::daemon
