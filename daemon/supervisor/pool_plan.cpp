#include "pool_plan.hpp"

#include <algorithm>

#include "gpuq/common/cpu_list.hpp"
#include "gpuq/common/log.hpp"
#include "ops.hpp"
#include "plugins.hpp"

namespace gpuq::daemon {
namespace {

// NVML's first initialisation without persistence mode takes seconds per GPU; a driver that
// takes longer than this is wedged, and the gpu pools are unavailable rather than the daemon
// stuck before READY=1 (systemd's TimeoutStartSec= is 120 s).
constexpr uint32_t kGpuDiscoveryTimeoutMs = 30'000;
constexpr uint32_t kPluginListTimeoutMs = 30'000;

}  // namespace

Result<void> learn_plugin_ops(const Config& config, const std::string& worker_path) {
  for (const std::string& path : config.plugins) {
    auto ops = list_plugin_ops_isolated(worker_path, path, kPluginListTimeoutMs);
    if (!ops) return ops.error();
    for (const PluginOp& op : *ops) {
      GPUQ_LOG_INFO("plug-in %s: op %s (%s%s%s)", path.c_str(), op.name.c_str(),
                    op.has_cpu ? "cpu" : "", op.has_cpu && op.has_gpu ? ", " : "",
                    op.has_gpu ? "gpu" : "");
    }
    if (auto r = add_plugin_ops(std::move(*ops)); !r) return r;
  }
  return {};
}

void learn_python_ops(Config& c, PoolPlan& plan) {
  uint32_t first_worker = 0;
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    PoolConfig& pool = c.pools[p];
    const uint32_t workers = pool.entries();
    if (!pool.python || !plan.pools[p].available) {
      first_worker += workers;
      continue;
    }
    PythonListingDetail detail;
    auto ops = learn_python_pool(pool, p, &detail);
    if (ops) {
      for (const ListedPythonOp& op : *ops) {
        GPUQ_LOG_INFO("pool %s: python op %s (id %u)", pool.name.c_str(), op.name.c_str(), op.id);
      }
      first_worker += workers;
      continue;
    }
    // Unavailable, not fatal: the other pools serve.
    PoolState& st = plan.pools[p];
    st.available = false;
    st.reason = "python: " + ops.error().message();
    st.start_error = detail.stderr_text;
    GPUQ_LOG_ERROR("pool %s is unavailable: %s%s%s", pool.name.c_str(), st.reason.c_str(),
                   st.start_error.empty() ? "" : "\n", st.start_error.c_str());
    plan.placements.erase(plan.placements.begin() + first_worker,
                          plan.placements.begin() + first_worker + workers);
    pool.workers = 0;
  }
}

Result<PoolPlan> plan_pools(Config& c, const WorkerExecutables& found, const TestHooks& hooks) {
  PoolPlan plan;
  plan.pools.assign(c.pools.size(), PoolState{});
  const bool want_gpus = std::any_of(c.pools.begin(), c.pools.end(),
                                     [](const PoolConfig& p) { return p.kind == PoolKind::kGpu; });
  bool cpu_backend = false;  // gpu pools on fake GPUs run the CPU backend (worker_program.hpp)
  if (want_gpus) {
    const GpuDiscoveryOptions how = gpu_discovery_options_from_environment(hooks.enabled);
    plan.nvml_library = how.nvml_library;
    cpu_backend = gpu_pools_on_cpu_backend(how, hooks);
    const char* runs = cpu_backend ? "gpu pools run gpuq-worker"
                                   : "gpu pools run their own programs (GPUQ_TEST_GPU_WORKER=real)";
    if (how.root != "/") {
      GPUQ_LOG_WARN(
          "test hooks: GPUQ_TEST_GPU_ROOT: GPUs are read from %s, NVML is not tried, and %s",
          how.root.c_str(), runs);
    } else if (how.fake()) {
      GPUQ_LOG_WARN("test hooks: GPUQ_TEST_NVML_LIBRARY: NVML is %s, and %s",
                    how.nvml_library.c_str(), runs);
    }
    plan.gpu_cpu_backend = cpu_backend;
    plan.discovery = discover_gpus_isolated(how, kGpuDiscoveryTimeoutMs);
    plan.discovery_ran = true;
    for (const GpuInfo& g : plan.discovery.gpus) {
      GPUQ_LOG_INFO("GPU %u (%s): %s, %s, %llu MiB, cpus %s, numa node %d", g.index,
                    plan.discovery.source.c_str(), g.uuid.empty() ? "(no UUID)" : g.uuid.c_str(),
                    g.pci_bus_id.c_str(), static_cast<unsigned long long>(g.memory_bytes >> 20),
                    g.local_cpus.empty() ? "unknown" : cpu_list_text(g.local_cpus).c_str(),
                    g.numa_node);
    }
  }
  // Which GPUs each gpu pool gets (none: unavailable), then their memory budgets on each, then
  // where every worker runs.
  std::vector<std::vector<uint32_t>> pool_gpus(c.pools.size());
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    PoolConfig& pool = c.pools[p];
    Result<WorkerProgram> program = worker_program(pool, found, cpu_backend);
    if (program) plan.pools[p].program = *program;
    if (pool.kind == PoolKind::kCpu) continue;
    Result<std::vector<uint32_t>> chosen = select_gpus(pool, plan.discovery);
    if (chosen && !program) chosen = program.error();
    if (!chosen) {
      // Unavailable, not fatal: the other pools serve, and jobs for this one fail at once with
      // NoDevice or go to the fallback pool (docs/design/gpu_discovery.md).
      PoolState& st = plan.pools[p];
      st.available = false;
      st.reason = chosen.error().message();
      pool.workers = 0;
      GPUQ_LOG_WARN("pool %s is unavailable: %s; %s", pool.name.c_str(), st.reason.c_str(),
                    pool.fallback_pool >= 0
                        ? ("its jobs go to pool " + c.pools[pool.fallback_pool].name).c_str()
                        : "its jobs fail with NoDevice");
      continue;
    }
    pool_gpus[p] = *chosen;
    plan.pools[p].gpus = *chosen;
  }
  auto placed = place_gpu_pools(c.pools, pool_gpus, plan.discovery.gpus, allowed_cpus());
  if (!placed) return placed.error();
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    PoolConfig& pool = c.pools[p];
    if (pool.kind == PoolKind::kCpu) {
      const std::vector<WorkerPlacement> entries = place_cpu_pool(pool);
      plan.placements.insert(plan.placements.end(), entries.begin(), entries.end());
      continue;
    }
    if (!plan.pools[p].available) continue;
    const GpuPoolPlacement& at = (*placed)[p];
    plan.pools[p].memory = at.memory;
    plan.placements.insert(plan.placements.end(), at.entries.begin(), at.entries.end());
    pool.workers = at.workers(pool);
    if (pool.max_workers_setting == 0) {
      pool.max_workers = pool.workers;
    } else if (pool.workers > pool.max_workers) {
      return Error(ErrorCode::kInvalidArgument,
                   "config: pools[" + pool.name +
                       "].max_workers: " + std::to_string(pool.max_workers) +
                       " is fewer than its workers_per_gpu x the GPUs found, " +
                       std::to_string(pool.workers));
    }
  }
  if (auto r = check_pool_sizes(c); !r) {
    return Error(r.error().code(), r.error().message() + " (with the GPUs found)");
  }
  // The free pool records' entries: placed when a reload adds a pool in one (place_added_pool).
  for (uint32_t i = 0; i < free_pool_records(c) * c.added_pool_workers; ++i) {
    plan.placements.push_back({{}, "-1", -1, {}});
  }
  return plan;
}

}  // namespace gpuq::daemon
