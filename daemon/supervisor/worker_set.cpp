#include "worker_set.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <string_view>
#include <utility>

#include "child_output.hpp"
#include "gpuq/common/cpu_list.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/posix_call.hpp"
#include "ops.hpp"

namespace gpuq::daemon {
namespace {

constexpr size_t kErrTailBytes = 8192;  // Worker::err_tail

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "ended (status " + std::to_string(status) + ")";
}

Result<void> set_nonblocking(int fd) {
  auto flags = GPUQ_POSIX_CALL(::fcntl, fd, F_GETFL);
  if (!flags) return flags.error();
  if (auto r = GPUQ_POSIX_CALL(::fcntl, fd, F_SETFL, static_cast<int>(*flags) | O_NONBLOCK); !r) {
    return r.error();
  }
  return {};
}

}  // namespace

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

namespace {

// The role of a pool's entry `i`: its active workers, then the entries reserved for growth
// (max_workers), its spares, its surge seats.
void set_role(Worker& w, const PoolConfig& pc, uint32_t i) {
  const uint32_t most = pc.most_workers();
  w.reserve = i >= pc.workers && i < most;
  w.spare = i >= most;
  w.surge = i >= most + pc.spare_workers;
}

}  // namespace

WorkerSet::WorkerSet(WorkerSetOptions options, QueueView& queue, EventLoop& loop,
                     ProcessLauncher& launcher)
    : options_(std::move(options)), queue_(queue), loop_(loop), launcher_(launcher) {}

Result<void> WorkerSet::create() {
  const Config& c = *options_.config;
  const auto configured = static_cast<uint32_t>(c.pools.size());
  generations_.assign(kMaxPools, 1);
  options_.python_ops.resize(kMaxPools);
  // The pools configured, then the free records' entries (a pool a reload adds).
  for (uint32_t p = 0; p < std::max(c.max_pools, configured); ++p) {
    const bool free = p >= configured;
    const uint32_t entries = free ? c.added_pool_workers : c.pools[p].entries();
    for (uint32_t i = 0; i < entries; ++i) {
      auto w = std::make_unique<Worker>();
      w->id = static_cast<uint32_t>(workers_.size());
      w->pool = p;
      w->placement = options_.plan->placements[w->id];
      if (free) {
        w->reserve = true;  // a free record's: no role until a reload adds a pool in it
      } else {
        set_role(*w, c.pools[p], i);
      }
      if (w->surge || w->reserve) {  // dormant until a rollout (or a reload) starts it
        w->state = WorkerState::kStopped;
        queue_.worker(w->id).state.store(static_cast<uint32_t>(WorkerState::kStopped),
                                         std::memory_order_release);
      }
      w->backoff = StartBackoff(BackoffSettings::of(c));
      auto page = MemfdSegment::create("gpuq-worker-" + std::to_string(w->id), kWorkerPrivateBytes);
      if (!page) return page.error();
      w->private_page = std::move(*page);
      new (w->private_page.address()) WorkerPrivate{};
      // The metrics page (job_metrics.hpp): the bucket bounds in job stamp ticks, once for the
      // daemon's life, so that a bucket means the same from one scrape to the next.
      auto* m = new (static_cast<char*>(w->private_page.address()) + kWorkerMetricsOffset)
          WorkerMetrics{};
      for (uint32_t b = 0; b < kMetricBounds; ++b) {
        const double ns = kMetricBoundSeconds[b] * 1e9;
        m->bound_ticks[b] = static_cast<uint64_t>(ns / options_.stamps.ns_per_tick);
      }
      m->enabled = c.job_metrics ? 1 : 0;
      workers_.push_back(std::move(w));
    }
  }
  return {};
}

// The worker's command line and environment: everything it needs is prepared here, before
// the launcher forks.
LaunchSpec WorkerSet::launch_spec(const Worker& w) const {
  const Config& c = *options_.config;
  const PoolConfig& pool = c.pools[w.pool];
  // What plan_pools chose (worker_program.hpp): gpuq-worker, gpuq-gpu-worker, or the
  // pool's interpreter, with or without the GPU.
  const WorkerProgram& program = options_.plan->pools[w.pool].program;
  const bool gpu_worker = program.gpu;
  LaunchSpec spec;
  if (program.kind == WorkerProgramKind::kPython) {
    // A Python worker: the pool's interpreter running gpuq's worker runtime (docs/python.md).
    spec.argv = python_worker_command(*pool.python);
  } else {
    spec.argv = {program.path};
  }
  spec.argv.insert(
      spec.argv.end(),
      {"--queue-segment", options_.segment_name, "--worker-id", std::to_string(w.id), "--pool-id",
       std::to_string(w.pool), "--supervisor-pid", std::to_string(getpid()), "--spin-us",
       std::to_string(spin_us_of(c, pool)), "--job-clock", stamp_clock_name(options_.job_clock),
       "--private-fd", std::to_string(kWorkerPrivateFd), "--stream-reader-timeout-ms",
       std::to_string(c.stream_reader_timeout_ms)});
  if (pool.job_time_limit_ms > 0) {
    spec.argv.insert(spec.argv.end(),
                     {"--job-time-limit-ms", std::to_string(pool.job_time_limit_ms)});
  }
  if (pool.python) {
    for (const auto& m : pool.python->modules) spec.argv.insert(spec.argv.end(), {"--module", m});
    for (const auto& p : pool.python->path) spec.argv.insert(spec.argv.end(), {"--path", p});
    spec.argv.insert(spec.argv.end(), {"--ops", options_.python_ops[w.pool]});
    if (pool.python->allow_callables) spec.argv.emplace_back("--allow-callables");
    if (gpu_worker) spec.argv.emplace_back("--gpu");
  } else {
    for (const std::string& plugin : c.plugins)
      spec.argv.insert(spec.argv.end(), {"--plugin", plugin});
  }
  // Its share of the pool's budget on its GPU (memory_budget.hpp), from its placement: a spare
  // promoted in another's place takes that place's, the same on the same GPU.
  const MemoryShare& memory = w.placement.memory;
  if (gpu_worker && memory.bytes > 0) {
    spec.argv.insert(spec.argv.end(), {"--memory-limit-bytes", std::to_string(memory.bytes)});
  } else if (gpu_worker) {
    char fraction[32];
    std::snprintf(fraction, sizeof fraction, "%.17g", memory.fraction);
    spec.argv.insert(spec.argv.end(), {"--memory-limit-fraction", fraction});
  }
  spec.env =
      pool.python
          ? python_environment(*pool.python)
          : environment_without({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NOTIFY_SOCKET"});
  const WorkerPlacement& at = w.placement;
  // A CPU worker must never see a GPU ("-1"); a GPU worker sees its own GPU only, named by
  // UUID, and PCI bus order makes an index (when there is no UUID) mean what discovery meant.
  spec.env.emplace_back("CUDA_VISIBLE_DEVICES=" + at.visible_devices);
  if (at.gpu >= 0) spec.env.emplace_back("CUDA_DEVICE_ORDER=PCI_BUS_ID");
  spec.env.emplace_back("GPUQ_WORKER_ID=" + std::to_string(w.id));
  const bool own_runtime_dir =
      pool.python && std::any_of(pool.python->env.begin(), pool.python->env.end(),
                                 [](const auto& e) { return e.first == "GPUQ_RUNTIME_DIR"; });
  if (!own_runtime_dir && !options_.runtime_dir.empty()) {
    std::erase_if(spec.env,
                  [](const std::string& e) { return e.starts_with("GPUQ_RUNTIME_DIR="); });
    spec.env.emplace_back("GPUQ_RUNTIME_DIR=" + options_.runtime_dir);
  }
  spec.cpus = at.cpus;
  return spec;
}

Result<void> WorkerSet::spawn(Worker& w) {
  // A client may have scribbled over the layout fields; the new worker reads them at start.
  queue_.restore_shared_layout();
  int sv[2], out[2], err[2];
  if (auto r = GPUQ_POSIX_CALL(::socketpair, AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv); !r) {
    return r.error();
  }
  UniqueFd control(sv[0]), child_control(sv[1]);
  if (auto r = GPUQ_POSIX_CALL(::pipe2, out, O_CLOEXEC); !r) return r.error();
  UniqueFd out_read(out[0]), child_out(out[1]);
  if (auto r = GPUQ_POSIX_CALL(::pipe2, err, O_CLOEXEC); !r) return r.error();
  UniqueFd err_read(err[0]), child_err(err[1]);
  for (int fd : {control.get(), out_read.get(), err_read.get()}) {
    if (auto r = set_nonblocking(fd); !r) return r.error();
  }
  LaunchSpec spec = launch_spec(w);
  spec.control_fd = child_control.get();
  spec.stdout_fd = child_out.get();
  spec.stderr_fd = child_err.get();
  spec.private_fd = w.private_page.fd();

  // Reset the worker's shared state before the launch, not after: once started, the worker
  // stores kReady and busy = 1 itself, and a later store here would overwrite them (the
  // segment would say "starting" and "idle" for good while the worker serves jobs).
  WorkerShm& ws = queue_.worker(w.id);
  ws.busy.store(0, std::memory_order_relaxed);
  ws.asleep.store(0, std::memory_order_relaxed);
  // The private page likewise: idle, not held (the previous process may have died mid-job);
  // a spare held out of the ring from its first instruction, so it never takes a job.
  WorkerPrivate& priv = w.priv();
  priv.job_seq.store(0, std::memory_order_relaxed);
  priv.job.store(0, std::memory_order_relaxed);
  priv.job_started.store(0, std::memory_order_relaxed);
  priv.hold.store(w.spare ? kHoldSpare : 0, std::memory_order_seq_cst);
  ws.state.store(static_cast<uint32_t>(WorkerState::kStarting), std::memory_order_release);
  w.spawned_ns = monotonic_ns();
  w.start_ns = 0;
  w.forced = false;
  w.retiring = false;
  w.generation = generations_[w.pool];
  w.start_timed_out = false;
  auto pid = launcher_.launch(spec);
  if (!pid) return pid.error();
  // The child's ends close here (they live on in the child).
  w.pid = *pid;
  w.outbox.clear();  // messages for the previous process of this worker
  w.waiting_writable = false;
  w.control = std::move(control);
  w.out = std::move(out_read);
  w.err = std::move(err_read);
  w.out_buf.clear();
  w.err_buf.clear();
  w.err_tail.clear();
  w.state = WorkerState::kStarting;
  w.kill_at_ns = 0;
  // A worker the loop cannot hear from could never report ready or be fed: stop it, and let
  // its exit count as a failed start (back-off, then max_start_failures).
  for (auto [fd, tag] :
       {std::pair{w.control.get(), make_tag(Tag::kWorkerControl, w.id)},
        std::pair{w.out.get(), make_tag(Tag::kWorkerOut, uint64_t{w.id} << 1)},
        std::pair{w.err.get(), make_tag(Tag::kWorkerOut, (uint64_t{w.id} << 1) | 1)}}) {
    if (auto r = loop_.add(fd, tag, EPOLLIN); !r) {
      GPUQ_LOG_ERROR("worker %u (pid %d): cannot watch its descriptors (%s): stopping it", w.id,
                     w.pid, r.error().to_string().c_str());
      launcher_.kill(w.pid);
      break;
    }
  }
  // Its own pid, the same value the worker stores (the rest was reset before the launch).
  ws.pid.store(w.pid, std::memory_order_relaxed);
  const WorkerPlacement& at = w.placement;
  // Its CPU, for wakeups on the caller's CPU first (its placement may have moved: a reload that
  // changed the pool's cpus).
  std::atomic_ref<int32_t>(ws.cpu).store(at.cpus.size() == 1 ? at.cpus.front() : -1,
                                         std::memory_order_relaxed);
  GPUQ_LOG_INFO("%s %u (pool %s, cpus %s%s%s) started as pid %d",
                w.surge   ? "surge worker"
                : w.spare ? "spare worker"
                          : "worker",
                w.id, options_.config->pools[w.pool].name.c_str(), cpu_list_text(at.cpus).c_str(),
                at.gpu >= 0 ? ", GPU " : "", at.gpu >= 0 ? at.visible_devices.c_str() : "", w.pid);
  if (on_started_) on_started_(w);
  return {};
}

void WorkerSet::send(Worker& w, MessageType type, const std::string& body, int fd) {
  if (!w.control.valid()) return;
  Worker::Outgoing m{type, body, {}};
  if (fd >= 0) {
    auto dup = GPUQ_POSIX_CALL(::fcntl, fd, F_DUPFD_CLOEXEC, 0);
    if (!dup) {
      GPUQ_LOG_ERROR("cannot queue a message for worker %u: %s", w.id,
                     dup.error().to_string().c_str());
      return;
    }
    m.fd.reset(static_cast<int>(*dup));
  }
  w.outbox.push_back(std::move(m));
  flush_outbox(w);
}

void WorkerSet::send_all(MessageType type, const std::string& body, int fd) {
  for (auto& w : workers_) send(*w, type, body, fd);
}

// Sends queued control messages in order until the worker's queue is full (then waits for
// EPOLLOUT) or the outbox is empty. Each message sent bumps control_seq and wakes the worker.
void WorkerSet::flush_outbox(Worker& w) {
  while (!w.outbox.empty() && w.control.valid()) {
    Worker::Outgoing& m = w.outbox.front();
    std::vector<int> fds;
    if (m.fd.valid()) fds.push_back(m.fd.get());
    auto r = send_message(w.control.get(), m.type, m.body, fds);
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
  if (want_out == w.waiting_writable) return;
  if (auto r = loop_.modify(w.control.get(), make_tag(Tag::kWorkerControl, w.id),
                            EPOLLIN | (want_out ? EPOLLOUT : 0u));
      !r) {
    // Without EPOLLOUT the rest of the outbox would wait for the next message or reply: the
    // worker would miss a client's segment. Stop it; its replacement gets every segment anew.
    GPUQ_LOG_ERROR(
        "worker %u (pid %d): cannot wait for room on its control socket (%s): "
        "stopping it",
        w.id, w.pid, r.error().to_string().c_str());
    launcher_.kill(w.pid);
    return;
  }
  w.waiting_writable = want_out;
}

void WorkerSet::on_control(uint32_t id) {
  Worker& w = *workers_[id];
  flush_outbox(w);  // EPOLLOUT, or room made while reading
  for (;;) {
    if (!w.control.valid()) return;
    auto m = receive_message(w.control.get());
    if (!m) {
      if (m.error().code() != ErrorCode::kTimeout) {
        loop_.remove(w.control.get());
        w.control.reset();  // the exit itself arrives as SIGCHLD
        w.outbox.clear();
        w.waiting_writable = false;
      }
      return;
    }
    if (m->type == MessageType::kWorkerReady) on_ready(w, *m);
  }
}

void WorkerSet::on_ready(Worker& w, const Message& m) {
  auto ready = decode_worker_ready(m.body);
  const std::string& expected =
      options_.config->pools[w.pool].python ? options_.python_ops[w.pool] : options_.plugin_ops;
  if (!ready || ready->plugin_ops != expected) {
    // Its ids would not be the ones clients were given: it would run the wrong ops.
    GPUQ_LOG_ERROR(
        "worker %u (pid %d) loaded other plug-in ops (%s) than gpuqd learned at start (%s): "
        "a plug-in file changed since? stopping it; restart gpuqd to load the new plug-ins",
        w.id, w.pid, ready ? ready->plugin_ops.c_str() : ready.error().to_string().c_str(),
        expected.c_str());
    launcher_.kill(w.pid);  // reaped as a worker that died before it was ready
    return;
  }
  const uint64_t now = monotonic_ns();
  w.state = WorkerState::kReady;
  w.backoff.ready(now);
  w.start_error.clear();
  w.start_ns = std::max<uint64_t>(now - w.spawned_ns, 1);
  w.backend_info = ready->backend;  // empty when the backend had nothing to say
  GPUQ_LOG_INFO("%s %u (pid %d) is ready",
                w.surge   ? "surge worker"
                : w.spare ? "spare worker"
                          : "worker",
                w.id, w.pid);
  if (stopping_ || w.removed) send(w, WorkerStopMessage::kType, encode(WorkerStopMessage{}));
  if (on_ready_) on_ready_(w);
}

void WorkerSet::on_output(uint32_t tag) {
  Worker& w = *workers_[tag >> 1];
  const bool is_err = (tag & 1) != 0;
  UniqueFd& fd = is_err ? w.err : w.out;
  std::string& buf = is_err ? w.err_buf : w.out_buf;
  char chunk[4096];
  for (;;) {
    auto n = fd.valid() ? GPUQ_POSIX_CALL(::read, fd.get(), chunk, sizeof chunk) : Result<long>(0);
    if (n && *n > 0) {
      buf.append(chunk, static_cast<size_t>(*n));
      continue;
    }
    // EAGAIN: all read for now. Another error is as final as the end of the pipe.
    const bool eof = n ? *n == 0 : (errno != EAGAIN && errno != EWOULDBLOCK);
    size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos || (eof && !buf.empty()) ||
           buf.size() > 4096) {
      const size_t len = nl == std::string::npos ? buf.size() : nl;
      GPUQ_LOG_INFO("worker %u (pid %d) %s: %.*s", w.id, w.pid, is_err ? "stderr" : "stdout",
                    static_cast<int>(len), buf.data());
      if (is_err) {
        w.err_tail.append(buf.data(), len).push_back('\n');
        if (w.err_tail.size() > kErrTailBytes) {
          w.err_tail.erase(0, w.err_tail.size() - kErrTailBytes);
        }
      }
      buf.erase(0, nl == std::string::npos ? len : len + 1);
    }
    if (eof && fd.valid()) {
      loop_.remove(fd.get());
      fd.reset();
    }
    return;
  }
}

void WorkerSet::close_channels(Worker& w) {
  // Log what it still had to say, then let go of its descriptors.
  if (w.out.valid()) on_output(w.id << 1);
  if (w.err.valid()) on_output((w.id << 1) | 1);
  for (UniqueFd* fd : {&w.control, &w.out, &w.err}) {
    if (fd->valid()) loop_.remove(fd->get());
    fd->reset();
  }
  w.outbox.clear();
  w.waiting_writable = false;
}

std::optional<WorkerExit> WorkerSet::reap(pid_t pid, int status, uint64_t now) {
  auto it = std::find_if(workers_.begin(), workers_.end(),
                         [pid](const auto& w) { return w->pid == pid; });
  if (it == workers_.end()) return std::nullopt;
  Worker& w = **it;
  close_channels(w);
  WorkerExit exit{w.id, w.pool, pid, describe_exit(status)};
  WorkerShm& ws = queue_.worker(w.id);
  ws.busy.store(0, std::memory_order_relaxed);
  // A worker that died asleep must not absorb the next wakeup meant for a live one.
  ws.asleep.store(0, std::memory_order_seq_cst);
  ws.pid.store(0, std::memory_order_relaxed);
  w.pid = 0;
  if (stopping_ || w.removed) {
    w.state = WorkerState::kStopped;
    ws.state.store(static_cast<uint32_t>(WorkerState::kStopped), std::memory_order_release);
    GPUQ_LOG_INFO("worker %u %s", w.id, exit.how.c_str());
    return exit;
  }
  if (std::exchange(w.retiring, false) && !w.forced) {
    // Stopped by a rollout after its last job: a spare seat is started again at once (at the
    // pool's new generation), a surge seat goes dormant.
    w.state = w.surge || w.reserve ? WorkerState::kStopped : WorkerState::kRestarting;
    ws.state.store(static_cast<uint32_t>(w.state), std::memory_order_release);
    w.respawn_at_ns = now;
    GPUQ_LOG_INFO("worker %u (pid %d) %s, retired%s", w.id, pid, exit.how.c_str(),
                  w.surge || w.reserve ? "" : "; starting it again as a spare");
    return exit;
  }
  w.last_exit = exit.how;
  w.last_exit_line.clear();
  w.last_exit_ns = now;
  if (std::exchange(w.forced, false)) {
    // Stopped for its job, not dead of its own accord: replaced at once, back-off untouched.
    ++w.stops_forced;
    ++w.restarts;
    // A surge seat (one retiring as it was stopped) goes dormant instead, and so does an entry
    // a reload took out of the pool.
    w.state = w.surge || w.reserve ? WorkerState::kStopped : WorkerState::kRestarting;
    ws.state.store(static_cast<uint32_t>(w.state), std::memory_order_release);
    ws.restarts.fetch_add(1, std::memory_order_relaxed);
    w.respawn_at_ns = now;
    GPUQ_LOG_WARN("worker %u (pid %d) %s (stopped for a job that did not end); restarting now",
                  w.id, pid, exit.how.c_str());
    return exit;
  }
  const bool was_ready = w.state == WorkerState::kReady;
  const bool timed_out = std::exchange(w.start_timed_out, false);
  if (timed_out) {
    exit.how = "did not report ready within " + std::to_string(options_.config->start_timeout_ms) +
               " ms (start_timeout_ms) and was killed";
    w.last_exit = exit.how;
  }
  if (!was_ready) {
    ++w.start_failures_total;
    w.start_error = w.err_tail.empty() ? "(it printed nothing on stderr) " + exit.how : w.err_tail;
    if (!timed_out) w.last_exit += " before it was ready";
    // The last line it printed: a Python traceback's exception, a worker's own error line.
    std::string_view err = w.err_tail;
    while (!err.empty() && (err.back() == '\n' || err.back() == ' ')) err.remove_suffix(1);
    const size_t nl = err.rfind('\n');
    w.last_exit_line = err.substr(nl == std::string_view::npos ? 0 : nl + 1);
  }
  if (w.surge || w.reserve) {
    // A surge seat is started by a rollout only: dormant again, whatever ended it (the
    // rollout reads why from start_error and last_exit). An entry a reload took out of the
    // pool (a shrink) likewise.
    w.state = WorkerState::kStopped;
    ws.state.store(static_cast<uint32_t>(w.state), std::memory_order_release);
    GPUQ_LOG_WARN("surge worker %u (pid %d) %s; dormant until the next rollout", w.id, pid,
                  exit.how.c_str());
    return exit;
  }
  const StartBackoff::Next next = w.backoff.exited(was_ready, now);
  w.state = next.failed ? WorkerState::kFailed : WorkerState::kRestarting;
  ws.state.store(static_cast<uint32_t>(w.state), std::memory_order_release);
  ws.restarts.fetch_add(1, std::memory_order_relaxed);
  ++w.restarts;
  w.respawn_at_ns = now + uint64_t{next.delay_ms} * 1'000'000;
  if (next.failed) {
    // Never given up on: whatever stops it from starting (a GPU that fell off the bus, a
    // model file being replaced) may pass, and then the pool is whole again by itself.
    GPUQ_LOG_ERROR(
        "worker %u (pid %d) %s; it failed to start %u times in a row: marked failed, trying "
        "again in %u ms",
        w.id, pid, exit.how.c_str(), w.backoff.start_failures(), next.delay_ms);
  } else {
    GPUQ_LOG_WARN("worker %u (pid %d) %s; restarting in %u ms", w.id, pid, exit.how.c_str(),
                  next.delay_ms);
  }
  return exit;
}

void WorkerSet::retire(Worker& w) {
  if (w.pid == 0) return;
  w.retiring = true;
  send(w, WorkerStopMessage::kType, encode(WorkerStopMessage{}));
  GPUQ_LOG_INFO("worker %u (pid %d): retiring: it stops after its running job", w.id, w.pid);
}

std::string WorkerSet::last_exit_of_pool(uint32_t pool) const {
  const Worker* last = nullptr;
  for (const auto& w : workers_) {
    if (w->pool == pool && !w->last_exit.empty() &&
        (last == nullptr || w->last_exit_ns > last->last_exit_ns)) {
      last = w.get();
    }
  }
  if (last == nullptr) return {};
  std::string text = "worker " + std::to_string(last->id) + " " + last->last_exit;
  if (!last->last_exit_line.empty()) text += ": " + last->last_exit_line;
  return text;
}

void WorkerSet::tick(uint64_t now) {
  for (auto& w : workers_) {
    if (awaits_start(*w) && now >= w->respawn_at_ns) {
      if (auto r = spawn(*w); !r) {
        // Counts as a failed start: the next try comes after the back-off.
        const StartBackoff::Next next = w->backoff.exited(false, now);
        GPUQ_LOG_ERROR("cannot respawn worker %u: %s; trying again in %u ms", w->id,
                       r.error().to_string().c_str(), next.delay_ms);
        w->state = next.failed ? WorkerState::kFailed : WorkerState::kRestarting;
        queue_.worker(w->id).state.store(static_cast<uint32_t>(w->state),
                                         std::memory_order_release);
        w->respawn_at_ns = now + uint64_t{next.delay_ms} * 1'000'000;
      }
    }
    if (const uint64_t due = start_deadline(*w); due != 0 && now >= due) {
      GPUQ_LOG_WARN(
          "worker %u (pid %d) has not reported ready %u ms after it was started "
          "(start_timeout_ms); killing it (a failed start)",
          w->id, w->pid, options_.config->start_timeout_ms);
      w->start_timed_out = true;
      launcher_.kill(w->pid);
    }
    if (w->pid > 0 && w->kill_at_ns != 0 && now >= w->kill_at_ns) {
      GPUQ_LOG_WARN("worker %u (pid %d) did not exit in time; killing it", w->id, w->pid);
      launcher_.kill(w->pid);
      w->kill_at_ns = 0;
    }
  }
}

void WorkerSet::force_stop(Worker& w) {
  if (w.pid <= 0) return;
  w.forced = true;
  launcher_.kill(w.pid);
  if (on_forced_) on_forced_(w);
}

void WorkerSet::stop_all(uint64_t now, uint64_t grace_ns) {
  stopping_ = true;
  send_all(WorkerStopMessage::kType, encode(WorkerStopMessage{}));
  for (auto& w : workers_) {
    if (w->pid > 0) w->kill_at_ns = now + grace_ns;
    if (w->state == WorkerState::kRestarting || w->state == WorkerState::kFailed) {
      w->state = WorkerState::kStopped;
    }
  }
}

void WorkerSet::kill_all() {
  for (auto& w : workers_) {
    if (w->pid > 0) launcher_.kill(w->pid);
  }
}

bool WorkerSet::any_running() const {
  return std::any_of(workers_.begin(), workers_.end(), [](const auto& w) { return w->pid > 0; });
}

Result<void> WorkerSet::add_pool(uint32_t pool, const std::vector<WorkerPlacement>& placements) {
  const PoolConfig& pc = options_.config->pools[pool];
  generations_[pool] = 1;
  uint32_t i = 0;
  for (auto& wp : workers_) {
    Worker& w = *wp;
    if (w.pool != pool) continue;
    if (i < pc.entries()) {
      set_role(w, pc, i);
      w.generation = 1;
      w.placement = placements[i];
      w.backoff = StartBackoff(BackoffSettings::of(*options_.config));
      const std::vector<int>& cpus = w.placement.cpus;
      std::atomic_ref<int32_t>(queue_.worker(w.id).cpu)
          .store(cpus.size() == 1 ? cpus.front() : -1, std::memory_order_relaxed);
    }
    ++i;
  }
  for (auto& wp : workers_) {
    Worker& w = *wp;
    if (w.pool != pool || w.reserve || w.surge) continue;
    if (auto r = spawn(w); !r) return r;
  }
  return {};
}

void WorkerSet::place_pool(uint32_t pool, const std::vector<WorkerPlacement>& placements) {
  size_t i = 0;
  for (auto& w : workers_) {
    if (w->pool != pool || i >= placements.size()) continue;
    w->placement = placements[i++];
  }
}

std::vector<EntryRole> WorkerSet::roles_of(uint32_t pool) const {
  std::vector<EntryRole> out;
  for (const auto& w : workers_) {
    if (w->pool != pool) continue;
    out.push_back(w->spare     ? EntryRole::kSpare
                  : w->surge   ? EntryRole::kSurge
                  : w->reserve ? EntryRole::kReserve
                               : EntryRole::kActive);
  }
  return out;
}

std::vector<WorkerPlacement> WorkerSet::placements_of(uint32_t pool) const {
  std::vector<WorkerPlacement> out;
  for (const auto& w : workers_) {
    if (w->pool == pool) out.push_back(w->placement);
  }
  return out;
}

Result<void> WorkerSet::resize_pool(uint32_t pool, uint32_t workers) {
  uint32_t active = 0;
  for (const auto& w : workers_) {
    if (w->pool == pool && !w->reserve && !w->spare && !w->surge) ++active;
  }
  // Grow: reserve entries become active workers, lowest ids first.
  for (auto& wp : workers_) {
    Worker& w = *wp;
    if (active >= workers) break;
    if (w.pool != pool || !w.reserve || w.pid != 0) continue;
    w.reserve = false;
    w.generation = generations_[pool];
    w.backoff = StartBackoff(BackoffSettings::of(*options_.config));
    ++active;
    if (auto r = spawn(w); !r) return r;
  }
  // Shrink: the highest ids' active workers take no further job, end the one they run and exit;
  // their entries go back to the reserve (dormant) instead of being started again.
  for (auto it = workers_.rbegin(); it != workers_.rend() && active > workers; ++it) {
    Worker& w = **it;
    if (w.pool != pool || w.reserve || w.spare || w.surge) continue;
    w.reserve = true;
    --active;
    if (w.pid > 0) {
      w.priv().hold.store(kHoldSpare, std::memory_order_seq_cst);
      retire(w);
    } else {
      w.state = WorkerState::kStopped;  // it was waiting to be started again: not any more
      queue_.worker(w.id).state.store(static_cast<uint32_t>(WorkerState::kStopped),
                                      std::memory_order_release);
    }
  }
  return {};
}

bool WorkerSet::pool_running(uint32_t pool) const {
  return std::any_of(workers_.begin(), workers_.end(),
                     [&](const auto& w) { return w->pool == pool && w->pid > 0; });
}

void WorkerSet::release_pool(uint32_t pool) {
  for (auto& w : workers_) {
    if (w->pool != pool) continue;
    w->reserve = true;
    w->removed = w->spare = w->surge = false;
    w->state = WorkerState::kStopped;
    queue_.worker(w->id).state.store(static_cast<uint32_t>(WorkerState::kStopped),
                                     std::memory_order_release);
  }
  if (pool < options_.python_ops.size()) options_.python_ops[pool].clear();
}

bool WorkerSet::pool_busy(uint32_t pool) const {
  return std::any_of(workers_.begin(), workers_.end(), [&](const auto& w) {
    return w->pool == pool && w->pid > 0 &&
           (w->priv().job_seq.load(std::memory_order_acquire) & 1) != 0;
  });
}

void WorkerSet::stop_pool(uint32_t pool) {
  for (auto& w : workers_) {
    if (w->pool != pool) continue;
    w->removed = true;
    if (w->pid > 0) {
      send(*w, WorkerStopMessage::kType, encode(WorkerStopMessage{}));
    } else {
      w->state = WorkerState::kStopped;
      queue_.worker(w->id).state.store(static_cast<uint32_t>(WorkerState::kStopped),
                                       std::memory_order_release);
    }
  }
}

bool WorkerSet::any_busy() const {
  return std::any_of(workers_.begin(), workers_.end(), [&](const auto& w) {
    // Not WorkerShm::busy: clients can write the queue segment, and a drain must not wait on
    // a word they set.
    return w->pid > 0 && (w->priv().job_seq.load(std::memory_order_acquire) & 1) != 0;
  });
}

uint64_t WorkerSet::next_due() const {
  uint64_t due = 0;
  auto consider = [&](uint64_t at) {
    if (at != 0 && (due == 0 || at < due)) due = at;
  };
  for (const auto& w : workers_) {
    if (awaits_start(*w)) consider(std::max<uint64_t>(w->respawn_at_ns, 1));
    if (w->pid > 0) consider(w->kill_at_ns);
    consider(start_deadline(*w));
  }
  return due;
}

uint64_t WorkerSet::start_deadline(const Worker& w) const {
  const uint32_t timeout_ms = options_.config->start_timeout_ms;
  if (timeout_ms == 0 || w.pid <= 0 || w.state != WorkerState::kStarting || w.start_timed_out ||
      stopping_) {
    return 0;
  }
  return w.spawned_ns + uint64_t{timeout_ms} * 1'000'000;
}

}  // namespace gpuq::daemon
