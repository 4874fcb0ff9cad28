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
#include <string>
#include <utility>
#include <vector>

#include "batch_gatherer.hpp"
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
#include "job_validation.hpp"
#include "op_backend.hpp"

namespace gpuq::daemon {
namespace {

constexpr uint64_t kIdleRecheckNs = 1'000'000'000;
// Longest wait for the MapClient of a live client whose job this worker popped.
constexpr uint64_t kMapWaitNs = 500'000'000;
// The longest nap of a worker gathering a batch between looks at its ring (run_batch).
constexpr uint64_t kGatherNapNs = 50'000;
// The part of the idle spin during which this worker counts as `spinning` (see loop()).
constexpr uint64_t kSpinningNs = kSpinPauseOnlyNs;

struct MappedClient {
  uint64_t session = 0;
  MemfdSegment segment;
  ClientSegmentView view;
};

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
    metrics_ = reinterpret_cast<WorkerMetrics*>(static_cast<char*>(private_page_.address()) +
                                                kWorkerMetricsOffset);
    metrics_on_ = metrics_->enabled != 0;
    std::memcpy(bound_ticks_, metrics_->bound_ticks, sizeof bound_ticks_);
    // The last bound is a minute: the cap, an hour, in the same ticks.
    wait_cap_ = bound_ticks_[kMetricBounds - 1] / 60 * kMaxQueueWaitSeconds;
    clients_.resize(l.max_clients);
    pool_ = &queue_.pool(options_.pool_id);
    self_ = &queue_.worker(options_.worker_id);
    ring_ = queue_.ring(options_.pool_id);

    // Control messages queued before start-up (the current clients' segments).
    seen_control_ = self_->control_seq.load(std::memory_order_acquire);
    if (!drain_control()) return 1;

    if (auto started = backend_.start(); !started) {
      GPUQ_LOG_ERROR("cannot start: %s", started.error().to_string().c_str());
      return 1;
    }
    memory_budget_ = backend_.device_memory_budget();
    metrics_->device_memory_budget.store(memory_budget_, std::memory_order_relaxed);
    metrics_->device_memory_used.store(backend_.device_memory_used(), std::memory_order_relaxed);
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
      if (ring_.try_pop(&value)) {
        GPUQ_FAULT_POINT("worker.popped");
        // The next job, if one is queued already: its lines travel while this one runs.
        if (uint32_t next; ring_.peek(&next)) prefetch_job(next);
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
        return ring_.value_at_head() ||
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
      if (has_work() || ring_.has_values()) {
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

  // A job this worker has claimed (its slot RUNNING, naming this worker), from its claim to
  // its end.
  struct Claimed {
    uint32_t value = 0;
    MappedClient* mc = nullptr;
    JobSlot* slot = nullptr;
    uint32_t generation = 0;
    JobDescriptor d;
    JobOutcome out{};
    JobState final_state = JobState::kDone;
    MetricOutcome outcome = MetricOutcome::kOk;
    std::optional<ValidatedJob> v;  // set once it passed its checks: it may run
    std::string message;            // a failure's
    uint64_t rows = 1;              // a batched op's job: its rows (its client's hint, py.r)
    uint64_t claimed_ns = 0;        // a batched op's job: when it was claimed (monotonic)
    uint32_t time_limit_ms = 0;     // a batched op's job: its own, as its client wrote it
  };
  enum class Claim { kClaimed, kDropped, kUnmapped };

  // Runs the job `value` refers to, and then, when it was a batched op's, each job popped
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

  // One job, from its claim to its end; a batched op's goes on to run_batch(). The path of
  // every other job is written out in one piece here, as it was before batches: made of the
  // steps below that the batch path uses (claim, publish, ..., end_job), or inlined into
  // loop(), the hot round trip took about 0.15 µs longer on a 2-vCPU VM (0.85 against 0.68 µs,
  // gpuq_bench_roundtrip, 2026-11-27).
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
    prefetch_job(value);
    // The popped cell is free, and a cell of the client's share is too once its job has left
    // SUBMITTED (the client's recount goes by the slot's state): producers blocked on either
    // are told right after the claim below, or when this entry is dropped (at any return).
    struct SpaceFreed {
      PoolShm& pool;
      bool told = false;
      // After this worker's seq_cst pop (and claim, when there was one): no fence needed.
      void tell() {
        if (!std::exchange(told, true)) pool.space.notify_all_after_rmw();
      }
      ~SpaceFreed() { tell(); }
    } space_freed{*pool_};
    if (ref.slot >= mc.view.slot_count()) return std::nullopt;
    JobSlot& slot = mc.view.slot(ref.slot);

    uint64_t word = slot.state.load(std::memory_order_acquire);
    SlotWord sw = SlotWord::unpack(word);
    if (sw.state != JobState::kSubmitted ||
        (sw.generation & JobRef::kGenerationMask) != ref.generation ||
        slot.desc.pool_id != options_.pool_id) {
      // Cancelled; or a stale entry for an earlier use of the slot, whose 14-bit generation
      // happens to match a job now queued on another pool (that pool's own entry runs it).
      return std::nullopt;
    }
    const SlotWord running{sw.generation, JobState::kRunning, options_.worker_id + 1};
    // seq_cst: the `space` notify below relies on it (EventCount::notify_all_after_rmw).
    if (!slot.state.compare_exchange_strong(word, running.pack(), std::memory_order_seq_cst,
                                            std::memory_order_acquire)) {
      return std::nullopt;  // the client cancelled it first
    }
    space_freed.tell();
    GPUQ_FAULT_POINT("worker.claimed");
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
    } else if (v->op->python != nullptr && v->op->python->batching_on(options_.pool_id).batched()) {
      Claimed c;
      c.value = value;
      c.mc = &mc;
      c.slot = &slot;
      c.generation = sw.generation;
      c.d = d;
      c.out = out;
      c.v.emplace(std::move(*v));
      // Looked up again here, off the path of the jobs that are not batched: one variable
      // for both looks made that path slower (the hot round trip, 0.84 against 0.69 µs).
      return run_batch(std::move(c), c.v->op->python->batching_on(options_.pool_id));
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
      auto r = backend_.run(*v->op, ctx);
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
        set_outcome(out, time_limit_error(*v->op, own_limit_ms(slot)));
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
    const SlotWord done{sw.generation, final_state, options_.worker_id + 1};
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
    if (metrics_on_) record_metrics(d, out, outcome);
    if (memory_budget_ != 0) {
      metrics_->device_memory_used.store(backend_.device_memory_used(), std::memory_order_relaxed);
    }
    return std::nullopt;
  }

  void set_outcome(JobOutcome& out, const Error& e) {
    out.code = static_cast<int32_t>(e.code());
    error_message_ = e.message();
  }

  // Claims a job popped while a batch is gathered: its slot SUBMITTED -> RUNNING. kDropped: a
  // stale or forged reference, or a job its client cancelled first. kUnmapped: the reference's
  // client is not mapped here yet (the reference is still the caller's: a batch never waits
  // for a mapping, nor reads control messages, while it holds claimed jobs).
  Claim claim(uint32_t value, Claimed& c) {
    const JobRef ref = JobRef::unpack(value);
    if (ref.client < clients_.size() && !clients_[ref.client] &&
        queue_.client(ref.client).session.load() != 0) {
      return Claim::kUnmapped;
    }
    if (ref.client >= clients_.size() || !clients_[ref.client]) {
      pool_->space.notify_all();
      return Claim::kDropped;  // an entry of a client that has gone, or a forged one
    }
    MappedClient& mc = *clients_[ref.client];
    prefetch_job(value);
    // The popped cell is free, and a cell of the client's share is too once its job has left
    // SUBMITTED (the client's recount goes by the slot's state): producers blocked on either
    // are told right after the claim below, or when this entry is dropped (at any return).
    struct SpaceFreed {
      PoolShm& pool;
      bool told = false;
      // After this worker's seq_cst pop (and claim, when there was one): no fence needed.
      void tell() {
        if (!std::exchange(told, true)) pool.space.notify_all_after_rmw();
      }
      ~SpaceFreed() { tell(); }
    } space_freed{*pool_};
    if (ref.slot >= mc.view.slot_count()) return Claim::kDropped;
    JobSlot& slot = mc.view.slot(ref.slot);

    uint64_t word = slot.state.load(std::memory_order_acquire);
    SlotWord sw = SlotWord::unpack(word);
    if (sw.state != JobState::kSubmitted ||
        (sw.generation & JobRef::kGenerationMask) != ref.generation ||
        slot.desc.pool_id != options_.pool_id) {
      // Cancelled; or a stale entry for an earlier use of the slot, whose 14-bit generation
      // happens to match a job now queued on another pool (that pool's own entry runs it).
      return Claim::kDropped;
    }
    const SlotWord running{sw.generation, JobState::kRunning, options_.worker_id + 1};
    // seq_cst: the `space` notify below relies on it (EventCount::notify_all_after_rmw).
    if (!slot.state.compare_exchange_strong(word, running.pack(), std::memory_order_seq_cst,
                                            std::memory_order_acquire)) {
      return Claim::kDropped;  // the client cancelled it first
    }
    space_freed.tell();
    GPUQ_FAULT_POINT("worker.claimed");
    c.value = value;
    c.mc = &mc;
    c.slot = &slot;
    c.generation = sw.generation;
    c.out.worker_id = options_.worker_id;
    return Claim::kClaimed;
  }

  // Makes `c` the job this worker is seen to run, for the supervisor's time limits and
  // status, in place of the batch's job published so far (handle_one published the first):
  // the next even job_seq ends that publication, then which job, since when, and the odd
  // job_seq that publishes them (a seqlock's write, as in handle_one). `batch_jobs`: how many
  // jobs the call serves.
  void republish(const Claimed& c, uint32_t batch_jobs) {
    priv_->job_seq.store(++job_seq_, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_release);
    priv_->job.store(c.value, std::memory_order_relaxed);
    priv_->job_started.store(c.out.started_stamp, std::memory_order_relaxed);
    priv_->session.store(c.mc->session, std::memory_order_relaxed);
    if (batch_jobs != published_batch_jobs_) {
      published_batch_jobs_ = batch_jobs;
      priv_->batch_jobs.store(batch_jobs, std::memory_order_relaxed);
    }
    priv_->job_seq.store(++job_seq_, std::memory_order_release);
  }

  // Not running a job any more: after the client's wakeup, off its critical path. seq_cst: the
  // Dekker pair with the supervisor's `hold`, which the loop reads (seq_cst) before it takes
  // another job.
  void unpublish() {
    priv_->job_seq.store(++job_seq_, std::memory_order_seq_cst);
    self_->busy.store(0, std::memory_order_relaxed);
  }

  // After the claim: the job's own copy of its descriptor.
  void take(Claimed& c) {
    JobSlot& slot = *c.slot;
    // The supervisor raises the time-limit bit only for a job it has seen published, so one
    // here now is a leftover meant for the slot's previous job: not this one's.
    if ((slot.cancel_requested.load(std::memory_order_relaxed) & kCancelByTimeLimit) != 0) {
      slot.cancel_requested.fetch_and(~kCancelByTimeLimit, std::memory_order_relaxed);
    }
    // One copy, validated once (no re-reads): the fixed fields, then only the params in use.
    // params_bytes stays as the client wrote it, so that validation rejects one over the limit.
    std::memcpy(&c.d, &slot.desc, offsetof(JobDescriptor, params));
    std::memcpy(c.d.params, slot.desc.params, std::min<uint32_t>(c.d.params_bytes, kMaxParamBytes));
  }

  // The job's deadline and descriptor: `c.v` when it may run, else its failure.
  void check(Claimed& c) {
    // Deadlines are CLOCK_MONOTONIC (stamps may not be): the clock is read only for a job
    // that has one.
    if (c.d.deadline_ns != kNoDeadline && monotonic_ns() > c.d.deadline_ns) {
      fail(c, JobState::kExpired, MetricOutcome::kExpired,
           Error(ErrorCode::kExpired, "deadline passed while the job was queued"));
    } else if (auto v = validate_descriptor(c.d, c.mc->view.arena_bytes(), options_.pool_id); !v) {
      fail(c, JobState::kFailed, MetricOutcome::kFailed, v.error());
    } else {
      c.v.emplace(std::move(*v));
    }
  }

  void fail(Claimed& c, JobState state, MetricOutcome outcome, const Error& e) {
    c.final_state = state;
    c.outcome = outcome;
    c.out.code = static_cast<int32_t>(e.code());
    c.message = e.message();
  }

  OpContext context(const Claimed& c) const {
    char* arena = c.mc->view.arena();
    return OpContext{reinterpret_cast<const std::byte*>(arena + c.v->input_offset),
                     c.v->input_bytes,
                     reinterpret_cast<std::byte*>(arena + c.v->output_offset),
                     c.v->output_capacity,
                     c.v->params,
                     c.slot->cancel_requested,
                     c.v->input_offset,
                     c.v->output_offset};
  }

  void run_one(Claimed& c) {
    const OpContext ctx = context(c);
    GPUQ_FAULT_POINT("worker.running");
    settle(c, backend_.run(*c.v->op, ctx), ctx);
  }

  // The job's end from its op's result.
  void settle(Claimed& c, const Result<OpOutput>& r, const OpContext& ctx) {
    if (r) {
      c.out.output_bytes = r->output_bytes;
      c.out.value = r->value;
    } else if (r.error().code() != ErrorCode::kCancelled) {
      fail(c, JobState::kFailed, MetricOutcome::kFailed, r.error());
      c.out.output_bytes = std::min(ctx.failure_output_bytes, ctx.output_capacity);
    } else if (const uint32_t why = c.slot->cancel_requested.load(std::memory_order_relaxed);
               (why & kCancelByClient) == 0 && (why & kCancelByTimeLimit) != 0) {
      // The op stopped because the supervisor asked it to at the job's time limit.
      fail(c, JobState::kFailed, MetricOutcome::kTimedOut,
           time_limit_error(*c.v->op, own_limit_ms(*c.slot)));
    } else {
      fail(c, JobState::kCancelled, MetricOutcome::kCancelled, r.error());
    }
  }

  // Writes the job's outcome and ends it: its client is told. `yield`: hand the core to a
  // client woken here (a batch's jobs yield once, after the last).
  void end_job(Claimed& c, bool yield = true) {
    JobSlot& slot = *c.slot;
    c.out.finished_stamp = read_stamp(options_.job_clock);
    went_on_ = c.out.finished_stamp;
    if (c.out.code != 0) set_slot_message(slot, c.message);
    std::memcpy(&slot.outcome, &c.out, sizeof c.out);
    GPUQ_FAULT_POINT("worker.before_complete");
    const SlotWord done{c.generation, c.final_state, options_.worker_id + 1};
    // An exchange, seq_cst: as cheap as a store and the fence notify would add after it.
    slot.state.exchange(done.pack(), std::memory_order_seq_cst);
    GPUQ_FAULT_POINT("worker.completed");
    // A client asleep on this job is most likely on this CPU (the pusher wakes the worker
    // pinned to its own CPU): give it the core now instead of spinning in front of it.
    if (c.mc->view.announce_end(slot, true) && yield) (void)sched_yield();  // cannot fail
  }

  // Counts an ended job, off its client's critical path.
  void count(const Claimed& c) {
    if (c.final_state == JobState::kDone) {
      // Only this worker writes it while it lives: no locked instruction needed.
      self_->jobs_done.store(self_->jobs_done.load(std::memory_order_relaxed) + 1,
                             std::memory_order_relaxed);
    } else {
      self_->jobs_failed.fetch_add(1, std::memory_order_relaxed);
    }
    if (metrics_on_) record_metrics(c.d, c.out, c.outcome);
    if (memory_budget_ != 0) {
      metrics_->device_memory_used.store(backend_.device_memory_used(), std::memory_order_relaxed);
    }
  }

  // ---- batches (docs/python.md, "Dynamic batching") ------------------------------------------

  // The op id a queued reference's descriptor names, if its client is mapped here: a hint
  // (the slot is its client's to rewrite until this worker claims it).
  std::optional<uint32_t> queued_op(uint32_t value) const {
    const JobRef ref = JobRef::unpack(value);
    if (ref.client >= clients_.size() || !clients_[ref.client]) return std::nullopt;
    const MappedClient& mc = *clients_[ref.client];
    if (ref.slot >= mc.view.slot_count()) return std::nullopt;
    return std::atomic_ref<const uint32_t>(mc.view.slot(ref.slot).desc.op_id)
        .load(std::memory_order_relaxed);
  }

  // A batched op's job: its rows, as its client's hint says (py.r; 0: its arrays do not share
  // a first axis, so it runs alone). The function's side checks the real shapes.
  static uint64_t rows_hint(const Claimed& c) {
    auto r = c.v->params.get_int("py.r", 1, 0, kMaxBatchSize);
    return r ? static_cast<uint64_t>(*r) : 1;
  }

  // A job's own time limit, as its client wrote it with the descriptor (0: none).
  static uint32_t own_limit_ms(const JobSlot& slot) {
    return std::atomic_ref<const uint32_t>(slot.time_limit_ms).load(std::memory_order_relaxed);
  }

  // The limit `c`'s run is held to: the smaller of its pool's and its own; 0: none.
  uint32_t limit_ms(const Claimed& c) const {
    return effective_time_limit_ms(options_.job_time_limit_ms, c.time_limit_ms);
  }

  // Runs the batch that `first` (claimed, published, checked; a job of a batched op) starts:
  // gathers further queued jobs of its op, then calls the op for all of them. Returns a
  // reference popped while gathering that could not join (another op's job, or one of a
  // client not mapped here yet), for handle() to run next.
  [[gnu::noinline]] std::optional<uint32_t> run_batch(Claimed&& first, BatchSettings settings) {
    const OpInfo* op = first.v->op;
    const uint32_t op_id = first.d.op_id;
    first.rows = rows_hint(first);
    first.time_limit_ms = own_limit_ms(*first.slot);
    first.claimed_ns = monotonic_ns();
    // A job that must run alone gathers no company.
    gatherer_.begin(op_id, settings, first.rows == 0 ? kMaxBatchSize : first.rows,
                    first.claimed_ns);
    batch_.clear();
    batch_.push_back(std::move(first));
    std::optional<uint32_t> carried = gather(op, op_id);
    gatherer_.finish();
    if (metrics_on_) {
      const uint64_t now = read_stamp(options_.job_clock);
      const uint64_t started = batch_.front().out.started_stamp;
      observe_gather(metrics_->batch[metrics_slot(op_id)], bound_ticks_,
                     now > started ? now - started : 0);
    }
    // Jobs cancelled or past their deadline while the batch was gathered leave it.
    const uint64_t now = monotonic_ns();
    std::erase_if(batch_, [&](Claimed& c) {
      if ((c.slot->cancel_requested.load(std::memory_order_relaxed) & kCancelByClient) != 0) {
        fail(c, JobState::kCancelled, MetricOutcome::kCancelled,
             Error(ErrorCode::kCancelled,
                   std::string(op->name) + ": cancelled while its batch was gathered"));
      } else if (c.d.deadline_ns != kNoDeadline && now > c.d.deadline_ns) {
        fail(c, JobState::kExpired, MetricOutcome::kExpired,
             Error(ErrorCode::kExpired, "deadline passed while the job's batch was gathered"));
      } else {
        return false;
      }
      end_job(c);
      count(c);
      return true;
    });
    call_batch(op, op_id);
    unpublish();
    // The jobs handle_one publishes next run alone (it never writes batch_jobs): while no job
    // is published, the page says so again.
    if (published_batch_jobs_ != 1) {
      published_batch_jobs_ = 1;
      priv_->batch_jobs.store(1, std::memory_order_relaxed);
    }
    return carried;
  }

  // Pops and claims queued jobs of op `op_id` into batch_ while the gatherer wants more.
  std::optional<uint32_t> gather(const OpInfo* op, uint32_t op_id) {
    while (!gatherer_.full()) {
      // The supervisor is about to stop this worker, or the first job's time limit has passed
      // (its gathering counts: the limit runs from the claim): call now.
      if (priv_->hold.load(std::memory_order_relaxed) != 0 ||
          (batch_.front().slot->cancel_requested.load(std::memory_order_relaxed) &
           kCancelByTimeLimit) != 0) {
        return std::nullopt;
      }
      uint32_t next;
      if (!ring_.peek(&next)) {
        const uint64_t now = monotonic_ns();
        if (!gatherer_.wait_for_more(now)) return std::nullopt;
        // A short spin, then naps of at most kGatherNapNs: the jobs it waits for come from
        // clients that may need this core to send them (on a machine with more clients than
        // cores a spinning or yielding gatherer took a fair share of it for nothing).
        if (!spin_until([&] { return ring_.value_at_head(); }, kSpinPauseOnlyNs)) {
          const uint64_t nap = std::min<uint64_t>(gatherer_.deadline_ns() - now, kGatherNapNs);
          timespec ts{0, static_cast<long>(nap)};
          (void)::nanosleep(&ts, nullptr);  // EINTR: the loop looks again
        }
        continue;
      }
      // Another op's job at the head stays queued, for the next worker free.
      if (queued_op(next).value_or(op_id) != op_id) return std::nullopt;
      uint32_t value;
      if (!ring_.try_pop(&value)) continue;
      if (queued_op(value).value_or(op_id) != op_id) return value;
      Claimed c;
      const Claim claimed = claim(value, c);
      if (claimed == Claim::kUnmapped) return value;
      if (claimed == Claim::kDropped) continue;
      c.out.started_stamp = read_stamp(options_.job_clock);
      c.claimed_ns = monotonic_ns();
      take(c);
      check(c);
      if (c.v && c.v->op == op) {
        c.rows = rows_hint(c);
        c.time_limit_ms = own_limit_ms(*c.slot);
        gatherer_.add(c.rows == 0 ? 1 : c.rows);
        batch_.push_back(std::move(c));
        continue;
      }
      // It failed its checks, or its client rewrote its op since the look above: it ends
      // (or runs) on its own, now.
      if (c.v) run_one(c);
      end_job(c);
      count(c);
    }
    return std::nullopt;
  }

  // Calls the op for batch_'s jobs and ends each. Jobs of a call stopped at another job's
  // time limit run again, in a call of their own.
  void call_batch(const OpInfo* op, uint32_t op_id) {
    while (!batch_.empty()) {
      republish(governing(), static_cast<uint32_t>(batch_.size()));
      contexts_.clear();
      for (const Claimed& c : batch_) contexts_.push_back(context(c));
      context_ptrs_.clear();
      for (const OpContext& ctx : contexts_) context_ptrs_.push_back(&ctx);
      results_.clear();
      call_rows_.clear();
      GPUQ_FAULT_POINT("worker.running");
      backend_.run_batch(*op, context_ptrs_, results_, call_rows_);
      if (metrics_on_) {
        OpBatchMetrics& m = metrics_->batch[metrics_slot(op_id)];
        for (const uint32_t rows : call_rows_) observe_batch_call(m, rows);
      }
      const uint64_t now = monotonic_ns();
      bool stopped_one = false;
      std::vector<bool>& again = again_;
      again.assign(batch_.size(), false);
      for (size_t i = 0; i < batch_.size(); ++i) {
        Claimed& c = batch_[i];
        const Result<OpOutput> r =
            i < results_.size()
                ? results_[i]
                : Result<OpOutput>(Error(ErrorCode::kInternal,
                                         std::string(op->name) + ": the batch lost this job"));
        if (r || r.error().code() != ErrorCode::kCancelled) {
          settle(c, r, contexts_[i]);
          continue;
        }
        const uint32_t why = c.slot->cancel_requested.load(std::memory_order_relaxed);
        const uint32_t limit = limit_ms(c);
        if ((why & kCancelByClient) != 0) {
          settle(c, r, contexts_[i]);
          stopped_one = true;
        } else if ((why & kCancelByTimeLimit) != 0 ||
                   (limit != 0 && now - c.claimed_ns >= uint64_t{limit} * 1'000'000)) {
          fail(c, JobState::kFailed, MetricOutcome::kTimedOut, time_limit_error(*op, limit));
          stopped_one = true;
        } else {
          again[i] = true;
        }
      }
      // A call that stopped for none of its jobs (the op raised Cancelled of its own accord):
      // its jobs end Cancelled rather than run again and again.
      if (!stopped_one) {
        for (size_t i = 0; i < batch_.size(); ++i) {
          if (again[i]) settle(batch_[i], results_[i], contexts_[i]);
        }
        again.assign(batch_.size(), false);
      }
      bool woke = false;
      for (size_t i = 0; i < batch_.size(); ++i) {
        if (again[i]) continue;
        end_job(batch_[i], false);
        woke = true;
      }
      if (woke) (void)sched_yield();  // for the clients woken above: see end_job
      size_t kept = 0;
      for (size_t i = 0; i < batch_.size(); ++i) {
        if (!again[i]) {
          count(batch_[i]);
        } else {
          if (kept != i) batch_[kept] = std::move(batch_[i]);
          ++kept;
        }
      }
      batch_.resize(kept);
    }
  }

  // The job of batch_ whose time limit passes first (the first job when none has one): the one
  // the supervisor watches.
  Claimed& governing() {
    Claimed* best = &batch_.front();
    uint64_t best_at = UINT64_MAX;
    for (Claimed& c : batch_) {
      const uint32_t limit = limit_ms(c);
      if (limit == 0) continue;
      const uint64_t at = c.claimed_ns + uint64_t{limit} * 1'000'000;
      if (at < best_at) {
        best_at = at;
        best = &c;
      }
    }
    return *best;
  }

  // Counts the job on this worker's metrics page (job_metrics.hpp): plain loads and stores on
  // lines only this worker writes. From the job's own stamps: no clock read here. The submit
  // stamp is the client's: one in the future counts as no wait.
  void record_metrics(const JobDescriptor& d, const JobOutcome& out, MetricOutcome outcome) {
    OpMetrics& m = metrics_->ops[metrics_slot(d.op_id)];
    bump(m.outcomes[static_cast<uint32_t>(outcome)]);
    const uint64_t wait = std::min(
        out.started_stamp > d.submit_stamp ? out.started_stamp - d.submit_stamp : 0, wait_cap_);
    observe(m, kQueueWait, bound_ticks_, wait);
    if (outcome != MetricOutcome::kExpired) {
      observe(m, kRun, bound_ticks_, out.finished_stamp - out.started_stamp);
    }
  }

  // The metrics slot of op `op_id`: remembered after the first job of each op. Ids of no op
  // here (a forged descriptor) and ops past the last free slot share the `other` slot.
  uint32_t metrics_slot(uint32_t op_id) {
    if (op_id < slot_of_.size() && slot_of_[op_id] != kNoSlot) return slot_of_[op_id];
    const bool known = op_id < kMaxMappedOpIds && find_op(op_id) != nullptr;
    const uint32_t slot = find_or_add_slot(known ? op_id : kMetricOtherOp);
    if (op_id < kMaxMappedOpIds) {
      if (op_id >= slot_of_.size()) slot_of_.resize(op_id + 1, kNoSlot);
      slot_of_[op_id] = static_cast<uint16_t>(slot);
    }
    return slot;
  }

  // The slot holding `key` (an op id, or kMetricOtherOp), added if there is none: the page
  // outlives this process, so a restarted worker finds its predecessor's slots. The last slot
  // is kept for `other`, so there always is one.
  uint32_t find_or_add_slot(uint32_t key) {
    const uint32_t n = std::min(metrics_->op_count.load(std::memory_order_relaxed), kMaxMetricOps);
    for (uint32_t i = 0; i < n; ++i) {
      if (metrics_->ops[i].op_id == key) return i;
    }
    if (key != kMetricOtherOp && n >= kMaxMetricOps - 1) return find_or_add_slot(kMetricOtherOp);
    metrics_->ops[n].op_id = key;
    metrics_->op_count.store(n + 1, std::memory_order_release);  // the supervisor reads it
    return n;
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

  // The outcome of a job whose op stopped at its time limit: the smaller of the pool's and
  // the job's own (`job_limit_ms`, as its client wrote it).
  Error time_limit_error(const OpInfo& op, uint32_t job_limit_ms) const {
    const uint32_t limit = effective_time_limit_ms(options_.job_time_limit_ms, job_limit_ms);
    return Error(ErrorCode::kTimedOut, std::string(op.name) +
                                           ": stopped at the job's time limit (" +
                                           std::to_string(limit) + " ms)");
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
  JobRing ring_;
  std::vector<std::optional<MappedClient>> clients_;
  uint32_t seen_control_ = 0;
  bool stopping_ = false;
  std::string error_message_;  // the current job's failure message (handle_one())
  // When the previous job finished, while this worker has gone straight on to the next one
  // (no idle wait, control message or map wait since); 0 otherwise.
  uint64_t went_on_ = 0;
  // Job metrics (job_metrics.hpp), on the private memfd after WorkerPrivate.
  static constexpr uint16_t kNoSlot = UINT16_MAX;
  static constexpr uint32_t kMaxMappedOpIds = 1u << 16;
  WorkerMetrics* metrics_ = nullptr;
  bool metrics_on_ = false;
  uint64_t bound_ticks_[kMetricBounds] = {};
  uint64_t wait_cap_ = 0;          // kMaxQueueWaitSeconds in job stamp ticks
  std::vector<uint16_t> slot_of_;  // op id -> metrics slot
  uint64_t memory_budget_ = 0;     // a GPU worker's device memory budget; 0: none
  // Batches: the gatherer, and what one batch's calls use (kept for their capacity).
  BatchGatherer gatherer_;
  std::vector<Claimed> batch_;
  std::vector<OpContext> contexts_;
  std::vector<const OpContext*> context_ptrs_;
  std::vector<Result<OpOutput>> results_;
  std::vector<uint32_t> call_rows_;
  std::vector<bool> again_;
  uint32_t published_batch_jobs_ = 1;  // this worker's copy of priv_->batch_jobs
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
