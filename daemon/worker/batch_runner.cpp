#include "batch_runner.hpp"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <utility>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/event_count.hpp"
#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/time_limit.hpp"
#include "stream_writer.hpp"

namespace gpuq::daemon {
namespace {

// The longest nap of a worker gathering a batch between looks at its lanes (gather()).
constexpr uint64_t kGatherNapNs = 50'000;

// A job's rows, as its client wrote them (py.r; 0: its arrays do not share a first axis, so it
// runs alone). Python's side of the call checks that the arrays have no more rows than that
// (gpuq._batching.check_rows), so a batch's call never gets more than max_batch_size rows.
uint64_t rows_of(const ParamBlock& params) {
  auto r = params.get_int(kPythonRowsParam, 1, 0, kMaxBatchSize);
  return r ? static_cast<uint64_t>(*r) : 1;
}

uint64_t rows_hint(const BatchRunner::Job& c) {
  return rows_of(c.v->params);
}

// The rows a job counts for in a batch it joins: one for a job that would run alone.
uint64_t counted(uint64_t rows) {
  return rows == 0 ? 1 : rows;
}

void fail(BatchRunner::Job& c, JobState state, MetricOutcome outcome, const Error& e) {
  c.final_state = state;
  c.outcome = outcome;
  c.out.code = static_cast<int32_t>(e.code());
  c.message = e.message();
}

}  // namespace

std::optional<uint32_t> BatchRunner::run(Job&& first, BatchSettings settings) {
  const OpInfo* op = first.v->op;
  const uint32_t op_id = first.d.op_id;
  // Gathered within the first job's priority level (its client's to write: any level will do).
  const uint32_t rank = priority_rank(flags_priority(first.d.flags));
  first.rows = rows_hint(first);
  first.time_limit_ms = own_time_limit_ms(*first.slot);
  first.claimed_ns = monotonic_ns();
  // A job that must run alone gathers no company.
  gatherer_.begin(op_id, settings, first.rows == 0 ? kMaxBatchSize : first.rows, first.claimed_ns);
  batch_.clear();
  batch_.push_back(std::move(first));
  std::optional<uint32_t> carried = gather(op, op_id, rank);
  gatherer_.finish();
  if (w_.metrics.on()) {
    const uint64_t now = read_stamp(w_.options.job_clock);
    const uint64_t started = batch_.front().out.started_stamp;
    observe_gather(w_.metrics.batch(op_id), w_.metrics.bound_ticks(),
                   now > started ? now - started : 0);
  }
  // Jobs cancelled or past their deadline while the batch was gathered leave it.
  const uint64_t now = monotonic_ns();
  std::erase_if(batch_, [&](Job& c) {
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
  // The jobs the loop publishes next run alone (it never writes batch_jobs): while no job is
  // published, the page says so again.
  if (published_batch_jobs_ != 1) {
    published_batch_jobs_ = 1;
    w_.priv.batch_jobs.store(1, std::memory_order_relaxed);
  }
  return carried;
}

// Pops and claims queued jobs of op `op_id` into batch_ while the gatherer wants more.
std::optional<uint32_t> BatchRunner::gather(const OpInfo* op, uint32_t op_id, uint32_t rank) {
  while (!gatherer_.full()) {
    // The supervisor is about to stop this worker, or the first job's time limit has passed
    // (its gathering counts: the limit runs from the claim): call now.
    if (w_.priv.hold.load(std::memory_order_relaxed) != 0 ||
        (batch_.front().slot->cancel_requested.load(std::memory_order_relaxed) &
         kCancelByTimeLimit) != 0) {
      return std::nullopt;
    }
    uint32_t next;
    uint32_t lane;
    if (!w_.lanes.peek_level(rank, &next, &lane)) {
      const uint64_t now = monotonic_ns();
      if (!gatherer_.wait_for_more(now)) return std::nullopt;
      // A short spin, then naps of at most kGatherNapNs: the jobs it waits for come from
      // clients that may need this core to send them (on a machine with more clients than
      // cores a spinning or yielding gatherer took a fair share of it for nothing).
      if (!spin_until([&] { return w_.lanes.value_ready_in_level(rank); }, kSpinPauseOnlyNs)) {
        const uint64_t nap = std::min<uint64_t>(gatherer_.deadline_ns() - now, kGatherNapNs);
        timespec ts{0, static_cast<long>(nap)};
        (void)::nanosleep(&ts, nullptr);  // EINTR: the loop looks again
      }
      continue;
    }
    // Another op's job at the head stays queued, for the next worker free; so does one whose
    // rows would take the batch past max_batch_size, for the next batch.
    if (queued_op(next).value_or(op_id) != op_id) return std::nullopt;
    if (!gatherer_.fits(counted(queued_rows(next).value_or(1)))) return std::nullopt;
    uint32_t value;
    if (!w_.lanes.pop_lane(lane, &value)) continue;
    if (queued_op(value).value_or(op_id) != op_id) return value;
    Job c;
    const Claim claimed = claim(value, c);
    if (claimed == Claim::kUnmapped) return value;
    if (claimed == Claim::kDropped) continue;
    c.out.started_stamp = read_stamp(w_.options.job_clock);
    c.claimed_ns = monotonic_ns();
    take(c);
    check(c);
    if (c.v && c.v->op == op) c.rows = rows_hint(c);
    // A stream job of the op runs on its own: its parts are its own (docs/design/streams.md).
    if (c.v && c.v->op == op && c.v->stream_window == 0 && gatherer_.fits(counted(c.rows))) {
      c.time_limit_ms = own_time_limit_ms(*c.slot);
      gatherer_.add(counted(c.rows));
      batch_.push_back(std::move(c));
      continue;
    }
    // It failed its checks, or its client rewrote its op or its rows since the looks above: it
    // ends (or runs) on its own, now.
    if (c.v) run_one(c);
    end_job(c);
    count(c);
  }
  return std::nullopt;
}

// Calls the op for batch_'s jobs and ends each. Jobs of a call stopped at another job's time
// limit run again, in a call of their own.
void BatchRunner::call_batch(const OpInfo* op, uint32_t op_id) {
  while (!batch_.empty()) {
    republish(governing(), static_cast<uint32_t>(batch_.size()));
    contexts_.clear();
    for (const Job& c : batch_) contexts_.push_back(context(c));
    context_ptrs_.clear();
    for (const OpContext& ctx : contexts_) context_ptrs_.push_back(&ctx);
    results_.clear();
    call_rows_.clear();
    GPUQ_FAULT_POINT("worker.running");
    w_.backend.run_batch(*op, context_ptrs_, results_, call_rows_);
    if (w_.metrics.on()) {
      OpBatchMetrics& m = w_.metrics.batch(op_id);
      for (const uint32_t rows : call_rows_) observe_batch_call(m, rows);
    }
    const uint64_t now = monotonic_ns();
    bool stopped_one = false;
    std::vector<bool>& again = again_;
    again.assign(batch_.size(), false);
    for (size_t i = 0; i < batch_.size(); ++i) {
      Job& c = batch_[i];
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
    // A call that stopped for none of its jobs (the op raised Cancelled of its own accord): its
    // jobs end Cancelled rather than run again and again.
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
BatchRunner::Job& BatchRunner::governing() {
  Job* best = &batch_.front();
  uint64_t best_at = UINT64_MAX;
  for (Job& c : batch_) {
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

// Claims a job popped while a batch is gathered. kDropped: a stale or forged reference, or a
// job its client cancelled first. kUnmapped: the reference's client is not mapped here yet (the
// reference is still the caller's: a batch never waits for a mapping, nor reads control
// messages, while it holds claimed jobs).
BatchRunner::Claim BatchRunner::claim(uint32_t value, Job& c) {
  const JobRef ref = JobRef::unpack(value);
  if (ref.client < w_.clients.size() && !w_.clients[ref.client] &&
      ref.client < w_.client_records.size() && w_.client_records[ref.client].session.load() != 0) {
    return Claim::kUnmapped;
  }
  if (ref.client >= w_.clients.size() || !w_.clients[ref.client]) {
    w_.pool.space.notify_all();
    return Claim::kDropped;  // an entry of a client that has gone, or a forged one
  }
  const MappedClient& mc = *w_.clients[ref.client];
  const SlotClaim claimed =
      claim_slot(value, mc, w_.pool, w_.options.pool_id, w_.options.worker_id);
  if (claimed.slot == nullptr) return Claim::kDropped;
  c.value = value;
  c.mc = &mc;
  c.slot = claimed.slot;
  c.generation = claimed.generation;
  c.out.worker_id = w_.options.worker_id;
  return Claim::kClaimed;
}

// After the claim: the job's own copy of its descriptor.
void BatchRunner::take(Job& c) {
  JobSlot& slot = *c.slot;
  // The supervisor raises the time-limit bit only for a job it has seen published, so one here
  // now is a leftover meant for the slot's previous job: not this one's.
  if ((slot.cancel_requested.load(std::memory_order_relaxed) & kCancelByTimeLimit) != 0) {
    slot.cancel_requested.fetch_and(~kCancelByTimeLimit, std::memory_order_relaxed);
  }
  // One copy, validated once (no re-reads): the fixed fields, then only the params in use.
  // params_bytes stays as the client wrote it, so that validation rejects one over the limit.
  std::memcpy(&c.d, &slot.desc, offsetof(JobDescriptor, params));
  std::memcpy(c.d.params, slot.desc.params, std::min<uint32_t>(c.d.params_bytes, kMaxParamBytes));
}

// The job's deadline and descriptor: `c.v` when it may run, else its failure.
void BatchRunner::check(Job& c) {
  // Deadlines are CLOCK_MONOTONIC (stamps may not be): the clock is read only for a job that
  // has one.
  if (c.d.deadline_ns != kNoDeadline && monotonic_ns() > c.d.deadline_ns) {
    fail(c, JobState::kExpired, MetricOutcome::kExpired,
         Error(ErrorCode::kExpired, "deadline passed while the job was queued"));
  } else if (auto v = validate_descriptor(c.d, c.mc->view.arena_bytes(), w_.options.pool_id); !v) {
    fail(c, JobState::kFailed, MetricOutcome::kFailed, v.error());
  } else {
    c.v.emplace(std::move(*v));
  }
}

// The op id a queued reference's descriptor names, if its client is mapped here: a hint (the
// slot is its client's to rewrite until this worker claims it).
std::optional<uint32_t> BatchRunner::queued_op(uint32_t value) const {
  const JobRef ref = JobRef::unpack(value);
  if (ref.client >= w_.clients.size() || !w_.clients[ref.client]) return std::nullopt;
  const MappedClient& mc = *w_.clients[ref.client];
  if (ref.slot >= mc.view.slot_count()) return std::nullopt;
  return std::atomic_ref<const uint32_t>(mc.view.slot(ref.slot).desc.op_id)
      .load(std::memory_order_relaxed);
}

// The rows a queued reference's descriptor says its job has, if its client is mapped here and
// its params parse: a hint, read as queued_op reads the op (the claim validates the params).
std::optional<uint64_t> BatchRunner::queued_rows(uint32_t value) const {
  const JobRef ref = JobRef::unpack(value);
  if (ref.client >= w_.clients.size() || !w_.clients[ref.client]) return std::nullopt;
  const MappedClient& mc = *w_.clients[ref.client];
  if (ref.slot >= mc.view.slot_count()) return std::nullopt;
  const JobDescriptor& d = mc.view.slot(ref.slot).desc;
  const uint32_t size =
      std::atomic_ref<const uint32_t>(d.params_bytes).load(std::memory_order_relaxed);
  if (size > kMaxParamBytes) return std::nullopt;
  uint8_t copy[kMaxParamBytes];
  std::memcpy(copy, d.params, size);
  auto params = ParamBlock::parse(copy, size);
  if (!params) return std::nullopt;
  return rows_of(*params);
}

// The limit `c`'s run is held to: the smaller of its pool's and its own; 0: none.
uint32_t BatchRunner::limit_ms(const Job& c) const {
  return effective_time_limit_ms(w_.options.job_time_limit_ms, c.time_limit_ms);
}

// Makes `c` the job this worker is seen to run, for the supervisor's time limits and status,
// in place of the batch's job published so far (the loop published the first): the next even
// job_seq ends that publication, then which job, since when, and the odd job_seq that
// publishes them (a seqlock's write, as in the loop). `batch_jobs`: how many jobs the call
// serves.
void BatchRunner::republish(const Job& c, uint32_t batch_jobs) {
  w_.priv.job_seq.store(++w_.job_seq, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_release);
  w_.priv.job.store(c.value, std::memory_order_relaxed);
  w_.priv.job_started.store(c.out.started_stamp, std::memory_order_relaxed);
  w_.priv.session.store(c.mc->session, std::memory_order_relaxed);
  if (batch_jobs != published_batch_jobs_) {
    published_batch_jobs_ = batch_jobs;
    w_.priv.batch_jobs.store(batch_jobs, std::memory_order_relaxed);
  }
  w_.priv.job_seq.store(++w_.job_seq, std::memory_order_release);
}

// Not running a job any more: after the clients' wakeups, off their critical path. seq_cst: the
// Dekker pair with the supervisor's `hold`, which the loop reads (seq_cst) before it takes
// another job.
void BatchRunner::unpublish() {
  w_.priv.job_seq.store(++w_.job_seq, std::memory_order_seq_cst);
  w_.self.busy.store(0, std::memory_order_relaxed);
}

OpContext BatchRunner::context(const Job& c) const {
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

void BatchRunner::run_one(Job& c) {
  OpContext ctx = context(c);
  GPUQ_FAULT_POINT("worker.running");
  settle(c,
         c.v->stream_window == 0
             ? w_.backend.run(*c.v->op, ctx)
             : run_streaming(w_.backend, *c.v->op, ctx, *c.slot, c.mc->view, c.v->stream_window,
                             w_.options.stream_reader_timeout_ms),
         ctx);
}

// The job's end from its op's result.
void BatchRunner::settle(Job& c, const Result<OpOutput>& r, const OpContext& ctx) {
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
         time_limit_error(*c.v->op, effective_time_limit_ms(w_.options.job_time_limit_ms,
                                                            own_time_limit_ms(*c.slot))));
  } else {
    fail(c, JobState::kCancelled, MetricOutcome::kCancelled, r.error());
  }
}

// Writes the job's outcome and ends it: its client is told. `yield`: hand the core to a client
// woken here (a call's jobs yield once, after the last).
void BatchRunner::end_job(Job& c, bool yield) {
  JobSlot& slot = *c.slot;
  c.out.finished_stamp = read_stamp(w_.options.job_clock);
  w_.went_on = c.out.finished_stamp;
  if (c.out.code != 0) set_slot_message(slot, c.message);
  std::memcpy(&slot.outcome, &c.out, sizeof c.out);
  GPUQ_FAULT_POINT("worker.before_complete");
  const SlotWord done{c.generation, c.final_state, w_.options.worker_id + 1};
  // An exchange, seq_cst: as cheap as a store and the fence notify would add after it.
  slot.state.exchange(done.pack(), std::memory_order_seq_cst);
  GPUQ_FAULT_POINT("worker.completed");
  // A client asleep on this job is most likely on this CPU (the pusher wakes the worker pinned
  // to its own CPU): give it the core now instead of spinning in front of it.
  if (c.mc->view.announce_end(slot, true) && yield) (void)sched_yield();  // cannot fail
}

// Counts an ended job, off its client's critical path.
void BatchRunner::count(const Job& c) {
  if (c.final_state == JobState::kDone) {
    // Only this worker writes it while it lives: no locked instruction needed.
    w_.self.jobs_done.store(w_.self.jobs_done.load(std::memory_order_relaxed) + 1,
                            std::memory_order_relaxed);
  } else {
    w_.self.jobs_failed.fetch_add(1, std::memory_order_relaxed);
  }
  if (w_.metrics.on()) w_.metrics.record(c.d, c.out, c.outcome);
  if (w_.metrics.tracks_memory()) w_.metrics.set_memory_used(w_.backend.device_memory_used());
}

}  // namespace gpuq::daemon
