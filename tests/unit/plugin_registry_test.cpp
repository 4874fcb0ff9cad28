// Plug-in ops in one process: load_plugin on the example and test plug-ins, add_plugin_ops
// (ids, name checks), the cpu backend running saxpy through the C ABI with the job's params,
// and the config key "plugins".
#include <doctest/doctest.h>

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

}  // namespace
}  // namespace gpuq::daemon
