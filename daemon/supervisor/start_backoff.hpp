// How long a worker that exited waits before it is started again (docs/design/faults.md,
// "Worker death"). One StartBackoff per worker; plain bookkeeping with no clock of its own (the
// caller passes the times), so a unit test can play any sequence of deaths.
//
//   - A worker that dies after it was ready is started again after the restart back-off:
//     restart_backoff_initial_ms, doubled at each death up to restart_backoff_max_ms, and back
//     to the initial delay once the worker has run ready for kStableRunNs.
//   - A worker that dies before it was ready (a failed start) likewise, for its first
//     max_start_failures - 1 failures in a row. From the max_start_failures-th on it is
//     `failed`, and tried again after the start back-off: start_backoff_initial_ms, doubled at
//     each further failure up to start_backoff_max_ms, for the daemon's life. Its first ready
//     report ends the run of failures.
//
// No gpuq fault is permanent: nothing here ever says "never again".
#pragma once

#include <cstdint>

#include "config.hpp"

namespace gpuq::daemon {

struct BackoffSettings {
  uint32_t restart_initial_ms = 100;
  uint32_t restart_max_ms = 10000;
  uint32_t start_initial_ms = 1000;
  uint32_t start_max_ms = 60000;
  uint32_t max_start_failures = 5;  // at least 1

  static BackoffSettings of(const Config& c) {
    return {c.restart_backoff_initial_ms, c.restart_backoff_max_ms, c.start_backoff_initial_ms,
            c.start_backoff_max_ms, c.max_start_failures};
  }
};

class StartBackoff {
 public:
  // A worker that has run ready this long has its restart back-off reset when it dies.
  static constexpr uint64_t kStableRunNs = 10'000'000'000ull;

  StartBackoff() : StartBackoff(BackoffSettings{}) {}
  explicit StartBackoff(const BackoffSettings& s)
      : s_(s), restart_delay_ms_(s.restart_initial_ms) {}

  // The worker reported ready at `now_ns`: its run of failed starts ends.
  void ready(uint64_t now_ns) {
    ready_since_ns_ = now_ns;
    start_failures_ = 0;
  }

  struct Next {
    uint32_t delay_ms = 0;  // wait this long before starting it again
    bool failed = false;    // its starts keep failing: max_start_failures or more in a row
  };
  // The worker exited at `now_ns`, after it was ready (`was_ready`) or before (a failed
  // start): when to start it again.
  Next exited(bool was_ready, uint64_t now_ns);

  uint32_t start_failures() const { return start_failures_; }  // failed starts in a row
  bool failing() const { return start_failures_ >= s_.max_start_failures; }

 private:
  BackoffSettings s_;
  uint32_t restart_delay_ms_;  // the restart back-off's next delay
  uint32_t start_failures_ = 0;
  uint64_t ready_since_ns_ = 0;
};

}  // namespace gpuq::daemon
