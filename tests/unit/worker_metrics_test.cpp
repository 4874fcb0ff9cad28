// WorkerMetricsWriter (daemon/worker/worker_metrics.hpp): a worker's writes to its job metrics
// page, on a real page (WorkerMetrics) and ops of the real registry. The supervisor's side (the
// sums, the text format) is in metrics_test.cpp; the whole path in python/tests/test_metrics.py.
#include "worker_metrics.hpp"

#include <doctest/doctest.h>

#include <memory>

#include "ops.hpp"

namespace gpuq::daemon {
namespace {

// A page as the supervisor leaves it for a worker: bounds 1000, 2000, ... ticks.
std::unique_ptr<WorkerMetrics> page(bool enabled = true) {
  auto p = std::make_unique<WorkerMetrics>();
  for (uint32_t b = 0; b < kMetricBounds; ++b) p->bound_ticks[b] = (b + 1) * 1000;
  p->enabled = enabled ? 1 : 0;
  return p;
}

JobDescriptor job(uint32_t op_id, uint64_t submit_stamp) {
  JobDescriptor d{};
  d.op_id = op_id;
  d.submit_stamp = submit_stamp;
  return d;
}

JobOutcome ran(uint64_t started, uint64_t finished) {
  JobOutcome out{};
  out.started_stamp = started;
  out.finished_stamp = finished;
  return out;
}

// An id no op of the registry has.
constexpr uint32_t kNoOp = 60'000;

TEST_CASE("WorkerMetricsWriter: on() follows the page's `enabled`") {
  auto on = page(true), off = page(false);
  WorkerMetricsWriter w;
  w.attach(*on);
  CHECK(w.on());
  CHECK(w.bound_ticks()[0] == 1000);
  w.attach(*off);
  CHECK_FALSE(w.on());
}

TEST_CASE("WorkerMetricsWriter: a job's outcome, queue wait and run time, in its op's slot") {
  auto p = page();
  WorkerMetricsWriter w;
  w.attach(*p);
  const uint32_t op = op_registry().front().id;
  w.record(job(op, 100), ran(1600, 4100), MetricOutcome::kOk);  // waited 1500, ran 2500
  const uint32_t slot = w.slot(op);
  CHECK(p->op_count.load() == 1);
  const OpMetrics& m = p->ops[slot];
  CHECK(m.op_id == op);
  CHECK(m.outcomes[static_cast<uint32_t>(MetricOutcome::kOk)].load() == 1);
  CHECK(m.buckets[1][kQueueWait].load() == 1);  // le 2000
  CHECK(m.sum_ticks[kQueueWait].load() == 1500);
  CHECK(m.buckets[2][kRun].load() == 1);  // le 3000
  CHECK(m.sum_ticks[kRun].load() == 2500);
}

TEST_CASE("WorkerMetricsWriter: waits from a future stamp count none, long ones an hour") {
  auto p = page();
  WorkerMetricsWriter w;
  w.attach(*p);
  const uint32_t op = op_registry().front().id;
  w.record(job(op, 5000), ran(1000, 1000), MetricOutcome::kOk);  // submitted "later"
  const OpMetrics& m = p->ops[w.slot(op)];
  CHECK(m.buckets[0][kQueueWait].load() == 1);
  CHECK(m.sum_ticks[kQueueWait].load() == 0);
  w.record(job(op, 0), ran(UINT64_MAX / 2, UINT64_MAX / 2), MetricOutcome::kOk);
  // The last bound (22000 ticks) is a minute: an hour is 60 of them.
  CHECK(m.sum_ticks[kQueueWait].load() == 22000 / 60 * kMaxQueueWaitSeconds);
}

TEST_CASE("WorkerMetricsWriter: an expired job never ran: no run time") {
  auto p = page();
  WorkerMetricsWriter w;
  w.attach(*p);
  const uint32_t op = op_registry().front().id;
  w.record(job(op, 0), ran(10, 5000), MetricOutcome::kExpired);
  const OpMetrics& m = p->ops[w.slot(op)];
  CHECK(m.outcomes[static_cast<uint32_t>(MetricOutcome::kExpired)].load() == 1);
  CHECK(m.sum_ticks[kRun].load() == 0);
  uint64_t runs = 0;
  for (const auto& bucket : m.buckets) runs += bucket[kRun].load();
  CHECK(runs == 0);
}

TEST_CASE("WorkerMetricsWriter: slots: one per op, unknown ids share `other`") {
  auto p = page();
  WorkerMetricsWriter w;
  w.attach(*p);
  const auto ops = op_registry();
  REQUIRE(ops.size() >= 2);
  const uint32_t a = w.slot(ops[0].id), b = w.slot(ops[1].id);
  CHECK(a != b);
  CHECK(w.slot(ops[0].id) == a);
  const uint32_t other = w.slot(kNoOp);
  CHECK(p->ops[other].op_id == kMetricOtherOp);
  CHECK(w.slot(kNoOp + 1) == other);
  CHECK(w.slot(UINT32_MAX - 1) == other);  // past the ids it remembers
  CHECK(&w.batch(ops[1].id) == &p->batch[b]);
  CHECK(p->op_count.load() == 3);
}

TEST_CASE("WorkerMetricsWriter: a restarted worker finds its predecessor's slots") {
  auto p = page();
  const uint32_t op = op_registry().back().id;
  WorkerMetricsWriter before;
  before.attach(*p);
  (void)before.slot(kNoOp);
  const uint32_t slot = before.slot(op);
  WorkerMetricsWriter after;
  after.attach(*p);
  CHECK(after.slot(op) == slot);
  CHECK(p->op_count.load() == 2);
}

TEST_CASE("WorkerMetricsWriter: with every slot but the last taken, a new op counts as `other`") {
  auto p = page();
  for (uint32_t i = 0; i < kMaxMetricOps - 1; ++i) p->ops[i].op_id = kNoOp + 10 + i;
  p->op_count.store(kMaxMetricOps - 1);
  WorkerMetricsWriter w;
  w.attach(*p);
  const uint32_t slot = w.slot(op_registry().front().id);
  CHECK(slot == kMaxMetricOps - 1);
  CHECK(p->ops[slot].op_id == kMetricOtherOp);
  CHECK(p->op_count.load() == kMaxMetricOps);
}

TEST_CASE("WorkerMetricsWriter: a GPU worker's device memory") {
  auto p = page();
  WorkerMetricsWriter w;
  w.attach(*p);
  CHECK_FALSE(w.tracks_memory());
  w.set_memory_budget(1000, 10);
  CHECK(w.tracks_memory());
  CHECK(p->device_memory_budget.load() == 1000);
  CHECK(p->device_memory_used.load() == 10);
  w.set_memory_used(600);
  CHECK(p->device_memory_used.load() == 600);
}

}  // namespace
}  // namespace gpuq::daemon
