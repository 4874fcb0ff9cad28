// Which pools cannot serve (docs/design/faults.md, "A pool that cannot serve"). A pool that has
// had no ready worker for pool_down_fail_ms is down: its queued jobs fail, and so do new ones,
// until one of its workers is ready again. The clock starts when the pool's last ready worker
// goes (it died, or was stopped), or, for a pool that has not had a ready worker yet, at its
// first failed start: a pool whose workers are all still in their first start is not down,
// however long that start takes; nor is a pool whose workers are merely busy (a worker running
// a job is ready).
//
// Bookkeeping only, with no clock of its own: the Supervisor tells it what each pool looks like
// and when, and acts on the changes it reports (the pool's `accepting` word, its jobs).
// Not thread-safe: the supervisor's loop owns it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gpuq::daemon {

class PoolOutage {
 public:
  // `fail_after_ns`: pool_down_fail_ms in nanoseconds; 0: no pool is ever down.
  PoolOutage(uint32_t pools, uint64_t fail_after_ns)
      : pools_(pools), fail_after_ns_(fail_after_ns) {}

  // pool_down_fail_ms changed by a config reload.
  void set_fail_after(uint64_t fail_after_ns) { fail_after_ns_ = fail_after_ns; }

  enum class Change { kNone, kDown, kUp };
  // Pool `p` at `now_ns` has `ready` ready workers (busy ones included), and `start_failed`
  // says whether one of its workers has failed to start since it was last ready (or since the
  // daemon started). kDown: the pool went down now; kUp: it was down and has a ready worker.
  Change observe(uint32_t p, uint32_t ready, bool start_failed, uint64_t now_ns);

  bool down(uint32_t p) const { return pools_[p].down; }
  // Whether pool `p`'s clock runs (no ready worker, and not in its first start), and since when.
  bool unserved(uint32_t p) const { return pools_[p].counting; }
  uint64_t unserved_since(uint32_t p) const { return pools_[p].since_ns; }
  // The earliest time a pool goes down unless a worker gets ready first; 0: none is due.
  uint64_t next_due() const;

  // Why pool `p` is down: the error its jobs fail with, as the Supervisor words it (the pool,
  // its last worker's exit). Kept while it is down; set_reason() returns whether it changed.
  bool set_reason(uint32_t p, std::string text);
  const std::string& reason(uint32_t p) const { return pools_[p].reason; }

 private:
  struct Pool {
    bool had_ready = false;  // a worker of it has been ready at some time
    bool counting = false;   // the clock runs: no ready worker since since_ns
    uint64_t since_ns = 0;
    bool down = false;
    std::string reason;
  };
  std::vector<Pool> pools_;
  uint64_t fail_after_ns_;
};

}  // namespace gpuq::daemon
