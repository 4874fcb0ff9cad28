#include "metrics_report.hpp"

#include <array>
#include <atomic>
#include <charconv>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <string_view>
#include <utility>

#include "gpuq/common/job_metrics.hpp"
#include "ops.hpp"

namespace gpuq::daemon {
namespace {

// The outcomes of gpuq_jobs_total: the workers' (MetricOutcome), then the supervisor's own.
constexpr uint32_t kOutcomes = kMetricOutcomes + 2;
constexpr uint32_t kWorkerDied = kMetricOutcomes;
constexpr uint32_t kPoolDownOutcome = kMetricOutcomes + 1;
const char* outcome_name(uint32_t i) {
  if (i == kWorkerDied) return "worker_died";
  if (i == kPoolDownOutcome) return "pool_down";
  return metric_outcome_name(static_cast<MetricOutcome>(i));
}
uint32_t outcome_index(std::string_view name) {
  for (uint32_t i = 0; i < kOutcomes; ++i) {
    if (name == outcome_name(i)) return i;
  }
  return kWorkerDied;
}

// `sum` plus `add`, stopping at the largest value: a sum that wrapped would read as a counter
// reset.
uint64_t saturating_add(uint64_t sum, uint64_t add) {
  return sum + add < sum ? UINT64_MAX : sum + add;
}

struct Histogram {
  uint64_t buckets[kMetricBounds + 1] = {};
  uint64_t sum_ticks = 0;

  void add(const OpMetrics& m, MetricHistogramKind kind) {
    for (uint32_t b = 0; b <= kMetricBounds; ++b) {
      buckets[b] += m.buckets[b][kind].load(std::memory_order_relaxed);
    }
    sum_ticks = saturating_add(sum_ticks, m.sum_ticks[kind].load(std::memory_order_relaxed));
  }
  // A priority level's queue waits.
  void add(const LevelWaitMetrics& m) {
    for (uint32_t b = 0; b <= kMetricBounds; ++b) {
      buckets[b] += m.buckets[b].load(std::memory_order_relaxed);
    }
    sum_ticks = saturating_add(sum_ticks, m.sum_ticks.load(std::memory_order_relaxed));
  }
  // A batched op's gathering times.
  void add(const OpBatchMetrics& m) {
    for (uint32_t b = 0; b <= kMetricBounds; ++b) {
      buckets[b] += m.gather_buckets[b].load(std::memory_order_relaxed);
    }
    sum_ticks = saturating_add(sum_ticks, m.gather_ticks.load(std::memory_order_relaxed));
  }
};

// A batched op's rows per call of its function (bounds kBatchRowBound).
struct RowsHistogram {
  uint64_t buckets[kBatchRowBounds + 1] = {};
  uint64_t rows = 0;

  void add(const OpBatchMetrics& m) {
    for (uint32_t b = 0; b <= kBatchRowBounds; ++b) {
      buckets[b] += m.rows_buckets[b].load(std::memory_order_relaxed);
    }
    rows = saturating_add(rows, m.rows_sum.load(std::memory_order_relaxed));
  }
};

struct OpTotals {
  uint64_t outcomes[kOutcomes] = {};
  Histogram queue_wait, run;
  bool observed = false;  // counted by a worker (has histograms)
};

// A batched Python op's calls, summed over a pool's workers.
struct BatchTotals {
  RowsHistogram rows;
  Histogram gather;
};

using Labels = std::vector<std::pair<const char*, std::string>>;

// Builds the exposition text: one family (HELP, TYPE, its samples) after another.
class Exposition {
 public:
  void family(const char* name, const char* type, const char* help) {
    out_ += "# HELP ";
    out_ += name;
    out_ += ' ';
    out_ += help;
    out_ += "\n# TYPE ";
    out_ += name;
    out_ += ' ';
    out_ += type;
    out_ += '\n';
  }
  void sample(std::string_view name, const Labels& labels, uint64_t value) {
    head(name, labels);
    out_ += std::to_string(value);
    out_ += '\n';
  }
  void sample(std::string_view name, const Labels& labels, double value) {
    head(name, labels);
    char text[32];
    // The shortest text that reads back as the same double (a start time keeps its digits).
    const auto r = std::to_chars(text, text + sizeof text, value);
    out_.append(text, r.ptr);
    out_ += '\n';
  }
  // A histogram of durations: its _bucket (cumulative; bounds kMetricBoundSeconds), _sum (in
  // seconds) and _count samples.
  void histogram(std::string_view name, const Labels& labels, const Histogram& h,
                 double ns_per_tick) {
    const uint64_t count = buckets(name, labels, h.buckets, kMetricBounds, [](uint32_t b) {
      char le[32];
      std::snprintf(le, sizeof le, "%g", kMetricBoundSeconds[b]);
      return std::string(le);
    });
    sample(std::string(name) + "_sum", labels,
           static_cast<double>(h.sum_ticks) * ns_per_tick / 1e9);
    sample(std::string(name) + "_count", labels, count);
  }
  // A histogram of rows per call: bounds kBatchRowBound, _sum in rows.
  void histogram(std::string_view name, const Labels& labels, const RowsHistogram& h) {
    const uint64_t count = buckets(name, labels, h.buckets, kBatchRowBounds,
                                   [](uint32_t b) { return std::to_string(kBatchRowBound[b]); });
    sample(std::string(name) + "_sum", labels, h.rows);
    sample(std::string(name) + "_count", labels, count);
  }
  std::string take() { return std::move(out_); }

 private:
  // The _bucket samples of `bounds` finite buckets and +Inf from per-bucket `counts`, made
  // cumulative; `le_of(b)` writes bound b. Returns the count of all observations.
  template <typename LeText>
  uint64_t buckets(std::string_view name, Labels labels, const uint64_t* counts, uint32_t bounds,
                   LeText le_of) {
    const std::string bucket = std::string(name) + "_bucket";
    labels.emplace_back("le", "");
    uint64_t cumulative = 0;
    for (uint32_t b = 0; b <= bounds; ++b) {
      cumulative += counts[b];
      labels.back().second = b < bounds ? le_of(b) : std::string("+Inf");
      sample(bucket, labels, cumulative);
    }
    return cumulative;
  }

  void head(std::string_view name, const Labels& labels) {
    out_ += name;
    if (!labels.empty()) {
      out_ += '{';
      for (size_t i = 0; i < labels.size(); ++i) {
        if (i > 0) out_ += ',';
        out_ += labels[i].first;
        out_ += "=\"";
        out_ += escape_label_value(labels[i].second);
        out_ += '"';
      }
      out_ += '}';
    }
    out_ += ' ';
  }

  std::string out_;
};

std::string op_label(uint32_t op_id) {
  if (op_id == kMetricOtherOp) return "other";
  const OpInfo* op = find_op(op_id);
  return op != nullptr ? op->name : "other";
}

}  // namespace

std::string escape_label_value(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string MetricsReport::text(bool draining, const std::vector<GpuSample>& gpus) const {
  const StatusReport::Sources& src = s_.status;
  const Config& c = *src.config;
  const QueueView& queue = *src.queue;
  const PoolPlan& plan = *src.plan;
  const uint32_t pools = static_cast<uint32_t>(c.pools.size());
  const auto pool_label = [&](uint32_t p) { return Labels{{"pool", c.pools[p].name}}; };
  Exposition e;

  e.family("gpuq_build_info", "gauge", "gpuqd's version (the value is always 1).");
  e.sample("gpuq_build_info", {{"version", GPUQ_VERSION}}, uint64_t{1});
  e.family("gpuq_start_time_seconds", "gauge", "When the daemon started, in Unix time.");
  e.sample("gpuq_start_time_seconds", {}, static_cast<double>(s_.start_unix_ns) / 1e9);

  const std::vector<PoolHealth> health = s_.report->pool_health();
  bool serving = !draining;
  uint32_t available = 0;
  for (const PoolHealth& h : health) {
    if (h.unavailable) continue;
    ++available;
    if (h.ready == 0) serving = false;
  }
  e.family("gpuq_ready", "gauge",
           "1 while the daemon accepts jobs and every available pool has a ready worker.");
  e.sample("gpuq_ready", {}, uint64_t{serving && available > 0 ? 1u : 0u});
  e.family("gpuq_draining", "gauge", "1 while the daemon drains to stop.");
  e.sample("gpuq_draining", {}, uint64_t{draining ? 1u : 0u});
  e.family("gpuq_clients_connected", "gauge", "Registered clients.");
  e.sample("gpuq_clients_connected", {}, uint64_t{src.clients->registered()});
  e.family("gpuq_clients_max", "gauge", "Clients the daemon admits at once (max_clients).");
  e.sample("gpuq_clients_max", {}, uint64_t{c.max_clients});
  // The clients with the most jobs queued (then running), at most kClientJobsShown of them: a
  // bounded set of series, for `gpuqctl top` and dashboards.
  e.family("gpuq_client_jobs", "gauge",
           "Jobs of the clients with the most queued, by client, pid, program and state.");
  for (const ClientRegistry::JobCounts& r :
       src.clients->busiest(pools, StatusReport::kClientJobsShown)) {
    for (const auto& [state, n] :
         {std::pair{"queued", r.queued}, std::pair{"running", r.running}}) {
      e.sample("gpuq_client_jobs",
               {{"client", std::to_string(r.client->index)},
                {"pid", std::to_string(r.client->pid)},
                {"program", r.client->name},
                {"state", state}},
               n);
    }
  }

  e.family("gpuq_queue_depth", "gauge", "Jobs waiting in the pool's ring.");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_queue_depth", pool_label(p), uint64_t{queue.queue(p).size()});
  }
  e.family("gpuq_queue_capacity", "gauge", "Cells of the pool's ring (queue_factor x workers).");
  for (uint32_t p = 0; p < pools; ++p) {
    // The supervisor's own copy (the segment's field is the clients' to scribble on).
    e.sample("gpuq_queue_capacity", pool_label(p), uint64_t{queue.layout().pools[p].capacity});
  }
  e.family("gpuq_jobs_submitted_total", "counter",
           "Jobs clients pushed to the pool's ring, as the clients count them.");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_jobs_submitted_total", pool_label(p), src.clients->jobs_submitted(p));
  }

  // Batched Python ops by pool and op (docs/python.md, "Dynamic batching"): each op batched on
  // its pool, whether or not it has run yet, and below any slot of a page with batch counts.
  std::map<std::pair<uint32_t, uint32_t>, BatchTotals> batches;
  for (const OpInfo& op : op_registry()) {
    if (op.python == nullptr || !c.job_metrics) continue;
    for (const uint32_t p : op.python->pools) {
      if (p < pools && op.python->batching_on(p).batched()) batches[{p, op.id}];
    }
  }

  // Jobs by pool and op: every worker's metrics page, then what the supervisor ended itself.
  std::map<std::pair<uint32_t, uint32_t>, OpTotals> ops;
  for (const auto& w : src.workers->all()) {
    const WorkerMetrics& m = w->metrics();
    const uint32_t n = std::min(m.op_count.load(std::memory_order_acquire), kMaxMetricOps);
    for (uint32_t i = 0; i < n; ++i) {
      const OpMetrics& om = m.ops[i];
      // An id this daemon has no op for (the page is the worker's, and a Python pool may run
      // clients' code) counts as `other`, so that no two series share their labels.
      const uint32_t op = find_op(om.op_id) != nullptr ? om.op_id : kMetricOtherOp;
      OpTotals& t = ops[{w->pool, op}];
      t.observed = true;
      for (uint32_t o = 0; o < kMetricOutcomes; ++o) {
        t.outcomes[o] += om.outcomes[o].load(std::memory_order_relaxed);
      }
      t.queue_wait.add(om, kQueueWait);
      t.run.add(om, kRun);
      const OpBatchMetrics& bm = m.batch[i];
      const bool counted = bm.calls.load(std::memory_order_relaxed) != 0 ||
                           bm.gathers.load(std::memory_order_relaxed) != 0;
      if (auto b = batches.find({w->pool, op}); b != batches.end() || counted) {
        BatchTotals& bt = b != batches.end() ? b->second : batches[{w->pool, op}];
        bt.rows.add(bm);
        bt.gather.add(bm);
      }
    }
  }
  // With job_metrics off there are no job counts at all (docs/metrics.md), not these alone.
  for (const auto& [key, count] : src.recovery->jobs_ended()) {
    if (!c.job_metrics) break;
    const auto& [pool, op, outcome] = key;
    ops[{pool, op}].outcomes[outcome_index(outcome)] += count;
  }
  e.family("gpuq_jobs_total", "counter", "Jobs that ended, by pool, op and outcome.");
  for (const auto& [key, t] : ops) {
    for (uint32_t o = 0; o < kOutcomes; ++o) {
      e.sample("gpuq_jobs_total",
               {{"pool", c.pools[key.first].name},
                {"op", op_label(key.second)},
                {"outcome", outcome_name(o)}},
               t.outcomes[o]);
    }
  }
  const double ns_per_tick = s_.stamps->ns_per_tick;
  struct HistogramFamily {
    const char* name;
    const char* help;
    Histogram OpTotals::*of;
  };
  for (const HistogramFamily& f :
       {HistogramFamily{"gpuq_job_queue_wait_seconds",
                        "Time from the client's push to the worker's start of the job.",
                        &OpTotals::queue_wait},
        HistogramFamily{"gpuq_job_run_seconds",
                        "Time from the worker's start of the job to its end.", &OpTotals::run}}) {
    e.family(f.name, "histogram", f.help);
    for (const auto& [key, t] : ops) {
      if (!t.observed) continue;
      e.histogram(f.name, {{"pool", c.pools[key.first].name}, {"op", op_label(key.second)}},
                  t.*f.of, ns_per_tick);
    }
  }
  // Queue wait by pool and priority level, whatever the op (a level no job had counts zero).
  if (c.job_metrics) {
    std::vector<std::array<Histogram, kPriorityLevels>> levels(pools);
    for (const auto& w : src.workers->all()) {
      if (w->pool >= pools) continue;
      for (uint32_t r = 0; r < kPriorityLevels; ++r) {
        levels[w->pool][r].add(w->metrics().level_wait[r]);
      }
    }
    e.family("gpuq_queue_wait_by_priority_seconds", "histogram",
             "Time from the client's push to the worker's start, by pool and priority level.");
    for (uint32_t p = 0; p < pools; ++p) {
      for (uint32_t r = 0; r < kPriorityLevels; ++r) {
        e.histogram("gpuq_queue_wait_by_priority_seconds",
                    {{"pool", c.pools[p].name},
                     {"priority", std::string(priority_name(priority_at_rank(r)))}},
                    levels[p][r], ns_per_tick);
      }
    }
  }
  // Only where a pool has batched ops: a daemon without any shows no such families.
  if (!batches.empty()) {
    e.family("gpuq_batch_rows", "histogram",
             "Rows per call of a batched Python op's function (jobs gathered into one call).");
    for (const auto& [key, b] : batches) {
      e.histogram("gpuq_batch_rows",
                  {{"pool", c.pools[key.first].name}, {"op", op_label(key.second)}}, b.rows);
    }
    e.family("gpuq_batch_gather_seconds", "histogram",
             "Time a worker spent gathering a batch of a batched Python op, from its first "
             "job's claim to the call.");
    for (const auto& [key, b] : batches) {
      e.histogram("gpuq_batch_gather_seconds",
                  {{"pool", c.pools[key.first].name}, {"op", op_label(key.second)}}, b.gather,
                  ns_per_tick);
    }
  }

  // Workers by state, and their counters, by pool.
  static constexpr const char* kStates[] = {"starting",   "idle",   "busy",    "stuck",
                                            "restarting", "failed", "stopped", "spare"};
  std::vector<std::array<uint64_t, std::size(kStates)>> states(pools);
  std::vector<uint64_t> restarts(pools), start_failures(pools);
  for (const auto& w : src.workers->all()) {
    if (dormant(*w)) continue;  // a surge seat with no process: no worker to count
    restarts[w->pool] += w->restarts;
    start_failures[w->pool] += w->start_failures_total;
    size_t state = 0;
    switch (w->state) {
      case WorkerState::kStarting:
        state = 0;
        break;
      case WorkerState::kReady:
        if (src.watch->stuck(*w)) {
          state = 3;  // a spare too: one whose place was taken as it was being stopped
        } else if (w->spare) {
          state = 7;  // ready, held out of the ring until promoted
        } else {
          state = (w->priv().job_seq.load(std::memory_order_relaxed) & 1) != 0 ? 2 : 1;
        }
        break;
      case WorkerState::kRestarting:
        state = 4;
        break;
      case WorkerState::kFailed:
        state = 5;
        break;
      case WorkerState::kStopped:
        state = 6;
        break;
    }
    ++states[w->pool][state];
  }
  e.family("gpuq_workers", "gauge", "Workers by pool and state.");
  for (uint32_t p = 0; p < pools; ++p) {
    for (size_t s = 0; s < std::size(kStates); ++s) {
      e.sample("gpuq_workers", {{"pool", c.pools[p].name}, {"state", kStates[s]}}, states[p][s]);
    }
  }
  e.family("gpuq_worker_restarts_total", "counter",
           "Worker processes started again after one ended.");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_worker_restarts_total", pool_label(p), restarts[p]);
  }
  e.family("gpuq_worker_start_failures_total", "counter",
           "Worker processes that ended before they were ready.");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_worker_start_failures_total", pool_label(p), start_failures[p]);
  }
  e.family("gpuq_spare_promotions_total", "counter",
           "Spare workers that took the place of a worker that died or was stopped.");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_spare_promotions_total", pool_label(p), src.spares->promotions(p));
  }
  e.family("gpuq_pool_rollouts_total", "counter",
           "Rolling restarts of the pool that completed (gpuqctl restart).");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_pool_rollouts_total", pool_label(p), src.rollouts->rollouts(p));
  }
  e.family("gpuq_pool_rollout_failures_total", "counter",
           "Rolling restarts of the pool that stopped (a new worker did not start; no seat).");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_pool_rollout_failures_total", pool_label(p), src.rollouts->failures(p));
  }
  e.family("gpuq_pool_down", "gauge",
           "1 while the pool has had no ready worker for pool_down_fail_ms and its jobs fail "
           "with PoolDown.");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_pool_down", pool_label(p), uint64_t{src.outage->down(p) ? 1u : 0u});
  }
  // Workers whose starts are failing (how many in a row, how the last one ended), and workers
  // waiting to be started again (when). Only those, not every worker: a healthy daemon has
  // none of these families.
  const uint64_t now = monotonic_ns();
  bool family_named = false;
  for (const auto& w : src.workers->all()) {
    if (w->backoff.start_failures() == 0) continue;
    if (!std::exchange(family_named, true)) {
      e.family("gpuq_worker_consecutive_start_failures", "gauge",
               "Failed starts in a row of a worker not ready since; last_exit: how its last "
               "process ended.");
    }
    e.sample("gpuq_worker_consecutive_start_failures",
             {{"pool", c.pools[w->pool].name},
              {"worker", std::to_string(w->id)},
              {"last_exit", w->last_exit}},
             uint64_t{w->backoff.start_failures()});
  }
  family_named = false;
  for (const auto& w : src.workers->all()) {
    if (!src.workers->awaits_start(*w)) continue;
    if (!std::exchange(family_named, true)) {
      e.family("gpuq_worker_next_start_seconds", "gauge",
               "Seconds until a worker that died or failed to start is started again.");
    }
    const double in =
        w->respawn_at_ns > now ? static_cast<double>(w->respawn_at_ns - now) / 1e9 : 0.0;
    e.sample("gpuq_worker_next_start_seconds",
             {{"pool", c.pools[w->pool].name}, {"worker", std::to_string(w->id)}}, in);
  }
  e.family("gpuq_job_time_limit_kills_total", "counter",
           "Workers stopped by force for a job past its time limit.");
  for (uint32_t p = 0; p < pools; ++p) {
    e.sample("gpuq_job_time_limit_kills_total", pool_label(p), src.recovery->time_limit_kills(p));
  }

  // GPU workers' device memory, from their metrics pages.
  bool any_gpu_worker = false;
  for (const auto& w : src.workers->all()) {
    any_gpu_worker |= w->metrics().device_memory_budget.load(std::memory_order_relaxed) != 0;
  }
  if (any_gpu_worker) {
    for (const char* name :
         {"gpuq_worker_gpu_memory_used_bytes", "gpuq_worker_gpu_memory_budget_bytes"}) {
      const bool used = std::string_view(name).find("used") != std::string_view::npos;
      e.family(name, "gauge",
               used ? "Device memory a GPU worker's jobs hold."
                    : "A GPU worker's device memory budget.");
      for (const auto& w : src.workers->all()) {
        const WorkerMetrics& m = w->metrics();
        const uint64_t budget = m.device_memory_budget.load(std::memory_order_relaxed);
        if (budget == 0) continue;
        const int g = w->placement.gpu;
        e.sample(name,
                 {{"pool", c.pools[w->pool].name},
                  {"worker", std::to_string(w->id)},
                  {"gpu", g >= 0 ? std::to_string(plan.discovery.gpus[g].index) : ""}},
                 used ? m.device_memory_used.load(std::memory_order_relaxed) : budget);
      }
    }
  }

  // Per GPU, as NVML last saw them.
  if (!gpus.empty()) {
    const auto gpu_labels = [](const GpuSample& g) {
      return Labels{{"gpu", std::to_string(g.index)}, {"uuid", g.uuid}};
    };
    e.family("gpuq_gpu_utilization_ratio", "gauge",
             "Share of NVML's last sample period in which the GPU ran a kernel (0 to 1).");
    for (const GpuSample& g : gpus) {
      if (g.utilization) e.sample("gpuq_gpu_utilization_ratio", gpu_labels(g), *g.utilization);
    }
    e.family("gpuq_gpu_memory_used_bytes", "gauge", "Device memory in use, all processes (NVML).");
    for (const GpuSample& g : gpus) {
      if (g.memory_used_bytes) {
        e.sample("gpuq_gpu_memory_used_bytes", gpu_labels(g), *g.memory_used_bytes);
      }
    }
    e.family("gpuq_gpu_memory_total_bytes", "gauge", "Device memory (NVML).");
    for (const GpuSample& g : gpus) {
      if (g.memory_total_bytes) {
        e.sample("gpuq_gpu_memory_total_bytes", gpu_labels(g), *g.memory_total_bytes);
      }
    }
  }
  return e.take();
}

}  // namespace gpuq::daemon
