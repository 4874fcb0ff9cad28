#include "worker_loop.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstddef>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "batch_runner.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/job_metrics.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/prefetch.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/time_limit.hpp"
#include "job_steps.hpp"
#include "job_validation.hpp"
#include "op_backend.hpp"
#include "step_runner.hpp"
#include "stream_writer.hpp"
#include "worker_metrics.hpp"

namespace gpuq::daemon {
namespace {

constexpr uint64_t kIdleRecheckNs = 1'000'000'000;
// Longest wait for the MapClient of a live client whose job this worker popped.
constexpr uint64_t kMapWaitNs = 500'000'000;
// The part of the idle spin during which this worker counts as `spinning` (see loop()).
constexpr uint64_t kSpinningNs = kSpinPauseOnlyNs;

class Worker {
 public:
  Worker(const WorkerOptions& o, OpBackend& backend) : options_(o), backend_(backend) {}

  int run() {
    auto seg = QueueSegment::open(options_.queue_segment);
    if (!seg) {
      GPUQ_LOG_ERROR("cannot open the queue segment: %s", seg.error().to_string().c_str());
      return 1;
    }
    segment_ = std::move(*seg);
    auto view = QueueView::attach(segment_.address(), segment_.size());
    if (!view) {
      GPUQ_LOG_ERROR("queue segment '%s': %s", options_.queue_segment.c_str(),
                     view.error().message().c_str());
      return 1;
    }
    queue_ = *view;
    const QueueLayout& l = queue_.layout();
    if (options_.worker_id >= l.worker_count || options_.pool_id >= l.pool_count) {
      GPUQ_LOG_ERROR("queue segment '%s' does not match this worker (worker %u, pool %u)",
                     options_.queue_segment.c_str(), options_.worker_id, options_.pool_id);
      return 1;
    }
    if (options_.private_fd < 0) {
      GPUQ_LOG_ERROR("no private page (--private-fd): gpuqd passes one to every worker");
      return 1;
    }
    // Not for processes an op may start: they would outlive this worker with its page.
    if (auto r = GPUQ_POSIX_CALL(::fcntl, options_.private_fd, F_SETFD, FD_CLOEXEC); !r) {
      GPUQ_LOG_ERROR("private page (fd %d): %s", options_.private_fd,
                     r.error().to_string().c_str());
      return 1;
    }
    auto page = MemfdSegment::map(UniqueFd(options_.private_fd), kWorkerPrivateBytes);
    if (!page) {
      GPUQ_LOG_ERROR("cannot map this worker's private page (fd %d): %s", options_.private_fd,
                     page.error().to_string().c_str());
      return 1;
    }
    private_page_ = std::move(*page);
    priv_ = static_cast<WorkerPrivate*>(private_page_.address());
    job_seq_ = priv_->job_seq.load(std::memory_order_relaxed) & ~uint64_t{1};
    // The page outlives the worker: a predecessor that died in a batched call left its count.
    priv_->batch_jobs.store(1, std::memory_order_relaxed);
    metrics_.attach(*reinterpret_cast<WorkerMetrics*>(static_cast<char*>(private_page_.address()) +
                                                      kWorkerMetricsOffset));
    clients_.resize(l.max_clients);
    pool_ = &queue_.pool(options_.pool_id);
    self_ = &queue_.worker(options_.worker_id);
    lanes_ = LanePicker(queue_.queue(options_.pool_id));
    const ClaimedJobs::WorkerParts parts{
        options_, backend_, lanes_,   *pool_,
        *self_,   *priv_,   clients_, std::span<const ClientShm>(&queue_.client(0), l.max_clients),
        metrics_, job_seq_, went_on_};
    batches_.emplace(parts);
    steps_.emplace(parts);

    // Control messages queued before start-up (the current clients' segments).
    seen_control_ = self_->control_seq.load(std::memory_order_acquire);
    if (!drain_control()) return 1;

    if (auto started = backend_.start(); !started) {
      GPUQ_LOG_ERROR("cannot start: %s", started.error().to_string().c_str());
      return 1;
    }
    metrics_.set_memory_budget(backend_.device_memory_budget(), backend_.device_memory_used());
    self_->pid.store(getpid(), std::memory_order_relaxed);
    self_->state.store(static_cast<uint32_t>(WorkerState::kReady), std::memory_order_release);
    WorkerReadyMessage ready;
    ready.worker = options_.worker_id;
    if (const nlohmann::json backend = backend_.describe();
        backend.is_object() && !backend.empty()) {
      ready.backend = backend.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    ready.plugin_ops = backend_.op_list();
    if (auto r = send_message(options_.control_fd, WorkerReadyMessage::kType, encode(ready)); !r) {
      GPUQ_LOG_ERROR("cannot report ready: %s", r.error().to_string().c_str());
      return 1;
    }
    return loop();
  }

 private:
  int loop() {
    const uint64_t spin_ns = uint64_t{options_.spin_us} * 1000;
    for (;;) {
      if (self_->control_seq.load(std::memory_order_acquire) != seen_control_) {
        seen_control_ = self_->control_seq.load(std::memory_order_acquire);
        if (!drain_control()) return 1;
      }
      // The supervisor is about to stop this worker for a job that did not end, or this is a
      // spare not promoted yet: take no new job (docs/design/faults.md, "Jobs that do not end",
      // "Spare workers").
      if (priv_->hold.load(std::memory_order_seq_cst) != 0) {
        if (!wait_while_held()) return 1;
        if (stopping_ && priv_->hold.load(std::memory_order_seq_cst) == kHoldSpare) return 0;
        continue;
      }
      uint32_t value;
      uint32_t lane;
      if (lanes_.pop(&value, &lane)) {
        GPUQ_FAULT_POINT("worker.popped");
        // The next job of that lane, if one is queued already: its lines travel while this one
        // runs.
        if (uint32_t next; lanes_.peek(lane, &next)) prefetch_job(next);
        handle(value);
        if (backend_.must_exit()) {
          GPUQ_LOG_ERROR("this worker cannot run another job: exiting to be replaced");
          return 3;
        }
        continue;
      }
      went_on_ = 0;             // idle from here: the next job's start is read afresh
      if (stopping_) return 0;  // ring drained after WorkerStop
      // Nothing queued: spin a little, then sleep on the pool's event count.
      auto has_work = [&] {
        return lanes_.value_ready() ||
               self_->control_seq.load(std::memory_order_acquire) != seen_control_;
      };
      // First the pause-only phase, counted in the pool's `spinning` so that pushers need not
      // wake a sleeping worker meanwhile (the decrement comes before the sleep protocol's
      // re-check, so a push that saw this worker spinning is popped or seen by that re-check);
      // then the rest of the spin, which yields the core between looks.
      pool_->spinning.fetch_add(1, std::memory_order_seq_cst);
      const bool found = spin_until(has_work, std::min(spin_ns, kSpinningNs));
      pool_->spinning.fetch_sub(1, std::memory_order_seq_cst);
      if (found || (spin_ns > kSpinningNs && spin_until(has_work, spin_ns - kSpinningNs))) {
        continue;
      }
      // Register, mark this worker asleep, raise the pool's sleeper count, then re-check (see
      // QueueView::wake_worker for why no wakeup is lost).
      EventCount::Key key = self_->wake.prepare_wait();
      self_->asleep.store(1, std::memory_order_seq_cst);
      pool_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      // Pushers load `sleepers` after their seq_cst push with no fence of their own
      // (wake_worker_after_push): this one orders the raise before the re-check's loads.
      std::atomic_thread_fence(std::memory_order_seq_cst);
      // The lanes whose bits are set (settle_active_bits: one found empty has its bit cleared,
      // then looked at again). A pusher whose mark this misses sees `sleepers` raised.
      if (has_work() || lanes_.queue().settle_active_bits()) {
        self_->asleep.store(0, std::memory_order_relaxed);
        pool_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
        self_->wake.cancel_wait();
        continue;
      }
      // Bounded, as a safety net: a producer killed between its cell CAS and its notify leaves
      // a value that no notify announces. One wakeup a second costs nothing measurable.
      self_->wake.wait(key, monotonic_ns() + kIdleRecheckNs);
      self_->asleep.store(0, std::memory_order_relaxed);
      pool_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // `hold` is up. kHoldStop: the supervisor saw this worker's job still running when it
  // decided to stop it, and either kills this process now or, having found the job ended after
  // all, lowers `hold` again; looked at every 5 ms. kHoldSpare: a spare, which sleeps on its
  // control socket until the supervisor promotes it (it lowers `hold`, then sends
  // WorkerPromote) or stops it (WorkerStop: returns with stopping_ set). Reads control
  // messages meanwhile. False if the supervisor is gone.
  bool wait_while_held() {
    went_on_ = 0;
    for (;;) {
      const uint32_t hold = priv_->hold.load(std::memory_order_seq_cst);
      if (hold == 0 || (hold == kHoldSpare && stopping_)) return true;
      pollfd p{options_.control_fd, POLLIN, 0};
      // EINTR or a timeout: the loop looks at `hold` and the socket again either way.
      (void)::poll(&p, 1, hold == kHoldSpare ? -1 : 5);
      seen_control_ = self_->control_seq.load(std::memory_order_acquire);
      if (!drain_control()) return false;
    }
  }

  // Processes every control message waiting on the socket. False if the supervisor is gone.
  bool drain_control() {
    went_on_ = 0;
    for (;;) {
      auto m = receive_message(options_.control_fd);
      if (!m) {
        if (m.error().code() == ErrorCode::kTimeout) return true;  // none left
        GPUQ_LOG_ERROR("control socket: %s", m.error().to_string().c_str());
        return false;
      }
      if (m->type == WorkerStopMessage::kType) {
        stopping_ = true;
        continue;
      }
      if (m->type == MapClientMessage::kType && !m->fds.empty()) {
        auto map = decode_map_client(m->body);
        if (!map) {
          GPUQ_LOG_ERROR("bad control message from the supervisor: %s",
                         map.error().to_string().c_str());
          continue;
        }
        if (map->client >= clients_.size()) continue;
        auto seg = MemfdSegment::map(std::move(m->fds[0]), map->geometry.segment_bytes);
        if (!seg) {
          GPUQ_LOG_ERROR("cannot map client %u: %s", map->client, seg.error().to_string().c_str());
          continue;
        }
        unmap_client(map->client);  // an earlier holder of the index, if this worker missed it
        auto& mc = clients_[map->client].emplace();
        mc.session = map->session;
        mc.segment = std::move(*seg);
        mc.view = ClientSegmentView(mc.segment.address(), map->geometry, map->slot_count);
        backend_.client_mapped(map->client, mc.segment.address(), mc.segment.size());
      } else if (m->type == UnmapClientMessage::kType) {
        auto unmap = decode_unmap_client(m->body);
        if (!unmap) {
          GPUQ_LOG_ERROR("bad control message from the supervisor: %s",
                         unmap.error().to_string().c_str());
          continue;
        }
        if (unmap->client < clients_.size() && clients_[unmap->client] &&
            clients_[unmap->client]->session == unmap->session) {
          unmap_client(unmap->client);
        }
      }
    }
  }

  // Runs the job `value` refers to, and then, when it was a batched or step op's, each job popped
  // while its batch was gathered that could not join it.
  void handle(uint32_t value) {
    for (;;) {
      const std::optional<uint32_t> carried = handle_one(value);
      if (!carried) [[likely]]
        return;
      if (backend_.must_exit()) return;  // a popped job left behind is requeued
      if (priv_->hold.load(std::memory_order_seq_cst) != 0 && !wait_while_held()) return;
      value = *carried;
    }
  }

  // Whether a job of Python op `op` runs with others: every job of a step op (a stream too),
  // and a batched op's unless it streams (its parts are its own).
  bool runs_with_others(const PythonOp& op, uint32_t stream_window) const noexcept {
    const BatchSettings b = op.batching_on(options_.pool_id);
    return b.step || (stream_window == 0 && b.batched());
  }

  // One job, from its claim to its end; a batched op's goes on to the batch runner
  // (batch_runner.cpp), a step op's to the step runner (step_runner.cpp), once claimed,
  // published and checked. The path of every other job is
  // written out in one piece here, as it was before batches: made of the steps the batch
  // runner takes (publish, ..., end_job), or inlined into loop(), the hot round trip took
  // about 0.15 µs longer on a 2-vCPU VM (0.85 against 0.68 µs, gpuq_bench_roundtrip,
  // 2026-11-27). The claim alone is shared (claim_slot, always inlined): written once, the
  // round trip did not get slower (p50 0.81 against 0.84 µs, bench/results/
  // slot-claim-ab-2026-12-05.txt).
  [[gnu::noinline]] std::optional<uint32_t> handle_one(uint32_t value) {
    const JobRef ref = JobRef::unpack(value);
    if (ref.client < clients_.size() && !clients_[ref.client] &&
        self_->control_seq.load(std::memory_order_acquire) != seen_control_) {
      // A client that has just connected: its MapClient message was sent before its Welcome,
      // so it is waiting on the control socket now.
      seen_control_ = self_->control_seq.load(std::memory_order_acquire);
      drain_control();
    }
    if (ref.client < clients_.size() && !clients_[ref.client]) wait_for_map(ref.client);
    if (ref.client >= clients_.size() || !clients_[ref.client]) {
      pool_->space.notify_all();
      return std::nullopt;  // an entry of a client that has gone, or a forged one
    }
    MappedClient& mc = *clients_[ref.client];
    // The claim the batch runner makes too, written once (job_steps.hpp) and inlined here.
    const SlotClaim claimed = claim_slot(value, mc, *pool_, options_.pool_id, options_.worker_id);
    if (claimed.slot == nullptr) return std::nullopt;
    JobSlot& slot = *claimed.slot;
    JobOutcome out{};
    out.worker_id = options_.worker_id;
    // A job taken straight after the previous one starts when that one finished: one stamp
    // per job instead of two. The difference is the pop and claim, well under a microsecond.
    out.started_stamp = went_on_ != 0 ? went_on_ : read_stamp(options_.job_clock);
    // For the supervisor's time limits and status, on the private page: which job, since
    // when, then the odd job_seq that publishes them (a seqlock's write; the release fence
    // keeps these stores after the previous job's even job_seq).
    std::atomic_thread_fence(std::memory_order_release);
    priv_->job.store(value, std::memory_order_relaxed);
    priv_->job_started.store(out.started_stamp, std::memory_order_relaxed);
    priv_->session.store(mc.session, std::memory_order_relaxed);
    priv_->job_seq.store(++job_seq_, std::memory_order_release);
    // The supervisor raises the time-limit bit only for a job it has seen published, so one
    // here now is a leftover meant for the slot's previous job: not this one's.
    if ((slot.cancel_requested.load(std::memory_order_relaxed) & kCancelByTimeLimit) != 0) {
      slot.cancel_requested.fetch_and(~kCancelByTimeLimit, std::memory_order_relaxed);
    }
    self_->busy.store(1, std::memory_order_relaxed);
    // One copy, validated once (no re-reads): the fixed fields, then only the params in use.
    // params_bytes stays as the client wrote it, so that validation rejects one over the limit.
    JobDescriptor d;
    std::memcpy(&d, &slot.desc, offsetof(JobDescriptor, params));
    std::memcpy(d.params, slot.desc.params, std::min<uint32_t>(d.params_bytes, kMaxParamBytes));
    JobState final_state = JobState::kDone;
    MetricOutcome outcome = MetricOutcome::kOk;

    // Deadlines are CLOCK_MONOTONIC (stamps may not be): the clock is read only for a job that
    // has one.
    if (d.deadline_ns != kNoDeadline && monotonic_ns() > d.deadline_ns) {
      final_state = JobState::kExpired;
      outcome = MetricOutcome::kExpired;
      set_outcome(out, Error(ErrorCode::kExpired, "deadline passed while the job was queued"));
    } else if (auto v = validate_descriptor(d, mc.view.arena_bytes(), options_.pool_id); !v) {
      final_state = JobState::kFailed;
      outcome = MetricOutcome::kFailed;
      set_outcome(out, v.error());
    } else if (v->op->python != nullptr && runs_with_others(*v->op->python, v->stream_window)) {
      ClaimedJob c;
      c.value = value;
      c.mc = &mc;
      c.slot = &slot;
      c.generation = claimed.generation;
      c.d = d;
      c.out = out;
      c.v.emplace(std::move(*v));
      // Looked up again here, off the path of the jobs that are not batched: one variable
      // for both looks made that path slower (the hot round trip, 0.84 against 0.69 µs).
      const BatchSettings b = c.v->op->python->batching_on(options_.pool_id);
      return b.step ? steps_->run(std::move(c), b) : batches_->run(std::move(c), b);
    } else {
      char* arena = mc.view.arena();
      OpContext ctx{reinterpret_cast<const std::byte*>(arena + v->input_offset),
                    v->input_bytes,
                    reinterpret_cast<std::byte*>(arena + v->output_offset),
                    v->output_capacity,
                    v->params,
                    slot.cancel_requested,
                    v->input_offset,
                    v->output_offset};
      GPUQ_FAULT_POINT("worker.running");
      auto r = v->stream_window == 0
                   ? backend_.run(*v->op, ctx)
                   : run_streaming(backend_, *v->op, ctx, slot, mc.view, v->stream_window,
                                   options_.stream_reader_timeout_ms);
      if (r) {
        out.output_bytes = r->output_bytes;
        out.value = r->value;
      } else if (r.error().code() != ErrorCode::kCancelled) {
        final_state = JobState::kFailed;
        outcome = MetricOutcome::kFailed;
        set_outcome(out, r.error());
        out.output_bytes = std::min(ctx.failure_output_bytes, ctx.output_capacity);
      } else if (const uint32_t why = slot.cancel_requested.load(std::memory_order_relaxed);
                 (why & kCancelByClient) == 0 && (why & kCancelByTimeLimit) != 0) {
        // The op stopped because the supervisor asked it to at the job's time limit.
        final_state = JobState::kFailed;
        outcome = MetricOutcome::kTimedOut;
        set_outcome(out,
                    time_limit_error(*v->op, effective_time_limit_ms(options_.job_time_limit_ms,
                                                                     own_time_limit_ms(slot))));
      } else {
        final_state = JobState::kCancelled;
        outcome = MetricOutcome::kCancelled;
        set_outcome(out, r.error());
      }
    }
    out.finished_stamp = read_stamp(options_.job_clock);
    went_on_ = out.finished_stamp;
    if (out.code != 0) set_slot_message(slot, error_message_);
    std::memcpy(&slot.outcome, &out, sizeof out);
    GPUQ_FAULT_POINT("worker.before_complete");
    const SlotWord done{claimed.generation, final_state, options_.worker_id + 1};
    // An exchange, seq_cst: as cheap as a store and the fence notify would add after it.
    slot.state.exchange(done.pack(), std::memory_order_seq_cst);
    GPUQ_FAULT_POINT("worker.completed");
    // A client asleep on this job is most likely on this CPU (the pusher wakes the worker
    // pinned to its own CPU): give it the core now instead of spinning in front of it.
    if (mc.view.announce_end(slot, true)) (void)sched_yield();  // cannot fail on Linux
    // Not running a job any more: after the client's wakeup, off its critical path. seq_cst:
    // the Dekker pair with the supervisor's `hold`, which the loop reads (seq_cst) before it
    // takes another job.
    priv_->job_seq.store(++job_seq_, std::memory_order_seq_cst);
    self_->busy.store(0, std::memory_order_relaxed);
    if (final_state == JobState::kDone) {
      // Only this worker writes it while it lives: no locked instruction needed.
      self_->jobs_done.store(self_->jobs_done.load(std::memory_order_relaxed) + 1,
                             std::memory_order_relaxed);
    } else {
      self_->jobs_failed.fetch_add(1, std::memory_order_relaxed);
    }
    if (metrics_.on()) metrics_.record(d, out, outcome);
    if (metrics_.tracks_memory()) metrics_.set_memory_used(backend_.device_memory_used());
    return std::nullopt;
  }

  void set_outcome(JobOutcome& out, const Error& e) {
    out.code = static_cast<int32_t>(e.code());
    error_message_ = e.message();
  }

  // Starts fetching the lines a job's handling touches, both last written by its client (the
  // slot's state word and descriptor), so that their misses overlap each other and the
  // current job instead of following one another. A hint: `value` may be stale or forged;
  // nothing is read.
  void prefetch_job(uint32_t value) const noexcept {
    const JobRef ref = JobRef::unpack(value);
    if (ref.client >= clients_.size() || !clients_[ref.client]) return;
    const MappedClient& mc = *clients_[ref.client];
    if (ref.slot >= mc.view.slot_count()) return;
    prefetch_for_write(&mc.view.slot(ref.slot).state);
    prefetch_for_read(&mc.view.slot(ref.slot).desc);
  }

  // A job of a client this worker has not mapped, whose index a live client holds: its
  // MapClient is on the way (a worker that has just started gets one per client, more than its
  // socket queue holds at once; the supervisor sends the rest as it drains). Waits for it,
  // for a bounded time: the `session` word is in shared memory, and a forged reference must
  // not stall a worker for long.
  void wait_for_map(uint32_t client) {
    went_on_ = 0;
    const uint64_t deadline = monotonic_ns() + kMapWaitNs;
    while (!clients_[client] && queue_.client(client).session.load() != 0) {
      const uint64_t now = monotonic_ns();
      if (now >= deadline) {
        GPUQ_LOG_WARN("client %u holds an index but was never mapped here: dropping its job",
                      client);
        return;
      }
      pollfd p{options_.control_fd, POLLIN, 0};
      // Only a pause: whatever poll says, the loop reads the control sequence and the clock
      // again.
      (void)::poll(&p, 1,
                   static_cast<int>(std::min<uint64_t>((deadline - now) / 1'000'000 + 1, 50)));
      seen_control_ = self_->control_seq.load(std::memory_order_acquire);
      if (!drain_control()) return;
    }
  }

  void unmap_client(uint32_t client) {
    auto& mc = clients_[client];
    if (!mc) return;
    backend_.client_unmapping(client, mc->segment.address(), mc->segment.size());
    mc.reset();
  }

  WorkerOptions options_;
  OpBackend& backend_;
  QueueSegment segment_;
  QueueView queue_;
  MemfdSegment private_page_;
  WorkerPrivate* priv_ = nullptr;
  uint64_t job_seq_ = 0;  // this worker's copy of priv_->job_seq
  PoolShm* pool_ = nullptr;
  WorkerShm* self_ = nullptr;
  LanePicker lanes_;
  MappedClients clients_;
  uint32_t seen_control_ = 0;
  bool stopping_ = false;
  std::string error_message_;  // the current job's failure message (handle_one())
  // When the previous job finished, while this worker has gone straight on to the next one
  // (no idle wait, control message or map wait since); 0 otherwise.
  uint64_t went_on_ = 0;
  // Job metrics (job_metrics.hpp), on the private memfd after WorkerPrivate.
  WorkerMetricsWriter metrics_;
  // A batched op's jobs (set up in run(): it works on the parts above).
  std::optional<BatchRunner> batches_;
  // A step op's sequences (the same).
  std::optional<StepRunner> steps_;
};

}  // namespace

int run_worker(const WorkerOptions& options, OpBackend& backend) {
  // Die with the supervisor; if it is already gone, do not start.
  if (auto r = GPUQ_POSIX_CALL(::prctl, PR_SET_PDEATHSIG, SIGKILL); !r) {
    GPUQ_LOG_ERROR("cannot tie the worker to the supervisor: %s", r.error().to_string().c_str());
    return 1;
  }
  if (getppid() != options.supervisor_pid) return 1;
  // A write to a departed peer fails with EPIPE instead of killing the worker.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  if (auto r = GPUQ_POSIX_CALL(::sigaction, SIGPIPE, &ignore, nullptr); !r) {
    GPUQ_LOG_ERROR("cannot ignore SIGPIPE: %s", r.error().to_string().c_str());
    return 1;
  }
  // The control socket is read without blocking (drain_control).
  auto flags = GPUQ_POSIX_CALL(::fcntl, options.control_fd, F_GETFL);
  if (flags) {
    flags = GPUQ_POSIX_CALL(::fcntl, options.control_fd, F_SETFL,
                            static_cast<int>(*flags) | O_NONBLOCK);
  }
  if (!flags) {
    GPUQ_LOG_ERROR("cannot set up the control socket: %s", flags.error().to_string().c_str());
    return 1;
  }
  Worker w(options, backend);
  return w.run();
}

}  // namespace gpuq::daemon
