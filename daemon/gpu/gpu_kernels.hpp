// The few CUDA kernels the GPU worker launches itself (gpu_kernels.cu, compiled by nvcc); the
// rest of its work is cuDNN and cuBLAS. Plain C++ declarations, so that the backend builds with
// the host compiler in C++20.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gpuq::gpu {

// Test only (the gpu_fault_test op): a one-thread kernel on `stream` that stores through
// `base + far_bytes`, far outside any allocation, so that the stream's next synchronization
// returns cudaErrorIllegalAddress, a sticky error. Returns the launch's own error.
cudaError_t launch_out_of_bounds_write(float* base, uint64_t far_bytes, cudaStream_t stream);

// Test only (gpu_fault_test with mode=spin): a one-thread kernel on `stream` that runs for
// `ns` nanoseconds of the GPU's global timer: a long kernel that ends by itself, for the
// cancel and time-limit paths. Returns the launch's own error.
cudaError_t launch_spin(uint64_t ns, cudaStream_t stream);

}  // namespace gpuq::gpu
