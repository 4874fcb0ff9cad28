#include "supervisor.hpp"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <utility>

#include "gpuq/common/log.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/posix_call.hpp"
#include "ops.hpp"

namespace gpuq::daemon {
namespace {

constexpr uint64_t kTickNs = 20'000'000;  // timer period: 20 ms
// The timer's period while nothing but a deadline more than this far away is pending (a
// failed worker's next start, a pool's pool_down_fail_ms): a daemon waiting a minute to try a
// worker again wakes once a second, not fifty times.
constexpr uint64_t kIdleTickNs = 1'000'000'000;
constexpr uint64_t kWorkerExitGraceNs = 5'000'000'000ull;

// MapClient: what a worker needs to map a client's segment (sent with its memfd).
MapClientMessage map_client_message(const Client& c) {
  return {c.index, c.session, c.slot_count, c.geometry};
}

}  // namespace

Supervisor::Supervisor(SupervisorOptions options)
    : options_(std::move(options)),
      files_(options_.config, options_.runtime_dir),
      catalog_(options_.config, plan_, files_.queue()),
      clients_(options_.config, files_.queue(), loop_),
      recovery_(options_.config, files_.queue(), clients_, job_clock_),
      watch_(options_.config, clients_, stamps_),
      outage_(kMaxPools,  // a reload may add pools
              uint64_t{options_.config.pool_down_fail_ms} * 1'000'000) {
  if (!options_.launcher) options_.launcher = std::make_shared<ForkExecLauncher>();
  clients_.set_handlers([this](Client& c, Message& m) { handle_message(c, m); },
                        [this](Client& c) { on_client_leaving(c); });
}

Supervisor::~Supervisor() {
  cleanup();
}

// ---- Start-up ---------------------------------------------------------------------------------

Result<void> Supervisor::start() {
  start_ns_ = monotonic_ns();
  // The epoch names this run (segment, Welcome); a clock-based one serves as well when the
  // kernel has no entropy to give yet.
  if (auto r = GPUQ_POSIX_CALL(::getrandom, &epoch_, sizeof epoch_, 0); !r || *r != sizeof epoch_) {
    epoch_ = start_ns_ ^ static_cast<uint64_t>(getpid());
  }
  Config& cfg = options_.config;
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
  stamps_.clock = job_clock_;
  if (job_clock_ == StampClock::kTsc) stamps_.ns_per_tick = tsc_rate_.ns_per_tick();
  GPUQ_LOG_INFO("job stamps: %s%s%s", stamp_clock_name(job_clock_),
                !cfg.job_clock && !no_tsc.empty() ? ": " : "",
                !cfg.job_clock && !no_tsc.empty() ? no_tsc.c_str() : "");
  // Before anything else: discovery may fork a child, which is only safe while this process
  // has a single thread and nothing to leak, and the worker counts it decides size the segment.
  auto plan = plan_pools(cfg, options_.executables, options_.test_hooks);
  if (!plan) return plan.error();
  plan_ = std::move(*plan);
  if (auto r = learn_plugin_ops(cfg, options_.executables.worker); !r) return r;
  learn_python_ops(cfg, plan_);
  uint64_t worker_count = 0;
  for (const auto& p : cfg.pools) worker_count += p.entries();
  worker_count += uint64_t{free_pool_records(cfg)} * cfg.added_pool_workers;  // their pages
  clients_.raise_descriptor_limit(worker_count);
  if (auto r = files_.lock_dir(); !r) return r;
  if (auto r = files_.create_queue(epoch_, plan_); !r) return r;
  if (auto r = files_.create_socket(); !r) return r;

  sigset_t mask;
  sigemptyset(&mask);
  for (int s : {SIGTERM, SIGINT, SIGCHLD, SIGHUP}) sigaddset(&mask, s);
  if (auto r = GPUQ_POSIX_CALL(::sigprocmask, SIG_BLOCK, &mask, nullptr); !r) {
    return r.error();
  }
  // A write to a departed peer fails with EPIPE instead of killing the daemon.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  if (auto r = GPUQ_POSIX_CALL(::sigaction, SIGPIPE, &ignore, nullptr); !r) return r.error();
  auto sfd = GPUQ_POSIX_CALL(::signalfd, -1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
  if (!sfd) return sfd.error();
  signal_fd_.reset(static_cast<int>(*sfd));
  auto tfd = GPUQ_POSIX_CALL(::timerfd_create, CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (!tfd) return tfd.error();
  timer_fd_.reset(static_cast<int>(*tfd));
  if (auto r = loop_.open(); !r) return r;
  if (auto r = watch(files_.listen_fd(), Tag::kListen); !r) return r;
  if (auto r = watch(signal_fd_.get(), Tag::kSignal); !r) return r;
  if (auto r = watch(timer_fd_.get(), Tag::kTimer); !r) return r;
  if (auto r = start_service_link(); !r) return r;
  if (watchdog_fd_.valid()) {
    if (auto r = watch(watchdog_fd_.get(), Tag::kWatchdog); !r) return r;
  }
  if (test_hook_fd_.valid()) {
    if (auto r = watch(test_hook_fd_.get(), Tag::kTestHook); !r) return r;
  }

  // Workers: pool by pool, placed as plan_pools() decided.
  WorkerSetOptions wo;
  wo.config = &options_.config;
  wo.plan = &plan_;
  wo.segment_name = files_.segment_name();
  wo.runtime_dir = options_.runtime_dir;
  wo.job_clock = job_clock_;
  wo.stamps = stamps_;
  wo.plugin_ops = plugin_op_list();
  for (uint32_t p = 0; p < cfg.pools.size(); ++p) wo.python_ops.push_back(python_op_list(p));
  workers_ = std::make_unique<WorkerSet>(std::move(wo), files_.queue(), loop_, *options_.launcher);
  workers_->set_on_started([this](Worker& w) { on_worker_started(w); });
  spares_ = std::make_unique<SparePool>(*workers_, files_.queue(), *options_.launcher,
                                        kMaxPools);  // a reload may add pools
  // A spare that is ready takes the place of an active worker still waiting to start again;
  // and that of a worker stopped for a job that did not end as soon as it is killed, not when
  // its exit comes (the kernel takes tens of milliseconds to tear down a process with a large
  // address space): its `hold` is up, so it takes no job meanwhile.
  workers_->set_on_ready([this](Worker& w) {
    spares_->spare_ready(w);
    rollouts_->step();  // a new worker of a rollout may take an old one's place now
  });
  workers_->set_on_forced([this](Worker& w) { spares_->vacated(w); });
  listings_ = std::make_unique<OpListings>(loop_, *options_.launcher,
                                           uint64_t{kPythonListTimeoutMs} * 1'000'000);
  rollouts_ = std::make_unique<PoolRollout>(*workers_, *spares_, options_.config, listings_.get());
  rollouts_->set_on_end([this](uint32_t pool, const Result<void>& r) { restart_ended(pool, r); });
  listings_->set_on_done([this](uint32_t pool, Result<std::vector<ListedPythonOp>> ops,
                                const PythonListingDetail& detail) {
    // A pool a reload adds, or one a rollout rolls: never both (a rollout needs workers).
    if (reload_->adding(pool)) {
      reload_->listed(pool, std::move(ops), detail);
    } else {
      rollouts_->listed(pool, std::move(ops), detail);
    }
  });
  // New ops are published once a new worker serves them: connected clients see them then.
  rollouts_->set_on_ops_changed([this](uint32_t) { catalog_.publish(); });
  reload_ = std::make_unique<ConfigReload>(
      ConfigReload::Parts{&options_.config, options_.config_path, &files_.queue(), workers_.get(),
                          rollouts_.get(), &outage_, &catalog_, &recovery_, &plan_,
                          &options_.executables, listings_.get()},
      options_.file_config);
  reload_->set_on_done([this](uint64_t requester, const Result<std::vector<std::string>>& r) {
    reload_ended(requester, r);
  });
  const StatusReport::Sources sources{&options_.config,
                                      &plan_,
                                      &files_.queue(),
                                      workers_.get(),
                                      &clients_,
                                      &recovery_,
                                      &watch_,
                                      &outage_,
                                      spares_.get(),
                                      rollouts_.get(),
                                      options_.runtime_dir,
                                      options_.executables.gpu_worker};
  status_ = std::make_unique<StatusReport>(sources);
  metrics_ = std::make_unique<MetricsReport>(MetricsReport::Sources{
      sources, status_.get(), &stamps_, files_.queue().header().start_unix_ns});
  if (auto r = workers_->create(); !r) return r;
  // Before any worker starts: a port that cannot be bound stops gpuqd before it has spun up
  // workers (and GPU contexts) for nothing. Discovery and the op listings, which fork without
  // exec, have run; from here every child is exec'd at once, safe beside the listener's thread.
  if (auto r = start_metrics_listener(); !r) return r;
  watch_.attach(workers_.get());
  for (const auto& w : workers_->all()) {
    if (w->surge || w->reserve) continue;  // a surge seat runs only during a rollout
    if (auto r = workers_->spawn(*w); !r) return r;
  }
  // Per-GPU metrics where NVML (or its stand-in, under the test hooks) found the GPUs some
  // pool runs on.
  const bool nvml_gpus_in_use =
      plan_.discovery.source == "nvml" &&
      std::any_of(plan_.pools.begin(), plan_.pools.end(),
                  [](const PoolState& p) { return p.available && !p.gpus.empty(); });
  if (nvml_gpus_in_use && !options_.self_path.empty()) {
    gpu_sampler_ =
        std::make_unique<GpuSampler>(options_.self_path, plan_.nvml_library, plan_.discovery.gpus,
                                     1000, loop_, make_tag(Tag::kGpuSampler, 0));
    if (auto r = gpu_sampler_->start(monotonic_ns()); !r) {
      GPUQ_LOG_WARN("GPU sampler: cannot start (no per-GPU metrics): %s",
                    r.error().to_string().c_str());
    }
  }
  catalog_.publish();  // before the first Welcome
  QueueView& queue = files_.queue();
  queue.header().daemon_state.store(static_cast<uint32_t>(DaemonState::kRunning),
                                    std::memory_order_release);
  const Config& c = options_.config;
  std::string pools;
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    pools += (p ? ", " : "") + c.pools[p].name +
             (plan_.pools[p].available
                  ? " (" + std::to_string(c.pools[p].workers) + " workers" +
                        (c.pools[p].spare_workers > 0
                             ? " and " + std::to_string(c.pools[p].spare_workers) + " spare"
                             : std::string()) +
                        ", ring " + std::to_string(queue.pool(p).capacity) + ")"
                  : std::string(" (unavailable)"));
  }
  GPUQ_LOG_INFO("gpuqd %s serving %s; pools: %s", GPUQ_VERSION, files_.socket_path().c_str(),
                pools.c_str());
  return {};
}

Result<void> Supervisor::watch(int fd, Tag tag) {
  return loop_.add(fd, make_tag(tag, 0), EPOLLIN);
}

// ---- Workers and clients ----------------------------------------------------------------------

// A new worker process gets every current client's segment (it reads them before it reports
// ready).
void Supervisor::on_worker_started(Worker& w) {
  clients_.for_each([&](const Client& c) {
    workers_->send(w, MapClientMessage::kType, encode(map_client_message(c)), c.segment.fd());
  });
}

void Supervisor::on_child_exit(pid_t pid, int status) {
  if (gpu_sampler_ && gpu_sampler_->on_exit(pid, status)) return;
  if (listings_ && listings_->on_exit(pid, status)) return;
  auto exit = workers_->reap(pid, status, monotonic_ns());
  if (!exit) return;  // not a worker (a discovery or plug-in listing child is reaped there)
  // A ready spare takes its place first: a job retried below goes to a worker that is warm.
  spares_->vacated(workers_->at(exit->worker));
  const std::optional<ForcedEnd> forced = watch_.take_forced(exit->worker);
  recovery_.worker_died(exit->worker, exit->pool,
                        "worker " + std::to_string(exit->worker) + " (pid " +
                            std::to_string(exit->pid) + ") " + exit->how +
                            " while running this job",
                        forced ? &*forced : nullptr);
  rollouts_->worker_exited(workers_->at(exit->worker));
  rollouts_->step();
}

// ---- Rolling restarts (pool_rollout.hpp) -------------------------------------------------------

void Supervisor::restart_pool(Client& client, const std::string& body) {
  auto refuse = [&](const Error& e) {
    (void)send_message(client.fd.get(), MessageType::kError, error_body(e));
  };
  auto req = decode_restart_request(body);
  if (!req) return refuse(req.error());
  const Config& c = options_.config;
  auto it = std::find_if(c.pools.begin(), c.pools.end(),
                         [&](const PoolConfig& p) { return !p.removed && p.name == req->pool; });
  if (it == c.pools.end()) {
    return refuse(Error(ErrorCode::kUnknownPool,
                        "no pool named '" + req->pool + "' (gpuqctl status lists the pools)"));
  }
  if (draining_) return refuse(Error(ErrorCode::kShuttingDown, "gpuqd is draining"));
  const auto pool = static_cast<uint32_t>(it - c.pools.begin());
  if (!plan_.pools[pool].available) {
    return refuse(Error(ErrorCode::kNoDevice, "pool " + it->name +
                                                  " is unavailable, with no workers to restart: " +
                                                  plan_.pools[pool].reason));
  }
  // The reply goes when the rollout ends (restart_ended, which may run within start()); a
  // second request for a pool being rolled waits for the same end.
  restart_waiters_.emplace_back(pool, client.id);
  if (rollouts_->in_progress(pool)) return;
  if (auto g = rollouts_->start(pool); !g) {
    std::erase(restart_waiters_, std::pair{pool, client.id});
    refuse(g.error());
  }
}

void Supervisor::restart_ended(uint32_t pool, const Result<void>& outcome) {
  reload_->rollout_ended(pool, outcome);
  std::vector<std::pair<uint32_t, uint64_t>> waiting;
  std::erase_if(restart_waiters_, [&](const auto& w) {
    if (w.first != pool) return false;
    waiting.push_back(w);
    return true;
  });
  for (const auto& [p, id] : waiting) {
    Client* client = clients_.find(id);
    if (client == nullptr) continue;  // it went away meanwhile
    if (outcome) {
      (void)send_message(client->fd.get(), RestartReplyMessage::kType,
                         encode(RestartReplyMessage{options_.config.pools[pool].name,
                                                    workers_->generation(pool)}));
    } else {
      (void)send_message(client->fd.get(), MessageType::kError, error_body(outcome.error()));
    }
  }
}

void Supervisor::update_pools(uint64_t now) {
  if (!workers_) return;
  const Config& c = options_.config;
  QueueView& queue = files_.queue();
  for (uint32_t p = 0; p < c.pools.size(); ++p) {
    if (!plan_.pools[p].available) continue;  // no workers: clients are told at Welcome
    if (c.pools[p].removed) continue;         // accepting stays kPoolRemoved
    uint32_t ready = 0;
    bool start_failed = false;
    for (const auto& w : workers_->all()) {
      if (w->pool != p) continue;
      // A busy worker is ready, and so is one stuck on a job that did not end: JobWatch stops
      // it within cancel_grace_ms, and its replacement's start is the pool's clock. A spare
      // serves no job until it is promoted (which a vacant place does at once).
      if (w->state == WorkerState::kReady && !w->spare) ++ready;
      if (w->backoff.start_failures() > 0) start_failed = true;
    }
    PoolShm& ps = queue.pool(p);
    switch (outage_.observe(p, ready, start_failed, now)) {
      case PoolOutage::Change::kDown:
        outage_.set_reason(p, down_message(p));
        set_pool_down_reason(ps, outage_.reason(p));
        GPUQ_LOG_ERROR("%s: its queued and new jobs fail with PoolDown until a worker is ready",
                       outage_.reason(p).c_str());
        if (!draining_) {
          ps.accepting.store(kPoolDown, std::memory_order_seq_cst);
          ps.space.notify_all();  // blocked producers look again and see it
        }
        break;
      case PoolOutage::Change::kUp:
        GPUQ_LOG_INFO("pool %s has a ready worker again: it accepts jobs", c.pools[p].name.c_str());
        if (!draining_) ps.accepting.store(kPoolAccepting, std::memory_order_seq_cst);
        break;
      case PoolOutage::Change::kNone:
        break;
    }
    if (!outage_.down(p)) continue;
    // The text follows the pool's latest exit (a worker that failed again, otherwise).
    if (outage_.set_reason(p, down_message(p))) set_pool_down_reason(ps, outage_.reason(p));
    recovery_.fail_queued(p, outage_.reason(p));
  }
}

// "pool 'py' is down (no ready worker for 10000 ms): worker 1 exited with status 1 before it was
// ready: RuntimeError: cannot load model": the pool, then the cause, whole (a job's message and
// the pool's down_reason hold kMessageBytes; a longer one keeps its beginning and its end).
std::string Supervisor::down_message(uint32_t pool) const {
  const std::string last = workers_->last_exit_of_pool(pool);
  return "pool '" + options_.config.pools[pool].name + "' is down (no ready worker for " +
         std::to_string(options_.config.pool_down_fail_ms) +
         " ms): " + (last.empty() ? std::string("none of its workers is ready") : last);
}

void Supervisor::on_client_leaving(Client& client) {
  recovery_.client_left(client.session);
  watch_.client_leaving(client, monotonic_ns());
  workers_->send_all(UnmapClientMessage::kType,
                     encode(UnmapClientMessage{client.index, client.session}));
}

void Supervisor::handle_message(Client& client, Message& msg) {
  switch (msg.type) {
    case MessageType::kHello:
      admit_client(client, msg.body);
      return;
    case MessageType::kStatusRequest:
      (void)send_message(client.fd.get(), MessageType::kStatusReply, status_json());
      return;
    case MessageType::kMetricsRequest:
      send_metrics(client);
      return;
    case MessageType::kStopRequest:
      (void)send_message(client.fd.get(), StopReplyMessage::kType, encode(StopReplyMessage{}));
      begin_drain("stop requested by a client");
      return;
    case MessageType::kRestartRequest:
      restart_pool(client, msg.body);
      return;
    case MessageType::kCatalogRequest:
      send_catalog(client);
      return;
    case MessageType::kReloadRequest:
      reload_->request(client.id, draining_);
      return;
    default:
      (void)send_message(client.fd.get(), MessageType::kError,
                         error_body(Error(ErrorCode::kInvalidArgument,
                                          "unexpected message type " +
                                              std::to_string(static_cast<int>(msg.type)))));
  }
}

void Supervisor::reload_ended(uint64_t requester, const Result<std::vector<std::string>>& outcome) {
  clients_.apply_weights();    // client_weights is a live key
  if (requester == 0) return;  // SIGHUP: the log has it
  Client* client = clients_.find(requester);
  if (client == nullptr) return;  // it went away meanwhile
  if (outcome) {
    (void)send_message(client->fd.get(), ReloadReplyMessage::kType,
                       encode(ReloadReplyMessage{outcome.value()}));
  } else {
    (void)send_message(client->fd.get(), MessageType::kError, error_body(outcome.error()));
  }
}

void Supervisor::send_catalog(Client& client) {
  (void)send_message(
      client.fd.get(), CatalogReplyMessage::kType,
      encode(CatalogReplyMessage{catalog_.generation(), catalog_.pools(), catalog_.ops()}));
}

// Hello: register the client, hand its segment to every worker, then Welcome it (the workers
// read their control messages before any job of this client can reach them).
void Supervisor::admit_client(Client& client, const std::string& hello_body) {
  auto refuse = [&](const Error& e) {
    GPUQ_LOG_WARN("client pid %d not registered: %s", client.pid, e.to_string().c_str());
    (void)send_message(client.fd.get(), MessageType::kError, error_body(e));
  };
  if (client.registered) {
    (void)send_message(client.fd.get(), MessageType::kError,
                       error_body(Error(ErrorCode::kInvalidArgument,
                                        "Hello on a connection that is already registered")));
    return;
  }
  if (auto r = clients_.admit(client, hello_body, draining_); !r) return refuse(r.error());
  const MapClientMessage map = map_client_message(client);
  workers_->send_all(MapClientMessage::kType, encode(map), client.segment.fd());

  WelcomeMessage welcome;
  welcome.client = map.client;
  welcome.session = map.session;
  welcome.slot_count = map.slot_count;
  welcome.geometry = map.geometry;
  welcome.epoch = epoch_;
  welcome.queue_segment = files_.segment_name();
  welcome.daemon_version = GPUQ_VERSION;
  welcome.job_clock = job_clock_;
  if (job_clock_ == StampClock::kTsc) welcome.tsc_ns_per_tick = tsc_rate_.ns_per_tick();
  welcome.catalog = catalog_.generation();
  welcome.pools = catalog_.pools();
  welcome.ops = catalog_.ops();
  if (auto r = send_message(client.fd.get(), WelcomeMessage::kType, encode(welcome),
                            {client.segment.fd()});
      !r) {
    return refuse(r.error());
  }
  GPUQ_LOG_INFO("client %u registered: pid %d uid %u%s%s, %llu-byte segment", client.index,
                client.pid, client.uid, client.name.empty() ? "" : ", ", client.name.c_str(),
                static_cast<unsigned long long>(client.geometry.segment_bytes));
}

// ---- Loop, signals, drain ---------------------------------------------------------------------

int Supervisor::run() {
  for (;;) {
    auto more = step(-1);
    if (!more) {
      GPUQ_LOG_ERROR("%s", more.error().to_string().c_str());
      return 1;
    }
    if (!*more) break;
  }
  cleanup();
  GPUQ_LOG_INFO("stopped");
  return 0;
}

Result<bool> Supervisor::step(int timeout_ms) {
  if (done_) return false;
  epoll_event events[64];
  auto n = loop_.wait(events, 64, timeout_ms);
  if (!n) return n.error();
  for (int i = 0; i < *n; ++i) {
    const uint64_t tag = events[i].data.u64;
    switch (tag_kind(tag)) {
      case Tag::kListen:
        clients_.on_accept(files_.listen_fd());
        break;
      case Tag::kSignal:
        on_signal();
        break;
      case Tag::kTimer:
        on_timer();
        break;
      case Tag::kConnection:
        clients_.on_readable(tag_id(tag), events[i].events);
        break;
      case Tag::kClientExit:
        clients_.on_exit(tag_id(tag));
        break;
      case Tag::kWorkerControl:
        workers_->on_control(static_cast<uint32_t>(tag_id(tag)));
        break;
      case Tag::kWorkerOut:
        workers_->on_output(static_cast<uint32_t>(tag_id(tag)));
        break;
      case Tag::kWatchdog:
        on_watchdog_timer();
        break;
      case Tag::kTestHook:
        on_test_hook_signal();
        break;
      case Tag::kMetrics:
        on_metrics_requests();
        break;
      case Tag::kGpuSampler:
        if (gpu_sampler_) gpu_sampler_->on_readable(monotonic_ns());
        break;
      case Tag::kListing:
        if (listings_) listings_->on_output(tag_id(tag));
        break;
    }
  }
  update_pools(monotonic_ns());
  if (draining_) check_drain();
  update_timer();
  update_service_state();
  return !done_;
}

// The periodic tick runs only while something is timed: a drain, a client index waiting for
// the rings to pass it, a reference waiting for room in a ring, or a deadline (a respawn, a
// kill, a time limit, the end of a grace, a pool's pool_down_fail_ms) less than one slow period
// away (every kTickNs); slower, the audit while clients are connected and a deadline less than
// kIdleTickNs away (every kAuditNs); and a farther deadline (every kIdleTickNs). A daemon
// without clients and with nothing due does not wake at all.
void Supervisor::update_timer() {
  const uint64_t now = monotonic_ns();
  uint64_t due = 0;
  for (const uint64_t at : {watch_.next_due(), workers_->next_due(), outage_.next_due()}) {
    if (at != 0 && (due == 0 || at < due)) due = at;
  }
  const bool timed = draining_ || clients_.retiring() > 0 || recovery_.pending() ||
                     (due != 0 && due < now + JobRecovery::kAuditNs);
  // The slow tick runs while clients are connected (the audit, limits of new jobs, the jobs of
  // a pool that is down) and while a job is followed (a departed client's, whose grace must
  // end with no client left).
  const bool slow =
      clients_.registered() > 0 || watch_.wants_tick(now) || (due != 0 && due < now + kIdleTickNs);
  const uint64_t period =
      timed ? kTickNs : (slow ? JobRecovery::kAuditNs : (due != 0 ? kIdleTickNs : 0));
  if (period == timer_period_ns_) return;
  const timespec tick{static_cast<time_t>(period / 1'000'000'000),
                      static_cast<long>(period % 1'000'000'000)};
  const itimerspec its{tick, tick};
  if (auto r = GPUQ_POSIX_CALL(::timerfd_settime, timer_fd_.get(), 0, &its, nullptr); !r) {
    // Only a bad descriptor or value fails here; keep the old period and try again next round.
    GPUQ_LOG_ERROR("cannot set the supervisor's timer: %s", r.error().to_string().c_str());
    return;
  }
  timer_period_ns_ = period;
}

void Supervisor::on_signal() {
  signalfd_siginfo si;
  // Until EAGAIN: every pending signal. (A signalfd read returns whole records only.)
  while (GPUQ_POSIX_CALL(::read, signal_fd_.get(), &si, sizeof si)) {
    if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
      begin_drain(si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
    } else if (si.ssi_signo == SIGHUP) {
      GPUQ_LOG_INFO("SIGHUP: reading %s again", options_.config_path.empty()
                                                    ? "the config (none: started without --config)"
                                                    : options_.config_path.c_str());
      reload_->request(0, draining_);
    }
  }
  // SIGCHLD may coalesce: reap every child that has exited.
  while (auto child = options_.launcher->reap()) on_child_exit(child->pid, child->status);
}

void Supervisor::on_timer() {
  uint64_t expirations = 0;
  // EAGAIN: a wakeup for expirations a timerfd_settime has reset; the tick runs all the same.
  (void)GPUQ_POSIX_CALL(::read, timer_fd_.get(), &expirations, sizeof expirations);
  const uint64_t now = monotonic_ns();
  if (job_clock_ == StampClock::kTsc) stamps_.ns_per_tick = tsc_rate_.ns_per_tick();
  recovery_.tick(now);
  watch_.tick(now);
  workers_->tick(now);
  listings_->tick(now);
  rollouts_->step();
  reload_->tick(now);
  clients_.release_retired();
}

void Supervisor::begin_drain(const char* reason) {
  if (draining_) return;
  draining_ = true;
  drain_deadline_ns_ = monotonic_ns() + uint64_t{options_.config.drain_timeout_ms} * 1'000'000;
  rollouts_->abort_all("gpuqd is draining");
  GPUQ_LOG_INFO("draining (%s): no new jobs; finishing queued and running ones", reason);
  notify_stopping(reason);
  QueueView& queue = files_.queue();
  queue.header().daemon_state.store(static_cast<uint32_t>(DaemonState::kDraining),
                                    std::memory_order_seq_cst);
  for (uint32_t p = 0; p < options_.config.pools.size(); ++p) {
    queue.pool(p).accepting.store(kPoolNotAccepting, std::memory_order_seq_cst);
    queue.pool(p).space.notify_all();  // blocked producers re-check and see ShuttingDown
  }
  loop_.remove(files_.listen_fd());
  files_.close_socket();
  check_drain();
}

void Supervisor::check_drain() {
  const uint64_t now = monotonic_ns();
  const QueueView& queue = files_.queue();
  if (!workers_->stopping()) {
    // Dekker with submit(): accepting was cleared (seq_cst) before these loads, and a client
    // raises `submitting` (seq_cst) before it reads `accepting`. So once no client is inside
    // submit, no job can enter a ring any more; then wait for the rings to empty and the
    // workers to go idle.
    bool idle = true;
    for (uint32_t i = 0; i < options_.config.max_clients && idle; ++i) {
      if (queue.client(i).session.load(std::memory_order_acquire) != 0 &&
          queue.client(i).submitting.load(std::memory_order_seq_cst) != 0) {
        idle = false;
      }
    }
    // An unavailable pool's ring has no worker to empty it (and no honest client fills it).
    for (uint32_t p = 0; p < options_.config.pools.size() && idle; ++p) {
      if (plan_.pools[p].available && queue.queue(p).has_values()) idle = false;
    }
    if (idle && workers_->any_busy()) idle = false;
    const bool timed_out = now >= drain_deadline_ns_;
    if (!idle && !timed_out) return;
    if (!idle) {
      GPUQ_LOG_WARN("drain_timeout_ms (%u) passed with jobs still queued or running; stopping",
                    options_.config.drain_timeout_ms);
    }
    workers_->stop_all(now, idle ? kWorkerExitGraceNs : 0);
  }
  if (!workers_->any_running()) done_ = true;
}

std::string Supervisor::status_json() const {
  return status_->document(epoch_, start_ns_, draining_);
}

// ---- Metrics ----------------------------------------------------------------------------------

std::string Supervisor::metrics_text() {
  return metrics_->text(
      draining_, gpu_sampler_ ? gpu_sampler_->latest(monotonic_ns()) : std::vector<GpuSample>{});
}

// MetricsReply: the text in a sealed memfd (it can outgrow a message), its size in the body.
void Supervisor::send_metrics(Client& client) {
  const std::string text = metrics_text();
  auto fd = GPUQ_POSIX_CALL(::memfd_create, "gpuq-metrics", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  Result<void> written;
  if (!fd) {
    written = fd.error();
  } else {
    UniqueFd memfd(static_cast<int>(*fd));
    size_t done = 0;
    while (written && done < text.size()) {
      auto n = GPUQ_POSIX_CALL(::write, memfd.get(), text.data() + done, text.size() - done);
      if (!n) {
        written = n.error();
      } else {
        done += static_cast<size_t>(*n);
      }
    }
    if (written) {
      if (auto r = GPUQ_POSIX_CALL(::fcntl, memfd.get(), F_ADD_SEALS,
                                   F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
          !r) {
        written = r.error();
      }
    }
    if (written) {
      (void)send_message(client.fd.get(), MetricsReplyMessage::kType,
                         encode(MetricsReplyMessage{text.size()}), {memfd.get()});
      return;
    }
  }
  GPUQ_LOG_WARN("cannot hand out the metrics: %s", written.error().to_string().c_str());
  (void)send_message(client.fd.get(), MessageType::kError, error_body(written.error()));
}

// The HTTP listener, when the config names an address (metrics_listen). Its thread never
// touches the supervisor's state: each scrape queues its reply here and wakes the loop.
Result<void> Supervisor::start_metrics_listener() {
  const Config& c = options_.config;
  if (!c.metrics_listen) return {};
  auto efd = GPUQ_POSIX_CALL(::eventfd, 0u, EFD_CLOEXEC | EFD_NONBLOCK);
  if (!efd) return efd.error();
  metrics_requests_.event.reset(static_cast<int>(*efd));
  if (auto r = watch(metrics_requests_.event.get(), Tag::kMetrics); !r) return r;
  MetricsRequests* requests = &metrics_requests_;
  auto server = MetricsHttpServer::start(*c.metrics_listen, [requests](MetricsHttpServer::Reply r) {
    {
      std::lock_guard lock(requests->mutex);
      requests->pending.push_back(std::move(r));
    }
    const uint64_t one = 1;
    // EAGAIN: the counter is full of unread wakeups already; the loop will come.
    (void)!::write(requests->event.get(), &one, sizeof one);
  });
  if (!server) return server.error();
  metrics_http_ = std::move(*server);
  ListenAddress bound = *c.metrics_listen;
  bound.port = metrics_http_->port();
  status_->set_metrics_listen(to_string(bound));
  GPUQ_LOG_INFO("metrics: http://%s/metrics", to_string(bound).c_str());
  return {};
}

void Supervisor::on_metrics_requests() {
  uint64_t count = 0;
  // EAGAIN: a wakeup whose requests an earlier round took.
  (void)GPUQ_POSIX_CALL(::read, metrics_requests_.event.get(), &count, sizeof count);
  std::vector<MetricsHttpServer::Reply> pending;
  {
    std::lock_guard lock(metrics_requests_.mutex);
    pending.swap(metrics_requests_.pending);
  }
  if (pending.empty()) return;
  const std::string text = metrics_text();
  for (auto& reply : pending) reply(text);
}

void Supervisor::cleanup() {
  metrics_http_.reset();  // its thread first: nothing may queue a scrape after this
  gpu_sampler_.reset();
  if (listings_) listings_->stop_all();
  files_.remove();
  if (workers_) workers_->kill_all();
}

}  // namespace gpuq::daemon
