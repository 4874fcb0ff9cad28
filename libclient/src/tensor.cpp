// The tensor helpers of the client library: shapes, Tensor, result shapes and the JobSpec
// builders of the tensor ops (gpuq/tensor.hpp). The keys and their meaning are
// the contract of gpuq/common/tensor_ops.hpp; every JobSpec built here also passes the workers'
// parser (parse_tensor_op) before it is returned.
#include "gpuq/tensor.hpp"

#include <algorithm>
#include <cstdio>

#include "gpuq/common/assert.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/tensor_ops.hpp"

namespace gpuq {
namespace {

Error invalid(std::string_view op, std::string_view what, const std::string& message) {
  return Error(ErrorCode::kInvalidArgument,
               std::string(op) + ": " + std::string(what) + ": " + message);
}

std::string pair_string(const std::array<int64_t, 2>& v) {
  return std::to_string(v[0]) + "x" + std::to_string(v[1]);
}

// Checks each of `v` is at least `min`.
Result<void> check_pair(std::string_view op, std::string_view key, const std::array<int64_t, 2>& v,
                        int64_t min) {
  if (v[0] < min || v[1] < min || v[0] > kMaxTensorDim || v[1] > kMaxTensorDim) {
    return invalid(op, key,
                   pair_string(v) + " is out of range: each must be in [" + std::to_string(min) +
                       ", " + std::to_string(kMaxTensorDim) + "]");
  }
  return {};
}

Result<void> check_rank(std::string_view op, std::string_view what, const Shape& s, size_t min,
                        size_t max) {
  if (auto e = shape_elements(s, std::string(op) + ": " + std::string(what)); !e) {
    return std::move(e).error();
  }
  if (s.size() < min || s.size() > max) {
    std::string want =
        min == max ? std::to_string(min) : std::to_string(min) + " to " + std::to_string(max);
    return invalid(op, what,
                   "shape " + shape_string(s) + " has " + std::to_string(s.size()) +
                       " dimensions, the op needs " + want);
  }
  return {};
}

// The output extent of one spatial dimension: (in + 2 pad - span) / stride + 1, where span is
// the filter's or window's reach; an error when the padded input is shorter than the span.
Result<int64_t> output_extent(std::string_view op, std::string_view what, int64_t in, int64_t pad,
                              int64_t span, int64_t stride) {
  const int64_t padded = in + 2 * pad;
  if (padded < span) {
    return invalid(op, what,
                   "the padded input (" + std::to_string(in) + " + 2 x " + std::to_string(pad) +
                       " = " + std::to_string(padded) + ") is shorter than the " +
                       (op == "conv2d" ? "dilated filter (" : "window (") + std::to_string(span) +
                       "): the result would be empty");
  }
  return (padded - span) / stride + 1;
}

// Builds one tensor job: the input span over `operands`, their "_at" offsets, the params, the
// output span, and the checks every op shares (dtype, alignment, y's shape, overlap).
class JobBuilder {
 public:
  JobBuilder(std::string_view op, const Tensor& y) : op_(op), y_(y) { spec_.op = std::string(op); }

  // Operands in the op's documented order.
  void operand(std::string_view name, const Tensor& t) { operands_.push_back({name, &t}); }
  void text(std::string key, std::string value) {
    spec_.params.push_back(JobParam::text(std::move(key), std::move(value)));
  }
  void integer(std::string key, int64_t value) {
    spec_.params.push_back(JobParam::integer(std::move(key), value));
  }
  void real(std::string key, double value) {
    spec_.params.push_back(JobParam::real(std::move(key), value));
  }
  void pair_unless(std::string key, const std::array<int64_t, 2>& v,
                   const std::array<int64_t, 2>& fallback) {
    if (v != fallback) text(std::move(key), pair_string(v));
  }

  Result<JobSpec> build(const Shape& result) {
    const DType dtype = operands_.front().tensor->dtype();
    for (const Operand& o : operands_) {
      if (auto r = check_tensor(o.name, *o.tensor, dtype); !r) return std::move(r).error();
    }
    if (auto r = check_tensor("y", y_, dtype); !r) return std::move(r).error();
    if (y_.shape() != result) {
      return invalid(
          op_, "y",
          "shape " + shape_string(y_.shape()) + ", the result's is " + shape_string(result));
    }
    const uint64_t y_begin = y_.buffer().offset;
    const uint64_t y_end = y_begin + y_.bytes();
    for (const Operand& o : operands_) {
      const uint64_t begin = o.tensor->buffer().offset;
      const uint64_t end = begin + o.tensor->bytes();
      if (begin < y_end && y_begin < end) {
        return invalid(op_, "y",
                       "bytes [" + std::to_string(y_begin) + ", " + std::to_string(y_end) +
                           ") overlap operand " + std::string(o.name) + "'s [" +
                           std::to_string(begin) + ", " + std::to_string(end) + ")");
      }
    }
    if (dtype != DType::kF32) text("dtype", std::string(dtype_name(dtype)));

    // The input span: from the lowest operand to the end of the highest.
    const Operand* lowest = &operands_.front();
    uint64_t end = 0;
    for (const Operand& o : operands_) {
      if (o.tensor->buffer().offset < lowest->tensor->buffer().offset) lowest = &o;
      end = std::max(end, o.tensor->buffer().offset + o.tensor->bytes());
    }
    const Buffer& low = lowest->tensor->buffer();
    spec_.input = Buffer{low.offset, end - low.offset, low.ptr};
    // "_at" for each operand from the first one not where back-to-back packing puts it: the
    // same places under either reading of where a later default operand goes.
    uint64_t packed = 0;
    bool packing = true;
    for (const Operand& o : operands_) {
      const uint64_t at = o.tensor->buffer().offset - low.offset;
      packing = packing && at == packed;
      if (!packing) integer(std::string(o.name) + "_at", static_cast<int64_t>(at));
      packed += o.tensor->bytes();
    }
    spec_.output = y_.buffer().slice(0, y_.bytes());

    // The parameters must fit in one job's block; say so here, not at submit.
    ParamWriter writer;
    for (const JobParam& p : spec_.params) {
      ParamValue v;
      if (p.type == JobParam::Type::kInt) v = p.int_value;
      if (p.type == JobParam::Type::kFloat) v = p.float_value;
      if (p.type == JobParam::Type::kString) v = p.string_value;
      if (auto r = writer.add(p.key, v); !r) {
        return Error(ErrorCode::kInvalidArgument, op_ + ": " + r.error().message());
      }
    }
    // And the workers' own parser accepts them: what it would refuse is refused here.
    Result<ParamBlock> block = ParamBlock::parse(writer.data(), writer.size());
    if (!block) return std::move(block).error();
    const std::optional<tensor::OpKind> kind = tensor::op_kind_from_name(op_);
    GPUQ_ASSERT(kind.has_value());
    const tensor::JobBuffers buffers{spec_.input.offset, spec_.input.size, spec_.output.offset,
                                     spec_.output.size};
    Result<tensor::TensorOp> parsed = tensor::parse_tensor_op(*kind, block.value(), buffers);
    if (!parsed) return std::move(parsed).error();
    GPUQ_ASSERT(tensor::result_bytes(parsed.value()) == spec_.output.size);
    return std::move(spec_);
  }

 private:
  struct Operand {
    std::string_view name;
    const Tensor* tensor;
  };

  Result<void> check_tensor(std::string_view name, const Tensor& t, DType dtype) {
    if (t.elements() == 0) return invalid(op_, name, "an empty Tensor (use Tensor::make)");
    if (t.dtype() != dtype) {
      return invalid(op_, name,
                     "dtype " + std::string(dtype_name(t.dtype())) + ", the operand " +
                         std::string(operands_.front().name) + " is " +
                         std::string(dtype_name(dtype)) + " (every operand and y share one)");
    }
    if (t.buffer().offset % dtype_bytes(dtype) != 0) {
      return invalid(op_, name,
                     "offset " + std::to_string(t.buffer().offset) +
                         " in the segment is not a "
                         "multiple of the element size " +
                         std::to_string(dtype_bytes(dtype)));
    }
    return {};
  }

  std::string op_;
  const Tensor& y_;
  std::vector<Operand> operands_;
  JobSpec spec_;
};

}  // namespace

// ---- Shapes and Tensor ----

std::string shape_string(const Shape& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += 'x';
    s += std::to_string(shape[i]);
  }
  return s;
}

Result<uint64_t> shape_elements(const Shape& shape, std::string_view what) {
  const std::string w(what);
  if (shape.empty() || shape.size() > kMaxTensorRank) {
    return Error(ErrorCode::kInvalidArgument,
                 w + ": shape '" + shape_string(shape) + "' has " + std::to_string(shape.size()) +
                     " dimensions, must have 1 to " + std::to_string(kMaxTensorRank));
  }
  uint64_t elements = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1 || shape[i] > kMaxTensorDim) {
      return Error(ErrorCode::kInvalidArgument, w + ": shape " + shape_string(shape) +
                                                    ": dimension " + std::to_string(i) + " is " +
                                                    std::to_string(shape[i]) + ", must be in [1, " +
                                                    std::to_string(kMaxTensorDim) + "]");
    }
    elements *= static_cast<uint64_t>(shape[i]);  // at most 2^48 x 2^31: no overflow
    if (elements > kMaxTensorElements) {
      return Error(ErrorCode::kInvalidArgument,
                   w + ": shape " + shape_string(shape) + " has more than 2^48 elements");
    }
  }
  return elements;
}

uint64_t shape_bytes(const Shape& shape, DType dtype) noexcept {
  if (shape.empty() || shape.size() > kMaxTensorRank) return 0;
  uint64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 1 || d > kMaxTensorDim) return 0;
    elements *= static_cast<uint64_t>(d);
    if (elements > kMaxTensorElements) return 0;
  }
  const uint64_t bytes = elements * dtype_bytes(dtype);
  return bytes > kMaxTensorElements ? 0 : bytes;
}

Result<Tensor> Tensor::make(const Buffer& buffer, Shape shape, DType dtype) {
  Result<uint64_t> elements = shape_elements(shape, "tensor");
  if (!elements) return std::move(elements).error();
  const uint64_t bytes = elements.value() * dtype_bytes(dtype);
  if (bytes > kMaxTensorElements) {
    return Error(ErrorCode::kInvalidArgument, "tensor: a " + std::string(dtype_name(dtype)) + " " +
                                                  shape_string(shape) +
                                                  " tensor has more than 2^48 bytes");
  }
  if (buffer.size < bytes) {
    return Error(ErrorCode::kInvalidArgument,
                 "tensor: a " + std::string(dtype_name(dtype)) + " " + shape_string(shape) +
                     " tensor needs " + std::to_string(bytes) + " bytes, the buffer has " +
                     std::to_string(buffer.size));
  }
  return Tensor(buffer, std::move(shape), dtype, elements.value());
}

std::string_view activation_mode_name(ActivationMode mode) noexcept {
  switch (mode) {
    case ActivationMode::kRelu:
      return "relu";
    case ActivationMode::kSigmoid:
      return "sigmoid";
    case ActivationMode::kTanh:
      return "tanh";
  }
  return "relu";
}

std::string_view pool_mode_name(PoolMode mode) noexcept {
  return mode == PoolMode::kAvg ? "avg" : "max";
}

// ---- Result shapes ----

Result<Shape> conv2d_result_shape(const Shape& x, const Shape& w, const Conv2dOptions& o) {
  constexpr std::string_view op = "conv2d";
  if (auto r = check_rank(op, "x", x, 4, 4); !r) return std::move(r).error();
  if (auto r = check_rank(op, "w", w, 4, 4); !r) return std::move(r).error();
  if (auto r = check_pair(op, "stride", o.stride, 1); !r) return std::move(r).error();
  if (auto r = check_pair(op, "pad", o.pad, 0); !r) return std::move(r).error();
  if (auto r = check_pair(op, "dilation", o.dilation, 1); !r) return std::move(r).error();
  const int64_t c = x[1], k = w[0];
  if (o.groups < 1 || c % o.groups != 0 || k % o.groups != 0) {
    return invalid(op, "groups",
                   std::to_string(o.groups) + " must be >= 1 and divide C (" + std::to_string(c) +
                       ") and K (" + std::to_string(k) + ")");
  }
  if (w[1] != c / o.groups) {
    return invalid(op, "w",
                   "shape " + shape_string(w) + ": dimension 1 is " + std::to_string(w[1]) +
                       ", must be C / groups = " + std::to_string(c) + " / " +
                       std::to_string(o.groups) + " = " + std::to_string(c / o.groups) + " (x is " +
                       shape_string(x) + ")");
  }
  Shape y{x[0], k, 0, 0};
  for (int i = 0; i < 2; ++i) {
    const int64_t span = o.dilation[i] * (w[2 + i] - 1) + 1;
    Result<int64_t> e =
        output_extent(op, i == 0 ? "H" : "W", x[2 + i], o.pad[i], span, o.stride[i]);
    if (!e) return std::move(e).error();
    y[2 + i] = e.value();
  }
  return y;
}

Result<Shape> pool2d_result_shape(const Shape& x, const Pool2dOptions& o) {
  constexpr std::string_view op = "pool2d";
  if (auto r = check_rank(op, "x", x, 4, 4); !r) return std::move(r).error();
  if (auto r = check_pair(op, "window", o.window, 1); !r) return std::move(r).error();
  const std::array<int64_t, 2> stride = o.stride.value_or(o.window);
  if (auto r = check_pair(op, "stride", stride, 1); !r) return std::move(r).error();
  if (auto r = check_pair(op, "pad", o.pad, 0); !r) return std::move(r).error();
  if (o.pad[0] >= o.window[0] || o.pad[1] >= o.window[1]) {
    return invalid(op, "pad",
                   pair_string(o.pad) + " must be less than the window " + pair_string(o.window));
  }
  Shape y{x[0], x[1], 0, 0};
  for (int i = 0; i < 2; ++i) {
    Result<int64_t> e =
        output_extent(op, i == 0 ? "H" : "W", x[2 + i], o.pad[i], o.window[i], stride[i]);
    if (!e) return std::move(e).error();
    y[2 + i] = e.value();
  }
  return y;
}

Result<Shape> gemm_result_shape(const Shape& a, const Shape& b, const GemmOptions& o) {
  constexpr std::string_view op = "gemm";
  if (auto r = check_rank(op, "a", a, 2, 2); !r) return std::move(r).error();
  if (auto r = check_rank(op, "b", b, 2, 2); !r) return std::move(r).error();
  const int64_t m = o.trans_a ? a[1] : a[0], ka = o.trans_a ? a[0] : a[1];
  const int64_t kb = o.trans_b ? b[1] : b[0], n = o.trans_b ? b[0] : b[1];
  if (ka != kb) {
    return invalid(op, "b",
                   "op(a) is " + std::to_string(m) + "x" + std::to_string(ka) + " (a " +
                       shape_string(a) + (o.trans_a ? ", transposed" : "") + "), op(b) is " +
                       std::to_string(kb) + "x" + std::to_string(n) + " (b " + shape_string(b) +
                       (o.trans_b ? ", transposed" : "") + "): K differs");
  }
  return Shape{m, n};
}

// ---- Builders ----

Result<JobSpec> conv2d_job(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                           const Tensor& y, const Conv2dOptions& options) {
  Result<Shape> result = conv2d_result_shape(x.shape(), w.shape(), options);
  if (!result) return std::move(result).error();
  JobBuilder job("conv2d", y);
  job.operand("x", x);
  job.operand("w", w);
  job.text("x", shape_string(x.shape()));
  job.text("w", shape_string(w.shape()));
  if (b) {
    const int64_t k = w.shape()[0];
    if (b->elements() != static_cast<uint64_t>(k)) {
      return invalid("conv2d", "b",
                     "shape " + shape_string(b->shape()) + " has " + std::to_string(b->elements()) +
                         " elements, must have K = " + std::to_string(k));
    }
    job.operand("b", *b);
    job.text("b", std::to_string(k));
  }
  job.pair_unless("stride", options.stride, {1, 1});
  job.pair_unless("pad", options.pad, {0, 0});
  job.pair_unless("dilation", options.dilation, {1, 1});
  if (options.groups != 1) job.integer("groups", options.groups);
  if (options.relu) job.integer("relu", 1);
  return job.build(result.value());
}

Result<JobSpec> activation_job(const Tensor& x, const Tensor& y, ActivationMode mode) {
  if (auto r = check_rank("activation", "x", x.shape(), 1, 4); !r) return std::move(r).error();
  JobBuilder job("activation", y);
  job.operand("x", x);
  job.text("x", shape_string(x.shape()));
  job.text("mode", std::string(activation_mode_name(mode)));
  return job.build(x.shape());
}

Result<JobSpec> softmax_job(const Tensor& x, const Tensor& y, const SoftmaxOptions& options) {
  if (auto r = check_rank("softmax", "x", x.shape(), 2, 4); !r) return std::move(r).error();
  JobBuilder job("softmax", y);
  job.operand("x", x);
  job.text("x", shape_string(x.shape()));
  if (options.log) job.integer("log", 1);
  return job.build(x.shape());
}

Result<JobSpec> pool2d_job(const Tensor& x, const Tensor& y, const Pool2dOptions& options) {
  Result<Shape> result = pool2d_result_shape(x.shape(), options);
  if (!result) return std::move(result).error();
  JobBuilder job("pool2d", y);
  job.operand("x", x);
  job.text("x", shape_string(x.shape()));
  job.text("mode", std::string(pool_mode_name(options.mode)));
  job.text("window", pair_string(options.window));
  if (options.stride) job.pair_unless("stride", *options.stride, options.window);
  job.pair_unless("pad", options.pad, {0, 0});
  if (options.count_pad) job.integer("count_pad", 1);
  return job.build(result.value());
}

Result<JobSpec> batchnorm_job(const Tensor& x, const Tensor& scale, const Tensor& bias,
                              const Tensor& mean, const Tensor& var, const Tensor& y,
                              const BatchNormOptions& options) {
  constexpr std::string_view op = "batchnorm";
  const Shape& s = x.shape();
  if (auto r = check_rank(op, "x", s, 2, 4); !r) return std::move(r).error();
  if (s.size() == 3) {
    return invalid(op, "x", "shape " + shape_string(s) + " must be NxCxHxW or NxC");
  }
  if (!(options.eps > 0)) {
    char text[64];
    std::snprintf(text, sizeof text, "%g must be > 0", options.eps);
    return invalid(op, "eps", text);
  }
  JobBuilder job(op, y);
  job.operand("x", x);
  job.text("x", shape_string(s));
  const std::pair<std::string_view, const Tensor*> channels[] = {
      {"scale", &scale}, {"bias", &bias}, {"mean", &mean}, {"var", &var}};
  for (const auto& [name, t] : channels) {
    if (t->elements() != static_cast<uint64_t>(s[1])) {
      return invalid(op, name,
                     "shape " + shape_string(t->shape()) + " has " + std::to_string(t->elements()) +
                         " elements, must have C = " + std::to_string(s[1]) + " (x is " +
                         shape_string(s) + ")");
    }
    job.operand(name, *t);
  }
  if (options.eps != 1e-5) job.real("eps", options.eps);
  if (options.relu) job.integer("relu", 1);
  return job.build(s);
}

Result<JobSpec> gemm_job(const Tensor& a, const Tensor& b, const std::optional<Tensor>& c,
                         const Tensor& y, const GemmOptions& options) {
  constexpr std::string_view op = "gemm";
  Result<Shape> result = gemm_result_shape(a.shape(), b.shape(), options);
  if (!result) return std::move(result).error();
  if (options.beta != 0 && !c) {
    return invalid(op, "c", "beta is " + std::to_string(options.beta) + ": c must be given");
  }
  if (options.beta == 0 && c) {
    return invalid(op, "c", "given while beta is 0 (c is read only when beta != 0)");
  }
  JobBuilder job(op, y);
  job.operand("a", a);
  job.operand("b", b);
  job.text("a", shape_string(a.shape()));
  job.text("b", shape_string(b.shape()));
  if (c) {
    if (c->shape() != result.value()) {
      return invalid(op, "c",
                     "shape " + shape_string(c->shape()) +
                         ", must be M x N = " + shape_string(result.value()));
    }
    job.operand("c", *c);
    job.text("c", shape_string(c->shape()));
  }
  if (options.trans_a) job.integer("trans_a", 1);
  if (options.trans_b) job.integer("trans_b", 1);
  if (options.alpha != 1.0) job.real("alpha", options.alpha);
  if (options.beta != 0.0) job.real("beta", options.beta);
  return job.build(result.value());
}

}  // namespace gpuq
