// Checked CUDA, cuBLAS and cuDNN calls: every call goes through GPUQ_CUDA / GPUQ_CUBLAS /
// GPUQ_CUDNN, which turn a failure into a gpuq::Error naming the call, the code, its text and
// the place. Used only in GPU worker code; the supervisor and the client never include it.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstring>
#include <string>

#include "gpuq/error.hpp"

namespace gpuq::gpu {

// True for the errors that the CUDA runtime documents as leaving the process in an
// inconsistent state ("any further CUDA work will return the same error; the process must be
// terminated and relaunched"), and for cudaErrorUnknown, which gives no reason to trust the
// context either. A GPU worker that meets one exits to be replaced.
inline bool is_sticky_cuda_error(cudaError_t e) noexcept {
  switch (e) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

// "gpu_backend.cpp:419": where a failed call is, without the build's directories, which say
// nothing to a job's client and would only lengthen its message (kMessageBytes).
inline std::string call_site(const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  return std::string(slash != nullptr ? slash + 1 : file) + ":" + std::to_string(line);
}

inline Error cuda_error(const char* call, cudaError_t e, const char* file, int line) {
  ErrorCode code = e == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory
                   : (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
                       ? ErrorCode::kNoDevice
                       : ErrorCode::kSystemError;
  return Error(code, std::string(call) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) +
                         " (" + call_site(file, line) + ")");
}

inline Error cublas_error(const char* call, cublasStatus_t s, const char* file, int line) {
  return Error(s == CUBLAS_STATUS_ALLOC_FAILED ? ErrorCode::kOutOfMemory : ErrorCode::kSystemError,
               std::string(call) + ": " + cublasGetStatusName(s) + ": " + cublasGetStatusString(s) +
                   " (" + call_site(file, line) + ")");
}

inline Error cudnn_error(const char* call, cudnnStatus_t s, const char* file, int line) {
  return Error(
      s == CUDNN_STATUS_ALLOC_FAILED ? ErrorCode::kOutOfMemory : ErrorCode::kSystemError,
      std::string(call) + ": " + cudnnGetErrorString(s) + " (" + call_site(file, line) + ")");
}

}  // namespace gpuq::gpu

#define GPUQ_CUDA(expr)                                                   \
  do {                                                                    \
    cudaError_t gpuq_e_ = (expr);                                         \
    if (gpuq_e_ != cudaSuccess)                                           \
      return ::gpuq::gpu::cuda_error(#expr, gpuq_e_, __FILE__, __LINE__); \
  } while (0)
#define GPUQ_CUBLAS(expr)                                                   \
  do {                                                                      \
    cublasStatus_t gpuq_s_ = (expr);                                        \
    if (gpuq_s_ != CUBLAS_STATUS_SUCCESS)                                   \
      return ::gpuq::gpu::cublas_error(#expr, gpuq_s_, __FILE__, __LINE__); \
  } while (0)
#define GPUQ_CUDNN(expr)                                                   \
  do {                                                                     \
    cudnnStatus_t gpuq_s_ = (expr);                                        \
    if (gpuq_s_ != CUDNN_STATUS_SUCCESS)                                   \
      return ::gpuq::gpu::cudnn_error(#expr, gpuq_s_, __FILE__, __LINE__); \
  } while (0)
