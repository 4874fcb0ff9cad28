// The job steps both paths of the worker take (daemon/worker/job_steps.hpp): the claim of a
// queued job's slot, on real slots in a memfd client segment, and a stopped job's time limit.
// The claim's races with clients and the supervisor run in tests/stress and tests/fault.
#include "job_steps.hpp"

#include <doctest/doctest.h>

#include <memory>

namespace gpuq::daemon {
namespace {

constexpr uint32_t kSlots = 4;
constexpr uint32_t kPool = 1;
constexpr uint32_t kWorker = 6;

struct Client {
  Client() {
    const ClientSegmentGeometry g = ClientSegmentGeometry::compute(kSlots, 4096);
    auto segment = MemfdSegment::create("job_steps_test", g.segment_bytes);
    REQUIRE(segment);
    ClientSegmentView view(segment->address(), g, kSlots);
    mc = MappedClient{1, std::move(*segment), view};
  }
  // Slot `s` queued on pool `pool_id` with generation `generation`; its reference.
  uint32_t queue(uint32_t s, uint32_t generation, uint32_t pool_id = kPool) {
    JobSlot& slot = mc.view.slot(s);
    slot.desc.pool_id = pool_id;
    slot.state.store(SlotWord{generation, JobState::kSubmitted, 0}.pack());
    return JobRef{0, s, generation}.pack();
  }
  SlotWord word(uint32_t s) const { return SlotWord::unpack(mc.view.slot(s).state.load()); }

  MappedClient mc;
  std::unique_ptr<PoolShm> pool = std::make_unique<PoolShm>();
};

TEST_CASE("claim_slot: a queued job of the pool turns RUNNING, naming this worker") {
  Client c;
  const uint32_t generation = (5u << 14) | 9;  // more than a reference's 14 bits hold
  const uint32_t ref = c.queue(2, generation);
  const SlotClaim claimed = claim_slot(ref, c.mc, *c.pool, kPool, kWorker);
  CHECK(claimed.slot == &c.mc.view.slot(2));
  CHECK(claimed.generation == generation);  // the slot's, full width
  CHECK(c.word(2).state == JobState::kRunning);
  CHECK(c.word(2).worker_plus_one == kWorker + 1);
  CHECK(c.word(2).generation == generation);
  // A second pop of the same reference (a duplicate entry) finds it taken.
  CHECK(claim_slot(ref, c.mc, *c.pool, kPool, kWorker).slot == nullptr);
}

TEST_CASE("claim_slot: stale, foreign and forged references are dropped, the slot untouched") {
  Client c;
  SUBCASE("a job its client cancelled while queued") {
    const uint32_t ref = c.queue(0, 3);
    c.mc.view.slot(0).state.store(SlotWord{3, JobState::kCancelled, 0}.pack());
    CHECK(claim_slot(ref, c.mc, *c.pool, kPool, kWorker).slot == nullptr);
    CHECK(c.word(0).state == JobState::kCancelled);
  }
  SUBCASE("a reference for an earlier use of the slot") {
    c.queue(0, 4);
    CHECK(claim_slot(JobRef{0, 0, 3}.pack(), c.mc, *c.pool, kPool, kWorker).slot == nullptr);
    CHECK(c.word(0).state == JobState::kSubmitted);
  }
  SUBCASE("a job queued on another pool, whose generation matches") {
    const uint32_t ref = c.queue(1, 3, kPool + 1);
    CHECK(claim_slot(ref, c.mc, *c.pool, kPool, kWorker).slot == nullptr);
    CHECK(c.word(1).state == JobState::kSubmitted);
  }
  SUBCASE("no such slot") {
    CHECK(claim_slot(JobRef{0, kSlots, 1}.pack(), c.mc, *c.pool, kPool, kWorker).slot == nullptr);
  }
}

TEST_CASE("own_time_limit_ms and time_limit_error: a stopped job's limit and message") {
  Client c;
  c.mc.view.slot(0).time_limit_ms = 250;
  CHECK(own_time_limit_ms(c.mc.view.slot(0)) == 250);
  const OpInfo op{7, "sleep", "", nullptr};
  const Error e = time_limit_error(op, 250);
  CHECK(e.code() == ErrorCode::kTimedOut);
  CHECK(e.message() == "sleep: stopped at the job's time limit (250 ms)");
}

}  // namespace
}  // namespace gpuq::daemon
