// gpuq-gpu-worker: a gpu pool's worker, started by gpuqd (fork+exec) with CUDA_VISIBLE_DEVICES
// set to its GPU, never by hand. The same worker loop as gpuq-worker, with the GPU backend.
#include "gpu_backend.hpp"
#include "worker_loop.hpp"

int main(int argc, char** argv) {
  return gpuq::daemon::worker_main(argc, argv, "gpuq-gpu-worker", gpuq::daemon::gpu_backend);
}
