// Kernels of the GPU worker (gpu_kernels.hpp).
#include "gpu_kernels.hpp"

namespace gpuq::gpu {
namespace {

__global__ void write_far(float* base, uint64_t far_bytes) {
  // volatile: the store must happen, and at this address.
  volatile float* p = reinterpret_cast<volatile float*>(reinterpret_cast<char*>(base) + far_bytes);
  *p = 1.0f;
}

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin(uint64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) {
  }
}

}  // namespace

cudaError_t launch_spin(uint64_t ns, cudaStream_t stream) {
  spin<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

cudaError_t launch_out_of_bounds_write(float* base, uint64_t far_bytes, cudaStream_t stream) {
  write_far<<<1, 1, 0, stream>>>(base, far_bytes);
  return cudaGetLastError();
}

}  // namespace gpuq::gpu
