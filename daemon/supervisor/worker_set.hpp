// The supervisor's worker processes: starting each one where the pool plan put it, its control
// channel (messages queued while its socket is full), its stdout and stderr copied to the log,
// its exit (state, start failures, and its back-off from StartBackoff), respawns when the
// back-off has passed (for the daemon's life: a worker whose starts keep failing is `failed`
// and tried again, never given up on), and the stop at the end of a drain. It knows nothing of
// clients or jobs: the Supervisor is told when a worker started (to hand it the clients' segments)
// and gets each exit back from reap() (to recover the jobs the worker had).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config.hpp"
#include "event_loop.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "pool_plan.hpp"
#include "process_launcher.hpp"
#include "start_backoff.hpp"

namespace gpuq::daemon {

struct Worker {
  uint32_t id = 0;
  uint32_t pool = 0;
  pid_t pid = 0;  // 0: not running
  // Where it runs: the plan's placement for this id at first; a spare's promotion swaps the
  // two workers' placements (SparePool).
  WorkerPlacement placement;
  // A spare (SparePool): started with WorkerPrivate::hold = kHoldSpare, so it takes no job
  // until it is promoted. The role belongs to the entry and moves with promotions.
  bool spare = false;
  // A surge seat (rollout_surge_workers; docs/design/live_changes.md): a spare entry whose
  // process runs only while a rollout makes it ready to take an old worker's place. With no
  // process it is dormant: never started by the WorkerSet, hidden from status. The role moves
  // with a swap, as `spare` does.
  bool surge = false;
  // Its pool was removed by a config reload (stop_pool): it is not started again.
  bool removed = false;
  // An entry with no role: of a free pool record (max_pools), until a config reload adds a pool
  // in it (WorkerSet::add_pool), or of a pool's growth reserve (max_workers), until a reload
  // raises its workers (resize_pool). Dormant without a process, hidden as a surge seat is.
  bool reserve = false;
  // The pool generation its current (or last) process was started at (PoolRollout).
  uint32_t generation = 1;
  // Its process was told to stop for a rollout (it took no job since): its exit is no failure,
  // and it is started again at once (a spare seat) or goes dormant (a surge seat).
  bool retiring = false;
  UniqueFd control, out, err;
  std::string out_buf, err_buf;
  // The current process's last lines on stderr (at most kErrTailBytes), and those of the last
  // process that died before it was ready: a Python worker's traceback, for status.
  std::string err_tail;
  std::string start_error;
  // How its last process ended ("exited with status 3", "was killed by signal 9 (Killed) before
  // it was ready"), and when; empty while none has ended. With a failed start, the last line
  // that process printed on stderr (a Python exception, the worker's own error).
  std::string last_exit;
  std::string last_exit_line;
  uint64_t last_exit_ns = 0;
  WorkerState state = WorkerState::kStarting;
  StartBackoff backoff;  // its failed starts in a row, and its next delay
  // What the worker's backend said about itself when it reported ready (a JSON object: a GPU
  // worker's device, compute capability, memory); shown under the worker in status.
  std::string backend_info;
  uint64_t respawn_at_ns = 0;
  uint64_t kill_at_ns = 0;
  uint64_t spawned_ns = 0;       // when the current process was started
  uint64_t start_ns = 0;         // how long it took from then to ready; 0: not ready yet
  bool forced = false;           // being stopped for a job that did not end (force_stop)
  bool start_timed_out = false;  // killed for not reporting ready within start_timeout_ms
  uint64_t stops_forced = 0;     // times this worker was stopped so
  // Counted here for metrics (the copy in WorkerShm is in memory clients can write).
  uint64_t restarts = 0;              // processes started again after one ended
  uint64_t start_failures_total = 0;  // processes that ended before they were ready
  // The page only this worker and the supervisor map (WorkerPrivate), kept across respawns.
  MemfdSegment private_page;
  WorkerPrivate& priv() const { return *static_cast<WorkerPrivate*>(private_page.address()); }
  const WorkerMetrics& metrics() const {
    return *reinterpret_cast<const WorkerMetrics*>(
        static_cast<const char*>(private_page.address()) + kWorkerMetricsOffset);
  }
  // Control messages that did not fit in the worker's socket queue (a Unix datagram queue
  // holds net.unix.max_dgram_qlen, 10 by default): sent in order as it drains (EPOLLOUT).
  struct Outgoing {
    MessageType type;
    std::string body;
    UniqueFd fd;  // a dup of the descriptor to pass, or none
  };
  std::deque<Outgoing> outbox;
  bool waiting_writable = false;  // EPOLLOUT registered on `control`
};

// What reap() tells the Supervisor about a worker that exited.
struct WorkerExit {
  uint32_t worker = 0;
  uint32_t pool = 0;
  pid_t pid = 0;
  std::string how;  // "exited with status 3", "was killed by signal 9 (Killed)"
};

struct WorkerSetOptions {
  const Config* config = nullptr;
  const PoolPlan* plan = nullptr;
  std::string segment_name;  // the queue segment the workers map
  // gpuqd's runtime directory: each worker's GPUQ_RUNTIME_DIR (unless a Python pool's env sets
  // it), so that a client made inside a job (gpuq inside gpuq) reaches the daemon running it.
  std::string runtime_dir;
  StampClock job_clock = StampClock::kMonotonic;
  StampScale stamps;       // the job stamps' rate, for the metrics' bucket bounds
  std::string plugin_ops;  // the plug-in ops gpuqd learned (JSON array); a worker must agree
  // What a Python pool's worker must report instead: its pool's Python ops (by pool).
  std::vector<std::string> python_ops;
};

class WorkerSet {
 public:
  WorkerSet(WorkerSetOptions options, QueueView& queue, EventLoop& loop, ProcessLauncher& launcher);

  // Creates the workers of every pool (not started yet), as the plan placed them, each with its
  // private page. Errors: the memfd's.
  Result<void> create();
  // Called with each worker right after it was started, before it can report ready.
  void set_on_started(std::function<void(Worker&)> fn) { on_started_ = std::move(fn); }
  // Called with each worker once it has reported ready (and was found to agree on its ops).
  void set_on_ready(std::function<void(Worker&)> fn) { on_ready_ = std::move(fn); }
  // Called with a worker force_stop() has just killed (its `hold` is up: it takes no job), before
  // its exit is reaped: its place may be taken at once.
  void set_on_forced(std::function<void(Worker&)> fn) { on_forced_ = std::move(fn); }

  // Starts worker `w`. Errors: the socketpair, pipe, epoll or fork that failed.
  Result<void> spawn(Worker& w);
  // Queues a control message for `w` (and a dup of `fd`, when >= 0) and sends what fits.
  void send(Worker& w, MessageType type, const std::string& body, int fd = -1);
  void send_all(MessageType type, const std::string& body, int fd = -1);

  // Event-loop handlers: the control socket of worker `id` is readable or writable; its
  // stdout or stderr (`tag`: id << 1 | 1 for stderr) has output.
  void on_control(uint32_t id);
  void on_output(uint32_t tag);
  // A child exited: lets go of the worker's descriptors and decides its state (stopped, or
  // restarting or failed, after max_start_failures failed starts in a row, and in either case
  // started again when its back-off has passed). Nothing when `pid` is none of the workers.
  std::optional<WorkerExit> reap(pid_t pid, int status, uint64_t now);
  // Kills `w` for a job that did not end (JobWatch): its exit is not its fault, so it is
  // replaced at once, with no back-off, and counted in stops_forced as well as restarts.
  void force_stop(Worker& w);
  // Respawns the workers whose back-off has passed; kills those past their exit deadline, and
  // those not ready start_timeout_ms after they were started (a failed start).
  void tick(uint64_t now);
  // The earliest respawn, kill or start deadline tick() has to meet (monotonic ns); 0: none.
  uint64_t next_due() const;
  // Whether `w` waits to be started again (after a death, or a failed start: restarting or
  // failed), at its respawn_at_ns.
  bool awaits_start(const Worker& w) const {
    return (w.state == WorkerState::kRestarting || w.state == WorkerState::kFailed) && w.pid == 0 &&
           !stopping_ && !w.removed;
  }

  // The end of a drain: tells every worker to stop, and kills those still running after
  // `grace_ns` (0: at once). From here on no worker is restarted.
  void stop_all(uint64_t now, uint64_t grace_ns);
  bool stopping() const { return stopping_; }
  // Kills every running worker (the daemon's exit).
  void kill_all();

  // A pool's generation: what the processes started from now on run (PoolRollout raises it).
  uint32_t generation(uint32_t pool) const { return generations_[pool]; }
  void set_generation(uint32_t pool, uint32_t g) { generations_[pool] = g; }
  // The op list (python_op_list) a Python pool's workers start with from now on and must report
  // ready with (a rollout re-listed the pool's ops).
  void set_python_ops(uint32_t pool, std::string list) {
    if (options_.python_ops.size() <= pool) options_.python_ops.resize(pool + 1);
    options_.python_ops[pool] = std::move(list);
  }
  // Tells `w`, which serves no job now (a spare, or an active worker whose place a spare has
  // just taken: its `hold` is kHoldSpare), to stop once its running job ends (WorkerStop).
  void retire(Worker& w);

  bool any_running() const;
  bool any_busy() const;  // a running worker in the middle of a job (its private job_seq)
  bool pool_busy(uint32_t pool) const;  // the same, among `pool`'s workers
  // A pool a config reload added in free record `pool` (config->pools[pool] is set): its entries
  // get their roles (workers, spares, surge seats, as create() gives them) and `placements`
  // (one per entry), the rest of the record's entries stay reserve; then its workers and
  // spares are started. Errors: the first start's.
  Result<void> add_pool(uint32_t pool, const std::vector<WorkerPlacement>& placements);
  // A config reload changed cpu pool `pool`'s `workers` (within its max_workers): reserve entries
  // are started as active workers, or the last active workers retire (they end their job, take
  // no other, and their entries go dormant). Errors: the first start's.
  Result<void> resize_pool(uint32_t pool, uint32_t workers);
  // A reload placed `pool` anew (a cpu pool's cpus, a gpu pool's GPUs or memory budgets): its
  // entries, in id order, take `placements` (placement.hpp; entries past them keep theirs).
  // Each process started from now on (a rollout's) runs there; those running stay where they
  // run until they retire.
  void place_pool(uint32_t pool, const std::vector<WorkerPlacement>& placements);
  // Where `pool`'s entries are placed, in id order (what place_pool takes), and their roles.
  std::vector<WorkerPlacement> placements_of(uint32_t pool) const;
  std::vector<EntryRole> roles_of(uint32_t pool) const;
  // Whether a worker of `pool` has a process.
  bool pool_running(uint32_t pool) const;
  // A pool add_pool could not start, none of its workers running: its record's entries are
  // reserve again, for the next pool a reload adds.
  void release_pool(uint32_t pool);
  // A pool removed by a config reload, drained: its workers stop after their running job
  // (WorkerStop) and are not started again; those with no process stay so.
  void stop_pool(uint32_t pool);
  const std::vector<std::unique_ptr<Worker>>& all() const { return workers_; }
  Worker& at(uint32_t id) { return *workers_[id]; }
  // The most recent exit of pool `pool`'s workers, for the error its jobs fail with while it
  // is down: "worker 1 exited with status 1 before it was ready: RuntimeError: ..." (the last
  // line it printed on stderr, for a failed start); empty when none of them has exited.
  std::string last_exit_of_pool(uint32_t pool) const;

 private:
  void flush_outbox(Worker& w);
  void on_ready(Worker& w, const Message& m);
  void close_channels(Worker& w);
  LaunchSpec launch_spec(const Worker& w) const;
  // When `w`, started and not ready, is past its start timeout (monotonic ns); 0: never.
  uint64_t start_deadline(const Worker& w) const;

  WorkerSetOptions options_;
  QueueView& queue_;
  EventLoop& loop_;
  ProcessLauncher& launcher_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<uint32_t> generations_;  // by pool
  std::function<void(Worker&)> on_started_;
  std::function<void(Worker&)> on_ready_;
  std::function<void(Worker&)> on_forced_;
  bool stopping_ = false;
};

const char* worker_state_name(WorkerState s);

// A surge seat with no process: an entry that status, health and metrics leave out.
inline bool dormant(const Worker& w) {
  return (w.surge || w.reserve) && w.pid == 0;
}

}  // namespace gpuq::daemon
