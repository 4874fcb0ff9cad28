// Which program runs a pool's workers, and whether the pool can run at all for want of it:
//   - a cpu pool: gpuq-worker;
//   - a C++ gpu pool: gpuq-gpu-worker, which a build without CUDA (or a pip install without the
//     gpu extra) does not have: the pool is then unavailable, with a message saying where it was
//     looked for and how to get it;
//   - a Python pool: its interpreter (python_worker_command), with `--gpu` on a gpu pool; it
//     never needs gpuq-gpu-worker (the framework in it owns the CUDA context).
// GPUs from a fake tree or a stand-in NVML (test hooks GPUQ_TEST_GPU_ROOT, GPUQ_TEST_NVML_LIBRARY)
// have no device behind them, so their gpu pools run the CPU backend (gpuq-worker, a Python pool
// without `--gpu`), unless GPUQ_TEST_GPU_WORKER=real asks for the programs chosen as without
// hooks. One decision for plan_pools (which pools are available), WorkerSet::launch_spec (what
// it execs) and gpuqd --check-config (what it prints).
#pragma once

#include <string>

#include "config.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/error.hpp"
#include "test_hooks.hpp"

namespace gpuq::daemon {

// The worker executables gpuqd found (main.cpp: next to itself, else in ../libexec/gpuq).
struct WorkerExecutables {
  std::string worker;      // gpuq-worker
  std::string gpu_worker;  // gpuq-gpu-worker; empty when it is not installed
  // Where they were looked for, for the message of a C++ gpu pool without gpuq-gpu-worker
  // ("next to gpuqd in /usr/bin or in /usr/bin/../libexec/gpuq"); empty: not said.
  std::string searched;
};

enum class WorkerProgramKind {
  kCpuWorker,  // gpuq-worker
  kGpuWorker,  // gpuq-gpu-worker
  kPython,     // the pool's interpreter running gpuq._worker
};

struct WorkerProgram {
  WorkerProgramKind kind = WorkerProgramKind::kCpuWorker;
  std::string path;  // the executable; empty for kPython (the pool's python.interpreter)
  // Its workers use the GPU of their placement: `--gpu` for a Python worker, and the memory
  // limit arguments (--memory-limit-bytes, --memory-limit-fraction).
  bool gpu = false;
};

// Whether the gpu pools run the CPU backend: GPUs from a fake tree or a stand-in NVML
// (`discovery.fake()`), unless the hook GPUQ_TEST_GPU_WORKER=real says otherwise.
bool gpu_pools_on_cpu_backend(const GpuDiscoveryOptions& discovery, const TestHooks& hooks);

// The program of `pool`'s workers. `cpu_backend`: gpu_pools_on_cpu_backend(). Errors: NoDevice
// for a C++ gpu pool without gpuq-gpu-worker, naming where it was looked for and how to install
// it.
Result<WorkerProgram> worker_program(const PoolConfig& pool, const WorkerExecutables& found,
                                     bool cpu_backend);

}  // namespace gpuq::daemon
