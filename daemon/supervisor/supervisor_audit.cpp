// The supervisor's audit of what clients can overwrite in the queue segment (see
// docs/design/ring.md, "Repair", and docs/design/faults.md, "Bad input").
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
#include <algorithm>
#include <cinttypes>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "supervisor.hpp"
#include "supervisor_state.hpp"

namespace gpuq::daemon {

void Supervisor::audit(uint64_t now) {
  if (now < next_audit_ns_) return;
  next_audit_ns_ = now + kAuditNs;
  for (uint32_t p = 0; p < options_.config.pools.size(); ++p) {
    audit_ring(p);
    audit_submitted(p, now);
  }
}

void Supervisor::audit_ring(uint32_t p) {
  JobRing ring = queue_.ring(p);
  const RingAudit::Report r = ring_audits_[p].run(ring);
  const char* pool = options_.config.pools[p].name.c_str();
  if (r.head_restored || r.tail_restored) {
    ++hints_restored_[p];
    GPUQ_LOG_WARN("pool %s: ring %s position jumped to %" PRIu64
                  " (a client wrote over the queue segment?): moved it back to %" PRIu64,
                  pool, r.head_restored ? "head" : "tail",
                  r.head_restored ? r.head_from : r.tail_from,
                  r.head_restored ? r.head_to : r.tail_to);
  }
  for (const JobRing::Suspect& s : r.retired) {
    ++cells_retired_[p];
    GPUQ_LOG_WARN(
        "pool %s: ring cell %u (position %" PRIu64 ") held 0x%016" PRIx64
        ", which no producer or consumer writes (a client wrote over the queue segment?): "
        "retired it",
        pool, s.index, s.position, s.word);
  }
}

void Supervisor::audit_submitted(uint32_t p, uint64_t now) {
  JobRing ring = queue_.ring(p);
  const uint32_t share = queue_.pool(p).client_share;
  std::map<LostKey, uint64_t> still_lost;
  std::map<uint64_t, uint32_t> pushed;  // per client session, this audit
  for_each_job_in_no_ring(p, [&](Connection& conn, uint32_t s, uint32_t ref) {
    const LostKey key{p, conn.session, s, JobRef::unpack(ref).generation};
    auto seen = lost_since_.find(key);
    const uint64_t since = seen == lost_since_.end() ? now : seen->second;
    // A client inside submit may be about to push it; a client's own scribbling gets at most
    // its share pushed per audit.
    const bool submitting =
        queue_.client(conn.index).submitting.load(std::memory_order_seq_cst) != 0;
    if (now - since < kLostAfterNs || submitting || pushed[conn.session] >= share ||
        !ring.try_push(ref)) {
      still_lost.emplace(key, since);
      return;
    }
    ++pushed[conn.session];
    ++jobs_requeued_[p];
    queue_.wake_worker(p);
    GPUQ_LOG_WARN("pool %s: job %u/%u was SUBMITTED but in no ring for %" PRIu64
                  " ms (its ring cell was overwritten?): pushed it again",
                  options_.config.pools[p].name.c_str(), conn.index, s, (now - since) / 1'000'000);
  });
  // Keys of other pools stay; this pool's are replaced by what is still lost.
  std::erase_if(lost_since_, [p](const auto& e) { return std::get<0>(e.first) == p; });
  lost_since_.merge(still_lost);
}

}  // namespace gpuq::daemon
