// GPU: plug-in ops on a real gpuqd with a gpu pool (gpuq-gpu-worker on this machine's first GPU)
// and a cpu pool. The example plug-in's saxpy (a CUDA kernel on the worker's stream) gives on
// the gpu pool what its CPU twin gives on the cpu pool; the test plug-in's plugin_oob_write (a
// kernel that writes far out of bounds: a sticky CUDA error) fails only its job, the worker is
// replaced by a new process, and the next job on the pool succeeds; its plugin_spin (a kernel
// that never ends) is stopped at the job's time limit by killing the worker
// (docs/design/faults.md, "Jobs that do not end"), and the replacement serves.
//
// Exits 77 (ctest: skipped) when the CUDA runtime reports no device (gpu_test_main.cpp: a
// child process asks, so this one, a client, never initialises CUDA).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

std::string plugin_gpu_config() {
  nlohmann::json c;
  c["pools"] = nlohmann::json::array({{{"name", "cpu"}, {"kind", "cpu"}, {"workers", 1}},
                                      {{"name", "gpu"},
                                       {"kind", "gpu"},
                                       {"gpus", nlohmann::json::array({0})},
                                       {"memory_limit", 0.5}}});
  c["plugins"] = {GPUQ_TEST_EXAMPLE_PLUGIN, GPUQ_TEST_PLUGIN};
  return c.dump();
}

pid_t gpu_worker_pid(const DaemonProcess& daemon) {
  const auto pids = daemon.worker_pids("gpu");
  REQUIRE(pids.size() == 1);
  return pids[0];
}

// saxpy on `pool` with a = 1.75 over x, y; the result.
std::vector<float> saxpy_on(Client& client, const std::string& pool, const std::vector<float>& x,
                            const std::vector<float>& y) {
  const uint64_t n = x.size();
  Buffer in = allocate(client, 2 * n * sizeof(float));
  Buffer out = allocate(client, n * sizeof(float));
  std::memcpy(in.data(), x.data(), n * sizeof(float));
  std::memcpy(in.data() + n * sizeof(float), y.data(), n * sizeof(float));
  JobSpec spec = job_spec("saxpy", in, out, pool);
  spec.params.push_back(JobParam::real("a", 1.75));
  Job job = submit_ok(client, spec);
  const JobResult r = wait_done(job);
  CHECK(r.output_size == n * sizeof(float));
  CHECK(r.value == n);
  std::vector<float> result(n);
  std::memcpy(result.data(), out.data(), n * sizeof(float));
  client.release(in);
  client.release(out);
  return result;
}

TEST_CASE("saxpy on the gpu pool matches its CPU twin") {
  DaemonProcess daemon(plugin_gpu_config());
  Client client = connect_client(daemon);
  constexpr uint64_t kN = (1u << 20) + 37;
  std::vector<float> x(kN), y(kN);
  for (uint64_t i = 0; i < kN; ++i) {
    x[i] = static_cast<float>(i % 1000) * 0.25f;
    y[i] = static_cast<float>(i % 77) - 30.0f;
  }
  const std::vector<float> on_cpu = saxpy_on(client, "cpu", x, y);
  const std::vector<float> on_gpu = saxpy_on(client, "gpu", x, y);
  uint64_t differ = 0;
  for (uint64_t i = 0; i < kN; ++i) {
    // a*x+y may be fused on the GPU: one rounding instead of two.
    if (std::abs(on_cpu[i] - on_gpu[i]) > 1e-5f * (1.0f + std::abs(on_cpu[i]))) ++differ;
  }
  CHECK(differ == 0);
  CHECK(daemon.terminate().ok());
}

TEST_CASE("a plug-in op's sticky CUDA error fails only its job; the worker is replaced") {
  DaemonProcess daemon(plugin_gpu_config());
  Client client = connect_client(daemon);
  const pid_t before = gpu_worker_pid(daemon);

  Buffer out = allocate(client, 256);
  Job fault = submit_ok(client, job_spec("plugin_oob_write", {}, out, "gpu"));
  Job on_cpu = submit_ok(client, sleep_spec(1000, "cpu"));
  const JobResult failed = wait_result(fault);
  INFO("message: " << failed.message);
  CHECK(failed.status == JobStatus::kFailed);
  CHECK(failed.code == ErrorCode::kOpFailed);
  CHECK(failed.message.find("cudaErrorIllegalAddress") != std::string::npos);
  CHECK(failed.message.find("the worker is replaced") != std::string::npos);
  wait_done(on_cpu);

  pid_t after = 0;
  REQUIRE(wait_until(
      [&] {
        const auto status = daemon.status();
        for (const auto& p : status["pools"]) {
          if (p["name"] != "gpu") continue;
          if (p["workers"].size() != 1 || p["workers"][0]["state"] != "ready") return false;
          after = p["workers"][0]["pid"].get<pid_t>();
          return after != before;
        }
        return false;
      },
      60s));
  CHECK(after != before);
  const std::vector<float> x(1000, 2.0f), y(1000, 1.0f);
  const std::vector<float> r = saxpy_on(client, "gpu", x, y);
  CHECK(r[0] == 1.75f * 2.0f + 1.0f);
  CHECK(r[999] == 1.75f * 2.0f + 1.0f);
  CHECK(daemon.terminate().ok());
}

TEST_CASE("a kernel that never ends is stopped at its time limit; the worker is replaced") {
  nlohmann::json config = nlohmann::json::parse(plugin_gpu_config());
  config["cancel_grace_ms"] = 300;
  DaemonProcess daemon(config.dump());
  Client client = connect_client(daemon);
  const pid_t before = gpu_worker_pid(daemon);

  JobSpec spin = job_spec("plugin_spin", {}, {}, "gpu");
  spin.time_limit = 500ms;
  Job job = submit_ok(client, spin);
  const JobResult r = wait_result(job);
  INFO("message: " << r.message);
  CHECK(r.status == JobStatus::kFailed);
  CHECK(r.code == ErrorCode::kTimedOut);
  CHECK(r.message.find("time limit (500 ms)") != std::string::npos);
  CHECK(r.message.find("was stopped") != std::string::npos);

  nlohmann::json gpu_worker;
  REQUIRE(wait_until(
      [&] {
        const nlohmann::json status = daemon.status();  // the loop refers into it
        for (const auto& p : status["pools"]) {
          if (p["name"] != "gpu" || p["workers"][0]["state"] != "ready") continue;
          gpu_worker = p["workers"][0];
          return gpu_worker["pid"].get<pid_t>() != before;
        }
        return false;
      },
      60s));
  CHECK(gpu_worker["stops_forced"] == 1);
  CHECK(gpu_worker["start_ms"].is_number());
  MESSAGE("replacement GPU worker start: " << gpu_worker["start_ms"].get<double>() << " ms");
  const std::vector<float> x(1000, 2.0f), y(1000, 1.0f);
  const std::vector<float> out = saxpy_on(client, "gpu", x, y);
  CHECK(out[0] == 1.75f * 2.0f + 1.0f);
  CHECK(daemon.terminate().ok());
}

}  // namespace
}  // namespace gpuq::test
