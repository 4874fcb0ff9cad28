// The example plug-in's GPU function: the same saxpy as the CPU twin, as a CUDA kernel
// enqueued on the worker's stream (the worker synchronizes and copies the result back).
#include <cuda_runtime.h>

#include <cstdio>

#include "saxpy_plugin.hpp"

namespace {

__global__ void saxpy_kernel(uint64_t n, float a, const float* x, const float* y, float* out) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = a * x[i] + y[i];
  }
}

}  // namespace

namespace gpuq_example {

int saxpy_gpu(gpuq_plugin_job* job) {
  SaxpyArgs args;
  if (int code = saxpy_args(job, &args); code != 0) return code;
  const float* x = static_cast<const float*>(job->input);
  constexpr unsigned kThreads = 256;
  const uint64_t blocks = (args.n + kThreads - 1) / kThreads;
  saxpy_kernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0,
                 static_cast<cudaStream_t>(job->cuda_stream)>>>(args.n, args.a, x, x + args.n,
                                                                static_cast<float*>(job->output));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    std::snprintf(job->error_message, job->error_message_capacity, "saxpy kernel launch: %s",
                  cudaGetErrorString(e));
    return GPUQ_OP_FAILED;
  }
  job->output_bytes = args.n * sizeof(float);
  job->value = args.n;
  return 0;
}

}  // namespace gpuq_example
