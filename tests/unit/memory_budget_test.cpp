// Device memory budgets (daemon/supervisor/memory_budget.hpp, docs/config.md "Device memory
// budgets"): a pool's memory_limit is its budget on each of its GPUs, divided among its workers
// and spares there; the pools that set none share 0.9 of the device after the others; pools
// whose budgets on one GPU add up to more than the device are refused, naming the GPU, the pools
// and the sum.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "memory_budget.hpp"

namespace gpuq::daemon {
namespace {

constexpr uint64_t kGiB = 1ull << 30;

PoolConfig gpu_pool(const std::string& name, uint32_t per_gpu = 1, uint32_t spares = 0) {
  PoolConfig p;
  p.name = name;
  p.kind = PoolKind::kGpu;
  p.workers_per_gpu = per_gpu;
  p.spare_workers = spares;
  return p;
}

PoolConfig with_fraction(PoolConfig p, double f) {
  p.memory_limit_fraction = f;
  return p;
}

PoolConfig with_bytes(PoolConfig p, uint64_t b) {
  p.memory_limit_bytes = b;
  return p;
}

std::vector<GpuInfo> gpus(std::vector<uint64_t> memory) {
  std::vector<GpuInfo> out;
  for (uint32_t i = 0; i < memory.size(); ++i) {
    GpuInfo g;
    g.index = i;
    g.uuid = "GPU-" + std::to_string(i);
    g.memory_bytes = memory[i];
    out.push_back(g);
  }
  return out;
}

TEST_CASE("workers_on_gpus: workers_per_gpu on each GPU, spares round robin from the first") {
  CHECK(workers_on_gpus(gpu_pool("p", 2, 0), 3) == std::vector<uint32_t>{2, 2, 2});
  CHECK(workers_on_gpus(gpu_pool("p", 1, 1), 2) == std::vector<uint32_t>{2, 1});
  CHECK(workers_on_gpus(gpu_pool("p", 1, 5), 2) == std::vector<uint32_t>{4, 3});
  CHECK(workers_on_gpus(gpu_pool("p", 1, 1), 0).empty());
}

TEST_CASE("one pool: its budget on each GPU, divided among its workers and spares there") {
  const auto g = gpus({80 * kGiB, 80 * kGiB});
  SUBCASE("the default: 0.9 of each GPU") {
    auto b = plan_memory_budgets({gpu_pool("p", 2)}, {{0, 1}}, g);
    REQUIRE(b);
    REQUIRE((*b)[0].size() == 2);
    for (const PoolGpuBudget& on : (*b)[0]) {
      CHECK(on.by_default);
      CHECK(on.workers == 2);
      CHECK(on.pool.fraction == doctest::Approx(0.9));
      CHECK(on.worker.fraction == doctest::Approx(0.45));
      CHECK(on.worker.bytes == 0);
    }
  }
  SUBCASE("a fraction, with a spare on the first GPU") {
    auto b = plan_memory_budgets({with_fraction(gpu_pool("p", 1, 1), 0.6)}, {{0, 1}}, g);
    REQUIRE(b);
    CHECK((*b)[0][0].workers == 2);
    CHECK((*b)[0][0].worker.fraction == doctest::Approx(0.3));
    CHECK((*b)[0][1].workers == 1);
    CHECK((*b)[0][1].worker.fraction == doctest::Approx(0.6));
    CHECK_FALSE((*b)[0][0].by_default);
  }
  SUBCASE("bytes") {
    auto b = plan_memory_budgets({with_bytes(gpu_pool("p", 3), 30 * kGiB)}, {{1}}, g);
    REQUIRE(b);
    REQUIRE((*b)[0].size() == 1);
    CHECK((*b)[0][0].gpu == 1);
    CHECK((*b)[0][0].worker.bytes == 10 * kGiB);
    CHECK((*b)[0][0].worker.fraction == 0);
  }
  SUBCASE("a cpu pool, or an unavailable gpu pool, has no budget") {
    PoolConfig cpu;
    cpu.name = "cpu";
    auto b = plan_memory_budgets({cpu, gpu_pool("g")}, {{}, {}}, g);
    REQUIRE(b);
    CHECK((*b)[0].empty());
    CHECK((*b)[1].empty());
  }
}

TEST_CASE("pools on one GPU: the ones without memory_limit share 0.9 after the others") {
  const auto g = gpus({80 * kGiB});
  auto b = plan_memory_budgets({gpu_pool("a"), gpu_pool("b", 2), with_fraction(gpu_pool("c"), 0.3),
                                with_bytes(gpu_pool("d"), 8 * kGiB)},
                               {{0}, {0}, {0}, {0}}, g);
  REQUIRE(b);
  // 0.9 - 0.3 - 0.1 (8 of 80 GiB) = 0.5, in two.
  CHECK((*b)[0][0].pool.fraction == doctest::Approx(0.25));
  CHECK((*b)[0][0].worker.fraction == doctest::Approx(0.25));
  CHECK((*b)[1][0].pool.fraction == doctest::Approx(0.25));
  CHECK((*b)[1][0].worker.fraction == doctest::Approx(0.125));
  CHECK((*b)[2][0].worker.fraction == doctest::Approx(0.3));
  CHECK((*b)[3][0].worker.bytes == 8 * kGiB);

  SUBCASE("a GPU whose memory is unknown: byte budgets take nothing off the default") {
    auto unknown = plan_memory_budgets({gpu_pool("a"), with_bytes(gpu_pool("d"), 8 * kGiB)},
                                       {{0}, {0}}, gpus({0}));
    REQUIRE(unknown);
    CHECK((*unknown)[0][0].pool.fraction == doctest::Approx(0.9));
  }
  SUBCASE("pools on different GPUs do not share") {
    auto apart =
        plan_memory_budgets({gpu_pool("a"), gpu_pool("b")}, {{0}, {1}}, gpus({kGiB, kGiB}));
    REQUIRE(apart);
    CHECK((*apart)[0][0].pool.fraction == doctest::Approx(0.9));
    CHECK((*apart)[1][0].pool.fraction == doctest::Approx(0.9));
  }
}

TEST_CASE("budgets that add up to more than the device are refused, naming GPU, pools and sum") {
  SUBCASE("fractions over 1.0") {
    auto b =
        plan_memory_budgets({with_fraction(gpu_pool("a"), 0.6), with_fraction(gpu_pool("b"), 0.5)},
                            {{0}, {0}}, gpus({0}));
    REQUIRE_FALSE(b);
    CHECK(b.error().message() ==
          "config: GPU 0 (GPU-0): the memory_limit of pools a (0.6 of the device), b (0.5 of the "
          "device) adds up to 1.1 of the device, more than all of it: lower them so that the "
          "pools on one GPU add up to at most 1.0 of it (docs/config.md, \"Device memory "
          "budgets\")");
  }
  SUBCASE("bytes over the device's memory, with fractions") {
    auto b = plan_memory_budgets(
        {with_bytes(gpu_pool("a"), 60 * kGiB), with_fraction(gpu_pool("b"), 0.5)}, {{0}, {0}},
        gpus({80 * kGiB}));
    REQUIRE_FALSE(b);
    CHECK(b.error().message().find("config: GPU 0 (GPU-0, 81920 MiB): the memory_limit of pools a "
                                   "(61440 MiB), b (0.5 of the device (40960 MiB)) adds up to "
                                   "1.25 of the device (102400 MiB), more than all of it") == 0);
  }
  SUBCASE("one pool's bytes over the device") {
    auto b = plan_memory_budgets({with_bytes(gpu_pool("a"), 100 * kGiB)}, {{0}}, gpus({80 * kGiB}));
    REQUIRE_FALSE(b);
    CHECK(b.error().message().find("the memory_limit of pool a (102400 MiB) adds up to 1.25") !=
          std::string::npos);
  }
  SUBCASE("exactly the whole device is allowed") {
    CHECK(
        plan_memory_budgets({with_fraction(gpu_pool("a"), 0.6), with_fraction(gpu_pool("b"), 0.4)},
                            {{0}, {0}}, gpus({0})));
  }
  SUBCASE("nothing of the default left for a pool that sets none") {
    auto b = plan_memory_budgets({with_fraction(gpu_pool("a"), 0.95), gpu_pool("b")}, {{0}, {0}},
                                 gpus({0}));
    REQUIRE_FALSE(b);
    CHECK(b.error().message() ==
          "config: GPU 0 (GPU-0): the memory_limit of pool a (0.95 of the device) adds up to "
          "0.95 of the device, which leaves nothing of 0.9 for pool b, which sets none: give it "
          "a memory_limit, or lower the others' (docs/config.md, \"Device memory budgets\")");
  }
}

TEST_CASE("MemoryShare::text") {
  CHECK(MemoryShare{256ull << 20, 0}.text() == "256 MiB");
  CHECK(MemoryShare{0, 0.45}.text() == "0.45 of the device");
  CHECK(MemoryShare{0, 0.5}.text(80 * kGiB) == "0.5 of the device (40960 MiB)");
}

}  // namespace
}  // namespace gpuq::daemon
