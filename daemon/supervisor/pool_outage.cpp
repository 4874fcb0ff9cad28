#include "pool_outage.hpp"

#include <utility>

namespace gpuq::daemon {

PoolOutage::Change PoolOutage::observe(uint32_t p, uint32_t ready, bool start_failed,
                                       uint64_t now_ns) {
  Pool& pool = pools_[p];
  if (ready > 0) {
    pool.had_ready = true;
    pool.counting = false;
    pool.since_ns = 0;
    if (!pool.down) return Change::kNone;
    pool.down = false;
    pool.reason.clear();
    return Change::kUp;
  }
  if (!pool.counting && (pool.had_ready || start_failed)) {
    pool.counting = true;
    pool.since_ns = now_ns;
  }
  if (!pool.counting || pool.down || fail_after_ns_ == 0 ||
      now_ns - pool.since_ns < fail_after_ns_) {
    return Change::kNone;
  }
  pool.down = true;
  return Change::kDown;
}

bool PoolOutage::set_reason(uint32_t p, std::string text) {
  if (pools_[p].reason == text) return false;
  pools_[p].reason = std::move(text);
  return true;
}

uint64_t PoolOutage::next_due() const {
  uint64_t due = 0;
  if (fail_after_ns_ == 0) return 0;
  for (const Pool& pool : pools_) {
    if (!pool.counting || pool.down) continue;
    const uint64_t at = pool.since_ns + fail_after_ns_;
    if (due == 0 || at < due) due = at;
  }
  return due;
}

}  // namespace gpuq::daemon
