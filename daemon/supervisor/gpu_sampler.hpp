// Per-GPU utilisation and memory for metrics, read by NVML in a child process
// (`gpuqd --sample-gpus MS`, gpu_discovery.hpp): the supervisor never maps libnvidia-ml, and a
// wedged driver that hangs NVML holds up only the child. The child writes one line per
// interval on a pipe the supervisor's loop reads; a child that dies is started again when
// metrics are next asked for, at most once every kRestartNs, and one silent that long is
// killed first.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "event_loop.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

class GpuSampler {
 public:
  static constexpr uint64_t kRestartNs = 10'000'000'000;

  // `self_exe`: gpuqd's own executable ("/proc/self/exe": the running binary even after a
  // package upgrade replaced the file); `gpus`: what discovery found (UUID -> index);
  // `tag`: what the loop reports the pipe with.
  GpuSampler(std::string self_exe, std::string nvml_library, std::vector<GpuInfo> gpus,
             uint32_t interval_ms, EventLoop& loop, uint64_t tag)
      : self_exe_(std::move(self_exe)),
        nvml_library_(std::move(nvml_library)),
        gpus_(std::move(gpus)),
        interval_ms_(interval_ms),
        loop_(loop),
        tag_(tag) {}
  ~GpuSampler() { stop(); }
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // Starts the child. Errors: the pipe, fork or epoll registration that failed.
  Result<void> start(uint64_t now);
  // The pipe is readable: takes the lines that came, keeps the last good one.
  void on_readable(uint64_t now);
  // A child exited: true if it was the sampler (then reaped here).
  bool on_exit(pid_t pid, int status);
  // The latest samples, with each GPU's index; empty when the last is older than three
  // intervals. Starts a dead child again when its back-off has passed.
  std::vector<GpuSample> latest(uint64_t now);
  // Kills the child (the daemon's exit).
  void stop();

 private:
  void close_pipe();

  std::string self_exe_;
  std::string nvml_library_;  // passed to the child: NVML's, or a stand-in in tests
  std::vector<GpuInfo> gpus_;
  uint32_t interval_ms_;
  EventLoop& loop_;
  uint64_t tag_;
  pid_t pid_ = 0;
  UniqueFd pipe_;
  std::string buffer_;
  std::vector<GpuSample> samples_;
  uint64_t sampled_ns_ = 0;  // when samples_ came
  uint64_t started_ns_ = 0;  // when the current (or last) child was started
  bool complained_ = false;  // a bad line was logged once
};

}  // namespace gpuq::daemon
