// Plug-in ops in one process: load_plugin on the example and test plug-ins, add_plugin_ops
// (ids, name checks), the cpu backend running saxpy through the C ABI with the job's params,
// and the config key "plugins". Then Python ops (add_python_op: ids after the plug-ins', one per
// name across pools, each pool's list) and a pool's "python" section.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "config.hpp"
#include "op_backend.hpp"
#include "ops.hpp"
#include "plugins.hpp"

namespace gpuq::daemon {
namespace {

ParamBlock params_of(const std::vector<std::pair<std::string, ParamValue>>& kv) {
  ParamWriter w;
  for (const auto& [k, v] : kv) REQUIRE(w.add(k, v).ok());
  auto block = ParamBlock::parse(w.data(), w.size());
  REQUIRE(block.ok());
  return std::move(block).value();
}

// Loads the example and test plug-ins into this process's registry, once (doctest runs a test
// case again for each subcase). Returns whether that worked.
bool register_plugins_once() {
  static const bool done = [] {
    auto example = load_plugin(GPUQ_TEST_EXAMPLE_PLUGIN);
    auto test = load_plugin(GPUQ_TEST_PLUGIN);
    return example.ok() && test.ok() && example->size() == 1 && (*example)[0].name == "saxpy" &&
           (*example)[0].has_cpu && add_plugin_ops(std::move(*example)).ok() &&
           add_plugin_ops(std::move(*test)).ok();
  }();
  return done;
}

TEST_CASE("plug-in ops: loaded, registered from id 2000, and run by the cpu backend") {
  REQUIRE(register_plugins_once());
  const OpInfo* saxpy = find_op(kFirstPluginOpId);
  REQUIRE(saxpy != nullptr);
  CHECK(std::string(saxpy->name) == "saxpy");
  REQUIRE(saxpy->plugin != nullptr);
  CHECK(saxpy->plugin->has_gpu == (saxpy->plugin->gpu_fn != nullptr));
  const OpInfo* gpu_only = find_op(kFirstPluginOpId + 1);
  REQUIRE(gpu_only != nullptr);
  CHECK(std::string(gpu_only->name) == "plugin_gpu_only");
  CHECK(find_op(1) != nullptr);  // the built-ins are still there

  // A clash with a built-in or an earlier plug-in op is refused, naming both sides.
  PluginOp clash;
  clash.name = "saxpy";
  clash.library = "/x/libother.so";
  auto r = add_plugin_ops({clash});
  REQUIRE(!r.ok());
  CHECK(r.error().message().find("plug-in /x/libother.so: op name 'saxpy' is already taken by "
                                 "plug-in " GPUQ_TEST_EXAMPLE_PLUGIN) != std::string::npos);
  clash.name = "Bad-Name";
  CHECK(!add_plugin_ops({clash}).ok());

  float in[6] = {1, 2, 3, 10, 20, 30};  // x then y
  float out[3] = {0, 0, 0};
  std::atomic<uint32_t> cancel{0};
  SUBCASE("saxpy with a float a") {
    const ParamBlock params = params_of({{"a", ParamValue(0.5)}});
    OpContext ctx{reinterpret_cast<const std::byte*>(in),
                  sizeof in,
                  reinterpret_cast<std::byte*>(out),
                  sizeof out,
                  params,
                  cancel};
    auto result = cpu_backend().run(*saxpy, ctx);
    REQUIRE_MESSAGE(result.ok(), result.error().message());
    CHECK(result->output_bytes == sizeof out);
    CHECK(result->value == 3);
    CHECK(out[0] == 10.5f);
    CHECK(out[2] == 31.5f);
  }
  SUBCASE("a string a is the wrong type: the op's message, InvalidArgument") {
    const ParamBlock params = params_of({{"a", ParamValue(std::string("two"))}});
    OpContext ctx{reinterpret_cast<const std::byte*>(in),
                  sizeof in,
                  reinterpret_cast<std::byte*>(out),
                  sizeof out,
                  params,
                  cancel};
    auto result = cpu_backend().run(*saxpy, ctx);
    REQUIRE(!result.ok());
    CHECK(result.error().code() == ErrorCode::kInvalidArgument);
    CHECK(result.error().message() == "saxpy: param a must be a number");
  }
  SUBCASE("an op with no cpu function: UnknownOp") {
    const ParamBlock params = params_of({});
    OpContext ctx{nullptr, 0, nullptr, 0, params, cancel};
    auto result = cpu_backend().run(*gpu_only, ctx);
    REQUIRE(!result.ok());
    CHECK(result.error().code() == ErrorCode::kUnknownOp);
  }
}

TEST_CASE("load_plugin: a failing register and a missing library name the plug-in") {
  auto bad = load_plugin(GPUQ_TEST_PLUGIN_BAD_REGISTER);
  REQUIRE(!bad.ok());
  CHECK(bad.error().message() == std::string("plug-in ") + GPUQ_TEST_PLUGIN_BAD_REGISTER +
                                     ": gpuq_plugin_register returned 16");
  auto missing = load_plugin("/nonexistent/libx.so");
  REQUIRE(!missing.ok());
  CHECK(missing.error().message().find("plug-in /nonexistent/libx.so: dlopen") == 0);
}

TEST_CASE("config: plugins must be absolute, readable and listed once") {
  const std::vector<int> cpus = {0};
  auto ok = parse_config(R"({"plugins":[")" GPUQ_TEST_EXAMPLE_PLUGIN R"("]})", cpus);
  REQUIRE(ok.ok());
  CHECK(ok->plugins == std::vector<std::string>{GPUQ_TEST_EXAMPLE_PLUGIN});
  auto rel = parse_config(R"({"plugins":["lib.so"]})", cpus);
  REQUIRE(!rel.ok());
  CHECK(rel.error().message().find("plugins[0]") != std::string::npos);
  auto twice = parse_config(
      R"({"plugins":[")" GPUQ_TEST_EXAMPLE_PLUGIN R"(",")" GPUQ_TEST_EXAMPLE_PLUGIN R"("]})", cpus);
  REQUIRE(!twice.ok());
  CHECK(twice.error().message().find("plugins[1]") != std::string::npos);
  CHECK(!parse_config(R"({"plugins":"x"})", cpus).ok());
}

// After the plug-in cases: the registry only grows.
TEST_CASE("python ops: ids after every other op, one per name, listed per pool") {
  REQUIRE(register_plugins_once());
  uint32_t last = 0;
  for (const auto& op : op_registry()) last = std::max(last, op.id);
  auto call0 = add_python_op(kPythonCallOp, "callables", 0);
  REQUIRE(call0.ok());
  CHECK(*call0 == last + 1);
  auto classify = add_python_op("classify", "a model", 0);
  REQUIRE(classify.ok());
  CHECK(*classify == last + 2);
  // Pool 3 has the same two ops: the same ids, and the pool joins each op's list.
  CHECK(add_python_op(kPythonCallOp, "", 3).value() == *call0);
  CHECK(add_python_op("classify", "", 3).value() == *classify);
  CHECK(add_python_op("only3", "", 3).value() == last + 3);
  const std::string c = std::to_string(*call0), k = std::to_string(*classify);
  CHECK(python_op_list(0) == "[[" + c + ",\"python_call\"],[" + k + ",\"classify\"]]");
  CHECK(python_op_list(3) == "[[" + c + ",\"python_call\"],[" + k + ",\"classify\"],[" +
                                 std::to_string(last + 3) + ",\"only3\"]]");
  CHECK(python_op_list(1) == "[]");
  // A Python op is no plug-in op: C++ workers still agree with the supervisor's plug-in list.
  CHECK(plugin_op_list().find("classify") == std::string::npos);
  const OpInfo* info = find_op(*classify);
  REQUIRE(info != nullptr);
  CHECK(info->python != nullptr);
  CHECK((info->run == nullptr));
  CHECK(info->plugin == nullptr);

  // Names taken by a built-in or plug-in op, malformed names, and an id out of order.
  auto builtin = add_python_op("echo", "", 0);
  REQUIRE(!builtin.ok());
  CHECK(builtin.error().message() ==
        "python pool 0: op 'echo': the name is taken by a built-in op");
  auto plugin = add_python_op("saxpy", "", 0);
  REQUIRE(!plugin.ok());
  CHECK(plugin.error().message().find("taken by plug-in") != std::string::npos);
  CHECK(!add_python_op("Bad-Name", "", 0).ok());
  CHECK(!add_python_op("low_id", "", 0, kFirstPluginOpId).ok());
  // A worker's own registration, with the supervisor's id: as given.
  CHECK(add_python_op("given", "", 5, last + 10).value() == last + 10);
  // A pool whose listing failed part way has no op left.
  forget_python_pool(3);
  CHECK(python_op_list(3) == "[]");
  CHECK(python_op_list(0) == "[[" + c + ",\"python_call\"],[" + k + ",\"classify\"]]");
}

TEST_CASE("set_python_pool_ops: a pool's ops re-listed keep their ids, all or nothing") {
  std::vector<ListedPythonOp> first = {{"rl_keep", "", {}}, {"rl_drop", "", {4, 10}}};
  auto changed = set_python_pool_ops(40, first);
  REQUIRE_MESSAGE(changed.ok(), changed.error().message());
  CHECK(*changed);  // from none
  const uint32_t keep = first[0].id, drop = first[1].id;
  CHECK(keep != drop);
  // The same names again (batching changed): the same ids, "not changed".
  std::vector<ListedPythonOp> same = {{"rl_drop", "", {8, 0}}, {"rl_keep", "", {}}};
  REQUIRE(set_python_pool_ops(40, same).ok());
  CHECK(!set_python_pool_ops(40, same).value());
  CHECK(same[0].id == drop);
  CHECK(find_op(drop)->python->batching_on(40).max_batch_size == 8);
  // One op dropped, one added: the new one gets an id above every id so far.
  std::vector<ListedPythonOp> next = {{"rl_keep", "", {}}, {"rl_new", "", {}}};
  REQUIRE(set_python_pool_ops(40, next).value());
  CHECK(next[0].id == keep);
  CHECK(next[1].id > drop);
  for (const OpInfo& op : op_registry()) CHECK(op.id <= next[1].id);
  CHECK(python_op_list(40) == "[[" + std::to_string(keep) + ",\"rl_keep\"],[" +
                                  std::to_string(next[1].id) + ",\"rl_new\"]]");
  REQUIRE(find_op(drop) != nullptr);  // its id stays reserved, no pool has it
  CHECK(find_op(drop)->python->pools.empty());
  // Dropped, then listed again: its old id.
  std::vector<ListedPythonOp> back = {{"rl_drop", "", {}}};
  REQUIRE(set_python_pool_ops(41, back).value());
  CHECK(back[0].id == drop);
  // A bad list changes nothing, and says which op.
  const std::string before = python_op_list(40);
  for (std::vector<ListedPythonOp> bad :
       std::vector<std::vector<ListedPythonOp>>{{{"rl_fine", "", {}}, {"echo", "", {}}},
                                                {{"rl_fine", "", {}}, {"rl_fine", "", {}}},
                                                {{"Bad-Name", "", {}}},
                                                {{"rl_fine", "", {0, 0}}}}) {
    auto r = set_python_pool_ops(40, bad);
    REQUIRE(!r.ok());
    CHECK(r.error().message().find("python pool 40: op '") == 0);
    CHECK(python_op_list(40) == before);
  }
}

TEST_CASE("config: a pool's python section") {
  const std::vector<int> cpus = {0, 1};
  auto c = parse_config(R"({"pools":[{"name":"py","workers":1,"python":{
      "venv":"/opt/venv","modules":["pkg.models","ops"],"path":["/srv/app"],
      "env":{"OMP_NUM_THREADS":"1"},"allow_callables":true}},
      {"name":"g","kind":"gpu","gpus":[0],"fallback":"cpu","python":{"modules":["m"]}}]})",
                        cpus);
  REQUIRE(c.ok());
  REQUIRE(c->pools[0].python.has_value());
  const PythonPoolConfig& py = *c->pools[0].python;
  CHECK(py.interpreter == "/opt/venv/bin/python");
  CHECK(py.modules == std::vector<std::string>{"pkg.models", "ops"});
  CHECK(py.path == std::vector<std::string>{"/srv/app"});
  REQUIRE(py.env.size() == 1);
  CHECK(py.env[0].first == "OMP_NUM_THREADS");
  CHECK(py.allow_callables);
  CHECK(c->pools[1].python->interpreter == "python3");  // the default, looked up in PATH
  CHECK(!c->pools[1].python->allow_callables);          // the default
  CHECK(c->pools[1].fallback_pool == 0);  // a Python gpu pool falls back to a Python cpu pool
  // Spin: a Python pool's default is at least kPythonPoolSpinUs; a pool's own key wins.
  CHECK(spin_us_of(*c, c->pools[0]) == kPythonPoolSpinUs);
  auto spin = parse_config(
      R"({"worker_spin_us":20,"pools":[{"name":"a"},{"name":"b","worker_spin_us":7},
          {"name":"c","python":{"modules":["m"]},"worker_spin_us":0}]})",
      cpus);
  REQUIRE(spin.ok());
  CHECK(spin_us_of(*spin, spin->pools[0]) == 20);
  CHECK(spin_us_of(*spin, spin->pools[1]) == 7);
  CHECK(spin_us_of(*spin, spin->pools[2]) == 0);
  CHECK(!parse_config(R"({"pools":[{"name":"a","worker_spin_us":100001}]})", cpus).ok());

  struct Bad {
    const char* python;
    const char* message;
  };
  for (const Bad& b : {
           Bad{R"({"modules":[]})", "pools[0].python.modules: must name at least one module"},
           Bad{R"({"modules":["a b"]})", "pools[0].python.modules[0]: 'a b' is not a module"},
           Bad{R"({"modules":["m"],"path":["rel"]})", "pools[0].python.path[0]: 'rel' is not an"},
           Bad{R"({"modules":["m"],"env":{"CUDA_VISIBLE_DEVICES":"0"}})",
               "pools[0].python.env.CUDA_VISIBLE_DEVICES: is set by gpuqd"},
           Bad{R"({"modules":["m"],"env":{"1X":"0"}})", "pools[0].python.env.1X: is not a"},
           Bad{R"({"modules":["m"],"env":{"X":1}})", "pools[0].python.env.X: must be a string"},
           Bad{R"({"modules":["m"],"allow_callables":1})",
               "pools[0].python.allow_callables: must be true or false"},
           Bad{R"({"modules":["m"],"venv":"rel"})", "pools[0].python.venv: must be an absolute"},
           Bad{R"({"modules":["m"],"interpreter":"bin/python"})",
               "pools[0].python.interpreter: must be an absolute path or a name"},
           Bad{R"({"modules":["m"],"venv":"/v","interpreter":"/p"})", "not both"},
           Bad{R"({"modules":["m"],"colour":1})", "pools[0].python.colour: unknown key"},
           Bad{R"({})", "pools[0].python.modules: is required"},
           Bad{R"([])", "pools[0].python: must be an object"},
       }) {
    CAPTURE(b.python);
    auto r = parse_config(
        std::string(R"({"pools":[{"name":"p","workers":1,"python":)") + b.python + "}]}", cpus);
    REQUIRE(!r.ok());
    CHECK(r.error().message().find(b.message) != std::string::npos);
  }
  // Callables alone need no module.
  CHECK(parse_config(R"({"pools":[{"name":"p","python":{"allow_callables":true}}]})", cpus).ok());
  // A gpu pool's fallback to "cpu" needs a cpu pool of its own sort.
  auto nofb = parse_config(
      R"({"pools":[{"name":"c"},{"name":"g","kind":"gpu","fallback":"cpu","python":{"modules":["m"]}}]})",
      cpus);
  REQUIRE(!nofb.ok());
  CHECK(nofb.error().message().find("first Python cpu pool") != std::string::npos);
}

}  // namespace
}  // namespace gpuq::daemon
