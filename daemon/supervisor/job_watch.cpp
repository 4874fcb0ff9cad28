// Time limits and forced cancellation (docs/design/faults.md, "Jobs that do not end").
//
// Why `hold`: between the supervisor's last look at a slot and its kill, the job may end and
// the worker take the next one, which the kill would then cost its run. So the supervisor
// raises the worker's `hold` (seq_cst) and only then looks at the slot (seq_cst); the worker
// stores a job's end (seq_cst) and only then looks at `hold` (seq_cst), before it takes
// another job. Of two such pairs at least one side sees the other's store: either the
// supervisor sees the job ended (and lowers `hold`, killing nothing), or the worker sees
// `hold` and takes no new job until it is killed. Either way the kill can cost no job but the
// one it was meant for.
#include "job_watch.hpp"

#include <fcntl.h>

#include <algorithm>
#include <utility>

#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "ops.hpp"
#include "worker_set.hpp"

namespace gpuq::daemon {
namespace {

// The op's name for logs and messages: the id comes from the client's descriptor.
std::string op_name(uint32_t id) {
  const OpInfo* op = find_op(id);
  return op != nullptr ? std::string(op->name) : "op " + std::to_string(id);
}

}  // namespace

JobWatch::JobWatch(const Config& config, QueueView& queue, const ClientRegistry& clients,
                   const StampScale& stamps)
    : config_(config), queue_(queue), clients_(clients), stamps_(stamps) {}

uint64_t JobWatch::age_ns(uint64_t started_stamp) const {
  const uint64_t now = read_stamp(stamps_.clock);
  return now > started_stamp ? stamps_.to_ns(now - started_stamp) : 0;
}

uint32_t JobWatch::pool_of(uint32_t worker) const {
  const QueueLayout& l = queue_.layout();
  for (uint32_t p = 0; p < l.pool_count; ++p) {
    if (worker >= l.pools[p].first_worker &&
        worker - l.pools[p].first_worker < l.pools[p].worker_count) {
      return p;
    }
  }
  return kMaxPools;  // none: no pool limit applies
}

uint32_t JobWatch::limit_for(uint32_t pool, const JobSlot& slot) const {
  uint32_t limit = pool < config_.pools.size() ? config_.pools[pool].job_time_limit_ms : 0;
  const uint32_t own = slot.time_limit_ms;  // the client's: it can only shorten the pool's
  if (own != 0 && (limit == 0 || own < limit)) limit = own;
  return limit;
}

std::optional<JobWatch::Seen> JobWatch::observe(uint32_t worker) const {
  const WorkerShm& ws = queue_.worker(worker);
  if (ws.busy.load(std::memory_order_acquire) == 0) return std::nullopt;
  Seen seen;
  seen.ref = ws.job.load(std::memory_order_acquire);
  seen.started_stamp = ws.job_started.load(std::memory_order_acquire);
  const JobRef ref = JobRef::unpack(seen.ref);
  auto look = [&](void* base, const ClientSegmentGeometry& g, uint32_t slot_count) {
    if (ref.slot >= slot_count) return false;
    JobSlot& slot = ClientSegmentView(base, g, slot_count).slot(ref.slot);
    const uint64_t word = slot.state.load(std::memory_order_acquire);
    const SlotWord sw = SlotWord::unpack(word);
    if (sw.state != JobState::kRunning || sw.worker_plus_one != worker + 1 ||
        (sw.generation & JobRef::kGenerationMask) != ref.generation) {
      return false;
    }
    seen.slot = &slot;
    seen.word = word;
    return true;
  };
  // A client that left while this worker ran its job: only the watch's own mapping has it.
  if (worker < tracks_.size()) {
    const Track& t = tracks_[worker];
    if (t.active && t.departed && t.ref == seen.ref &&
        look(t.departed->address(), t.geometry, t.slot_count)) {
      seen.session = t.session;
      return seen;
    }
  }
  const Client* c = clients_.by_index(ref.client);
  if (c == nullptr || !look(c->segment.address(), c->geometry, c->slot_count)) {
    return std::nullopt;  // ended, or the worker moved on since it published
  }
  seen.session = c->session;
  seen.client = c;
  return seen;
}

void JobWatch::tick(uint64_t now, WorkerSet& workers) {
  const uint64_t grace_ns = uint64_t{config_.cancel_grace_ms} * 1'000'000;
  for (const auto& wp : workers.all()) {
    Worker& w = *wp;
    Track& t = tracks_[w.id];
    if (w.pid <= 0 || w.state != WorkerState::kReady) continue;
    if (t.stopping) continue;  // killed; its exit is on the way
    auto seen = observe(w.id);
    if (!seen) {
      t = Track{};
      continue;
    }
    JobSlot& slot = *seen->slot;
    const uint32_t generation = SlotWord::unpack(seen->word).generation;
    if (!t.active || t.ref != seen->ref || t.session != seen->session ||
        t.generation != generation) {
      Track fresh;
      fresh.active = true;
      fresh.ref = seen->ref;
      fresh.session = seen->session;
      fresh.generation = generation;
      fresh.started_ns = now - std::min(now, age_ns(seen->started_stamp));
      fresh.limit_ms = limit_for(w.pool, slot);
      fresh.op_id = slot.desc.op_id;
      fresh.client_pid = seen->client != nullptr ? seen->client->pid : 0;
      t = std::move(fresh);
    }
    if (t.why == 0) {
      const uint32_t asked = slot.cancel_requested.load(std::memory_order_relaxed);
      if ((asked & kCancelByClient) != 0) {
        t.why = kCancelByClient;
        t.asked_ns = now;
      } else if (t.limit_ms != 0 && now - t.started_ns >= uint64_t{t.limit_ms} * 1'000'000) {
        slot.cancel_requested.fetch_or(kCancelByTimeLimit, std::memory_order_seq_cst);
        // The job may have ended (and its slot been freed and reused) since `observe`: then
        // the flag is not this job's to keep.
        if (slot.state.load(std::memory_order_seq_cst) != seen->word) {
          slot.cancel_requested.fetch_and(~kCancelByTimeLimit, std::memory_order_seq_cst);
          t = Track{};
          continue;
        }
        GPUQ_FAULT_POINT("supervisor.time_limit_flagged");
        t.why = kCancelByTimeLimit;
        t.asked_ns = now;
        const JobRef ref = JobRef::unpack(t.ref);
        GPUQ_LOG_WARN(
            "worker %u (pid %d): job %u/%u (%s) passed its time limit of %u ms: asked "
            "it to stop",
            w.id, w.pid, ref.client, ref.slot, op_name(t.op_id).c_str(), t.limit_ms);
      }
    }
    if (t.why == 0 || now - t.asked_ns < grace_ns) continue;
    // Past the grace: stop the worker, unless the job ends now (see `hold` above).
    WorkerShm& ws = queue_.worker(w.id);
    ws.hold.store(1, std::memory_order_seq_cst);
    GPUQ_FAULT_POINT("supervisor.before_forced_stop");
    if (slot.state.load(std::memory_order_seq_cst) != seen->word) {
      ws.hold.store(0, std::memory_order_seq_cst);
      t = Track{};
      continue;
    }
    const JobRef ref = JobRef::unpack(t.ref);
    ForcedEnd end;
    end.session = t.session;
    end.slot = ref.slot;
    end.generation = t.generation;
    end.code = t.why == kCancelByTimeLimit ? ErrorCode::kTimedOut : ErrorCode::kCancelled;
    end.message = forced_message(t, w.id, w.pid);
    GPUQ_LOG_WARN(
        "worker %u (pid %d): job %u/%u (%s) %s and did not stop within "
        "cancel_grace_ms (%u ms): stopping the worker",
        w.id, w.pid, ref.client, ref.slot, op_name(t.op_id).c_str(),
        t.why == kCancelByTimeLimit ? "passed its time limit" : "was cancelled",
        config_.cancel_grace_ms);
    forced_[w.id] = std::move(end);
    t.stopping = true;
    workers.force_stop(w);
  }
}

std::string JobWatch::forced_message(const Track& t, uint32_t worker, pid_t pid) const {
  const std::string stopped = "; it did not stop within cancel_grace_ms (" +
                              std::to_string(config_.cancel_grace_ms) + " ms), so worker " +
                              std::to_string(worker) + " (pid " + std::to_string(pid) +
                              ") was stopped";
  if (t.why == kCancelByTimeLimit) {
    return op_name(t.op_id) + ": ran past its time limit (" + std::to_string(t.limit_ms) + " ms)" +
           stopped;
  }
  return op_name(t.op_id) + ": cancelled while running" + stopped;
}

void JobWatch::client_leaving(const Client& client, uint64_t now) {
  ClientSegmentView view(client.segment.address(), client.geometry, client.slot_count);
  std::shared_ptr<MemfdSegment> mapping;
  for (uint32_t s = 0; s < client.slot_count; ++s) {
    JobSlot& slot = view.slot(s);
    const SlotWord sw = SlotWord::unpack(slot.state.load(std::memory_order_acquire));
    if (sw.state != JobState::kRunning || sw.worker_plus_one == 0 ||
        sw.worker_plus_one > tracks_.size()) {
      continue;
    }
    // Unless the client asked to keep them: stopped, and followed (a kept one is followed too,
    // for status and its time limit).
    if (!client.keep_running_jobs) {
      slot.cancel_requested.fetch_or(kCancelByClient, std::memory_order_seq_cst);
    }
    if (!mapping) {
      // The registry lets go of the segment when the client is gone; the watch keeps a
      // mapping of its own to follow these jobs to their end.
      auto fd = GPUQ_POSIX_CALL(::fcntl, client.segment.fd(), F_DUPFD_CLOEXEC, 0);
      auto seg =
          fd ? MemfdSegment::map(UniqueFd(static_cast<int>(*fd)), client.geometry.segment_bytes)
             : Result<MemfdSegment>(fd.error());
      if (!seg) {
        // Its ops are asked to stop all the same; one that ignores it keeps its worker.
        GPUQ_LOG_ERROR("client %u left with jobs running, which cannot be followed: %s",
                       client.index, seg.error().to_string().c_str());
        continue;
      }
      mapping = std::make_shared<MemfdSegment>(std::move(*seg));
    }
    const uint32_t worker = sw.worker_plus_one - 1;
    Track& t = tracks_[worker];
    const uint32_t ref = JobRef{client.index, s, sw.generation}.pack();
    if (!(t.active && t.ref == ref && t.session == client.session &&
          t.generation == sw.generation)) {
      t = Track{};
      t.active = true;
      t.ref = ref;
      t.session = client.session;
      t.generation = sw.generation;
      const WorkerShm& ws = queue_.worker(worker);
      t.started_ns = ws.job.load(std::memory_order_acquire) == ref
                         ? now - std::min(now, age_ns(ws.job_started.load()))
                         : now;
      t.limit_ms = limit_for(pool_of(worker), slot);
      t.op_id = slot.desc.op_id;
    }
    t.departed = mapping;
    t.geometry = client.geometry;
    t.slot_count = client.slot_count;
    t.client_pid = client.pid;
    if (client.keep_running_jobs) {
      GPUQ_LOG_INFO(
          "client %u left while job %u/%u (%s) ran on worker %u: it runs on "
          "(keep_running_jobs)",
          client.index, client.index, s, op_name(t.op_id).c_str(), worker);
      continue;
    }
    if (t.why == 0) {  // a time limit already hit keeps its grace
      t.why = kCancelByClient;
      t.asked_ns = now;
    }
    GPUQ_LOG_INFO("client %u left while job %u/%u (%s) ran on worker %u: cancelled it",
                  client.index, client.index, s, op_name(t.op_id).c_str(), worker);
  }
}

std::optional<ForcedEnd> JobWatch::take_forced(uint32_t worker) {
  if (worker >= tracks_.size()) return std::nullopt;
  tracks_[worker] = Track{};
  if (worker >= forced_.size()) return std::nullopt;
  return std::exchange(forced_[worker], std::nullopt);
}

uint64_t JobWatch::next_due() const {
  const uint64_t grace_ns = uint64_t{config_.cancel_grace_ms} * 1'000'000;
  uint64_t due = 0;
  for (const Track& t : tracks_) {
    if (!t.active || t.stopping) continue;
    uint64_t at = 0;
    if (t.why != 0) {
      at = t.asked_ns + grace_ns;
    } else if (t.limit_ms != 0) {
      at = t.started_ns + uint64_t{t.limit_ms} * 1'000'000;
    }
    if (at != 0 && (due == 0 || at < due)) due = at;
  }
  return due;
}

std::optional<RunningJob> JobWatch::running(uint32_t worker) const {
  auto seen = observe(worker);
  if (!seen) return std::nullopt;
  const JobRef ref = JobRef::unpack(seen->ref);
  RunningJob r;
  r.client = ref.client;
  r.slot = ref.slot;
  r.age_ns = age_ns(seen->started_stamp);
  const Track* t = worker < tracks_.size() ? &tracks_[worker] : nullptr;
  const bool tracked = t != nullptr && t->active && t->ref == seen->ref &&
                       t->session == seen->session &&
                       t->generation == SlotWord::unpack(seen->word).generation;
  r.op_id = tracked ? t->op_id : seen->slot->desc.op_id;
  r.time_limit_ms = tracked ? t->limit_ms : limit_for(pool_of(worker), *seen->slot);
  if (seen->client != nullptr) {
    r.client_pid = seen->client->pid;
    r.client_name = seen->client->name;
  } else if (tracked) {
    r.client_pid = t->client_pid;
  }
  if (tracked && t->why != 0)
    r.stop_requested = t->why == kCancelByTimeLimit ? "time_limit" : "cancel";
  return r;
}

bool JobWatch::stuck(uint32_t worker) const {
  if (worker >= tracks_.size()) return false;
  const Track& t = tracks_[worker];
  return t.active && (t.why != 0 || t.stopping) && observe(worker).has_value();
}

}  // namespace gpuq::daemon
