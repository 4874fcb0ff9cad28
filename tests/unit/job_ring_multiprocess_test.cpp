// JobRing shared by processes: forked producer and consumer children over a ring in shared
// memory (an anonymous shared mapping, or a named QueueSegment that each child maps again at its
// own address). The parent checks that every value was seen exactly once.
#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "gpuq/common/job_ring.hpp"
#include "gpuq/common/shm.hpp"
#include "support/test_support.hpp"

namespace gpuq {
namespace {

// Everything the children share besides the ring, placed in an anonymous shared mapping.
struct Tally {
  std::atomic<uint64_t>* popped;  // values taken by all consumers
  std::atomic<uint32_t>* count;   // per value: times popped
  std::atomic<uint64_t>* bitmap;  // per value: one bit, set with fetch_or
  std::atomic<uint32_t>* errors;  // values a consumer saw twice (bit already set) or never pushed
};

enum ChildExitCode : int { kChildOk = 0, kChildDeadline = 3, kChildNoSegment = 4 };

int producer_main(JobRing ring, uint32_t first, uint32_t count, uint64_t deadline) {
  for (uint32_t v = first; v < first + count; ++v) {
    while (!ring.try_push(v)) {
      if (monotonic_ns() > deadline) return kChildDeadline;
      sched_yield();
    }
  }
  return kChildOk;
}

int consumer_main(JobRing ring, const Tally& tally, uint64_t total, uint64_t deadline) {
  while (tally.popped->load() < total) {
    uint32_t v = 0;
    if (!ring.try_pop(&v)) {
      if (monotonic_ns() > deadline) return kChildDeadline;
      sched_yield();
      continue;
    }
    if (v >= total) {
      tally.errors->fetch_add(1);
      continue;
    }
    const uint64_t bit = uint64_t{1} << (v % 64);
    if ((tally.bitmap[v / 64].fetch_or(bit) & bit) != 0) tally.errors->fetch_add(1);
    tally.count[v].fetch_add(1);
    tally.popped->fetch_add(1);
  }
  return kChildOk;
}

// Forks `producers` + `consumers` children over the ring that `ring_in_child()` returns in each
// child, and checks the outcome in the parent.
template <typename RingInChild>
void run_processes(JobRing parent_view, RingInChild&& ring_in_child, uint32_t producers,
                   uint32_t consumers, uint32_t per_producer) {
  const uint64_t total = uint64_t{producers} * per_producer;
  test::SharedMemory shared(sizeof(uint64_t) * (3 + total / 64) + sizeof(uint32_t) * total + 4096);
  test::SharedArena arena(shared);
  Tally tally{arena.make_array<std::atomic<uint64_t>>(1),
              arena.make_array<std::atomic<uint32_t>>(total),
              arena.make_array<std::atomic<uint64_t>>(total / 64 + 1),
              arena.make_array<std::atomic<uint32_t>>(1)};
  const uint64_t deadline = monotonic_ns() + 30 * test::kSecond;  // children give up then

  std::vector<pid_t> children;
  for (uint32_t p = 0; p < producers; ++p) {
    children.push_back(test::fork_child([&] {
      JobRing ring;
      if (!ring_in_child(&ring)) return static_cast<int>(kChildNoSegment);
      return producer_main(ring, p * per_producer, per_producer, deadline);
    }));
  }
  for (uint32_t c = 0; c < consumers; ++c) {
    children.push_back(test::fork_child([&] {
      JobRing ring;
      if (!ring_in_child(&ring)) return static_cast<int>(kChildNoSegment);
      return consumer_main(ring, tally, total, deadline);
    }));
  }

  for (pid_t pid : children) {
    REQUIRE(pid > 0);
    const test::ChildExit e = test::wait_child(pid, 40 * test::kSecond);
    INFO("child " << pid << ": " << e.describe());
    CHECK(e.ok());
  }

  CHECK(tally.popped->load() == total);
  CHECK(tally.errors->load() == 0);
  uint64_t not_once = 0;
  for (uint64_t v = 0; v < total; ++v) {
    if (tally.count[v].load() != 1) ++not_once;
  }
  CHECK(not_once == 0);
  uint64_t bits = 0;
  for (uint64_t w = 0; w <= total / 64; ++w) bits += __builtin_popcountll(tally.bitmap[w].load());
  CHECK(bits == total);
  CHECK(parent_view.size() == 0);
  uint32_t v = 0;
  CHECK_FALSE(parent_view.try_pop(&v));
}

TEST_CASE("JobRing in an anonymous shared mapping: forked producers and consumers") {
  const uint32_t per_producer = static_cast<uint32_t>(test::scaled(100'000));
  for (uint32_t cap : {3u, 20u}) {
    CAPTURE(cap);
    test::SharedMemory ring_memory(JobRing::bytes_for(cap));
    JobRing ring = JobRing::create(ring_memory.base(), cap);

    run_processes(
        ring,
        [&](JobRing* out) {
          *out = JobRing(ring_memory.base());
          return true;
        },
        3, 3, per_producer);
  }
}

TEST_CASE("JobRing in a QueueSegment that each child maps again at its own address") {
  const std::string name = "gpuq_test_ring_" + std::to_string(::getpid());
  QueueSegment::remove(name);
  auto created = QueueSegment::create(name, JobRing::bytes_for(20), 0600);
  REQUIRE_MESSAGE(created.ok(), created.error().to_string());
  JobRing ring = JobRing::create(created->address(), 20);
  const uint32_t per_producer = static_cast<uint32_t>(test::scaled(50'000));

  // The child keeps its own mapping alive until it _exit()s.
  run_processes(
      ring,
      [&](JobRing* out) {
        static QueueSegment child_segment;
        auto opened = QueueSegment::open(name);
        if (!opened.ok() || opened->address() == created->address()) return false;
        child_segment = std::move(*opened);
        *out = JobRing(child_segment.address());
        return true;
      },
      2, 2, per_producer);

  CHECK(QueueSegment::remove(name));
}

}  // namespace
}  // namespace gpuq
