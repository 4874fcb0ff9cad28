// gpuqd configuration: one JSON file; every key has a default, so the daemon runs without one.
// Unknown keys and bad values are errors that name the key path ("pools[0].cpus[2]").
// docs/config.md lists every key; keep the two in step.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"
#include "metrics_http.hpp"

namespace gpuq::daemon {

// One entry of a gpu pool's "gpus" list: a GPU by its index in PCI bus order, or by its UUID.
struct GpuSelector {
  bool by_uuid = false;
  uint32_t index = 0;
  std::string uuid;  // "GPU-...", as written
};

// What a gpu pool does with jobs while it has no GPU (docs/config.md, "GPU pool keys").
enum class PoolFallback { kNone, kCpu };

// A Python pool's "python" section (docs/python.md, "Python pools"): its workers are this
// interpreter running gpuq's worker runtime (`python -m gpuq._worker`) with these modules'
// ops.
struct PythonPoolConfig {
  // The interpreter: an absolute path, or a name looked up in PATH when gpuqd starts ("venv"
  // sets it to <venv>/bin/python).
  std::string interpreter = "python3";
  std::vector<std::string> modules;  // imported in each worker, in order
  std::vector<std::string> path;     // prepended to sys.path, in order (absolute directories)
  std::vector<std::pair<std::string, std::string>> env;  // added to the workers' environment
  bool allow_callables = false;  // whether gpuq.Executor may run clients' pickled callables
};

struct PoolConfig {
  std::string name;
  PoolKind kind = PoolKind::kCpu;
  // cpu pools: 0 in the file means one per CPU in `cpus`. gpu pools: the number known from the
  // config (workers_per_gpu x listed GPUs; 0 with "gpus": "all") until the supervisor has
  // found the GPUs, which sets it (0 for an unavailable pool).
  uint32_t workers = 0;
  // The most `workers` a config reload may raise it to (entries reserved for them, its ring
  // sized for them; a gpu pool's workers are workers_per_gpu x its GPUs); `workers` when the
  // file does not say (no growth), as it says in max_workers_setting (0: not said), which a
  // reload compares. Fixed while gpuqd runs.
  uint32_t max_workers = 0;
  uint32_t max_workers_setting = 0;
  // Spare workers (docs/design/faults.md, "Spare workers"): started and made ready like the
  // others but kept out of the ring, each to take the place of an active worker that dies or
  // is stopped. A gpu pool's are spread over its GPUs, round robin.
  uint32_t spare_workers = 0;
  // Surge seats (docs/design/live_changes.md): entries with no process, each started only by a
  // rolling restart to make a new worker ready before it takes an old one's place. Default 1
  // in a cpu pool (a seat costs nothing while idle), 0 in a gpu pool (a seat there takes a
  // share of the pool's memory budget, as a spare does).
  uint32_t rollout_surge_workers = 0;
  // The most active workers it may have: max_workers, at least workers.
  uint32_t most_workers() const { return std::max(workers, max_workers); }
  // The pool's worker entries (processes, WorkerShm slots, ids): its active workers, the entries
  // reserved for growth (max_workers), its spares and its surge seats, in that order; 0 for a
  // pool without workers (an unavailable gpu pool). most_workers() sizes the ring.
  uint32_t entries() const {
    return workers == 0 ? 0 : most_workers() + spare_workers + rollout_surge_workers;
  }
  std::vector<int> cpus;  // cpu pools: CPUs the workers are pinned to, one each, round robin
  // gpu pools only.
  bool all_gpus = true;           // "gpus": "all"
  std::vector<GpuSelector> gpus;  // else these, in this order
  uint32_t workers_per_gpu = 1;
  PoolFallback fallback = PoolFallback::kNone;
  int fallback_pool = -1;  // with fallback "cpu": index of the first cpu pool; else -1
  // The pool's device memory budget on each of its GPUs ("memory_limit"), shared by its workers
  // there (memory_budget.hpp): bytes (an integer, at least 1 MiB), else a fraction of the
  // device's memory (a non-integer number in (0, 1]). Both 0: not set (a share of 0.9).
  uint64_t memory_limit_bytes = 0;
  double memory_limit_fraction = 0;
  // The longest a job of this pool may run (0: no limit); a job's own time limit may shorten
  // it (docs/design/faults.md, "Jobs that do not end").
  uint32_t job_time_limit_ms = 0;
  // A Python pool: its workers run Python ops (and, when allowed, clients' callables).
  std::optional<PythonPoolConfig> python;
  // This pool's workers' idle spin; unset: the top-level worker_spin_us, and for a Python pool
  // at least kPythonPoolSpinUs (spin_us_of).
  std::optional<uint32_t> worker_spin_us;
  // Not a key: set by the supervisor when a config reload removed the pool. It stays in the
  // list (pool ids are indexes, and its record stays reserved), drains, and serves no more.
  bool removed = false;
};

// A Python pool's least default spin: its clients' own Python takes longer than the usual 50 us
// between one job and the next, and a worker asleep by then costs each call a wakeup.
inline constexpr uint32_t kPythonPoolSpinUs = 300;

// The default of max_clients ("auto"): 8 per CPU the daemon may use (a Pool() or n_jobs=-1 starts
// a process per core, each a client; several such programs at once), at least
// kMinDefaultMaxClients, at most kMaxClients - 1 (a JobRef's 10 bits of client index).
inline constexpr uint32_t kMinDefaultMaxClients = 256;
inline constexpr uint32_t kMaxClientsPerCpu = 8;
inline uint32_t default_max_clients(size_t available_cpus) {
  const uint64_t by_cpus = uint64_t{kMaxClientsPerCpu} * available_cpus;
  return static_cast<uint32_t>(
      std::min<uint64_t>(std::max<uint64_t>(by_cpus, kMinDefaultMaxClients), kMaxClients - 1));
}

// Pool records a config reload may add pools in (docs/design/live_changes.md): "max_pools",
// "auto" = the pools configured plus kAutoSpareRecords, at most kMaxPools.
inline constexpr uint32_t kAutoSpareRecords = 4;
// Worker entries (workers, spares and surge seats) of a pool a reload adds: "added_pool_workers",
// "auto" = the daemon's CPUs + 2 (a pool of one worker per CPU, a spare and a surge seat), at
// most kMaxAutoAddedPoolWorkers.
inline constexpr uint32_t kMaxAutoAddedPoolWorkers = 66;

struct Config {
  uint32_t queue_factor = 10;  // ring capacity = queue_factor x workers
  // Connected clients at once; parse_config sets default_max_clients() of the daemon's CPUs.
  uint32_t max_clients = kMinDefaultMaxClients;
  uint32_t max_jobs_per_client = 64;               // job slots (jobs in flight) per client
  double client_queue_share = 1.0;                 // fraction of a lane one client may fill
  uint64_t client_segment_bytes = 64ull << 20;     // default payload arena per client
  uint64_t max_client_segment_bytes = 1ull << 30;  // most a client may ask for
  uint32_t drain_timeout_ms = 30000;               // SIGTERM: longest wait for queued/running jobs
  // A running job asked to stop (its time limit, a cancel, its client gone) that has not ended
  // this long after is stopped by killing its worker, which is then replaced.
  uint32_t cancel_grace_ms = 1000;
  // A streaming job whose caller has read none of its `window` unread parts this long ends
  // Cancelled, and its worker goes on (0: no limit; docs/design/streams.md).
  uint32_t stream_reader_timeout_ms = 60000;
  uint32_t worker_spin_us = 50;  // idle worker spins this long before sleeping
  // What job stamps count in (clock.hpp, "Job stamps"): "auto" (unset) picks the TSC where
  // the kernel keeps time with it; "tsc" insists on it (gpuqd refuses to start without it).
  std::optional<StampClock> job_clock;
  // Worker restarts (start_backoff.hpp): a death after ready waits the restart back-off; a
  // worker that failed to start max_start_failures times in a row is "failed" and tried again
  // after the start back-off, for the daemon's life.
  uint32_t restart_backoff_initial_ms = 100;
  uint32_t restart_backoff_max_ms = 10000;
  uint32_t max_start_failures = 5;  // failed starts in a row -> worker "failed"
  uint32_t start_backoff_initial_ms = 1000;
  uint32_t start_backoff_max_ms = 60000;
  // A worker that has not reported ready this long after it was started is killed, and that
  // counts as a failed start (a hung import, a model load stuck on a network file); 0: no limit.
  uint32_t start_timeout_ms = 600000;
  // A pool with no ready worker for this long fails its queued and new jobs with PoolDown
  // until a worker is ready again (pool_outage.hpp); 0: never, they wait.
  uint32_t pool_down_fail_ms = 10000;
  std::vector<uid_t> allowed_uids;  // empty with allowed_gids empty: the daemon's user
  std::vector<gid_t> allowed_gids;
  // A client's weight in its pools' turns (docs/design/ring.md, "Lanes"): the first entry that
  // names its user, else the first that names one of its groups, else 1.
  struct ClientWeight {
    bool group = false;  // `id` is a gid, else a uid
    uint32_t id = 0;
    uint32_t weight = 1;  // 1 to PoolQueue::kMaxWeight
    bool operator==(const ClientWeight&) const = default;
  };
  std::vector<ClientWeight> client_weights;
  gid_t group = static_cast<gid_t>(-1);  // group given access to socket and segment
  bool group_set = false;
  LogLevel log_level = LogLevel::kInfo;
  // Metrics (docs/metrics.md): per-job counts and histograms in the workers; and the HTTP
  // listener for Prometheus (none unless the config names an address).
  bool job_metrics = true;
  std::optional<ListenAddress> metrics_listen;
  std::vector<PoolConfig> pools;
  // Pool records in the queue segment: the pools configured, and free ones a reload may add
  // pools in; each free one has `added_pool_workers` worker entries and a ring of queue_factor x
  // that many cells (parse_config resolves "auto").
  uint32_t max_pools = 0;
  uint32_t added_pool_workers = 0;
  // As the file says them (0: "auto"), which a reload compares.
  uint32_t max_pools_setting = 0;
  uint32_t added_pool_workers_setting = 0;
  // Plug-in libraries (gpuq/plugin.h), absolute paths, in the order their ops get ids.
  std::vector<std::string> plugins;
};

// The CPUs this process may run on (sched_getaffinity), ascending.
std::vector<int> allowed_cpus();

// Parses and validates a config document. `available_cpus` is the set `cpus` entries must
// come from (and the default). Errors: InvalidArgument naming the key path.
Result<Config> parse_config(const std::string& json_text, const std::vector<int>& available_cpus);

// Reads `path` and parses it; an empty path gives the built-in defaults.
Result<Config> load_config(const std::string& path, const std::vector<int>& available_cpus);

// How long pool `p`'s idle workers spin before they sleep (docs/config.md, "Pool keys").
inline uint32_t spin_us_of(const Config& c, const PoolConfig& p) {
  if (p.worker_spin_us) return *p.worker_spin_us;
  return p.python ? std::max(c.worker_spin_us, kPythonPoolSpinUs) : c.worker_spin_us;
}

// Capacity of pool `p`'s ring under `c`. A pool without workers (a gpu pool that found no GPU)
// still gets a ring of one cell, so that the segment's layout is the same for every pool; no
// job enters it (its `accepting` stays 0).
inline uint32_t ring_capacity(const Config& c, const PoolConfig& p) {
  return p.workers == 0 ? 1 : c.queue_factor * p.most_workers();
}

// The pool records a reload may still add a pool in: max_pools less the pools in `c` (removed
// ones included: their records stay reserved).
inline uint32_t free_pool_records(const Config& c) {
  return c.max_pools > c.pools.size() ? c.max_pools - static_cast<uint32_t>(c.pools.size()) : 0;
}

// The checks on sizes across pools (ring cells per pool, worker entries in all, spares
// included), on the workers each
// pool has now. parse_config runs them on what the file says; the supervisor again once the gpu
// pools know their GPUs. Errors: InvalidArgument naming the key path.
Result<void> check_pool_sizes(const Config& c);

}  // namespace gpuq::daemon
