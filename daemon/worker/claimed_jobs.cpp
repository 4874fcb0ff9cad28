#include "claimed_jobs.hpp"

#include <sched.h>

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

void ClaimedJob::fail(JobState state, MetricOutcome metric, const Error& e) {
  final_state = state;
  outcome = metric;
  out.code = static_cast<int32_t>(e.code());
  message = e.message();
}

// kDropped: a stale or forged reference, or a job its client cancelled first. kUnmapped: the
// reference's client is not mapped here yet (the reference is still the caller's: a runner
// never waits for a mapping, nor reads control messages, while it holds claimed jobs).
ClaimedJobs::Claim ClaimedJobs::claim(uint32_t value, ClaimedJob& c) {
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
void ClaimedJobs::take(ClaimedJob& c) {
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
void ClaimedJobs::check(ClaimedJob& c) {
  // Deadlines are CLOCK_MONOTONIC (stamps may not be): the clock is read only for a job that
  // has one.
  if (c.d.deadline_ns != kNoDeadline && monotonic_ns() > c.d.deadline_ns) {
    c.fail(JobState::kExpired, MetricOutcome::kExpired,
           Error(ErrorCode::kExpired, "deadline passed while the job was queued"));
  } else if (auto v = validate_descriptor(c.d, c.mc->view.arena_bytes(), w_.options.pool_id); !v) {
    c.fail(JobState::kFailed, MetricOutcome::kFailed, v.error());
  } else {
    c.v.emplace(std::move(*v));
    c.rows = python_rows(c.v->params);
    c.time_limit_ms = own_time_limit_ms(*c.slot);
  }
}

std::optional<uint32_t> ClaimedJobs::queued_op(uint32_t value) const {
  const JobRef ref = JobRef::unpack(value);
  if (ref.client >= w_.clients.size() || !w_.clients[ref.client]) return std::nullopt;
  const MappedClient& mc = *w_.clients[ref.client];
  if (ref.slot >= mc.view.slot_count()) return std::nullopt;
  return std::atomic_ref<const uint32_t>(mc.view.slot(ref.slot).desc.op_id)
      .load(std::memory_order_relaxed);
}

std::optional<uint64_t> ClaimedJobs::queued_rows(uint32_t value) const {
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
  return python_rows(*params);
}

uint32_t ClaimedJobs::limit_ms(const ClaimedJob& c) const {
  return effective_time_limit_ms(w_.options.job_time_limit_ms, c.time_limit_ms);
}

bool ClaimedJobs::past_limit(const ClaimedJob& c, uint64_t now_ns) const {
  if ((c.slot->cancel_requested.load(std::memory_order_relaxed) & kCancelByTimeLimit) != 0) {
    return true;
  }
  const uint32_t limit = limit_ms(c);
  return limit != 0 && now_ns - c.claimed_ns >= uint64_t{limit} * 1'000'000;
}

bool ClaimedJobs::client_left(const ClaimedJob& c) const {
  const uint32_t client = JobRef::unpack(c.value).client;
  return client >= w_.client_records.size() ||
         w_.client_records[client].session.load(std::memory_order_relaxed) != c.mc->session;
}

// The next even job_seq ends the publication so far, then which job, since when, and the odd
// job_seq that publishes them (a seqlock's write, as in the loop).
void ClaimedJobs::republish(const ClaimedJob& c, uint32_t batch_jobs) {
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

// After the clients' wakeups, off their critical path. seq_cst: the Dekker pair with the
// supervisor's `hold`, which the loop reads (seq_cst) before it takes another job. The jobs the
// loop publishes next run alone (it never writes batch_jobs): while no job is published, the
// page says so again.
void ClaimedJobs::unpublish() {
  w_.priv.job_seq.store(++w_.job_seq, std::memory_order_seq_cst);
  w_.self.busy.store(0, std::memory_order_relaxed);
  if (published_batch_jobs_ != 1) {
    published_batch_jobs_ = 1;
    w_.priv.batch_jobs.store(1, std::memory_order_relaxed);
  }
}

OpContext ClaimedJobs::context(const ClaimedJob& c) const {
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

void ClaimedJobs::run_one(ClaimedJob& c) {
  OpContext ctx = context(c);
  GPUQ_FAULT_POINT("worker.running");
  settle(c,
         c.v->stream_window == 0
             ? w_.backend.run(*c.v->op, ctx)
             : run_streaming(w_.backend, *c.v->op, ctx, *c.slot, c.mc->view, c.v->stream_window,
                             w_.options.stream_reader_timeout_ms),
         ctx);
}

void ClaimedJobs::finish_alone(ClaimedJob& c) {
  if (c.v) run_one(c);
  end(c);
  count(c);
}

void ClaimedJobs::settle(ClaimedJob& c, const Result<OpOutput>& r, const OpContext& ctx) {
  if (r) {
    c.out.output_bytes = r->output_bytes;
    c.out.value = r->value;
  } else if (r.error().code() != ErrorCode::kCancelled) {
    c.fail(JobState::kFailed, MetricOutcome::kFailed, r.error());
    c.out.output_bytes = std::min(ctx.failure_output_bytes, ctx.output_capacity);
  } else if (const uint32_t why = c.slot->cancel_requested.load(std::memory_order_relaxed);
             (why & kCancelByClient) == 0 && (why & kCancelByTimeLimit) != 0) {
    // The op stopped because the supervisor asked it to at the job's time limit.
    c.fail(JobState::kFailed, MetricOutcome::kTimedOut,
           time_limit_error(*c.v->op, effective_time_limit_ms(w_.options.job_time_limit_ms,
                                                              own_time_limit_ms(*c.slot))));
  } else {
    c.fail(JobState::kCancelled, MetricOutcome::kCancelled, r.error());
  }
}

void ClaimedJobs::end(ClaimedJob& c, bool yield) {
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

void ClaimedJobs::count(const ClaimedJob& c) {
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
