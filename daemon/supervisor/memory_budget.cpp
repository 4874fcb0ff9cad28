#include "memory_budget.hpp"

#include <cstdio>

namespace gpuq::daemon {
namespace {

// Fractions that add up to the whole device in decimal (0.6 + 0.4) may not in binary.
constexpr double kSlack = 1e-9;

std::string mib(uint64_t bytes) {
  return std::to_string(bytes >> 20) + " MiB";
}

std::string number(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", x);
  return text;
}

// "pool a", "pools a, b": `names` counted by its commas.
std::string pools_text(const std::string& names) {
  return (names.find(", ") == std::string::npos ? "pool " : "pools ") + names;
}

bool is_set(const PoolConfig& p) {
  return p.memory_limit_bytes > 0 || p.memory_limit_fraction > 0;
}

// "GPU 0 (GPU-..., 81559 MiB)": the GPU a message is about.
std::string gpu_name(const GpuInfo& g) {
  std::string name = "GPU " + std::to_string(g.index);
  std::string detail = g.uuid;
  if (g.memory_bytes > 0) detail += (detail.empty() ? "" : ", ") + mib(g.memory_bytes);
  return detail.empty() ? name : name + " (" + detail + ")";
}

}  // namespace

std::string MemoryShare::text(uint64_t device_bytes) const {
  if (bytes > 0) return mib(bytes);
  std::string t = number(fraction) + " of the device";
  if (device_bytes > 0) {
    t += " (" + mib(static_cast<uint64_t>(fraction * static_cast<double>(device_bytes))) + ")";
  }
  return t;
}

std::vector<uint32_t> workers_on_gpus(const PoolConfig& pool, size_t gpu_count) {
  std::vector<uint32_t> on(gpu_count, pool.workers_per_gpu);
  // Spares, then surge seats, round robin (pool_plan.cpp places them so): each takes a share.
  const uint32_t extra = pool.spare_workers + pool.rollout_surge_workers;
  for (uint32_t k = 0; k < extra && gpu_count > 0; ++k) ++on[k % gpu_count];
  return on;
}

Result<std::vector<std::vector<PoolGpuBudget>>> plan_memory_budgets(
    const std::vector<PoolConfig>& pools, const std::vector<std::vector<uint32_t>>& pool_gpus,
    const std::vector<GpuInfo>& gpus) {
  std::vector<std::vector<PoolGpuBudget>> out(pools.size());
  for (size_t p = 0; p < pools.size(); ++p) {
    const std::vector<uint32_t> on = workers_on_gpus(pools[p], pool_gpus[p].size());
    for (size_t k = 0; k < pool_gpus[p].size(); ++k) {
      PoolGpuBudget b;
      b.gpu = pool_gpus[p][k];
      b.workers = on[k];
      b.by_default = !is_set(pools[p]);
      b.pool = {pools[p].memory_limit_bytes, pools[p].memory_limit_fraction};
      out[p].push_back(b);
    }
  }
  for (uint32_t g = 0; g < gpus.size(); ++g) {
    const uint64_t device = gpus[g].memory_bytes;  // 0: not known (procfs)
    // What the pools that set a memory_limit take of this GPU, as a fraction of it (their byte
    // budgets only where its memory is known), and who they are.
    double taken = 0;
    std::string named;
    std::vector<PoolGpuBudget*> by_default;
    std::string default_names;
    for (size_t p = 0; p < pools.size(); ++p) {
      for (PoolGpuBudget& b : out[p]) {
        if (b.gpu != g) continue;
        if (b.by_default) {
          by_default.push_back(&b);
          default_names += (default_names.empty() ? "" : ", ") + pools[p].name;
          continue;
        }
        named += (named.empty() ? "" : ", ") + pools[p].name + " (" + b.pool.text(device) + ")";
        if (b.pool.bytes == 0) {
          taken += b.pool.fraction;
        } else if (device > 0) {
          taken += static_cast<double>(b.pool.bytes) / static_cast<double>(device);
        }
      }
    }
    if (taken > 1.0 + kSlack) {
      return Error(
          ErrorCode::kInvalidArgument,
          "config: " + gpu_name(gpus[g]) + ": the memory_limit of " + pools_text(named) +
              " adds up to " + number(taken) + " of the device" +
              (device > 0
                   ? " (" + mib(static_cast<uint64_t>(taken * static_cast<double>(device))) + ")"
                   : std::string()) +
              ", more than all of it: lower them so that the pools on one GPU add up "
              "to at most 1.0 of it (docs/config.md, \"Device memory budgets\")");
    }
    if (by_default.empty()) continue;
    const double left = kDefaultMemoryFraction - taken;
    if (left <= kSlack) {
      return Error(ErrorCode::kInvalidArgument,
                   "config: " + gpu_name(gpus[g]) + ": the memory_limit of " + pools_text(named) +
                       " adds up to " + number(taken) + " of the device, which leaves nothing of " +
                       number(kDefaultMemoryFraction) + " for " + pools_text(default_names) +
                       ", which sets none: give it a memory_limit, or lower the others' "
                       "(docs/config.md, \"Device memory budgets\")");
    }
    for (PoolGpuBudget* b : by_default) {
      b->pool = {0, left / static_cast<double>(by_default.size())};
    }
  }
  for (auto& pool : out) {
    for (PoolGpuBudget& b : pool) {
      const uint32_t n = b.workers > 0 ? b.workers : 1;
      b.worker = b.pool.bytes > 0 ? MemoryShare{b.pool.bytes / n, 0}
                                  : MemoryShare{0, b.pool.fraction / static_cast<double>(n)};
    }
  }
  return out;
}

}  // namespace gpuq::daemon
