// gpuq-gpu-probe: checks, in a process of its own, that this machine's GPUs can do what a gpuq
// GPU worker needs: a CUDA context per device, a stream, cuBLAS and cuDNN handles, a kernel
// launch and a cuBLAS GEMM whose result is checked against the CPU. Prints one JSON object.
//
// Exit status: 0 all devices passed, 1 a device failed, 77 no CUDA device (ctest: skipped).
// Never run by gpuqd (the supervisor does not touch CUDA); a tool for people and for the `gpu`
// test label.
#include <cstdio>
#include <string>
#include <vector>

#include "cuda_check.hpp"

namespace {

__global__ void fill_kernel(float* x, int n, float base) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = base + static_cast<float>(i % 7);
}

struct DeviceReport {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  size_t total_bytes = 0;
  std::string error;
};

// C = A * B for small n x n matrices on the device, checked against the CPU.
gpuq::Result<void> check_device(int dev, DeviceReport& rep) {
  GPUQ_CUDA(cudaSetDevice(dev));
  cudaDeviceProp prop{};
  GPUQ_CUDA(cudaGetDeviceProperties(&prop, dev));
  rep.name = prop.name;
  rep.cc_major = prop.major;
  rep.cc_minor = prop.minor;
  rep.total_bytes = prop.totalGlobalMem;
  cudaStream_t stream;
  GPUQ_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t blas;
  GPUQ_CUBLAS(cublasCreate(&blas));
  GPUQ_CUBLAS(cublasSetStream(blas, stream));
  cudnnHandle_t dnn;
  GPUQ_CUDNN(cudnnCreate(&dnn));
  GPUQ_CUDNN(cudnnSetStream(dnn, stream));

  constexpr int n = 64;
  float *a, *b, *c;
  GPUQ_CUDA(cudaMallocAsync(&a, n * n * sizeof(float), stream));
  GPUQ_CUDA(cudaMallocAsync(&b, n * n * sizeof(float), stream));
  GPUQ_CUDA(cudaMallocAsync(&c, n * n * sizeof(float), stream));
  fill_kernel<<<(n * n + 255) / 256, 256, 0, stream>>>(a, n * n, 1.0f);
  fill_kernel<<<(n * n + 255) / 256, 256, 0, stream>>>(b, n * n, -2.0f);
  GPUQ_CUDA(cudaGetLastError());
  const float alpha = 1.0f, beta = 0.0f;
  GPUQ_CUBLAS(
      cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, n, b, n, &beta, c, n));
  std::vector<float> hc(n * n);
  GPUQ_CUDA(
      cudaMemcpyAsync(hc.data(), c, hc.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  GPUQ_CUDA(cudaStreamSynchronize(stream));
  // Reference (column-major, like cuBLAS).
  auto av = [](int i) { return 1.0f + static_cast<float>(i % 7); };
  auto bv = [](int i) { return -2.0f + static_cast<float>(i % 7); };
  for (int col = 0; col < n; ++col) {
    for (int row = 0; row < n; ++row) {
      double ref = 0;
      for (int k = 0; k < n; ++k) ref += double(av(k * n + row)) * double(bv(col * n + k));
      double got = hc[col * n + row];
      if (got - ref > 1e-3 * (1 + (ref < 0 ? -ref : ref)) ||
          ref - got > 1e-3 * (1 + (ref < 0 ? -ref : ref))) {
        return gpuq::Error(gpuq::ErrorCode::kInternal,
                           "cublasSgemm result differs from the CPU at (" + std::to_string(row) +
                               ", " + std::to_string(col) + ")");
      }
    }
  }
  GPUQ_CUDA(cudaFreeAsync(a, stream));
  GPUQ_CUDA(cudaFreeAsync(b, stream));
  GPUQ_CUDA(cudaFreeAsync(c, stream));
  GPUQ_CUDA(cudaStreamSynchronize(stream));
  GPUQ_CUDNN(cudnnDestroy(dnn));
  GPUQ_CUBLAS(cublasDestroy(blas));
  GPUQ_CUDA(cudaStreamDestroy(stream));
  return {};
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) continue;
    o += ch;
  }
  return o;
}

}  // namespace

int main() {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  std::printf("{\"cuda_runtime\": %d, \"cuda_driver\": %d, \"cudnn\": %zu, ", runtime, driver,
              cudnnGetVersion());
  if (e != cudaSuccess || count == 0) {
    std::printf("\"devices\": [], \"skipped\": \"%s\"}\n",
                json_escape(e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device").c_str());
    return 77;
  }
  bool all_ok = true;
  std::printf("\"devices\": [");
  for (int d = 0; d < count; ++d) {
    DeviceReport rep;
    rep.index = d;
    auto r = check_device(d, rep);
    if (!r) {
      rep.error = r.error().to_string();
      all_ok = false;
    }
    std::printf(
        "%s{\"index\": %d, \"name\": \"%s\", \"compute_capability\": \"%d.%d\", "
        "\"memory_bytes\": %zu, \"ok\": %s, \"error\": \"%s\"}",
        d ? ", " : "", d, json_escape(rep.name).c_str(), rep.cc_major, rep.cc_minor,
        rep.total_bytes, r ? "true" : "false", json_escape(rep.error).c_str());
  }
  std::printf("]}\n");
  return all_ok ? 0 : 1;
}
