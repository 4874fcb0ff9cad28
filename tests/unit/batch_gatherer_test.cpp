// BatchGatherer (daemon/worker/batch_gatherer.hpp): when a worker that took a batched op's job
// stops gathering more. The worker loop's pops and claims run against real rings and Python
// workers in python/tests/test_batching.py.
#include "batch_gatherer.hpp"

#include <doctest/doctest.h>

namespace gpuq::daemon {
namespace {

constexpr uint64_t kUs = 1000;
constexpr BatchSettings kSettings{8, 500};

TEST_CASE("BatchGatherer: a lone job never waits for company") {
  BatchGatherer g;
  g.begin(7, kSettings, 1, 1'000'000);
  CHECK_FALSE(g.full());
  CHECK_FALSE(g.wait_for_more(1'000'000));  // the op's first batch: nothing to expect
  g.finish();
  g.begin(7, kSettings, 1, 2'000'000);
  CHECK_FALSE(g.wait_for_more(2'000'000));  // its previous batch held one job
}

TEST_CASE("BatchGatherer: after a batch of several jobs it waits for as many, within the delay") {
  BatchGatherer g;
  g.begin(7, kSettings, 1, 0);
  g.add(1, 0);
  g.add(1, 0);
  CHECK(g.jobs() == 3);
  CHECK(g.rows() == 3);
  g.finish();
  CHECK(g.expected(7) == 3);
  const uint64_t t0 = 10'000'000;
  g.begin(7, kSettings, 1, t0);
  CHECK(g.deadline_ns() == t0 + 500 * kUs);
  CHECK(g.wait_for_more(t0));
  g.add(1, t0 + kUs);
  g.add(1, t0 + 2 * kUs);
  CHECK_FALSE(g.wait_for_more(t0 + 2 * kUs));  // as many as last time: call now
  g.finish();
  CHECK(g.expected(7) == 3);
}

TEST_CASE("BatchGatherer: while jobs keep coming it waits until the delay has passed") {
  BatchGatherer g;
  g.begin(7, BatchSettings{64, 500}, 1, 0);
  for (int i = 0; i < 20; ++i) g.add(1, 0);
  g.finish();  // expects 21 jobs
  const uint64_t t0 = 10'000'000;
  g.begin(7, BatchSettings{64, 500}, 1, t0);
  for (uint64_t t = 40; t <= 480; t += 40) {
    CHECK(g.wait_for_more(t0 + t * kUs - kUs));
    g.add(1, t0 + t * kUs);
  }
  CHECK(g.wait_for_more(t0 + 499 * kUs));
  CHECK_FALSE(g.wait_for_more(t0 + 500 * kUs));  // the delay has passed
}

TEST_CASE("BatchGatherer: it waits for the fewest jobs of the op's last kRecentBatches batches") {
  BatchGatherer g;
  auto batch = [&](uint32_t jobs) {
    g.begin(7, kSettings, 1, 0);
    for (uint32_t i = 1; i < jobs; ++i) g.add(1, 0);
    g.finish();
  };
  // Two workers share the jobs of 8 clients unevenly (5 and 3, then 3 and 5...): one that
  // waited for as many as its last batch had would wait, time and again, for jobs in the
  // other's batch.
  for (const uint32_t jobs : {5u, 3u, 6u, 4u}) batch(jobs);
  CHECK(g.expected(7) == 3);
  batch(6);  // the 5 leaves the window, the 3 stays
  CHECK(g.expected(7) == 3);
  for (int i = 0; i < 3; ++i) batch(6);
  CHECK(g.expected(7) == 6);
  batch(1);  // a quiet spell: the next job runs at once
  CHECK(g.expected(7) == 1);
}

TEST_CASE(
    "BatchGatherer: no job for its quiet gap ends the wait (the others are in other batches)") {
  BatchGatherer g;
  g.begin(7, kSettings, 1, 0);
  for (int i = 0; i < 5; ++i) g.add(1, 0);
  g.finish();  // expects 6 jobs
  const uint64_t t0 = 10'000'000;
  g.begin(7, kSettings, 1, t0);
  CHECK(g.wait_for_more(t0 + BatchGatherer::kMinQuietNs - 1));
  CHECK_FALSE(g.wait_for_more(t0 + BatchGatherer::kMinQuietNs));  // none since the first
  g.begin(7, kSettings, 1, t0);  // the default delay's tenth is the least gap: 50 µs
  g.add(1, t0 + 30 * kUs);
  CHECK(g.wait_for_more(t0 + 30 * kUs + BatchGatherer::kMinQuietNs - 1));
  CHECK_FALSE(g.wait_for_more(t0 + 30 * kUs + BatchGatherer::kMinQuietNs));
  // A longer delay, a longer gap: a tenth of it (5 ms: 500 µs).
  g.begin(7, BatchSettings{8, 5000}, 1, t0);
  CHECK(g.wait_for_more(t0 + 499 * kUs));
  CHECK_FALSE(g.wait_for_more(t0 + 500 * kUs));
}

TEST_CASE("BatchGatherer: each op remembers its own previous batch") {
  BatchGatherer g;
  g.begin(7, kSettings, 1, 0);
  g.add(1, 0);
  g.finish();
  g.begin(9, kSettings, 1, 0);
  g.finish();
  CHECK(g.expected(7) == 2);
  CHECK(g.expected(9) == 1);
  CHECK(g.expected(11) == 1);
  g.begin(9, kSettings, 1, 0);
  CHECK_FALSE(g.wait_for_more(0));
}

TEST_CASE("BatchGatherer: max_batch_size rows make the batch full") {
  BatchGatherer g;
  g.begin(7, kSettings, 3, 0);
  CHECK_FALSE(g.full());
  g.add(4, 0);
  CHECK_FALSE(g.full());
  g.add(1, 0);
  CHECK(g.full());  // 8 rows
  BatchGatherer alone;
  alone.begin(7, kSettings, 11, 0);  // a first job above the maximum runs alone
  CHECK(alone.full());
  CHECK_FALSE(alone.fits(1));
}

TEST_CASE("BatchGatherer: a job joins only while the batch stays within max_batch_size") {
  BatchGatherer g;
  g.begin(7, kSettings, 5, 0);  // 8 rows at most
  CHECK(g.fits(3));
  CHECK_FALSE(g.fits(4));
  CHECK_FALSE(g.fits(UINT64_MAX));
  g.add(3, 0);
  CHECK(g.full());
  CHECK_FALSE(g.fits(1));
  CHECK(g.rows() == 8);
}

TEST_CASE("BatchGatherer: no delay means no wait, whatever came last time") {
  BatchGatherer g;
  g.begin(7, BatchSettings{8, 0}, 1, 0);
  g.add(1, 0);
  g.add(1, 0);
  g.finish();
  g.begin(7, BatchSettings{8, 0}, 1, 100);
  CHECK_FALSE(g.wait_for_more(100));
}

}  // namespace
}  // namespace gpuq::daemon
