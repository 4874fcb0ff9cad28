// Time limits and forced cancellation (docs/design/faults.md, "Jobs that do not end").
//
// Why `hold`: between the supervisor's last look at a worker and its kill, the job may end and
// the worker take the next one, which the kill would then cost its run. So the supervisor
// raises the worker's `hold` (seq_cst) and only then looks at its job_seq (seq_cst); the worker
// stores the job's end in job_seq (seq_cst) and only then looks at `hold` (seq_cst), before it
// takes another job. Of two such pairs at least one side sees the other's store: either the
// supervisor sees the job ended (and lowers `hold`, killing nothing), or the worker sees `hold`
// and takes no new job until it is killed. Both words are on the worker's private page, so no
// client can forge either side.
#include "job_watch.hpp"

#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/time_limit.hpp"
#include "ops.hpp"
#include "worker_set.hpp"

namespace gpuq::daemon {
namespace {

// How long a job a departed client's slot says a worker runs may go unpublished on that
// worker's page: a worker publishes right after its claim, so one that has not by then is not
// running it (the slot's word was the client's to forge).
constexpr uint64_t kPublishWaitNs = 500'000'000;
// How long after a client leaves the watch looks for jobs of it that a worker claimed after
// its departure (and remembers that a keep_running_jobs client's are to run on).
constexpr uint64_t kDepartureWatchNs = 5'000'000'000;

// The op's name for logs and messages: the id comes from the client's descriptor.
std::string op_name(uint32_t id) {
  const OpInfo* op = find_op(id);
  return op != nullptr ? std::string(op->name) : "op " + std::to_string(id);
}

}  // namespace

JobWatch::JobWatch(const Config& config, const ClientRegistry& clients, const StampScale& stamps)
    : config_(config), clients_(clients), stamps_(stamps) {}

void JobWatch::attach(WorkerSet* workers) {
  workers_ = workers;
  tracks_.assign(workers->all().size(), Track{});
  forced_.assign(workers->all().size(), std::nullopt);
}

uint64_t JobWatch::age_ns(uint64_t started_stamp) const {
  const uint64_t now = read_stamp(stamps_.clock);
  return now > started_stamp ? stamps_.to_ns(now - started_stamp) : 0;
}

uint32_t JobWatch::limit_for(uint32_t pool, const JobSlot* slot) const {
  const uint32_t limit = pool < config_.pools.size() ? config_.pools[pool].job_time_limit_ms : 0;
  if (slot == nullptr) return limit;
  // The client's own (written with its descriptor): it can only shorten the pool's.
  const uint32_t own =
      std::atomic_ref<const uint32_t>(slot->time_limit_ms).load(std::memory_order_relaxed);
  return effective_time_limit_ms(limit, own);
}

JobSlot* JobWatch::slot_in(void* base, const ClientSegmentGeometry& g, uint32_t slot_count,
                           uint32_t ref) {
  const JobRef r = JobRef::unpack(ref);
  if (base == nullptr || r.slot >= slot_count) return nullptr;
  return &ClientSegmentView(base, g, slot_count).slot(r.slot);
}

std::optional<JobWatch::Seen> JobWatch::observe(const Worker& w) const {
  // A seqlock read of the private page: the same odd job_seq before and after.
  const WorkerPrivate& p = w.priv();
  Seen seen;
  seen.seq = p.job_seq.load(std::memory_order_acquire);
  if ((seen.seq & 1) == 0) return std::nullopt;  // idle
  seen.ref = p.job.load(std::memory_order_relaxed);
  seen.started_stamp = p.job_started.load(std::memory_order_relaxed);
  seen.session = p.session.load(std::memory_order_relaxed);
  seen.batch_jobs = std::max<uint32_t>(1, p.batch_jobs.load(std::memory_order_relaxed));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (p.job_seq.load(std::memory_order_relaxed) != seen.seq) return std::nullopt;  // moved on
  // The job's slot: through the watch's own mapping for a client that has left, else the
  // registry's, if the client holding the reference's index is the job's (a departed client's
  // index may have been given to another since). Else an orphan: no slot to read.
  const Track& t = tracks_[w.id];
  if (t.active && t.departed && t.ref == seen.ref && t.session == seen.session &&
      (t.seq == 0 || t.seq == seen.seq)) {
    seen.slot = slot_in(t.departed->address(), t.geometry, t.slot_count, seen.ref);
    return seen;
  }
  if (const Client* c = clients_.by_index(JobRef::unpack(seen.ref).client);
      c != nullptr && c->session == seen.session) {
    seen.slot = slot_in(c->segment.address(), c->geometry, c->slot_count, seen.ref);
    seen.client = c;
  }
  return seen;
}

bool JobWatch::wants_tick(uint64_t now) const {
  return now < departure_watch_until_ns_ ||
         std::any_of(tracks_.begin(), tracks_.end(), [](const Track& t) { return t.active; });
}

void JobWatch::tick(uint64_t now) {
  const uint64_t grace_ns = uint64_t{config_.cancel_grace_ms} * 1'000'000;
  std::erase_if(kept_sessions_,
                [&](const auto& kept) { return now - kept.second > kDepartureWatchNs; });
  for (const auto& wp : workers_->all()) {
    Worker& w = *wp;
    Track& t = tracks_[w.id];
    if (w.pid <= 0 || w.state != WorkerState::kReady) continue;
    if (t.stopping) continue;  // killed; its exit is on the way
    auto seen = observe(w);
    if (!seen) {
      // Idle. A departed client's job the worker claimed but has not published yet keeps its
      // track (and the mapping in it) while its slot still says it runs here, for a while.
      const JobSlot* slot =
          t.active && t.departed && t.seq == 0 && now - t.started_ns < kPublishWaitNs
              ? slot_in(t.departed->address(), t.geometry, t.slot_count, t.ref)
              : nullptr;
      const SlotWord sw = slot != nullptr ? SlotWord::unpack(slot->state.load()) : SlotWord{};
      if (slot == nullptr || sw.state != JobState::kRunning || sw.worker_plus_one != w.id + 1 ||
          !t.generation_known || sw.generation != t.generation) {
        t = Track{};
      }
      continue;
    }
    JobSlot* slot = seen->slot;
    if (t.active && t.seq == 0 && t.ref == seen->ref && t.session == seen->session) {
      t.seq = seen->seq;  // published now
    }
    if (!t.active || t.seq != seen->seq) {
      Track fresh;
      fresh.active = true;
      fresh.seq = seen->seq;
      fresh.ref = seen->ref;
      fresh.session = seen->session;
      if (slot != nullptr) {
        const SlotWord sw = SlotWord::unpack(slot->state.load(std::memory_order_acquire));
        if ((sw.generation & JobRef::kGenerationMask) == JobRef::unpack(seen->ref).generation) {
          fresh.generation = sw.generation;
          fresh.generation_known = true;
          fresh.word = SlotWord{sw.generation, JobState::kRunning, w.id + 1}.pack();
        }
        fresh.op_id =
            std::atomic_ref<const uint32_t>(slot->desc.op_id).load(std::memory_order_relaxed);
      }
      fresh.started_stamp = seen->started_stamp;
      fresh.started_ns = now - std::min(now, age_ns(seen->started_stamp));
      fresh.limit_ms = limit_for(w.pool, slot);
      fresh.client_pid = seen->client != nullptr ? seen->client->pid : 0;
      fresh.batch_jobs = seen->batch_jobs;
      // A batched call serves other clients too: their departure does not stop it (only a
      // time limit does).
      if (seen->client == nullptr && slot == nullptr && seen->batch_jobs == 1 &&
          kept_sessions_.count(seen->session) == 0) {
        // An orphan: its client left between the scan of its slots and the worker's claim of
        // this job (client_leaving never saw it). Cancelled like the others; with no slot to
        // raise a flag in, stopped by force after the grace.
        fresh.why = kCancelByClient;
        fresh.asked_ns = now;
        GPUQ_LOG_INFO("worker %u (pid %d) runs a job of a client that has left: cancelled it", w.id,
                      w.pid);
      }
      t = std::move(fresh);
    }
    WorkerPrivate& p = w.priv();
    if (t.why == 0) {
      const uint32_t asked =
          slot != nullptr ? slot->cancel_requested.load(std::memory_order_relaxed) : 0;
      if ((asked & kCancelByClient) != 0 && t.batch_jobs == 1) {
        t.why = kCancelByClient;
        t.asked_ns = now;
      } else if (t.limit_ms != 0 && now - t.started_ns >= uint64_t{t.limit_ms} * 1'000'000) {
        // Into the slot when its word is known to be this job's; else straight to the grace.
        if (slot != nullptr && t.generation_known) {
          slot->cancel_requested.fetch_or(kCancelByTimeLimit, std::memory_order_seq_cst);
          // The job may have ended (and its slot been freed and reused) since `observe`: then
          // the flag is not this job's to keep. A client frees a slot with FREE and then the
          // flag's reset, both release: a bit that landed after the reset sees FREE or later.
          const bool moved = slot->state.load(std::memory_order_seq_cst) != t.word;
          const bool ended = p.job_seq.load(std::memory_order_seq_cst) != t.seq;
          if (moved || ended) {
            slot->cancel_requested.fetch_and(~kCancelByTimeLimit, std::memory_order_seq_cst);
            if (ended) {
              t = Track{};
              continue;
            }
            // Still running here, though its slot says otherwise (its client rewrote it): no
            // flag, and the grace starts all the same.
          }
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
    p.hold.store(1, std::memory_order_seq_cst);
    GPUQ_FAULT_POINT("supervisor.before_forced_stop");
    if (p.job_seq.load(std::memory_order_seq_cst) != t.seq) {
      p.hold.store(0, std::memory_order_seq_cst);
      t = Track{};
      continue;
    }
    // The client's cancel, if it came on top of a time limit, decides: the worker's own path
    // says Cancelled then too.
    const uint32_t asked =
        slot != nullptr ? slot->cancel_requested.load(std::memory_order_relaxed) : 0;
    const ErrorCode code =
        t.why == kCancelByClient || ((asked & kCancelByClient) != 0 && t.batch_jobs == 1)
            ? ErrorCode::kCancelled
            : ErrorCode::kTimedOut;
    const JobRef ref = JobRef::unpack(t.ref);
    ForcedEnd end;
    end.session = t.session;
    end.slot = ref.slot;
    end.generation = t.generation;
    end.generation_known = t.generation_known;
    end.started_stamp = t.started_stamp;
    end.code = code;
    end.message = forced_message(t, code, w.id, w.pid);
    end.limit_ms = t.limit_ms;
    end.batch_jobs = t.batch_jobs;
    GPUQ_LOG_WARN(
        "worker %u (pid %d): job %u/%u (%s) %s and did not stop within "
        "cancel_grace_ms (%u ms): stopping the worker",
        w.id, w.pid, ref.client, ref.slot, op_name(t.op_id).c_str(),
        code == ErrorCode::kTimedOut ? "passed its time limit" : "was cancelled",
        config_.cancel_grace_ms);
    forced_[w.id] = std::move(end);
    t.stopping = true;
    workers_->force_stop(w);
  }
}

std::string JobWatch::forced_message(const Track& t, ErrorCode code, uint32_t worker,
                                     pid_t pid) const {
  const std::string stopped = "; it did not stop within cancel_grace_ms (" +
                              std::to_string(config_.cancel_grace_ms) + " ms), so worker " +
                              std::to_string(worker) + " (pid " + std::to_string(pid) +
                              ") was stopped";
  if (code == ErrorCode::kTimedOut) {
    return op_name(t.op_id) + ": ran past its time limit (" + std::to_string(t.limit_ms) + " ms)" +
           stopped;
  }
  return op_name(t.op_id) + ": cancelled while running" + stopped;
}

void JobWatch::client_leaving(const Client& client, uint64_t now) {
  // A worker may still claim one of its jobs before it reads the client's UnmapClient: watch
  // for such orphans for a while.
  departure_watch_until_ns_ = now + kDepartureWatchNs;
  if (client.keep_running_jobs) kept_sessions_[client.session] = now;
  ClientSegmentView view(client.segment.address(), client.geometry, client.slot_count);
  std::shared_ptr<MemfdSegment> mapping;
  for (uint32_t s = 0; s < client.slot_count; ++s) {
    JobSlot& slot = view.slot(s);
    const SlotWord sw = SlotWord::unpack(slot.state.load(std::memory_order_acquire));
    if (sw.state != JobState::kRunning || sw.worker_plus_one == 0 ||
        sw.worker_plus_one > tracks_.size()) {
      continue;
    }
    const uint32_t worker = sw.worker_plus_one - 1;
    const uint32_t ref = JobRef{client.index, s, sw.generation}.pack();
    // The slot's word is the client's to write: believe it only where the worker's private
    // page does not say otherwise (it runs this job, or has not published one yet).
    const Worker& w = *workers_->all()[worker];
    // A dormant surge seat runs nothing: the word is forged (a track on it would never end,
    // and would keep the client's segment for good).
    if (dormant(w)) continue;
    const WorkerPrivate& p = w.priv();
    const uint64_t seq = p.job_seq.load(std::memory_order_acquire);
    const bool running_it = (seq & 1) != 0 && p.job.load(std::memory_order_relaxed) == ref &&
                            p.session.load(std::memory_order_relaxed) == client.session;
    Track& t = tracks_[worker];
    if (t.stopping || ((seq & 1) != 0 && !running_it)) continue;
    // A batched call serves other clients too: it runs on, and the departed client's rows are
    // dropped with its segment (its time limit, as the batch's, still holds).
    if (running_it && p.batch_jobs.load(std::memory_order_relaxed) > 1) continue;
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
        // Its ops are asked to stop all the same, and the pool's limit still holds.
        GPUQ_LOG_ERROR("client %u left with jobs running, which cannot be followed: %s",
                       client.index, seg.error().to_string().c_str());
        continue;
      }
      mapping = std::make_shared<MemfdSegment>(std::move(*seg));
    }
    if (!(t.active && t.ref == ref && t.session == client.session)) {
      t = Track{};
      t.active = true;
      t.seq = running_it ? seq : 0;
      t.ref = ref;
      t.session = client.session;
      t.generation = sw.generation;
      t.generation_known = true;
      t.started_stamp = running_it ? p.job_started.load(std::memory_order_relaxed) : 0;
      t.started_ns = running_it ? now - std::min(now, age_ns(t.started_stamp)) : now;
      t.limit_ms = limit_for(w.pool, &slot);
      t.op_id = std::atomic_ref<const uint32_t>(slot.desc.op_id).load(std::memory_order_relaxed);
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
  return std::exchange(forced_[worker], std::nullopt);
}

uint64_t JobWatch::next_due() const {
  const uint64_t grace_ns = uint64_t{config_.cancel_grace_ms} * 1'000'000;
  uint64_t due = 0;
  for (const Track& t : tracks_) {
    if (!t.active || t.stopping) continue;
    uint64_t at = 0;
    if (t.seq == 0) {
      at = t.started_ns + kPublishWaitNs;  // dropped then if still not published
    } else if (t.why != 0) {
      at = t.asked_ns + grace_ns;
    } else if (t.limit_ms != 0) {
      at = t.started_ns + uint64_t{t.limit_ms} * 1'000'000;
    }
    if (at != 0 && (due == 0 || at < due)) due = at;
  }
  return due;
}

std::optional<RunningJob> JobWatch::running(const Worker& w) const {
  auto seen = observe(w);
  if (!seen) return std::nullopt;
  const JobRef ref = JobRef::unpack(seen->ref);
  RunningJob r;
  r.client = ref.client;
  r.slot = ref.slot;
  const Track& t = tracks_[w.id];
  const bool tracked = t.active && t.seq == seen->seq;
  // A tracked job's age on the clock its limit is judged by: status never shows a stuck job
  // younger than its limit.
  const uint64_t now = monotonic_ns();
  r.age_ns = tracked ? now - std::min(now, t.started_ns) : age_ns(seen->started_stamp);
  r.op_id = 0;
  if (tracked) {
    r.op_id = t.op_id;
  } else if (seen->slot != nullptr) {
    r.op_id =
        std::atomic_ref<const uint32_t>(seen->slot->desc.op_id).load(std::memory_order_relaxed);
  }
  r.time_limit_ms = tracked ? t.limit_ms : limit_for(w.pool, seen->slot);
  if (seen->client != nullptr) {
    r.client_pid = seen->client->pid;
    r.client_name = seen->client->name;
  } else if (tracked) {
    r.client_pid = t.client_pid;
  }
  if (tracked && t.why != 0) {
    r.stop_requested = t.why == kCancelByTimeLimit ? "time_limit" : "cancel";
  }
  return r;
}

bool JobWatch::stuck(const Worker& w) const {
  const Track& t = tracks_[w.id];
  if (!t.active || (t.why == 0 && !t.stopping)) return false;
  auto seen = observe(w);
  return seen && seen->seq == t.seq;
}

}  // namespace gpuq::daemon
