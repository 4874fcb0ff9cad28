// Unit tests of PoolQueue and LanePicker (common/include/gpuq/common/pool_queue.hpp): the lane
// geometry, the `active` bits (set by a push, settled by a sleeping worker or the audit, also
// for a lane whose pusher died before its mark), the order workers take jobs in (levels, the
// fresh lane, client lanes round robin, FIFO within a lane), that a waiting class still gets a
// tenth of the starts, batching's look-then-take within a level, and exactly-once delivery with
// threads pushing and popping at once.
#include "gpuq/common/pool_queue.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <thread>
#include <vector>

#include "support/raw_ring.hpp"
#include "support/test_support.hpp"

namespace gpuq {
namespace {

using test::RingMemory;

// A pool's lanes in heap memory, with a picker (one worker's view).
struct Lanes {
  Lanes(uint32_t capacity, uint32_t client_lanes)
      : memory(capacity, client_lanes),
        queue(PoolQueue::create(memory.get(), capacity, client_lanes)),
        picker(queue) {}
  // A job value that names its client and its number (client * 1000 + n).
  bool push(uint32_t client, Priority p, bool fresh, uint32_t n) {
    return queue.try_push(queue.lane_for(client, p, fresh), client * 1000 + n);
  }
  std::vector<uint32_t> drain() {
    std::vector<uint32_t> out;
    uint32_t v = 0;
    uint32_t lane = 0;
    while (picker.pop(&v, &lane)) out.push_back(v);
    return out;
  }
  RingMemory memory;
  PoolQueue queue;
  LanePicker picker;
};

TEST_CASE("PoolQueue: client lanes per level follow the cell budget, a power of two to 16") {
  CHECK(PoolQueue::client_lanes_for(1) == PoolQueue::kMaxClientLanes);
  CHECK(PoolQueue::client_lanes_for(20) == PoolQueue::kMaxClientLanes);
  CHECK(PoolQueue::client_lanes_for(320) == 16);  // 3 x 17 x 320 = 16320 cells
  CHECK(PoolQueue::client_lanes_for(640) == 4);   // 7 would fit
  CHECK(PoolQueue::client_lanes_for(JobRing::kMaxCapacity) == 1);
  CHECK_FALSE(PoolQueue::valid_client_lanes(0));
  CHECK_FALSE(PoolQueue::valid_client_lanes(3));
  CHECK_FALSE(PoolQueue::valid_client_lanes(32));
  for (uint32_t cap : {1u, 20u, 100u, 321u, 640u, 8192u}) {
    CAPTURE(cap);
    const uint32_t k = PoolQueue::client_lanes_for(cap);
    CHECK(PoolQueue::valid_client_lanes(k));
    CHECK((k == 1 || uint64_t{kPriorityLevels} * (k + 1) * cap <= PoolQueue::kCellBudget));
    CHECK(PoolQueue::bytes_for(cap, k) ==
          sizeof(PoolQueueHeader) + kPriorityLevels * (k + 1) * JobRing::bytes_for(cap));
  }
}

TEST_CASE("PoolQueue: a client's lanes, the fresh lanes, and their levels") {
  Lanes l(4, 4);
  const PoolQueue& q = l.queue;
  CHECK(q.lane_count() == 15);
  CHECK(q.lane_for(0, Priority::kHigh, true) == 0);
  CHECK(q.lane_for(0, Priority::kHigh, false) == 1);
  CHECK(q.lane_for(5, Priority::kHigh, false) == 2);  // 5 % 4 = 1
  CHECK(q.lane_for(7, Priority::kNormal, true) == 5);
  CHECK(q.lane_for(7, Priority::kNormal, false) == 9);  // 7 % 4 = 3
  CHECK(q.lane_for(2, Priority::kLow, false) == 13);
  CHECK(q.column_of(6) == 2);
  for (uint32_t lane = 0; lane < q.lane_count(); ++lane) {
    CAPTURE(lane);
    CHECK(q.rank_of(lane) == lane / 5);
    CHECK(q.is_fresh(lane) == (lane % 5 == 0));
  }
}

TEST_CASE("PoolQueue: a push marks its lane; settling clears empty lanes, marks full ones") {
  Lanes l(4, 2);
  PoolQueue& q = l.queue;
  CHECK(q.active() == 0);
  REQUIRE(l.push(1, Priority::kNormal, false, 0));
  const uint32_t lane = q.lane_for(1, Priority::kNormal, false);
  CHECK(q.active() == uint64_t{1} << lane);
  CHECK(q.size() == 1);
  CHECK(q.level_size(priority_rank(Priority::kNormal)) == 1);
  CHECK(q.has_values());
  // Each lane holds `capacity` values.
  for (uint32_t n = 1; n < 4; ++n) REQUIRE(l.push(1, Priority::kNormal, false, n));
  CHECK_FALSE(l.push(1, Priority::kNormal, false, 4));
  CHECK(l.push(0, Priority::kNormal, false, 0));  // another lane has room

  // Popped empty: the bits stay (workers clear them only before they sleep).
  CHECK(l.drain().size() == 5);
  CHECK(q.active() != 0);
  CHECK_FALSE(q.settle_active_bits());  // what a worker about to sleep does
  CHECK(q.active() == 0);

  // A pusher that died between its push and its mark: no bit, so neither a picker nor a
  // worker about to sleep sees it...
  REQUIRE(q.lane(lane).try_push(42));
  uint32_t v = 0;
  uint32_t from = 0;
  CHECK_FALSE(l.picker.pop(&v, &from));
  CHECK_FALSE(l.picker.value_ready());
  CHECK_FALSE(q.settle_active_bits());
  CHECK(q.active() == 0);
  // ...until the audit settles every lane: one hidden value found (its caller wakes a worker).
  CHECK(q.settle_bits() == 1);
  CHECK(q.active() == uint64_t{1} << lane);
  CHECK(q.settle_bits() == 0);  // a value whose bit is set is not hidden
  CHECK(q.settle_active_bits());
  REQUIRE(l.picker.pop(&v, &from));
  CHECK(v == 42);
  CHECK(from == lane);
  CHECK(q.settle_bits() == 0);
  CHECK(q.active() == 0);
}

TEST_CASE("PoolQueue: bits a client set past the lanes are ignored, and the audit clears them") {
  Lanes l(4, 2);  // 3 x 3 lanes: bits 9 to 63 name none
  l.queue.header().active.store(~uint64_t{0});
  uint32_t v = 0;
  uint32_t from = 0;
  CHECK(l.queue.active() == (uint64_t{1} << 9) - 1);
  CHECK_FALSE(l.picker.pop(&v, &from));
  CHECK_FALSE(l.picker.value_ready());
  CHECK(l.queue.settle_bits() == 0);
  CHECK(l.queue.header().active.load() == 0);
  REQUIRE(l.push(1, Priority::kLow, false, 7));
  l.queue.header().active.fetch_or(uint64_t{1} << 63);
  REQUIRE(l.picker.pop(&v, &from));
  CHECK(v == 1007);
}

TEST_CASE("LanePicker: higher levels first; within a level the fresh lane, then clients in turn") {
  Lanes l(8, 4);
  // Client 1 queues 4 jobs, client 2 queues 2, client 3 one (each its own lane); client 9 sends
  // one job alone (the fresh lane), a low and a high job come last.
  for (uint32_t n = 0; n < 4; ++n) REQUIRE(l.push(1, Priority::kNormal, false, n));
  for (uint32_t n = 0; n < 2; ++n) REQUIRE(l.push(2, Priority::kNormal, false, n));
  REQUIRE(l.push(3, Priority::kNormal, false, 0));
  REQUIRE(l.push(9, Priority::kNormal, true, 0));
  REQUIRE(l.push(4, Priority::kLow, false, 0));
  REQUIRE(l.push(5, Priority::kHigh, false, 0));
  const std::vector<uint32_t> order = l.drain();
  CHECK(order == std::vector<uint32_t>{5000, 9000, 1000, 2000, 3000, 1001, 2001, 1002, 1003, 4000});
}

TEST_CASE("LanePicker: a client's wait depends on the busy clients, not on their queues") {
  // Eight clients with 8 jobs queued each; a ninth sends one job at a time. Each of its jobs
  // is taken next (the fresh lane); a client with 2 queued waits one round of the others.
  Lanes l(16, 16);
  for (uint32_t c = 1; c <= 8; ++c) {
    for (uint32_t n = 0; n < 8; ++n) REQUIRE(l.push(c, Priority::kNormal, false, n));
  }
  uint32_t v = 0;
  uint32_t lane = 0;
  for (uint32_t round = 0; round < 5; ++round) {
    REQUIRE(l.picker.pop(&v, &lane));  // a flood's job is running
    REQUIRE(l.push(12, Priority::kNormal, true, round));
    REQUIRE(l.picker.pop(&v, &lane));
    CHECK(v == 12000 + round);
  }
  // Client 13 queues two: the first waits for the lanes ahead of it in this round, not for the
  // 8 x 8 jobs queued.
  REQUIRE(l.push(13, Priority::kNormal, false, 0));
  REQUIRE(l.push(13, Priority::kNormal, false, 1));
  uint32_t taken = 0;
  for (;;) {
    REQUIRE(l.picker.pop(&v, &lane));
    ++taken;
    if (v / 1000 == 13) break;
  }
  CHECK(taken <= 9);
}

TEST_CASE("LanePicker: a client lane of weight 3 gives three jobs per turn") {
  Lanes l(32, 4);
  l.queue.set_weight(l.queue.column_of(1), 3);
  CHECK(l.queue.weight(l.queue.column_of(1)) == 3);
  CHECK(l.queue.weight(l.queue.column_of(2)) == 1);
  for (uint32_t n = 0; n < 9; ++n) REQUIRE(l.push(1, Priority::kNormal, false, n));
  for (uint32_t n = 0; n < 5; ++n) REQUIRE(l.push(2, Priority::kNormal, false, n));
  std::vector<uint32_t> clients;
  for (uint32_t v : l.drain()) clients.push_back(v / 1000);
  CHECK(clients == std::vector<uint32_t>{1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 2, 2, 2});
  // A scribbled weight is clamped; 0 reads as 1.
  l.queue.set_weight(0, 200);
  CHECK(l.queue.weight(0) == PoolQueue::kMaxWeight);
  l.queue.set_weight(0, 0);
  CHECK(l.queue.weight(0) == 1);
}

TEST_CASE("LanePicker: a waiting lower class gets a tenth of the starts; nothing starves") {
  Lanes l(64, 2);
  REQUIRE(l.push(0, Priority::kLow, false, 0));
  REQUIRE(l.push(0, Priority::kLow, false, 1));
  REQUIRE(l.push(0, Priority::kNormal, false, 0));
  REQUIRE(l.push(0, Priority::kNormal, false, 1));
  uint32_t v = 0;
  uint32_t lane = 0;
  std::vector<uint32_t> starts;
  // High jobs keep coming: one is always queued.
  REQUIRE(l.push(1, Priority::kHigh, false, 0));
  for (uint32_t n = 1; starts.size() < 40; ++n) {
    REQUIRE(l.picker.pop(&v, &lane));
    starts.push_back(l.queue.rank_of(lane));
    REQUIRE(l.push(1, Priority::kHigh, false, n));
  }
  // The first 9 starts are high; then low and normal (the lowest waiting first); each waiting
  // class gets one start in ten.
  std::map<uint32_t, std::vector<size_t>> at;
  for (size_t i = 0; i < starts.size(); ++i) at[starts[i]].push_back(i);
  CHECK(at[2] == std::vector<size_t>{9, 19});   // low: its two jobs
  CHECK(at[1] == std::vector<size_t>{10, 20});  // normal
  CHECK(at[0].size() == 36);
}

TEST_CASE("LanePicker: batching looks at a level's next job, then takes it from that lane") {
  Lanes l(8, 4);
  REQUIRE(l.push(1, Priority::kHigh, false, 0));
  REQUIRE(l.push(2, Priority::kNormal, false, 0));
  REQUIRE(l.push(3, Priority::kNormal, false, 0));
  REQUIRE(l.push(4, Priority::kNormal, true, 0));
  const uint32_t normal = priority_rank(Priority::kNormal);
  uint32_t v = 0;
  uint32_t lane = 0;
  std::vector<uint32_t> got;
  while (l.picker.peek_level(normal, &v, &lane)) {
    uint32_t taken = 0;
    REQUIRE(l.picker.pop_lane(lane, &taken));
    CHECK(taken == v);
    CHECK(l.queue.rank_of(lane) == normal);
    got.push_back(taken);
  }
  CHECK(got == std::vector<uint32_t>{4000, 2000, 3000});  // the high job is not the batch's
  CHECK_FALSE(l.picker.value_ready_in_level(normal));
  CHECK(l.picker.value_ready_in_level(priority_rank(Priority::kHigh)));
  CHECK(l.picker.value_ready());
}

TEST_CASE("PoolQueue: threads pushing to every lane and popping with pickers, each value once") {
  test::Watchdog watchdog("stalled pool queue", 60 * test::kSecond);
  constexpr uint32_t kProducers = 4, kConsumers = 3;
  const uint32_t per_producer = static_cast<uint32_t>(test::scaled(20000));
  Lanes l(16, 4);
  std::atomic<uint32_t> done_producers{0};
  std::vector<std::vector<uint32_t>> popped(kConsumers);
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kProducers; ++t) {
    threads.emplace_back([&, t] {
      for (uint32_t n = 0; n < per_producer; ++n) {
        const auto p = static_cast<Priority>(n % kPriorityLevels);
        const uint32_t lane = l.queue.lane_for(t, p, n % 5 == 0);
        const uint32_t value = t << 24 | n;
        while (!l.queue.try_push(lane, value)) std::this_thread::yield();
      }
      done_producers.fetch_add(1);
    });
  }
  for (uint32_t c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&, c] {
      LanePicker picker(l.queue);
      uint32_t v = 0;
      uint32_t lane = 0;
      for (;;) {
        if (picker.pop(&v, &lane)) {
          popped[c].push_back(v);
          continue;
        }
        if (done_producers.load() == kProducers && !l.queue.settle_active_bits()) break;
        std::this_thread::yield();
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<uint32_t> seen(kProducers * per_producer, 0);
  for (const auto& values : popped) {
    for (uint32_t v : values) ++seen[(v >> 24) * per_producer + (v & 0xFFFFFF)];
  }
  uint32_t wrong = 0;
  for (uint32_t count : seen) wrong += count != 1;
  CHECK(wrong == 0);
  CHECK(l.queue.size() == 0);
}

}  // namespace
}  // namespace gpuq
