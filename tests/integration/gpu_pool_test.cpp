// Integration: gpu pools on a machine without a GPU, and with a fake one. A gpu pool that finds
// no GPU is "unavailable" with its reason in the status; the daemon starts, is ready for its other
// pools, and its cpu pool keeps serving; jobs for the pool fail at once with NoDevice, or run on
// the first cpu pool with "fallback": "cpu". A GPU found in a fake /proc + /sys tree
// (GPUQ_TEST_GPU_ROOT, a test hook) gets workers with CUDA_VISIBLE_DEVICES=<its UUID>,
// CUDA_DEVICE_ORDER=PCI_BUS_ID and the affinity of its local CPUs. Bad gpu pool keys stop gpuqd
// with an error naming the key.
#include <sched.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <set>

#include "integration/integration_support.hpp"
#include "support/fake_gpu_tree.hpp"

namespace gpuq::test {
namespace {

const char* const kUuidA = "GPU-0b7e1c3a-5d2f-4a61-9c8e-2f4b6d8a0c1e";
const char* const kUuidB = "GPU-9f3e2d1c-0b4a-4e5f-8a7b-6c5d4e3f2a1b";

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A cpu pool "cpu" of one worker, a gpu pool "gpu" without fallback and a gpu pool "gpu_fb"
// whose jobs go to the cpu pool while it has no GPU.
std::string cpu_and_gpu_config() {
  return R"({"pools":[{"name":"cpu","kind":"cpu","workers":1},
                      {"name":"gpu","kind":"gpu"},
                      {"name":"gpu_fb","kind":"gpu","fallback":"cpu"}]})";
}

// Daemon options that start gpuqd with `config` and wait only for its socket: the fixture's
// default readiness wants workers in every pool, and an unavailable pool has none.
DaemonOptions answering(std::string config, std::vector<std::string> env = {}) {
  DaemonOptions o;
  o.config_json = std::move(config);
  o.readiness = DaemonOptions::Readiness::kAnswering;
  o.env = std::move(env);
  return o;
}

// The hooks that make gpuqd read its GPUs from `tree` (and never from the machine's NVML).
std::vector<std::string> fake_gpu_env(const FakeGpuTree& tree) {
  return {"GPUQ_TEST_HOOKS=1", "GPUQ_TEST_GPU_ROOT=" + tree.root()};
}

// Waits until the status document says "ready" (or its value stays `want`); returns it.
nlohmann::json wait_ready_field(DaemonProcess& daemon, bool want) {
  nlohmann::json s;
  const bool reached = wait_until(
      [&] {
        s = daemon.status();
        return s["ready"] == want &&
               s["pools"][0]["workers_ready"] == s["pools"][0]["workers_total"];
      },
      kDaemonReadyTimeout);
  INFO("status: " << s.dump());
  REQUIRE(reached);
  return s;
}

CommandResult gpuqctl(const DaemonProcess& daemon, const std::string& args) {
  return run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                     daemon.runtime_dir() + "' " + args + " 2>&1");
}

std::vector<std::string> environment_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> entries;
  for (size_t at = 0; at < text.size();) {
    const size_t end = text.find('\0', at);
    entries.push_back(text.substr(at, end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return entries;
}

std::set<int> affinity_of(pid_t pid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::set<int> cpus;
  if (::sched_getaffinity(pid, sizeof set, &set) == 0) {
    for (int i = 0; i < CPU_SETSIZE; ++i) {
      if (CPU_ISSET(i, &set)) cpus.insert(i);
    }
  }
  return cpus;
}

// The checks of an unavailable "gpu" / "gpu_fb" pair and a serving cpu pool, whatever the
// reason the GPUs are missing.
void check_unavailable_pools(DaemonProcess& daemon, const std::string& reason_part) {
  const nlohmann::json s = wait_ready_field(daemon, true);
  INFO("status: " << s.dump());
  REQUIRE(s["pools"].size() == 3);
  const nlohmann::json& cpu = s["pools"][0];
  CHECK(cpu["status"] == "ready");
  for (int p : {1, 2}) {
    const nlohmann::json& gpu = s["pools"][p];
    CHECK(gpu["kind"] == "gpu");
    CHECK(gpu["status"] == "unavailable");
    CHECK(contains(gpu["reason"].get<std::string>(), reason_part));
    CHECK(gpu["workers"].empty());
    CHECK(gpu["workers_total"] == 0);
    CHECK(gpu["accepting"] == false);
    CHECK(gpu["gpus"].empty());
  }
  CHECK(s["pools"][1]["fallback"].is_null());
  CHECK(s["pools"][2]["fallback"] == "cpu");
  CHECK(s["gpu_discovery"]["source"] == "none");
  CHECK(contains(s["gpu_discovery"]["problem"].get<std::string>(), reason_part));

  // Ready for the pools it has; `gpuqctl ready` agrees, and `gpuqctl status` shows the reason.
  const CommandResult ready = gpuqctl(daemon, "ready");
  CHECK_MESSAGE(ready.exit_code == 0, ready.output);
  const CommandResult table = gpuqctl(daemon, "status");
  CHECK(table.exit_code == 0);
  CHECK_MESSAGE(contains(table.output, "pool gpu (gpu): unavailable (" + reason_part),
                table.output);

  // The client learns availability and fallback at connect time.
  Client client = connect_client(daemon);
  REQUIRE(client.pools().size() == 3);
  CHECK(client.pools()[0].available);
  CHECK(client.pools()[0].runs_on == "cpu");
  CHECK_FALSE(client.pools()[1].available);
  CHECK(contains(client.pools()[1].unavailable_reason, reason_part));
  CHECK(client.pools()[1].runs_on.empty());
  CHECK_FALSE(client.pools()[2].available);
  CHECK(client.pools()[2].runs_on == "cpu");

  // No fallback: submit itself fails, at once, naming the pool and the reason.
  const uint64_t start = monotonic_ns();
  auto refused = client.submit(noop_spec("gpu"), 10s);
  auto refused_now = client.try_submit(noop_spec("gpu"));
  CHECK(monotonic_ns() - start < kSecond);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code() == ErrorCode::kNoDevice);
  CHECK(contains(refused.error().message(), "pool 'gpu' is unavailable: " + reason_part));
  REQUIRE_FALSE(refused_now.ok());
  CHECK(refused_now.error().code() == ErrorCode::kNoDevice);
  const CommandResult cli = gpuqctl(daemon, "submit noop --pool gpu");
  CHECK(cli.exit_code != 0);
  CHECK_MESSAGE(contains(cli.output, "NoDevice"), cli.output);

  // "fallback": "cpu": the job runs on the cpu pool's worker.
  const uint32_t cpu_worker = cpu["workers"][0]["id"].get<uint32_t>();
  Job fallen_back = submit_ok(client, sleep_spec(1000, "gpu_fb"));
  CHECK(wait_done(fallen_back).worker_id == cpu_worker);
  const nlohmann::json after = daemon.status();
  CHECK(after["pools"][0]["jobs_submitted"] == 1);
  CHECK(after["pools"][2]["jobs_submitted"] == 0);

  // The cpu pool serves throughout.
  check_echo_works(client);
  Job direct = submit_ok(client, noop_spec("cpu"));
  wait_done(direct);
}

TEST_CASE("no GPU on this machine: gpu pools are unavailable with the reason; cpu pool serves") {
  if (::access("/proc/driver/nvidia", F_OK) == 0) {
    MESSAGE("skipped: this machine has an NVIDIA driver (the fake-tree cases below still run)");
    return;
  }
  DaemonProcess daemon(answering(cpu_and_gpu_config()));

  check_unavailable_pools(daemon,
                          "no NVIDIA driver: /proc/driver/nvidia not found and "
                          "libnvidia-ml.so.1 cannot be loaded");

  CHECK(daemon.terminate().ok());
}

TEST_CASE("a driver that lists no GPU (fake tree): the same, with that reason") {
  FakeGpuTree tree;
  tree.add_driver();
  DaemonProcess daemon(answering(cpu_and_gpu_config(), fake_gpu_env(tree)));

  check_unavailable_pools(daemon, "no usable NVIDIA GPU: the NVIDIA driver is loaded but");

  CHECK(daemon.terminate().ok());
}

TEST_CASE("only an unavailable gpu pool: gpuqd starts, but is not ready") {
  FakeGpuTree tree;  // empty: no driver
  DaemonProcess daemon(answering(R"({"pools":[{"name":"gpu","kind":"gpu"}]})", fake_gpu_env(tree)));

  const nlohmann::json s = daemon.status();
  INFO("status: " << s.dump());
  CHECK(s["ready"] == false);
  CHECK(s["pools"][0]["status"] == "unavailable");
  CHECK(contains(s["pools"][0]["reason"].get<std::string>(), "no NVIDIA driver"));
  const CommandResult ready = gpuqctl(daemon, "ready");
  CHECK(ready.exit_code == 1);
  CHECK_MESSAGE(contains(ready.output, "not ready"), ready.output);
  Client client = connect_client(daemon);
  auto refused = client.submit(noop_spec(), 1s);  // the first pool is the default
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code() == ErrorCode::kNoDevice);

  CHECK(daemon.terminate().ok());
}

TEST_CASE("a discovered GPU: its workers see only it, in PCI bus order, on its local CPUs") {
  const std::vector<int> cpus = affinity_cpus();
  REQUIRE_FALSE(cpus.empty());
  FakeGpuTree tree;
  // GPU 0 (bus 3b) is local to the last CPU, GPU 1 (bus af) to the first; written in the other
  // order, so that the index comes from the bus and not from the directory listing.
  tree.add_gpu(
      {"0000:af:00.0", "NVIDIA H100 80GB HBM3", kUuidB, std::to_string(cpus.front()), "1", false});
  tree.add_gpu(
      {"0000:3b:00.0", "NVIDIA H100 80GB HBM3", kUuidA, std::to_string(cpus.back()), "0", false});
  DaemonOptions options;
  options.config_json = R"({"pools":[{"name":"cpu","kind":"cpu","workers":1},
                                     {"name":"gpu","kind":"gpu","fallback":"cpu"},
                                     {"name":"second","kind":"gpu","gpus":[")" +
                        std::string(kUuidB) + R"("]}]})";
  options.env = fake_gpu_env(tree);
  DaemonProcess daemon(options);

  const nlohmann::json s = daemon.status();
  INFO("status: " << s.dump());
  CHECK(s["ready"] == true);
  CHECK(s["gpu_discovery"]["source"] == "procfs");
  // gpuqd found gpuq-gpu-worker beside itself exactly when this build has CUDA (fake GPUs run
  // gpuq-worker all the same).
#if GPUQ_TEST_HAVE_CUDA
  REQUIRE(s["gpu_discovery"]["gpu_worker"].is_string());
  const std::string gpu_worker = s["gpu_discovery"]["gpu_worker"].get<std::string>();
  CHECK(gpu_worker.size() > 16);
  CHECK(gpu_worker.substr(gpu_worker.size() - 16) == "/gpuq-gpu-worker");
  CHECK(::access(gpu_worker.c_str(), X_OK) == 0);
#else
  CHECK(s["gpu_discovery"]["gpu_worker"].is_null());
#endif
  const nlohmann::json& gpu = s["pools"][1];
  CHECK(gpu["status"] == "ready");
  REQUIRE(gpu["gpus"].size() == 2);
  CHECK(gpu["gpus"][0]["uuid"] == kUuidA);
  CHECK(gpu["gpus"][0]["pci_bus_id"] == "0000:3b:00.0");
  CHECK(gpu["gpus"][1]["uuid"] == kUuidB);
  REQUIRE(gpu["workers"].size() == 2);
  const nlohmann::json& second = s["pools"][2];
  REQUIRE(second["workers"].size() == 1);
  CHECK(second["gpus"][0]["index"] == 1);

  struct Expect {
    nlohmann::json worker;
    std::string uuid;
    int cpu;
  };
  const Expect expected[] = {{gpu["workers"][0], kUuidA, cpus.back()},
                             {gpu["workers"][1], kUuidB, cpus.front()},
                             {second["workers"][0], kUuidB, cpus.front()}};
  for (const Expect& e : expected) {
    INFO("worker " << e.worker.dump());
    CHECK(e.worker["gpu"] == e.uuid);
    CHECK(e.worker["cpus"] == nlohmann::json::array({e.cpu}));
    const pid_t pid = e.worker["pid"].get<pid_t>();
    REQUIRE(pid > 0);
    std::vector<std::string> cuda;
    for (const std::string& entry : environment_of(pid)) {
      if (entry.rfind("CUDA_VISIBLE_DEVICES=", 0) == 0 ||
          entry.rfind("CUDA_DEVICE_ORDER=", 0) == 0) {
        cuda.push_back(entry);
      }
    }
    std::sort(cuda.begin(), cuda.end());
    CHECK(cuda == std::vector<std::string>{"CUDA_DEVICE_ORDER=PCI_BUS_ID",
                                           "CUDA_VISIBLE_DEVICES=" + e.uuid});
    CHECK(affinity_of(pid) == std::set<int>{e.cpu});
  }
  // The cpu pool's worker still sees no GPU.
  const pid_t cpu_pid = s["pools"][0]["workers"][0]["pid"].get<pid_t>();
  std::vector<std::string> cpu_env = environment_of(cpu_pid);
  CHECK(std::count(cpu_env.begin(), cpu_env.end(), "CUDA_VISIBLE_DEVICES=-1") == 1);

  // Jobs for the gpu pool run on its workers (the GPU runtime itself is a later part).
  Client client = connect_client(daemon);
  CHECK(client.pools()[1].available);
  CHECK(client.pools()[1].runs_on == "gpu");
  std::set<uint32_t> gpu_workers = {gpu["workers"][0]["id"].get<uint32_t>(),
                                    gpu["workers"][1]["id"].get<uint32_t>()};
  Job job = submit_ok(client, sleep_spec(1000, "gpu"));
  CHECK(gpu_workers.count(wait_done(job).worker_id) == 1);

  CHECK(daemon.terminate().ok());
}

TEST_CASE(
    "a C++ gpu pool without gpuq-gpu-worker is unavailable, saying where it looked "
    "(GPUQ_TEST_GPU_WORKER=real)") {
  // gpuqd and gpuq-worker copied to a directory of their own, without gpuq-gpu-worker (a build
  // without CUDA, a pip install without the gpu extra); a fake GPU, and the hook that makes gpu
  // pools run what they would run on a real one. python/tests/test_gpu_pool_programs.py runs a
  // Python gpu pool beside it, which needs no gpuq-gpu-worker.
  FakeGpuTree tree;
  tree.add_gpu({"0000:3b:00.0", "NVIDIA H100 80GB HBM3", kUuidA, "", "-1", false});
  const std::string bin = tree.root() + "/bin";
  const std::string gpuqd = gpuqd_path();
  const std::string worker = gpuqd.substr(0, gpuqd.rfind('/')) + "/gpuq-worker";
  REQUIRE(run_command("mkdir '" + bin + "' && cp '" + gpuqd + "' '" + worker + "' '" + bin + "/'")
              .exit_code == 0);
  const std::string config = R"({"pools":[{"name":"cpu","kind":"cpu","workers":1},
                                          {"name":"gpu","kind":"gpu"}]})";
  std::vector<std::string> env = fake_gpu_env(tree);
  env.emplace_back("GPUQ_TEST_GPU_WORKER=real");
  const std::string needs = "a C++ gpu pool needs gpuq-gpu-worker, which is not installed";
  const std::string where =
      "(looked for next to gpuqd in " + bin + " and in " + bin + "/../libexec/gpuq)";

  FakeGpuTree::write(tree.root() + "/gpuqd.json", config);
  std::string assignments;
  for (const std::string& e : env) assignments += "'" + e + "' ";
  const CommandResult check =
      run_command("env " + assignments + "'" + bin + "/gpuqd' --check-config --config '" +
                  tree.root() + "/gpuqd.json' 2>&1");
  CHECK(check.exit_code == 0);
  CHECK_MESSAGE(contains(check.output, "unavailable: " + needs), check.output);
  CHECK_MESSAGE(contains(check.output, where), check.output);
  CHECK_MESSAGE(contains(check.output, "pip install 'gpuq[gpu]'"), check.output);

  DaemonOptions options = answering(config, env);
  options.gpuqd = bin + "/gpuqd";
  DaemonProcess daemon(options);
  const nlohmann::json s = wait_ready_field(daemon, true);
  INFO("status: " << s.dump());
  CHECK(s["gpu_discovery"]["gpu_worker"].is_null());
  CHECK(s["pools"][0]["status"] == "ready");
  const nlohmann::json& gpu = s["pools"][1];
  CHECK(gpu["status"] == "unavailable");
  CHECK(contains(gpu["reason"].get<std::string>(), needs));
  CHECK(contains(gpu["reason"].get<std::string>(), where));
  CHECK(daemon.terminate().ok());
}

TEST_CASE("memory budgets: shares per worker in --check-config; a GPU over-promised is refused") {
  FakeGpuTree tree;
  tree.add_gpu({"0000:3b:00.0", "NVIDIA H100 80GB HBM3", kUuidA, "", "-1", false});
  const std::string path = tree.root() + "/gpuqd.json";
  std::string env;
  for (const std::string& e : fake_gpu_env(tree)) env += "'" + e + "' ";
  const auto check = [&](const std::string& config) {
    FakeGpuTree::write(path, config);
    return run_command("env " + env + "'" + gpuqd_path() + "' --check-config --config '" + path +
                       "' 2>&1");
  };

  // Two pools on GPU 0 without memory_limit share 0.9; a pool's share is divided among its
  // workers and spares there.
  const CommandResult shared = check(R"({"pools":[
      {"name":"a","kind":"gpu","gpus":[0],"workers_per_gpu":2,"spare_workers":1},
      {"name":"b","kind":"gpu","gpus":[0]},
      {"name":"c","kind":"gpu","gpus":[0],"memory_limit":0.1}]})");
  INFO(shared.output);
  CHECK(shared.exit_code == 0);
  CHECK(contains(shared.output, "pool a: gpu, gpus 0, 2 workers per GPU, memory_limit not set"));
  CHECK(contains(shared.output,
                 "  on GPU 0: budget 0.4 of the device (its share of the default 0.9), 3 workers "
                 "(spares included): 0.1333 of the device each"));
  CHECK(contains(shared.output,
                 "  on GPU 0: budget 0.4 of the device (its share of the default 0.9), 1 workers "
                 "(spares included): 0.4 of the device each"));
  CHECK(contains(shared.output, "memory_limit 0.1 of the device per GPU"));
  CHECK(contains(shared.output, "  on GPU 0: budget 0.1 of the device, 1 workers"));

  // Over the device: --check-config and the daemon itself refuse it, naming GPU, pools and sum.
  const std::string over = R"({"pools":[
      {"name":"a","kind":"gpu","gpus":[0],"memory_limit":0.6},
      {"name":"b","kind":"gpu","gpus":"all","memory_limit":0.5}]})";
  const std::string says = "config: GPU 0 (" + std::string(kUuidA) +
                           "): the memory_limit of pools a (0.6 of the device), b (0.5 of the "
                           "device) adds up to 1.1 of the device, more than all of it";
  const CommandResult refused = check(over);
  CHECK(refused.exit_code == 2);
  CHECK_MESSAGE(contains(refused.output, says), refused.output);
  const CommandResult start =
      run_command("env " + env + "timeout 30 '" + gpuqd_path() + "' --config '" + path +
                  "' --runtime-dir '" + tree.root() + "/run' 2>&1");
  CHECK(start.exit_code == 1);
  CHECK_MESSAGE(contains(start.output, "cannot start: InvalidArgument: " + says), start.output);
}

TEST_CASE("bad gpu pool values stop gpuqd with an error naming the key") {
  struct Case {
    const char* pools;
    const char* names;
  };
  const Case cases[] = {
      {R"([{"name":"g","kind":"gpu","workers_per_gpu":0}])",
       "config: pools[0].workers_per_gpu: must be in [1, 64], got 0"},
      {R"([{"name":"g","kind":"gpu","gpus":[0,"GPU-nope"]}])", "config: pools[0].gpus[1]: "},
      {R"([{"name":"g","kind":"gpu","gpus":"most"}])", "config: pools[0].gpus: must be \"all\""},
      {R"([{"name":"g","kind":"gpu","fallback":"gpu"}])",
       "config: pools[0].fallback: must be \"none\" or \"cpu\""},
      {R"([{"name":"g","kind":"gpu","fallback":"cpu"}])",
       "config: pools[0].fallback: \"cpu\" sends jobs to the first cpu pool"},
      {R"([{"name":"c"},{"name":"g","kind":"gpu","workers":2}])",
       "config: pools[1].workers: is not a gpu pool key"},
  };
  FakeGpuTree scratch;  // a directory for the config files
  for (const Case& c : cases) {
    CAPTURE(c.pools);
    const std::string path = scratch.root() + "/gpuqd.json";
    FakeGpuTree::write(path, std::string(R"({"pools":)") + c.pools + "}");

    const CommandResult check = run_command(std::string("'") + gpuqd_path() +
                                            "' --check-config --config '" + path + "' 2>&1");
    const CommandResult start =
        // `timeout`: a config accepted by mistake would start a daemon that never returns.
        run_command(std::string("timeout 30 '") + gpuqd_path() + "' --config '" + path +
                    "' --runtime-dir '" + scratch.root() + "/run' 2>&1");

    CHECK(check.exit_code == 2);
    CHECK_MESSAGE(contains(check.output, c.names), check.output);
    CHECK(start.exit_code == 2);
    CHECK_MESSAGE(contains(start.output, c.names), start.output);
  }
}

}  // namespace
}  // namespace gpuq::test
