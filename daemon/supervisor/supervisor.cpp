#include "supervisor.hpp"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <deque>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "client_messages.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/cpu_list.hpp"
#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/runtime_dir.hpp"
#include "ops.hpp"
#include "plugins.hpp"
#include "supervisor_state.hpp"

extern char** environ;

namespace gpuq::daemon {
namespace {

using nlohmann::json;

// epoll tags: {kind:8 | id:56}.
enum class Tag : uint64_t {
  kListen = 1,
  kSignal,
  kTimer,
  kConnection,
  kClientExit,  // a client's pidfd: the process has exited
  kWorkerControl,
  kWorkerOut,
  kWatchdog,  // the watchdog keep-alive timer (supervisor_service.cpp)
  kTestHook   // SIGUSR2 with GPUQ_TEST_HOOKS=1 (supervisor_service.cpp)
};
uint64_t make_tag(Tag t, uint64_t id) {
  return (static_cast<uint64_t>(t) << 56) | id;
}
Tag tag_kind(uint64_t tag) {
  return static_cast<Tag>(tag >> 56);
}
uint64_t tag_id(uint64_t tag) {
  return tag & ((1ull << 56) - 1);
}

constexpr uint64_t kTickNs = 20'000'000;              // timer period: 20 ms
constexpr uint64_t kStableRunNs = 10'000'000'000ull;  // ready this long: back-off resets
constexpr uint64_t kWorkerExitGraceNs = 5'000'000'000ull;
// NVML's first initialisation without persistence mode takes seconds per GPU; a driver that
// takes longer than this is wedged, and the gpu pools are unavailable rather than the daemon
// stuck before READY=1 (systemd's TimeoutStartSec= is 120 s).
constexpr uint32_t kGpuDiscoveryTimeoutMs = 30'000;
constexpr uint32_t kPluginListTimeoutMs = 30'000;

json gpu_json(const GpuInfo& g) {
  return {{"index", g.index},
          {"uuid", g.uuid},
          {"pci_bus_id", g.pci_bus_id},
          {"name", g.name},
          {"memory_bytes", g.memory_bytes},
          {"local_cpus", g.local_cpus},
          {"numa_node", g.numa_node}};
}

const char* worker_state_name(WorkerState s) {
  switch (s) {
    case WorkerState::kStarting:
      return "starting";
    case WorkerState::kReady:
      return "ready";
    case WorkerState::kRestarting:
      return "restarting";
    case WorkerState::kFailed:
      return "failed";
    case WorkerState::kStopped:
      return "stopped";
  }
  return "unknown";
}

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "ended (status " + std::to_string(status) + ")";
}

void set_nonblocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

}  // namespace

Supervisor::Supervisor(SupervisorOptions options) : options_(std::move(options)) {}

Supervisor::~Supervisor() {
  cleanup();
}

// ---- Start-up ---------------------------------------------------------------------------------

Result<void> Supervisor::start() {
  start_ns_ = monotonic_ns();
  if (getrandom(&epoch_, sizeof epoch_, 0) != sizeof epoch_) epoch_ = start_ns_ ^ getpid();
  const Config& cfg = options_.config;
  if ((!cfg.allowed_uids.empty() || !cfg.allowed_gids.empty()) && !cfg.group_set) {
    GPUQ_LOG_WARN(
        "allowed_users/allowed_groups admit other users, but \"group\" is not set: the "
        "socket and segments are mode 0600, so only root and the daemon's own user can "
        "reach them");
  }
  // Job stamps: the TSC where the kernel keeps time with it (clock.hpp, "Job stamps").
  const std::string no_tsc = tsc_unusable_reason();
  if (cfg.job_clock == StampClock::kTsc && !no_tsc.empty()) {
    return Error(ErrorCode::kInvalidArgument, "job_clock: \"tsc\" cannot be used here: " + no_tsc);
  }
  job_clock_ = cfg.job_clock.value_or(no_tsc.empty() ? StampClock::kTsc : StampClock::kMonotonic);
  GPUQ_LOG_INFO("job stamps: %s%s%s", stamp_clock_name(job_clock_),
                !cfg.job_clock && !no_tsc.empty() ? ": " : "",
                !cfg.job_clock && !no_tsc.empty() ? no_tsc.c_str() : "");
  // Before anything else: discovery may fork a child, which is only safe while this process
  // has a single thread and nothing to leak, and the worker counts it decides size the segment.
  if (auto r = plan_pools(); !r) return r;
  if (auto r = learn_plugin_ops(); !r) return r;
  raise_descriptor_limit();
  if (auto r = create_runtime_dir(); !r) return r;
  if (auto r = create_queue_segment(); !r) return r;
  if (auto r = create_socket(); !r) return r;

  sigset_t mask;
  sigemptyset(&mask);
  for (int s : {SIGTERM, SIGINT, SIGCHLD, SIGHUP}) sigaddset(&mask, s);
  sigprocmask(SIG_BLOCK, &mask, nullptr);
  signal(SIGPIPE, SIG_IGN);
  auto sfd = GPUQ_POSIX_CALL(::signalfd, -1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
  if (!sfd) return sfd.error();
  signal_fd_.reset(static_cast<int>(*sfd));
  auto tfd = GPUQ_POSIX_CALL(::timerfd_create, CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (!tfd) return tfd.error();
  timer_fd_.reset(static_cast<int>(*tfd));
  auto efd = GPUQ_POSIX_CALL(::epoll_create1, EPOLL_CLOEXEC);
  if (!efd) return efd.error();
  epoll_fd_.reset(static_cast<int>(*efd));
  epoll_add(listen_fd_.get(), make_tag(Tag::kListen, 0), EPOLLIN);
  epoll_add(signal_fd_.get(), make_tag(Tag::kSignal, 0), EPOLLIN);
  epoll_add(timer_fd_.get(), make_tag(Tag::kTimer, 0), EPOLLIN);
  if (auto r = start_service_link(); !r) return r;
  if (watchdog_fd_.valid()) epoll_add(watchdog_fd_.get(), make_tag(Tag::kWatchdog, 0), EPOLLIN);
  if (test_hook_fd_.valid()) {
    epoll_add(test_hook_fd_.get(), make_tag(Tag::kTestHook, 0), EPOLLIN);
  }

  // Workers: pool by pool, placed as plan_pools() decided.
  const Config& c = options_.config;
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    for (uint32_t i = 0; i < c.pools[p].workers; ++i) {
      auto w = std::make_unique<WorkerProc>();
      w->id = static_cast<uint32_t>(workers_.size());
      w->pool = p;
      const WorkerPlacement& at = placements_[w->id];
      w->cpu = at.cpus.size() == 1 ? at.cpus.front() : -1;
      w->backoff_ms = c.restart_backoff_initial_ms;
      workers_.push_back(std::move(w));
    }
  }
  for (auto& w : workers_) {
    if (auto r = spawn_worker(*w); !r) return r;
  }
  queue_.header().daemon_state.store(static_cast<uint32_t>(DaemonState::kRunning),
                                     std::memory_order_release);
  std::string pools;
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    pools +=
        (p ? ", " : "") + c.pools[p].name +
        (pool_state_[p].available ? " (" + std::to_string(c.pools[p].workers) + " workers, ring " +
                                        std::to_string(queue_.pool(p).capacity) + ")"
                                  : std::string(" (unavailable)"));
  }
  GPUQ_LOG_INFO("gpuqd %s serving %s; pools: %s", GPUQ_VERSION, socket_path_.c_str(),
                pools.c_str());
  return {};
}

// The plug-ins' ops, from a child per plug-in (gpuq-worker --list-plugin-ops): the supervisor
// never dlopens a plug-in (it may link CUDA). Ids follow config order, as in the workers.
Result<void> Supervisor::learn_plugin_ops() {
  for (const std::string& path : options_.config.plugins) {
    auto ops = list_plugin_ops_isolated(options_.worker_path, path, kPluginListTimeoutMs);
    if (!ops) return ops.error();
    for (const PluginOp& op : *ops) {
      GPUQ_LOG_INFO("plug-in %s: op %s (%s%s%s)", path.c_str(), op.name.c_str(),
                    op.has_cpu ? "cpu" : "", op.has_cpu && op.has_gpu ? ", " : "",
                    op.has_gpu ? "gpu" : "");
    }
    if (auto r = add_plugin_ops(std::move(*ops)); !r) return r;
  }
  return {};
}

Result<void> Supervisor::plan_pools() {
  Config& c = options_.config;
  pool_state_.assign(c.pools.size(), PoolState{});
  placements_.clear();
  const bool want_gpus = std::any_of(c.pools.begin(), c.pools.end(),
                                     [](const PoolConfig& p) { return p.kind == PoolKind::kGpu; });
  if (want_gpus) {
    const GpuDiscoveryOptions how =
        gpu_discovery_options_from_environment(options_.test_hooks.enabled);
    if (how.root != "/") {
      fake_gpus_ = true;
      GPUQ_LOG_WARN(
          "test hooks: GPUQ_TEST_GPU_ROOT: GPUs are read from %s, NVML is not tried, and gpu "
          "pools run gpuq-worker",
          how.root.c_str());
    }
    discovery_ = discover_gpus_isolated(how, kGpuDiscoveryTimeoutMs);
    discovery_ran_ = true;
    for (const GpuInfo& g : discovery_.gpus) {
      GPUQ_LOG_INFO("GPU %u (%s): %s, %s, %llu MiB, cpus %s, numa node %d", g.index,
                    discovery_.source.c_str(), g.uuid.empty() ? "(no UUID)" : g.uuid.c_str(),
                    g.pci_bus_id.c_str(), static_cast<unsigned long long>(g.memory_bytes >> 20),
                    g.local_cpus.empty() ? "unknown" : cpu_list_text(g.local_cpus).c_str(),
                    g.numa_node);
    }
  }
  const std::vector<int> allowed = allowed_cpus();
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    PoolConfig& pool = c.pools[p];
    if (pool.kind == PoolKind::kCpu) {
      for (uint32_t i = 0; i < pool.workers; ++i) {
        placements_.push_back({{pool.cpus[i % pool.cpus.size()]}, "-1", -1});
      }
      continue;
    }
    Result<std::vector<uint32_t>> chosen = select_gpus(pool, discovery_);
    if (chosen && options_.gpu_worker_path.empty() && !fake_gpus_) {
      chosen = Error(ErrorCode::kNoDevice, "this gpuq was built without CUDA (no gpuq-gpu-worker)");
    }
    if (!chosen) {
      // Unavailable, not fatal: the other pools serve, and jobs for this one fail at once with
      // NoDevice or go to the fallback pool (docs/design/gpu_discovery.md).
      PoolState& st = pool_state_[p];
      st.available = false;
      st.reason = chosen.error().message();
      pool.workers = 0;
      GPUQ_LOG_WARN("pool %s is unavailable: %s; %s", pool.name.c_str(), st.reason.c_str(),
                    pool.fallback_pool >= 0
                        ? ("its jobs go to pool " + c.pools[pool.fallback_pool].name).c_str()
                        : "its jobs fail with NoDevice");
      continue;
    }
    pool_state_[p].gpus = *chosen;
    for (uint32_t g : *chosen) {
      const GpuInfo& gpu = discovery_.gpus[g];
      // The GPU's local CPUs that this daemon may use; all of its CPUs when the two sets do not
      // meet (a cgroup or taskset that keeps it off the GPU's node) or locality is unknown.
      std::vector<int> cpus;
      std::set_intersection(gpu.local_cpus.begin(), gpu.local_cpus.end(), allowed.begin(),
                            allowed.end(), std::back_inserter(cpus));
      if (cpus.empty()) {
        if (!gpu.local_cpus.empty()) {
          GPUQ_LOG_WARN(
              "GPU %u: none of its local CPUs (%s) is available to the daemon; its "
              "workers run on every available CPU",
              gpu.index, cpu_list_text(gpu.local_cpus).c_str());
        }
        cpus = allowed;
      }
      // Without a UUID (a driver that hides it from this user) the index in PCI bus order
      // names the same GPU, given CUDA_DEVICE_ORDER=PCI_BUS_ID.
      const std::string visible = gpu.uuid.empty() ? std::to_string(gpu.index) : gpu.uuid;
      for (uint32_t k = 0; k < pool.workers_per_gpu; ++k) {
        placements_.push_back({cpus, visible, static_cast<int>(g)});
      }
    }
    pool.workers = static_cast<uint32_t>(chosen->size()) * pool.workers_per_gpu;
  }
  if (auto r = check_pool_sizes(c); !r) {
    return Error(r.error().code(), r.error().message() + " (with the GPUs found)");
  }
  return {};
}

Result<void> Supervisor::create_runtime_dir() {
  const std::string& dir = options_.runtime_dir;
  const mode_t mode = options_.config.group_set ? 0750 : 0700;
  if (::mkdir(dir.c_str(), mode) != 0 && errno != EEXIST) {
    return Error(ErrorCode::kSystemError,
                 "cannot create runtime directory '" + dir + "': " + std::strerror(errno));
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Error(ErrorCode::kInvalidArgument, "runtime directory '" + dir + "' is not a directory");
  }
  if (st.st_uid != geteuid()) {
    return Error(ErrorCode::kPermissionDenied,
                 "runtime directory '" + dir + "' belongs to uid " + std::to_string(st.st_uid) +
                     ", not to the daemon's uid " + std::to_string(geteuid()));
  }
  ::chmod(dir.c_str(), mode);
  if (options_.config.group_set) {
    if (::chown(dir.c_str(), static_cast<uid_t>(-1), options_.config.group) != 0) {
      GPUQ_LOG_WARN("cannot give group %u the runtime directory: %s", options_.config.group,
                    std::strerror(errno));
    }
  }
  const std::string lock_path = dir + "/gpuqd.lock";
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return GPUQ_SYSTEM_ERROR(("open " + lock_path).c_str());
  lock_fd_.reset(fd);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
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

Result<void> Supervisor::create_queue_segment() {
  const Config& c = options_.config;
  uint32_t worker_count = 0;
  for (const auto& p : c.pools) worker_count += p.workers;
  uint64_t off = sizeof(QueueHeader);
  const uint64_t pools_off = off;
  off += c.pools.size() * sizeof(PoolShm);
  const uint64_t workers_off = off;
  off += uint64_t{worker_count} * sizeof(WorkerShm);
  const uint64_t clients_off = off;
  off += uint64_t{c.max_clients} * sizeof(ClientShm);
  std::vector<uint64_t> ring_offsets;
  for (const auto& p : c.pools) {
    off = (off + 63) & ~uint64_t{63};
    ring_offsets.push_back(off);
    off += JobRing::bytes_for(ring_capacity(c, p));
  }
  const uint64_t total = (off + 4095) & ~uint64_t{4095};

  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(epoch_));
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
  h.epoch = epoch_;
  h.segment_bytes = total;
  h.start_unix_ns = static_cast<uint64_t>(time(nullptr)) * 1000000000ull;
  h.pool_count = static_cast<uint32_t>(c.pools.size());
  h.worker_count = worker_count;
  h.max_clients = c.max_clients;
  h.pools_offset = pools_off;
  h.workers_offset = workers_off;
  h.clients_offset = clients_off;
  queue_ = QueueView(segment_.address());  // takes the array offsets just written
  uint32_t first = 0;
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    PoolShm& ps = queue_.pool(p);
    std::strncpy(ps.name, c.pools[p].name.c_str(), kPoolNameBytes - 1);
    ps.id = p;
    ps.kind = static_cast<uint32_t>(c.pools[p].kind);
    ps.capacity = ring_capacity(c, c.pools[p]);
    ps.worker_count = c.pools[p].workers;
    ps.first_worker = first;
    ps.client_share =
        std::max<uint32_t>(1, static_cast<uint32_t>(ps.capacity * c.client_queue_share));
    ps.ring_offset = ring_offsets[p];
    // An unavailable pool never accepts a job: nothing would ever run it. Clients learn why
    // from Welcome and do not even try (a client that pushes anyway gets ShuttingDown).
    ps.accepting.store(pool_state_[p].available ? 1 : 0, std::memory_order_relaxed);
    JobRing::create(queue_.base() + ring_offsets[p], ps.capacity);
    for (uint32_t i = 0; i < c.pools[p].workers; ++i) {
      WorkerShm& ws = queue_.worker(first + i);
      ws.id = first + i;
      ws.pool_id = p;
      // A worker pinned to several CPUs (a GPU's local cores) has no CPU of its own to be woken
      // on first (QueueView::wake_worker).
      const std::vector<int>& cpus = placements_[first + i].cpus;
      ws.cpu = cpus.size() == 1 ? cpus.front() : -1;
    }
    first += c.pools[p].workers;
  }
  // From here on this process indexes the segment with this copy of the layout only; clients
  // can write the segment's own copy (QueueLayout).
  queue_ = QueueView(segment_.address());
  index_in_use_.assign(c.max_clients, false);
  h.daemon_state.store(static_cast<uint32_t>(DaemonState::kStarting), std::memory_order_release);

  std::ofstream f(options_.runtime_dir + "/" + kSegmentNameFile, std::ios::trunc);
  f << segment_name_ << "\n";
  return {};
}

Result<void> Supervisor::create_socket() {
  socket_path_ = options_.runtime_dir + "/" + kSocketName;
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
  ::unlink(socket_path_.c_str());  // the lock says no live daemon owns it
  // Bind under a tight umask so the socket is never briefly open to others.
  const mode_t old_mask = ::umask(0177);
  int rc = ::bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::umask(old_mask);
  if (rc != 0) return GPUQ_SYSTEM_ERROR(("bind " + socket_path_).c_str());
  if (options_.config.group_set) {
    ::chmod(socket_path_.c_str(), 0660);
    if (::chown(socket_path_.c_str(), static_cast<uid_t>(-1), options_.config.group) != 0) {
      GPUQ_LOG_WARN("cannot give group %u the socket: %s", options_.config.group,
                    std::strerror(errno));
    }
  }
  if (auto r = GPUQ_POSIX_CALL(::listen, listen_fd_.get(), 128); !r) return r.error();
  return {};
}

void Supervisor::epoll_add(int fd, uint64_t tag, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev);
}

// ---- Workers ----------------------------------------------------------------------------------

Result<void> Supervisor::spawn_worker(WorkerProc& w) {
  const Config& c = options_.config;
  // A client may have scribbled over the layout fields; the new worker reads them at start.
  queue_.restore_shared_layout();
  int sv[2], out[2], err[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return GPUQ_SYSTEM_ERROR("socketpair");
  }
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    return GPUQ_SYSTEM_ERROR("pipe2");
  }
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  const PoolConfig& pool = c.pools[w.pool];
  const bool gpu_worker = pool.kind == PoolKind::kGpu && !fake_gpus_;
  std::vector<std::string> args = {gpu_worker ? options_.gpu_worker_path : options_.worker_path,
                                   "--queue-segment",
                                   segment_name_,
                                   "--worker-id",
                                   std::to_string(w.id),
                                   "--pool-id",
                                   std::to_string(w.pool),
                                   "--supervisor-pid",
                                   std::to_string(getpid()),
                                   "--spin-us",
                                   std::to_string(c.worker_spin_us),
                                   "--job-clock",
                                   stamp_clock_name(job_clock_)};
  for (const std::string& plugin : c.plugins) args.insert(args.end(), {"--plugin", plugin});
  if (gpu_worker && pool.memory_limit_bytes > 0) {
    args.insert(args.end(), {"--memory-limit-bytes", std::to_string(pool.memory_limit_bytes)});
  } else if (gpu_worker) {
    char fraction[32];
    std::snprintf(fraction, sizeof fraction, "%.17g", pool.memory_limit_fraction);
    args.insert(args.end(), {"--memory-limit-fraction", fraction});
  }
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string_view v(*e);
    if (v.rfind("CUDA_VISIBLE_DEVICES=", 0) == 0 || v.rfind("CUDA_DEVICE_ORDER=", 0) == 0 ||
        v.rfind("NOTIFY_SOCKET=", 0) == 0) {
      continue;
    }
    env.emplace_back(v);
  }
  const WorkerPlacement& at = placements_[w.id];
  // A CPU worker must never see a GPU ("-1"); a GPU worker sees its own GPU only, named by
  // UUID, and PCI bus order makes an index (when there is no UUID) mean what discovery meant.
  env.emplace_back("CUDA_VISIBLE_DEVICES=" + at.visible_devices);
  if (at.gpu >= 0) env.emplace_back("CUDA_DEVICE_ORDER=PCI_BUS_ID");
  env.emplace_back("GPUQ_WORKER_ID=" + std::to_string(w.id));
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  for (int cpu : at.cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &cpus);
  }
  sigset_t empty;
  sigemptyset(&empty);
  const char* path = args.front().c_str();

  // Reset the worker's shared state before fork(), not after: once forked, the worker stores
  // kReady and busy = 1 itself, and a later store here would overwrite them (the segment would
  // say "starting" and "idle" for good while the worker serves jobs).
  WorkerShm& ws = queue_.worker(w.id);
  ws.busy.store(0, std::memory_order_relaxed);
  ws.asleep.store(0, std::memory_order_relaxed);
  ws.state.store(static_cast<uint32_t>(WorkerState::kStarting), std::memory_order_release);
  pid_t pid = ::fork();
  if (pid < 0) return GPUQ_SYSTEM_ERROR("fork");
  if (pid == 0) {
    // Child: wire fds 1, 2, 3; pin; die with the supervisor; exec.
    if (sv[1] == 3) {
      fcntl(3, F_SETFD, 0);
    } else {
      dup2(sv[1], 3);
    }
    dup2(out[1], 1);
    dup2(err[1], 2);
    sched_setaffinity(0, sizeof cpus, &cpus);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    sigprocmask(SIG_SETMASK, &empty, nullptr);
    signal(SIGPIPE, SIG_DFL);
    execve(path, argv.data(), envp.data());
    static const char msg[] = "gpuq-worker: execve failed\n";
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(127);
  }
  ::close(sv[1]);
  ::close(out[1]);
  ::close(err[1]);
  w.pid = pid;
  w.outbox.clear();  // messages for the previous process of this worker
  w.waiting_writable = false;
  w.control.reset(sv[0]);
  w.out.reset(out[0]);
  w.err.reset(err[0]);
  w.out_buf.clear();
  w.err_buf.clear();
  w.state = WorkerState::kStarting;
  w.kill_at_ns = 0;
  set_nonblocking(w.control.get());
  set_nonblocking(w.out.get());
  set_nonblocking(w.err.get());
  epoll_add(w.control.get(), make_tag(Tag::kWorkerControl, w.id), EPOLLIN);
  epoll_add(w.out.get(), make_tag(Tag::kWorkerOut, uint64_t{w.id} << 1), EPOLLIN);
  epoll_add(w.err.get(), make_tag(Tag::kWorkerOut, (uint64_t{w.id} << 1) | 1), EPOLLIN);
  // Its own pid, the same value the worker stores (the rest was reset before fork()).
  queue_.worker(w.id).pid.store(pid, std::memory_order_relaxed);
  // Hand the new worker every current client's segment (read before it reports ready).
  for (auto& [id, conn] : connections_) {
    if (!conn->registered) continue;
    json j{{"client", conn->index},
           {"session", conn->session},
           {"slot_count", conn->slot_count},
           {"slots_offset", conn->geometry.slots_offset},
           {"arena_offset", conn->geometry.arena_offset},
           {"arena_bytes", conn->geometry.arena_bytes},
           {"segment_bytes", conn->geometry.segment_bytes}};
    send_to_worker(w, static_cast<int>(MessageType::kMapClient), j.dump(), conn->segment.fd());
  }
  GPUQ_LOG_INFO("worker %u (pool %s, cpus %s%s%s) started as pid %d", w.id,
                c.pools[w.pool].name.c_str(), cpu_list_text(at.cpus).c_str(),
                at.gpu >= 0 ? ", GPU " : "", at.gpu >= 0 ? at.visible_devices.c_str() : "", pid);
  return {};
}

void Supervisor::send_to_worker(WorkerProc& w, int type, const std::string& body, int fd) {
  if (!w.control.valid()) return;
  WorkerProc::Outgoing m{type, body, {}};
  if (fd >= 0) {
    m.fd.reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!m.fd.valid()) {
      GPUQ_LOG_ERROR("cannot queue a message for worker %u: dup: %s", w.id, std::strerror(errno));
      return;
    }
  }
  w.outbox.push_back(std::move(m));
  flush_outbox(w);
}

// Sends queued control messages in order until the worker's queue is full (then waits for
// EPOLLOUT) or the outbox is empty. Each message sent bumps control_seq and wakes the worker.
void Supervisor::flush_outbox(WorkerProc& w) {
  while (!w.outbox.empty() && w.control.valid()) {
    WorkerProc::Outgoing& m = w.outbox.front();
    std::vector<int> fds;
    if (m.fd.valid()) fds.push_back(m.fd.get());
    auto r = send_message(w.control.get(), static_cast<MessageType>(m.type), m.body, fds);
    if (!r && r.error().code() == ErrorCode::kTimeout) break;  // full: EPOLLOUT resumes
    if (!r) {
      GPUQ_LOG_WARN("cannot send to worker %u: %s", w.id, r.error().to_string().c_str());
      w.outbox.clear();  // its exit (SIGCHLD) follows
      break;
    }
    w.outbox.pop_front();
    queue_.worker(w.id).control_seq.fetch_add(1, std::memory_order_release);
    queue_.worker(w.id).wake.notify_all();
  }
  if (!w.control.valid()) return;
  const bool want_out = !w.outbox.empty();
  if (want_out != w.waiting_writable) {
    epoll_event ev{};
    ev.events = EPOLLIN | (want_out ? EPOLLOUT : 0u);
    ev.data.u64 = make_tag(Tag::kWorkerControl, w.id);
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, w.control.get(), &ev);
    w.waiting_writable = want_out;
  }
}

void Supervisor::send_to_workers(int type, const std::string& body, int fd) {
  for (auto& w : workers_) send_to_worker(*w, type, body, fd);
}

void Supervisor::on_worker_control(uint32_t worker_id) {
  WorkerProc& w = *workers_[worker_id];
  flush_outbox(w);  // EPOLLOUT, or room made while reading
  for (;;) {
    auto m = receive_message(w.control.get());
    if (!m) {
      if (m.error().code() != ErrorCode::kTimeout) {
        epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, w.control.get(), nullptr);
        w.control.reset();  // the exit itself arrives as SIGCHLD
        w.outbox.clear();
        w.waiting_writable = false;
      }
      return;
    }
    if (m->type == MessageType::kWorkerReady) {
      const json ready = json::parse(m->body, nullptr, false);
      const json mine = json::parse(plugin_op_list());
      if (!ready.is_object() || ready.value("plugin_ops", json::array()) != mine) {
        // Its ids would not be the ones clients were given: it would run the wrong ops.
        GPUQ_LOG_ERROR(
            "worker %u (pid %d) loaded other plug-in ops (%s) than gpuqd learned at start (%s): "
            "a plug-in file changed since? stopping it; restart gpuqd to load the new plug-ins",
            w.id, w.pid,
            ready.is_object() ? ready.value("plugin_ops", json::array()).dump().c_str() : "?",
            mine.dump().c_str());
        ::kill(w.pid, SIGKILL);  // reaped as a worker that died before it was ready
        continue;
      }
      w.state = WorkerState::kReady;
      w.start_failures = 0;
      w.ready_since_ns = monotonic_ns();
      w.backend_info.clear();
      if (ready.is_object() && ready.contains("backend") && ready["backend"].is_object() &&
          !ready["backend"].empty()) {
        w.backend_info = ready["backend"].dump();
      }
      GPUQ_LOG_INFO("worker %u (pid %d) is ready", w.id, w.pid);
      if (workers_stopping_)
        send_to_worker(w, static_cast<int>(MessageType::kWorkerStop), "{}", -1);
    }
  }
}

void Supervisor::on_worker_output(uint32_t tag_id_value) {
  WorkerProc& w = *workers_[tag_id_value >> 1];
  const bool is_err = (tag_id_value & 1) != 0;
  UniqueFd& fd = is_err ? w.err : w.out;
  std::string& buf = is_err ? w.err_buf : w.out_buf;
  char chunk[4096];
  for (;;) {
    ssize_t n = fd.valid() ? ::read(fd.get(), chunk, sizeof chunk) : 0;
    if (n > 0) {
      buf.append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    bool eof = n == 0;
    size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos || (eof && !buf.empty()) ||
           buf.size() > 4096) {
      size_t len = nl == std::string::npos ? buf.size() : nl;
      GPUQ_LOG_INFO("worker %u (pid %d) %s: %.*s", w.id, w.pid, is_err ? "stderr" : "stdout",
                    static_cast<int>(len), buf.data());
      buf.erase(0, nl == std::string::npos ? len : len + 1);
    }
    if (eof && fd.valid()) {
      epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd.get(), nullptr);
      fd.reset();
    }
    return;
  }
}

void Supervisor::fail_running_jobs(const WorkerProc& w, const std::string& why) {
  // The dying worker's id is in the state word of the job it ran; fail exactly that job.
  for (auto& [id, conn] : connections_) {
    if (!conn->registered) continue;
    ClientSegmentView view(conn->segment.address(), conn->geometry, conn->slot_count);
    for (uint32_t s = 0; s < conn->slot_count; ++s) {
      JobSlot& slot = view.slot(s);
      uint64_t word = slot.state.load(std::memory_order_acquire);
      SlotWord sw = SlotWord::unpack(word);
      if (sw.state != JobState::kRunning || sw.worker_plus_one != w.id + 1) continue;
      if (retry_job(*conn, s, slot, word, why)) continue;
      JobOutcome out{};
      out.code = static_cast<int32_t>(ErrorCode::kWorkerDied);
      out.worker_id = w.id;
      out.finished_stamp = read_stamp(job_clock_);
      set_slot_message(slot, why.c_str());
      std::memcpy(&slot.outcome, &out, sizeof out);
      SlotWord failed{sw.generation, JobState::kFailed, sw.worker_plus_one};
      if (slot.state.compare_exchange_strong(word, failed.pack(), std::memory_order_acq_rel)) {
        slot.done.notify_all();
        queue_.worker(w.id).jobs_failed.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
}

// A retryable job whose worker died: back to SUBMITTED (same generation) and into its pool's
// ring, once. The count is kept here, not in the client's segment, which the client could
// rewrite to retry a job that kills every worker forever. False if the job is not retryable,
// was retried already, or there is no room; the caller then fails it.
bool Supervisor::retry_job(Connection& conn, uint32_t s, JobSlot& slot, uint64_t running_word,
                           const std::string& why) {
  const SlotWord sw = SlotWord::unpack(running_word);
  const uint32_t pool = slot.desc.pool_id;
  if ((slot.desc.flags & kJobFlagRetryable) == 0 || pool >= options_.config.pools.size()) {
    return false;
  }
  const auto key = std::make_tuple(conn.session, s, sw.generation);
  if (retried_.count(key) != 0) {
    GPUQ_LOG_WARN("job %u/%u is retryable but was retried once already: failing it", conn.index, s);
    return false;
  }
  const SlotWord queued_again{sw.generation, JobState::kSubmitted, 0};
  if (!slot.state.compare_exchange_strong(running_word, queued_again.pack(),
                                          std::memory_order_acq_rel)) {
    return false;
  }
  if (!queue_.ring(pool).try_push(JobRef{conn.index, s, sw.generation}.pack())) {
    // Put it back as it was, for the caller to fail.
    uint64_t expected = queued_again.pack();
    slot.state.compare_exchange_strong(expected, running_word, std::memory_order_acq_rel);
    GPUQ_LOG_WARN("cannot retry job %u/%u: the ring of pool %u is full", conn.index, s, pool);
    return false;
  }
  retried_.insert(key);
  queue_.wake_worker(pool);
  GPUQ_LOG_WARN("retrying job %u/%u (retryable): %s", conn.index, s, why.c_str());
  return true;
}

// A worker killed between popping a job's reference and claiming the slot took the reference
// with it: the job is SUBMITTED but in no ring. Put such references back. A reference that is
// in fact still in flight (a client between storing SUBMITTED and pushing) gets a duplicate,
// which is harmless: only one SUBMITTED -> RUNNING CAS can win.
void Supervisor::requeue_lost_jobs(uint32_t pool) {
  JobRing ring = queue_.ring(pool);
  for_each_job_in_no_ring(pool, [&](Connection& conn, uint32_t s, uint32_t ref) {
    if (ring.try_push(ref)) {
      GPUQ_LOG_WARN("requeued job %u/%u, whose reference a dying worker took", conn.index, s);
      queue_.wake_worker(pool);
    } else {
      // Not lost: tried again on every timer tick until there is room.
      GPUQ_LOG_WARN("cannot requeue job %u/%u yet: ring full; retrying", conn.index, s);
      requeue_pending_ |= 1u << pool;
    }
  });
}

void Supervisor::for_each_job_in_no_ring(
    uint32_t pool, const std::function<void(Connection&, uint32_t slot, uint32_t ref)>& fn) {
  std::vector<uint32_t> in_ring;
  queue_.ring(pool).for_each_value([&](uint32_t v) { in_ring.push_back(v); });
  std::sort(in_ring.begin(), in_ring.end());
  for (auto& [id, conn] : connections_) {
    if (!conn->registered) continue;
    ClientSegmentView view(conn->segment.address(), conn->geometry, conn->slot_count);
    for (uint32_t s = 0; s < conn->slot_count; ++s) {
      JobSlot& slot = view.slot(s);
      const SlotWord sw = SlotWord::unpack(slot.state.load(std::memory_order_acquire));
      if (sw.state != JobState::kSubmitted || slot.desc.pool_id != pool) continue;
      const uint32_t ref = JobRef{conn->index, s, sw.generation}.pack();
      if (!std::binary_search(in_ring.begin(), in_ring.end(), ref)) fn(*conn, s, ref);
    }
  }
}

void Supervisor::on_worker_exit(pid_t pid, int status) {
  auto it = std::find_if(workers_.begin(), workers_.end(),
                         [pid](const auto& w) { return w->pid == pid; });
  if (it == workers_.end()) return;
  WorkerProc& w = **it;
  // Log what it still had to say, then let go of its descriptors.
  if (w.out.valid()) on_worker_output(w.id << 1);
  if (w.err.valid()) on_worker_output((w.id << 1) | 1);
  for (UniqueFd* fd : {&w.control, &w.out, &w.err}) {
    if (fd->valid()) epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, fd->get(), nullptr);
    fd->reset();
  }
  w.outbox.clear();
  w.waiting_writable = false;
  const std::string how = describe_exit(status);
  fail_running_jobs(w, "worker " + std::to_string(w.id) + " (pid " + std::to_string(pid) + ") " +
                           how + " while running this job");
  requeue_lost_jobs(w.pool);
  WorkerShm& ws = queue_.worker(w.id);
  ws.busy.store(0, std::memory_order_relaxed);
  // A worker that died asleep must not absorb the next wakeup meant for a live one.
  ws.asleep.store(0, std::memory_order_seq_cst);
  ws.pid.store(0, std::memory_order_relaxed);
  w.pid = 0;
  const uint64_t now = monotonic_ns();
  if (workers_stopping_) {
    w.state = WorkerState::kStopped;
    ws.state.store(static_cast<uint32_t>(WorkerState::kStopped), std::memory_order_release);
    GPUQ_LOG_INFO("worker %u %s", w.id, how.c_str());
    return;
  }
  const Config& c = options_.config;
  if (w.state != WorkerState::kReady) {
    ++w.start_failures;
  } else if (now - w.ready_since_ns > kStableRunNs) {
    w.backoff_ms = c.restart_backoff_initial_ms;
  }
  if (w.start_failures >= c.max_start_failures) {
    w.state = WorkerState::kFailed;
    ws.state.store(static_cast<uint32_t>(WorkerState::kFailed), std::memory_order_release);
    GPUQ_LOG_ERROR(
        "worker %u %s; it died %u times in a row before becoming ready: marked failed, "
        "not restarted",
        w.id, how.c_str(), w.start_failures);
    return;
  }
  w.state = WorkerState::kRestarting;
  ws.state.store(static_cast<uint32_t>(WorkerState::kRestarting), std::memory_order_release);
  ws.restarts.fetch_add(1, std::memory_order_relaxed);
  w.respawn_at_ns = now + uint64_t{w.backoff_ms} * 1'000'000;
  GPUQ_LOG_WARN("worker %u (pid %d) %s; restarting in %u ms", w.id, pid, how.c_str(), w.backoff_ms);
  w.backoff_ms = std::min(w.backoff_ms * 2, c.restart_backoff_max_ms);
}

// ---- Clients ----------------------------------------------------------------------------------

bool Supervisor::authorized(uid_t uid, gid_t gid) const {
  const Config& c = options_.config;
  if (c.allowed_uids.empty() && c.allowed_gids.empty()) return uid == geteuid();
  if (std::find(c.allowed_uids.begin(), c.allowed_uids.end(), uid) != c.allowed_uids.end()) {
    return true;
  }
  if (c.allowed_gids.empty()) return false;
  std::vector<gid_t> groups{gid};
  passwd pw{}, *res = nullptr;
  std::vector<char> buf(16384);
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &res) == 0 && res != nullptr) {
    int n = 64;
    std::vector<gid_t> g(static_cast<size_t>(n));
    if (getgrouplist(pw.pw_name, gid, g.data(), &n) >= 0) {
      groups.assign(g.begin(), g.begin() + n);
    }
  }
  for (gid_t g : groups) {
    if (std::find(c.allowed_gids.begin(), c.allowed_gids.end(), g) != c.allowed_gids.end()) {
      return true;
    }
  }
  return false;
}

// Each client costs the supervisor three descriptors (its socket, its pidfd, its segment's
// memfd, kept to hand to respawned workers); each worker three (control socket, stdout,
// stderr). The soft RLIMIT_NOFILE is often 1024 while the hard one is far higher (systemd:
// 524288), so raise the soft limit to the hard one, and say so when even that is too few.
void Supervisor::raise_descriptor_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  descriptor_limit_ = lim.rlim_cur;
  const Config& c = options_.config;
  uint64_t workers = 0;
  for (const auto& p : c.pools) workers += p.workers;
  const uint64_t fixed = workers * 3 + 32;  // workers, and the supervisor's own descriptors
  const uint64_t needed = fixed + uint64_t{c.max_clients} * 3;
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < needed) {
    GPUQ_LOG_WARN(
        "the descriptor limit (RLIMIT_NOFILE) is %llu, but max_clients = %u needs about %llu: "
        "clients past about %llu will be refused (raise LimitNOFILE= or ulimit -Hn, or lower "
        "max_clients)",
        static_cast<unsigned long long>(lim.rlim_cur), c.max_clients,
        static_cast<unsigned long long>(needed),
        static_cast<unsigned long long>(lim.rlim_cur > fixed ? (lim.rlim_cur - fixed) / 3 : 0));
  }
  reserve_fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
}

// accept4 failed with EMFILE or ENFILE: the connection would stay in the backlog, and the
// level-triggered listen socket would wake the loop at once, again and again. Spend the
// reserve descriptor to take it, tell the client why, and close it.
bool Supervisor::refuse_for_descriptors() {
  const int err = errno;
  if (!reserve_fd_.valid()) {
    GPUQ_LOG_WARN("accept: %s, and no reserve descriptor to refuse the client with",
                  std::strerror(err));
    return false;
  }
  reserve_fd_.reset();
  UniqueFd fd(::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
  if (fd.valid()) {
    Error e(ErrorCode::kTooManyClients,
            "the daemon is out of file descriptors (" + std::string(std::strerror(err)) +
                ", RLIMIT_NOFILE " + std::to_string(descriptor_limit_) + ") with " +
                std::to_string(registered_clients_) +
                " clients; raise its LimitNOFILE= or lower max_clients");
    GPUQ_LOG_WARN("refused a connection: %s", e.message().c_str());
    (void)send_message(fd.get(), MessageType::kError, error_body(e));
  }
  const bool refused = fd.valid();
  fd.reset();
  reserve_fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return refused;
}

void Supervisor::on_accept() {
  for (;;) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if (errno == EMFILE || errno == ENFILE) {
        // Until a client leaves, every new one is refused; stop when none is waiting or no
        // descriptor could be had even so (the next wakeup tries again).
        if (!refuse_for_descriptors()) return;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        GPUQ_LOG_WARN("accept: %s", std::strerror(errno));
      }
      return;
    }
    auto conn = std::make_unique<Connection>();
    conn->fd.reset(fd);
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      GPUQ_LOG_WARN("SO_PEERCRED: %s", std::strerror(errno));
      continue;
    }
    conn->pid = cred.pid;
    conn->uid = cred.uid;
    conn->gid = cred.gid;
    if (!authorized(cred.uid, cred.gid)) {
      Error e(ErrorCode::kPermissionDenied,
              "uid " + std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                  ") is not allowed to use this daemon (see allowed_users and allowed_groups)");
      GPUQ_LOG_WARN("refused a connection: %s", e.message().c_str());
      (void)send_message(fd, MessageType::kError, error_body(e));
      continue;  // conn closes the socket
    }
    conn->id = next_conn_id_++;
    GPUQ_FAULT_POINT("supervisor.client_accepted");
    epoll_add(fd, make_tag(Tag::kConnection, conn->id), EPOLLIN | EPOLLRDHUP);
    // The socket alone misses a client whose children inherited it (fork, exec): they keep
    // it open after the client itself has died. Its pidfd becomes readable when it exits.
    if (int pfd = static_cast<int>(::syscall(SYS_pidfd_open, cred.pid, 0)); pfd >= 0) {
      conn->pidfd.reset(pfd);
      epoll_add(pfd, make_tag(Tag::kClientExit, conn->id), EPOLLIN);
    } else if (errno != ENOSYS) {
      GPUQ_LOG_WARN("pidfd_open(%d): %s; the client's exit is seen when its socket closes",
                    cred.pid, std::strerror(errno));
    }
    connections_.emplace(conn->id, std::move(conn));
  }
}

void Supervisor::on_connection(uint64_t conn_id, uint32_t events) {
  auto it = connections_.find(conn_id);
  if (it == connections_.end()) return;
  Connection& conn = *it->second;
  if (events & EPOLLIN) {
    for (;;) {
      auto m = receive_message(conn.fd.get());
      if (!m) {
        ErrorCode code = m.error().code();
        if (code == ErrorCode::kTimeout) break;  // nothing more to read now
        if (code != ErrorCode::kDisconnected) {
          // Malformed, oversized or wrong-version input: say why, then drop this connection.
          GPUQ_LOG_WARN("client pid %d sent a bad message: %s", conn.pid,
                        m.error().to_string().c_str());
          (void)send_message(conn.fd.get(), MessageType::kError, error_body(m.error()));
        }
        close_connection(conn_id);
        return;
      }
      handle_message(conn, *m);
      if (connections_.find(conn_id) == connections_.end()) return;
    }
  }
  if (events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) close_connection(conn_id);
}

void Supervisor::handle_message(Connection& conn, Message& msg) {
  switch (msg.type) {
    case MessageType::kHello: {
      if (conn.registered) {
        (void)send_message(conn.fd.get(), MessageType::kError,
                           error_body(Error(ErrorCode::kInvalidArgument,
                                            "Hello on a connection that is already registered")));
        return;
      }
      if (auto r = register_client(conn, msg.body); !r) {
        GPUQ_LOG_WARN("client pid %d not registered: %s", conn.pid, r.error().to_string().c_str());
        (void)send_message(conn.fd.get(), MessageType::kError, error_body(r.error()));
      }
      return;
    }
    case MessageType::kStatusRequest:
      (void)send_message(conn.fd.get(), MessageType::kStatusReply, status_json());
      return;
    case MessageType::kStopRequest:
      (void)send_message(conn.fd.get(), MessageType::kStopReply, R"({"draining":true})");
      begin_drain("stop requested by a client");
      return;
    default:
      (void)send_message(conn.fd.get(), MessageType::kError,
                         error_body(Error(ErrorCode::kInvalidArgument,
                                          "unexpected message type " +
                                              std::to_string(static_cast<int>(msg.type)))));
  }
}

bool Supervisor::client_index_free(uint32_t index) const {
  if (index_in_use_[index]) return false;
  for (const auto& r : retired_) {
    if (r.index == index) return false;
  }
  return true;
}

Result<void> Supervisor::register_client(Connection& conn, const std::string& body) {
  const Config& c = options_.config;
  if (draining_) return Error(ErrorCode::kShuttingDown, "the daemon is draining");
  auto hello = parse_hello(body, c.max_client_segment_bytes);
  if (!hello) return hello.error();
  conn.name = std::move(hello->name);
  const uint64_t arena = hello->arena_bytes != 0 ? hello->arena_bytes : c.client_segment_bytes;
  if (registered_clients_ >= c.max_clients) {
    return Error(ErrorCode::kTooManyClients, "the daemon already serves max_clients = " +
                                                 std::to_string(c.max_clients) + " clients");
  }
  uint32_t index = c.max_clients;
  for (uint32_t k = 0; k < c.max_clients; ++k) {
    uint32_t i = (next_index_ + k) % c.max_clients;
    if (client_index_free(i)) {
      index = i;
      break;
    }
  }
  if (index == c.max_clients) {
    return Error(ErrorCode::kTooManyClients, "no client index is free yet; retry shortly");
  }
  next_index_ = (index + 1) % c.max_clients;

  conn.slot_count = c.max_jobs_per_client;
  conn.geometry = ClientSegmentGeometry::compute(conn.slot_count, arena);
  auto seg =
      MemfdSegment::create("gpuq-client-" + std::to_string(index), conn.geometry.segment_bytes);
  if (!seg) return seg.error();
  conn.segment = std::move(*seg);
  auto* h = static_cast<ClientSegmentHeader*>(conn.segment.address());
  h->magic = kClientMagic;
  h->layout_version = kLayoutVersion;
  h->client_index = index;
  h->slot_count = conn.slot_count;
  h->slots_offset = conn.geometry.slots_offset;
  h->arena_offset = conn.geometry.arena_offset;
  h->arena_bytes = conn.geometry.arena_bytes;
  h->segment_bytes = conn.geometry.segment_bytes;

  conn.index = index;
  conn.session = next_session_++;
  conn.registered = true;
  index_in_use_[index] = true;
  ++registered_clients_;
  ClientShm& cs = queue_.client(index);
  for (auto& n : cs.submitted) n.store(0, std::memory_order_relaxed);
  cs.submitting.store(0, std::memory_order_relaxed);
  cs.pid.store(conn.pid, std::memory_order_relaxed);
  cs.session.store(conn.session, std::memory_order_release);

  json map{{"client", index},
           {"session", conn.session},
           {"slot_count", conn.slot_count},
           {"slots_offset", conn.geometry.slots_offset},
           {"arena_offset", conn.geometry.arena_offset},
           {"arena_bytes", conn.geometry.arena_bytes},
           {"segment_bytes", conn.geometry.segment_bytes}};
  send_to_workers(static_cast<int>(MessageType::kMapClient), map.dump(), conn.segment.fd());

  json welcome = map;
  welcome["epoch"] = epoch_;
  welcome["queue_segment"] = segment_name_;
  welcome["daemon_version"] = GPUQ_VERSION;
  welcome["job_clock"] = stamp_clock_name(job_clock_);
  if (job_clock_ == StampClock::kTsc) welcome["tsc_ns_per_tick"] = tsc_rate_.ns_per_tick();
  welcome["pools"] = json::array();
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    const PoolShm& ps = queue_.pool(p);
    // "available", "reason" and "fallback" (the pool id that runs this pool's jobs while it is
    // unavailable, or -1): a client checks them in submit (docs/design/protocol.md).
    welcome["pools"].push_back({{"name", c.pools[p].name},
                                {"id", p},
                                {"kind", c.pools[p].kind == PoolKind::kGpu ? "gpu" : "cpu"},
                                {"capacity", ps.capacity},
                                {"client_share", ps.client_share},
                                {"available", pool_state_[p].available},
                                {"reason", pool_state_[p].reason},
                                {"fallback", c.pools[p].fallback_pool}});
  }
  welcome["ops"] = json::array();
  for (const auto& op : op_registry()) welcome["ops"].push_back({{"name", op.name}, {"id", op.id}});
  if (auto r =
          send_message(conn.fd.get(), MessageType::kWelcome, welcome.dump(), {conn.segment.fd()});
      !r) {
    return r;
  }
  GPUQ_LOG_INFO("client %u registered: pid %d uid %u%s%s, %llu-byte segment", index, conn.pid,
                conn.uid, conn.name.empty() ? "" : ", ", conn.name.c_str(),
                static_cast<unsigned long long>(conn.geometry.segment_bytes));
  return {};
}

void Supervisor::on_client_exit(uint64_t conn_id) {
  auto it = connections_.find(conn_id);
  if (it == connections_.end()) return;
  GPUQ_LOG_INFO("client pid %d has exited", it->second->pid);
  close_connection(conn_id);
}

void Supervisor::unregister_client(Connection& conn) {
  GPUQ_FAULT_POINT("supervisor.client_unregistering");
  ClientSegmentView view(conn.segment.address(), conn.geometry, conn.slot_count);
  // Jobs still queued will never be read: cancel them (a worker that pops one skips it).
  for (uint32_t s = 0; s < conn.slot_count; ++s) {
    JobSlot& slot = view.slot(s);
    uint64_t word = slot.state.load(std::memory_order_acquire);
    SlotWord sw = SlotWord::unpack(word);
    if (sw.state == JobState::kSubmitted) {
      SlotWord cancelled{sw.generation, JobState::kCancelled, 0};
      slot.state.compare_exchange_strong(word, cancelled.pack(), std::memory_order_acq_rel);
    }
  }
  ClientShm& cs = queue_.client(conn.index);
  for (uint32_t p = 0; p < options_.config.pools.size(); ++p) {
    submitted_by_departed_[p] += cs.submitted[p].load(std::memory_order_relaxed);
  }
  std::erase_if(retried_, [&](const auto& key) { return std::get<0>(key) == conn.session; });
  cs.session.store(0, std::memory_order_release);
  cs.submitting.store(0, std::memory_order_relaxed);
  json j{{"client", conn.index}, {"session", conn.session}};
  send_to_workers(static_cast<int>(MessageType::kUnmapClient), j.dump(), -1);
  RetiredClient r{conn.index, {}};
  for (uint32_t p = 0; p < options_.config.pools.size(); ++p) {
    r.tails[p] = queue_.ring(p).settled_tail();
  }
  retired_.push_back(r);
  index_in_use_[conn.index] = false;
  --registered_clients_;
  conn.registered = false;
  GPUQ_LOG_INFO("client %u (pid %d) disconnected", conn.index, conn.pid);
}

void Supervisor::close_connection(uint64_t conn_id) {
  auto it = connections_.find(conn_id);
  if (it == connections_.end()) return;
  Connection& conn = *it->second;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, conn.fd.get(), nullptr);
  if (conn.registered) unregister_client(conn);
  connections_.erase(it);
}

// ---- Loop, signals, drain ---------------------------------------------------------------------

int Supervisor::run() {
  epoll_event events[64];
  while (!done_) {
    int n = epoll_wait(epoll_fd_.get(), events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      GPUQ_LOG_ERROR("epoll_wait: %s", std::strerror(errno));
      return 1;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      switch (tag_kind(tag)) {
        case Tag::kListen:
          on_accept();
          break;
        case Tag::kSignal:
          on_signal();
          break;
        case Tag::kTimer:
          on_timer();
          break;
        case Tag::kConnection:
          on_connection(tag_id(tag), events[i].events);
          break;
        case Tag::kClientExit:
          on_client_exit(tag_id(tag));
          break;
        case Tag::kWorkerControl:
          on_worker_control(static_cast<uint32_t>(tag_id(tag)));
          break;
        case Tag::kWorkerOut:
          on_worker_output(static_cast<uint32_t>(tag_id(tag)));
          break;
        case Tag::kWatchdog:
          on_watchdog_timer();
          break;
        case Tag::kTestHook:
          on_test_hook_signal();
          break;
      }
    }
    if (draining_) check_drain();
    update_timer();
    update_service_state();
  }
  cleanup();
  GPUQ_LOG_INFO("stopped");
  return 0;
}

// The periodic tick runs only while something is timed: a respawn or kill deadline, a drain,
// or a client index waiting for the rings to pass it (every kTickNs); and, slower, the audit
// while clients are connected (every kAuditNs). A daemon without clients does not wake at all.
void Supervisor::update_timer() {
  bool timed = draining_ || !retired_.empty() || requeue_pending_ != 0;
  for (const auto& w : workers_) {
    if (w->state == WorkerState::kRestarting || w->kill_at_ns != 0) timed = true;
  }
  const uint64_t period = timed ? kTickNs : (registered_clients_ > 0 ? kAuditNs : 0);
  if (period == timer_period_ns_) return;
  const timespec tick{static_cast<time_t>(period / 1'000'000'000),
                      static_cast<long>(period % 1'000'000'000)};
  itimerspec its{tick, tick};
  timerfd_settime(timer_fd_.get(), 0, &its, nullptr);
  timer_period_ns_ = period;
}

void Supervisor::on_signal() {
  signalfd_siginfo si;
  while (::read(signal_fd_.get(), &si, sizeof si) == sizeof si) {
    if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
      begin_drain(si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
    } else if (si.ssi_signo == SIGHUP) {
      GPUQ_LOG_INFO("SIGHUP ignored (the config is read at start only)");
    }
  }
  // SIGCHLD may coalesce: reap every child that has exited.
  for (;;) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    on_worker_exit(pid, status);
  }
}

void Supervisor::on_timer() {
  uint64_t expirations;
  ssize_t ignored = ::read(timer_fd_.get(), &expirations, sizeof expirations);
  (void)ignored;
  const uint64_t now = monotonic_ns();
  // Jobs a dead worker took that found no room in a full ring: try again each tick.
  if (const uint32_t pending = std::exchange(requeue_pending_, 0); pending != 0) {
    for (uint32_t p = 0; p < options_.config.pools.size(); ++p) {
      if ((pending & (1u << p)) != 0) requeue_lost_jobs(p);
    }
  }
  for (auto& w : workers_) {
    if (w->state == WorkerState::kRestarting && !workers_stopping_ && now >= w->respawn_at_ns) {
      if (auto r = spawn_worker(*w); !r) {
        GPUQ_LOG_ERROR("cannot respawn worker %u: %s", w->id, r.error().to_string().c_str());
        w->respawn_at_ns = now + uint64_t{w->backoff_ms} * 1'000'000;
      }
    }
    if (w->pid > 0 && w->kill_at_ns != 0 && now >= w->kill_at_ns) {
      GPUQ_LOG_WARN("worker %u (pid %d) did not exit in time; killing it", w->id, w->pid);
      ::kill(w->pid, SIGKILL);
      w->kill_at_ns = 0;
    }
  }
  audit(now);
  // Client indexes whose last ring entries have all been popped become reusable.
  std::erase_if(retired_, [&](const RetiredClient& r) {
    for (uint32_t p = 0; p < options_.config.pools.size(); ++p) {
      if (queue_.ring(p).head_position() < r.tails[p]) return false;
    }
    return true;
  });
}

void Supervisor::begin_drain(const char* reason) {
  if (draining_) return;
  draining_ = true;
  drain_deadline_ns_ = monotonic_ns() + uint64_t{options_.config.drain_timeout_ms} * 1'000'000;
  GPUQ_LOG_INFO("draining (%s): no new jobs; finishing queued and running ones", reason);
  notify_stopping(reason);
  queue_.header().daemon_state.store(static_cast<uint32_t>(DaemonState::kDraining),
                                     std::memory_order_seq_cst);
  for (uint32_t p = 0; p < options_.config.pools.size(); ++p) {
    queue_.pool(p).accepting.store(0, std::memory_order_seq_cst);
    queue_.pool(p).space.notify_all();  // blocked producers re-check and see ShuttingDown
  }
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, listen_fd_.get(), nullptr);
  listen_fd_.reset();
  ::unlink(socket_path_.c_str());
  check_drain();
}

void Supervisor::check_drain() {
  const uint64_t now = monotonic_ns();
  if (!workers_stopping_) {
    // Dekker with submit(): accepting was cleared (seq_cst) before these loads, and a client
    // raises `submitting` (seq_cst) before it reads `accepting`. So once no client is inside
    // submit, no job can enter a ring any more; then wait for the rings to empty and the
    // workers to go idle.
    bool idle = true;
    for (uint32_t i = 0; i < options_.config.max_clients && idle; ++i) {
      if (queue_.client(i).session.load(std::memory_order_acquire) != 0 &&
          queue_.client(i).submitting.load(std::memory_order_seq_cst) != 0) {
        idle = false;
      }
    }
    // An unavailable pool's ring has no worker to empty it (and no honest client fills it).
    for (uint32_t p = 0; p < options_.config.pools.size() && idle; ++p) {
      if (pool_state_[p].available && queue_.ring(p).has_values()) idle = false;
    }
    for (auto& w : workers_) {
      if (w->pid > 0 && queue_.worker(w->id).busy.load(std::memory_order_acquire) != 0) {
        idle = false;
      }
    }
    const bool timed_out = now >= drain_deadline_ns_;
    if (!idle && !timed_out) return;
    if (!idle) {
      GPUQ_LOG_WARN("drain_timeout_ms (%u) passed with jobs still queued or running; stopping",
                    options_.config.drain_timeout_ms);
    }
    workers_stopping_ = true;
    send_to_workers(static_cast<int>(MessageType::kWorkerStop), "{}", -1);
    for (auto& w : workers_) {
      if (w->pid > 0) w->kill_at_ns = now + (idle ? kWorkerExitGraceNs : 0);
      if (w->state == WorkerState::kRestarting) w->state = WorkerState::kStopped;
    }
  }
  bool all_exited =
      std::none_of(workers_.begin(), workers_.end(), [](const auto& w) { return w->pid > 0; });
  if (all_exited) done_ = true;
}

std::string Supervisor::status_json() const {
  const Config& c = options_.config;
  json s;
  s["version"] = GPUQ_VERSION;
  s["pid"] = getpid();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(epoch_));
  s["epoch"] = hex;
  s["uptime_s"] = static_cast<double>(monotonic_ns() - start_ns_) / 1e9;
  s["state"] = draining_ ? "draining" : "running";
  s["runtime_dir"] = options_.runtime_dir;
  s["clients"] = registered_clients_;
  // Indexes of departed clients whose last ring entries have not all been popped yet.
  s["client_indexes_retiring"] = retired_.size();
  if (discovery_ran_) {
    s["gpu_discovery"] = {
        {"source", discovery_.source}, {"problem", discovery_.problem}, {"gpus", json::array()}};
    // The executable gpu pools run on real GPUs; null in a build without CUDA.
    s["gpu_discovery"]["gpu_worker"] =
        options_.gpu_worker_path.empty() ? json(nullptr) : json(options_.gpu_worker_path);
    for (const GpuInfo& g : discovery_.gpus) s["gpu_discovery"]["gpus"].push_back(gpu_json(g));
  }
  s["pools"] = json::array();
  bool all_pools_serving = true;
  uint32_t available_pools = 0;
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    const PoolShm& ps = queue_.pool(p);
    json pool{{"name", c.pools[p].name},
              {"id", p},
              {"kind", c.pools[p].kind == PoolKind::kGpu ? "gpu" : "cpu"},
              {"capacity", ps.capacity},
              {"queue_depth", queue_.ring(p).size()},
              {"client_share", ps.client_share},
              {"accepting", ps.accepting.load() != 0},
              {"jobs_submitted", jobs_submitted(p)},
              {"jobs_completed", jobs_completed(p)},
              {"cells_held", cells_held(p)},
              {"ring_cells_retired", cells_retired_[p]},
              {"ring_positions_restored", hints_restored_[p]},
              {"jobs_requeued", jobs_requeued_[p]}};
    const PoolState& st = pool_state_[p];
    if (c.pools[p].kind == PoolKind::kGpu) {
      pool["gpus"] = json::array();
      for (uint32_t g : st.gpus) pool["gpus"].push_back(gpu_json(discovery_.gpus[g]));
      const int fallback = c.pools[p].fallback_pool;
      pool["fallback"] = fallback >= 0 ? json(c.pools[fallback].name) : json(nullptr);
    }
    uint32_t ready = 0, total = 0;
    pool["workers"] = json::array();
    for (const auto& w : workers_) {
      if (w->pool != p) continue;
      const WorkerShm& ws = queue_.worker(w->id);
      ++total;
      if (w->state == WorkerState::kReady) ++ready;
      const WorkerPlacement& at = placements_[w->id];
      pool["workers"].push_back({{"id", w->id},
                                 {"pid", w->pid},
                                 {"cpus", at.cpus},
                                 {"state", worker_state_name(w->state)},
                                 {"busy", ws.busy.load() != 0},
                                 {"jobs_done", ws.jobs_done.load()},
                                 {"jobs_failed", ws.jobs_failed.load()},
                                 {"restarts", ws.restarts.load()}});
      if (at.gpu >= 0) pool["workers"].back()["gpu"] = discovery_.gpus[at.gpu].uuid;
      if (!w->backend_info.empty()) {
        pool["workers"].back()["backend"] = json::parse(w->backend_info, nullptr, false);
      }
    }
    pool["workers_ready"] = ready;
    pool["workers_total"] = total;
    if (!st.available) {
      pool["status"] = "unavailable";
      pool["reason"] = st.reason;
    } else {
      ++available_pools;
      pool["status"] = ready == total ? "ready" : (ready > 0 ? "degraded" : "down");
      pool["reason"] = ready == total ? ""
                                      : std::to_string(total - ready) + " of " +
                                            std::to_string(total) + " workers not ready";
      if (ready == 0) all_pools_serving = false;
    }
    s["pools"].push_back(pool);
  }
  // Ready: accepting jobs, and every available pool has at least one live, ready worker. An
  // unavailable pool (a gpu pool without a GPU) does not count: it will not get better by
  // waiting, and the daemon serves its other pools (and this pool's fallback); its status says
  // "unavailable" with the reason. With no available pool at all, nothing can run: not ready.
  // A readiness probe (gpuqctl ready) answers from this.
  s["ready"] = !draining_ && all_pools_serving && available_pools > 0;
  return s.dump();
}

// Ring cells of pool `p` whose entries name a client index in use (a connected client, or
// one that has gone and whose index is still retiring): 0 when idle.
uint64_t Supervisor::cells_held(uint32_t p) const {
  uint64_t n = 0;
  queue_.ring(p).for_each_value([&](uint32_t v) {
    const uint32_t c = JobRef::unpack(v).client;
    if (c < index_in_use_.size() && index_in_use_[c]) ++n;
  });
  return n;
}

// Each pool's workers by state, for the service manager's READY=1 and STATUS= lines.
std::vector<Supervisor::PoolHealth> Supervisor::pool_health() const {
  const Config& c = options_.config;
  std::vector<PoolHealth> pools(c.pools.size());
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    pools[p].name = c.pools[p].name;
    pools[p].capacity = queue_.pool(p).capacity;
    pools[p].unavailable = !pool_state_[p].available;
  }
  for (const auto& w : workers_) {
    PoolHealth& h = pools[w->pool];
    ++h.total;
    if (w->state == WorkerState::kReady) ++h.ready;
    if (w->state == WorkerState::kFailed) ++h.failed;
    if (w->state == WorkerState::kStarting || w->state == WorkerState::kRestarting) ++h.settling;
  }
  return pools;
}

// Jobs pushed to pool `p`: by clients that have left, plus the live clients' own counters.
uint64_t Supervisor::jobs_submitted(uint32_t p) const {
  uint64_t n = submitted_by_departed_[p];
  for (const auto& [id, conn] : connections_) {
    if (conn->registered) n += queue_.client(conn->index).submitted[p].load();
  }
  return n;
}

// Jobs of pool `p` that reached a terminal state in a worker (or failed with its death).
uint64_t Supervisor::jobs_completed(uint32_t p) const {
  uint64_t n = 0;
  for (const auto& w : workers_) {
    if (w->pool != p) continue;
    n += queue_.worker(w->id).jobs_done.load() + queue_.worker(w->id).jobs_failed.load();
  }
  return n;
}

void Supervisor::cleanup() {
  if (!segment_name_.empty()) {
    queue_.header().daemon_state.store(static_cast<uint32_t>(DaemonState::kStopped),
                                       std::memory_order_release);
    QueueSegment::remove(segment_name_);
    ::unlink((options_.runtime_dir + "/" + kSegmentNameFile).c_str());
    segment_name_.clear();
  }
  if (listen_fd_.valid()) {
    listen_fd_.reset();
    ::unlink(socket_path_.c_str());
  }
  for (auto& w : workers_) {
    if (w->pid > 0) ::kill(w->pid, SIGKILL);
  }
}

}  // namespace gpuq::daemon
