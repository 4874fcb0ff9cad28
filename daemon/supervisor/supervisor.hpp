// The supervisor (gpuqd's core): owns the runtime directory, the control socket, the queue
// segment and the worker processes; registers clients and hands them their payload segments;
// drains on SIGTERM/SIGINT. Single-threaded: one epoll loop handles the listening socket,
// client connections, signals (signalfd), worker control sockets and output pipes, and a
// periodic timer. Never initialises CUDA and links no CUDA library.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "config.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"
#include "service_notifier.hpp"
#include "test_hooks.hpp"

namespace gpuq::daemon {

struct SupervisorOptions {
  Config config;
  std::string runtime_dir;  // already resolved
  std::string worker_path;  // the gpuq-worker executable
  // The gpuq-gpu-worker executable, which gpu pools run; empty when this build has none (built
  // without CUDA): gpu pools are then unavailable. The supervisor only execs it.
  std::string gpu_worker_path;
  // The service manager link (READY=1, STATUS=, STOPPING=1, WATCHDOG=1); null: none.
  std::shared_ptr<ServiceNotifier> notifier;
  TestHooks test_hooks;  // off unless GPUQ_TEST_HOOKS=1 (test_hooks.hpp)
};

class Supervisor {
 public:
  explicit Supervisor(SupervisorOptions options);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Creates the runtime directory, takes its lock, creates the queue segment and the socket,
  // and spawns the workers. Errors name what failed (another daemon running, permissions...).
  Result<void> start();

  // Serves until a drain completes (SIGTERM/SIGINT or a stop request). Returns the exit code.
  int run();

 private:
  struct WorkerProc;
  struct Connection;
  struct RetiredClient;

  // Event-loop handlers.
  void on_signal();
  void on_timer();
  void on_accept();
  void on_connection(uint64_t conn_id, uint32_t events);
  void on_client_exit(uint64_t conn_id);
  void on_worker_control(uint32_t worker_id);
  // `tag` is {worker id << 1 | 1 for stderr}.
  void on_worker_output(uint32_t tag);

  // Clients.
  void handle_message(Connection& conn, Message& msg);
  Result<void> register_client(Connection& conn, const std::string& body);
  void close_connection(uint64_t conn_id);
  void unregister_client(Connection& conn);
  bool client_index_free(uint32_t index) const;
  bool authorized(uid_t uid, gid_t gid) const;

  // Pools and their GPUs: where each worker runs, and which pools have nothing to run on.
  // Where a worker runs (placements_[worker id]).
  struct WorkerPlacement {
    std::vector<int> cpus;        // its CPU affinity
    std::string visible_devices;  // CUDA_VISIBLE_DEVICES: "-1" (cpu pool), else the GPU's UUID
    int gpu = -1;                 // index into discovery_.gpus; -1 in a cpu pool
  };
  // A pool at run time (pool_state_[pool]).
  struct PoolState {
    bool available = true;       // false: a gpu pool that found no GPU; it has no workers
    std::string reason;          // why it is unavailable
    std::vector<uint32_t> gpus;  // a gpu pool's GPUs, indexes into discovery_.gpus
  };
  // Finds the GPUs (when a gpu pool asks for them), decides each pool's workers and where they
  // run, and sets each gpu pool's worker count in the config. Errors: InvalidArgument when the
  // GPUs found make a pool too large (check_pool_sizes).
  Result<void> plan_pools();
  Result<void> learn_plugin_ops();

  // Workers.
  Result<void> spawn_worker(WorkerProc& w);
  void on_worker_exit(pid_t pid, int status);
  void fail_running_jobs(const WorkerProc& w, const std::string& why);
  bool retry_job(Connection& conn, uint32_t slot_index, JobSlot& slot, uint64_t running_word,
                 const std::string& why);
  void requeue_lost_jobs(uint32_t pool);
  // Calls fn(connection, slot, reference) for every live client's job that is SUBMITTED to
  // `pool` but whose reference is in no cell of its ring.
  void for_each_job_in_no_ring(
      uint32_t pool, const std::function<void(Connection&, uint32_t slot, uint32_t ref)>& fn);
  void send_to_workers(int type, const std::string& body, int fd);
  void flush_outbox(WorkerProc& w);
  void send_to_worker(WorkerProc& w, int type, const std::string& body, int fd);

  // The audit of rings and SUBMITTED jobs that a client may have overwritten
  // (supervisor_audit.cpp).
  void audit(uint64_t now);
  void audit_ring(uint32_t pool);
  void audit_submitted(uint32_t pool, uint64_t now);

  // Drain and status.
  void update_timer();
  void begin_drain(const char* reason);
  void check_drain();
  std::string status_json() const;
  uint64_t cells_held(uint32_t pool) const;
  uint64_t jobs_submitted(uint32_t pool) const;
  uint64_t jobs_completed(uint32_t pool) const;

  // The service manager link (supervisor_service.cpp, docs/service.md).
  struct PoolHealth {
    std::string name;
    uint32_t ready = 0, failed = 0, settling = 0, total = 0;  // settling: starting/restarting
    uint32_t capacity = 0;
    bool unavailable = false;  // a gpu pool without a GPU (PoolState)
  };
  std::vector<PoolHealth> pool_health() const;
  static std::string pools_summary(const std::vector<PoolHealth>& pools);
  Result<void> start_service_link();
  void update_service_state();
  void notify_stopping(const char* reason);
  void on_watchdog_timer();
  void on_test_hook_signal();

  Result<void> create_runtime_dir();
  Result<void> create_queue_segment();
  Result<void> create_socket();
  void raise_descriptor_limit();
  bool refuse_for_descriptors();
  void epoll_add(int fd, uint64_t tag, uint32_t events);
  void cleanup();

  SupervisorOptions options_;
  uint64_t epoch_ = 0;
  uint64_t start_ns_ = 0;
  StampClock job_clock_ = StampClock::kMonotonic;  // what job stamps count in (clock.hpp)
  TscRate tsc_rate_;                               // the TSC's rate, for clients (Welcome)
  std::string segment_name_;
  QueueSegment segment_;
  QueueView queue_;
  UniqueFd lock_fd_, listen_fd_, epoll_fd_, signal_fd_, timer_fd_;
  std::string socket_path_;
  std::vector<std::unique_ptr<WorkerProc>> workers_;
  std::vector<WorkerPlacement> placements_;  // by worker id
  std::vector<PoolState> pool_state_;        // by pool
  GpuDiscovery discovery_;                   // what plan_pools() found
  bool discovery_ran_ = false;               // only when a gpu pool is configured
  // GPUs read from a fake tree (test hook GPUQ_TEST_GPU_ROOT): no device stands behind them, so
  // their pools run gpuq-worker (the CPU backend) instead of gpuq-gpu-worker.
  bool fake_gpus_ = false;
  std::map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::vector<RetiredClient> retired_;
  std::vector<bool> index_in_use_;
  uint64_t next_conn_id_ = 1;
  uint64_t next_session_ = 1;
  uint32_t next_index_ = 0;
  uint32_t registered_clients_ = 0;
  bool draining_ = false;
  bool workers_stopping_ = false;
  uint64_t drain_deadline_ns_ = 0;
  bool done_ = false;
  uint64_t submitted_by_departed_[kMaxPools] = {};
  // Retryable jobs already run again after a worker death: {client session, slot, generation}.
  std::set<std::tuple<uint64_t, uint32_t, uint32_t>> retried_;
  // Pools (bit p) with a job a dead worker took that did not fit back into the full ring yet.
  uint32_t requeue_pending_ = 0;
  UniqueFd watchdog_fd_, test_hook_fd_;
  // The audit (supervisor_audit.cpp): every kAuditNs while clients are connected.
  static constexpr uint64_t kAuditNs = 100'000'000;
  static constexpr uint64_t kLostAfterNs = 1'000'000'000;
  uint64_t next_audit_ns_ = 0;
  RingAudit ring_audits_[kMaxPools];
  using LostKey = std::tuple<uint32_t, uint64_t, uint32_t, uint32_t>;  // pool, session, slot, gen
  std::map<LostKey, uint64_t> lost_since_;  // SUBMITTED jobs in no ring: first seen (ns)
  uint64_t cells_retired_[kMaxPools] = {};
  uint64_t hints_restored_[kMaxPools] = {};
  uint64_t jobs_requeued_[kMaxPools] = {};
  uint64_t timer_period_ns_ = 0;  // 0: disarmed
  // Held open so that a connection can still be accepted, told why it is refused and closed
  // when the process is out of descriptors (EMFILE), instead of staying in the backlog.
  UniqueFd reserve_fd_;
  uint64_t descriptor_limit_ = 0;  // RLIMIT_NOFILE soft limit after start()
  bool ready_notified_ = false;
  std::string last_service_status_;
};

}  // namespace gpuq::daemon
