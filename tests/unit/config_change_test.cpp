// diff_configs (daemon/supervisor/config_change.hpp): what a config reload changes, from two
// parsed config files: daemon keys live or fixed (named with why), pool keys rolled, live or
// fixed, pools removed, pools added (in free records, within added_pool_workers), a gpu pool's
// GPUs and memory_limit (for the reload to plan again) and its size (fixed), and a reload that
// would remove every pool.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "config.hpp"
#include "config_change.hpp"

namespace gpuq::daemon {
namespace {

Config parse(const std::string& text) {
  auto c = parse_config(text, {0, 1});
  REQUIRE_MESSAGE(c.ok(), c.error().message());
  return *c;
}

bool mentions(const std::vector<std::string>& lines, const std::string& what) {
  for (const std::string& l : lines) {
    if (l.find(what) != std::string::npos) return true;
  }
  return false;
}

const char* const kBase = R"({"log_level":"info","pools":[
  {"name":"cpu","workers":2},
  {"name":"py","workers":1,"python":{"modules":["a"],"path":["/srv/v1"]}},
  {"name":"old","workers":1}]})";

TEST_CASE("diff_configs: the same file changes nothing") {
  const ConfigChange c = diff_configs(parse(kBase), parse(kBase));
  CHECK(c.empty());
  CHECK(c.describe(parse(kBase), parse(kBase)).empty());
}

TEST_CASE("diff_configs: live daemon keys, a rolled Python pool, a live pool key, a removal") {
  const Config running = parse(kBase);
  const Config next = parse(R"({"log_level":"debug","cancel_grace_ms":5,
    "pools":[{"name":"cpu","workers":2,"job_time_limit_ms":900},
             {"name":"py","workers":1,"python":{"modules":["a","b"],"path":["/srv/v2"]}}]})");
  const ConfigChange c = diff_configs(running, next);
  CHECK(c.fixed.empty());
  CHECK(c.daemon_keys == std::vector<std::string>{"log_level", "cancel_grace_ms"});
  REQUIRE(c.pools.size() == 2);
  CHECK(c.pools[0].name == "cpu");
  CHECK(c.pools[0].keys == std::vector<std::string>{"job_time_limit_ms"});
  CHECK(!c.pools[0].rollout);
  CHECK(c.pools[1].name == "py");
  CHECK(c.pools[1].pool == 1);
  CHECK(c.pools[1].keys == std::vector<std::string>{"python.modules", "python.path"});
  CHECK(c.pools[1].rollout);
  CHECK(c.removed == std::vector<uint32_t>{2});
  const std::vector<std::string> lines = c.describe(running, next);
  CHECK(mentions(lines, "log_level: changed, in effect now"));
  CHECK(mentions(lines, "pool py: python.modules, python.path changed: rolling restart"));
  CHECK(mentions(lines, "pool cpu: job_time_limit_ms changed, in effect now"));
  CHECK(mentions(lines, "pool old: removed"));
}

TEST_CASE("diff_configs: client_weights is a live daemon key") {
  const ConfigChange c =
      diff_configs(parse(R"({"pools":[{"name":"a"}]})"),
                   parse(R"({"client_weights":[{"user":0,"weight":3}],"pools":[{"name":"a"}]})"));
  CHECK(c.fixed.empty());
  CHECK(c.daemon_keys == std::vector<std::string>{"client_weights"});
}

TEST_CASE("diff_configs: a pool's effective worker_spin_us, from the top-level key too") {
  const ConfigChange c = diff_configs(
      parse(R"({"worker_spin_us":50,"pools":[{"name":"a"},{"name":"b","worker_spin_us":9}]})"),
      parse(R"({"worker_spin_us":70,"pools":[{"name":"a"},{"name":"b","worker_spin_us":9}]})"));
  CHECK(c.fixed.empty());
  REQUIRE(c.pools.size() == 1);  // b's own key did not move
  CHECK(c.pools[0].name == "a");
  CHECK(c.pools[0].keys == std::vector<std::string>{"worker_spin_us"});
  CHECK(c.pools[0].rollout);
}

TEST_CASE("diff_configs: what cannot change live is named, with why") {
  const ConfigChange c = diff_configs(parse(kBase), parse(R"({"queue_factor":4,"max_clients":300,
    "pools":[{"name":"cpu","workers":3,"cpus":[1]},
             {"name":"py","kind":"gpu","python":{"modules":["a"],"path":["/srv/v1"]}},
             {"name":"old","workers":1},{"name":"new","workers":1}]})"));
  CHECK(mentions(c.fixed, "queue_factor (it sizes the queue segment every client maps)"));
  CHECK(mentions(c.fixed, "max_clients"));
  CHECK(mentions(c.fixed, "pools[cpu].workers (more than its max_workers"));
  CHECK(!mentions(c.fixed, "pools[cpu].cpus"));  // new CPUs: a rollout places them
  REQUIRE(!c.pools.empty());
  CHECK(c.pools[0].keys == std::vector<std::string>{"cpus"});
  CHECK(c.pools[0].rollout);
  CHECK(mentions(c.fixed, "pools[py].kind"));
  CHECK(!mentions(c.fixed, "pools[new]"));  // a cpu pool can be added
  CHECK(c.added == std::vector<uint32_t>{3});
  CHECK(!mentions(c.fixed, "pools[old]"));
}

TEST_CASE("diff_configs: a cpu pool resized within its max_workers") {
  const Config running =
      parse(R"({"pools":[{"name":"a","workers":2,"max_workers":4},{"name":"b","workers":2}]})");
  CHECK(running.pools[0].max_workers == 4);
  CHECK(running.pools[1].max_workers == 2);  // not said: its workers
  CHECK(running.pools[0].entries() == 5);    // 4 + the default surge seat
  const Config next =
      parse(R"({"pools":[{"name":"a","workers":4,"max_workers":4},{"name":"b","workers":1}]})");
  const ConfigChange c = diff_configs(running, next);
  CHECK(c.fixed.empty());
  REQUIRE(c.pools.size() == 2);
  CHECK(c.pools[0].workers == 4);
  CHECK(c.pools[1].workers == 1);  // shrinking needs no reserve
  CHECK(!c.pools[0].rollout);
  CHECK(mentions(c.describe(running, next), "pool a: workers changed, in effect now (4 workers)"));
  const ConfigChange past = diff_configs(
      running,
      parse(R"({"pools":[{"name":"a","workers":5,"max_workers":5},{"name":"b","workers":2}]})"));
  CHECK(mentions(past.fixed, "pools[a].max_workers"));
  CHECK(mentions(past.fixed, "pools[a].workers (more than its max_workers"));
}

TEST_CASE("diff_configs: pools added in free records, within added_pool_workers") {
  // 3 pools, max_pools "auto": 7 records, 4 free; added_pool_workers "auto": 2 CPUs + 2.
  const Config running = parse(kBase);
  CHECK(running.max_pools == 7);
  CHECK(running.added_pool_workers == 4);
  const Config next = parse(R"({"log_level":"info","pools":[
    {"name":"cpu","workers":2},
    {"name":"py","workers":1,"python":{"modules":["a"],"path":["/srv/v1"]}},
    {"name":"old","workers":1},
    {"name":"a1","workers":2},{"name":"a2","workers":3,"rollout_surge_workers":1},
    {"name":"big","workers":4,"spare_workers":1},
    {"name":"g","kind":"gpu","gpus":[0]}]})");
  const ConfigChange c = diff_configs(running, next);
  CHECK(c.added == std::vector<uint32_t>{3, 4, 6});  // g: its GPUs are checked by the reload
  CHECK(mentions(c.fixed, "pools[big] (a new pool: 6 worker entries"));
  CHECK(mentions(c.fixed, "more than added_pool_workers, 4"));
  CHECK(!mentions(c.fixed, "pools[g]"));
  CHECK(mentions(c.describe(running, next), "pool a1: added, 2 workers"));
  // Records run out: max_pools 4 leaves one free record; a removed pool keeps its own.
  Config tight = parse(R"({"max_pools":4,"pools":[{"name":"a"},{"name":"b"},{"name":"c"}]})");
  const ConfigChange one = diff_configs(tight, parse(R"({"max_pools":4,"pools":[{"name":"a"},
    {"name":"b"},{"name":"d","workers":1}]})"));
  CHECK(one.fixed.empty());
  CHECK(one.added == std::vector<uint32_t>{2});
  CHECK(one.removed == std::vector<uint32_t>{2});
  tight.pools[2].removed = true;  // as the reload leaves it
  tight.pools.push_back(parse(R"({"pools":[{"name":"d","workers":1}]})").pools[0]);
  const ConfigChange two = diff_configs(tight, parse(R"({"max_pools":4,"pools":[{"name":"a"},
    {"name":"b"},{"name":"d","workers":1},{"name":"e","workers":1}]})"));
  CHECK(two.added.empty());
  CHECK(mentions(two.fixed, "pools[e] (a new pool: no free pool record left: max_pools is 4"));
  // max_pools and added_pool_workers are fixed; "auto" stays "auto" whatever the pools.
  CHECK(mentions(diff_configs(tight, parse(R"({"max_pools":5,"pools":[{"name":"a"},
    {"name":"b"},{"name":"c"}]})"))
                     .fixed,
                 "max_pools"));
  CHECK(diff_configs(running, parse(R"({"pools":[{"name":"cpu","workers":2},
    {"name":"py","workers":1,"python":{"modules":["a"],"path":["/srv/v1"]}},{"name":"old","workers":1},
    {"name":"x","workers":1}]})"))
            .fixed.empty());
}

TEST_CASE("diff_configs: a gpu pool's GPUs, memory_limit and size, for the reload to plan") {
  const Config running = parse(R"({"pools":[{"name":"g","kind":"gpu","gpus":[0]},
    {"name":"h","kind":"gpu","gpus":[1],"memory_limit":0.2,"max_workers":2}]})");
  CHECK(running.pools[0].max_workers == 1);  // not said: its workers
  CHECK(running.pools[1].max_workers == 2);
  CHECK(running.pools[1].entries() == 2);  // a growth entry, no surge seat in a gpu pool
  const ConfigChange c = diff_configs(running, parse(R"({"pools":[
    {"name":"g","kind":"gpu","gpus":[1]},
    {"name":"h","kind":"gpu","gpus":[1],"memory_limit":0.3,"max_workers":2}]})"));
  CHECK(c.fixed.empty());
  REQUIRE(c.pools.size() == 2);
  CHECK(c.pools[0].keys == std::vector<std::string>{"gpus"});
  CHECK(c.pools[1].keys == std::vector<std::string>{"memory_limit"});
  // Whether they roll, and how many workers they have, is the reload's to say, with every gpu
  // pool's budgets planned again and the GPUs counted (max_workers checked then).
  CHECK(!c.pools[0].rollout);
  CHECK(!c.pools[1].rollout);
  const ConfigChange size = diff_configs(running, parse(R"({"pools":[
    {"name":"g","kind":"gpu","gpus":[0,1]},
    {"name":"h","kind":"gpu","gpus":[1],"memory_limit":0.2,"workers_per_gpu":2,"max_workers":2}]})"));
  CHECK(size.fixed.empty());
  REQUIRE(size.pools.size() == 2);
  CHECK(size.pools[0].keys == std::vector<std::string>{"gpus"});
  CHECK(size.pools[1].keys == std::vector<std::string>{"workers_per_gpu"});
  CHECK(size.pools[1].workers == 0);
  // Its max_workers sizes its ring: fixed.
  CHECK(mentions(diff_configs(running, parse(R"({"pools":[{"name":"g","kind":"gpu","gpus":[0]},
    {"name":"h","kind":"gpu","gpus":[1],"memory_limit":0.2,"max_workers":3}]})"))
                     .fixed,
                 "pools[h].max_workers"));
  // Fewer max_workers than workers_per_gpu x the GPUs listed: the file is refused.
  auto few =
      parse_config(R"({"pools":[{"name":"g","kind":"gpu","gpus":[0,1],"max_workers":1}]})", {0, 1});
  REQUIRE(!few);
  CHECK(few.error().message().find("pools[0].max_workers: 1 is fewer than its workers_per_gpu x "
                                   "its GPUs, 2") != std::string::npos);
}

TEST_CASE("diff_configs: every pool replaced; a removed pool is not compared again") {
  Config running = parse(kBase);
  const ConfigChange all = diff_configs(running, parse(R"({"pools":[{"name":"other"}]})"));
  CHECK(all.fixed.empty());
  CHECK(all.removed.size() == 3);
  CHECK(all.added == std::vector<uint32_t>{0});
  running.pools[2].removed = true;
  const ConfigChange again = diff_configs(running, parse(R"({"log_level":"info","pools":[
    {"name":"cpu","workers":2},
    {"name":"py","workers":1,"python":{"modules":["a"],"path":["/srv/v1"]}}]})"));
  CHECK(again.empty());
  // Its name given to a new pool: that is an added pool, in a record of its own.
  const ConfigChange reuse = diff_configs(running, parse(kBase));
  CHECK(reuse.fixed.empty());
  CHECK(reuse.added == std::vector<uint32_t>{2});
}

}  // namespace
}  // namespace gpuq::daemon
