// Which pools are down (daemon/supervisor/pool_outage.hpp): a pool's ready workers and failed
// starts, observed at made-up times, and the changes it reports.
#include <doctest/doctest.h>

#include "pool_outage.hpp"

namespace gpuq::daemon {
namespace {

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kT0 = 5'000 * kMs;  // any time; not 0
using Change = PoolOutage::Change;

TEST_CASE(
    "pool outage: a pool whose last ready worker goes is down after the time, up again "
    "with a ready worker") {
  PoolOutage o(2, 1000 * kMs);
  CHECK(o.observe(0, 2, false, kT0) == Change::kNone);
  CHECK_FALSE(o.unserved(0));
  CHECK(o.next_due() == 0);

  // The last ready worker dies: the clock starts then (no failed start needed).
  CHECK(o.observe(0, 0, false, kT0 + 10 * kMs) == Change::kNone);
  CHECK(o.unserved(0));
  CHECK(o.unserved_since(0) == kT0 + 10 * kMs);
  CHECK(o.next_due() == kT0 + 1010 * kMs);
  CHECK(o.observe(0, 0, false, kT0 + 1009 * kMs) == Change::kNone);
  CHECK_FALSE(o.down(0));
  CHECK(o.observe(0, 0, true, kT0 + 1010 * kMs) == Change::kDown);
  CHECK(o.down(0));
  CHECK(o.next_due() == 0);                                         // nothing more to wait for
  CHECK(o.observe(0, 0, true, kT0 + 5000 * kMs) == Change::kNone);  // reported once
  CHECK(o.down(0));
  CHECK_FALSE(o.down(1));  // the other pool is untouched

  CHECK(o.set_reason(0, "pool 'a' has had no ready worker"));
  CHECK_FALSE(o.set_reason(0, "pool 'a' has had no ready worker"));  // unchanged
  CHECK(o.reason(0) == "pool 'a' has had no ready worker");

  CHECK(o.observe(0, 1, false, kT0 + 6000 * kMs) == Change::kUp);
  CHECK_FALSE(o.down(0));
  CHECK_FALSE(o.unserved(0));
  CHECK(o.reason(0).empty());
  CHECK(o.observe(0, 1, false, kT0 + 7000 * kMs) == Change::kNone);
}

TEST_CASE("pool outage: a ready worker in time stops the clock; the next outage counts anew") {
  PoolOutage o(1, 1000 * kMs);
  CHECK(o.observe(0, 1, false, kT0) == Change::kNone);
  CHECK(o.observe(0, 0, false, kT0 + 100 * kMs) == Change::kNone);  // a restart begins
  CHECK(o.observe(0, 1, false, kT0 + 900 * kMs) == Change::kNone);  // ready again in time
  CHECK_FALSE(o.unserved(0));
  CHECK(o.observe(0, 0, false, kT0 + 1500 * kMs) == Change::kNone);
  CHECK(o.unserved_since(0) == kT0 + 1500 * kMs);  // not the first outage's start
  CHECK(o.observe(0, 0, false, kT0 + 2400 * kMs) == Change::kNone);
  CHECK(o.observe(0, 0, false, kT0 + 2500 * kMs) == Change::kDown);
}

TEST_CASE(
    "pool outage: a pool still in its first start is not down, however long it takes, "
    "until a start fails") {
  PoolOutage o(1, 1000 * kMs);
  for (uint64_t t = 0; t < 60'000; t += 1000) {
    CHECK(o.observe(0, 0, /*start_failed=*/false, kT0 + t * kMs) == Change::kNone);
  }
  CHECK_FALSE(o.unserved(0));
  CHECK(o.next_due() == 0);
  // A worker fails to start: the clock starts at that failure.
  CHECK(o.observe(0, 0, true, kT0 + 70'000 * kMs) == Change::kNone);
  CHECK(o.unserved_since(0) == kT0 + 70'000 * kMs);
  CHECK(o.observe(0, 0, true, kT0 + 70'999 * kMs) == Change::kNone);
  CHECK(o.observe(0, 0, true, kT0 + 71'000 * kMs) == Change::kDown);
}

TEST_CASE("pool outage: pool_down_fail_ms 0 never makes a pool down") {
  PoolOutage o(1, 0);
  CHECK(o.observe(0, 1, false, kT0) == Change::kNone);
  for (uint64_t t = 1; t < 100; ++t) {
    CHECK(o.observe(0, 0, true, kT0 + t * 3600'000 * kMs) == Change::kNone);
  }
  CHECK_FALSE(o.down(0));
  CHECK(o.unserved(0));  // still reported: how long it has been without a worker
  CHECK(o.next_due() == 0);
}

TEST_CASE("pool outage: next_due is the earliest of the pools' deadlines") {
  PoolOutage o(3, 1000 * kMs);
  CHECK(o.observe(0, 0, true, kT0 + 300 * kMs) == Change::kNone);
  CHECK(o.observe(1, 0, true, kT0 + 100 * kMs) == Change::kNone);
  CHECK(o.observe(2, 1, false, kT0) == Change::kNone);
  CHECK(o.next_due() == kT0 + 1100 * kMs);
  CHECK(o.observe(1, 0, true, kT0 + 1100 * kMs) == Change::kDown);
  CHECK(o.next_due() == kT0 + 1300 * kMs);
}

}  // namespace
}  // namespace gpuq::daemon
