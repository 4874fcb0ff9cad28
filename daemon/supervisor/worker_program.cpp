#include "worker_program.hpp"

namespace gpuq::daemon {

bool gpu_pools_on_cpu_backend(const GpuDiscoveryOptions& discovery, const TestHooks& hooks) {
  return discovery.fake() && !(hooks.enabled && hooks.real_gpu_worker);
}

Result<WorkerProgram> worker_program(const PoolConfig& pool, const WorkerExecutables& found,
                                     bool cpu_backend) {
  const bool gpu = pool.kind == PoolKind::kGpu && !cpu_backend;
  if (pool.python) return WorkerProgram{WorkerProgramKind::kPython, "", gpu};
  if (!gpu) return WorkerProgram{WorkerProgramKind::kCpuWorker, found.worker, false};
  if (found.gpu_worker.empty()) {
    return Error(
        ErrorCode::kNoDevice,
        "a C++ gpu pool needs gpuq-gpu-worker, which is not installed" +
            (found.searched.empty() ? std::string() : " (looked for " + found.searched + ")") +
            ": this gpuq was built without CUDA, or installed from pip without the "
            "gpu extra (pip install 'gpuq[gpu]'); a Python pool (\"python\") needs "
            "no gpuq-gpu-worker");
  }
  return WorkerProgram{WorkerProgramKind::kGpuWorker, found.gpu_worker, true};
}

}  // namespace gpuq::daemon
