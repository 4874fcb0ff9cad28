// gpuqd configuration: one JSON file; every key has a default, so the daemon runs without one.
// Unknown keys and bad values are errors that name the key path ("pools[0].cpus[2]").
// docs/config.md lists every key; keep the two in step.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpuq/common/log.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

struct PoolConfig {
  std::string name;
  PoolKind kind = PoolKind::kCpu;
  uint32_t workers = 0;   // 0 in the file means: one per CPU in `cpus`
  std::vector<int> cpus;  // CPUs the pool's workers are pinned to, one each, round robin
};

struct Config {
  uint32_t queue_factor = 10;                      // ring capacity = queue_factor x workers
  uint32_t max_clients = 64;                       // connected clients at once
  uint32_t max_jobs_per_client = 64;               // job slots (jobs in flight) per client
  double client_queue_share = 0.5;                 // fraction of a ring one client may fill
  uint64_t client_segment_bytes = 64ull << 20;     // default payload arena per client
  uint64_t max_client_segment_bytes = 1ull << 30;  // most a client may ask for
  uint32_t drain_timeout_ms = 30000;               // SIGTERM: longest wait for queued/running jobs
  uint32_t worker_spin_us = 50;                    // idle worker spins this long before sleeping
  uint32_t restart_backoff_initial_ms = 100;
  uint32_t restart_backoff_max_ms = 10000;
  uint32_t max_start_failures = 5;  // deaths before ready in a row -> worker "failed"
  std::vector<uid_t> allowed_uids;  // empty with allowed_gids empty: the daemon's user
  std::vector<gid_t> allowed_gids;
  gid_t group = static_cast<gid_t>(-1);  // group given access to socket and segment
  bool group_set = false;
  LogLevel log_level = LogLevel::kInfo;
  std::vector<PoolConfig> pools;
};

// The CPUs this process may run on (sched_getaffinity), ascending.
std::vector<int> allowed_cpus();

// Parses and validates a config document. `available_cpus` is the set `cpus` entries must
// come from (and the default). Errors: InvalidArgument naming the key path.
Result<Config> parse_config(const std::string& json_text, const std::vector<int>& available_cpus);

// Reads `path` and parses it; an empty path gives the built-in defaults.
Result<Config> load_config(const std::string& path, const std::vector<int>& available_cpus);

// Capacity of pool `p`'s ring under `c`.
inline uint32_t ring_capacity(const Config& c, const PoolConfig& p) {
  return c.queue_factor * p.workers;
}

}  // namespace gpuq::daemon
