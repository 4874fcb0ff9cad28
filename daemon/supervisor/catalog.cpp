#include "catalog.hpp"

#include <algorithm>

#include "ops.hpp"

namespace gpuq::daemon {

void Catalog::publish() {
  std::vector<WelcomePool> pools;
  for (uint32_t p = 0; p < config_.pools.size(); ++p) {
    const PoolConfig& c = config_.pools[p];
    // Removed by a reload: no longer offered; being added: not yet.
    if (c.removed || plan_.pools[p].adding) continue;
    const PoolShm& ps = queue_.pool(p);
    // "available", "reason" and "fallback" (the pool id that runs this pool's jobs while it is
    // unavailable, or -1): a client checks them in submit (docs/design/protocol.md).
    pools.push_back({c.name, p, c.kind == PoolKind::kGpu ? "gpu" : "cpu", ps.capacity,
                     ps.client_share, plan_.pools[p].available, plan_.pools[p].reason,
                     c.fallback_pool});
  }
  std::vector<WelcomeOp> ops;
  for (const auto& op : op_registry()) {
    // A Python op no pool has any more (its module dropped it): its id stays reserved.
    if (op.python != nullptr && op.python->pools.empty()) continue;
    ops.push_back({op.name, op.id});
  }
  pools_ = std::move(pools);
  ops_ = std::move(ops);
  ++generation_;
  queue_.header().catalog_generation.store(generation_, std::memory_order_release);
}

bool Catalog::has_op(const std::string& name) const {
  return std::any_of(ops_.begin(), ops_.end(), [&](const WelcomeOp& o) { return o.name == name; });
}

}  // namespace gpuq::daemon
