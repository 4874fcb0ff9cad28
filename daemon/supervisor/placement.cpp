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

int entry_without_seat(const std::vector<EntryRole>& roles, const std::vector<WorkerPlacement>& at,
                       const std::vector<bool>& stays) {
  std::vector<int> seats;
  for (size_t i = 0; i < roles.size(); ++i) {
    if (roles[i] == EntryRole::kSpare || roles[i] == EntryRole::kSurge) seats.push_back(at[i].gpu);
  }
  for (size_t i = 0; i < roles.size(); ++i) {
    if (roles[i] != EntryRole::kActive || !stays[i]) continue;
    if (std::find(seats.begin(), seats.end(), at[i].gpu) == seats.end()) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

Assigned assign_placements(const std::vector<EntryRole>& roles,
                           const std::vector<WorkerPlacement>& now,
                           const std::vector<WorkerPlacement>& plan, uint32_t workers,
                           uint32_t most) {
  const size_t n = roles.size();
  Assigned out;
  out.placements = now;
  out.active.assign(n, false);
  // Who is active once the pool has `workers`: the active ones, lowest ids first, then growth
  // entries, lowest ids first (resize_pool).
  uint32_t left = workers;
  for (size_t i = 0; i < n && left > 0; ++i) {
    if (roles[i] == EntryRole::kActive) out.active[i] = true, --left;
  }
  for (size_t i = 0; i < n && left > 0; ++i) {
    if (roles[i] == EntryRole::kReserve) out.active[i] = true, --left;
  }
  // The plan's places of each group, and the entries that take them.
  auto fill = [&](size_t first, size_t last, auto member, bool keep_gpu) {
    std::vector<bool> taken(last > first ? last - first : 0, false);
    std::vector<size_t> waiting;
    for (size_t i = 0; i < n; ++i) {
      if (!member(i)) continue;
      bool placed = false;
      for (size_t k = first; keep_gpu && k < last && k < plan.size(); ++k) {
        if (!taken[k - first] && plan[k].gpu == now[i].gpu) {
          taken[k - first] = true;
          out.placements[i] = plan[k];
          placed = true;
          break;
        }
      }
      if (!placed) waiting.push_back(i);
    }
    size_t k = first;
    for (size_t i : waiting) {
      while (k < last && k < plan.size() && taken[k - first]) ++k;
      if (k >= last || k >= plan.size()) break;
      taken[k - first] = true;
      out.placements[i] = plan[k++];
    }
  };
  const auto spares =
      static_cast<size_t>(std::count(roles.begin(), roles.end(), EntryRole::kSpare));
  // Active ones keep their GPU where they can (a worker with a process); growth entries have
  // none to keep.
  fill(
      0, workers, [&](size_t i) { return out.active[i]; }, true);
  fill(
      workers, most,
      [&](size_t i) {
        return !out.active[i] &&
               (roles[i] == EntryRole::kActive || roles[i] == EntryRole::kReserve);
      },
      false);
  fill(
      most, most + spares, [&](size_t i) { return roles[i] == EntryRole::kSpare; }, true);
  fill(
      most + spares, plan.size(), [&](size_t i) { return roles[i] == EntryRole::kSurge; }, true);
  return out;
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
