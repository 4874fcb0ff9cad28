#include "config_reload.hpp"

#include <algorithm>
#include <utility>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "python_pool.hpp"

namespace gpuq::daemon {

ConfigReload::ConfigReload(Parts parts, Config file_config)
    : parts_(std::move(parts)), file_config_(std::move(file_config)) {}

void ConfigReload::request(uint64_t requester, bool draining) {
  auto fail = [&](const Error& e) {
    GPUQ_LOG_ERROR("config reload refused: %s", e.message().c_str());
    if (on_done_) on_done_(requester, e);
  };
  if (draining) return fail(Error(ErrorCode::kShuttingDown, "gpuqd is draining"));
  if (parts_.path.empty()) {
    return fail(Error(ErrorCode::kInvalidArgument,
                      "gpuqd was started without --config: there is no file to read again"));
  }
  if (!pending_.empty()) {
    return fail(Error(ErrorCode::kInvalidArgument,
                      "a reload is in progress (its rolling restarts run); reload again when it "
                      "has ended"));
  }
  auto r = apply(requester);
  if (!r) return fail(r.error());
  if (pending_.empty() && on_done_) on_done_(requester, *r);
}

Result<std::vector<std::string>> ConfigReload::apply(uint64_t requester) {
  Config& running = *parts_.config;
  // Parsed and checked as at start and by --check-config.
  auto next = load_config(parts_.path, allowed_cpus());
  if (!next) {
    // load_config's message names the key and the file ("... (in /etc/gpuq/gpuqd.json)").
    return Error(next.error().code(), next.error().message() + "; nothing changed");
  }
  const ConfigChange change = diff_configs(file_config_, *next);
  if (!change.fixed.empty()) {
    std::string keys;
    for (const std::string& k : change.fixed) keys += (keys.empty() ? "" : "; ") + k;
    return Error(ErrorCode::kInvalidArgument,
                 "nothing changed: these cannot change while gpuqd runs (restart it to change "
                 "them): " +
                     keys);
  }
  // Everything that could still refuse is checked before anything changes: each rolled pool
  // can be rolled now, and each Python pool's interpreter is found.
  std::vector<std::pair<uint32_t, PoolConfig>> updated;  // running pools' new settings
  for (const PoolChange& c : change.pools) {
    const PoolConfig& want = *std::find_if(next->pools.begin(), next->pools.end(),
                                           [&](const PoolConfig& p) { return p.name == c.name; });
    PoolConfig now = running.pools[c.pool];
    now.job_time_limit_ms = want.job_time_limit_ms;
    if (c.workers != 0) now.workers = c.workers;  // within max_workers (diff_configs)
    now.cpus = want.cpus;                         // placed below, taken up by the rollout
    now.worker_spin_us = want.worker_spin_us;
    if (want.python) {
      now.python = want.python;
      if (auto found = resolve_python_interpreter(now); !found) {
        return Error(found.error().code(),
                     "pools[" + c.name + "]." + found.error().message() + "; nothing changed");
      }
    }
    if (c.rollout && running.pools[c.pool].entries() > 0) {
      if (auto can = parts_.rollouts->can_start(c.pool); !can) {
        return Error(can.error().code(),
                     "pool " + c.name + ": " + can.error().message() + "; nothing changed");
      }
    }
    updated.emplace_back(c.pool, std::move(now));
  }
  std::vector<PoolConfig> added;  // as they will run (interpreter resolved)
  for (uint32_t i : change.added) {
    PoolConfig pool = next->pools[i];
    pool.fallback_pool = -1;  // a cpu pool's; its index in `next` means nothing here
    if (pool.python) {
      if (auto found = resolve_python_interpreter(pool); !found) {
        return Error(found.error().code(),
                     "pools[" + pool.name + "]." + found.error().message() + "; nothing changed");
      }
    }
    if (auto program = worker_program(pool, *parts_.executables, false); !program) {
      return Error(program.error().code(),
                   "pools[" + pool.name + "]: " + program.error().message() + "; nothing changed");
    }
    added.push_back(std::move(pool));
  }

  // Applied from here on.
  Pending pending;
  pending.requester = requester;
  pending.lines = change.describe(file_config_, *next);
  if (pending.lines.empty()) pending.lines.emplace_back("nothing changed");
  Config& c = running;
  const Config& n = *next;
  for (const LiveKey& k : live_daemon_keys()) k.take(c, n);
  c.worker_spin_us = n.worker_spin_us;  // each pool's effective spin was compared (and rolled)
  // Those that keep a copy.
  set_log_level(c.log_level);
  parts_.outage->set_fail_after(uint64_t{c.pool_down_fail_ms} * 1'000'000);
  // The file's view, for the next reload: its daemon keys, each running pool as it says now.
  const std::vector<PoolConfig> file_pools = std::move(file_config_.pools);
  file_config_ = n;
  file_config_.pools = file_pools;
  for (PoolConfig& fp : file_config_.pools) {
    if (fp.removed) continue;
    auto it = std::find_if(n.pools.begin(), n.pools.end(),
                           [&](const PoolConfig& p) { return p.name == fp.name; });
    if (it == n.pools.end()) continue;  // removed below
    for (const PoolChange& ch : change.pools) {
      if (ch.name == fp.name && ch.rollout) {
        PoolConfig before = fp;
        before.workers = it->workers;  // a new size stays, whatever the rollout does
        pending.file_before.emplace_back(ch.pool, std::move(before));
      }
    }
    fp = *it;
  }
  for (auto& [id, now] : updated) {
    const uint32_t p = id;  // a lambda may not capture a structured binding (before C++20's fix)
    const bool rolled =
        std::any_of(change.pools.begin(), change.pools.end(),
                    [&](const PoolChange& ch) { return ch.pool == p && ch.rollout; });
    if (rolled) {
      // Put back if the rollout fails; a new size stays (it is applied below, not rolled).
      PoolConfig before = running.pools[p];
      before.workers = now.workers;
      pending.before.emplace_back(p, std::move(before));
    }
    const bool resized = now.workers != running.pools[p].workers;
    const bool moved = now.cpus != running.pools[p].cpus;
    running.pools[p] = std::move(now);
    if (moved) parts_.workers->place_pool(p, running.pools[p].cpus);
    if (resized) {
      if (auto r = parts_.workers->resize_pool(p, running.pools[p].workers); !r) {
        pending.failures.push_back("pool " + running.pools[p].name +
                                   ": a new worker cannot start: " + r.error().message());
      }
    }
    if (!rolled || running.pools[p].entries() == 0) continue;  // no workers: nothing to roll
    if (auto g = parts_.rollouts->start(p); !g) {
      // can_start said yes: only the listing's start can fail here (no fork).
      pending.failures.push_back(g.error().message());
      continue;
    }
    pending.rolling.push_back(p);
  }
  const uint64_t now_ns = monotonic_ns();
  for (uint32_t p : change.removed) {
    PoolConfig& pool = running.pools[p];
    pool.removed = true;
    file_config_.pools[p].removed = true;
    PoolShm& ps = parts_.queue->pool(p);
    ps.accepting.store(kPoolRemoved, std::memory_order_seq_cst);
    ps.space.notify_all();  // blocked producers look again and see it removed
    removals_.push_back({p, now_ns + uint64_t{c.drain_timeout_ms} * 1'000'000});
    GPUQ_LOG_INFO("pool %s removed by a reload: it drains", pool.name.c_str());
  }
  for (size_t k = 0; k < added.size(); ++k) {
    const auto id = static_cast<uint32_t>(running.pools.size());
    PoolConfig& pool = running.pools.emplace_back(std::move(added[k]));
    file_config_.pools.push_back(n.pools[change.added[k]]);
    PoolState st;
    st.program = worker_program(pool, *parts_.executables, false).value();  // checked above
    parts_.plan->pools.push_back(std::move(st));
    PoolShm& ps = parts_.queue->pool(id);
    for (uint32_t b = 0; b < kPoolNameBytes; ++b) {
      std::atomic_ref<char>(ps.name[b])
          .store(b < pool.name.size() && b + 1 < kPoolNameBytes ? pool.name[b] : '\0',
                 std::memory_order_relaxed);
    }
    ps.kind = static_cast<uint32_t>(pool.kind);
    GPUQ_LOG_INFO("pool %s added by a reload (record %u)", pool.name.c_str(), id);
    if (pool.python) {
      if (auto r = parts_.listings->start(id, pool, now_ns); !r) {
        pending.failures.push_back("pool " + pool.name + " not added: " + r.error().message());
        forget_added(id);
        continue;
      }
      pending.adding.push_back(id);
      continue;
    }
    if (auto r = start_added(id); !r) {
      pending.failures.push_back("pool " + pool.name + " not added: " + r.error().message());
    }
  }
  if (!change.removed.empty() || !change.added.empty()) parts_.catalog->publish();
  for (const std::string& line : pending.lines) GPUQ_LOG_INFO("config reload: %s", line.c_str());
  if (!pending.rolling.empty() || !pending.adding.empty()) {
    pending_.push_back(std::move(pending));  // replied to when its rollouts and adds end
    return std::vector<std::string>{};
  }
  if (!pending.failures.empty()) {
    std::string why;
    for (const std::string& f : pending.failures) why += (why.empty() ? "" : "; ") + f;
    return Error(ErrorCode::kWorkerDied, "config reload: " + why);
  }
  return pending.lines;
}

Result<void> ConfigReload::start_added(uint32_t pool) {
  const PoolConfig& pc = parts_.config->pools[pool];
  // As plan_pools places a cpu pool's entries: its CPUs, round robin (spares and surge seats
  // on the CPUs of the workers they may replace).
  std::vector<WorkerPlacement> placements;
  for (uint32_t i = 0; i < pc.entries(); ++i) {
    placements.push_back({{pc.cpus[i % pc.cpus.size()]}, "-1", -1, {}});
  }
  if (auto r = parts_.workers->add_pool(pool, placements); !r) {
    forget_added(pool);
    return r;
  }
  parts_.queue->pool(pool).accepting.store(kPoolAccepting, std::memory_order_seq_cst);
  return {};
}

void ConfigReload::forget_added(uint32_t pool) {
  Config& running = *parts_.config;
  parts_.workers->stop_pool(pool);  // those started (none, or up to the one that failed)
  if (pool + 1 == running.pools.size() && !parts_.workers->pool_running(pool)) {
    running.pools.pop_back();  // the last record taken: free again
    file_config_.pools.pop_back();
    parts_.plan->pools.pop_back();
    parts_.workers->release_pool(pool);
    return;
  }
  running.pools[pool].removed = true;
  file_config_.pools[pool].removed = true;
}

bool ConfigReload::adding(uint32_t pool) const {
  return !pending_.empty() &&
         std::find(pending_.front().adding.begin(), pending_.front().adding.end(), pool) !=
             pending_.front().adding.end();
}

void ConfigReload::listed(uint32_t pool, Result<std::vector<ListedPythonOp>> ops,
                          const PythonListingDetail& detail) {
  if (!adding(pool)) return;
  Pending& p = pending_.front();
  std::erase(p.adding, pool);
  const std::string name = parts_.config->pools[pool].name;
  Result<void> started;
  if (!ops) {
    const std::string err = tail_lines(detail.stderr_text, 20, 1500);
    started =
        Error(ErrorCode::kWorkerDied, ops.error().message() + (err.empty() ? "" : ":\n" + err));
    forget_added(pool);
  } else if (auto set = set_python_pool_ops(pool, *ops); !set) {
    started = set.error();
    forget_added(pool);
  } else {
    parts_.workers->set_python_ops(pool, python_op_list(pool));
    started = start_added(pool);  // forgets the pool itself when it fails
  }
  if (!started) {
    p.failures.push_back("pool " + name + " not added: " + started.error().message());
    GPUQ_LOG_ERROR("config reload: %s", p.failures.back().c_str());
  }
  parts_.catalog->publish();  // its ops (and the pool), or the pool gone
  if (p.rolling.empty() && p.adding.empty()) finish();
}

void ConfigReload::rollout_ended(uint32_t pool, const Result<void>& outcome) {
  if (pending_.empty()) return;
  Pending& p = pending_.front();
  auto it = std::find(p.rolling.begin(), p.rolling.end(), pool);
  if (it == p.rolling.end()) return;
  p.rolling.erase(it);
  if (!outcome) {
    p.failures.push_back(outcome.error().message());
    if (!parts_.rollouts->swapped(pool)) {
      // No new worker serves: the pool's settings are the old workers' again, and a reload of
      // a mended file rolls it anew.
      for (auto& [id, before] : p.before) {
        if (id != pool) continue;
        (*parts_.config).pools[pool] = before;
        if (before.kind == PoolKind::kCpu) parts_.workers->place_pool(pool, before.cpus);
      }
      for (auto& [id, before] : p.file_before) {
        if (id == pool) file_config_.pools[pool] = before;
      }
      GPUQ_LOG_WARN("pool %s: its settings before the reload are back",
                    parts_.config->pools[pool].name.c_str());
    }
  }
  if (p.rolling.empty() && p.adding.empty()) finish();
}

void ConfigReload::finish() {
  Pending p = std::move(pending_.front());
  pending_.clear();
  if (!on_done_) return;
  if (p.failures.empty()) {
    on_done_(p.requester, p.lines);
    return;
  }
  std::string why;
  for (const std::string& f : p.failures) why += (why.empty() ? "" : "; ") + f;
  on_done_(p.requester, Error(ErrorCode::kWorkerDied,
                              "config reload: a rolling restart failed, that pool's settings are "
                              "back as they were: " +
                                  why));
}

bool ConfigReload::draining(uint32_t pool) const {
  return std::any_of(removals_.begin(), removals_.end(),
                     [&](const Removal& r) { return r.pool == pool; });
}

void ConfigReload::tick(uint64_t now) {
  const QueueView& queue = *parts_.queue;
  std::erase_if(removals_, [&](const Removal& r) {
    // As a drain (Supervisor::check_drain): `accepting` went to kPoolRemoved (seq_cst) before
    // these loads, and a client raises `submitting` before it reads `accepting`; once no client
    // is inside submit, nothing enters the ring any more.
    bool idle = true;
    for (uint32_t i = 0; i < parts_.config->max_clients && idle; ++i) {
      if (queue.client(i).session.load(std::memory_order_acquire) != 0 &&
          queue.client(i).submitting.load(std::memory_order_seq_cst) != 0) {
        idle = false;
      }
    }
    if (idle && queue.queue(r.pool).has_values()) idle = false;
    if (idle && parts_.workers->pool_busy(r.pool)) idle = false;
    const std::string& name = parts_.config->pools[r.pool].name;
    if (!idle && now < r.deadline_ns) return false;
    if (!idle) {
      const uint32_t failed = parts_.recovery->fail_queued(
          r.pool, "pool '" + name + "' was removed by a reload and did not drain within " +
                      std::to_string(parts_.config->drain_timeout_ms) + " ms (drain_timeout_ms)");
      GPUQ_LOG_WARN("pool %s: drain_timeout_ms passed: %u queued jobs failed; stopping its workers",
                    name.c_str(), failed);
    } else {
      GPUQ_LOG_INFO("pool %s drained: stopping its workers", name.c_str());
    }
    parts_.workers->stop_pool(r.pool);
    return true;
  });
}

}  // namespace gpuq::daemon
