#include "start_backoff.hpp"

#include <algorithm>

namespace gpuq::daemon {

StartBackoff::Next StartBackoff::exited(bool was_ready, uint64_t now_ns) {
  if (was_ready) {
    if (now_ns - ready_since_ns_ > kStableRunNs) restart_delay_ms_ = s_.restart_initial_ms;
  } else {
    ++start_failures_;
  }
  if (failing()) {
    // The start back-off: the initial delay at the max_start_failures-th failure, doubled at
    // each one after, up to the max (the shift stops growing long before it could overflow).
    const uint32_t doublings = std::min<uint32_t>(start_failures_ - s_.max_start_failures, 32);
    const uint64_t delay = uint64_t{s_.start_initial_ms} << doublings;
    return {static_cast<uint32_t>(std::min<uint64_t>(delay, s_.start_max_ms)), true};
  }
  const uint32_t delay = restart_delay_ms_;
  restart_delay_ms_ =
      static_cast<uint32_t>(std::min<uint64_t>(uint64_t{restart_delay_ms_} * 2, s_.restart_max_ms));
  return {delay, false};
}

}  // namespace gpuq::daemon
