// The test plug-in's faulting GPU op: one thread writes 2^47 bytes past its output buffer,
// past the top of the x86-64 user address space, where nothing can be mapped: an illegal
// address, a sticky CUDA error that poisons the worker's context.
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
