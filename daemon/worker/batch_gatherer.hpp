// BatchGatherer: when a worker that has taken a job of a batched op (a Python op declared with
// max_batch_size > 1, docs/python.md "Dynamic batching") stops gathering further queued jobs of
// that op and calls it. The worker loop pops and claims; this component only decides, from the
// rows gathered so far, the op's settings, the clock and what the op's previous batch on this
// worker held. Not thread-safe: one per worker loop.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "ops.hpp"

namespace gpuq::daemon {

class BatchGatherer {
 public:
  // How long a batch waits for a next job after its last one came: a tenth of the op's
  // max_queue_delay_us, kMinQuietNs at least. Past it, the jobs expected are taken to be in
  // other workers' batches. Two workers gathering from 8 clients each waited out the whole
  // delay for jobs the other had: 0.74x the unbatched op's rows/s; 0.86x with a 100 µs gap;
  // 1.04x with 50 µs (the default delay's tenth) and the fewest of the last kRecentBatches
  // batches expected (bench_batching.py, 2026-12-05).
  static constexpr uint64_t kMinQuietNs = 50'000;
  static uint64_t quiet_ns_for(BatchSettings settings) noexcept {
    const uint64_t tenth = uint64_t{settings.max_queue_delay_us} * 100;
    return tenth > kMinQuietNs ? tenth : kMinQuietNs;
  }
  // How many of an op's previous batches on this worker set what the next waits for.
  static constexpr uint32_t kRecentBatches = 4;

  // Starts a batch of op `op_id` (`settings.batched()`), whose first job has `rows` rows and
  // was taken at `now_ns` (CLOCK_MONOTONIC).
  void begin(uint32_t op_id, BatchSettings settings, uint64_t rows, uint64_t now_ns) noexcept;

  // Whether a job of `rows` rows may join: the batch stays within max_batch_size rows. The one
  // place the limit holds (the op's function gets no more rows in one call); a first job above
  // it runs alone.
  bool fits(uint64_t rows) const noexcept {
    return rows_ <= settings_.max_batch_size && rows <= settings_.max_batch_size - rows_;
  }

  // Adds a gathered job of `rows` rows, one that fits(), taken at `now_ns`.
  void add(uint64_t rows, uint64_t now_ns) noexcept {
    rows_ += rows;
    ++jobs_;
    last_taken_ns_ = now_ns;
  }

  // Whether the batch holds max_batch_size rows or more: take no further job.
  bool full() const noexcept { return rows_ >= settings_.max_batch_size; }

  // With no further job of the op queued now: whether to wait for one (true) or call the op at
  // once (false). It waits only while max_queue_delay_us has not passed since the first job
  // and the batch holds fewer jobs than each of this op's last kRecentBatches batches on this
  // worker did. So a lone caller never waits, nor does the first job after a quiet spell (its
  // previous batch held one job), while under steady load from several clients the worker
  // waits for as many as it surely got of late, never past the delay, and not once its quiet
  // gap (quiet_ns_for) has passed since the last job came.
  bool wait_for_more(uint64_t now_ns) const noexcept {
    return now_ns < deadline_ns_ && jobs_ < expected_ && now_ns - last_taken_ns_ < quiet_ns_;
  }

  // The quiet gap of the batches begun from now on, in place of quiet_ns_for()'s (tests that
  // wait out a delay); 0: quiet_ns_for()'s again.
  void set_quiet_ns(uint64_t ns) noexcept { quiet_override_ns_ = ns; }

  // Ends the batch: the jobs it gathered (those that left it while it was gathered included)
  // become what the op's next batch on this worker waits for.
  void finish() noexcept;

  uint64_t rows() const noexcept { return rows_; }
  uint32_t jobs() const noexcept { return jobs_; }
  uint64_t started_ns() const noexcept { return started_ns_; }
  uint64_t deadline_ns() const noexcept { return deadline_ns_; }
  // What the next batch of `op_id` would wait for (1 before its first batch).
  uint32_t expected(uint32_t op_id) const noexcept;

 private:
  uint32_t op_id_ = 0;
  BatchSettings settings_;
  uint64_t rows_ = 0;
  uint32_t jobs_ = 0;
  uint32_t expected_ = 1;
  uint64_t started_ns_ = 0;
  uint64_t deadline_ns_ = 0;
  uint64_t last_taken_ns_ = 0;
  uint64_t quiet_ns_ = kMinQuietNs;
  uint64_t quiet_override_ns_ = 0;
  // Each op's last batches' jobs: a worker serves few batched ops.
  struct Recent {
    uint32_t op_id = 0;
    uint32_t jobs[kRecentBatches] = {};
    uint32_t count = 0;  // batches recorded (the last kRecentBatches of them kept)
  };
  std::vector<Recent> last_jobs_;
};

}  // namespace gpuq::daemon
