// The supervisor (gpuqd's core): its event loop, and the wiring of the components that own the
// daemon's state (docs/design/architecture.md has the picture):
//   RuntimeFiles    runtime directory and lock, queue segment, control socket
//   PoolPlan        where each worker runs (GPUs found, CPUs, CUDA_VISIBLE_DEVICES)
//   WorkerSet       worker processes: spawn (through a ProcessLauncher), control channel,
//                   output, exit, back-off, stop
//   ClientRegistry  connections: accept, authenticate, register, unregister, index reuse
//   Catalog         the pools and ops clients are told of, and its generation
//   JobRecovery     jobs a dead worker or a scribbling client would lose; the ring audit;
//                   the queued jobs of a pool that is down
//   PoolOutage      which pools have had no ready worker for pool_down_fail_ms (down)
//   SparePool       spare workers: which one takes a dead or stopped worker's place
//   PoolRollout     rolling restarts: new workers made ready, then swapped in one by one
//   ConfigReload    gpuqctl reload and SIGHUP: the config file read again, the change applied
//   OpListings      a Python pool's ops listed anew for a rollout, without blocking the loop
//   StatusReport    the status document and pool health
//   MetricsReport   the metrics text (docs/metrics.md); GpuSampler, NVML in a child
// One epoll loop handles the listening socket, client connections, signals (signalfd), worker
// control sockets and output pipes, and a periodic timer; it drains on SIGTERM/SIGINT or a
// stop request. The only other thread is the metrics HTTP listener's (metrics_http.hpp, when
// configured), which touches none of this state: it queues scrapes for the loop (eventfd).
// Never initialises CUDA and links no CUDA library.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "catalog.hpp"
#include "client_registry.hpp"
#include "config.hpp"
#include "config_reload.hpp"
#include "event_loop.hpp"
#include "gpu_sampler.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"
#include "job_recovery.hpp"
#include "job_watch.hpp"
#include "metrics_http.hpp"
#include "metrics_report.hpp"
#include "op_listing.hpp"
#include "pool_outage.hpp"
#include "pool_plan.hpp"
#include "pool_rollout.hpp"
#include "process_launcher.hpp"
#include "runtime_files.hpp"
#include "service_notifier.hpp"
#include "spare_pool.hpp"
#include "status_report.hpp"
#include "test_hooks.hpp"
#include "worker_set.hpp"

namespace gpuq::daemon {

struct SupervisorOptions {
  Config config;
  // The file `config` was read from (empty: none, the defaults), which a reload reads again,
  // and `config` as it said, which a reload compares the file with (the supervisor resolves
  // interpreters and gpu pools' workers in `config`).
  std::string config_path;
  Config file_config;
  std::string runtime_dir;  // already resolved
  // gpuq-worker, and gpuq-gpu-worker, which C++ gpu pools run (empty when this build has none:
  // built without CUDA; those pools are then unavailable). The supervisor only execs them.
  WorkerExecutables executables;
  // The service manager link (READY=1, STATUS=, STOPPING=1, WATCHDOG=1); null: none.
  std::shared_ptr<ServiceNotifier> notifier;
  TestHooks test_hooks;  // off unless GPUQ_TEST_HOOKS=1 (test_hooks.hpp)
  // How workers are started, killed and reaped; null: fork and exec (ForkExecLauncher). A test
  // passes its own to step the supervisor without worker processes.
  std::shared_ptr<ProcessLauncher> launcher;
  // gpuqd's own executable ("/proc/self/exe"), which it runs as its GPU sampler
  // (`--sample-gpus`) for the metrics; empty: no per-GPU metrics.
  std::string self_path;
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
  // One round of the event loop: waits up to `timeout_ms` (-1: no limit) for events and
  // handles them. False once a drain has completed. Errors: epoll_wait's.
  Result<bool> step(int timeout_ms);

  // For tests that step the loop: what a client and `gpuqctl status` would see.
  std::string status_json() const;
  // The metrics text (docs/metrics.md): what `gpuqctl metrics` and the HTTP listener serve.
  std::string metrics_text();
  const std::string& socket_path() const { return files_.socket_path(); }
  const QueueView& queue() const { return files_.queue(); }

 private:
  // Event-loop handlers.
  void on_signal();
  void on_timer();
  void on_child_exit(pid_t pid, int status);
  void handle_message(Client& client, Message& msg);
  void admit_client(Client& client, const std::string& hello_body);
  void on_worker_started(Worker& w);
  void on_client_leaving(Client& client);
  // RestartRequest: starts (or joins) a rollout of the pool; the reply goes when it ends.
  void restart_pool(Client& client, const std::string& body);
  void restart_ended(uint32_t pool, const Result<void>& outcome);
  // CatalogRequest: the pools and ops as published now.
  void send_catalog(Client& client);
  // A reload's end (ConfigReload): the reply to the client that asked (none for SIGHUP).
  void reload_ended(uint64_t requester, const Result<std::vector<std::string>>& outcome);
  // Pools that cannot serve: after each round, each pool's ready workers go to outage_, and a
  // pool that is down stops accepting jobs and has its queued ones failed.
  void update_pools(uint64_t now);
  std::string down_message(uint32_t pool) const;
  // Metrics (docs/metrics.md): for a control request, and the HTTP listener's scrapes.
  void send_metrics(Client& client);
  Result<void> start_metrics_listener();
  void on_metrics_requests();

  // Drain.
  void update_timer();
  void begin_drain(const char* reason);
  void check_drain();

  // The service manager link (service_link.cpp, docs/service.md).
  Result<void> start_service_link();
  void update_service_state();
  void notify_stopping(const char* reason);
  void on_watchdog_timer();
  void on_test_hook_signal();

  Result<void> watch(int fd, Tag tag);
  void cleanup();

  SupervisorOptions options_;
  uint64_t epoch_ = 0;
  uint64_t start_ns_ = 0;
  StampClock job_clock_ = StampClock::kMonotonic;  // what job stamps count in (clock.hpp)
  TscRate tsc_rate_;                               // the TSC's rate, for clients (Welcome)
  StampScale stamps_;  // job stamps to nanoseconds (JobWatch); its rate refreshed each tick
  PoolPlan plan_;
  EventLoop loop_;
  RuntimeFiles files_;
  Catalog catalog_;
  ClientRegistry clients_;
  JobRecovery recovery_;
  JobWatch watch_;
  PoolOutage outage_;
  std::unique_ptr<WorkerSet> workers_;     // made in start(), once the segment has a name
  std::unique_ptr<SparePool> spares_;      // with workers_
  std::unique_ptr<OpListings> listings_;   // a rollout's listing of a Python pool's ops
  std::unique_ptr<PoolRollout> rollouts_;  // with workers_
  std::unique_ptr<ConfigReload> reload_;   // with workers_
  // Clients waiting for a rollout's end: {pool, connection id}.
  std::vector<std::pair<uint32_t, uint64_t>> restart_waiters_;
  std::unique_ptr<StatusReport> status_;
  std::unique_ptr<MetricsReport> metrics_;
  // Scrapes the HTTP listener's thread hands to the loop: it queues a reply and writes the
  // eventfd; the loop renders once for all queued and replies (docs/metrics.md).
  struct MetricsRequests {
    std::mutex mutex;
    std::vector<MetricsHttpServer::Reply> pending;
    UniqueFd event;
  } metrics_requests_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;  // after metrics_requests_: stops first
  std::unique_ptr<GpuSampler> gpu_sampler_;          // where NVML found the GPUs of gpu pools
  UniqueFd signal_fd_, timer_fd_, watchdog_fd_, test_hook_fd_;
  bool draining_ = false;
  uint64_t drain_deadline_ns_ = 0;
  bool done_ = false;
  uint64_t timer_period_ns_ = 0;  // 0: disarmed
  bool ready_notified_ = false;
  std::string last_service_status_;
};

}  // namespace gpuq::daemon
