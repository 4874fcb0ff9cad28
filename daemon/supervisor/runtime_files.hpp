// What gpuqd creates for its clients and workers to find, and removes when it stops: the
// runtime directory (with the lock that makes one daemon per directory), the queue segment in
// /dev/shm (its header, pools, worker and client records and rings; its name in the directory
// for a successor to clean up after a crash), and the control socket.
#pragma once

#include <cstdint>
#include <string>

#include "config.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"
#include "pool_plan.hpp"

namespace gpuq::daemon {

class RuntimeFiles {
 public:
  RuntimeFiles(const Config& config, std::string runtime_dir)
      : config_(config), dir_(std::move(runtime_dir)) {}
  ~RuntimeFiles() { remove(); }
  RuntimeFiles(const RuntimeFiles&) = delete;
  RuntimeFiles& operator=(const RuntimeFiles&) = delete;

  // Creates the directory (0700, or 0750 with a group), takes its lock and removes a queue
  // segment a killed predecessor left. Errors: the directory is not ours or not a directory;
  // another gpuqd holds the lock (SystemError naming the directory).
  Result<void> lock_dir();
  // Creates and lays out the queue segment for the pools as planned (`epoch` names it), in
  // DaemonState::kStarting. Errors: the segment's creation.
  Result<void> create_queue(uint64_t epoch, const PoolPlan& plan);
  // Binds and listens on the control socket. Errors: a path too long, bind, listen.
  Result<void> create_socket();
  // Closes the listening socket and removes its path (a drain: no new clients).
  void close_socket();
  // Marks the daemon stopped in the segment, removes the segment, its name file and the
  // socket. Idempotent.
  void remove();

  QueueView& queue() { return queue_; }
  const QueueView& queue() const { return queue_; }
  const std::string& segment_name() const { return segment_name_; }
  const std::string& socket_path() const { return socket_path_; }
  int listen_fd() const { return listen_fd_.get(); }

 private:
  const Config& config_;
  std::string dir_;
  UniqueFd lock_fd_, listen_fd_;
  std::string socket_path_;
  std::string segment_name_;
  QueueSegment segment_;
  QueueView queue_;
};

}  // namespace gpuq::daemon
