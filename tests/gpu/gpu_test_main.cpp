// main() of the GPU test binaries (label gpu): exit 77, which ctest reports as skipped (never
// passed), when the CUDA runtime sees no device; else run the doctest cases.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

namespace {

// Whether the CUDA runtime sees a device, asked in a child process: the test process is a gpuq
// client, and a client never initialises CUDA (nor forks gpuqd after doing so).
bool cuda_device_present() {
  const pid_t child = ::fork();
  if (child == 0) {
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0) {
      std::printf("no CUDA device (%s): skipped\n",
                  e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
      std::fflush(stdout);
      ::_exit(77);
    }
    ::_exit(0);
  }
  int status = 0;
  if (child < 0 || ::waitpid(child, &status, 0) != child) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (!cuda_device_present()) return 77;
  doctest::Context context(argc, argv);
  return context.run();
}
