// Device memory budgets (docs/config.md, "Device memory budgets"): a gpu pool's memory_limit is
// its budget on each GPU it uses, shared equally by the workers the plan places on that GPU, its
// spares included (a spare holds its context and may be promoted at any time). A pool that sets
// no memory_limit gets an equal share of kDefaultMemoryFraction of the device among the pools on
// that GPU that set none, after the budgets of those that do. The budgets of the pools on one GPU
// may not add up to more than the device: more than 1.0 in fractions, or, where the device's
// memory is known, more than its bytes; such a config is refused (at start, and by
// gpuqd --check-config) with the GPU, the pools and the sum.
//
// Arithmetic only: plan_pools (pool_plan.cpp) calls it once the GPUs are chosen and gives each
// worker's placement its share, which WorkerSet::launch_spec passes to the worker; gpuqd
// --check-config calls it on the same choice and prints the shares.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

// What the pools that set no memory_limit share on a GPU, less what the others take.
inline constexpr double kDefaultMemoryFraction = 0.9;

// An amount of device memory: bytes, or else a fraction of the device.
struct MemoryShare {
  uint64_t bytes = 0;
  double fraction = 0;
  // "4096 MiB", "0.45 of the device"; with the device's memory known, a fraction in MiB too
  // ("0.45 of the device (36864 MiB)").
  std::string text(uint64_t device_bytes = 0) const;
};

// One pool on one of its GPUs.
struct PoolGpuBudget {
  uint32_t gpu = 0;         // index into the GPUs found (GpuDiscovery::gpus)
  uint32_t workers = 0;     // its workers placed there, spares included
  bool by_default = false;  // the pool sets no memory_limit: a share of the default
  MemoryShare pool;         // the pool's budget on this GPU
  MemoryShare worker;       // each of those workers' budget: `pool` / `workers`
};

// The workers (spares and surge seats included) that `pool` places on each of its `gpu_count`
// GPUs, in the order of its GPUs: workers_per_gpu on each, and its spares, then its surge
// seats, round robin from the first (as plan_pools places them).
std::vector<uint32_t> workers_on_gpus(const PoolConfig& pool, size_t gpu_count);

// The budgets of every gpu pool on each of its GPUs: `pool_gpus[p]` lists pool p's GPUs (indexes
// into `gpus`; empty for a cpu pool or an unavailable one). Result[p] follows pool_gpus[p].
// Errors: InvalidArgument naming the GPU, its pools with their budgets, and their sum, when they
// add up to more than the device, or leave nothing of the default for a pool that sets none.
Result<std::vector<std::vector<PoolGpuBudget>>> plan_memory_budgets(
    const std::vector<PoolConfig>& pools, const std::vector<std::vector<uint32_t>>& pool_gpus,
    const std::vector<GpuInfo>& gpus);

}  // namespace gpuq::daemon
