// Unit tests of GPU discovery without CUDA (daemon/supervisor/gpu_discovery.hpp): the parsers of
// the NVIDIA driver's /proc files and of sysfs, discovery over a fake /proc + /sys tree
// (tests/support/fake_gpu_tree.hpp), the choice of a gpu pool's GPUs, and the gpu pool keys of
// the config (daemon/supervisor/config.hpp), each refused with an error naming the key.
#include "gpu_discovery.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "config.hpp"
#include "support/fake_gpu_tree.hpp"

namespace gpuq::daemon {
namespace {

using test::FakeGpu;
using test::FakeGpuTree;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const char* const kUuidA = "GPU-0b7e1c3a-5d2f-4a61-9c8e-2f4b6d8a0c1e";
const char* const kUuidB = "GPU-9f3e2d1c-0b4a-4e5f-8a7b-6c5d4e3f2a1b";

// Two GPUs, the one on the higher bus written first, plus one the driver excludes.
void add_two_gpus(FakeGpuTree& tree) {
  tree.add_gpu({"0000:af:00.0", "NVIDIA H100 80GB HBM3", kUuidB, "1", "1", false});
  tree.add_gpu({"0000:3b:00.0", "NVIDIA H100 80GB HBM3", kUuidA, "0,2-3", "0", false});
  tree.add_gpu(
      {"0000:d8:00.0", "NVIDIA A100", "GPU-11111111-2222-3333-4444-555555555555", "", "-1", true});
}

TEST_CASE("parse_cpu_list reads the kernel's cpulist format") {
  CHECK(parse_cpu_list("0-3,8,10-11\n").value() == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpu_list("5").value() == std::vector<int>{5});
  CHECK(parse_cpu_list("\n").value().empty());  // a node without CPUs
  CHECK_FALSE(parse_cpu_list("1,a").ok());
  CHECK_FALSE(parse_cpu_list("3-1").ok());
  CHECK_FALSE(parse_cpu_list("-1").ok());
}

TEST_CASE("normalize_pci_bus_id gives the sysfs form of NVML's and the driver's bus ids") {
  CHECK(normalize_pci_bus_id("00000000:3B:00.0").value() == "0000:3b:00.0");
  CHECK(normalize_pci_bus_id("0000:af:00.0").value() == "0000:af:00.0");
  CHECK(normalize_pci_bus_id(" 0001:00:1f.7 ").value() == "0001:00:1f.7");
  CHECK(normalize_pci_bus_id("00010000:01:00.0").value() == "00010000:01:00.0");
  CHECK_FALSE(normalize_pci_bus_id("3b:00.0").ok());
  CHECK_FALSE(normalize_pci_bus_id("0000:3b:00.0x").ok());
  CHECK_FALSE(normalize_pci_bus_id("0000:3b:40.0").ok());  // device > 31
  CHECK_FALSE(normalize_pci_bus_id("").ok());
}

TEST_CASE("parse_proc_gpu_information reads model, UUID, bus and exclusion") {
  const std::string text =
      "Model: \t\t Tesla V100-SXM2-16GB\nIRQ:   \t\t 59\nGPU UUID: \t " + std::string(kUuidA) +
      "\nBus Location: \t 0000:3b:00.0\nDevice Minor: \t 0\nGPU Excluded:\t No\n";

  auto info = parse_proc_gpu_information(text);

  REQUIRE(info.ok());
  CHECK(info->model == "Tesla V100-SXM2-16GB");
  CHECK(info->uuid == kUuidA);
  CHECK(info->bus_location == "0000:3b:00.0");
  CHECK_FALSE(info->excluded);

  SUBCASE("a UUID hidden from this user reads as none") {
    auto hidden = parse_proc_gpu_information(
        R"(Model: X
GPU UUID: GPU-????????-????-????-????-????????????
Bus Location: 0000:01:00.0
)");
    REQUIRE(hidden.ok());
    CHECK(hidden->uuid.empty());
  }
  SUBCASE("an excluded GPU says so") {
    auto excluded =
        parse_proc_gpu_information("Model: X\nBus Location: 0000:01:00.0\nGPU Excluded: Yes\n");
    REQUIRE(excluded.ok());
    CHECK(excluded->excluded);
  }
  SUBCASE("Model and Bus Location are required") {
    CHECK_FALSE(parse_proc_gpu_information("Bus Location: 0000:01:00.0\n").ok());
    CHECK_FALSE(parse_proc_gpu_information("Model: X\n").ok());
    CHECK_FALSE(parse_proc_gpu_information("").ok());
  }
}

TEST_CASE("read_procfs_gpus lists the driver's GPUs in PCI bus order, with locality") {
  FakeGpuTree tree;
  add_two_gpus(tree);

  auto gpus = read_procfs_gpus(tree.root());

  REQUIRE_MESSAGE(gpus.ok(), gpus.error().to_string());
  REQUIRE(gpus->size() == 2);  // the excluded one is left out
  const GpuInfo& first = (*gpus)[0];
  const GpuInfo& second = (*gpus)[1];
  CHECK(first.index == 0);
  CHECK(first.pci_bus_id == "0000:3b:00.0");
  CHECK(first.uuid == kUuidA);
  CHECK(first.name == "NVIDIA H100 80GB HBM3");
  CHECK(first.memory_bytes == 0);  // the driver's files do not say
  CHECK(first.local_cpus == std::vector<int>{0, 2, 3});
  CHECK(first.numa_node == 0);
  CHECK(second.index == 1);
  CHECK(second.pci_bus_id == "0000:af:00.0");
  CHECK(second.uuid == kUuidB);
  CHECK(second.local_cpus == std::vector<int>{1});
  CHECK(second.numa_node == 1);
}

TEST_CASE("read_procfs_gpus: no driver, no GPU, a broken file") {
  FakeGpuTree tree;

  SUBCASE("no driver directory") {
    auto r = read_procfs_gpus(tree.root());
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kNoDevice);
    CHECK(contains(r.error().message(), "/proc/driver/nvidia not found"));
  }
  SUBCASE("a driver without GPUs") {
    tree.add_driver();
    auto r = read_procfs_gpus(tree.root());
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.error().message(), "lists no GPU"));
  }
  SUBCASE("only an excluded GPU") {
    tree.add_gpu({"0000:01:00.0", "X", kUuidA, "", "-1", true});
    auto r = read_procfs_gpus(tree.root());
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.error().message(), "1 excluded"));
  }
  SUBCASE("an information file without a bus") {
    tree.add_gpu({"0000:01:00.0", "X", kUuidA, "", "-1", false});
    FakeGpuTree::write(tree.root() + "/proc/driver/nvidia/gpus/0000:01:00.0/information",
                       "Model: X\n");
    auto r = read_procfs_gpus(tree.root());
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.error().message(), "Bus Location"));
  }
}

TEST_CASE(
    "discover_gpus falls back from NVML to the driver's files, and says why when neither "
    "has a GPU") {
  FakeGpuTree tree;
  GpuDiscoveryOptions options;
  options.root = tree.root();
  options.nvml_library = "libgpuq-test-no-such-nvml.so.1";  // absent on every machine

  SUBCASE("no driver at all") {
    GpuDiscovery d = discover_gpus(options);
    CHECK(d.gpus.empty());
    CHECK(d.source == "none");
    CHECK(contains(d.problem, "no NVIDIA driver: "));
    CHECK(contains(d.problem, "/proc/driver/nvidia not found"));
    CHECK(contains(d.problem, "libgpuq-test-no-such-nvml.so.1 cannot be loaded"));
  }
  SUBCASE("a driver whose files list GPUs") {
    add_two_gpus(tree);
    GpuDiscovery d = discover_gpus(options);
    CHECK(d.source == "procfs");
    CHECK(d.problem.empty());
    REQUIRE(d.gpus.size() == 2);
    CHECK(d.gpus[0].uuid == kUuidA);
  }
  SUBCASE("NVML switched off (a fake tree stands for the machine)") {
    options.use_nvml = false;
    GpuDiscovery d = discover_gpus(options);
    CHECK(d.source == "none");
    CHECK(contains(d.problem, "NVML was not tried"));
  }
}

TEST_CASE("discover_gpus_isolated answers what discover_gpus does, from a child process") {
  FakeGpuTree tree;
  add_two_gpus(tree);
  GpuDiscoveryOptions options;
  options.root = tree.root();
  options.use_nvml = false;

  GpuDiscovery direct = discover_gpus(options);
  GpuDiscovery isolated = discover_gpus_isolated(options, 10'000);

  CHECK(isolated.source == direct.source);
  CHECK(isolated.problem == direct.problem);
  REQUIRE(isolated.gpus.size() == direct.gpus.size());
  for (size_t i = 0; i < direct.gpus.size(); ++i) {
    CHECK(isolated.gpus[i].index == direct.gpus[i].index);
    CHECK(isolated.gpus[i].uuid == direct.gpus[i].uuid);
    CHECK(isolated.gpus[i].pci_bus_id == direct.gpus[i].pci_bus_id);
    CHECK(isolated.gpus[i].name == direct.gpus[i].name);
    CHECK(isolated.gpus[i].local_cpus == direct.gpus[i].local_cpus);
    CHECK(isolated.gpus[i].numa_node == direct.gpus[i].numa_node);
  }
}

TEST_CASE("gpu_discovery_options_from_environment honours GPUQ_TEST_GPU_ROOT only with the hooks") {
  ::setenv("GPUQ_TEST_GPU_ROOT", "/tmp/somewhere", 1);

  GpuDiscoveryOptions off = gpu_discovery_options_from_environment(false);
  GpuDiscoveryOptions on = gpu_discovery_options_from_environment(true);
  ::unsetenv("GPUQ_TEST_GPU_ROOT");

  CHECK(off.root == "/");
  CHECK(off.use_nvml);
  CHECK(on.root == "/tmp/somewhere");
  CHECK_FALSE(on.use_nvml);
}

// ---- Choosing a pool's GPUs ----------------------------------------------------------------

GpuDiscovery two_found() {
  GpuDiscovery d;
  d.source = "procfs";
  d.gpus.resize(2);
  d.gpus[0].index = 0;
  d.gpus[0].uuid = kUuidA;
  d.gpus[1].index = 1;
  d.gpus[1].uuid = kUuidB;
  return d;
}

PoolConfig gpu_pool(std::vector<GpuSelector> gpus) {
  PoolConfig p;
  p.name = "gpu";
  p.kind = PoolKind::kGpu;
  p.all_gpus = gpus.empty();
  p.gpus = std::move(gpus);
  return p;
}

GpuSelector by_index(uint32_t i) {
  return {false, i, {}};
}
GpuSelector by_uuid(std::string u) {
  return {true, 0, std::move(u)};
}

TEST_CASE("select_gpus: all, by index, by UUID (any case), in the list's order") {
  const GpuDiscovery found = two_found();
  std::string upper = kUuidB;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  upper.replace(0, 4, "GPU-");

  CHECK(select_gpus(gpu_pool({}), found).value() == std::vector<uint32_t>{0, 1});
  CHECK(select_gpus(gpu_pool({by_index(1)}), found).value() == std::vector<uint32_t>{1});
  CHECK(select_gpus(gpu_pool({by_uuid(upper), by_index(0)}), found).value() ==
        std::vector<uint32_t>{1, 0});
}

TEST_CASE("select_gpus: a GPU not found, or named twice, makes the pool unavailable") {
  const GpuDiscovery found = two_found();

  auto missing = select_gpus(gpu_pool({by_index(0), by_index(5)}), found);
  auto unknown =
      select_gpus(gpu_pool({by_uuid("GPU-00000000-0000-0000-0000-000000000000")}), found);
  auto twice = select_gpus(gpu_pool({by_index(1), by_uuid(kUuidB)}), found);
  GpuDiscovery nothing;
  nothing.source = "none";
  nothing.problem = "no NVIDIA driver: test";
  auto none = select_gpus(gpu_pool({}), nothing);

  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code() == ErrorCode::kNoDevice);
  CHECK(contains(missing.error().message(), "gpus[1]: no GPU with index 5 (2 found: 0 GPU-"));
  REQUIRE_FALSE(unknown.ok());
  CHECK(contains(unknown.error().message(), "gpus[0]: no GPU with UUID GPU-00000000"));
  REQUIRE_FALSE(twice.ok());
  CHECK(contains(twice.error().message(), "gpus[0] and gpus[1] name the same GPU"));
  REQUIRE_FALSE(none.ok());
  CHECK(none.error().message() == "no NVIDIA driver: test");
}

// ---- Config: gpu pool keys -----------------------------------------------------------------

const std::vector<int> kCpus = {0, 1};

TEST_CASE("config: a gpu pool's keys and their defaults") {
  auto c = parse_config(
      R"({"pools":[{"name":"cpu"},{"name":"gpu","kind":"gpu"},
                   {"name":"g2","kind":"gpu","gpus":[1,")" +
          std::string(kUuidA) + R"("],"workers_per_gpu":3,"fallback":"cpu"}]})",
      kCpus);

  REQUIRE_MESSAGE(c.ok(), c.error().to_string());
  REQUIRE(c->pools.size() == 3);
  const PoolConfig& gpu = c->pools[1];
  CHECK(gpu.kind == PoolKind::kGpu);
  CHECK(gpu.all_gpus);
  CHECK(gpu.workers_per_gpu == 1);
  CHECK(gpu.fallback == PoolFallback::kNone);
  CHECK(gpu.fallback_pool == -1);
  CHECK(gpu.workers == 0);  // known once the GPUs are found
  const PoolConfig& g2 = c->pools[2];
  CHECK_FALSE(g2.all_gpus);
  REQUIRE(g2.gpus.size() == 2);
  CHECK_FALSE(g2.gpus[0].by_uuid);
  CHECK(g2.gpus[0].index == 1);
  CHECK(g2.gpus[1].by_uuid);
  CHECK(g2.gpus[1].uuid == kUuidA);
  CHECK(g2.workers_per_gpu == 3);
  CHECK(g2.workers == 6);
  CHECK(g2.fallback == PoolFallback::kCpu);
  CHECK(g2.fallback_pool == 0);
  CHECK(ring_capacity(*c, gpu) == 1);     // no workers yet: a ring of one cell
  CHECK(gpu.memory_limit_bytes == 0);     // not set: a share of 0.9 of the device
  CHECK(gpu.memory_limit_fraction == 0);  // (memory_budget.hpp)
}

TEST_CASE("config: a gpu pool's memory_limit is bytes (an integer) or a fraction (a number)") {
  auto c = parse_config(R"({"pools":[{"name":"a","kind":"gpu","memory_limit":268435456},
                                      {"name":"b","kind":"gpu","memory_limit":0.25},
                                      {"name":"c","kind":"gpu","memory_limit":1.0}]})",
                        kCpus);

  REQUIRE_MESSAGE(c.ok(), c.error().to_string());
  CHECK(c->pools[0].memory_limit_bytes == 268435456);
  CHECK(c->pools[0].memory_limit_fraction == 0);
  CHECK(c->pools[1].memory_limit_bytes == 0);
  CHECK(c->pools[1].memory_limit_fraction == doctest::Approx(0.25));
  CHECK(c->pools[2].memory_limit_fraction == doctest::Approx(1.0));
}

TEST_CASE("config: bad gpu pool values are refused with an error naming the key") {
  struct Case {
    const char* pools;  // the "pools" value
    const char* names;
  };
  const Case cases[] = {
      {R"([{"name":"g","kind":"tpu"}])", "pools[0].kind: must be \"cpu\" or \"gpu\""},
      {R"([{"name":"g","kind":"gpu","gpus":"some"}])", "pools[0].gpus: must be \"all\""},
      {R"([{"name":"g","kind":"gpu","gpus":[]}])", "pools[0].gpus: must be \"all\""},
      {R"([{"name":"g","kind":"gpu","gpus":[0,-1]}])", "pools[0].gpus[1]"},
      {R"([{"name":"g","kind":"gpu","gpus":[0,1.5]}])", "pools[0].gpus[1]"},
      {R"([{"name":"g","kind":"gpu","gpus":[256]}])", "pools[0].gpus[0]"},
      {R"([{"name":"g","kind":"gpu","gpus":["GPU-xyz"]}])", "pools[0].gpus[0]: must be a GPU"},
      {R"([{"name":"g","kind":"gpu","gpus":[2,2]}])", "pools[0].gpus[1]: GPU 2 is listed twice"},
      {R"([{"name":"g","kind":"gpu","workers_per_gpu":0}])", "pools[0].workers_per_gpu"},
      {R"([{"name":"g","kind":"gpu","workers_per_gpu":65}])", "pools[0].workers_per_gpu"},
      {R"([{"name":"g","kind":"gpu","workers_per_gpu":"2"}])", "pools[0].workers_per_gpu"},
      {R"([{"name":"g","kind":"gpu","fallback":"gpu"}])", "pools[0].fallback: must be"},
      {R"([{"name":"g","kind":"gpu","fallback":"cpu"}])",
       "pools[0].fallback: \"cpu\" sends jobs to the first cpu pool, and this config has none"},
      {R"([{"name":"c"},{"name":"g","kind":"gpu","workers":2}])",
       "pools[1].workers: is not a gpu pool key"},
      {R"([{"name":"c"},{"name":"g","kind":"gpu","cpus":[0]}])",
       "pools[1].cpus: is not a gpu pool key"},
      {R"([{"name":"c","gpus":"all"}])", "pools[0].gpus: is a key of \"kind\": \"gpu\" pools"},
      {R"([{"name":"c","kind":"cpu","fallback":"cpu"}])", "pools[0].fallback: is a key of"},
      {R"([{"name":"c","workers_per_gpu":1}])", "pools[0].workers_per_gpu: is a key of"},
      {R"([{"name":"g","kind":"gpu","gpu":[0]}])", "pools[0].gpu: unknown key"},
      {R"([{"name":"g","kind":"gpu","memory_limit":0}])", "pools[0].memory_limit"},
      {R"([{"name":"g","kind":"gpu","memory_limit":1}])", "pools[0].memory_limit"},
      {R"([{"name":"g","kind":"gpu","memory_limit":0.0}])", "pools[0].memory_limit: must be"},
      {R"([{"name":"g","kind":"gpu","memory_limit":1.5}])", "pools[0].memory_limit: must be"},
      {R"([{"name":"g","kind":"gpu","memory_limit":-0.5}])", "pools[0].memory_limit: must be"},
      {R"([{"name":"g","kind":"gpu","memory_limit":"1G"}])", "pools[0].memory_limit: must be"},
      {R"([{"name":"c","memory_limit":0.5}])", "pools[0].memory_limit: is a key of"},
      {R"([{"name":"g","kind":"gpu","gpus":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],
           "workers_per_gpu":64}])",
       "pools: more than 1024 workers in all"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.pools);

    auto r = parse_config(std::string(R"({"queue_factor":1,"pools":)") + c.pools + "}", kCpus);

    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE(contains(r.error().message(), c.names), r.error().message());
  }
}

}  // namespace
}  // namespace gpuq::daemon
