#include "status_report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "gpuq/common/clock.hpp"
#include "ops.hpp"

namespace gpuq::daemon {
namespace {

using nlohmann::json;

json gpu_json(const GpuInfo& g) {
  return {{"index", g.index},
          {"uuid", g.uuid},
          {"pci_bus_id", g.pci_bus_id},
          {"name", g.name},
          {"memory_bytes", g.memory_bytes},
          {"local_cpus", g.local_cpus},
          {"numa_node", g.numa_node}};
}

}  // namespace

// "cpu 2/2 ready, ring 20; gpu0 0/2 ready, 2 failed, failing jobs, ring 20; gpu1 unavailable"
std::string pools_summary(const std::vector<PoolHealth>& pools) {
  std::string s;
  for (const PoolHealth& p : pools) {
    if (!s.empty()) s += "; ";
    if (p.unavailable) {
      s += p.name + " unavailable";  // the reason is in the log and in gpuqctl status
      continue;
    }
    s += p.name + " " + std::to_string(p.ready) + "/" + std::to_string(p.total) + " ready";
    if (p.spares > 0) {
      s += ", " + std::to_string(p.spares_ready) + "/" + std::to_string(p.spares) + " spare ready";
    }
    if (p.stuck > 0) s += ", " + std::to_string(p.stuck) + " stuck";
    if (p.failed > 0) s += ", " + std::to_string(p.failed) + " failed";
    if (p.settling > 0) s += ", " + std::to_string(p.settling) + " starting";
    if (p.down) s += ", failing jobs";
    s += ", ring " + std::to_string(p.capacity);
  }
  return s;
}

std::string StatusReport::document(uint64_t epoch, uint64_t start_ns, bool draining) const {
  const Config& c = *s_.config;
  const QueueView& queue = *s_.queue;
  const PoolPlan& plan = *s_.plan;
  json s;
  s["version"] = GPUQ_VERSION;
  s["pid"] = getpid();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(epoch));
  s["epoch"] = hex;
  s["uptime_s"] = static_cast<double>(monotonic_ns() - start_ns) / 1e9;
  s["state"] = draining ? "draining" : "running";
  s["runtime_dir"] = s_.runtime_dir;
  s["clients"] = s_.clients->registered();
  s["metrics_listen"] = metrics_listen_.empty() ? json(nullptr) : json(metrics_listen_);
  // Indexes of departed clients whose last ring entries have not all been popped yet.
  s["client_indexes_retiring"] = s_.clients->retiring();
  s["client_jobs"] = client_jobs();
  if (plan.discovery_ran) {
    s["gpu_discovery"] = {{"source", plan.discovery.source},
                          {"problem", plan.discovery.problem},
                          {"gpus", json::array()}};
    // The executable gpu pools run on real GPUs; null in a build without CUDA.
    s["gpu_discovery"]["gpu_worker"] =
        s_.gpu_worker_path.empty() ? json(nullptr) : json(s_.gpu_worker_path);
    for (const GpuInfo& g : plan.discovery.gpus) s["gpu_discovery"]["gpus"].push_back(gpu_json(g));
  }
  s["pools"] = json::array();
  const uint64_t now = monotonic_ns();
  bool all_pools_serving = true;
  uint32_t available_pools = 0;
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    const PoolShm& ps = queue.pool(p);
    json pool{{"name", c.pools[p].name},
              {"id", p},
              {"kind", c.pools[p].kind == PoolKind::kGpu ? "gpu" : "cpu"},
              {"capacity", ps.capacity},
              {"queue_depth", queue.queue(p).size()},
              {"queued_by_priority", queued_by_priority(queue.queue(p))},
              {"client_share", ps.client_share},
              {"accepting", ps.accepting.load() == kPoolAccepting},
              {"jobs_submitted", s_.clients->jobs_submitted(p)},
              {"jobs_completed", jobs_completed(p)},
              {"cells_held", cells_held(p)},
              {"ring_cells_retired", s_.recovery->cells_retired(p)},
              {"ring_positions_restored", s_.recovery->positions_restored(p)},
              {"jobs_requeued", s_.recovery->jobs_requeued(p)}};
    if (c.pools[p].removed) {
      // Removed by a config reload: what is left of it (its drain), no longer offered.
      bool running = false;
      for (const auto& w : s_.workers->all()) running = running || (w->pool == p && w->pid > 0);
      pool["status"] = "removed";
      pool["reason"] =
          running ? "removed by a config reload: draining" : "removed by a config reload";
      s["pools"].push_back(pool);
      continue;
    }
    const PoolState& st = plan.pools[p];
    if (c.pools[p].kind == PoolKind::kGpu) {
      pool["gpus"] = json::array();
      for (uint32_t g : st.gpus) pool["gpus"].push_back(gpu_json(plan.discovery.gpus[g]));
      const int fallback = c.pools[p].fallback_pool;
      pool["fallback"] = fallback >= 0 ? json(c.pools[fallback].name) : json(nullptr);
    }
    const uint32_t limit = c.pools[p].job_time_limit_ms;
    pool["job_time_limit_ms"] = limit != 0 ? json(limit) : json(nullptr);
    uint32_t ready = 0, total = 0, stuck_count = 0, spares = 0, spares_ready = 0;
    uint64_t stops_forced = 0;
    pool["workers"] = json::array();
    for (const auto& w : s_.workers->all()) {
      if (w->pool != p || dormant(*w)) continue;  // a surge seat shows while it runs
      const WorkerShm& ws = queue.worker(w->id);
      const bool stuck = w->state == WorkerState::kReady && s_.watch->stuck(*w);
      // Spares serve nothing until promoted: counted apart, never in ready and total; a surge
      // seat (running for a rollout) is listed and counted in neither.
      if (w->surge) {
      } else if (w->spare) {
        ++spares;
        // Not one being stopped: it gave its place to a spare as it was killed.
        if (w->state == WorkerState::kReady && !w->forced) ++spares_ready;
      } else {
        ++total;
        if (w->state == WorkerState::kReady && !stuck) ++ready;
        if (stuck) ++stuck_count;
      }
      stops_forced += w->stops_forced;
      const WorkerPlacement& at = w->placement;
      const auto job = w->state == WorkerState::kReady ? s_.watch->running(*w) : std::nullopt;
      json job_json = nullptr;
      if (job) {
        const OpInfo* op = find_op(job->op_id);
        job_json = {
            {"op", op != nullptr ? json(op->name) : json(nullptr)},
            {"client", job->client},
            {"client_pid", job->client_pid},
            {"client_name", job->client_name},
            {"slot", job->slot},
            {"age_ms", static_cast<double>(job->age_ns) / 1e6},
            {"time_limit_ms", job->time_limit_ms != 0 ? json(job->time_limit_ms) : json(nullptr)},
            {"stop_requested",
             job->stop_requested != nullptr ? json(job->stop_requested) : json(nullptr)}};
      }
      // A worker waiting for its next start: after a death (restarting), or one whose starts
      // keep failing (failed). Its start failures in a row, and how its last process ended.
      const bool waiting = s_.workers->awaits_start(*w);
      const int64_t next_start_ns =
          waiting ? static_cast<int64_t>(w->respawn_at_ns) - static_cast<int64_t>(now) : 0;
      pool["workers"].push_back(
          {{"id", w->id},
           {"role", w->surge   ? "surge"
                    : w->spare ? "spare"
                               : "active"},
           {"generation", w->generation},
           {"pid", w->pid},
           {"cpus", at.cpus},
           {"state", stuck ? "stuck" : worker_state_name(w->state)},
           {"busy", (w->priv().job_seq.load() & 1) != 0},
           {"job", job_json},
           {"jobs_done", ws.jobs_done.load()},
           {"jobs_failed", ws.jobs_failed.load()},
           {"restarts", ws.restarts.load()},
           {"stops_forced", w->stops_forced},
           {"start_failures", w->backoff.start_failures()},
           {"next_start_ms",
            waiting ? json(static_cast<double>(std::max<int64_t>(next_start_ns, 0)) / 1e6)
                    : json(nullptr)},
           {"last_exit", w->last_exit.empty() ? json(nullptr) : json(w->last_exit)},
           {"start_ms",
            w->start_ns != 0 ? json(static_cast<double>(w->start_ns) / 1e6) : json(nullptr)}});
      if (at.gpu >= 0) pool["workers"].back()["gpu"] = plan.discovery.gpus[at.gpu].uuid;
      if (!w->backend_info.empty()) {
        pool["workers"].back()["backend"] = json::parse(w->backend_info, nullptr, false);
      }
      // Why its last start failed (what it printed on stderr: a Python traceback).
      if (!w->start_error.empty()) pool["workers"].back()["start_error"] = w->start_error;
    }
    // How long it has had no ready worker (counting toward pool_down_fail_ms), and whether its
    // jobs fail for it (PoolOutage).
    const PoolOutage& outage = *s_.outage;
    pool["unserved_ms"] =
        outage.unserved(p)
            ? json(static_cast<double>(now - std::min(now, outage.unserved_since(p))) / 1e6)
            : json(nullptr);
    pool["failing_jobs"] = outage.down(p);
    pool["failing_jobs_error"] = outage.down(p) ? json(outage.reason(p)) : json(nullptr);
    pool["workers_ready"] = ready;  // able to take work: active, ready and not stuck
    pool["workers_stuck"] = stuck_count;
    pool["workers_total"] = total;  // active workers (`workers`), spares apart
    pool["spares_ready"] = spares_ready;
    pool["spares_total"] = spares;
    pool["spare_promotions"] = s_.spares->promotions(p);
    // Rolling restarts (docs/design/live_changes.md): the generation new processes run, the
    // one in progress, and why the last one stopped, kept until the next.
    pool["generation"] = s_.workers->generation(p);
    const std::string& failure = s_.rollouts->last_failure(p);
    pool["rollout"] = {{"state", s_.rollouts->in_progress(p)    ? json("rolling")
                                 : !failure.empty()             ? json("failed")
                                 : s_.rollouts->rollouts(p) > 0 ? json("done")
                                                                : json(nullptr)},
                       {"error", failure.empty() ? json(nullptr) : json(failure)},
                       {"completed", s_.rollouts->rollouts(p)},
                       {"failed", s_.rollouts->failures(p)}};
    pool["stops_forced"] = stops_forced;
    if (const auto& py = c.pools[p].python) {
      json ops = json::array();
      // The batched ops' settings by name (docs/python.md, "Dynamic batching"; a step op's,
      // "Step-level batching", with "step": true); an op that is not batched (max_batch_size
      // 1) has no entry.
      json batching = json::object();
      for (const OpInfo& op : op_registry()) {
        if (op.python != nullptr && std::find(op.python->pools.begin(), op.python->pools.end(),
                                              p) != op.python->pools.end()) {
          ops.push_back(op.name);
          if (const BatchSettings b = op.python->batching_on(p); b.batched()) {
            batching[op.name] = {{"max_batch_size", b.max_batch_size},
                                 {"max_queue_delay_us", b.max_queue_delay_us}};
            if (b.step) batching[op.name]["step"] = true;
          }
        }
      }
      pool["python"] = {{"interpreter", py->interpreter},
                        {"modules", py->modules},
                        {"allow_callables", py->allow_callables},
                        {"ops", ops},
                        {"batching", batching}};
    }
    if (!st.start_error.empty()) pool["start_error"] = st.start_error;
    pool["worker_spin_us"] = spin_us_of(c, c.pools[p]);
    if (!st.available) {
      pool["status"] = "unavailable";
      pool["reason"] = st.reason;
    } else if (st.adding) {
      // Added by a config reload, not yet accepting jobs (not in the catalog yet).
      pool["status"] = "adding";
      pool["reason"] = "added by a config reload: starting";
    } else {
      ++available_pools;
      pool["status"] = ready == total ? "ready" : (ready > 0 ? "degraded" : "down");
      pool["reason"] = ready == total
                           ? ""
                           : std::to_string(total - ready) + " of " + std::to_string(total) +
                                 " workers not ready" +
                                 (stuck_count > 0 ? " (" + std::to_string(stuck_count) +
                                                        " stuck on a job that did not end)"
                                                  : "");
      if (ready == 0) all_pools_serving = false;
    }
    s["pools"].push_back(pool);
  }
  // Ready: accepting jobs, and every available pool has at least one live, ready worker. An
  // unavailable pool (a gpu pool without a GPU) does not count: it will not get better by
  // waiting, and the daemon serves its other pools (and this pool's fallback); its status says
  // "unavailable" with the reason. With no available pool at all, nothing can run: not ready.
  // A readiness probe (gpuqctl ready) answers from this.
  s["ready"] = !draining && all_pools_serving && available_pools > 0;
  // Replace, not throw: start_error holds whatever a worker printed (maybe not UTF-8).
  return s.dump(-1, ' ', false, json::error_handler_t::replace);
}

// A pool's queued jobs by level, highest first (lane sizes: a hint while jobs move).
json StatusReport::queued_by_priority(const PoolQueue& q) {
  json levels = json::object();
  for (uint32_t r = 0; r < kPriorityLevels; ++r) {
    levels[std::string(priority_name(priority_at_rank(r)))] = q.level_size(r);
  }
  return levels;
}

// The clients with jobs queued or running, most queued first (then most running), at most
// kClientJobsShown: each one's index, pid, program, and its jobs in each pool.
json StatusReport::client_jobs() const {
  const Config& c = *s_.config;
  json out = json::array();
  for (const ClientRegistry::JobCounts& r : s_.clients->busiest(c.pools.size(), kClientJobsShown)) {
    json pools = json::object();
    for (uint32_t p = 0; p < r.pools.size(); ++p) {
      if (r.pools[p].first + r.pools[p].second == 0) continue;
      pools[c.pools[p].name] = {{"queued", r.pools[p].first}, {"running", r.pools[p].second}};
    }
    out.push_back({{"client", r.client->index},
                   {"pid", r.client->pid},
                   {"program", r.client->name},
                   {"weight", r.client->weight},
                   {"queued", r.queued},
                   {"running", r.running},
                   {"pools", std::move(pools)}});
  }
  return out;
}

// Ring cells of pool `p` whose entries name a client index in use (a connected client, or
// one that has gone and whose index is still retiring): 0 when idle.
uint64_t StatusReport::cells_held(uint32_t p) const {
  uint64_t n = 0;
  s_.queue->queue(p).for_each_value([&](uint32_t v) {
    const uint32_t c = JobRef::unpack(v).client;
    if (s_.clients->index_in_use(c)) ++n;
  });
  return n;
}

// Each pool's workers by state, for the service manager's READY=1 and STATUS= lines.
std::vector<PoolHealth> StatusReport::pool_health() const {
  const Config& c = *s_.config;
  std::vector<PoolHealth> pools(c.pools.size());
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    pools[p].name = c.pools[p].name;
    pools[p].capacity = s_.queue->pool(p).capacity;
    // A pool a reload removed counts as one that cannot serve, as an unavailable one does.
    pools[p].unavailable = !s_.plan->pools[p].available || c.pools[p].removed;
    pools[p].down = s_.outage->down(p);
  }
  for (const auto& w : s_.workers->all()) {
    if (w->surge || w->reserve) continue;  // serves no job: a rollout's seat, a free record
    if (c.pools[w->pool].removed) continue;
    PoolHealth& h = pools[w->pool];
    if (w->spare) {
      ++h.spares;
      if (w->state == WorkerState::kReady && !w->forced) ++h.spares_ready;
      if (w->state == WorkerState::kStarting || w->state == WorkerState::kRestarting) {
        if (!w->backoff.failing()) ++h.settling;
      }
      continue;
    }
    ++h.total;
    const bool stuck = w->state == WorkerState::kReady && s_.watch->stuck(*w);
    if (w->state == WorkerState::kReady && !stuck) ++h.ready;
    if (stuck) ++h.stuck;
    // A failed worker starting again is still failed until it is ready: its starts keep
    // failing, and it must not hold back READY=1 (service_link.cpp) at each try.
    const bool failing = w->state != WorkerState::kReady && w->state != WorkerState::kStopped &&
                         w->backoff.failing();
    if (failing) {
      ++h.failed;
    } else if (w->state == WorkerState::kStarting || w->state == WorkerState::kRestarting) {
      ++h.settling;
    }
  }
  return pools;
}

// Jobs of pool `p` that reached a terminal state in a worker (or failed with its death), or
// failed while queued because the pool was down.
uint64_t StatusReport::jobs_completed(uint32_t p) const {
  uint64_t n = s_.recovery->jobs_failed_down(p);
  for (const auto& w : s_.workers->all()) {
    if (w->pool != p) continue;
    n += s_.queue->worker(w->id).jobs_done.load() + s_.queue->worker(w->id).jobs_failed.load();
  }
  return n;
}

}  // namespace gpuq::daemon
