#include "batch_runner.hpp"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/event_count.hpp"
#include "gpuq/common/fault_point.hpp"

namespace gpuq::daemon {
namespace {

// The longest nap of a worker gathering a batch between looks at its lanes (gather()).
constexpr uint64_t kGatherNapNs = 50'000;

// The rows a job counts for in a batch it joins: one for a job that would run alone.
uint64_t counted(uint64_t rows) {
  return rows == 0 ? 1 : rows;
}

}  // namespace

std::optional<uint32_t> BatchRunner::run(Job&& first, BatchSettings settings) {
  const OpInfo* op = first.v->op;
  const uint32_t op_id = first.d.op_id;
  // Gathered within the first job's priority level (its client's to write: any level will do).
  const uint32_t rank = priority_rank(flags_priority(first.d.flags));
  first.rows = python_rows(first.v->params);
  first.time_limit_ms = own_time_limit_ms(*first.slot);
  first.claimed_ns = monotonic_ns();
  // A job that must run alone gathers no company.
  gatherer_.begin(op_id, settings, first.rows == 0 ? kMaxBatchSize : first.rows, first.claimed_ns);
  batch_.clear();
  batch_.push_back(std::move(first));
  std::optional<uint32_t> carried = gather(op, op_id, rank);
  gatherer_.finish();
  const ClaimedJobs::WorkerParts& w = jobs_.parts();
  if (w.metrics.on()) {
    const uint64_t now = read_stamp(w.options.job_clock);
    const uint64_t started = batch_.front().out.started_stamp;
    observe_gather(w.metrics.batch(op_id), w.metrics.bound_ticks(),
                   now > started ? now - started : 0);
  }
  // Jobs cancelled or past their deadline while the batch was gathered leave it.
  const uint64_t now = monotonic_ns();
  std::erase_if(batch_, [&](Job& c) {
    if ((c.slot->cancel_requested.load(std::memory_order_relaxed) & kCancelByClient) != 0) {
      c.fail(JobState::kCancelled, MetricOutcome::kCancelled,
             Error(ErrorCode::kCancelled,
                   std::string(op->name) + ": cancelled while its batch was gathered"));
    } else if (c.d.deadline_ns != kNoDeadline && now > c.d.deadline_ns) {
      c.fail(JobState::kExpired, MetricOutcome::kExpired,
             Error(ErrorCode::kExpired, "deadline passed while the job's batch was gathered"));
    } else {
      return false;
    }
    jobs_.end(c);
    jobs_.count(c);
    return true;
  });
  call_batch(op, op_id);
  jobs_.unpublish();
  return carried;
}

// Pops and claims queued jobs of op `op_id` into batch_ while the gatherer wants more.
std::optional<uint32_t> BatchRunner::gather(const OpInfo* op, uint32_t op_id, uint32_t rank) {
  const ClaimedJobs::WorkerParts& w = jobs_.parts();
  while (!gatherer_.full()) {
    // The supervisor is about to stop this worker, or the first job's time limit has passed
    // (its gathering counts: the limit runs from the claim): call now.
    if (w.priv.hold.load(std::memory_order_relaxed) != 0 ||
        (batch_.front().slot->cancel_requested.load(std::memory_order_relaxed) &
         kCancelByTimeLimit) != 0) {
      return std::nullopt;
    }
    Job c;
    uint32_t carried = 0;
    switch (jobs_.take_next(
        op_id, rank, [&](uint64_t rows) { return gatherer_.fits(counted(rows)); }, c, carried)) {
      case ClaimedJobs::Next::kEmpty: {
        const uint64_t now = monotonic_ns();
        if (!gatherer_.wait_for_more(now)) return std::nullopt;
        // A short spin, then naps of at most kGatherNapNs: the jobs it waits for come from
        // clients that may need this core to send them (on a machine with more clients than
        // cores a spinning or yielding gatherer took a fair share of it for nothing).
        if (!spin_until([&] { return w.lanes.value_ready_in_level(rank); }, kSpinPauseOnlyNs)) {
          const uint64_t nap = std::min<uint64_t>(gatherer_.deadline_ns() - now, kGatherNapNs);
          timespec ts{0, static_cast<long>(nap)};
          (void)::nanosleep(&ts, nullptr);  // EINTR: the loop looks again
        }
        continue;
      }
      case ClaimedJobs::Next::kBlocked:
        return std::nullopt;
      case ClaimedJobs::Next::kAgain:
        continue;
      case ClaimedJobs::Next::kCarried:
        return carried;
      case ClaimedJobs::Next::kTaken:
        break;
    }
    // A stream job of the op runs on its own: its parts are its own (docs/design/streams.md).
    if (c.v && c.v->op == op && c.v->stream_window == 0 && gatherer_.fits(counted(c.rows))) {
      gatherer_.add(counted(c.rows), c.claimed_ns);
      batch_.push_back(std::move(c));
      continue;
    }
    // It failed its checks, or its client rewrote its op or its rows since the looks above.
    jobs_.finish_alone(c);
  }
  return std::nullopt;
}

// Calls the op for batch_'s jobs and ends each. Jobs of a call stopped at another job's time
// limit run again, in a call of their own.
void BatchRunner::call_batch(const OpInfo* op, uint32_t op_id) {
  const ClaimedJobs::WorkerParts& w = jobs_.parts();
  while (!batch_.empty()) {
    jobs_.republish(governing(), static_cast<uint32_t>(batch_.size()));
    contexts_.clear();
    for (const Job& c : batch_) contexts_.push_back(jobs_.context(c));
    context_ptrs_.clear();
    for (const OpContext& ctx : contexts_) context_ptrs_.push_back(&ctx);
    results_.clear();
    call_rows_.clear();
    GPUQ_FAULT_POINT("worker.running");
    w.backend.run_batch(*op, context_ptrs_, results_, call_rows_);
    if (w.metrics.on()) {
      OpBatchMetrics& m = w.metrics.batch(op_id);
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
        jobs_.settle(c, r, contexts_[i]);
        continue;
      }
      const uint32_t why = c.slot->cancel_requested.load(std::memory_order_relaxed);
      if ((why & kCancelByClient) != 0) {
        jobs_.settle(c, r, contexts_[i]);
        stopped_one = true;
      } else if (jobs_.past_limit(c, now)) {
        c.fail(JobState::kFailed, MetricOutcome::kTimedOut,
               time_limit_error(*op, jobs_.limit_ms(c)));
        stopped_one = true;
      } else {
        again[i] = true;
      }
    }
    // A call that stopped for none of its jobs (the op raised Cancelled of its own accord): its
    // jobs end Cancelled rather than run again and again.
    if (!stopped_one) {
      for (size_t i = 0; i < batch_.size(); ++i) {
        if (again[i]) jobs_.settle(batch_[i], results_[i], contexts_[i]);
      }
      again.assign(batch_.size(), false);
    }
    bool woke = false;
    for (size_t i = 0; i < batch_.size(); ++i) {
      if (again[i]) continue;
      jobs_.end(batch_[i], false);
      woke = true;
    }
    if (woke) (void)sched_yield();  // for the clients woken above: see ClaimedJobs::end
    size_t kept = 0;
    for (size_t i = 0; i < batch_.size(); ++i) {
      if (!again[i]) {
        jobs_.count(batch_[i]);
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
    const uint32_t limit = jobs_.limit_ms(c);
    if (limit == 0) continue;
    const uint64_t at = c.claimed_ns + uint64_t{limit} * 1'000'000;
    if (at < best_at) {
      best_at = at;
      best = &c;
    }
  }
  return *best;
}

}  // namespace gpuq::daemon
