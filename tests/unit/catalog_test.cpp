// Catalog (daemon/supervisor/catalog.hpp): the pools and ops clients are told of, a snapshot
// taken when published, and its generation in the queue header: raised by each publish, the
// registry's later changes unseen until the next one, a Python op no pool has left out.
#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "catalog.hpp"
#include "ops.hpp"

namespace gpuq::daemon {
namespace {

// A queue segment's header and pool records in plain memory (no rings: the catalog reads the
// records only).
struct Segment {
  alignas(64) char memory[sizeof(QueueHeader) + 2 * sizeof(PoolShm)] = {};
  QueueView view;
  Segment() {
    auto* h = new (memory) QueueHeader{};
    h->pool_count = 2;
    h->pools_offset = sizeof(QueueHeader);
    for (uint32_t p = 0; p < 2; ++p) {
      auto* ps = new (memory + sizeof(QueueHeader) + p * sizeof(PoolShm)) PoolShm{};
      ps->capacity = 20 * (p + 1);
      ps->client_share = 10 * (p + 1);
    }
    view = QueueView(memory);
  }
};

bool has(const std::vector<WelcomeOp>& ops, const std::string& name) {
  return std::any_of(ops.begin(), ops.end(), [&](const WelcomeOp& o) { return o.name == name; });
}

TEST_CASE("Catalog: a snapshot per publish, its generation in the queue header") {
  Segment seg;
  Config config;
  config.pools.resize(2);
  config.pools[0].name = "cpu";
  config.pools[1].name = "gpu";
  config.pools[1].kind = PoolKind::kGpu;
  config.pools[1].fallback_pool = 0;
  PoolPlan plan;
  plan.pools.resize(2);
  plan.pools[1].available = false;
  plan.pools[1].reason = "no GPU found";
  std::vector<ListedPythonOp> listed = {{"cat_first", "", {}}, {"cat_second", "", {}}};
  REQUIRE(set_python_pool_ops(50, listed).ok());

  Catalog catalog(config, plan, seg.view);
  catalog.publish();
  CHECK(catalog.generation() == 1);
  CHECK(seg.view.header().catalog_generation.load() == 1);
  REQUIRE(catalog.pools().size() == 2);
  CHECK(catalog.pools()[0] == WelcomePool{"cpu", 0, "cpu", 20, 10, true, "", -1});
  CHECK(catalog.pools()[1] == WelcomePool{"gpu", 1, "gpu", 40, 20, false, "no GPU found", 0});
  CHECK(has(catalog.ops(), "noop"));
  CHECK(catalog.has_op("cat_first"));
  CHECK(catalog.has_op("cat_second"));

  // The registry changes: clients see nothing of it until the next publish.
  std::vector<ListedPythonOp> next = {{"cat_first", "", {}}, {"cat_third", "", {}}};
  REQUIRE(set_python_pool_ops(50, next).ok());
  CHECK(!catalog.has_op("cat_third"));
  CHECK(seg.view.header().catalog_generation.load() == 1);
  catalog.publish();
  CHECK(catalog.generation() == 2);
  CHECK(seg.view.header().catalog_generation.load() == 2);
  CHECK(catalog.has_op("cat_third"));
  CHECK(!catalog.has_op("cat_second"));  // no pool has it: left out, its id kept
  REQUIRE(find_op(listed[1].id) != nullptr);
  CHECK(find_op(listed[1].id)->name == std::string("cat_second"));
}

}  // namespace
}  // namespace gpuq::daemon
