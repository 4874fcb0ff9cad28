// Spare workers (daemon/supervisor/spare_pool.hpp): which spare takes a vacant worker's place
// (SparePool::pick, over made-up seats), the pool key `spare_workers` and where the plan puts
// spares. The promotion itself (roles, pinning, hold, WorkerPromote) is stepped with a fake
// launcher in supervisor_step_test.cpp, and run with real processes in tests/fault and
// python/tests.
#include <doctest/doctest.h>

#include <vector>

#include "config.hpp"
#include "pool_plan.hpp"
#include "spare_pool.hpp"

namespace gpuq::daemon {
namespace {

const std::vector<int> kCpu0{0}, kCpu1{1}, kCpus01{0, 1};

SpareSeat active(uint32_t pool, int gpu, const std::vector<int>& cpus, bool ready = true) {
  return {pool, gpu, false, ready, &cpus};
}
SpareSeat spare(uint32_t pool, int gpu, const std::vector<int>& cpus, bool ready = true) {
  return {pool, gpu, true, ready, &cpus};
}

TEST_CASE("spare pool: a ready spare of the vacant worker's pool takes its place") {
  const std::vector<SpareSeat> seats = {active(0, -1, kCpu0), active(0, -1, kCpu1),
                                        spare(0, -1, kCpu0)};
  CHECK(SparePool::pick(seats, 0) == 2u);
  CHECK(SparePool::pick(seats, 1) == 2u);  // pinned elsewhere: it is re-pinned, still chosen
  CHECK_FALSE(SparePool::pick(seats, 2));  // a spare's own death promotes nothing
  CHECK_FALSE(SparePool::pick(seats, 7));  // no such worker
}

TEST_CASE("spare pool: no spare that is not ready, nor one of another pool") {
  const std::vector<SpareSeat> seats = {active(0, -1, kCpu0), spare(0, -1, kCpu0, false),
                                        active(1, -1, kCpu1), spare(1, -1, kCpu1)};
  CHECK_FALSE(SparePool::pick(seats, 0));  // its pool's spare is still starting
  CHECK(SparePool::pick(seats, 2) == 3u);
}

TEST_CASE("spare pool: on a gpu pool only a spare on the same GPU qualifies") {
  const std::vector<SpareSeat> seats = {active(0, 0, kCpus01), active(0, 1, kCpus01),
                                        spare(0, 1, kCpus01)};
  CHECK_FALSE(SparePool::pick(seats, 0));  // GPU 0 has no spare: a fresh start, as before
  CHECK(SparePool::pick(seats, 1) == 2u);
}

TEST_CASE("spare pool: a spare already on the vacant worker's CPUs is preferred") {
  const std::vector<SpareSeat> seats = {active(0, -1, kCpu0), active(0, -1, kCpu1),
                                        spare(0, -1, kCpu0), spare(0, -1, kCpu1)};
  CHECK(SparePool::pick(seats, 0) == 2u);
  CHECK(SparePool::pick(seats, 1) == 3u);
  const std::vector<SpareSeat> one_left = {active(0, -1, kCpu0), active(0, -1, kCpu1),
                                           spare(0, -1, kCpu0, false), spare(0, -1, kCpu1)};
  CHECK(SparePool::pick(one_left, 0) == 3u);  // the other one, re-pinned
}

TEST_CASE("spare_workers: parsed, bounded, and counted in the total of workers, not the ring") {
  const std::vector<int> cpus = {0, 1};
  auto c = parse_config(
      R"({"pools":[{"name":"a","workers":2,"spare_workers":1,"rollout_surge_workers":0}]})", cpus);
  REQUIRE(c.ok());
  CHECK(c->pools[0].workers == 2);
  CHECK(c->pools[0].spare_workers == 1);
  CHECK(c->pools[0].entries() == 3);
  CHECK(ring_capacity(*c, c->pools[0]) == 20);  // queue_factor x active workers

  auto none =
      parse_config(R"({"pools":[{"name":"a","workers":2,"rollout_surge_workers":0}]})", cpus);
  REQUIRE(none.ok());
  CHECK(none->pools[0].spare_workers == 0);
  CHECK(none->pools[0].entries() == 2);

  for (const char* bad : {R"({"pools":[{"name":"a","spare_workers":65}]})",
                          R"({"pools":[{"name":"a","spare_workers":-1}]})",
                          R"({"pools":[{"name":"a","spare_workers":"1"}]})"}) {
    auto r = parse_config(bad, cpus);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message().find("pools[0].spare_workers") != std::string::npos);
  }
  // 1000 workers and 30 spares: more than kMaxWorkers (1024) processes.
  auto too_many = parse_config(
      R"({"queue_factor":1,"pools":[{"name":"a","workers":1000,"spare_workers":30}]})", cpus);
  REQUIRE_FALSE(too_many.ok());
  CHECK(too_many.error().message().find("spare_workers included") != std::string::npos);
}

TEST_CASE("spare_workers: a cpu pool's spares are placed after its workers, round robin") {
  const std::vector<int> allowed = allowed_cpus();
  REQUIRE_FALSE(allowed.empty());
  const int cpu = allowed.front();
  auto c = parse_config(R"({"max_pools":2,"pools":[{"name":"a","workers":2,"spare_workers":2,)"
                        R"("rollout_surge_workers":0,"cpus":[)" +
                            std::to_string(cpu) +
                            "]},{\"name\":\"b\",\"workers\":1,\"rollout_surge_workers\":0,"
                            "\"cpus\":[" +
                            std::to_string(cpu) + "]}]}",
                        allowed);
  REQUIRE(c.ok());
  auto plan = plan_pools(*c, {}, {});
  REQUIRE(plan.ok());
  REQUIRE(plan->placements.size() == 5);  // 2 + 2 spares, then pool b's 1
  for (const WorkerPlacement& at : plan->placements) {
    CHECK(at.cpus == std::vector<int>{cpu});
    CHECK(at.visible_devices == "-1");
    CHECK(at.gpu == -1);
  }
}

}  // namespace
}  // namespace gpuq::daemon
