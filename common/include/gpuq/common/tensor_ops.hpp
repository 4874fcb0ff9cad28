// The catalog's tensor ops (conv2d, activation, softmax, pool2d, batchnorm, gemm): their
// parameters, parsed from a job's ParamBlock and validated against its buffers once, before
// anything runs. One parser for every side: the CPU worker (oneDNN), the GPU worker (cuDNN and
// cuBLAS), the client library, which writes the same keys, and gpuqctl. docs/ops.md is the
// user's reference; this header is the contract between those sides.
//
// Conventions
//   - Tensors are dense, row-major, NCHW for 4-D ones. A shape is written "2x3x32x32" (1 to 4
//     dimensions, each 1 .. 2^31 - 1); elements and bytes must fit in 2^48.
//   - dtype: "f32" (default) or "f16" (IEEE binary16). Every operand and the result share it.
//     CPU pools run f32 only and refuse f16 with InvalidArgument naming the pool kind.
//   - Operands lie in the job's input buffer, in the op's documented order, back to back by
//     default; "<operand>_at" (int) places one at a byte offset of the input buffer instead
//     (how the client library passes separate buffers without a copy). Each must be aligned to
//     its element size, lie wholly inside the input buffer and not overlap the output.
//   - The result is written at the start of the output buffer, whose capacity must hold it;
//     the job's output_bytes is the result's size in bytes.
//   - Errors are InvalidArgument, "<op>: <key>: <what is wrong>", naming the values involved.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "gpuq/common/params.hpp"
#include "gpuq/error.hpp"

namespace gpuq::tensor {

enum class DType : uint8_t { kF32 = 1, kF16 = 2 };
inline constexpr uint64_t dtype_bytes(DType t) noexcept {
  return t == DType::kF16 ? 2 : 4;
}
const char* dtype_name(DType t) noexcept;  // "f32", "f16"

inline constexpr int kMaxRank = 4;
inline constexpr uint64_t kMaxElements = uint64_t{1} << 48;

struct Shape {
  int rank = 0;
  int64_t dims[kMaxRank] = {};

  uint64_t elements() const noexcept;
  std::string to_string() const;  // "2x3x32x32"
  bool operator==(const Shape& o) const noexcept;
};

// Parses "AxBxC" (1..kMaxRank positive dimensions). `what` names the key in errors.
Result<Shape> parse_shape(std::string_view text, std::string_view what);

// An operand in the input buffer.
struct Operand {
  Shape shape;
  uint64_t offset = 0;  // bytes from the start of the input buffer
  uint64_t bytes = 0;   // elements x dtype size
};

enum class Activation : uint8_t { kRelu, kSigmoid, kTanh };
enum class PoolMode : uint8_t { kMax, kAvg };

// y = conv(x, w) (+ b) (then ReLU). Keys: x "NxCxHxW", w "KxC/groups x R x S", b "K"
// (optional; its presence adds the operand), stride "SHxSW" (default 1x1), pad "PHxPW"
// (default 0x0), dilation "DHxDW" (default 1x1), groups (int, default 1; divides C and K),
// relu (int 0/1, default 0). Operands in order: x, w, b. y: N x K x OH x OW with
// OH = (H + 2 PH - DH (R - 1) - 1) / SH + 1 (at least 1, else an error), OW alike.
struct Conv2d {
  DType dtype = DType::kF32;
  Operand x, w;
  std::optional<Operand> b;
  int64_t stride[2] = {1, 1}, pad[2] = {0, 0}, dilation[2] = {1, 1};
  int64_t groups = 1;
  bool relu = false;
  Shape y;
};

// y = f(x) elementwise. Keys: x (any rank), mode "relu" | "sigmoid" | "tanh". y: x's shape.
struct ActivationOp {
  DType dtype = DType::kF32;
  Activation mode = Activation::kRelu;
  Operand x;
  Shape y;
};

// Softmax over dimension 1 (C of NCHW; the row of an NxC matrix), for each other index.
// Keys: x (rank 2 to 4), log (int 0/1, default 0: log-softmax). y: x's shape.
struct Softmax {
  DType dtype = DType::kF32;
  Operand x;
  bool log = false;
  Shape y;
};

// Keys: x "NxCxHxW", mode "max" | "avg", window "RxS", stride (default: the window), pad
// (default 0x0; each less than the window), count_pad (int 0/1, default 0: an average over
// the cells inside the input only). y: N x C x OH x OW, OH = (H + 2 PH - R) / SH + 1.
struct Pool2d {
  DType dtype = DType::kF32;
  PoolMode mode = PoolMode::kMax;
  Operand x;
  int64_t window[2] = {1, 1}, stride[2] = {1, 1}, pad[2] = {0, 0};
  bool count_pad = false;
  Shape y;
};

// Inference batch normalization: y = scale (x - mean) / sqrt(var + eps) + bias, per channel.
// Keys: x "NxCxHxW" (or NxC), eps (float, default 1e-5, > 0), relu (int 0/1, default 0).
// Operands in order: x, scale, bias, mean, var (each C elements). y: x's shape.
struct BatchNorm {
  DType dtype = DType::kF32;
  Operand x, scale, bias, mean, var;
  double eps = 1e-5;
  bool relu = false;
  Shape y;
};

// y = alpha op(a) op(b) + beta c, row-major. Keys: a (2-D, as stored), b (2-D, as stored),
// trans_a, trans_b (int 0/1, default 0), alpha (float, default 1), beta (float, default 0),
// c "MxN" (required when beta != 0, refused otherwise). Operands in order: a, b, c.
// op(a) is M x K, op(b) is K x N; y: M x N.
struct Gemm {
  DType dtype = DType::kF32;
  Operand a, b;
  std::optional<Operand> c;
  bool trans_a = false, trans_b = false;
  double alpha = 1.0, beta = 0.0;
  int64_t m = 0, n = 0, k = 0;
  Shape y;
};

using TensorOp = std::variant<Conv2d, ActivationOp, Softmax, Pool2d, BatchNorm, Gemm>;

enum class OpKind : uint8_t { kConv2d, kActivation, kSoftmax, kPool2d, kBatchNorm, kGemm };
const char* op_kind_name(OpKind k) noexcept;  // "conv2d", ...
std::optional<OpKind> op_kind_from_name(std::string_view name) noexcept;

// Where the job's buffers are, as far as validation needs to know: sizes, and the output's
// place relative to the input (both are offsets in the same client arena), for the overlap
// check.
struct JobBuffers {
  uint64_t input_offset = 0, input_bytes = 0;
  uint64_t output_offset = 0, output_capacity = 0;
};

// Parses and validates op `kind`'s parameters against the job's buffers: every key typed and
// in range, unknown keys refused (a misspelt "strides" must not be silently ignored), shapes
// consistent, operands inside the input buffer and clear of the output, the result within the
// output capacity.
Result<TensorOp> parse_tensor_op(OpKind kind, const ParamBlock& params, const JobBuffers& buffers);

// The result's shape and size in bytes.
const Shape& result_shape(const TensorOp& op) noexcept;
DType result_dtype(const TensorOp& op) noexcept;
uint64_t result_bytes(const TensorOp& op) noexcept;

}  // namespace gpuq::tensor
