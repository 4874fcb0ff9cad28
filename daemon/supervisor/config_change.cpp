#include "config_change.hpp"

#include <algorithm>

namespace gpuq::daemon {
namespace {

bool same_gpus(const PoolConfig& a, const PoolConfig& b) {
  if (a.all_gpus != b.all_gpus || a.gpus.size() != b.gpus.size()) return false;
  for (size_t i = 0; i < a.gpus.size(); ++i) {
    const GpuSelector &x = a.gpus[i], &y = b.gpus[i];
    if (x.by_uuid != y.by_uuid || (x.by_uuid ? x.uuid != y.uuid : x.index != y.index)) {
      return false;
    }
  }
  return true;
}

bool same_listen(const std::optional<ListenAddress>& a, const std::optional<ListenAddress>& b) {
  if (a.has_value() != b.has_value()) return false;
  return !a || (a->host == b->host && a->port == b->port);
}

// The daemon keys: those that take effect at once go to `live`, the others to `fixed`.
void diff_daemon(const Config& a, const Config& b, ConfigChange& out) {
  auto fixed = [&](bool differ, const char* key, const char* why) {
    if (differ) out.fixed.push_back(std::string(key) + " (" + why + ")");
  };
  const char* layout = "it sizes the queue segment every client maps";
  fixed(a.queue_factor != b.queue_factor, "queue_factor", layout);
  fixed(a.max_clients != b.max_clients, "max_clients", layout);
  fixed(a.max_jobs_per_client != b.max_jobs_per_client, "max_jobs_per_client",
        "it sizes each client's segment");
  fixed(a.client_queue_share != b.client_queue_share, "client_queue_share",
        "clients hold their share from their handshake");
  fixed(a.client_segment_bytes != b.client_segment_bytes, "client_segment_bytes",
        "it sizes each client's segment");
  fixed(a.max_client_segment_bytes != b.max_client_segment_bytes, "max_client_segment_bytes",
        "it sizes each client's segment");
  fixed(a.job_clock != b.job_clock, "job_clock", "clients read job stamps in it");
  fixed(a.group_set != b.group_set || a.group != b.group, "group",
        "the socket and the queue segment were made with it");
  fixed(a.job_metrics != b.job_metrics, "job_metrics", "every worker was started with it");
  fixed(a.stream_reader_timeout_ms != b.stream_reader_timeout_ms, "stream_reader_timeout_ms",
        "every worker was started with it");
  fixed(!same_listen(a.metrics_listen, b.metrics_listen), "metrics_listen",
        "the listener was bound at start");
  fixed(a.plugins != b.plugins, "plugins", "their ops' ids were given to clients");
  fixed(a.max_pools_setting != b.max_pools_setting, "max_pools", layout);
  fixed(a.added_pool_workers_setting != b.added_pool_workers_setting, "added_pool_workers", layout);
  for (const LiveKey& k : live_daemon_keys()) {
    if (!k.same(a, b)) out.daemon_keys.emplace_back(k.name);
  }
  // worker_spin_us is compared per pool, as each pool's effective spin (below).
}

// One running pool against its namesake in the new file.
void diff_pool(const Config& ca, const PoolConfig& a, const Config& cb, const PoolConfig& b,
               uint32_t index, ConfigChange& out) {
  const std::string at = "pools[" + a.name + "].";
  auto fixed = [&](bool differ, const std::string& key, const char* why) {
    if (differ) out.fixed.push_back(at + key + " (" + why + ")");
  };
  const char* layout = "its ring and worker records are fixed in the queue segment";
  fixed(a.kind != b.kind, "kind", "clients hold the pool's kind; add a pool of another name");
  fixed(a.max_workers_setting != b.max_workers_setting, "max_workers", layout);
  // A cpu pool's workers change live within its max_workers (entries and ring reserved).
  const bool resize = a.kind == PoolKind::kCpu && b.kind == PoolKind::kCpu &&
                      a.workers != b.workers && b.workers <= a.max_workers;
  const bool gpu = a.kind == PoolKind::kGpu && b.kind == PoolKind::kGpu;
  if (!gpu) {
    fixed(a.workers != b.workers && !resize, "workers",
          "more than its max_workers: its ring and worker records are fixed in the queue "
          "segment; a pool may grow to max_workers live");
  }
  fixed(a.spare_workers != b.spare_workers, "spare_workers", layout);
  fixed(a.rollout_surge_workers != b.rollout_surge_workers, "rollout_surge_workers", layout);
  fixed(a.fallback != b.fallback, "fallback", "clients hold the pool's fallback");
  fixed(a.python.has_value() != b.python.has_value(), "python",
        "a pool cannot become a Python pool or stop being one; add a pool of another name");
  PoolChange change{a.name, index, {}, false, 0};
  if (a.python && b.python) {
    const PythonPoolConfig &x = *a.python, &y = *b.python;
    auto rolled = [&](bool differ, const char* key) {
      if (differ) change.keys.emplace_back(key);
    };
    rolled(x.interpreter != y.interpreter, "python.interpreter");
    rolled(x.modules != y.modules, "python.modules");
    rolled(x.path != y.path, "python.path");
    rolled(x.env != y.env, "python.env");
    rolled(x.allow_callables != y.allow_callables, "python.allow_callables");
  }
  if (spin_us_of(ca, a) != spin_us_of(cb, b)) change.keys.emplace_back("worker_spin_us");
  // A cpu pool's new CPUs: its new workers are placed there, its old ones leave with a rollout.
  if (a.kind == PoolKind::kCpu && a.cpus != b.cpus) change.keys.emplace_back("cpus");
  change.rollout = !change.keys.empty();
  // A gpu pool's GPUs and budget: ConfigReload plans them again with every gpu pool's and
  // rolls the pool where a worker would move or have less memory (needs_restart).
  // Its size (workers_per_gpu x its GPUs) too, within its max_workers, which ConfigReload checks
  // once the GPUs are counted.
  if (gpu && !same_gpus(a, b)) change.keys.emplace_back("gpus");
  if (gpu && a.workers_per_gpu != b.workers_per_gpu) change.keys.emplace_back("workers_per_gpu");
  if (gpu && (a.memory_limit_bytes != b.memory_limit_bytes ||
              a.memory_limit_fraction != b.memory_limit_fraction)) {
    change.keys.emplace_back("memory_limit");
  }
  if (a.job_time_limit_ms != b.job_time_limit_ms) change.keys.emplace_back("job_time_limit_ms");
  if (resize) {
    change.keys.emplace_back("workers");
    change.workers = b.workers;
  }
  if (!change.keys.empty()) out.pools.push_back(std::move(change));
}

}  // namespace

const std::vector<LiveKey>& live_daemon_keys() {
  // A uint32_t key, by its Config member.
  auto number = [](const char* name, uint32_t Config::*field) {
    return LiveKey{name, [field](const Config& a, const Config& b) { return a.*field == b.*field; },
                   [field](Config& to, const Config& from) { to.*field = from.*field; }};
  };
  static const std::vector<LiveKey> kKeys = {
      {"log_level", [](const Config& a, const Config& b) { return a.log_level == b.log_level; },
       [](Config& to, const Config& from) { to.log_level = from.log_level; }},
      number("drain_timeout_ms", &Config::drain_timeout_ms),
      number("cancel_grace_ms", &Config::cancel_grace_ms),
      number("restart_backoff_initial_ms", &Config::restart_backoff_initial_ms),
      number("restart_backoff_max_ms", &Config::restart_backoff_max_ms),
      number("max_start_failures", &Config::max_start_failures),
      number("start_backoff_initial_ms", &Config::start_backoff_initial_ms),
      number("start_backoff_max_ms", &Config::start_backoff_max_ms),
      number("start_timeout_ms", &Config::start_timeout_ms),
      number("pool_down_fail_ms", &Config::pool_down_fail_ms),
      {"allowed_users",
       [](const Config& a, const Config& b) { return a.allowed_uids == b.allowed_uids; },
       [](Config& to, const Config& from) { to.allowed_uids = from.allowed_uids; }},
      {"allowed_groups",
       [](const Config& a, const Config& b) { return a.allowed_gids == b.allowed_gids; },
       [](Config& to, const Config& from) { to.allowed_gids = from.allowed_gids; }},
      // The lanes' weights follow within an audit (ClientRegistry::apply_weights).
      {"client_weights",
       [](const Config& a, const Config& b) { return a.client_weights == b.client_weights; },
       [](Config& to, const Config& from) { to.client_weights = from.client_weights; }},
  };
  return kKeys;
}

ConfigChange diff_configs(const Config& running, const Config& next) {
  ConfigChange out;
  diff_daemon(running, next, out);
  for (uint32_t p = 0; p < running.pools.size(); ++p) {
    const PoolConfig& a = running.pools[p];
    if (a.removed) continue;
    auto it = std::find_if(next.pools.begin(), next.pools.end(),
                           [&](const PoolConfig& b) { return b.name == a.name; });
    if (it == next.pools.end()) {
      out.removed.push_back(p);
      continue;
    }
    diff_pool(running, a, next, *it, p, out);
  }
  uint32_t free = free_pool_records(running);
  for (uint32_t i = 0; i < next.pools.size(); ++i) {
    const PoolConfig& b = next.pools[i];
    const bool runs =
        std::any_of(running.pools.begin(), running.pools.end(),
                    [&](const PoolConfig& a) { return !a.removed && a.name == b.name; });
    if (runs) continue;
    const std::string at = "pools[" + b.name + "] (a new pool: ";
    if (free == 0) {
      out.fixed.push_back(at + "no free pool record left: max_pools is " +
                          std::to_string(running.max_pools) + ", and removed pools keep theirs)");
    } else if (b.entries() > running.added_pool_workers) {
      out.fixed.push_back(at + std::to_string(b.entries()) +
                          " worker entries (workers, spare_workers, rollout_surge_workers), more "
                          "than added_pool_workers, " +
                          std::to_string(running.added_pool_workers) + ")");
    } else {
      --free;
      out.added.push_back(i);
    }
  }
  // Removing every pool would leave clients nothing to submit to: keep one.
  const auto running_pools = static_cast<size_t>(std::count_if(
      running.pools.begin(), running.pools.end(), [](const PoolConfig& a) { return !a.removed; }));
  if (!out.removed.empty() && out.removed.size() == running_pools && out.added.empty()) {
    out.fixed.push_back("pools (every running pool would be removed: keep at least one)");
  }
  return out;
}

std::vector<std::string> ConfigChange::describe(const Config& running, const Config& next) const {
  std::vector<std::string> lines;
  for (const std::string& key : daemon_keys) lines.push_back(key + ": changed, in effect now");
  for (const PoolChange& c : pools) {
    std::string keys;
    for (const std::string& k : c.keys) keys += (keys.empty() ? "" : ", ") + k;
    lines.push_back("pool " + c.name + ": " + keys +
                    (c.rollout ? " changed: rolling restart" : " changed, in effect now") +
                    (c.workers != 0 ? " (" + std::to_string(c.workers) + " workers)" : ""));
  }
  for (uint32_t i : added) {
    lines.push_back("pool " + next.pools[i].name + ": added, " +
                    std::to_string(next.pools[i].workers) + " workers");
  }
  for (uint32_t p : removed) {
    lines.push_back("pool " + running.pools[p].name +
                    ": removed: its queued and running jobs finish, new ones fail UnknownPool");
  }
  return lines;
}

}  // namespace gpuq::daemon
