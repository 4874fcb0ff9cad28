#include "batch_gatherer.hpp"

#include <algorithm>

namespace gpuq::daemon {

void BatchGatherer::begin(uint32_t op_id, BatchSettings settings, uint64_t rows,
                          uint64_t now_ns) noexcept {
  op_id_ = op_id;
  settings_ = settings;
  rows_ = rows;
  jobs_ = 1;
  expected_ = expected(op_id);
  started_ns_ = now_ns;
  last_taken_ns_ = now_ns;
  quiet_ns_ = quiet_override_ns_ != 0 ? quiet_override_ns_ : quiet_ns_for(settings);
  deadline_ns_ = now_ns + uint64_t{settings.max_queue_delay_us} * 1000;
}

uint32_t BatchGatherer::expected(uint32_t op_id) const noexcept {
  auto it = std::find_if(last_jobs_.begin(), last_jobs_.end(),
                         [&](const Recent& e) { return e.op_id == op_id; });
  if (it == last_jobs_.end()) return 1;
  const uint32_t n = std::min(it->count, kRecentBatches);
  return *std::min_element(it->jobs, it->jobs + n);
}

void BatchGatherer::finish() noexcept {
  auto it = std::find_if(last_jobs_.begin(), last_jobs_.end(),
                         [&](const Recent& e) { return e.op_id == op_id_; });
  if (it == last_jobs_.end()) {
    last_jobs_.push_back(Recent{op_id_, {}, 0});
    it = last_jobs_.end() - 1;
  }
  it->jobs[it->count++ % kRecentBatches] = jobs_;
}

}  // namespace gpuq::daemon
