// Which program runs a pool's workers (daemon/supervisor/worker_program.hpp): gpuq-worker,
// gpuq-gpu-worker (a C++ gpu pool, unavailable without it), or the pool's interpreter (a Python
// pool, with --gpu on a gpu pool, never needing gpuq-gpu-worker); fake GPUs run the CPU backend
// unless the hook GPUQ_TEST_GPU_WORKER=real says otherwise.
#include <doctest/doctest.h>
#include <stdlib.h>

#include <string>

#include "worker_program.hpp"

namespace gpuq::daemon {
namespace {

PoolConfig pool(PoolKind kind, bool python) {
  PoolConfig p;
  p.name = "p";
  p.kind = kind;
  if (python) p.python = PythonPoolConfig{};
  return p;
}

const WorkerExecutables kWithGpuWorker{"/opt/gpuq/gpuq-worker", "/opt/gpuq/gpuq-gpu-worker",
                                       "next to gpuqd in /opt/gpuq"};
const WorkerExecutables kWithoutGpuWorker{"/opt/gpuq/gpuq-worker", "",
                                          "next to gpuqd in /opt/gpuq and in /opt/libexec/gpuq"};

TEST_CASE("worker_program: a cpu pool runs gpuq-worker, a Python pool its interpreter") {
  for (const WorkerExecutables* found : {&kWithGpuWorker, &kWithoutGpuWorker}) {
    auto cpu = worker_program(pool(PoolKind::kCpu, false), *found, false);
    REQUIRE(cpu);
    CHECK(cpu->kind == WorkerProgramKind::kCpuWorker);
    CHECK(cpu->path == "/opt/gpuq/gpuq-worker");
    CHECK_FALSE(cpu->gpu);
    auto py = worker_program(pool(PoolKind::kCpu, true), *found, false);
    REQUIRE(py);
    CHECK(py->kind == WorkerProgramKind::kPython);
    CHECK_FALSE(py->gpu);
  }
}

TEST_CASE(
    "worker_program: a Python gpu pool runs its interpreter with --gpu, gpuq-gpu-worker or not") {
  for (const WorkerExecutables* found : {&kWithGpuWorker, &kWithoutGpuWorker}) {
    auto py = worker_program(pool(PoolKind::kGpu, true), *found, false);
    REQUIRE(py);
    CHECK(py->kind == WorkerProgramKind::kPython);
    CHECK(py->gpu);
  }
}

TEST_CASE(
    "worker_program: a C++ gpu pool runs gpuq-gpu-worker, and without it says where it looked") {
  auto gpu = worker_program(pool(PoolKind::kGpu, false), kWithGpuWorker, false);
  REQUIRE(gpu);
  CHECK(gpu->kind == WorkerProgramKind::kGpuWorker);
  CHECK(gpu->path == "/opt/gpuq/gpuq-gpu-worker");
  CHECK(gpu->gpu);

  auto missing = worker_program(pool(PoolKind::kGpu, false), kWithoutGpuWorker, false);
  REQUIRE_FALSE(missing);
  const std::string m = missing.error().message();
  CHECK(missing.error().code() == ErrorCode::kNoDevice);
  CHECK(m.find("C++ gpu pool needs gpuq-gpu-worker") != std::string::npos);
  CHECK(m.find("next to gpuqd in /opt/gpuq and in /opt/libexec/gpuq") != std::string::npos);
  CHECK(m.find("pip install 'gpuq[gpu]'") != std::string::npos);
}

TEST_CASE("worker_program: on the CPU backend (fake GPUs) gpu pools run gpuq-worker, no --gpu") {
  auto gpu = worker_program(pool(PoolKind::kGpu, false), kWithoutGpuWorker, true);
  REQUIRE(gpu);
  CHECK(gpu->kind == WorkerProgramKind::kCpuWorker);
  CHECK(gpu->path == "/opt/gpuq/gpuq-worker");
  CHECK_FALSE(gpu->gpu);
  auto py = worker_program(pool(PoolKind::kGpu, true), kWithoutGpuWorker, true);
  REQUIRE(py);
  CHECK(py->kind == WorkerProgramKind::kPython);
  CHECK_FALSE(py->gpu);
}

TEST_CASE("gpu_pools_on_cpu_backend: fake GPUs, unless GPUQ_TEST_GPU_WORKER=real") {
  GpuDiscoveryOptions real;
  GpuDiscoveryOptions tree;
  tree.root = "/tmp/fake";
  GpuDiscoveryOptions nvml;
  nvml.nvml_library = "/tmp/libfake_nvml.so";
  TestHooks off;
  TestHooks on;
  on.enabled = true;
  TestHooks on_real = on;
  on_real.real_gpu_worker = true;
  CHECK_FALSE(gpu_pools_on_cpu_backend(real, off));
  CHECK_FALSE(gpu_pools_on_cpu_backend(real, on_real));
  CHECK(gpu_pools_on_cpu_backend(tree, on));
  CHECK(gpu_pools_on_cpu_backend(nvml, on));
  CHECK_FALSE(gpu_pools_on_cpu_backend(tree, on_real));
  CHECK_FALSE(gpu_pools_on_cpu_backend(nvml, on_real));
}

TEST_CASE("GPUQ_TEST_GPU_WORKER: read only with the hooks on, and only 'real'") {
  ::setenv("GPUQ_TEST_GPU_WORKER", "real", 1);
  ::unsetenv("GPUQ_TEST_HOOKS");
  auto off = read_test_hooks();
  REQUIRE(off);
  CHECK_FALSE(off->real_gpu_worker);
  ::setenv("GPUQ_TEST_HOOKS", "1", 1);
  auto on = read_test_hooks();
  REQUIRE(on);
  CHECK(on->real_gpu_worker);
  ::setenv("GPUQ_TEST_GPU_WORKER", "yes", 1);
  auto bad = read_test_hooks();
  REQUIRE_FALSE(bad);
  CHECK(bad.error().message().find("GPUQ_TEST_GPU_WORKER='yes': must be 'real'") !=
        std::string::npos);
  ::unsetenv("GPUQ_TEST_GPU_WORKER");
  ::unsetenv("GPUQ_TEST_HOOKS");
}

}  // namespace
}  // namespace gpuq::daemon
