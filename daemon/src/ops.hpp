// The op registry: every op a worker can run, looked up by id (from the job descriptor) or by
// name (for the op table the supervisor sends to clients). Built-in CPU ops: noop, echo, sleep,
// checksum; the catalog's tensor ops: conv2d, activation, softmax, pool2d, batchnorm, gemm
// (gpuq/common/tensor_ops.hpp), which each backend runs its own way. docs/ops.md documents each.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "gpuq/common/params.hpp"
#include "gpuq/common/tensor_ops.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

// What an op gets. The buffers are already validated to lie inside the client's arena.
struct OpContext {
  const std::byte* input;
  uint64_t input_bytes;
  std::byte* output;
  uint64_t output_capacity;
  const ParamBlock& params;
  const std::atomic<uint32_t>& cancel_requested;  // ops that loop poll it
  // Where the buffers start in the client's arena (both buffers are in the same one): what
  // an op needs to tell whether they overlap.
  uint64_t input_offset = 0;
  uint64_t output_offset = 0;
};

struct OpOutput {
  uint64_t output_bytes = 0;
  uint64_t value = 0;
};

using OpFunction = Result<OpOutput> (*)(const OpContext&);

struct OpInfo {
  uint32_t id;  // stable, part of the wire format; never reused
  const char* name;
  const char* summary;
  OpFunction run;  // the same on every pool; null for a tensor op
  // A catalog tensor op (gpuq/common/tensor_ops.hpp), which each backend implements its own
  // way (oneDNN on CPU pools, cuDNN and cuBLAS on GPU pools).
  std::optional<tensor::OpKind> tensor = std::nullopt;
};

// All registered ops, in id order. Thread-safe (immutable).
std::span<const OpInfo> op_registry();
// The op with this id, or nullptr.
const OpInfo* find_op(uint32_t id);

}  // namespace gpuq::daemon
