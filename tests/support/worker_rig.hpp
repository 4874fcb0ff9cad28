// A worker's parts for the tests of its runners (batch_runner_test.cpp, step_runner_test.cpp), all
// real: a pool's lanes in ring memory, a client segment in a memfd with real slots and
// descriptors, the worker's pages (WorkerShm, WorkerPrivate, the metrics page). A test adds its
// own backend and runner over them. Each slot `s` has its own stretch of the arena: its input
// (one uint64_t tag) at s * kSlotArena, its output buffer after it. Test-only code.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>

#include "claimed_jobs.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/shm.hpp"
#include "support/raw_ring.hpp"

namespace gpuq::daemon::test_rig {

constexpr uint32_t kClients = 4;
constexpr uint32_t kClient = 1;  // the one mapped client
constexpr uint64_t kSession = 77;
constexpr uint32_t kSlots = 32;
constexpr uint32_t kRingCells = 64;
constexpr uint32_t kWorker = 3;
constexpr uint32_t kPool = 0;
constexpr uint64_t kSlotArena = 512;  // each slot's stretch of the arena
constexpr uint64_t kOutputAt = 64;    // its output buffer's place in it
constexpr uint64_t kMaxOutput = kSlotArena - kOutputAt;

// How a queued job differs from a plain one.
struct JobShape {
  uint32_t op_id = 0;  // 0: the rig's default op
  int64_t rows = 1;    // py.r
  uint32_t own_limit_ms = 0;
  uint64_t deadline_ns = kNoDeadline;
  uint32_t cancel = 0;                 // cancel_requested as queued
  uint64_t input_offset = UINT64_MAX;  // UINT64_MAX: the slot's own place in the arena
  uint64_t output_capacity = 8;        // at most kMaxOutput
  uint32_t stream_window = 0;          // a stream of that many cells
};

// The worker's parts and a client.
struct WorkerRig {
  WorkerRig(uint32_t op, uint32_t pool_limit_ms) : default_op(op) {
    options.worker_id = kWorker;
    options.pool_id = kPool;
    options.job_time_limit_ms = pool_limit_ms;
    pool_queue = PoolQueue::create(ring_memory.get(), kRingCells, 1);
    lanes = LanePicker(pool_queue);
    auto segment = MemfdSegment::create("worker_rig", geometry.segment_bytes);
    REQUIRE(segment);
    ClientSegmentView view(segment->address(), geometry, kSlots);
    clients[kClient].emplace(MappedClient{kSession, std::move(*segment), view});
    records[kClient].session.store(kSession);
    for (uint32_t b = 0; b < kMetricBounds; ++b) {
      metrics_page->bound_ticks[b] = static_cast<uint64_t>(kMetricBoundSeconds[b] * 1e9);
    }
    metrics_page->enabled = 1;
    metrics.attach(*metrics_page);
  }

  ClaimedJobs::WorkerParts parts(OpBackend& backend) {
    return ClaimedJobs::WorkerParts{
        options, backend, lanes,   *pool,
        *self,   *priv,   clients, std::span<const ClientShm>(records.get(), kClients),
        metrics, job_seq, went_on};
  }

  const ClientSegmentView& view() const { return clients[kClient]->view; }
  JobSlot& slot(uint32_t s) const { return view().slot(s); }
  SlotWord word(uint32_t s) const { return SlotWord::unpack(slot(s).state.load()); }
  char* output_at(uint32_t s) const { return view().arena() + s * kSlotArena + kOutputAt; }
  uint64_t output(uint32_t s) const {
    uint64_t v = 0;
    std::memcpy(&v, output_at(s), sizeof v);
    return v;
  }
  std::string message(uint32_t s) const { return slot(s).message; }

  // Queues a job in slot `s` whose input is `tag`, as a client does: descriptor, own limit,
  // SUBMITTED, its reference pushed. Returns the reference.
  uint32_t queue(uint32_t s, uint64_t tag, JobShape shape = {}) {
    JobSlot& js = slot(s);
    std::memcpy(view().arena() + s * kSlotArena, &tag, sizeof tag);
    JobDescriptor& d = js.desc;
    d = JobDescriptor{};
    d.op_id = shape.op_id != 0 ? shape.op_id : default_op;
    d.pool_id = kPool;
    d.input_offset = shape.input_offset != UINT64_MAX ? shape.input_offset : s * kSlotArena;
    d.input_bytes = sizeof tag;
    d.output_offset = s * kSlotArena + kOutputAt;
    d.output_capacity = shape.output_capacity;
    d.flags = stream_flags(shape.stream_window);
    d.deadline_ns = shape.deadline_ns;
    d.submit_stamp = read_stamp(options.job_clock);
    ParamWriter params;
    REQUIRE(params.add("py.r", shape.rows));
    std::memcpy(d.params, params.data(), params.size());
    d.params_bytes = static_cast<uint32_t>(params.size());
    js.time_limit_ms = shape.own_limit_ms;
    js.cancel_requested.store(shape.cancel);
    js.stream.written.store(0);
    js.stream.read.store(0);
    const uint32_t generation = ++generations[s];
    js.state.store(SlotWord{generation, JobState::kSubmitted, 0}.pack());
    const uint32_t ref = JobRef{kClient, s, generation}.pack();
    REQUIRE(push_ref(ref));
    return ref;
  }
  // Into the one client lane of the normal level (one lane: every client's jobs in order).
  bool push_ref(uint32_t ref) {
    return pool_queue.try_push(
        pool_queue.lane_for(JobRef::unpack(ref).client, Priority::kNormal, false), ref);
  }

  // What the loop does with a batched or step op's job before it hands it over: pop, claim,
  // copy, check, publish.
  ClaimedJob first() {
    uint32_t value;
    uint32_t lane;
    REQUIRE(lanes.pop(&value, &lane));
    const MappedClient& mc = *clients[kClient];
    const SlotClaim claimed = claim_slot(value, mc, *pool, kPool, kWorker);
    REQUIRE(claimed.slot != nullptr);
    ClaimedJob c;
    c.value = value;
    c.mc = &mc;
    c.slot = claimed.slot;
    c.generation = claimed.generation;
    std::memcpy(&c.d, &claimed.slot->desc, sizeof c.d);
    auto v = validate_descriptor(c.d, mc.view.arena_bytes(), kPool);
    REQUIRE(v);
    c.v.emplace(std::move(*v));
    c.out.worker_id = kWorker;
    c.out.started_stamp = read_stamp(options.job_clock);
    priv->job.store(value);
    priv->job_seq.store(++job_seq);
    self->busy.store(1);
    return c;
  }

  uint32_t default_op;
  WorkerOptions options;
  std::unique_ptr<WorkerPrivate> priv = std::make_unique<WorkerPrivate>();
  test::RingMemory ring_memory{kRingCells, 1};
  PoolQueue pool_queue;
  LanePicker lanes;
  std::unique_ptr<PoolShm> pool = std::make_unique<PoolShm>();
  std::unique_ptr<WorkerShm> self = std::make_unique<WorkerShm>();
  ClientSegmentGeometry geometry = ClientSegmentGeometry::compute(kSlots, kSlotArena* kSlots);
  MappedClients clients = MappedClients(kClients);
  std::unique_ptr<ClientShm[]> records = std::make_unique<ClientShm[]>(kClients);
  std::unique_ptr<WorkerMetrics> metrics_page = std::make_unique<WorkerMetrics>();
  WorkerMetricsWriter metrics;
  uint64_t job_seq = 0;
  uint64_t went_on = 0;
  uint32_t generations[kSlots] = {};
};

}  // namespace gpuq::daemon::test_rig
