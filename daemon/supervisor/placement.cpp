#include "placement.hpp"

#include <algorithm>
#include <iterator>

#include "gpuq/common/cpu_list.hpp"
#include "gpuq/common/log.hpp"

namespace gpuq::daemon {
namespace {

// A share in one unit: bytes when it has them, else its fraction of a device of `device` bytes
// (0: unknown, then fractions compare as they are).
double amount(const MemoryShare& m) {
  return m.bytes > 0 ? static_cast<double>(m.bytes) : m.fraction;
}

// The GPU's local CPUs that this daemon may use; all of `allowed` when the two sets do not meet
// (a cgroup or taskset that keeps it off the GPU's node) or locality is unknown.
std::vector<int> cpus_near(const GpuInfo& gpu, const std::vector<int>& allowed) {
  std::vector<int> cpus;
  std::set_intersection(gpu.local_cpus.begin(), gpu.local_cpus.end(), allowed.begin(),
                        allowed.end(), std::back_inserter(cpus));
  if (!cpus.empty()) return cpus;
  if (!gpu.local_cpus.empty()) {
    GPUQ_LOG_WARN(
        "GPU %u: none of its local CPUs (%s) is available to the daemon; its workers run on "
        "every available CPU",
        gpu.index, cpu_list_text(gpu.local_cpus).c_str());
  }
  return allowed;
}

}  // namespace

bool needs_restart(const WorkerPlacement& now, const WorkerPlacement& next) {
  if (now.gpu != next.gpu) return true;
  if (now.gpu < 0) return false;
  // A budget in bytes against one in fractions (a memory_limit changed from one to the other):
  // not comparable without the device's size, so a restart.
  if ((now.memory.bytes > 0) != (next.memory.bytes > 0)) return true;
  return amount(next.memory) < amount(now.memory);
}

std::vector<WorkerPlacement> place_cpu_pool(const PoolConfig& pool) {
  std::vector<WorkerPlacement> out;
  for (uint32_t i = 0; i < pool.entries(); ++i) {
    out.push_back({{pool.cpus[i % pool.cpus.size()]}, "-1", -1, {}});
  }
  return out;
}

Result<std::vector<GpuPoolPlacement>> place_gpu_pools(
    const std::vector<PoolConfig>& pools, const std::vector<std::vector<uint32_t>>& pool_gpus,
    const std::vector<GpuInfo>& gpus, const std::vector<int>& allowed) {
  auto budgets = plan_memory_budgets(pools, pool_gpus, gpus);
  if (!budgets) return budgets.error();
  std::vector<GpuPoolPlacement> out(pools.size());
  for (size_t p = 0; p < pools.size(); ++p) {
    const PoolConfig& pool = pools[p];
    if (pool.kind != PoolKind::kGpu || pool_gpus[p].empty()) continue;
    GpuPoolPlacement& placed = out[p];
    placed.gpus = pool_gpus[p];
    placed.memory = (*budgets)[p];
    std::vector<WorkerPlacement> on_gpu;  // one per GPU, in the order of its GPUs
    for (const PoolGpuBudget& budget : placed.memory) {
      const GpuInfo& gpu = gpus[budget.gpu];
      GPUQ_LOG_INFO("pool %s on GPU %u: memory budget %s%s, %u workers (spares included): %s each",
                    pool.name.c_str(), gpu.index, budget.pool.text(gpu.memory_bytes).c_str(),
                    budget.by_default ? " (its share of the default)" : "", budget.workers,
                    budget.worker.text(gpu.memory_bytes).c_str());
      // Without a UUID (a driver that hides it from this user) the index in PCI bus order
      // names the same GPU, given CUDA_DEVICE_ORDER=PCI_BUS_ID.
      const std::string visible = gpu.uuid.empty() ? std::to_string(gpu.index) : gpu.uuid;
      on_gpu.push_back(
          {cpus_near(gpu, allowed), visible, static_cast<int>(budget.gpu), budget.worker});
    }
    // The active workers round robin over the GPUs (entry k on GPU k mod their count), then the
    // growth entries of max_workers the same way on from there: a pool resized live keeps each
    // worker that stays on its GPU, and its new ones spread as its old ones are.
    const uint32_t active = placed.workers(pool);
    const uint32_t most = std::max(active, pool.max_workers);
    for (uint32_t k = 0; k < most; ++k) placed.entries.push_back(on_gpu[k % on_gpu.size()]);
    // Spares after the active workers, spread over the GPUs as workers_on_gpus counts them: a
    // spare takes the place of a worker on its own GPU only (SparePool).
    for (uint32_t k = 0; k < pool.spare_workers; ++k) {
      placed.entries.push_back(on_gpu[k % on_gpu.size()]);
    }
    // Surge seats likewise, on from where the spares stopped (workers_on_gpus counts them the
    // same way): a rollout starts a new worker on the GPU of the one it replaces.
    for (uint32_t k = 0; k < pool.rollout_surge_workers; ++k) {
      placed.entries.push_back(on_gpu[(pool.spare_workers + k) % on_gpu.size()]);
    }
  }
  return out;
}

}  // namespace gpuq::daemon
