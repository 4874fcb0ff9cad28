// The supervisor's records of its workers and clients, shared by its source files
// (supervisor.cpp, supervisor_audit.cpp). Private to the daemon.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <string>

#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "supervisor.hpp"

namespace gpuq::daemon {

struct Supervisor::WorkerProc {
  uint32_t id = 0;
  uint32_t pool = 0;
  int cpu = 0;
  pid_t pid = 0;
  UniqueFd control, out, err;
  std::string out_buf, err_buf;
  WorkerState state = WorkerState::kStarting;
  uint32_t start_failures = 0;  // deaths before ready, in a row
  uint32_t backoff_ms = 0;
  uint64_t ready_since_ns = 0;
  // What the worker's backend said about itself when it reported ready (a JSON object: a GPU
  // worker's device, compute capability, memory); shown under the worker in status.
  std::string backend_info;
  uint64_t respawn_at_ns = 0;
  uint64_t kill_at_ns = 0;
  // Control messages that did not fit in the worker's socket queue (a Unix datagram queue
  // holds net.unix.max_dgram_qlen, 10 by default): sent in order as it drains (EPOLLOUT).
  struct Outgoing {
    int type;
    std::string body;
    UniqueFd fd;  // a dup of the descriptor to pass, or none
  };
  std::deque<Outgoing> outbox;
  bool waiting_writable = false;  // EPOLLOUT registered on `control`
};

struct Supervisor::Connection {
  uint64_t id = 0;
  UniqueFd fd;
  UniqueFd pidfd;  // the peer process (pidfd_open), when the kernel has it
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool registered = false;
  uint32_t index = 0;
  uint64_t session = 0;
  std::string name;
  MemfdSegment segment;
  ClientSegmentGeometry geometry{};
  uint32_t slot_count = 0;
};

// A client index whose last entries may still sit in the rings: reusable once every pool's
// head has passed the tail it had when the client left.
struct Supervisor::RetiredClient {
  uint32_t index;
  uint64_t tails[kMaxPools];
};

}  // namespace gpuq::daemon
