// What `gpuqctl top` shows, computed from two metrics texts taken some time apart
// (docs/metrics.md names the metrics): jobs/s and p50/p99 of the jobs that ended in between,
// the gauges as the second text has them, and the report as plain text. No I/O and no clock, so
// that a unit test can feed it two texts. Private to gpuqctl (tools/gpuqctl/).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "prom_text.hpp"

namespace gpuq::ctl {

// One pool. A rate or quantile is nullopt when there is none to give: "-" in the report.
struct PoolTop {
  std::string name;
  // Jobs that ended per second (gpuq_jobs_total over every op and outcome), and of those the
  // ones whose outcome is not ok. nullopt when a counter went down (the daemon restarted).
  std::optional<double> jobs_per_s;
  std::optional<double> failed_per_s;
  // p50 and p99, in seconds, of the queue wait and run time of the jobs that ended in the
  // interval (the deltas of the histograms' buckets, summed over ops). nullopt when no job did,
  // or when a counter went down.
  std::optional<double> wait_p50, wait_p99, run_p50, run_p99;
  std::optional<double> queue_depth, queue_capacity;
  // gpuq_workers by state ("busy", "idle", "stuck", "restarting", "failed", ...), in the order
  // the text lists them.
  std::vector<std::pair<std::string, double>> workers;
  std::optional<double> restarts;        // gpuq_worker_restarts_total in the second text
  std::optional<double> restarts_delta;  // its increase over the interval; nullopt if it went down
  // Batched Python ops: whether the pool has any (gpuq_batch_rows series), and the mean rows
  // per call of their functions over the interval (the increase of gpuq_batch_rows_sum over
  // that of _count, all ops together). nullopt when no call was made, or a counter went down.
  bool batched = false;
  std::optional<double> mean_batch;

  // The count of workers in `state` (0 when the text has none).
  double workers_in(std::string_view state) const;
};

// One GPU worker (gpuq_worker_gpu_memory_{used,budget}_bytes).
struct GpuWorkerTop {
  std::string pool, worker, gpu;
  std::optional<double> used_bytes, budget_bytes;
};

// One client among those with the most jobs queued (gpuq_client_jobs, the second text).
struct ClientTop {
  std::string client, pid, program;
  double queued = 0, running = 0;
};

// One GPU as NVML sees it (gpuq_gpu_*).
struct GpuTop {
  std::string gpu, uuid;
  std::optional<double> utilization;  // 0 to 1
  std::optional<double> used_bytes, total_bytes;
};

struct TopReport {
  double interval_s = 0;
  std::string version;                 // gpuq_build_info's label; "" when missing
  std::optional<double> start_time_s;  // gpuq_start_time_seconds, Unix time
  // The two texts come from different daemons (gpuq_start_time_seconds changed): no rates.
  bool daemon_restarted = false;
  std::optional<double> clients, clients_max;
  bool ready = false, draining = false;
  std::vector<PoolTop> pools;  // in the order the second text names them
  std::vector<GpuWorkerTop> gpu_workers;
  std::vector<GpuTop> gpus;
  std::vector<ClientTop> clients_with_jobs;  // most queued first (then most running)
};

// The clients `format_top` lists, at most.
inline constexpr size_t kTopClientsShown = 5;

// The q-quantile (0 <= q <= 1) of a histogram given as cumulative buckets (upper bound `le`,
// count), as Prometheus' histogram_quantile computes it: the buckets are sorted by bound (equal
// bounds merged, counts made monotonic), the bucket that holds rank q x count is found, and the
// value is interpolated linearly inside it, from 0 for the first bucket; a rank in the +Inf bucket
// gives the highest finite bound. nullopt where Prometheus gives NaN: no +Inf bucket, fewer than
// two buckets, no observations, or q outside [0, 1]. Thread-safe.
std::optional<double> histogram_quantile(double q, std::vector<std::pair<double, double>> buckets);

// The report from `before` and `after`, parsed metrics texts of one daemon whose fetches were
// `interval_s` (> 0) seconds apart. A counter series that went down, or one of `before` missing
// from `after`, voids the rates and quantiles it feeds (a daemon restarted: no data, never a
// negative rate); a series new in `after` counts from 0. Thread-safe.
TopReport compute_top(const std::vector<PromSample>& before, const std::vector<PromSample>& after,
                      double interval_s);

// The report as plain text, one line each, no escape codes: a header (version, uptime from
// `now_unix_s`, state, clients, interval), a table of pools (with a BATCH column, the mean batch
// size, when a pool has batched ops), the clients with the most jobs queued (at most
// kTopClientsShown), then the GPU workers and the GPUs when there are any.
// Thread-safe.
std::string format_top(const TopReport& report, double now_unix_s);

}  // namespace gpuq::ctl
