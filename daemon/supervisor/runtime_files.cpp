#include "runtime_files.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/runtime_dir.hpp"

namespace gpuq::daemon {

Result<void> RuntimeFiles::lock_dir() {
  const std::string& dir = dir_;
  const mode_t mode = config_.group_set ? 0750 : 0700;
  // EEXIST: it is checked below like one just made.
  if (auto r = GPUQ_POSIX_CALL(::mkdir, dir.c_str(), mode); !r && errno != EEXIST) {
    return Error(ErrorCode::kSystemError,
                 "cannot create runtime directory '" + dir + "': " + std::strerror(errno));
  }
  struct stat st {};
  if (!GPUQ_POSIX_CALL(::stat, dir.c_str(), &st) || !S_ISDIR(st.st_mode)) {
    return Error(ErrorCode::kInvalidArgument, "runtime directory '" + dir + "' is not a directory");
  }
  if (st.st_uid != geteuid()) {
    return Error(ErrorCode::kPermissionDenied,
                 "runtime directory '" + dir + "' belongs to uid " + std::to_string(st.st_uid) +
                     ", not to the daemon's uid " + std::to_string(geteuid()));
  }
  // An existing directory gets the mode it would have been created with (a warning if not:
  // it is ours, so this fails only on a read-only file system).
  if (auto r = GPUQ_POSIX_CALL(::chmod, dir.c_str(), mode); !r) {
    GPUQ_LOG_WARN("cannot set the runtime directory's mode: %s", r.error().to_string().c_str());
  }
  if (config_.group_set) {
    if (::chown(dir.c_str(), static_cast<uid_t>(-1), config_.group) != 0) {
      GPUQ_LOG_WARN("cannot give group %u the runtime directory: %s", config_.group,
                    std::strerror(errno));
    }
  }
  const std::string lock_path = dir + "/gpuqd.lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return GPUQ_SYSTEM_ERROR(("open " + lock_path).c_str());  // names the path
  lock_fd_.reset(fd);
  if (!GPUQ_POSIX_CALL(::flock, lock_fd_.get(), LOCK_EX | LOCK_NB)) {
    return Error(ErrorCode::kSystemError,
                 "another gpuqd is already serving runtime directory '" + dir + "'");
  }
  // A killed predecessor may have left its queue segment behind: remove it.
  std::ifstream old(dir + "/" + kSegmentNameFile);
  std::string old_name;
  if (old && std::getline(old, old_name) && old_name.rfind("gpuq-", 0) == 0) {
    if (QueueSegment::remove(old_name)) {
      GPUQ_LOG_INFO("removed queue segment %s left by an earlier daemon", old_name.c_str());
    }
  }
  return {};
}

Result<void> RuntimeFiles::create_queue(uint64_t epoch, const PoolPlan& plan) {
  const Config& c = config_;
  // The pools configured, then the free records a reload may add pools in, each with
  // added_pool_workers worker entries and a ring for them (docs/design/live_changes.md).
  const auto configured = static_cast<uint32_t>(c.pools.size());
  const uint32_t records = std::max(c.max_pools, configured);
  uint32_t worker_count = 0;  // worker entries: active workers, spares, surge seats
  for (const auto& p : c.pools) worker_count += p.entries();
  worker_count += (records - configured) * c.added_pool_workers;
  uint64_t off = sizeof(QueueHeader);
  const uint64_t pools_off = off;
  off += uint64_t{records} * sizeof(PoolShm);
  const uint64_t workers_off = off;
  off += uint64_t{worker_count} * sizeof(WorkerShm);
  const uint64_t clients_off = off;
  off += uint64_t{c.max_clients} * sizeof(ClientShm);
  std::vector<uint64_t> queue_offsets;
  std::vector<uint32_t> capacities;
  for (uint32_t p = 0; p < records; ++p) {
    off = (off + 63) & ~uint64_t{63};
    queue_offsets.push_back(off);
    capacities.push_back(p < configured ? ring_capacity(c, c.pools[p])
                                        : c.queue_factor * c.added_pool_workers);
    off += PoolQueue::bytes_for(capacities.back(), PoolQueue::client_lanes_for(capacities.back()));
  }
  const uint64_t total = (off + 4095) & ~uint64_t{4095};

  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(epoch));
  segment_name_ = "gpuq-" + std::to_string(geteuid()) + "-" + hex;
  const unsigned mode = c.group_set ? 0660 : 0600;
  auto seg = QueueSegment::create(segment_name_, total, mode);
  if (!seg) return seg.error();
  segment_ = std::move(*seg);
  if (c.group_set) {
    std::string path = "/dev/shm/" + segment_name_;
    if (::chown(path.c_str(), static_cast<uid_t>(-1), c.group) != 0) {
      GPUQ_LOG_WARN("cannot give group %u the queue segment: %s", c.group, std::strerror(errno));
    }
  }
  queue_ = QueueView(segment_.address());
  QueueHeader& h = queue_.header();
  h.magic = kQueueMagic;
  h.layout_version = kLayoutVersion;
  h.header_bytes = sizeof(QueueHeader);
  h.epoch = epoch;
  h.segment_bytes = total;
  h.start_unix_ns = static_cast<uint64_t>(time(nullptr)) * 1000000000ull;
  h.pool_count = records;
  h.worker_count = worker_count;
  h.max_clients = c.max_clients;
  h.pools_offset = pools_off;
  h.workers_offset = workers_off;
  h.clients_offset = clients_off;
  queue_ = QueueView(segment_.address());  // takes the array offsets just written
  uint32_t first = 0;
  for (uint32_t p = 0; p < records; ++p) {
    PoolShm& ps = queue_.pool(p);
    const bool free = p >= configured;
    const uint32_t entries = free ? c.added_pool_workers : c.pools[p].entries();
    if (!free) std::strncpy(ps.name, c.pools[p].name.c_str(), kPoolNameBytes - 1);
    ps.id = p;
    ps.kind = free ? 0 : static_cast<uint32_t>(c.pools[p].kind);
    ps.capacity = capacities[p];
    ps.worker_count = entries;  // its spares and surge seats too: their WorkerShm follow
    ps.first_worker = first;
    ps.client_share =
        std::max<uint32_t>(1, static_cast<uint32_t>(ps.capacity * c.client_queue_share));
    ps.queue_offset = queue_offsets[p];
    ps.client_lanes = PoolQueue::client_lanes_for(ps.capacity);
    // An unavailable pool never accepts a job: nothing would ever run it. Clients learn why
    // from Welcome and do not even try (a client that pushes anyway gets ShuttingDown). Nor
    // does a free record until a reload adds a pool in it.
    ps.accepting.store(!free && plan.pools[p].available ? kPoolAccepting : kPoolNotAccepting,
                       std::memory_order_relaxed);
    PoolQueue::create(queue_.base() + queue_offsets[p], ps.capacity, ps.client_lanes);
    for (uint32_t i = 0; i < entries; ++i) {
      WorkerShm& ws = queue_.worker(first + i);
      ws.id = first + i;
      ws.pool_id = p;
      // A worker pinned to several CPUs (a GPU's local cores) has no CPU of its own to be woken
      // on first (QueueView::wake_worker).
      const std::vector<int>& cpus = plan.placements[first + i].cpus;
      ws.cpu = cpus.size() == 1 ? cpus.front() : -1;
    }
    first += entries;
  }
  // From here on this process indexes the segment with this copy of the layout only; clients
  // can write the segment's own copy (QueueLayout).
  queue_ = QueueView(segment_.address());
  h.daemon_state.store(static_cast<uint32_t>(DaemonState::kStarting), std::memory_order_release);

  // For a successor after a crash (lock_dir removes what it names): without it a killed
  // daemon's segment would stay in /dev/shm until reboot, so a failure to write it is one.
  const std::string name_file = dir_ + "/" + kSegmentNameFile;
  std::ofstream f(name_file, std::ios::trunc);
  f << segment_name_ << "\n";
  f.close();
  if (!f) {
    return Error(ErrorCode::kSystemError, "cannot write '" + name_file + "'");
  }
  return {};
}

Result<void> RuntimeFiles::create_socket() {
  socket_path_ = dir_ + "/" + kSocketName;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path_.size() >= sizeof addr.sun_path) {
    return Error(ErrorCode::kInvalidArgument, "socket path '" + socket_path_ + "' is longer than " +
                                                  std::to_string(sizeof addr.sun_path - 1) +
                                                  " bytes; use a shorter runtime dir");
  }
  std::memcpy(addr.sun_path, socket_path_.c_str(), socket_path_.size() + 1);
  auto fd = GPUQ_POSIX_CALL(::socket, AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (!fd) return fd.error();
  listen_fd_.reset(static_cast<int>(*fd));
  (void)::unlink(socket_path_.c_str());  // the lock says no live daemon owns it; may be absent
  // Bind under a tight umask so the socket is never briefly open to others.
  const mode_t old_mask = ::umask(0177);
  auto bound =
      GPUQ_POSIX_CALL(::bind, listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::umask(old_mask);                                                       // cannot fail
  if (!bound) return GPUQ_SYSTEM_ERROR(("bind " + socket_path_).c_str());  // names the path
  if (config_.group_set) {
    if (auto r = GPUQ_POSIX_CALL(::chmod, socket_path_.c_str(), 0660); !r) {
      GPUQ_LOG_WARN("cannot open the socket to the group: %s", r.error().to_string().c_str());
    }
    if (::chown(socket_path_.c_str(), static_cast<uid_t>(-1), config_.group) != 0) {
      GPUQ_LOG_WARN("cannot give group %u the socket: %s", config_.group, std::strerror(errno));
    }
  }
  if (auto r = GPUQ_POSIX_CALL(::listen, listen_fd_.get(), 128); !r) return r.error();
  return {};
}

void RuntimeFiles::close_socket() {
  if (!listen_fd_.valid()) return;
  listen_fd_.reset();
  (void)::unlink(socket_path_.c_str());  // best effort: the lock, not the path, says who serves
}

void RuntimeFiles::remove() {
  if (!segment_name_.empty()) {
    queue_.header().daemon_state.store(static_cast<uint32_t>(DaemonState::kStopped),
                                       std::memory_order_release);
    QueueSegment::remove(segment_name_);
    (void)::unlink((dir_ + "/" + kSegmentNameFile).c_str());  // gone already: fine
    segment_name_.clear();
  }
  close_socket();
}

}  // namespace gpuq::daemon
