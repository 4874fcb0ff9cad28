// Fuzz target: a job descriptor written by an untrusted client, through the worker's validation
// (daemon/worker/job_validation.cpp) and, when it validates, through the op itself on a real heap
// arena of exactly the validated size. ASan reports any access outside that arena that the
// validator let through; the checks below report a validated range that overflows or leaves the
// arena, and an op that claims more output than its buffer holds.
//
// Input format: tests/fuzz/fuzz_inputs.hpp. Ops run with their cancel flag already set, so
// `sleep` returns at once whatever its "us" parameter (every op that waits polls the flag).
// A tensor op (conv2d, gemm, ...) is not run (each backend runs those its own way): its
// parameters go through the tensor-op parser, and every operand it accepts must lie inside the
// input buffer and its result inside the output buffer.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "fuzz/fuzz_inputs.hpp"
#include "gpuq/common/assert.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/tensor_ops.hpp"
#include "job_validation.hpp"
#include "ops.hpp"

namespace gpuq::fuzz {
namespace {

// [offset, offset + length) inside [0, arena), computed without trusting the validator's math.
bool inside(uint64_t offset, uint64_t length, uint64_t arena) {
  uint64_t end = 0;
  return !__builtin_add_overflow(offset, length, &end) && end <= arena;
}

void check_validated(const JobDescriptor& d, uint64_t arena,
                     const Result<daemon::ValidatedJob>& v) {
  if (!v) {
    const ErrorCode code = v.error().code();
    GPUQ_ASSERT(code == ErrorCode::kInvalidArgument || code == ErrorCode::kUnknownOp);
    GPUQ_ASSERT(!v.error().message().empty());
    return;
  }
  GPUQ_ASSERT(v->op != nullptr && v->op->id == d.op_id);
  GPUQ_ASSERT(v->input_offset == d.input_offset && v->input_bytes == d.input_bytes);
  GPUQ_ASSERT(v->output_offset == d.output_offset && v->output_capacity == d.output_capacity);
  GPUQ_ASSERT(inside(v->input_offset, v->input_bytes, arena));
  GPUQ_ASSERT(inside(v->output_offset, v->output_capacity, arena));
  GPUQ_ASSERT(d.params_bytes <= kMaxParamBytes);
}

// A tensor op's parameters against the validated buffers: what the parser accepts must be safe
// for a backend to read and write.
void check_tensor_op(const daemon::ValidatedJob& v) {
  const tensor::JobBuffers buffers{v.input_offset, v.input_bytes, v.output_offset,
                                   v.output_capacity};
  auto op = tensor::parse_tensor_op(*v.op->tensor, v.params, buffers);
  if (!op) {
    GPUQ_ASSERT(op.error().code() == ErrorCode::kInvalidArgument);
    GPUQ_ASSERT(!op.error().message().empty());
    return;
  }
  auto operand = [&](const tensor::Operand& o) {
    GPUQ_ASSERT(inside(o.offset, o.bytes, v.input_bytes));
    GPUQ_ASSERT(o.bytes == o.shape.elements() * tensor::dtype_bytes(tensor::result_dtype(*op)));
  };
  std::visit(
      [&](const auto& o) {
        using T = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<T, tensor::Conv2d>) {
          operand(o.x);
          operand(o.w);
          if (o.b) operand(*o.b);
        } else if constexpr (std::is_same_v<T, tensor::BatchNorm>) {
          for (const auto* x : {&o.x, &o.scale, &o.bias, &o.mean, &o.var}) operand(*x);
        } else if constexpr (std::is_same_v<T, tensor::Gemm>) {
          operand(o.a);
          operand(o.b);
          if (o.c) operand(*o.c);
        } else {
          operand(o.x);
        }
      },
      *op);
  GPUQ_ASSERT(tensor::result_bytes(*op) <= v.output_capacity);
}

void run(const uint8_t* data, size_t size) {
  // The descriptor, as the worker copies it out of the slot.
  JobDescriptor d;
  std::memset(&d, 0, sizeof d);
  std::memcpy(&d, data, size < sizeof d ? size : sizeof d);
  uint64_t arena_word = 0;
  if (size >= kArenaWordAt + sizeof arena_word) {
    std::memcpy(&arena_word, data + kArenaWordAt, sizeof arena_word);
  }
  const uint32_t pool = size > kPoolAt ? data[kPoolAt] : 0;

  // Bounds only, against an arena of any size up to 2^64 - 1 (overflow of offset + length).
  check_validated(d, arena_word, daemon::validate_descriptor(d, arena_word, pool));

  // For real, on an arena of exactly `arena_bytes` heap bytes: ASan catches a byte past it.
  const uint64_t arena_bytes = arena_word % (kMaxFuzzArenaBytes + 1);
  auto v = daemon::validate_descriptor(d, arena_bytes, pool);
  check_validated(d, arena_bytes, v);
  if (!v) return;
  if (v->op->run == nullptr) {
    // A tensor op; or gpu_fault_test, a GPU worker's test op: validated only.
    if (v->op->tensor) check_tensor_op(*v);
    return;
  }
  auto arena = std::make_unique<std::byte[]>(arena_bytes);  // zeroed
  if (size > kArenaContentAt) {
    const size_t n = size - kArenaContentAt;
    std::memcpy(arena.get(), data + kArenaContentAt, n < arena_bytes ? n : arena_bytes);
  }
  const std::atomic<uint32_t> cancel_requested{1};
  daemon::OpContext ctx{arena.get() + v->input_offset,
                        v->input_bytes,
                        arena.get() + v->output_offset,
                        v->output_capacity,
                        v->params,
                        cancel_requested};
  auto r = v->op->run(ctx);
  if (r) {
    GPUQ_ASSERT(r->output_bytes <= v->output_capacity);
  } else {
    GPUQ_ASSERT(r.error().code() != ErrorCode::kOk && !r.error().message().empty());
  }
}

}  // namespace
}  // namespace gpuq::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {  // NOLINT
  gpuq::fuzz::run(data, size);
  return 0;
}
