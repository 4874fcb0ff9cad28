#include "spare_pool.hpp"

#include <algorithm>
#include <atomic>
#include <utility>

#include "gpuq/common/cpu_list.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/messages.hpp"

namespace gpuq::daemon {

SparePool::SparePool(WorkerSet& workers, const QueueView& queue, ProcessLauncher& launcher,
                     uint32_t pool_count)
    : workers_(workers), queue_(queue), launcher_(launcher), promotions_(pool_count, 0) {}

std::optional<uint32_t> SparePool::pick(std::span<const SpareSeat> seats, uint32_t vacant) {
  if (vacant >= seats.size() || seats[vacant].spare) return std::nullopt;
  const SpareSeat& v = seats[vacant];
  std::optional<uint32_t> chosen;
  for (uint32_t i = 0; i < seats.size(); ++i) {
    const SpareSeat& s = seats[i];
    if (!s.spare || !s.ready || s.pool != v.pool || s.gpu != v.gpu) continue;
    // One already on the vacant worker's CPUs needs no re-pinning: its threads stay where
    // their caches are.
    if (s.cpus != nullptr && v.cpus != nullptr && *s.cpus == *v.cpus) return i;
    if (!chosen) chosen = i;
  }
  return chosen;
}

std::vector<SpareSeat> SparePool::seats() const {
  std::vector<SpareSeat> out;
  out.reserve(workers_.all().size());
  for (const auto& w : workers_.all()) {
    // A worker being stopped (forced) is dying, whatever its role; one retiring goes too; a
    // surge seat serves its rollout only (PoolRollout).
    out.push_back(
        {w->pool, w->placement.gpu, w->spare,
         w->pid > 0 && w->state == WorkerState::kReady && !w->forced && !w->retiring && !w->surge,
         &w->placement.cpus});
  }
  return out;
}

std::optional<uint32_t> SparePool::vacated(Worker& vacant) {
  // A stopped worker's exit: the worker that took its place gets its CPUs now.
  if (vacant.pid == 0) {
    for (auto it = pin_at_exit_.begin(); it != pin_at_exit_.end();) {
      if (it->first != vacant.id) {
        ++it;
        continue;
      }
      const Worker& promoted = workers_.at(it->second);
      if (promoted.pid > 0) pin(promoted, promoted.placement.cpus);
      it = pin_at_exit_.erase(it);
    }
  }
  // A spare takes the place of an active worker only: not of one a reload took out of its pool
  // (reserve) or whose pool it removed.
  if (vacant.spare || vacant.reserve || vacant.removed || workers_.stopping()) return std::nullopt;
  const std::vector<SpareSeat> all = seats();
  const std::optional<uint32_t> spare = pick(all, vacant.id);
  if (!spare) return std::nullopt;
  promote(workers_.at(*spare), vacant);
  return spare;
}

std::optional<uint32_t> SparePool::spare_ready(Worker& w) {
  if (!w.spare || w.surge || w.retiring || workers_.stopping()) return std::nullopt;
  for (const auto& other : workers_.all()) {
    Worker& v = *other;
    if (v.spare || v.pool != w.pool || v.placement.gpu != w.placement.gpu ||
        !workers_.awaits_start(v)) {
      continue;
    }
    promote(w, v);
    return w.id;
  }
  return std::nullopt;
}

void SparePool::take_over(Worker& seat, Worker& old) {
  // The old worker takes no job from now on (it may have popped one a moment ago: it runs it
  // to its end, then stops), and the seat serves in its place.
  old.priv().hold.store(kHoldSpare, std::memory_order_seq_cst);
  const bool surge = seat.surge;
  promote(seat, old, false);
  seat.surge = false;
  old.surge = surge;  // the seat's role moves to the old entry, as a spare's does
  workers_.retire(old);
}

void SparePool::promote(Worker& spare, Worker& vacant, bool count) {
  // The roles and places swap: the spare serves where the vacant worker did; the vacant entry
  // is started again (after its back-off) as a spare, where the spare idled.
  std::swap(spare.placement, vacant.placement);
  spare.spare = false;
  vacant.spare = true;
  for (const Worker* w : {&spare, &vacant}) {
    const std::vector<int>& cpus = w->placement.cpus;
    std::atomic_ref<int32_t>(queue_.worker(w->id).cpu)
        .store(cpus.size() == 1 ? cpus.front() : -1, std::memory_order_relaxed);
  }
  if (vacant.pid > 0) {
    // Being stopped (killed by force_stop, or retiring after its job): until its exit, any CPU of
    // the pool (see pin_at_exit_), then the stopped worker's.
    std::vector<int> pool_cpus;
    for (const auto& w : workers_.all()) {
      if (w->pool != spare.pool) continue;
      pool_cpus.insert(pool_cpus.end(), w->placement.cpus.begin(), w->placement.cpus.end());
    }
    std::sort(pool_cpus.begin(), pool_cpus.end());
    pool_cpus.erase(std::unique(pool_cpus.begin(), pool_cpus.end()), pool_cpus.end());
    pin(spare, pool_cpus);
    pin_at_exit_.emplace_back(vacant.id, spare.id);
  } else {
    pin(spare, spare.placement.cpus);
  }
  // Lowered before the wakeup: the worker looks at `hold` after it reads the message.
  spare.priv().hold.store(0, std::memory_order_seq_cst);
  workers_.send(spare, WorkerPromoteMessage::kType, encode(WorkerPromoteMessage{}));
  if (count) ++promotions_[spare.pool];
  GPUQ_LOG_INFO(
      "spare worker %u (pid %d) takes the place of worker %u (cpus %s); worker %u is "
      "now a spare",
      spare.id, spare.pid, vacant.id, cpu_list_text(spare.placement.cpus).c_str(), vacant.id);
}

void SparePool::pin(const Worker& w, const std::vector<int>& cpus) {
  if (auto r = launcher_.set_affinity(w.pid, cpus); !r) {
    // It serves all the same, on the CPUs it had (as a spare: the pool's, or its GPU's).
    GPUQ_LOG_WARN("worker %u (pid %d): cannot pin it to cpus %s: %s", w.id, w.pid,
                  cpu_list_text(cpus).c_str(), r.error().to_string().c_str());
  }
}

}  // namespace gpuq::daemon
