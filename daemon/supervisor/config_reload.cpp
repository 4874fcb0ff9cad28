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
  applying_ = true;  // a rollout that ends inside apply is only recorded (advance waits)
  auto r = apply(requester);
  applying_ = false;
  if (!r) return fail(r.error());
  advance();
}

Result<void> ConfigReload::apply(uint64_t requester) {
  Config& running = *parts_.config;
  // Parsed and checked as at start and by --check-config.
  auto next = load_config(parts_.path, allowed_cpus());
  if (!next) {
    // load_config's message names the key and the file ("... (in /etc/gpuq/gpuqd.json)").
    return Error(next.error().code(), next.error().message() + "; nothing changed");
  }
  ConfigChange change = diff_configs(file_config_, *next);
  if (!change.fixed.empty()) {
    std::string keys;
    for (const std::string& k : change.fixed) keys += (keys.empty() ? "" : "; ") + k;
    return Error(ErrorCode::kInvalidArgument,
                 "nothing changed: these cannot change while gpuqd runs (restart it to change "
                 "them): " +
                     keys);
  }
  // Everything that could still refuse is checked before anything changes: each added pool
  // can run, the gpu pools' GPUs and budgets add up, each rolled pool can be rolled now, and
  // each Python pool's interpreter is found.
  std::vector<PoolConfig> added;  // as they will run (interpreter resolved)
  for (uint32_t i : change.added) {
    PoolConfig pool = next->pools[i];
    // Its fallback: the first cpu pool that runs (its index in `next` means nothing here).
    pool.fallback_pool = -1;
    if (pool.fallback == PoolFallback::kCpu) {
      auto cpu = std::find_if(running.pools.begin(), running.pools.end(), [](const PoolConfig& p) {
        return p.kind == PoolKind::kCpu && !p.removed;
      });
      if (cpu != running.pools.end()) {
        pool.fallback_pool = static_cast<int>(cpu - running.pools.begin());
      }
    }
    if (pool.python) {
      if (auto found = resolve_python_interpreter(pool); !found) {
        return Error(found.error().code(),
                     "pools[" + pool.name + "]." + found.error().message() + "; nothing changed");
      }
    }
    if (auto program = worker_program(pool, *parts_.executables, parts_.plan->gpu_cpu_backend);
        !program) {
      return Error(program.error().code(),
                   "pools[" + pool.name + "]: " + program.error().message() + "; nothing changed");
    }
    added.push_back(std::move(pool));
  }
  auto gpus = replan_gpus(change, *next, added);
  if (!gpus) return Error(gpus.error().code(), gpus.error().message() + "; nothing changed");
  std::vector<std::pair<uint32_t, PoolConfig>> updated;  // running pools' new settings
  for (const PoolChange& c : change.pools) {
    const PoolConfig& want = *std::find_if(next->pools.begin(), next->pools.end(),
                                           [&](const PoolConfig& p) { return p.name == c.name; });
    PoolConfig now = running.pools[c.pool];
    now.job_time_limit_ms = want.job_time_limit_ms;
    if (c.workers != 0) now.workers = c.workers;  // within max_workers (diff_configs)
    now.cpus = want.cpus;                         // placed below, taken up by the rollout
    now.worker_spin_us = want.worker_spin_us;
    now.gpus = want.gpus;  // a gpu pool's: placed below (replan_gpus), taken up by the rollout
    now.all_gpus = want.all_gpus;
    now.memory_limit_bytes = want.memory_limit_bytes;
    now.memory_limit_fraction = want.memory_limit_fraction;
    now.workers_per_gpu = want.workers_per_gpu;
    if (want.python) {
      now.python = want.python;
      if (auto found = resolve_python_interpreter(now); !found) {
        return Error(found.error().code(),
                     "pools[" + c.name + "]." + found.error().message() + "; nothing changed");
      }
    }
    if (c.rollout && running.pools[c.pool].entries() > 0) {
      const bool placed_anew =
          std::any_of(gpus->by_id.begin(), gpus->by_id.end(),
                      [&](const auto& b) { return b.first == c.pool; });  // checked there
      if (auto can = parts_.rollouts->can_start(c.pool, !placed_anew); !can) {
        return Error(can.error().code(),
                     "pool " + c.name + ": " + can.error().message() + "; nothing changed");
      }
    }
    updated.emplace_back(c.pool, std::move(now));
  }

  // Applied from here on. The reply goes when the rollouts it starts have ended (advance).
  Pending& pending = pending_.emplace_back();
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
  auto rolls = [&](uint32_t p) {
    return running.pools[p].entries() > 0 &&
           std::any_of(change.pools.begin(), change.pools.end(),
                       [&](const PoolChange& ch) { return ch.pool == p && ch.rollout; });
  };
  auto moves = [&](uint32_t p) {
    return std::find(gpus->movers.begin(), gpus->movers.end(), p) != gpus->movers.end();
  };
  const bool any_rollout =
      std::any_of(updated.begin(), updated.end(), [&](const auto& u) { return rolls(u.first); });
  // Rollouts that make room (shrink pools, or change what does not touch the GPUs) come first;
  // then the pools that move onto other GPUs are placed and rolled, and those whose shares
  // grow placed; then gpu pools grow and added gpu pools start (advance).
  const bool room_first = std::any_of(updated.begin(), updated.end(), [&](const auto& u) {
    return rolls(u.first) && !moves(u.first);
  });
  auto grows_later = [&](uint32_t p, const PoolConfig& now) {
    return any_rollout && now.kind == PoolKind::kGpu && now.workers > running.pools[p].workers;
  };
  // The file's view, for the next reload: its daemon keys, each running pool as it says now.
  const std::vector<PoolConfig> file_pools = std::move(file_config_.pools);
  file_config_ = n;
  file_config_.pools = file_pools;
  for (PoolConfig& fp : file_config_.pools) {
    if (fp.removed) continue;
    auto it = std::find_if(n.pools.begin(), n.pools.end(),
                           [&](const PoolConfig& p) { return p.name == fp.name; });
    if (it == n.pools.end()) continue;  // removed below
    for (const auto& [id, now] : updated) {
      if (running.pools[id].name != fp.name) continue;
      // Put back if its rollout, or one it waits for, fails; a size applied at once stays.
      PoolConfig before = fp;
      if (!grows_later(id, now)) before.workers = it->workers;
      pending.file_before.emplace_back(id, std::move(before));
    }
    fp = *it;
  }
  // The gpu pools placed anew (other GPUs, other budgets) before their rollouts start, so that
  // each process started from now on runs where the new plan puts it.
  for (const auto& [p, entries] : gpus->by_id) {
    PoolState& st = parts_.plan->pools[p];
    pending.placed_before.push_back({p, parts_.workers->placements_of(p), st.gpus, st.memory});
    Placed next_place{p, entries, gpus->placed[p].gpus, gpus->placed[p].memory, rolls(p)};
    if ((moves(p) && room_first) || (!rolls(p) && any_rollout)) {
      pending.later.push_back(std::move(next_place));
    } else {
      place(next_place);
    }
  }
  for (auto& [id, now] : updated) {
    const uint32_t p = id;  // a lambda may not capture a structured binding (before C++20's fix)
    const bool grow = grows_later(p, now);
    // Put back if its rollout, or one it waits for, fails; a size applied at once stays.
    PoolConfig before = running.pools[p];
    if (!grow) before.workers = now.workers;
    pending.before.emplace_back(p, std::move(before));
    if (grow) {
      pending.grow.emplace_back(p, now.workers);
      now.workers = running.pools[p].workers;  // until it grows (start_deferred)
    }
    const bool resized = now.workers != running.pools[p].workers;
    const bool moved = now.kind == PoolKind::kCpu && now.cpus != running.pools[p].cpus;
    running.pools[p] = std::move(now);
    if (moved) parts_.workers->place_pool(p, place_cpu_pool(running.pools[p]));
    if (resized) {
      if (auto r = parts_.workers->resize_pool(p, running.pools[p].workers); !r) {
        pending.failures.push_back("pool " + running.pools[p].name +
                                   ": a new worker cannot start: " + r.error().message());
      }
    }
    const bool waits = std::any_of(pending.later.begin(), pending.later.end(),
                                   [&](const Placed& l) { return l.pool == p; });
    if (rolls(p) && !waits) start_rollout(pending, p);
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
  // replan_gpus planned the added pools after the running ones: the k-th at base + k, whatever
  // record each takes (one that is not added gives its record back to the next).
  const auto base = static_cast<uint32_t>(running.pools.size());
  for (size_t k = 0; k < added.size(); ++k) {
    const auto id = static_cast<uint32_t>(running.pools.size());
    PoolConfig& pool = running.pools.emplace_back(std::move(added[k]));
    file_config_.pools.push_back(n.pools[change.added[k]]);
    PoolState st;
    st.program =  // checked above
        worker_program(pool, *parts_.executables, parts_.plan->gpu_cpu_backend).value();
    st.adding = true;  // not in the catalog until it accepts jobs (start_added)
    if (pool.kind == PoolKind::kGpu) {
      const GpuPoolPlacement& at = gpus->placed[base + k];  // planned by replan_gpus
      st.gpus = at.gpus;
      st.memory = at.memory;
      pending.added_at.emplace_back(id, at.entries);
    } else {
      pending.added_at.emplace_back(id, place_cpu_pool(pool));
    }
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
    if (pool.kind == PoolKind::kGpu) {
      pending.deferred.push_back(id);  // once the rollouts have ended (advance)
      continue;
    }
    if (auto r = start_added(pending, id); !r) {
      pending.failures.push_back("pool " + pool.name + " not added: " + r.error().message());
    }
  }
  if (!change.removed.empty() || !change.added.empty()) parts_.catalog->publish();
  for (const std::string& line : pending.lines) GPUQ_LOG_INFO("config reload: %s", line.c_str());
  return {};
}

Result<ConfigReload::GpuPlan> ConfigReload::replan_gpus(ConfigChange& change, const Config& next,
                                                        std::vector<PoolConfig>& added) const {
  const Config& running = *parts_.config;
  const PoolPlan& plan = *parts_.plan;
  auto is_gpu = [](const PoolConfig& p) { return p.kind == PoolKind::kGpu; };
  GpuPlan out;
  if (std::none_of(added.begin(), added.end(), is_gpu) &&
      std::none_of(running.pools.begin(), running.pools.end(),
                   [&](const PoolConfig& p) { return is_gpu(p) && !p.removed; })) {
    return out;  // no gpu pool before or after: nothing to plan
  }
  auto bad = [](const std::string& pool, const std::string& why) {
    return Error(ErrorCode::kInvalidArgument, "pools[" + pool + "]: " + why);
  };
  // The pools as they will run, by id: the running ones with the file's GPUs and budgets (a
  // removed one keeps its GPUs while it drains: its workers hold their memory until they
  // exit), then those added.
  std::vector<PoolConfig> pools = running.pools;
  std::vector<std::vector<uint32_t>> pool_gpus(pools.size());
  std::string holding;  // removed pools that still hold their budgets
  for (uint32_t p = 0; p < pools.size(); ++p) {
    PoolConfig& pool = pools[p];
    const bool leaving =
        std::find(change.removed.begin(), change.removed.end(), p) != change.removed.end();
    if (!is_gpu(pool) || (pool.removed && !draining(p))) continue;
    pool_gpus[p] = plan.pools[p].gpus;
    if (pool.removed || leaving) {
      // What its workers hold, as a memory_limit: the largest of its budgets on its GPUs.
      pool.memory_limit_bytes = 0;
      pool.memory_limit_fraction = 0;
      for (const PoolGpuBudget& b : plan.pools[p].memory) {
        pool.memory_limit_bytes = std::max(pool.memory_limit_bytes, b.pool.bytes);
        pool.memory_limit_fraction = std::max(pool.memory_limit_fraction, b.pool.fraction);
      }
      if (pool.memory_limit_bytes > 0) pool.memory_limit_fraction = 0;
      if (!pool_gpus[p].empty()) holding += (holding.empty() ? "" : ", ") + pool.name;
      continue;
    }
    auto want = std::find_if(next.pools.begin(), next.pools.end(),
                             [&](const PoolConfig& b) { return b.name == pool.name; });
    pool.memory_limit_bytes = want->memory_limit_bytes;
    pool.memory_limit_fraction = want->memory_limit_fraction;
    pool.gpus = want->gpus;
    pool.all_gpus = want->all_gpus;
    pool.workers_per_gpu = want->workers_per_gpu;
    const auto changed = std::find_if(change.pools.begin(), change.pools.end(),
                                      [&](const PoolChange& c) { return c.pool == p; });
    const bool placed =
        changed != change.pools.end() &&
        std::any_of(changed->keys.begin(), changed->keys.end(), [](const std::string& k) {
          return k == "gpus" || k == "memory_limit" || k == "workers_per_gpu";
        });
    if (!placed) continue;
    if (pool.workers == 0) {
      return bad(pool.name,
                 "it has no workers since gpuqd started (" + plan.pools[p].reason +
                     "): its GPUs and memory_limit are planned at start; restart gpuqd to "
                     "change them");
    }
    auto chosen = select_gpus(pool, plan.discovery);
    if (!chosen) return bad(pool.name, chosen.error().message());
    // Another size: within its max_workers, entries and ring reserved at start.
    const auto workers = static_cast<uint32_t>(chosen->size()) * pool.workers_per_gpu;
    if (workers > pool.most_workers()) {
      return bad(pool.name, "workers_per_gpu x its GPUs would be " + std::to_string(workers) +
                                " workers, more than its max_workers, " +
                                std::to_string(pool.most_workers()) +
                                ": its ring and worker records are fixed in the queue segment; "
                                "a pool may grow to max_workers live");
    }
    pool.workers = workers;
    if (workers != running.pools[p].workers) changed->workers = workers;
    pool_gpus[p] = *chosen;
  }
  for (PoolConfig& pool : added) {
    pools.push_back(pool);
    pool_gpus.emplace_back();
    if (!is_gpu(pool)) continue;
    if (!plan.discovery_ran) {
      return bad(pool.name,
                 "a new gpu pool: gpuqd looks for GPUs at start, and did not (it had no gpu pool "
                 "then); restart gpuqd to add it");
    }
    auto chosen = select_gpus(pool, plan.discovery);
    if (!chosen) return bad(pool.name, "a new gpu pool: " + chosen.error().message());
    // As plan_pools resolves a gpu pool's workers and max_workers at start.
    pool.workers = static_cast<uint32_t>(chosen->size()) * pool.workers_per_gpu;
    if (pool.max_workers_setting == 0) {
      pool.max_workers = pool.workers;
    } else if (pool.workers > pool.max_workers) {
      return bad(pool.name, "a new gpu pool: max_workers " + std::to_string(pool.max_workers) +
                                " is fewer than its workers_per_gpu x its GPUs, " +
                                std::to_string(pool.workers));
    }
    pools.back() = pool;
    if (pool.entries() > running.added_pool_workers) {
      return bad(pool.name, "a new gpu pool: " + std::to_string(pool.entries()) +
                                " worker entries (max_workers, spare_workers, "
                                "rollout_surge_workers), more than added_pool_workers, " +
                                std::to_string(running.added_pool_workers));
    }
    pool_gpus.back() = *chosen;
  }
  auto placed = place_gpu_pools(pools, pool_gpus, plan.discovery.gpus, allowed_cpus());
  if (!placed) {
    if (holding.empty()) return placed.error();
    return Error(placed.error().code(),
                 placed.error().message() + " (removed pools hold their budgets until they " +
                     "have drained: " + holding + "; reload again once they have)");
  }
  out.placed = std::move(*placed);
  // The running pools whose workers would run elsewhere, or with other budgets: each entry
  // given its place in the new plan by role (assign_placements), then compared with where it is.
  for (uint32_t p = 0; p < running.pools.size(); ++p) {
    const PoolConfig& pool = running.pools[p];
    if (!is_gpu(pool) || pool.removed || pool.workers == 0 || out.placed[p].entries.empty() ||
        std::find(change.removed.begin(), change.removed.end(), p) != change.removed.end()) {
      continue;
    }
    const std::vector<WorkerPlacement> now = parts_.workers->placements_of(p);
    const std::vector<EntryRole> roles = parts_.workers->roles_of(p);
    const Assigned then =
        assign_placements(roles, now, out.placed[p].entries, pools[p].workers, pool.most_workers());
    bool moved = false;
    bool mover = false;
    bool restart = false;
    for (size_t i = 0; i < now.size(); ++i) {
      const WorkerPlacement &a = now[i], &b = then.placements[i];
      moved = moved || a.gpu != b.gpu || a.memory.bytes != b.memory.bytes ||
              a.memory.fraction != b.memory.fraction;
      // Those with a process that keep their role: a worker that stays active, a spare.
      const bool runs =
          (roles[i] == EntryRole::kActive && then.active[i]) || roles[i] == EntryRole::kSpare;
      if (!runs) continue;
      mover = mover || a.gpu != b.gpu;
      restart = restart || needs_restart(a, b);
    }
    if (!moved) continue;
    out.by_id.emplace_back(p, then.placements);
    if (mover) out.movers.push_back(p);
    if (!restart) continue;
    // A seat on each GPU where a worker stays, as the new plan puts them.
    if (const int k = entry_without_seat(roles, then.placements, then.active); k >= 0) {
      const int g = then.placements[static_cast<size_t>(k)].gpu;
      return bad(pool.name,
                 "its workers must be rolled (to other GPUs or smaller budgets), and it would "
                 "have no seat for a new worker on GPU " +
                     std::to_string(plan.discovery.gpus[static_cast<size_t>(g)].index) +
                     ": a gpu pool needs a spare (spare_workers) or a surge seat "
                     "(rollout_surge_workers) on each of its GPUs, one per GPU at least");
    }
    auto c = std::find_if(change.pools.begin(), change.pools.end(),
                          [&](const PoolChange& ch) { return ch.pool == p; });
    if (c == change.pools.end()) {
      // Its file did not change: another pool's budget on its GPUs did.
      change.pools.push_back({pool.name, p, {"memory budget"}, true, 0});
    } else {
      c->rollout = true;
    }
  }
  return out;
}

Result<void> ConfigReload::start_added(const Pending& pending, uint32_t pool) {
  std::vector<WorkerPlacement> placements;
  for (const auto& [id, at] : pending.added_at) {
    if (id == pool) placements = at;
  }
  if (auto r = parts_.workers->add_pool(pool, placements); !r) {
    forget_added(pool);
    return r;
  }
  parts_.queue->pool(pool).accepting.store(kPoolAccepting, std::memory_order_seq_cst);
  parts_.plan->pools[pool].adding = false;
  return {};
}

void ConfigReload::start_deferred() {
  Pending& p = pending_.front();
  // A rollout of the reload failed: a pool may still hold its old, larger budget.
  const bool failed = p.rollout_failed;
  for (const auto& [pool, workers] : p.grow) {
    PoolConfig& pc = parts_.config->pools[pool];
    if (failed) {
      p.failures.push_back("pool " + pc.name +
                           " not resized: a rolling restart of the reload failed (it may hold "
                           "the memory the new workers need)");
      put_back(p, pool);
      continue;
    }
    pc.workers = workers;
    if (auto r = parts_.workers->resize_pool(pool, workers); !r) {
      p.failures.push_back("pool " + pc.name +
                           ": a new worker cannot start: " + r.error().message());
    }
  }
  p.grow.clear();
  for (uint32_t pool : p.deferred) {
    const std::string name = parts_.config->pools[pool].name;
    Result<void> started = Error(ErrorCode::kWorkerDied,
                                 "a rolling restart of the reload failed (it may hold the "
                                 "memory this pool needs)");
    if (failed) {
      forget_added(pool);
    } else {
      started = start_added(p, pool);  // forgets the pool itself when it fails
    }
    if (!started) {
      p.failures.push_back("pool " + name + " not added: " + started.error().message());
      GPUQ_LOG_ERROR("config reload: %s", p.failures.back().c_str());
    }
  }
  if (!p.deferred.empty()) parts_.catalog->publish();  // the pools, or the pools gone
  p.deferred.clear();
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
    if (parts_.config->pools[pool].kind == PoolKind::kGpu) {
      p.deferred.push_back(pool);  // after the rollouts, as a C++ gpu pool (advance)
      advance();
      return;
    }
    started = start_added(p, pool);  // forgets the pool itself when it fails
  }
  if (!started) {
    p.failures.push_back("pool " + name + " not added: " + started.error().message());
    GPUQ_LOG_ERROR("config reload: %s", p.failures.back().c_str());
  }
  parts_.catalog->publish();  // its ops (and the pool), or the pool gone
  advance();
}

void ConfigReload::rollout_ended(uint32_t pool, const Result<void>& outcome) {
  if (pending_.empty()) return;
  Pending& p = pending_.front();
  auto it = std::find(p.rolling.begin(), p.rolling.end(), pool);
  if (it == p.rolling.end()) return;
  p.rolling.erase(it);
  if (!outcome) {
    p.failures.push_back(outcome.error().message());
    p.rollout_failed = true;
    // No new worker serves: the pool's settings are the old workers' again, and a reload of a
    // mended file rolls it anew.
    if (!parts_.rollouts->swapped(pool)) put_back(p, pool);
  }
  advance();
}

void ConfigReload::advance() {
  if (pending_.empty() || applying_ || advancing_) return;
  advancing_ = true;
  Pending& p = pending_.front();
  if (p.rolling.empty() && !p.later.empty()) {
    const std::vector<Placed> later = std::move(p.later);
    p.later.clear();
    for (const Placed& at : later) {
      if (p.rollout_failed) {
        // Not placed: it keeps where it runs, and its settings before the reload.
        p.failures.push_back("pool " + parts_.config->pools[at.pool].name +
                             " not placed anew: a rolling restart that makes room for it "
                             "failed");
        put_back(p, at.pool);
        continue;
      }
      place(at);
      if (at.roll) start_rollout(p, at.pool);  // one that ends at once is only recorded
    }
  }
  if (p.rolling.empty() && (!p.grow.empty() || !p.deferred.empty())) start_deferred();
  advancing_ = false;
  if (p.rolling.empty() && p.adding.empty() && p.later.empty()) finish();
}

void ConfigReload::put_back(Pending& p, uint32_t pool) {
  for (auto& [id, before] : p.before) {
    if (id != pool) continue;
    parts_.config->pools[pool] = before;
    if (before.kind == PoolKind::kCpu) parts_.workers->place_pool(pool, place_cpu_pool(before));
  }
  for (auto& [id, before] : p.file_before) {
    if (id == pool) file_config_.pools[pool] = before;
  }
  for (Placed& before : p.placed_before) {
    if (before.pool == pool) place(before);
  }
  GPUQ_LOG_WARN("pool %s: its settings before the reload are back",
                parts_.config->pools[pool].name.c_str());
}

void ConfigReload::place(const Placed& at) {
  parts_.workers->place_pool(at.pool, at.entries);
  parts_.plan->pools[at.pool].gpus = at.gpus;
  parts_.plan->pools[at.pool].memory = at.memory;
}

void ConfigReload::start_rollout(Pending& p, uint32_t pool) {
  p.rolling.push_back(pool);  // first: PoolRollout may end it inside start()
  if (auto g = parts_.rollouts->start(pool); !g) {
    // can_start said yes: only the listing's start can fail here (no fork).
    std::erase(p.rolling, pool);
    p.failures.push_back(g.error().message());
    p.rollout_failed = true;
    put_back(p, pool);
  }
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
  on_done_(p.requester,
           Error(ErrorCode::kWorkerDied,
                 std::string("config reload: ") +
                     (p.rollout_failed ? "a rolling restart failed, that pool's settings are "
                                         "back as they were: "
                                       : "") +
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
