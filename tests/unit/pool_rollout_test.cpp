// PoolRollout::next_step (pool_rollout.hpp): what a rolling restart does next, from the pool's
// entries; and rollout_surge_workers, parsed and placed.
#include <doctest/doctest.h>

#include <vector>

#include "config.hpp"
#include "pool_plan.hpp"
#include "pool_rollout.hpp"

using gpuq::daemon::parse_config;
using gpuq::daemon::PoolRollout;
using gpuq::daemon::RolloutSeat;
using gpuq::daemon::RolloutStep;
using Role = RolloutSeat::Role;
using Kind = RolloutStep::Kind;

namespace {

RolloutSeat seat(uint32_t id, Role role, uint32_t generation, bool running = true,
                 bool ready = true, int gpu = -1) {
  RolloutSeat s;
  s.id = id;
  s.role = role;
  s.generation = generation;
  s.running = running;
  s.ready = running && ready;
  s.gpu = gpu;
  return s;
}

RolloutSeat dormant_surge(uint32_t id, int gpu = -1) {
  return seat(id, Role::kSurge, 1, false, false, gpu);
}

}  // namespace

TEST_CASE("PoolRollout: with a surge seat, each old worker is replaced by a new one made ready") {
  // Two active workers at generation 1, one dormant surge seat; the rollout is to generation 2.
  std::vector<RolloutSeat> s = {seat(0, Role::kActive, 1), seat(1, Role::kActive, 1),
                                dormant_surge(2)};
  RolloutStep step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kStartSurge);
  CHECK(step.seat == 2u);
  // Started, not ready yet: wait (no old worker stops before its replacement is ready).
  s[2] = seat(2, Role::kSurge, 2, true, false);
  CHECK(PoolRollout::next_step(s, 2).kind == Kind::kWait);
  // Ready: it takes worker 0's place.
  s[2].ready = true;
  step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kTakeOver);
  CHECK(step.seat == 2u);
  CHECK(step.old == 0u);
  // The swap: entry 2 serves, entry 0 is the surge seat, retiring after its job: wait for it.
  s[2].role = Role::kActive;
  s[0].role = Role::kSurge;
  s[0].retiring = true;
  CHECK(PoolRollout::next_step(s, 2).kind == Kind::kWait);
  // It exited: dormant. Then worker 1's turn, in the same seat.
  s[0] = dormant_surge(0);
  step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kStartSurge);
  CHECK(step.seat == 0u);
  s[0] = seat(0, Role::kSurge, 2);
  step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kTakeOver);
  CHECK(step.old == 1u);
  s[0].role = Role::kActive;
  s[1] = dormant_surge(1);
  CHECK(PoolRollout::next_step(s, 2).kind == Kind::kDone);
}

TEST_CASE("PoolRollout: old spares are started again first, then serve as the seats") {
  std::vector<RolloutSeat> s = {seat(0, Role::kActive, 1), seat(1, Role::kSpare, 1),
                                dormant_surge(2)};
  RolloutStep step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kRetireSpare);
  CHECK(step.seat == 1u);
  // Retired, then waiting for its start again (the WorkerSet's): the surge seat is not needed.
  s[1] = seat(1, Role::kSpare, 1, false);
  s[1].awaits_start = true;
  step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kStartSurge);  // a dormant surge on the GPU comes first
  // Without a surge seat: the spare's start is waited for.
  std::vector<RolloutSeat> no_surge = {s[0], s[1]};
  CHECK(PoolRollout::next_step(no_surge, 2).kind == Kind::kWait);
  no_surge[1] = seat(1, Role::kSpare, 2);
  step = PoolRollout::next_step(no_surge, 2);
  CHECK(step.kind == Kind::kTakeOver);
  CHECK(step.seat == 1u);
  CHECK(step.old == 0u);
}

TEST_CASE("PoolRollout: a seat must be on the old worker's GPU; none is a clear failure") {
  std::vector<RolloutSeat> s = {seat(0, Role::kActive, 1, true, true, 0),
                                seat(1, Role::kActive, 1, true, true, 1), dormant_surge(2, 0)};
  RolloutStep step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kStartSurge);
  // Worker 0 replaced; worker 1 is on GPU 1, where the pool has no seat.
  s[0] = seat(0, Role::kSurge, 1, false, false, 0);
  s[2] = seat(2, Role::kActive, 2, true, true, 0);
  step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kFail);
  CHECK(step.old == 1u);
  CHECK(step.why.find("rollout_surge_workers") != std::string::npos);
  CHECK(step.why.find("on each of its GPUs") != std::string::npos);
  // A pool with no seat at all fails at once, naming both ways to give it one.
  std::vector<RolloutSeat> bare = {seat(0, Role::kActive, 1)};
  step = PoolRollout::next_step(bare, 2);
  CHECK(step.kind == Kind::kFail);
  CHECK(step.why.find("spare_workers") != std::string::npos);
}

TEST_CASE("PoolRollout: workers not running need nothing; a stray new surge worker stops") {
  // Worker 1 died and waits for its start: that start is of the new generation already.
  std::vector<RolloutSeat> s = {seat(0, Role::kActive, 2), seat(1, Role::kActive, 1, false),
                                seat(2, Role::kSurge, 2)};
  s[1].awaits_start = true;
  RolloutStep step = PoolRollout::next_step(s, 2);
  CHECK(step.kind == Kind::kRetireSpare);
  CHECK(step.seat == 2u);
  s[2] = dormant_surge(2);
  CHECK(PoolRollout::next_step(s, 2).kind == Kind::kDone);
}

TEST_CASE("rollout_surge_workers: default 1 in a cpu pool, 0 in a gpu pool, bounded, placed") {
  const std::vector<int> allowed = gpuq::daemon::allowed_cpus();
  REQUIRE_FALSE(allowed.empty());
  auto c = parse_config(R"({"pools":[{"name":"a","workers":2}]})", allowed);
  REQUIRE(c.ok());
  CHECK(c->pools[0].rollout_surge_workers == 1);
  CHECK(c->pools[0].entries() == 3);
  auto g = parse_config(R"({"pools":[{"name":"g","kind":"gpu","gpus":[0]}]})", allowed);
  REQUIRE(g.ok());
  CHECK(g->pools[0].rollout_surge_workers == 0);
  auto two = parse_config(
      R"({"max_pools":1,"pools":[{"name":"a","workers":1,"rollout_surge_workers":2}]})", allowed);
  REQUIRE(two.ok());
  CHECK(two->pools[0].entries() == 3);
  auto plan = gpuq::daemon::plan_pools(*two, {}, {});
  REQUIRE(plan.ok());
  CHECK(plan->placements.size() == 3);
  for (const char* bad : {R"({"pools":[{"name":"a","rollout_surge_workers":65}]})",
                          R"({"pools":[{"name":"a","rollout_surge_workers":true}]})"}) {
    auto r = parse_config(bad, allowed);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().message().find("pools[0].rollout_surge_workers") != std::string::npos);
  }
}
