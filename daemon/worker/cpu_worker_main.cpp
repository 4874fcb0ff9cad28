// gpuq-worker: the CPU worker, started by gpuqd (fork+exec), never by hand.
#include "op_backend.hpp"
#include "worker_loop.hpp"

int main(int argc, char** argv) {
  return gpuq::daemon::worker_main(
      argc, argv, "gpuq-worker",
      [](const gpuq::daemon::WorkerOptions&) -> gpuq::daemon::OpBackend& {
        return gpuq::daemon::cpu_backend();
      });
}
