// The GPU worker's backend (gpuq-gpu-worker). One CUDA context for the worker's whole life, on
// the only device the worker sees (gpuqd sets CUDA_VISIBLE_DEVICES to its GPU's UUID): a
// non-blocking stream, cuDNN and cuBLAS handles bound to it, and a device memory pool with a
// budget (the gpu pool's memory_limit), all made once in start().
//
// Jobs: the built-in ops run on the host as on a CPU worker; the catalog's tensor ops
// (gpuq/common/tensor_ops.hpp) copy their input buffer to the device from the client's
// registered (pinned) segment, run on cuDNN or cuBLAS, and copy the result back. A tensor job's
// result value is 1 when both copies ran from pinned memory, 0 when the segment could not be
// registered (pageable copies).
//
// Errors: a job beyond the budget, cudaErrorMemoryAllocation, CUDNN_STATUS_ALLOC_FAILED or
// CUBLAS_STATUS_ALLOC_FAILED fail the job with OutOfMemory, and the worker keeps serving. A
// sticky CUDA error (is_sticky_cuda_error) fails the job with the CUDA error's text, and
// must_exit() turns true: the worker exits 3 and gpuqd starts a fresh one.
//
// Not thread-safe: the worker runs one job at a time on one thread.
#pragma once

#include "op_backend.hpp"
#include "worker_loop.hpp"

namespace gpuq::daemon {

// The process's GPU backend, made for `options` (memory limit) on the first call.
OpBackend& gpu_backend(const WorkerOptions& options);

}  // namespace gpuq::daemon
