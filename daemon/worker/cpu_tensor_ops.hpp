// The catalog's tensor ops on the CPU worker (gpuq-worker): oneDNN primitives in f32, run on the
// calling thread. Built from cpu_tensor_ops.cpp where the build has oneDNN
// (GPUQ_WITH_ONEDNN), else from cpu_tensor_ops_none.cpp, whose ops all fail "not in this build".
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <variant>

#include "gpuq/common/tensor_ops.hpp"
#include "gpuq/error.hpp"
#include "ops.hpp"

namespace gpuq::daemon {

// The backends name an op by its variant index: TensorOp's alternatives are in OpKind's order.
static_assert(
    std::is_same_v<std::variant_alternative_t<size_t(tensor::OpKind::kConv2d), tensor::TensorOp>,
                   tensor::Conv2d> &&
    std::is_same_v<
        std::variant_alternative_t<size_t(tensor::OpKind::kActivation), tensor::TensorOp>,
        tensor::ActivationOp> &&
    std::is_same_v<std::variant_alternative_t<size_t(tensor::OpKind::kSoftmax), tensor::TensorOp>,
                   tensor::Softmax> &&
    std::is_same_v<std::variant_alternative_t<size_t(tensor::OpKind::kPool2d), tensor::TensorOp>,
                   tensor::Pool2d> &&
    std::is_same_v<std::variant_alternative_t<size_t(tensor::OpKind::kBatchNorm), tensor::TensorOp>,
                   tensor::BatchNorm> &&
    std::is_same_v<std::variant_alternative_t<size_t(tensor::OpKind::kGemm), tensor::TensorOp>,
                   tensor::Gemm>);

// True when this build runs tensor ops on CPU pools.
bool cpu_tensor_ops_available() noexcept;

// Once per process, before the first op: makes oneDNN run on the calling thread only (its
// OpenMP runtime set to one thread; a worker is pinned to one CPU and runs one job at a time)
// and creates the CPU engine. Errors: OpFailed if oneDNN cannot create its engine. Not
// thread-safe; idempotent.
Result<void> cpu_tensor_ops_start();

// Runs a parsed and validated op (tensor::parse_tensor_op has checked every operand against
// the buffers) reading its operands from `input` and writing the result at `output`.
// Errors: InvalidArgument for f16 ("<op>: dtype: f16 is not supported on cpu pools ...");
// Cancelled if `cancel` is set before the primitive starts (a primitive is not interrupted);
// OpFailed if oneDNN refuses or fails (its message included); UnknownOp in a build without
// oneDNN. Not thread-safe (one worker thread).
Result<OpOutput> run_cpu_tensor_op(const tensor::TensorOp& op, const std::byte* input,
                                   std::byte* output, const std::atomic<uint32_t>& cancel);

}  // namespace gpuq::daemon
