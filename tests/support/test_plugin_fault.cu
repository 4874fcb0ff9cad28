// The test plug-in's GPU ops that go wrong:
// - plugin_oob_write: one thread writes 2^47 bytes past its output buffer, past the top of the
//   x86-64 user address space, where nothing can be mapped: an illegal address, a sticky CUDA
//   error that poisons the worker's context;
// - plugin_spin: a kernel that never ends (the worker waits on its stream for good): only
//   killing the worker's process stops it.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "gpuq/plugin.h"

namespace {

__global__ void write_far(float* base, uint64_t far_bytes) {
  // volatile: the store must happen, and at this address.
  volatile float* p = reinterpret_cast<volatile float*>(reinterpret_cast<char*>(base) + far_bytes);
  *p = 1.0f;
}

// Reads a flag nothing ever sets; volatile, so every iteration reads it again.
__device__ volatile int g_never_set = 0;

__global__ void spin_forever() {
  while (g_never_set == 0) {
  }
}

}  // namespace

int gpuq_test_plugin_oob_write(gpuq_plugin_job* job) {
  write_far<<<1, 1, 0, static_cast<cudaStream_t>(job->cuda_stream)>>>(
      static_cast<float*>(job->output), uint64_t{1} << 47);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    std::snprintf(job->error_message, job->error_message_capacity, "launch: %s",
                  cudaGetErrorString(e));
    return GPUQ_OP_FAILED;
  }
  return 0;
}

int gpuq_test_plugin_spin_kernel(gpuq_plugin_job* job) {
  spin_forever<<<1, 1, 0, static_cast<cudaStream_t>(job->cuda_stream)>>>();
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    std::snprintf(job->error_message, job->error_message_capacity, "launch: %s",
                  cudaGetErrorString(e));
    return GPUQ_OP_FAILED;
  }
  return 0;  // the worker's wait for the stream never returns
}
