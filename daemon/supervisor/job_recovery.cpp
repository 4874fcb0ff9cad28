// The supervisor's recovery of jobs: after a worker's death, and the audit of what clients can
// overwrite in the queue segment (see docs/design/ring.md, "Repair", and docs/design/faults.md,
// "Bad input").
//
// The rings live in the queue segment, which every allowed client maps read-write, so a client
// (buggy or hostile) can store words in the cells that no producer or consumer would. Such a
// word at the head stops every consumer of the pool, at the tail every producer, and a value it
// replaced is a job that no worker will ever see. While any client is connected, the
// supervisor looks every kAuditNs:
//   - at each ring's head and tail hints and cells (RingAudit, gpuq/common/job_ring.hpp):
//     hints that jumped are moved back, and a cell suspect in two audits in a row, with the
//     same word, is retired (marked consumed, so both sides step past it);
//   - at each live client's SUBMITTED jobs: one in no ring for kLostAfterNs, while its client
//     is not inside submit (`submitting` is up from before the slot turns SUBMITTED until its
//     reference is in the ring), has lost its entry, and is pushed again;
// A false "lost" (a job whose entry is in fact about to be pushed or popped) would only cost
// a duplicate reference, which is harmless: one SUBMITTED -> RUNNING CAS wins, the other pop
// finds the slot taken and drops it.
#include "job_recovery.hpp"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstring>
#include <utility>
#include <vector>

#include "gpuq/common/log.hpp"
#include "gpuq/common/time_limit.hpp"
#include "ops.hpp"

namespace gpuq::daemon {
namespace {

// The `worker_plus_one` of a queued job the supervisor has claimed to fail it (fail_queued):
// no worker has that id (kMaxWorkers is far below), so nothing that looks for a worker's jobs
// takes it for one.
constexpr uint32_t kSupervisorClaim = 0xFFFFFF;
static_assert(kMaxWorkers < kSupervisorClaim);

}  // namespace

void JobRecovery::worker_died(uint32_t worker, uint32_t pool, const std::string& why,
                              const ForcedEnd* forced) {
  if (forced != nullptr && forced->code == ErrorCode::kTimedOut) ++time_limit_kills_[pool];
  // The dying worker's id is in the state word of the job it ran; end exactly that job.
  clients_.for_each([&](const Client& conn) {
    ClientSegmentView view(conn.segment.address(), conn.geometry, conn.slot_count);
    for (uint32_t s = 0; s < conn.slot_count; ++s) {
      JobSlot& slot = view.slot(s);
      uint64_t word = slot.state.load(std::memory_order_acquire);
      SlotWord sw = SlotWord::unpack(word);
      if (sw.state != JobState::kRunning || sw.worker_plus_one != worker + 1) continue;
      bool stopped_for_it = forced != nullptr && forced->generation_known &&
                            forced->session == conn.session && forced->slot == s &&
                            forced->generation == sw.generation;
      // A batched call stopped at one job's time limit: the others of its batch that asked for
      // that limit (or a shorter one) end TimedOut too; the rest run again.
      const bool batch_mate = !stopped_for_it && forced != nullptr &&
                              forced->code == ErrorCode::kTimedOut && forced->batch_jobs > 1;
      std::string message = stopped_for_it ? forced->message : why;
      if (batch_mate) {
        const uint32_t own = std::atomic_ref<const uint32_t>(slot.time_limit_ms).load();
        const uint32_t limit = effective_time_limit_ms(
            pool < config_.pools.size() ? config_.pools[pool].job_time_limit_ms : 0, own);
        if (limit != 0 && limit <= forced->limit_ms) {
          stopped_for_it = true;
          message = forced->message + " (its batch's call; this job's limit is " +
                    std::to_string(limit) + " ms)";
        }
      }
      if (!stopped_for_it && retry(conn, s, slot, word, why, batch_mate)) continue;
      JobOutcome out{};
      out.code = static_cast<int32_t>(stopped_for_it ? forced->code : ErrorCode::kWorkerDied);
      out.worker_id = worker;
      out.finished_stamp = read_stamp(job_clock_);
      if (stopped_for_it) out.started_stamp = forced->started_stamp;  // it ran until stopped
      set_slot_message(slot, message);
      std::memcpy(&slot.outcome, &out, sizeof out);
      const JobState end = stopped_for_it && forced->code == ErrorCode::kCancelled
                               ? JobState::kCancelled
                               : JobState::kFailed;
      SlotWord failed{sw.generation, end, sw.worker_plus_one};
      if (slot.state.compare_exchange_strong(word, failed.pack(), std::memory_order_acq_rel)) {
        view.announce_end(slot, false);
        queue_.worker(worker).jobs_failed.fetch_add(1, std::memory_order_relaxed);
        const char* outcome = !stopped_for_it                         ? "worker_died"
                              : forced->code == ErrorCode::kCancelled ? "cancelled"
                                                                      : "timed_out";
        // The op id is the client's to write: one no op has counts as `other`.
        const uint32_t op = slot.desc.op_id;
        ++jobs_ended_[{pool, find_op(op) != nullptr ? op : kMetricOtherOp, outcome}];
      }
    }
  });
  requeue_lost(pool);
}

uint32_t JobRecovery::fail_queued(uint32_t pool, const std::string& why) {
  const PoolQueue queue = queue_.queue(pool);
  uint32_t failed = 0;
  bool popped = false;
  uint32_t value = 0;
  // At most two lanes' worth from each: a client that keeps pushing (against `accepting`)
  // cannot hold the loop here.
  for (uint32_t lane = 0; lane < queue.lane_count(); ++lane) {
    JobRing ring = queue.lane(lane);
    for (uint32_t n = 0; n < 2 * ring.capacity() && ring.try_pop(&value); ++n) {
      popped = true;
      failed += fail_popped(pool, value, why) ? 1 : 0;
    }
  }
  jobs_failed_down_[pool] += failed;
  // Producers asleep for room in the ring, or for their share of it: they look again and see
  // the pool down.
  if (popped) queue_.pool(pool).space.notify_all();
  if (failed > 0) {
    GPUQ_LOG_WARN("failed %u queued job%s: %s", failed, failed == 1 ? "" : "s", why.c_str());
  }
  return failed;
}

// One reference fail_queued popped: fails its job with PoolDown, unless it is stale.
bool JobRecovery::fail_popped(uint32_t pool, uint32_t value, const std::string& why) {
  const JobRef ref = JobRef::unpack(value);
  const Client* conn = clients_.by_index(ref.client);
  if (conn == nullptr) return false;  // a departed client's: its jobs were cancelled as it left
  ClientSegmentView view(conn->segment.address(), conn->geometry, conn->slot_count);
  if (ref.slot >= conn->slot_count) return false;  // forged
  JobSlot& slot = view.slot(ref.slot);
  uint64_t word = slot.state.load(std::memory_order_acquire);
  const SlotWord sw = SlotWord::unpack(word);
  if (sw.state != JobState::kSubmitted ||
      (sw.generation & JobRef::kGenerationMask) != ref.generation || slot.desc.pool_id != pool) {
    return false;  // cancelled or expired while queued, or a stale entry (as a worker drops it)
  }
  // Claimed first, as a worker claims a job (the CAS races the client's cancel and expiry,
  // which write their own outcome after theirs); then the outcome; then the end.
  const SlotWord claimed{sw.generation, JobState::kRunning, kSupervisorClaim};
  if (!slot.state.compare_exchange_strong(word, claimed.pack(), std::memory_order_acq_rel)) {
    return false;
  }
  JobOutcome out{};
  out.code = static_cast<int32_t>(ErrorCode::kPoolDown);
  out.finished_stamp = read_stamp(job_clock_);
  set_slot_message(slot, why);
  std::memcpy(&slot.outcome, &out, sizeof out);
  slot.state.store(SlotWord{sw.generation, JobState::kFailed, kSupervisorClaim}.pack(),
                   std::memory_order_release);
  view.announce_end(slot, false);
  const uint32_t op = slot.desc.op_id;
  ++jobs_ended_[{pool, find_op(op) != nullptr ? op : kMetricOtherOp, "pool_down"}];
  return true;
}

// The lane a job of `conn` in slot `s` goes back to: its client's lane of its priority.
uint32_t JobRecovery::lane_of(const Client& conn, uint32_t s, uint32_t pool) const {
  ClientSegmentView view(conn.segment.address(), conn.geometry, conn.slot_count);
  const uint32_t flags = view.slot(s).desc.flags;  // the client's to write: any level will do
  return queue_.queue(pool).lane_for(conn.index, flags_priority(flags), false);
}

void JobRecovery::client_left(uint64_t session) {
  std::erase_if(retried_, [&](const auto& key) { return std::get<0>(key) == session; });
}

// A retryable job whose worker died: back to SUBMITTED (same generation) and into its pool's
// ring, once. The count is kept here, not in the client's segment, which the client could
// rewrite to retry a job that kills every worker forever. False if the job is not retryable,
// was retried already, or there is no room; the caller then fails it.
bool JobRecovery::retry(const Client& conn, uint32_t s, JobSlot& slot, uint64_t running_word,
                        const std::string& why, bool batch_mate) {
  const SlotWord sw = SlotWord::unpack(running_word);
  const uint32_t pool = slot.desc.pool_id;
  if ((!batch_mate && (slot.desc.flags & kJobFlagRetryable) == 0) || pool >= config_.pools.size()) {
    return false;
  }
  const auto key = std::make_tuple(conn.session, s, sw.generation);
  if (retried_.count(key) != 0) {
    GPUQ_LOG_WARN("job %u/%u is retryable but was retried once already: failing it", conn.index, s);
    return false;
  }
  const SlotWord queued_again{sw.generation, JobState::kSubmitted, 0};
  if (!slot.state.compare_exchange_strong(running_word, queued_again.pack(),
                                          std::memory_order_acq_rel)) {
    return false;
  }
  if (!queue_.queue(pool).try_push(lane_of(conn, s, pool),
                                   JobRef{conn.index, s, sw.generation}.pack())) {
    // Put it back as it was, for the caller to fail.
    uint64_t expected = queued_again.pack();
    slot.state.compare_exchange_strong(expected, running_word, std::memory_order_acq_rel);
    GPUQ_LOG_WARN("cannot retry job %u/%u: the ring of pool %u is full", conn.index, s, pool);
    return false;
  }
  retried_.insert(key);
  queue_.wake_worker(pool);
  if (batch_mate) {
    GPUQ_LOG_WARN("running job %u/%u again (its batch's call was stopped for another job): %s",
                  conn.index, s, why.c_str());
  } else {
    GPUQ_LOG_WARN("retrying job %u/%u (retryable): %s", conn.index, s, why.c_str());
  }
  return true;
}

// A worker killed between popping a job's reference and claiming the slot took the reference
// with it: the job is SUBMITTED but in no ring. Put such references back. Not while the job's
// client is inside submit (`submitting`, seq_cst as in the drain's handshake): the job may be
// the one it is about to push, or to give back when its push fails (Timeout waiting for room,
// ShuttingDown, PoolDown), and a reference pushed for it then would let a worker, or the
// PoolDown failure, claim a slot the client is freeing. Such a job is looked at again on the
// next tick; a duplicate reference of a job the client does push is harmless (only one
// SUBMITTED -> RUNNING CAS can win).
void JobRecovery::requeue_lost(uint32_t pool) {
  PoolQueue queue = queue_.queue(pool);
  for_each_job_in_no_ring(pool, [&](const Client& conn, uint32_t s, uint32_t ref) {
    if (queue_.client(conn.index).submitting.load(std::memory_order_seq_cst) != 0) {
      requeue_pending_ |= 1u << pool;
      return;
    }
    if (queue.try_push(lane_of(conn, s, pool), ref)) {
      GPUQ_LOG_WARN("requeued job %u/%u, whose reference a dying worker took", conn.index, s);
      queue_.wake_worker(pool);
    } else {
      // Not lost: tried again on every timer tick until there is room.
      GPUQ_LOG_WARN("cannot requeue job %u/%u yet: ring full; retrying", conn.index, s);
      requeue_pending_ |= 1u << pool;
    }
  });
}

void JobRecovery::for_each_job_in_no_ring(
    uint32_t pool, const std::function<void(const Client&, uint32_t slot, uint32_t ref)>& fn) {
  std::vector<uint32_t> in_ring;
  queue_.queue(pool).for_each_value([&](uint32_t v) { in_ring.push_back(v); });
  std::sort(in_ring.begin(), in_ring.end());
  clients_.for_each([&](const Client& conn) {
    ClientSegmentView view(conn.segment.address(), conn.geometry, conn.slot_count);
    for (uint32_t s = 0; s < conn.slot_count; ++s) {
      JobSlot& slot = view.slot(s);
      const SlotWord sw = SlotWord::unpack(slot.state.load(std::memory_order_acquire));
      if (sw.state != JobState::kSubmitted || slot.desc.pool_id != pool) continue;
      const uint32_t ref = JobRef{conn.index, s, sw.generation}.pack();
      if (!std::binary_search(in_ring.begin(), in_ring.end(), ref)) fn(conn, s, ref);
    }
  });
}

void JobRecovery::tick(uint64_t now) {
  // Jobs a dead worker took that found no room in a full ring: try again each tick.
  if (const uint32_t pending = std::exchange(requeue_pending_, 0); pending != 0) {
    for (uint32_t p = 0; p < config_.pools.size(); ++p) {
      if ((pending & (1u << p)) != 0) requeue_lost(p);
    }
  }
  if (now < next_audit_ns_) return;
  next_audit_ns_ = now + kAuditNs;
  for (uint32_t p = 0; p < config_.pools.size(); ++p) {
    audit_ring(p);
    audit_submitted(p, now);
  }
}

void JobRecovery::audit_ring(uint32_t p) {
  PoolQueue queue = queue_.queue(p);
  // Lane bits of lanes that emptied while the workers never slept, and of lanes whose pusher
  // died before its mark or whose bit a client cleared (PoolQueue's contract): no worker looks
  // at those until their bits are set, so one is woken for them.
  if (queue.settle_bits() != 0) queue_.wake_worker(p);
  ring_audits_[p].resize(queue.lane_count());
  for (uint32_t lane = 0; lane < queue.lane_count(); ++lane) audit_lane(p, lane);
}

void JobRecovery::audit_lane(uint32_t p, uint32_t lane) {
  JobRing ring = queue_.queue(p).lane(lane);
  const RingAudit::Report r = ring_audits_[p][lane].run(ring);
  const char* pool = config_.pools[p].name.c_str();
  if (r.head_restored || r.tail_restored) {
    ++hints_restored_[p];
    GPUQ_LOG_WARN("pool %s: lane %u %s position jumped to %" PRIu64
                  " (a client wrote over the queue segment?): moved it back to %" PRIu64,
                  pool, lane, r.head_restored ? "head" : "tail",
                  r.head_restored ? r.head_from : r.tail_from,
                  r.head_restored ? r.head_to : r.tail_to);
  }
  for (const JobRing::Suspect& s : r.retired) {
    ++cells_retired_[p];
    GPUQ_LOG_WARN(
        "pool %s: lane %u cell %u (position %" PRIu64 ") held 0x%016" PRIx64
        ", which no producer or consumer writes (a client wrote over the queue segment?): "
        "retired it",
        pool, lane, s.index, s.position, s.word);
  }
}

void JobRecovery::audit_submitted(uint32_t p, uint64_t now) {
  PoolQueue queue = queue_.queue(p);
  const uint32_t share = queue_.pool(p).client_share;
  std::map<LostKey, uint64_t> still_lost;
  std::map<uint64_t, uint32_t> pushed;  // per client session, this audit
  for_each_job_in_no_ring(p, [&](const Client& conn, uint32_t s, uint32_t ref) {
    const LostKey key{p, conn.session, s, JobRef::unpack(ref).generation};
    auto seen = lost_since_.find(key);
    const uint64_t since = seen == lost_since_.end() ? now : seen->second;
    // A client inside submit may be about to push it; a client's own scribbling gets at most
    // its share pushed per audit.
    const bool submitting =
        queue_.client(conn.index).submitting.load(std::memory_order_seq_cst) != 0;
    if (now - since < kLostAfterNs || submitting || pushed[conn.session] >= share ||
        !queue.try_push(lane_of(conn, s, p), ref)) {
      still_lost.emplace(key, since);
      return;
    }
    ++pushed[conn.session];
    ++jobs_requeued_[p];
    queue_.wake_worker(p);
    GPUQ_LOG_WARN("pool %s: job %u/%u was SUBMITTED but in no ring for %" PRIu64
                  " ms (its ring cell was overwritten?): pushed it again",
                  config_.pools[p].name.c_str(), conn.index, s, (now - since) / 1'000'000);
  });
  // Keys of other pools stay; this pool's are replaced by what is still lost.
  std::erase_if(lost_since_, [p](const auto& e) { return std::get<0>(e.first) == p; });
  lost_since_.merge(still_lost);
}

}  // namespace gpuq::daemon
