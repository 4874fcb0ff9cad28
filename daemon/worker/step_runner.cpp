#include "step_runner.hpp"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/job_metrics.hpp"

namespace gpuq::daemon {
namespace {

// How long a runner whose live sequences all wait for their readers naps between looks.
constexpr long kReaderNapNs = 100'000;

}  // namespace

std::optional<uint32_t> StepRunner::run(ClaimedJob&& first, BatchSettings settings) {
  const OpInfo& op = *first.v->op;
  const uint32_t op_id = first.d.op_id;
  // Admitted within the first job's priority level (its client's to write: any level will do).
  const uint32_t rank = priority_rank(flags_priority(first.d.flags));
  const uint32_t most = std::max<uint32_t>(settings.max_batch_size, 1);
  first.time_limit_ms = own_time_limit_ms(*first.slot);
  first.claimed_ns = monotonic_ns();
  live_.clear();
  start(op, std::move(first));
  const ClaimedJobs::WorkerParts& w = jobs_.parts();
  std::optional<uint32_t> carried;
  for (;;) {
    if (!carried && live_.size() < most && w.priv.hold.load(std::memory_order_relaxed) == 0 &&
        !w.backend.must_exit()) {
      carried = admit(op, op_id, rank, most);
    }
    if (live_.empty()) break;
    sweep(op);
    if (ready_.empty()) {
      if (live_.empty()) continue;  // the sweep ended them all: admit again, or stop
      wait_for_readers();
      continue;
    }
    step(op, op_id);
  }
  jobs_.unpublish();
  return carried;
}

// A new sequence for `c` (checked): its state made, or its job ended with why not.
void StepRunner::start(const OpInfo& op, ClaimedJob&& c) {
  const ClaimedJobs::WorkerParts& w = jobs_.parts();
  auto s = std::make_unique<Sequence>();
  s->job = std::move(c);
  s->key = ++next_key_;
  s->ctx.emplace(jobs_.context(s->job));
  if (const uint32_t window = s->job.v->stream_window; window != 0) {
    s->writer = std::make_unique<StreamWriter>(*s->job.slot, s->job.mc->view, s->ctx->output,
                                               s->ctx->output_capacity, window,
                                               w.options.stream_reader_timeout_ms);
  }
  GPUQ_FAULT_POINT("worker.running");
  if (Result<void> started = w.backend.step_start(op, *s->ctx, s->key); !started) {
    w.backend.step_end(op, s->key);
    jobs_.settle(s->job, Result<OpOutput>(started.error()), *s->ctx);
    jobs_.end(s->job);
    jobs_.count(s->job);
    return;
  }
  live_.push_back(std::move(s));
}

// Takes queued jobs of the op while there is room, without waiting.
std::optional<uint32_t> StepRunner::admit(const OpInfo& op, uint32_t op_id, uint32_t rank,
                                          uint32_t most) {
  while (live_.size() < most) {
    ClaimedJob c;
    uint32_t carried = 0;
    switch (jobs_.take_next(
        op_id, rank, [](uint64_t) { return true; }, c, carried)) {
      case ClaimedJobs::Next::kEmpty:
      case ClaimedJobs::Next::kBlocked:
        return std::nullopt;
      case ClaimedJobs::Next::kAgain:
        continue;
      case ClaimedJobs::Next::kCarried:
        return carried;
      case ClaimedJobs::Next::kTaken:
        break;
    }
    if (c.v && c.v->op == &op) {
      start(op, std::move(c));
      continue;
    }
    // It failed its checks, or its client rewrote its op since the look.
    jobs_.finish_alone(c);
  }
  return std::nullopt;
}

// Ends the sequences that must stop, and finds those the next step runs (ready_): every live
// one whose part has somewhere to go.
void StepRunner::sweep(const OpInfo& op) {
  const uint64_t now = monotonic_ns();
  ready_.clear();
  bool ended = false;
  for (const std::unique_ptr<Sequence>& s : live_) {
    ClaimedJob& c = s->job;
    const uint32_t why = c.slot->cancel_requested.load(std::memory_order_relaxed);
    if ((why & kCancelByClient) != 0) {
      c.fail(JobState::kCancelled, MetricOutcome::kCancelled,
             Error(ErrorCode::kCancelled, std::string(op.name) + ": cancelled while running"));
    } else if (jobs_.client_left(c)) {
      c.fail(JobState::kCancelled, MetricOutcome::kCancelled,
             Error(ErrorCode::kCancelled, std::string(op.name) + ": its client left"));
    } else if (jobs_.past_limit(c, now)) {
      c.fail(JobState::kFailed, MetricOutcome::kTimedOut, time_limit_error(op, jobs_.limit_ms(c)));
    } else if (s->writer == nullptr) {
      s->cell = std::span<std::byte>(s->ctx->output, s->ctx->output_capacity);
      ready_.push_back(s.get());
      continue;
    } else if (std::optional<Result<std::span<std::byte>>> cell = s->writer->try_cell(); !cell) {
      continue;  // its reader has every cell: it sits this step out
    } else if (*cell) {
      s->cell = **cell;
      ready_.push_back(s.get());
      continue;
    } else {
      c.fail(JobState::kCancelled, MetricOutcome::kCancelled,
             Error(ErrorCode::kCancelled, std::string(op.name) + ": " + cell->error().message()));
    }
    if (s->writer != nullptr) c.out.value = s->writer->parts();
    s->ended = true;
    ended = true;
  }
  if (ended) end_ended(op);
}

// One call for the ready sequences, then their parts published and the ended ones ended.
void StepRunner::step(const OpInfo& op, uint32_t op_id) {
  const ClaimedJobs::WorkerParts& w = jobs_.parts();
  jobs_.republish(governing(), static_cast<uint32_t>(ready_.size()));
  step_jobs_.clear();
  for (Sequence* s : ready_) {
    step_jobs_.push_back(StepJob{s->key, &*s->ctx, s->cell, s->writer != nullptr});
  }
  results_.clear();
  GPUQ_FAULT_POINT("worker.running");
  w.backend.step(op, step_jobs_, results_);
  if (w.metrics.on()) observe_batch_call(w.metrics.batch(op_id), ready_.size());
  bool ended = false;
  for (size_t i = 0; i < ready_.size(); ++i) {
    Sequence& s = *ready_[i];
    ClaimedJob& c = s.job;
    const Result<StepOutput> r =
        i < results_.size()
            ? results_[i]
            : Result<StepOutput>(Error(ErrorCode::kInternal,
                                       std::string(op.name) + ": the step lost this sequence"));
    if (r) {
      if (s.writer != nullptr) s.writer->publish(r->bytes);
      if (!r->done) continue;
      c.out.output_bytes = s.writer != nullptr ? 0 : std::min(r->bytes, s.ctx->output_capacity);
    } else {
      jobs_.settle(c, Result<OpOutput>(r.error()), *s.ctx);
    }
    if (s.writer != nullptr) c.out.value = s.writer->parts();
    s.ended = true;
    ended = true;
  }
  // A worker whose device failed runs no more steps: the sequences left end with it.
  if (w.backend.must_exit()) {
    for (const std::unique_ptr<Sequence>& s : live_) {
      if (s->ended) continue;
      s->job.fail(JobState::kFailed, MetricOutcome::kFailed,
                  Error(ErrorCode::kOpFailed,
                        std::string(op.name) + ": the worker stopped (its device failed)"));
      s->ended = true;
      ended = true;
    }
  }
  if (ended) end_ended(op);
}

// Ends the sequences marked ended: their states forgotten, their clients told (one yield after
// the last, for the clients woken), then their counts.
void StepRunner::end_ended(const OpInfo& op) {
  const ClaimedJobs::WorkerParts& w = jobs_.parts();
  for (const std::unique_ptr<Sequence>& s : live_) {
    if (!s->ended) continue;
    w.backend.step_end(op, s->key);
    jobs_.end(s->job, false);
  }
  (void)sched_yield();  // for the clients woken above: see ClaimedJobs::end
  std::erase_if(live_, [&](const std::unique_ptr<Sequence>& s) {
    if (!s->ended) return false;
    jobs_.count(s->job);
    return true;
  });
  // The page may name a job that has just ended: the supervisor would watch it, and stop this
  // worker past its limit while the live ones wait for their readers. It names a live one.
  if (!live_.empty()) jobs_.republish(governing(), static_cast<uint32_t>(live_.size()));
}

void StepRunner::wait_for_readers() const {
  timespec ts{0, kReaderNapNs};
  (void)::nanosleep(&ts, nullptr);  // EINTR: the runner looks again
}

// The live job whose time limit passes first (the first when none has one): the one the
// supervisor watches.
const ClaimedJob& StepRunner::governing() const {
  const ClaimedJob* best = &live_.front()->job;
  uint64_t best_at = UINT64_MAX;
  for (const std::unique_ptr<Sequence>& s : live_) {
    const uint32_t limit = jobs_.limit_ms(s->job);
    if (limit == 0) continue;
    const uint64_t at = s->job.claimed_ns + uint64_t{limit} * 1'000'000;
    if (at < best_at) {
      best_at = at;
      best = &s->job;
    }
  }
  return *best;
}

}  // namespace gpuq::daemon
