// The catalog: the pools and ops clients are told of (Welcome, CatalogReply), and its
// generation in the queue header (docs/design/live_changes.md, "Clients see it without
// reconnecting"). What clients are told is a snapshot taken when it is published, not the op
// registry as it is at each moment: a rollout registers a Python pool's new ops when it starts,
// but they are published only once its new workers serve (an old worker would fail them with
// UnknownOp).
//
// Records and ids are only ever added: a client that holds an older catalog keeps valid pool
// ids and op ids, and sees the new ones after it asks again.
// Not thread-safe: the supervisor's loop owns it.
#pragma once

#include <cstdint>
#include <vector>

#include "config.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "pool_plan.hpp"

namespace gpuq::daemon {

class Catalog {
 public:
  Catalog(const Config& config, const PoolPlan& plan, const QueueView& queue)
      : config_(config), plan_(plan), queue_(queue) {}

  // Takes a new snapshot of the pools (config, plan, queue segment) and ops (the registry) and
  // raises the generation in the queue header (release: a client that sees the new value and
  // asks gets this snapshot or a later one). The first call publishes generation 1.
  void publish();

  uint32_t generation() const noexcept { return generation_; }
  const std::vector<WelcomePool>& pools() const noexcept { return pools_; }
  const std::vector<WelcomeOp>& ops() const noexcept { return ops_; }
  // Whether the snapshot has an op of this name.
  bool has_op(const std::string& name) const;

 private:
  const Config& config_;
  const PoolPlan& plan_;
  const QueueView& queue_;
  uint32_t generation_ = 0;
  std::vector<WelcomePool> pools_;
  std::vector<WelcomeOp> ops_;
};

}  // namespace gpuq::daemon
