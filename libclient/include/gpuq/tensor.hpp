// Tensors in a client's payload segment and the options of the catalog's tensor ops (conv2d,
// activation, softmax, pool2d, batchnorm, gemm), and the builders conv2d_job() and the others,
// which return an op's JobSpec without submitting it. The calls that submit them are in
// gpuq/client.hpp: Client::conv2d() and the others. docs/ops.md is the reference of the ops;
// their parameter keys are the ones docs/ops.md lists.
//
//   auto xb = client->allocate(1 * 3 * 8 * 8 * 4);
//   auto wb = client->allocate(4 * 3 * 3 * 3 * 4);
//   auto x = gpuq::Tensor::make(*xb, {1, 3, 8, 8});          // f32 by default
//   auto w = gpuq::Tensor::make(*wb, {4, 3, 3, 3});
//   gpuq::Conv2dOptions opts;
//   opts.pad = {1, 1};
//   auto shape = gpuq::conv2d_result_shape(x->shape(), w->shape(), opts);   // 1x4x8x8
//   auto yb = client->allocate(gpuq::shape_bytes(*shape, gpuq::DType::kF32));
//   auto y = gpuq::Tensor::make(*yb, *shape);
//   auto job = client->conv2d(*x, *w, std::nullopt, *y, opts);   // Result<Job>
//
// Conventions: tensors are dense and row-major, NCHW for 4-D ones; a shape has 1 to 4
// dimensions, each in [1, 2^31 - 1], and at most 2^48 elements and bytes. Every operand of a
// job and its result share one dtype. Everything here is a value type; the functions are pure
// and thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpuq/buffer.hpp"
#include "gpuq/error.hpp"
#include "gpuq/export.hpp"
#include "gpuq/job_spec.hpp"

namespace gpuq {

// Element type. CPU pools run kF32 only; GPU pools run both.
enum class DType : uint8_t { kF32 = 1, kF16 = 2 };

constexpr uint64_t dtype_bytes(DType t) noexcept {
  return t == DType::kF16 ? 2 : 4;
}
// "f32", "f16": the value of the ops' "dtype" parameter.
constexpr std::string_view dtype_name(DType t) noexcept {
  return t == DType::kF16 ? "f16" : "f32";
}

// Dimensions, outermost first: {N, C, H, W}.
using Shape = std::vector<int64_t>;

inline constexpr size_t kMaxTensorRank = 4;
inline constexpr int64_t kMaxTensorDim = (int64_t{1} << 31) - 1;
inline constexpr uint64_t kMaxTensorElements = uint64_t{1} << 48;

// "2x3x32x32", the form the ops' shape parameters take. "" for an empty shape.
GPUQ_API std::string shape_string(const Shape& shape);

// The number of elements of `shape`. Errors: InvalidArgument (rank not 1..4, a dimension
// outside [1, 2^31 - 1], more than 2^48 elements or bytes of `dtype`); `what` names the
// tensor in the message.
GPUQ_API Result<uint64_t> shape_elements(const Shape& shape, std::string_view what = "shape");

// elements x dtype_bytes, or 0 when the shape is invalid (see shape_elements).
GPUQ_API uint64_t shape_bytes(const Shape& shape, DType dtype) noexcept;

// A typed view of (the start of) a Buffer: the tensor's bytes are the first elements() x
// dtype_bytes(dtype()) bytes of buffer(). Copies share the memory. A value type.
class GPUQ_API Tensor {
 public:
  Tensor() = default;

  // Errors: InvalidArgument when the shape is invalid (see shape_elements) or `buffer` is
  // smaller than the shape's bytes; the message gives both sizes.
  static Result<Tensor> make(const Buffer& buffer, Shape shape, DType dtype = DType::kF32);

  const Buffer& buffer() const noexcept { return buffer_; }
  const Shape& shape() const noexcept { return shape_; }
  DType dtype() const noexcept { return dtype_; }
  uint64_t elements() const noexcept { return elements_; }
  uint64_t bytes() const noexcept { return elements_ * dtype_bytes(dtype_); }
  std::byte* data() const noexcept { return buffer_.ptr; }
  // The elements as T (float for kF32; a 16-bit type such as uint16_t for kF16).
  template <typename T>
  T* data_as() const noexcept {
    return reinterpret_cast<T*>(buffer_.ptr);
  }

 private:
  Tensor(const Buffer& buffer, Shape shape, DType dtype, uint64_t elements)
      : buffer_(buffer), shape_(std::move(shape)), dtype_(dtype), elements_(elements) {}

  Buffer buffer_;
  Shape shape_;
  DType dtype_ = DType::kF32;
  uint64_t elements_ = 0;
};

// ---- Op options. Defaults are the ops' defaults; a parameter at its default is not sent. ----

// y = conv(x, w) (+ b) (then ReLU). x: N x C x H x W; w: K x C/groups x R x S; b: K.
// y: N x K x OH x OW, OH = (H + 2 pad[0] - dilation[0] (R - 1) - 1) / stride[0] + 1, OW alike.
struct Conv2dOptions {
  std::array<int64_t, 2> stride{1, 1};    // >= 1
  std::array<int64_t, 2> pad{0, 0};       // >= 0
  std::array<int64_t, 2> dilation{1, 1};  // >= 1
  int64_t groups = 1;                     // divides C and K
  bool relu = false;
};

enum class ActivationMode : uint8_t { kRelu, kSigmoid, kTanh };
// "relu", "sigmoid", "tanh": the value of activation's "mode" parameter.
GPUQ_API std::string_view activation_mode_name(ActivationMode mode) noexcept;

// Softmax over dimension 1 (C of NCHW; the row of an N x C matrix). x: rank 2 to 4.
struct SoftmaxOptions {
  bool log = false;  // log-softmax
};

enum class PoolMode : uint8_t { kMax, kAvg };
// "max", "avg": the value of pool2d's "mode" parameter.
GPUQ_API std::string_view pool_mode_name(PoolMode mode) noexcept;

// x: N x C x H x W. y: N x C x OH x OW, OH = (H + 2 pad[0] - window[0]) / stride[0] + 1.
struct Pool2dOptions {
  PoolMode mode = PoolMode::kMax;
  std::array<int64_t, 2> window{1, 1};           // >= 1
  std::optional<std::array<int64_t, 2>> stride;  // >= 1; default: the window
  std::array<int64_t, 2> pad{0, 0};              // >= 0, less than the window
  bool count_pad = false;  // avg: divide by the whole window, padding included
};

// Inference batch normalization, per channel: y = scale (x - mean) / sqrt(var + eps) + bias.
// x: N x C x H x W or N x C; scale, bias, mean, var: C elements each. y: x's shape.
struct BatchNormOptions {
  double eps = 1e-5;  // > 0
  bool relu = false;
};

// y = alpha op(a) op(b) + beta c, row-major; op(a) is M x K, op(b) K x N, y and c M x N.
// c is given exactly when beta != 0.
struct GemmOptions {
  bool trans_a = false;
  bool trans_b = false;
  double alpha = 1.0;
  double beta = 0.0;
};

// ---- Result shapes: the same checks as the ops make, without a daemon. ----
// Errors: InvalidArgument, "<op>: <key>: <what is wrong>", naming the values involved.

GPUQ_API Result<Shape> conv2d_result_shape(const Shape& x, const Shape& w,
                                           const Conv2dOptions& options = {});
GPUQ_API Result<Shape> pool2d_result_shape(const Shape& x, const Pool2dOptions& options);
GPUQ_API Result<Shape> gemm_result_shape(const Shape& a, const Shape& b,
                                         const GemmOptions& options = {});
// activation, softmax and batchnorm: y has x's shape.

// ---- Builders (docs/ops.md) --------------------------------------------------------------------
// Each builder makes the JobSpec of one tensor op without submitting it (set spec.pool,
// expire_after or retryable, then Client::submit it), so that it can be checked without a
// daemon. The job's input span is the smallest range of the segment that covers every
// operand; each operand not where back-to-back packing from the span's start would put it is
// placed with its "<operand>_at" parameter. The output span is y's bytes. Parameters at their
// defaults (and dtype f32) are left out, to stay within the 192 parameter bytes.
// Errors, all before anything is submitted: InvalidArgument, "<op>: <operand or key>: <what is
// wrong>": an invalid or inconsistent shape, y's shape not the result's, operands of different
// dtypes, an operand not aligned to its element size, y overlapping an operand, an option out
// of range, or parameters over 192 bytes. Pure functions; thread-safe.

GPUQ_API Result<JobSpec> conv2d_job(const Tensor& x, const Tensor& w,
                                    const std::optional<Tensor>& b, const Tensor& y,
                                    const Conv2dOptions& options = {});
GPUQ_API Result<JobSpec> activation_job(const Tensor& x, const Tensor& y, ActivationMode mode);
GPUQ_API Result<JobSpec> softmax_job(const Tensor& x, const Tensor& y,
                                     const SoftmaxOptions& options = {});
GPUQ_API Result<JobSpec> pool2d_job(const Tensor& x, const Tensor& y, const Pool2dOptions& options);
GPUQ_API Result<JobSpec> batchnorm_job(const Tensor& x, const Tensor& scale, const Tensor& bias,
                                       const Tensor& mean, const Tensor& var, const Tensor& y,
                                       const BatchNormOptions& options = {});
GPUQ_API Result<JobSpec> gemm_job(const Tensor& a, const Tensor& b, const std::optional<Tensor>& c,
                                  const Tensor& y, const GemmOptions& options = {});

}  // namespace gpuq
