// What the daemon says about itself: the status document (gpuqctl status, docs/service.md and
// docs/design/gpu_discovery.md list its fields), readiness, and each pool's workers by state for
// the service manager's READY=1 and STATUS= lines. Reads the other components; changes nothing.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "client_registry.hpp"
#include "config.hpp"
#include "job_recovery.hpp"
#include "job_watch.hpp"
#include "pool_outage.hpp"
#include "pool_plan.hpp"
#include "pool_rollout.hpp"
#include "spare_pool.hpp"
#include "worker_set.hpp"

namespace gpuq::daemon {

struct PoolHealth {
  std::string name;
  // Active workers (spares apart). ready: able to take work (ready and not stuck); failed: its
  // starts keep failing (max_start_failures or more in a row; retried after the start
  // back-off, and counted here while it tries again too); settling: starting or restarting,
  // the others, spares included (READY=1 waits for the spares too).
  uint32_t ready = 0, failed = 0, settling = 0, stuck = 0, total = 0;
  uint32_t spares = 0, spares_ready = 0;  // spare workers (spare_workers), and those ready
  uint32_t capacity = 0;
  bool unavailable = false;  // a gpu pool without a GPU (PoolState)
  bool down = false;         // no ready worker for pool_down_fail_ms: its jobs fail (PoolOutage)
};

// "cpu 2/2 ready, ring 20; gpu0 0/2 ready, 2 failed, failing jobs, ring 20; gpu1 unavailable";
// a pool with spares: "py 2/2 ready, 1/1 spare ready, ring 20"
std::string pools_summary(const std::vector<PoolHealth>& pools);

class StatusReport {
 public:
  struct Sources {
    const Config* config;
    const PoolPlan* plan;
    const QueueView* queue;
    const WorkerSet* workers;
    const ClientRegistry* clients;
    const JobRecovery* recovery;
    const JobWatch* watch;
    const PoolOutage* outage;
    const SparePool* spares;
    const PoolRollout* rollouts;
    std::string runtime_dir;
    std::string gpu_worker_path;  // empty in a build without CUDA
  };
  explicit StatusReport(Sources s) : s_(std::move(s)) {}

  // The status document (JSON text). `epoch` and `start_ns` identify this daemon's run.
  std::string document(uint64_t epoch, uint64_t start_ns, bool draining) const;
  std::vector<PoolHealth> pool_health() const;
  // Where the metrics HTTP listener listens ("127.0.0.1:9464", its real port); empty: off.
  void set_metrics_listen(std::string at) { metrics_listen_ = std::move(at); }

  // The clients listed in status' `client_jobs` (and the metric gpuq_client_jobs), at most.
  static constexpr size_t kClientJobsShown = 20;

 private:
  uint64_t cells_held(uint32_t pool) const;
  nlohmann::json client_jobs() const;
  static nlohmann::json queued_by_priority(const PoolQueue& queue);
  uint64_t jobs_completed(uint32_t pool) const;

  Sources s_;
  std::string metrics_listen_;
};

}  // namespace gpuq::daemon
