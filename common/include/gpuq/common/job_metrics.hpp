// Per-worker job metrics: counts by op and outcome, and histograms of queue wait and run time,
// kept on the worker's private memfd (after WorkerPrivate), which only the worker and the
// supervisor map. The worker is the only writer: each count is a plain load and store on lines
// that stay in its own cache (no lock, no system call, no line shared with another writer);
// the supervisor reads them only when metrics are asked for, summing the workers of a pool
// (docs/metrics.md). The page is kept across a worker's respawns, so the counts only grow.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "gpuq/priority.hpp"

namespace gpuq {

// Finite upper bounds of the histogram buckets, in seconds (Prometheus `le`); a last bucket
// (+Inf) follows. From 5 µs, the cost of a job round trip here, to a minute.
inline constexpr uint32_t kMetricBounds = 22;
inline constexpr double kMetricBoundSeconds[kMetricBounds] = {
    5e-6,   1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
    2.5e-2, 5e-2, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0,   30.0, 60.0};
static_assert(kMetricBoundSeconds[kMetricBounds - 1] == 60.0);  // kMaxQueueWaitSeconds

// How a job ended, for the jobs counter's `outcome` label. The supervisor adds the outcomes
// no worker reports (a job lost with its worker) on its own side.
enum class MetricOutcome : uint32_t {
  kOk = 0,         // done
  kFailed = 1,     // the op or the descriptor failed
  kCancelled = 2,  // cancelled by its client while running
  kExpired = 3,    // its deadline passed while it was queued
  kTimedOut = 4,   // stopped at its time limit
};
inline constexpr uint32_t kMetricOutcomes = 5;
constexpr const char* metric_outcome_name(MetricOutcome o) noexcept {
  constexpr const char* kNames[kMetricOutcomes] = {"ok", "failed", "cancelled", "expired",
                                                   "timed_out"};
  return kNames[static_cast<uint32_t>(o)];
}

// The two histograms of each op.
enum MetricHistogramKind : uint32_t { kQueueWait = 0, kRun = 1 };

// An op's metrics in one worker. `op_id` is written before the slot is published. Laid out
// for the job path: the outcome counts and both sums fill the first line, and the two
// histograms' counts for one bucket sit side by side, so a job touches the first line and
// one or two more (one when both durations fall in the first four buckets, as short jobs' do).
// Bucket counts are per bucket, not cumulative (one store per job); sums are in job stamp
// ticks (clock.hpp; the supervisor converts).
inline constexpr uint32_t kMetricOtherOp = UINT32_MAX;  // unknown op ids, and ops past the last
struct alignas(64) OpMetrics {
  uint32_t op_id;
  uint32_t reserved;
  std::atomic<uint64_t> outcomes[kMetricOutcomes];
  std::atomic<uint64_t> sum_ticks[2];                   // by MetricHistogramKind
  std::atomic<uint64_t> buckets[kMetricBounds + 1][2];  // [bucket][MetricHistogramKind]
};
static_assert(offsetof(OpMetrics, buckets) == 64);

// A batched Python op's calls in one worker (docs/python.md, "Dynamic batching"), in the same
// slot as its OpMetrics: how many rows each call of the function took, and how long each
// gathering of a batch waited for company (from its first job's claim to the call). Only
// batched ops' jobs touch it; rows buckets are per bucket, not cumulative, as above.
inline constexpr uint32_t kBatchRowBounds = 17;
inline constexpr uint64_t kBatchRowBound[kBatchRowBounds] = {
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
struct alignas(64) OpBatchMetrics {
  std::atomic<uint64_t> calls;         // calls of the function (rows histogram's count)
  std::atomic<uint64_t> rows_sum;      // rows over all calls
  std::atomic<uint64_t> gathers;       // batches gathered (gather histogram's count)
  std::atomic<uint64_t> gather_ticks;  // time spent gathering, in job stamp ticks
  std::atomic<uint64_t> rows_buckets[kBatchRowBounds + 1];
  std::atomic<uint64_t> gather_buckets[kMetricBounds + 1];
};

// The queue wait of one priority level's jobs in one worker, whatever their op (the same
// bounds as OpMetrics' histograms; per bucket, not cumulative).
struct alignas(64) LevelWaitMetrics {
  std::atomic<uint64_t> sum_ticks;
  std::atomic<uint64_t> buckets[kMetricBounds + 1];
};

// Op slots per worker. The last is kept for kMetricOtherOp, so a worker keeps at most 95 ops
// apart; jobs of further ops count under `other`.
inline constexpr uint32_t kMaxMetricOps = 96;

struct alignas(64) WorkerMetrics {
  // Written by the supervisor before the worker first starts: kMetricBoundSeconds in job stamp
  // ticks, and whether the worker collects at all (config `job_metrics`).
  uint64_t bound_ticks[kMetricBounds];
  uint32_t enabled;
  // Slots in use; the worker fills a slot's op_id, then publishes it here (release).
  std::atomic<uint32_t> op_count;
  // A GPU worker's device memory: what its jobs hold now, and its budget (0: not a GPU worker).
  std::atomic<uint64_t> device_memory_used;
  std::atomic<uint64_t> device_memory_budget;
  OpMetrics ops[kMaxMetricOps];
  OpBatchMetrics batch[kMaxMetricOps];           // by the same slot as `ops`
  LevelWaitMetrics level_wait[kPriorityLevels];  // by priority_rank (0: high)
};
static_assert(std::is_standard_layout_v<WorkerMetrics> &&
              std::is_trivially_destructible_v<WorkerMetrics>);

// Where WorkerMetrics lies on the private memfd: the page after WorkerPrivate.
inline constexpr uint64_t kWorkerMetricsOffset = 4096;

// Adds `n` to a counter only this process writes: a plain load and store, no locked
// instruction.
inline void bump(std::atomic<uint64_t>& counter, uint64_t n = 1) noexcept {
  counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

// Records a duration of `ticks` in op `m`'s histogram `kind` (the worker; single writer);
// returns its bucket. Bucket search is linear: short jobs, the common case, stop at the first
// bounds.
inline uint32_t observe(OpMetrics& m, MetricHistogramKind kind, const uint64_t* bound_ticks,
                        uint64_t ticks) noexcept {
  uint32_t i = 0;
  while (i < kMetricBounds && ticks > bound_ticks[i]) ++i;
  bump(m.buckets[i][kind]);
  // Saturating: a sum that wrapped would read as a counter reset.
  const uint64_t sum = m.sum_ticks[kind].load(std::memory_order_relaxed);
  m.sum_ticks[kind].store(sum + ticks < sum ? UINT64_MAX : sum + ticks, std::memory_order_relaxed);
  return i;
}

// Records a queue wait of `ticks` in level `m`, in `bucket` (observe() found it for the job's
// op) (the worker; single writer).
inline void observe_wait(LevelWaitMetrics& m, uint32_t bucket, uint64_t ticks) noexcept {
  bump(m.buckets[bucket]);
  const uint64_t sum = m.sum_ticks.load(std::memory_order_relaxed);
  m.sum_ticks.store(sum + ticks < sum ? UINT64_MAX : sum + ticks, std::memory_order_relaxed);
}

// Records one call of a batched op's function with `rows` rows (the worker; single writer).
inline void observe_batch_call(OpBatchMetrics& m, uint64_t rows) noexcept {
  uint32_t i = 0;
  while (i < kBatchRowBounds && rows > kBatchRowBound[i]) ++i;
  bump(m.rows_buckets[i]);
  bump(m.calls);
  bump(m.rows_sum, rows);
}

// Records one gathering of a batch that took `ticks` (the worker; single writer).
inline void observe_gather(OpBatchMetrics& m, const uint64_t* bound_ticks,
                           uint64_t ticks) noexcept {
  uint32_t i = 0;
  while (i < kMetricBounds && ticks > bound_ticks[i]) ++i;
  bump(m.gather_buckets[i]);
  bump(m.gathers);
  const uint64_t sum = m.gather_ticks.load(std::memory_order_relaxed);
  m.gather_ticks.store(sum + ticks < sum ? UINT64_MAX : sum + ticks, std::memory_order_relaxed);
}

// The longest queue wait one job adds to the sum: an hour (the +Inf bucket starts at a
// minute). A wait starts at the client's own submit stamp; one that claims more is a lie.
inline constexpr uint64_t kMaxQueueWaitSeconds = 3600;

}  // namespace gpuq
