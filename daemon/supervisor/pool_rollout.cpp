#include "pool_rollout.hpp"

#include <algorithm>
#include <string_view>
#include <utility>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"

namespace gpuq::daemon {
namespace {

using Role = RolloutSeat::Role;
using Kind = RolloutStep::Kind;

// The most of a new worker's stderr a failed rollout's message carries: its end (a Python
// traceback ends with the exception).
constexpr size_t kReasonTailBytes = 1500;

std::string tail(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  if (text.size() > kReasonTailBytes) text = text.substr(text.size() - kReasonTailBytes);
  return std::string(text);
}

}  // namespace

RolloutStep PoolRollout::next_step(std::span<const RolloutSeat> seats, uint32_t generation) {
  // One change at a time: an old worker still ending its job, or a process still starting,
  // is waited for.
  for (const RolloutSeat& s : seats) {
    if (s.retiring || (s.running && !s.ready)) return {Kind::kWait};
  }
  // Old spares first: they stop and their seats start again at the new generation.
  for (const RolloutSeat& s : seats) {
    if (s.role == Role::kSpare && s.running && s.generation < generation) {
      return {Kind::kRetireSpare, s.id};
    }
  }
  for (const RolloutSeat& old : seats) {
    if (old.role != Role::kActive || !old.running || old.generation >= generation) continue;
    // A new seat on its GPU, ready: it takes the old worker's place.
    for (const RolloutSeat& s : seats) {
      if (s.role != Role::kActive && s.running && s.generation >= generation && s.gpu == old.gpu) {
        return {Kind::kTakeOver, s.id, old.id};
      }
    }
    for (const RolloutSeat& s : seats) {
      if (s.role == Role::kSurge && !s.running && s.gpu == old.gpu) {
        return {Kind::kStartSurge, s.id};
      }
    }
    // A spare seat of its GPU being started again (after its back-off): wait for it.
    for (const RolloutSeat& s : seats) {
      if (s.role == Role::kSpare && s.awaits_start && s.gpu == old.gpu) return {Kind::kWait};
    }
    return {Kind::kFail, 0, old.id,
            "no seat for a new worker beside worker " + std::to_string(old.id) +
                (old.gpu >= 0 ? " on its GPU" : "") +
                ": give the pool a spare (spare_workers) or a surge seat (rollout_surge_workers)" +
                (old.gpu >= 0 ? " on each of its GPUs" : "")};
  }
  // A new surge worker no old worker needs any more (they all went otherwise): it stops.
  for (const RolloutSeat& s : seats) {
    if (s.role == Role::kSurge && s.running) return {Kind::kRetireSpare, s.id};
  }
  return {Kind::kDone};
}

PoolRollout::PoolRollout(WorkerSet& workers, SparePool& spares, const Config& config,
                         OpListings* listings)
    : workers_(workers),
      spares_(spares),
      config_(config),
      listings_(listings),
      pools_(kMaxPools) {}  // a reload may add pools

std::vector<RolloutSeat> PoolRollout::seats_of(uint32_t pool) const {
  std::vector<RolloutSeat> out;
  for (const auto& wp : workers_.all()) {
    const Worker& w = *wp;
    if (w.pool != pool || w.reserve) continue;  // an added pool's unused entries
    RolloutSeat s;
    s.id = w.id;
    s.role = w.surge ? Role::kSurge : w.spare ? Role::kSpare : Role::kActive;
    s.gpu = w.placement.gpu;
    s.running = w.pid > 0;
    s.ready = s.running && w.state == WorkerState::kReady;
    s.retiring = s.running && (w.retiring || w.forced);
    s.awaits_start = workers_.awaits_start(w);
    s.generation = w.generation;
    out.push_back(s);
  }
  return out;
}

Result<void> PoolRollout::can_start(uint32_t pool, bool seats_per_gpu) const {
  const PoolConfig& pc = config_.pools[pool];
  if (pc.entries() == 0) {
    return Error(ErrorCode::kNotFound, "pool " + pc.name + " has no workers to restart");
  }
  if (pools_[pool].running) {
    return Error(ErrorCode::kInvalidArgument,
                 "a rolling restart of pool " + pc.name + " is in progress already");
  }
  if (pc.spare_workers == 0 && pc.rollout_surge_workers == 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "pool " + pc.name +
                     " has no seat for a new worker: give it a spare (spare_workers) or a "
                     "surge seat (rollout_surge_workers)");
  }
  if (!seats_per_gpu) return {};
  // A gpu pool's new worker starts on the GPU of the one it replaces: a seat on each GPU.
  const std::vector<EntryRole> roles = workers_.roles_of(pool);
  const int k = entry_without_seat(roles, workers_.placements_of(pool),
                                   std::vector<bool>(roles.size(), true));
  if (k >= 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "pool " + pc.name + " has no seat for a new worker on the GPU of its entry " +
                     std::to_string(k) +
                     ": a gpu pool needs a spare (spare_workers) or a surge seat "
                     "(rollout_surge_workers) on each of its GPUs, one per GPU at least");
  }
  return {};
}

Result<uint32_t> PoolRollout::start(uint32_t pool) {
  const PoolConfig& pc = config_.pools[pool];
  if (pc.entries() == 0) {
    return Error(ErrorCode::kNotFound, "pool " + pc.name + " has no workers to restart");
  }
  PoolRolling& r = pools_[pool];
  if (r.running) {
    return Error(ErrorCode::kInvalidArgument,
                 "a rolling restart of pool " + pc.name + " is in progress already");
  }
  const bool list = pc.python && listings_ != nullptr;
  if (list) {
    if (auto started = listings_->start(pool, pc, monotonic_ns()); !started) {
      return Error(started.error().code(),
                   "rolling restart of pool " + pc.name +
                       ": cannot list its ops: " + started.error().message());
    }
  }
  const uint32_t g = workers_.generation(pool) + 1;
  workers_.set_generation(pool, g);
  r = PoolRolling{true, list, false, false, {}, {}, r.completed, r.failed};
  GPUQ_LOG_INFO("pool %s: rolling restart to generation %u", pc.name.c_str(), g);
  advance(pool);
  return g;
}

void PoolRollout::listed(uint32_t pool, Result<std::vector<ListedPythonOp>> ops,
                         const PythonListingDetail& detail) {
  if (pool >= pools_.size() || !pools_[pool].listing) return;
  PoolRolling& r = pools_[pool];
  r.listing = false;
  const std::string& name = config_.pools[pool].name;
  const std::string stopped =
      "rolling restart of pool " + name + " stopped, the old workers serve on: ";
  if (!ops) {
    const std::string err = tail(detail.stderr_text);
    // Its modules do not import: the new version does not start, as a new worker's death says.
    const ErrorCode code =
        ops.error().code() == ErrorCode::kTimeout ? ErrorCode::kTimeout : ErrorCode::kWorkerDied;
    return end(pool, Error(code, stopped + "the new version's ops cannot be listed: " +
                                     ops.error().message() + (err.empty() ? "" : ":\n" + err)));
  }
  r.old_ops = python_pool_ops(pool);
  auto changed = set_python_pool_ops(pool, *ops);
  if (!changed)
    return end(pool, Error(changed.error().code(), stopped + changed.error().message()));
  if (*changed) {
    r.ops_changed = true;
    workers_.set_python_ops(pool, python_op_list(pool));
    GPUQ_LOG_INFO("pool %s: the new version's ops: %s", name.c_str(), python_op_list(pool).c_str());
  }
  advance(pool);
}

void PoolRollout::worker_exited(const Worker& w) {
  if (w.pool >= pools_.size() || !pools_[w.pool].running) return;
  if (w.generation < workers_.generation(w.pool) || w.start_ns != 0) return;
  // A new process that ended before it was ready: this version does not start.
  std::string why = "worker " + std::to_string(w.id) + " (generation " +
                    std::to_string(w.generation) + ") " + w.last_exit;
  const std::string err = tail(w.start_error);
  if (!err.empty()) why += ":\n" + err;
  end(w.pool,
      Error(ErrorCode::kWorkerDied, "rolling restart of pool " + config_.pools[w.pool].name +
                                        " stopped, the old workers serve on: " + why));
}

void PoolRollout::step() {
  for (uint32_t p = 0; p < pools_.size(); ++p) {
    if (pools_[p].running) advance(p);
  }
}

void PoolRollout::advance(uint32_t pool) {
  if (pools_[pool].listing) return;  // listed() goes on
  // Each action changes what the next look sees (a seat starts, a worker retires), so that one
  // look after another ends in a wait, the end, or a failure.
  for (int i = 0; i < 8 && pools_[pool].running; ++i) {
    const std::vector<RolloutSeat> seats = seats_of(pool);
    const RolloutStep s = next_step(seats, workers_.generation(pool));
    switch (s.kind) {
      case Kind::kWait:
        return;
      case Kind::kRetireSpare:
        workers_.retire(workers_.at(s.seat));
        break;
      case Kind::kStartSurge:
        if (auto r = workers_.spawn(workers_.at(s.seat)); !r) {
          end(pool, Error(r.error().code(),
                          "rolling restart of pool " + config_.pools[pool].name +
                              " stopped: cannot start a worker: " + r.error().message()));
        }
        break;
      case Kind::kTakeOver:
        GPUQ_LOG_INFO("pool %s: worker %u (generation %u) takes the place of worker %u",
                      config_.pools[pool].name.c_str(), s.seat, workers_.at(s.seat).generation,
                      s.old);
        spares_.take_over(workers_.at(s.seat), workers_.at(s.old));
        pools_[pool].swapped = true;
        break;
      case Kind::kDone:
        end(pool, {});
        return;
      case Kind::kFail:
        end(pool, Error(ErrorCode::kInvalidArgument,
                        "rolling restart of pool " + config_.pools[pool].name +
                            " stopped, the old workers serve on: " + s.why));
        return;
    }
  }
}

void PoolRollout::abort_all(const std::string& why) {
  for (uint32_t p = 0; p < pools_.size(); ++p) {
    if (pools_[p].running) {
      end(p, Error(ErrorCode::kShuttingDown,
                   "rolling restart of pool " + config_.pools[p].name + " stopped: " + why));
    }
  }
}

void PoolRollout::end(uint32_t pool, const Result<void>& outcome) {
  PoolRolling& r = pools_[pool];
  if (!r.running) return;
  r.running = false;
  if (r.listing && listings_ != nullptr) listings_->cancel(pool);
  r.listing = false;
  if (!outcome && r.ops_changed && !r.swapped) {
    // No new worker serves: the ops are the old workers' again.
    (void)set_python_pool_ops(pool, r.old_ops);
    workers_.set_python_ops(pool, python_op_list(pool));
    r.ops_changed = false;
  }
  if (r.ops_changed && on_ops_changed_) on_ops_changed_(pool);
  r.ops_changed = false;
  if (outcome) {
    ++r.completed;
    GPUQ_LOG_INFO("pool %s: rolling restart to generation %u done",
                  config_.pools[pool].name.c_str(), workers_.generation(pool));
  } else {
    ++r.failed;
    r.failure = outcome.error().message();
    GPUQ_LOG_ERROR("%s", r.failure.c_str());
  }
  if (on_end_) on_end_(pool, outcome);
}

}  // namespace gpuq::daemon
