// What `gpuqctl top` shows (top_report.hpp).
#include "top_report.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cli.hpp"

namespace gpuq::ctl {
namespace {

constexpr std::string_view kJobsTotal = "gpuq_jobs_total";
constexpr std::string_view kQueueWaitBucket = "gpuq_job_queue_wait_seconds_bucket";
constexpr std::string_view kRunBucket = "gpuq_job_run_seconds_bucket";
constexpr std::string_view kRestartsTotal = "gpuq_worker_restarts_total";
constexpr std::string_view kBatchRowsSum = "gpuq_batch_rows_sum";
constexpr std::string_view kBatchRowsCount = "gpuq_batch_rows_count";

// A series' identity: its name and its labels in sorted order.
std::string series_key(const PromSample& s) {
  std::vector<std::pair<std::string, std::string>> labels = s.labels;
  std::sort(labels.begin(), labels.end());
  std::string key = s.name;
  for (const auto& [name, value] : labels) {
    key += '\x1f';
    key += name;
    key += '=';
    key += value;
  }
  return key;
}

// What one pool's counters added up to over the interval.
struct PoolDeltas {
  double jobs = 0, failed = 0;
  bool jobs_void = false;
  std::map<double, double> queue_wait, run;  // upper bound -> cumulative count, summed over ops
  bool queue_wait_void = false, run_void = false;
  bool restarts_void = false;
  double batch_rows = 0, batch_calls = 0;  // summed over batched ops
  bool batch_void = false;
};

class TopBuilder {
 public:
  TopBuilder(const std::vector<PromSample>& before, const std::vector<PromSample>& after,
             double interval_s)
      : before_(before), after_(after) {
    report_.interval_s = interval_s;
    for (const PromSample& s : before_) before_values_.emplace(series_key(s), s.value);
  }

  TopReport build() {
    find_restart();
    for (const PromSample& s : after_) read(s);
    void_vanished_series();
    for (size_t p = 0; p < report_.pools.size(); ++p) finish(report_.pools[p], deltas_[p]);
    return std::move(report_);
  }

 private:
  // Start times that differ: two daemons, whose counters cannot be subtracted.
  void find_restart() {
    std::optional<double> then, now;
    for (const PromSample& s : before_) {
      if (s.name == "gpuq_start_time_seconds") then = s.value;
    }
    for (const PromSample& s : after_) {
      if (s.name == "gpuq_start_time_seconds") now = s.value;
    }
    report_.daemon_restarted = then && now && *then != *now;
  }

  std::optional<size_t> find_pool(std::string_view name) const {
    for (size_t p = 0; p < report_.pools.size(); ++p) {
      if (report_.pools[p].name == name) return p;
    }
    return std::nullopt;
  }

  // The pool's entry, added at the end when it is new.
  size_t pool_index(std::string_view name) {
    if (auto p = find_pool(name)) return *p;
    report_.pools.push_back(PoolTop{});
    report_.pools.back().name = std::string(name);
    deltas_.emplace_back();
    return report_.pools.size() - 1;
  }

  // The counter's increase since `before`, or nullopt when it went down (or is not a number,
  // or the daemon restarted). A series `before` lacks counts from 0.
  std::optional<double> delta(const PromSample& s) const {
    if (report_.daemon_restarted) return std::nullopt;
    auto it = before_values_.find(series_key(s));
    const double d = s.value - (it == before_values_.end() ? 0.0 : it->second);
    if (!(d >= 0)) return std::nullopt;  // negative or NaN
    return d;
  }

  static void add_bucket(const PromSample& s, std::optional<double> d,
                         std::map<double, double>& buckets, bool& is_void) {
    if (!d) {
      is_void = true;
      return;
    }
    if (auto le = parse_prom_value(s.label("le")); le && !std::isnan(*le)) buckets[*le] += *d;
  }

  void read(const PromSample& s) {
    const std::string_view name = s.name;
    if (name == "gpuq_build_info") {
      report_.version = std::string(s.label("version"));
    } else if (name == "gpuq_start_time_seconds") {
      report_.start_time_s = s.value;
    } else if (name == "gpuq_ready") {
      report_.ready = s.value == 1;
    } else if (name == "gpuq_draining") {
      report_.draining = s.value == 1;
    } else if (name == "gpuq_clients_connected") {
      report_.clients = s.value;
    } else if (name == "gpuq_clients_max") {
      report_.clients_max = s.value;
    } else if (name == "gpuq_queue_depth") {
      report_.pools[pool_index(s.label("pool"))].queue_depth = s.value;
    } else if (name == "gpuq_queue_capacity") {
      report_.pools[pool_index(s.label("pool"))].queue_capacity = s.value;
    } else if (name == "gpuq_workers") {
      report_.pools[pool_index(s.label("pool"))].workers.emplace_back(s.label("state"), s.value);
    } else if (name == kRestartsTotal) {
      const size_t p = pool_index(s.label("pool"));
      report_.pools[p].restarts = s.value;
      if (auto d = delta(s)) {
        report_.pools[p].restarts_delta = *d;
      } else {
        deltas_[p].restarts_void = true;
      }
    } else if (name == kJobsTotal) {
      PoolDeltas& d = deltas_[pool_index(s.label("pool"))];
      if (auto jobs = delta(s)) {
        d.jobs += *jobs;
        if (s.label("outcome") != "ok") d.failed += *jobs;
      } else {
        d.jobs_void = true;
      }
    } else if (name == kQueueWaitBucket) {
      PoolDeltas& d = deltas_[pool_index(s.label("pool"))];
      add_bucket(s, delta(s), d.queue_wait, d.queue_wait_void);
    } else if (name == kRunBucket) {
      PoolDeltas& d = deltas_[pool_index(s.label("pool"))];
      add_bucket(s, delta(s), d.run, d.run_void);
    } else if (name == kBatchRowsSum || name == kBatchRowsCount) {
      const size_t p = pool_index(s.label("pool"));
      report_.pools[p].batched = true;
      PoolDeltas& d = deltas_[p];
      if (auto n = delta(s)) {
        (name == kBatchRowsSum ? d.batch_rows : d.batch_calls) += *n;
      } else {
        d.batch_void = true;
      }
    } else if (name == "gpuq_worker_gpu_memory_used_bytes" ||
               name == "gpuq_worker_gpu_memory_budget_bytes") {
      GpuWorkerTop& w = gpu_worker(s);
      (name == "gpuq_worker_gpu_memory_used_bytes" ? w.used_bytes : w.budget_bytes) = s.value;
    } else if (name == "gpuq_client_jobs") {
      ClientTop& c = client(s);
      (s.label("state") == "queued" ? c.queued : c.running) = s.value;
    } else if (name == "gpuq_gpu_utilization_ratio") {
      gpu(s).utilization = s.value;
    } else if (name == "gpuq_gpu_memory_used_bytes") {
      gpu(s).used_bytes = s.value;
    } else if (name == "gpuq_gpu_memory_total_bytes") {
      gpu(s).total_bytes = s.value;
    }
  }

  GpuWorkerTop& gpu_worker(const PromSample& s) {
    for (GpuWorkerTop& w : report_.gpu_workers) {
      if (w.pool == s.label("pool") && w.worker == s.label("worker") && w.gpu == s.label("gpu")) {
        return w;
      }
    }
    report_.gpu_workers.push_back(GpuWorkerTop{std::string(s.label("pool")),
                                               std::string(s.label("worker")),
                                               std::string(s.label("gpu")),
                                               {},
                                               {}});
    return report_.gpu_workers.back();
  }

  ClientTop& client(const PromSample& s) {
    for (ClientTop& c : report_.clients_with_jobs) {
      if (c.client == s.label("client") && c.pid == s.label("pid")) return c;
    }
    report_.clients_with_jobs.push_back(ClientTop{std::string(s.label("client")),
                                                  std::string(s.label("pid")),
                                                  std::string(s.label("program")), 0, 0});
    return report_.clients_with_jobs.back();
  }

  GpuTop& gpu(const PromSample& s) {
    for (GpuTop& g : report_.gpus) {
      if (g.gpu == s.label("gpu") && g.uuid == s.label("uuid")) return g;
    }
    report_.gpus.push_back(
        GpuTop{std::string(s.label("gpu")), std::string(s.label("uuid")), {}, {}, {}});
    return report_.gpus.back();
  }

  // A counter series of `before` that `after` lacks went away with its daemon.
  void void_vanished_series() {
    std::unordered_set<std::string> now;
    for (const PromSample& s : after_) now.insert(series_key(s));
    for (const PromSample& s : before_) {
      const std::string_view name = s.name;
      if (name != kJobsTotal && name != kQueueWaitBucket && name != kRunBucket &&
          name != kRestartsTotal && name != kBatchRowsSum && name != kBatchRowsCount) {
        continue;
      }
      if (now.count(series_key(s)) != 0) continue;
      const auto p = find_pool(s.label("pool"));
      if (!p) continue;  // a pool gone with its daemon: not in the report
      PoolDeltas& d = deltas_[*p];
      if (name == kJobsTotal) d.jobs_void = true;
      if (name == kQueueWaitBucket) d.queue_wait_void = true;
      if (name == kRunBucket) d.run_void = true;
      if (name == kRestartsTotal) d.restarts_void = true;
      if (name == kBatchRowsSum || name == kBatchRowsCount) d.batch_void = true;
    }
  }

  void finish(PoolTop& pool, const PoolDeltas& d) const {
    const double seconds = report_.interval_s;
    const bool rates = seconds > 0 && !report_.daemon_restarted;
    if (rates && !d.jobs_void) {
      pool.jobs_per_s = d.jobs / seconds;
      pool.failed_per_s = d.failed / seconds;
    }
    if (d.restarts_void) pool.restarts_delta.reset();
    const auto quantiles = [rates](const std::map<double, double>& buckets, bool is_void,
                                   std::optional<double>& p50, std::optional<double>& p99) {
      if (!rates || is_void) return;
      const std::vector<std::pair<double, double>> list(buckets.begin(), buckets.end());
      p50 = histogram_quantile(0.5, list);
      p99 = histogram_quantile(0.99, list);
    };
    quantiles(d.queue_wait, d.queue_wait_void, pool.wait_p50, pool.wait_p99);
    quantiles(d.run, d.run_void, pool.run_p50, pool.run_p99);
    if (rates && !d.batch_void && d.batch_calls > 0) pool.mean_batch = d.batch_rows / d.batch_calls;
  }

  const std::vector<PromSample>& before_;
  const std::vector<PromSample>& after_;
  std::unordered_map<std::string, double> before_values_;
  TopReport report_;
  std::vector<PoolDeltas> deltas_;  // one per report_.pools entry
};

// "512 B", "12.0 KiB", "1.50 GiB".
std::string format_bytes(double bytes) {
  if (bytes < 1024) return strf("%.0f B", bytes);
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = bytes / 1024;
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  return strf(value < 100 ? "%.2f %s" : "%.1f %s", value, kUnits[unit]);
}

std::string format_seconds(std::optional<double> seconds) {
  if (!seconds) return "-";
  return format_ns(static_cast<uint64_t>(std::llround(std::max(0.0, *seconds) * 1e9)));
}

std::string format_rate(std::optional<double> per_s) {
  return per_s ? strf("%.1f", *per_s) : "-";
}

std::string format_count(std::optional<double> value) {
  return value ? strf("%.0f", *value) : "-";
}

std::string pad_right(std::string text, size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

// "1.20 GiB / 4.00 GiB (30%)"; "-" for a part that is missing.
std::string format_share(std::optional<double> used, std::optional<double> of) {
  std::string text = (used ? format_bytes(*used) : "-") + " / " + (of ? format_bytes(*of) : "-");
  if (used && of && *of > 0) text += strf(" (%.0f%%)", *used / *of * 100);
  return text;
}

constexpr const char* kPoolRow = "%9s %9s %10s %10s %10s %10s %11s %5s %5s %6s %11s %7s %9s";
constexpr const char* kBatchCell = " %7s";

}  // namespace

double PoolTop::workers_in(std::string_view state) const {
  double n = 0;
  for (const auto& [worker_state, count] : workers) {
    if (worker_state == state) n += count;
  }
  return n;
}

std::optional<double> histogram_quantile(double q, std::vector<std::pair<double, double>> buckets) {
  if (!(q >= 0 && q <= 1)) return std::nullopt;
  std::sort(buckets.begin(), buckets.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  if (buckets.empty() || !std::isinf(buckets.back().first) || buckets.back().first < 0) {
    return std::nullopt;
  }
  // Equal bounds merged (one series per op, say), then counts made monotonic: a scrape can
  // catch one bucket before its neighbour.
  std::vector<std::pair<double, double>> merged;
  for (const auto& [le, count] : buckets) {
    if (!merged.empty() && merged.back().first == le) {
      merged.back().second += count;
    } else {
      merged.emplace_back(le, count);
    }
  }
  for (size_t i = 1; i < merged.size(); ++i) {
    merged[i].second = std::max(merged[i].second, merged[i - 1].second);
  }
  if (merged.size() < 2) return std::nullopt;
  const double observations = merged.back().second;
  if (!(observations > 0)) return std::nullopt;
  double rank = q * observations;
  size_t b = 0;
  while (b < merged.size() - 1 && merged[b].second < rank) ++b;
  if (b == merged.size() - 1) return merged[b - 1].first;
  if (b == 0 && merged[0].first <= 0) return merged[0].first;
  double start = 0;
  double count = merged[b].second;
  if (b > 0) {
    start = merged[b - 1].first;
    count -= merged[b - 1].second;
    rank -= merged[b - 1].second;
  }
  return start + (merged[b].first - start) * (rank / count);
}

TopReport compute_top(const std::vector<PromSample>& before, const std::vector<PromSample>& after,
                      double interval_s) {
  return TopBuilder(before, after, interval_s).build();
}

std::string format_top(const TopReport& r, double now_unix_s) {
  std::string out = "gpuqd " + (r.version.empty() ? std::string("?") : r.version);
  if (r.start_time_s && now_unix_s >= *r.start_time_s) {
    out += ", up " + format_uptime(now_unix_s - *r.start_time_s);
  }
  out += r.draining ? ", draining" : r.ready ? ", ready" : ", not ready";
  out += ", clients " + format_count(r.clients);
  if (r.clients_max) {
    // Two appends: GCC 12's -Wrestrict misfires on "/" + std::string&& (its insert at 0).
    out += '/';
    out += format_count(r.clients_max);
  }
  out += strf(", over %.2f s", r.interval_s);
  if (r.daemon_restarted) out += " (the daemon restarted: no rates this time)";
  out += '\n';

  // The BATCH column only where some pool has batched ops; none on the line of a pool without.
  const bool batch_column =
      std::any_of(r.pools.begin(), r.pools.end(), [](const PoolTop& p) { return p.batched; });
  out += pad_right("POOL", 10) + ' ' +
         strf(kPoolRow, "JOBS/S", "FAILED/S", "WAIT P50", "WAIT P99", "RUN P50", "RUN P99", "QUEUE",
              "BUSY", "IDLE", "STUCK", "RESTARTING", "FAILED", "RESTARTS") +
         (batch_column ? strf(kBatchCell, "BATCH") : std::string()) + '\n';
  for (const PoolTop& p : r.pools) {
    std::string restarts = format_count(p.restarts);
    if (p.restarts_delta && *p.restarts_delta > 0) {
      restarts += " (+" + format_count(p.restarts_delta) + ")";
    }
    const std::string batch = p.mean_batch ? strf("%.1f", *p.mean_batch) : "-";  // rows per call
    out +=
        pad_right(p.name, 10) + ' ' +
        strf(kPoolRow, format_rate(p.jobs_per_s).c_str(), format_rate(p.failed_per_s).c_str(),
             format_seconds(p.wait_p50).c_str(), format_seconds(p.wait_p99).c_str(),
             format_seconds(p.run_p50).c_str(), format_seconds(p.run_p99).c_str(),
             (format_count(p.queue_depth) + "/" + format_count(p.queue_capacity)).c_str(),
             format_count(p.workers_in("busy")).c_str(), format_count(p.workers_in("idle")).c_str(),
             format_count(p.workers_in("stuck")).c_str(),
             format_count(p.workers_in("restarting")).c_str(),
             format_count(p.workers_in("failed")).c_str(), restarts.c_str()) +
        (p.batched ? strf(kBatchCell, batch.c_str()) : std::string()) + '\n';
  }
  if (r.pools.empty()) out += "no pools\n";

  if (!r.clients_with_jobs.empty()) {
    std::vector<ClientTop> clients = r.clients_with_jobs;
    std::stable_sort(clients.begin(), clients.end(), [](const ClientTop& a, const ClientTop& b) {
      return a.queued != b.queued ? a.queued > b.queued : a.running > b.running;
    });
    out += "\nCLIENT      PID  " + pad_right("PROGRAM", 24) + "  QUEUED  RUNNING\n";
    for (size_t i = 0; i < clients.size() && i < kTopClientsShown; ++i) {
      const ClientTop& c = clients[i];
      std::string program = c.program.size() > 24 ? c.program.substr(0, 21) + "..." : c.program;
      out += strf("%6s %8s  ", c.client.c_str(), c.pid.c_str()) + pad_right(program, 24) +
             strf("  %6s  %7s", format_count(c.queued).c_str(), format_count(c.running).c_str()) +
             '\n';
    }
  }

  if (!r.gpu_workers.empty()) {
    out += "\nGPU WORKER  " + pad_right("POOL", 10) + "  GPU  MEMORY USED / BUDGET\n";
    for (const GpuWorkerTop& w : r.gpu_workers) {
      out += strf("%10s  ", w.worker.c_str()) + pad_right(w.pool, 10) +
             strf("  %3s  ", w.gpu.empty() ? "-" : w.gpu.c_str()) +
             format_share(w.used_bytes, w.budget_bytes) + '\n';
    }
  }
  if (!r.gpus.empty()) {
    out += "\nGPU   UTIL  " + pad_right("MEMORY USED / TOTAL", 32) + "  UUID\n";
    for (const GpuTop& g : r.gpus) {
      const std::string util = g.utilization ? strf("%.0f%%", *g.utilization * 100) : "-";
      out += strf("%3s  %5s  ", g.gpu.c_str(), util.c_str()) +
             pad_right(format_share(g.used_bytes, g.total_bytes), 32) + "  " + g.uuid + '\n';
    }
  }
  return out;
}

}  // namespace gpuq::ctl
