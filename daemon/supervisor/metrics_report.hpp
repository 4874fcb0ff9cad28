// The daemon's metrics in the Prometheus text exposition format (docs/metrics.md lists every
// metric): read from the same components as the status document, and from each worker's
// metrics page (job_metrics.hpp), summed by pool and op. Reads; changes nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_discovery.hpp"
#include "gpuq/common/clock.hpp"
#include "status_report.hpp"

namespace gpuq::daemon {

class MetricsReport {
 public:
  struct Sources {
    StatusReport::Sources status;
    const StatusReport* report;
    const StampScale* stamps;  // job stamp ticks to nanoseconds
    uint64_t start_unix_ns = 0;
  };
  explicit MetricsReport(Sources s) : s_(std::move(s)) {}

  // The exposition text. `gpus`: the latest NVML samples (empty: none to show).
  std::string text(bool draining, const std::vector<GpuSample>& gpus) const;

 private:
  Sources s_;
};

// A label value as the text format wants it: backslash, double quote and newline escaped.
std::string escape_label_value(std::string_view value);

}  // namespace gpuq::daemon
