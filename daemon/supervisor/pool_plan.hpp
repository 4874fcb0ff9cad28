// Where each worker runs: the GPUs found (when a gpu pool asks for them), each pool's worker
// count, each worker's CPUs and CUDA_VISIBLE_DEVICES, and the pools that have nothing to run
// on. Decided once, at start, before any worker exists (docs/design/gpu_discovery.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/error.hpp"
#include "memory_budget.hpp"
#include "placement.hpp"
#include "python_pool.hpp"
#include "test_hooks.hpp"
#include "worker_program.hpp"

namespace gpuq::daemon {

// A pool at run time (PoolPlan::pools[pool]).
struct PoolState {
  bool available = true;  // false: a gpu pool that found no GPU; it has no workers
  std::string reason;     // why it is unavailable
  // A Python pool whose op listing failed: what the interpreter printed (the traceback).
  std::string start_error;
  std::vector<uint32_t> gpus;  // a gpu pool's GPUs, indexes into PoolPlan::discovery.gpus
  WorkerProgram program;       // what its workers run (worker_program.hpp)
  // A gpu pool's memory budget on each of its GPUs, in the order of `gpus` (memory_budget.hpp).
  std::vector<PoolGpuBudget> memory;
  // Added by a config reload and not yet accepting jobs (its ops listed, or rollouts it waits
  // for): not in the catalog, so no client sends it a job before it can take one.
  bool adding = false;
};

struct PoolPlan {
  std::vector<WorkerPlacement> placements;  // by worker id
  std::vector<PoolState> pools;             // by pool
  GpuDiscovery discovery;                   // what discovery found
  bool discovery_ran = false;               // only when a gpu pool is configured
  // The gpu pools run the CPU backend (fake GPUs: gpu_pools_on_cpu_backend, worker_program.hpp);
  // a gpu pool a reload adds runs what those at start run.
  bool gpu_cpu_backend = false;
  std::string nvml_library = kNvmlLibrary;  // what discovery loaded; the GPU sampler loads it too
};

// Finds the GPUs (when a gpu pool asks for them), decides each pool's workers and where they
// run, what they run (worker_program), and sets each gpu pool's worker count in `config`. A gpu
// pool with no GPU (or a C++ gpu pool without gpuq-gpu-worker: `found.gpu_worker` empty) is
// unavailable, not an error. `hooks`: the test hooks (fake GPUs, GPUQ_TEST_GPU_WORKER). Call
// while the process is single-threaded (discovery may fork). Errors: InvalidArgument when the
// GPUs found make a pool too large (check_pool_sizes), or the memory budgets of the pools on a
// GPU add up to more than it (plan_memory_budgets).
Result<PoolPlan> plan_pools(Config& config, const WorkerExecutables& found, const TestHooks& hooks);

// The plug-ins' ops, from a child per plug-in (`worker_path --list-plugin-ops`): the supervisor
// never dlopens a plug-in (it may link CUDA). Registers them (ids follow config order, as in
// the workers). Errors: the plug-in that could not be listed, or a clash of op names.
Result<void> learn_plugin_ops(const Config& config, const std::string& worker_path);

// The Python pools' ops, from a child per pool (learn_python_pool, python_pool.hpp: the
// interpreter running gpuq._worker --list-ops, with the GPU hidden): registers them
// (add_python_op, after the plug-in ops). A pool whose
// interpreter is not found or whose listing fails (an import error, a bad op) is unavailable,
// with the traceback in `plan` (PoolState::start_error); the other pools serve. Resolves each
// pool's interpreter to an absolute path (PATH). Call after plan_pools, single-threaded.
void learn_python_ops(Config& config, PoolPlan& plan);

}  // namespace gpuq::daemon
