// Where a pool's entries run (daemon/supervisor/placement.hpp): a cpu pool's on its CPUs round
// robin; a gpu pool's on its GPUs, each with the GPU's local CPUs this daemon may use, its
// CUDA_VISIBLE_DEVICES and its share of the pool's budget there, spares and surge seats after
// the workers; and whether a worker must be restarted to run at a new placement (another GPU, or
// less memory), which is what a config reload rolls a gpu pool for.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "placement.hpp"

namespace gpuq::daemon {
namespace {

PoolConfig gpu_pool(const std::string& name, uint32_t per_gpu, uint32_t spares, uint32_t surge) {
  PoolConfig p;
  p.name = name;
  p.kind = PoolKind::kGpu;
  p.workers_per_gpu = per_gpu;
  p.spare_workers = spares;
  p.rollout_surge_workers = surge;
  return p;
}

std::vector<GpuInfo> two_gpus() {
  std::vector<GpuInfo> out(2);
  out[0].index = 0;
  out[0].uuid = "GPU-a";
  out[0].local_cpus = {0, 1};
  out[1].index = 1;  // no UUID: named by its index
  out[1].local_cpus = {8, 9};
  return out;
}

TEST_CASE("place_cpu_pool: workers, then spares and surge seats, round robin over its cpus") {
  PoolConfig p;
  p.workers = 3;
  p.max_workers = 3;
  p.spare_workers = 1;
  p.rollout_surge_workers = 1;
  p.cpus = {4, 5};
  const std::vector<WorkerPlacement> at = place_cpu_pool(p);
  REQUIRE(at.size() == 5);
  const std::vector<int> cpus = {4, 5, 4, 5, 4};
  for (size_t i = 0; i < at.size(); ++i) {
    CHECK(at[i].cpus == std::vector<int>{cpus[i]});
    CHECK(at[i].visible_devices == "-1");
    CHECK(at[i].gpu == -1);
  }
}

TEST_CASE("place_gpu_pools: GPUs, local CPUs, budgets; spares and surge seats after the workers") {
  std::vector<PoolConfig> pools = {gpu_pool("a", 2, 1, 1), gpu_pool("b", 1, 0, 0), PoolConfig{}};
  pools[1].memory_limit_fraction = 0.5;
  const std::vector<int> allowed = {0, 1, 2, 3};  // GPU 1's CPUs are not among them
  auto placed = place_gpu_pools(pools, {{0, 1}, {0}, {}}, two_gpus(), allowed);
  REQUIRE(placed);
  const GpuPoolPlacement& a = (*placed)[0];
  CHECK(a.gpus == std::vector<uint32_t>{0, 1});
  CHECK(a.workers(pools[0]) == 4);
  // 2 per GPU, round robin over them; a spare (GPU 0), a surge seat (GPU 1).
  REQUIRE(a.entries.size() == 6);
  const std::vector<int> on = {0, 1, 0, 1, 0, 1};
  for (size_t i = 0; i < on.size(); ++i) CHECK(a.entries[i].gpu == on[i]);
  CHECK(a.entries[0].visible_devices == "GPU-a");
  CHECK(a.entries[1].visible_devices == "1");
  CHECK(a.entries[0].cpus == std::vector<int>{0, 1});
  CHECK(a.entries[1].cpus == allowed);  // none of its own: every CPU the daemon may use
  // On GPU 0, b takes 0.5; a the rest of the default, 0.4, shared by its 3 entries there.
  CHECK(a.entries[0].memory.fraction == doctest::Approx(0.4 / 3));
  // On GPU 1, a alone: 0.9 among its 3 entries there.
  CHECK(a.entries[1].memory.fraction == doctest::Approx(0.3));
  CHECK((*placed)[1].entries.size() == 1);
  CHECK((*placed)[1].entries[0].memory.fraction == doctest::Approx(0.5));
  CHECK((*placed)[2].entries.empty());  // not a gpu pool
  // Too much promised on one GPU: refused as plan_memory_budgets refuses it.
  pools[0].memory_limit_fraction = 0.6;
  auto over = place_gpu_pools(pools, {{0, 1}, {0}, {}}, two_gpus(), allowed);
  REQUIRE(!over);
  CHECK(over.error().message().find("more than all of it") != std::string::npos);
}

TEST_CASE("place_gpu_pools: a gpu pool's growth entries (max_workers), round robin on") {
  PoolConfig g = gpu_pool("g", 1, 1, 0);
  g.max_workers = 5;  // 2 active on 2 GPUs, 3 to grow into
  auto placed = place_gpu_pools({g}, {{0, 1}}, two_gpus(), {0, 1});
  REQUIRE(placed);
  const std::vector<WorkerPlacement>& e = (*placed)[0].entries;
  REQUIRE(e.size() == 6);  // 5, then the spare
  const std::vector<int> on = {0, 1, 0, 1, 0, 0};
  for (size_t i = 0; i < on.size(); ++i) CHECK(e[i].gpu == on[i]);
  // The budget counts the workers and the spare, not the growth entries (dormant).
  CHECK(e[0].memory.fraction == doctest::Approx(0.45));
  CHECK(e[1].memory.fraction == doctest::Approx(0.9));
}

WorkerPlacement on(int gpu, double share) {
  return {{}, "GPU-" + std::to_string(gpu), gpu, {0, share}};
}

TEST_CASE("assign_placements: by role, each worker kept on its GPU where the plan allows") {
  using R = EntryRole;
  // A rollout swapped roles: entry 1 is the surge seat now, entries 0 and 2 the workers, both
  // on GPU 0. The new plan: one worker per GPU, then the seat on GPU 0.
  const std::vector<R> roles = {R::kActive, R::kSurge, R::kActive};
  const std::vector<WorkerPlacement> now = {on(0, 0.3), on(0, 0.3), on(0, 0.3)};
  const std::vector<WorkerPlacement> plan = {on(0, 0.45), on(1, 0.9), on(0, 0.45)};
  const Assigned a = assign_placements(roles, now, plan, 2, 2);
  CHECK(a.active == std::vector<bool>{true, false, true});
  CHECK(a.placements[0].gpu == 0);  // kept on GPU 0
  CHECK(a.placements[2].gpu == 1);  // the other worker takes GPU 1's place
  CHECK(a.placements[1].gpu == 0);  // the seat, its own place (not plan place 1)
  CHECK(a.placements[1].memory.fraction == doctest::Approx(0.45));
}

TEST_CASE("assign_placements: growth starts the lowest growth entries, shrink keeps the lowest") {
  using R = EntryRole;
  // 2 workers on GPUs 0 and 1, 2 growth entries, a spare; the plan grows to 4.
  const std::vector<R> roles = {R::kActive, R::kActive, R::kReserve, R::kReserve, R::kSpare};
  const std::vector<WorkerPlacement> now = {on(0, 0.45), on(1, 0.9), on(0, 0.45), on(1, 0.9),
                                            on(0, 0.45)};
  const std::vector<WorkerPlacement> grown = {on(0, 0.3), on(1, 0.45), on(0, 0.3), on(1, 0.45),
                                              on(0, 0.3)};
  const Assigned g = assign_placements(roles, now, grown, 4, 4);
  CHECK(g.active == std::vector<bool>{true, true, true, true, false});
  for (size_t i = 0; i < 5; ++i) CHECK(g.placements[i].gpu == grown[i].gpu);
  CHECK(needs_restart(now[0], g.placements[0]));  // a smaller share: rolled first
  // Back to 2: the lowest ids stay active (resize_pool retires the highest).
  const std::vector<R> big = {R::kActive, R::kActive, R::kActive, R::kActive, R::kSpare};
  const Assigned s = assign_placements(big, grown, now, 2, 4);
  CHECK(s.active == std::vector<bool>{true, true, false, false, false});
  CHECK(s.placements[0].gpu == 0);
  CHECK(s.placements[1].gpu == 1);
  CHECK(!needs_restart(grown[0], s.placements[0]));  // a larger share: no restart
}

TEST_CASE("entry_without_seat: a worker that stays on a GPU with no spare or surge seat") {
  using R = EntryRole;
  const std::vector<R> roles = {R::kActive, R::kActive, R::kSurge};
  const std::vector<bool> all(3, true);
  CHECK(entry_without_seat(roles, {on(0, 0.3), on(1, 0.3), on(1, 0.3)}, all) == 0);
  CHECK(entry_without_seat(roles, {on(1, 0.3), on(1, 0.3), on(1, 0.3)}, all) == -1);
  // Entry 0 retires (not staying): only entry 1's GPU needs a seat.
  CHECK(entry_without_seat(roles, {on(0, 0.3), on(1, 0.3), on(1, 0.3)}, {false, true, true}) == -1);
}

TEST_CASE("needs_restart: another GPU or less memory, not more") {
  WorkerPlacement now{{0}, "GPU-a", 0, {0, 0.45}};
  WorkerPlacement more = now;
  more.memory.fraction = 0.9;
  WorkerPlacement less = now;
  less.memory.fraction = 0.3;
  WorkerPlacement moved = now;
  moved.gpu = 1;
  WorkerPlacement bytes = now;
  bytes.memory = {1ull << 30, 0};
  CHECK(!needs_restart(now, now));
  CHECK(!needs_restart(now, more));
  CHECK(needs_restart(now, less));
  CHECK(needs_restart(now, moved));
  CHECK(needs_restart(now, bytes));  // bytes against a fraction: not comparable
  WorkerPlacement cpu{{1}, "-1", -1, {}};
  WorkerPlacement cpu2{{2}, "-1", -1, {}};
  CHECK(!needs_restart(cpu, cpu2));  // a cpu pool's new CPUs: its rollout, not this
}

}  // namespace
}  // namespace gpuq::daemon
