// The tensor ops' parameter parser and validator (gpuq/common/tensor_ops.hpp). Every check is
// done here, once, before a backend sees the op: a backend may trust every field of the spec.
#include "gpuq/common/tensor_ops.hpp"

#include <array>
#include <charconv>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <vector>

namespace gpuq::tensor {
namespace {

constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

// Assigns the value of Result `expr` to `lhs`, or returns its error from the enclosing function.
#define GPUQ_TENSOR_TRY(lhs, expr)        \
  do {                                    \
    auto gpuq_r_ = (expr);                \
    if (!gpuq_r_) return gpuq_r_.error(); \
    lhs = std::move(gpuq_r_.value());     \
  } while (0)
#define GPUQ_TENSOR_CHECK(expr)           \
  do {                                    \
    auto gpuq_r_ = (expr);                \
    if (!gpuq_r_) return gpuq_r_.error(); \
  } while (0)

std::string str(int64_t v) {
  return std::to_string(v);
}
std::string ustr(uint64_t v) {
  return std::to_string(v);
}

// a * b, or nullopt if it does not fit in 64 bits.
std::optional<uint64_t> mul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// Parses an unsigned decimal integer that fills `text` exactly (no sign, no spaces).
std::optional<int64_t> parse_dim(std::string_view text) {
  if (text.empty() || text.size() > 19) return std::nullopt;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  int64_t v = 0;
  auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size()) return std::nullopt;
  return v;
}

// Splits "AxBxC" at 'x'; nullopt if any part is not a non-negative integer or there are more
// than kMaxRank parts.
std::optional<std::vector<int64_t>> split_dims(std::string_view text) {
  std::vector<int64_t> out;
  size_t start = 0;
  for (;;) {
    size_t x = text.find('x', start);
    std::string_view part =
        text.substr(start, x == std::string_view::npos ? std::string_view::npos : x - start);
    auto d = parse_dim(part);
    if (!d) return std::nullopt;
    out.push_back(*d);
    if (static_cast<int>(out.size()) > kMaxRank) return std::nullopt;
    if (x == std::string_view::npos) break;
    start = x + 1;
  }
  return out;
}

// Parses and validates one op's parameters: remembers the op's name for errors, the dtype, the
// buffers and where the next back-to-back operand goes.
class OpParser {
 public:
  OpParser(OpKind kind, const ParamBlock& params, const JobBuffers& buffers)
      : op_(op_kind_name(kind)), params_(params), buffers_(buffers) {}

  DType dtype() const { return dtype_; }

  Error error(std::string_view key, const std::string& what) const {
    return Error(ErrorCode::kInvalidArgument, op_ + ": " + std::string(key) + ": " + what);
  }

  // Refuses a key outside `allowed` (or outside the operands' "_at" keys) and a key given
  // twice; reads dtype.
  Result<void> start(std::initializer_list<std::string_view> allowed,
                     std::initializer_list<std::string_view> operands) {
    const auto& entries = params_.entries();
    for (size_t i = 0; i < entries.size(); ++i) {
      const std::string& key = entries[i].key;
      bool known = key == "dtype";
      for (auto a : allowed) known = known || key == a;
      for (auto o : operands) known = known || key == std::string(o) + "_at";
      if (!known) {
        std::string list = "dtype";
        for (auto a : allowed) list += ", " + std::string(a);
        for (auto o : operands) list += ", " + std::string(o) + "_at";
        return error(key, "unknown key (" + op_ + " takes " + list + ")");
      }
      for (size_t j = 0; j < i; ++j) {
        if (entries[j].key == key) return error(key, "given twice");
      }
    }
    auto t = string("dtype");
    if (!t) return t.error();
    if (t->has_value()) {
      if (**t == "f32") {
        dtype_ = DType::kF32;
      } else if (**t == "f16") {
        dtype_ = DType::kF16;
      } else {
        return error("dtype", "'" + **t + "' is not a dtype (f32 or f16)");
      }
    }
    return {};
  }

  bool has(std::string_view key) const { return params_.find(key) != nullptr; }

  Result<std::optional<std::string>> string(std::string_view key) const {
    const ParamValue* v = params_.find(key);
    if (v == nullptr) return std::optional<std::string>();
    const auto* s = std::get_if<std::string>(v);
    if (s == nullptr) return error(key, "must be a string");
    return std::optional<std::string>(*s);
  }

  Result<std::string> required_string(std::string_view key) const {
    auto s = string(key);
    if (!s) return s.error();
    if (!s->has_value()) return error(key, "is required");
    return std::move(**s);
  }

  Result<int64_t> integer(std::string_view key, int64_t fallback, int64_t min, int64_t max) const {
    const ParamValue* v = params_.find(key);
    if (v == nullptr) return fallback;
    const auto* i = std::get_if<int64_t>(v);
    if (i == nullptr) return error(key, "must be an integer");
    if (*i < min || *i > max) {
      return error(key, "is " + str(*i) + ", must be in [" + str(min) + ", " + str(max) + "]");
    }
    return *i;
  }

  Result<bool> flag(std::string_view key) const {
    const ParamValue* v = params_.find(key);
    if (v == nullptr) return false;
    const auto* i = std::get_if<int64_t>(v);
    if (i == nullptr) return error(key, "must be an integer 0 or 1");
    if (*i != 0 && *i != 1) return error(key, "is " + str(*i) + ", must be 0 or 1");
    return *i == 1;
  }

  // A float key; an integer value is taken as that number (gpuqctl's "alpha=2").
  Result<double> real(std::string_view key, double fallback) const {
    const ParamValue* v = params_.find(key);
    if (v == nullptr) return fallback;
    double d = 0;
    if (const auto* f = std::get_if<double>(v)) {
      d = *f;
    } else if (const auto* i = std::get_if<int64_t>(v)) {
      d = static_cast<double>(*i);
    } else {
      return error(key, "must be a number");
    }
    if (!std::isfinite(d)) return error(key, "must be finite");
    return d;
  }

  Result<Shape> shape(std::string_view key, int min_rank, int max_rank) const {
    auto s = required_string(key);
    if (!s) return s.error();
    auto shape = parse_shape(*s, op_ + ": " + std::string(key));
    if (!shape) return shape.error();
    if (shape->rank < min_rank || shape->rank > max_rank) {
      std::string ranks = min_rank == max_rank ? str(min_rank) + "-D"
                                               : str(min_rank) + "-D to " + str(max_rank) + "-D";
      return error(key,
                   "is " + shape->to_string() + " (" + str(shape->rank) + "-D), must be " + ranks);
    }
    return *shape;
  }

  // A pair "AxB" of integers in [min, kMaxDim], or `fallback` when absent.
  Result<std::array<int64_t, 2>> pair(std::string_view key, std::array<int64_t, 2> fallback,
                                      int64_t min) const {
    auto s = string(key);
    if (!s) return s.error();
    if (!s->has_value()) return fallback;
    auto dims = split_dims(**s);
    if (!dims || dims->size() != 2) {
      return error(key, "'" + **s + "' is not a pair of integers like 2x2");
    }
    for (int64_t d : *dims) {
      if (d < min || d > kMaxDim) {
        return error(key,
                     "'" + **s + "': each must be in [" + str(min) + ", " + str(kMaxDim) + "]");
      }
    }
    return std::array<int64_t, 2>{(*dims)[0], (*dims)[1]};
  }

  // Places operand `name` of `shape`: at "<name>_at" if given, else right after the previous
  // operand. Checks its size, alignment, that it lies in the input buffer and clear of the
  // output buffer.
  Result<Operand> place(std::string_view name, const Shape& shape) {
    const std::string at_key = std::string(name) + "_at";
    const uint64_t esize = dtype_bytes(dtype_);
    Operand o;
    o.shape = shape;
    auto elements = shape.elements();
    auto bytes = mul(elements, esize);
    if (elements > kMaxElements || !bytes || *bytes > kMaxElements) {
      return error(name, shape.to_string() + " " + dtype_name(dtype_) +
                             " is too large (elements and bytes must be at most 2^48)");
    }
    o.bytes = *bytes;
    std::string where;
    if (params_.find(at_key) != nullptr) {
      auto at = integer(at_key, 0, 0, std::numeric_limits<int64_t>::max());
      if (!at) return at.error();
      o.offset = static_cast<uint64_t>(*at);
      where = at_key;
    } else {
      o.offset = cursor_;
      where = std::string(name);
    }
    const std::string desc = std::string(name) + " (" + shape.to_string() + " " +
                             dtype_name(dtype_) + ", " + ustr(o.bytes) + " bytes) at byte " +
                             ustr(o.offset) + " of the input buffer";
    if (o.offset > buffers_.input_bytes || o.bytes > buffers_.input_bytes - o.offset) {
      return error(where, desc + " ends past its end (" + ustr(buffers_.input_bytes) + " bytes)");
    }
    if ((buffers_.input_offset + o.offset) % esize != 0) {
      return error(where, desc + " is not aligned to its " + ustr(esize) +
                              "-byte elements (arena offset " +
                              ustr(buffers_.input_offset + o.offset) + ")");
    }
    const uint64_t begin = buffers_.input_offset + o.offset;
    const uint64_t end = begin + o.bytes;
    const uint64_t out_begin = buffers_.output_offset;
    const uint64_t out_end = out_begin + buffers_.output_capacity;
    if (o.bytes > 0 && buffers_.output_capacity > 0 && begin < out_end && out_begin < end) {
      return error(where, desc + " overlaps the output buffer (arena bytes " + ustr(out_begin) +
                              " to " + ustr(out_end) + ")");
    }
    cursor_ = o.offset + o.bytes;
    return o;
  }

  // Checks result `y` (named by `key`): its size, that it fits in the output buffer and that
  // the output is aligned to its elements.
  Result<void> finish(std::string_view key, const Shape& y) const {
    for (int i = 0; i < y.rank; ++i) {
      if (y.dims[i] < 1 || y.dims[i] > kMaxDim) {
        return error(key, "the result's dimension " + str(i) + " would be " + str(y.dims[i]) +
                              ", must be in [1, " + str(kMaxDim) + "]");
      }
    }
    const uint64_t esize = dtype_bytes(dtype_);
    auto elements = y.elements();
    auto bytes = mul(elements, esize);
    if (elements > kMaxElements || !bytes || *bytes > kMaxElements) {
      return error(key, "the result " + y.to_string() + " " + dtype_name(dtype_) +
                            " is too large (elements and bytes must be at most 2^48)");
    }
    if (*bytes > buffers_.output_capacity) {
      return error(key, "the result " + y.to_string() + " " + dtype_name(dtype_) + " is " +
                            ustr(*bytes) + " bytes, the output buffer holds " +
                            ustr(buffers_.output_capacity));
    }
    if (buffers_.output_offset % esize != 0) {
      return error(key, "the output buffer (arena offset " + ustr(buffers_.output_offset) +
                            ") is not aligned to the " + ustr(esize) + "-byte elements");
    }
    return {};
  }

 private:
  std::string op_;
  const ParamBlock& params_;
  const JobBuffers& buffers_;
  DType dtype_ = DType::kF32;
  uint64_t cursor_ = 0;
};

Shape make_shape(std::initializer_list<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.dims[s.rank++] = d;
  return s;
}

Result<TensorOp> parse_conv2d(OpParser& p) {
  Conv2d c;
  GPUQ_TENSOR_CHECK(
      p.start({"x", "w", "b", "stride", "pad", "dilation", "groups", "relu"}, {"x", "w", "b"}));
  c.dtype = p.dtype();
  Shape x, w;
  GPUQ_TENSOR_TRY(x, p.shape("x", 4, 4));
  GPUQ_TENSOR_TRY(w, p.shape("w", 4, 4));
  std::optional<Shape> b;
  auto b_text = p.string("b");
  if (!b_text) return b_text.error();
  if (b_text->has_value()) {
    GPUQ_TENSOR_TRY(b, p.shape("b", 1, 1));
  } else if (p.has("b_at")) {
    return p.error("b_at", "given without b");
  }
  std::array<int64_t, 2> stride{}, pad{}, dilation{};
  GPUQ_TENSOR_TRY(stride, p.pair("stride", {1, 1}, 1));
  GPUQ_TENSOR_TRY(pad, p.pair("pad", {0, 0}, 0));
  GPUQ_TENSOR_TRY(dilation, p.pair("dilation", {1, 1}, 1));
  GPUQ_TENSOR_TRY(c.groups, p.integer("groups", 1, 1, kMaxDim));
  GPUQ_TENSOR_TRY(c.relu, p.flag("relu"));

  const int64_t n = x.dims[0], ch = x.dims[1], h = x.dims[2], wd = x.dims[3];
  const int64_t k = w.dims[0], cg = w.dims[1], r = w.dims[2], s = w.dims[3];
  const int64_t g = c.groups;
  if (ch % g != 0) {
    return p.error("groups", str(g) + " does not divide x's " + str(ch) + " channels");
  }
  if (k % g != 0) {
    return p.error("groups", str(g) + " does not divide w's " + str(k) + " output channels");
  }
  if (cg * g != ch) {
    return p.error("w", "is " + w.to_string() + ": its " + str(cg) + " channels x groups " +
                            str(g) + " must equal x's " + str(ch) + " channels (x is " +
                            x.to_string() + ")");
  }
  if (b && b->dims[0] != k) {
    return p.error(
        "b", "has " + str(b->dims[0]) + " elements, must have w's " + str(k) + " output channels");
  }
  int64_t out[2] = {0, 0};
  const int64_t in[2] = {h, wd}, kern[2] = {r, s};
  const char* axis[2] = {"height", "width"};
  for (int i = 0; i < 2; ++i) {
    const int64_t span = dilation[i] * (kern[i] - 1) + 1;  // <= 2^62
    const int64_t padded = in[i] + 2 * pad[i];
    if (span > padded) {
      return p.error("w", std::string("the kernel ") + axis[i] + " " + str(kern[i]) +
                              " with dilation " + str(dilation[i]) + " spans " + str(span) +
                              ", more than the padded input " + axis[i] + " " + str(padded) + " (" +
                              str(in[i]) + " + 2 x pad " + str(pad[i]) + ")");
    }
    out[i] = (padded - span) / stride[i] + 1;
  }
  for (int i = 0; i < 2; ++i) {
    c.stride[i] = stride[i];
    c.pad[i] = pad[i];
    c.dilation[i] = dilation[i];
  }
  c.y = make_shape({n, k, out[0], out[1]});
  GPUQ_TENSOR_TRY(c.x, p.place("x", x));
  GPUQ_TENSOR_TRY(c.w, p.place("w", w));
  if (b) {
    Operand bo;
    GPUQ_TENSOR_TRY(bo, p.place("b", *b));
    c.b = bo;
  }
  GPUQ_TENSOR_CHECK(p.finish("y", c.y));
  return TensorOp(std::move(c));
}

Result<TensorOp> parse_activation(OpParser& p) {
  ActivationOp a;
  GPUQ_TENSOR_CHECK(p.start({"x", "mode"}, {"x"}));
  a.dtype = p.dtype();
  Shape x;
  GPUQ_TENSOR_TRY(x, p.shape("x", 1, kMaxRank));
  std::string mode;
  GPUQ_TENSOR_TRY(mode, p.required_string("mode"));
  if (mode == "relu") {
    a.mode = Activation::kRelu;
  } else if (mode == "sigmoid") {
    a.mode = Activation::kSigmoid;
  } else if (mode == "tanh") {
    a.mode = Activation::kTanh;
  } else {
    return p.error("mode", "'" + mode + "' is not an activation (relu, sigmoid or tanh)");
  }
  a.y = x;
  GPUQ_TENSOR_TRY(a.x, p.place("x", x));
  GPUQ_TENSOR_CHECK(p.finish("y", a.y));
  return TensorOp(std::move(a));
}

Result<TensorOp> parse_softmax(OpParser& p) {
  Softmax s;
  GPUQ_TENSOR_CHECK(p.start({"x", "log"}, {"x"}));
  s.dtype = p.dtype();
  Shape x;
  GPUQ_TENSOR_TRY(x, p.shape("x", 2, kMaxRank));
  GPUQ_TENSOR_TRY(s.log, p.flag("log"));
  s.y = x;
  GPUQ_TENSOR_TRY(s.x, p.place("x", x));
  GPUQ_TENSOR_CHECK(p.finish("y", s.y));
  return TensorOp(std::move(s));
}

Result<TensorOp> parse_pool2d(OpParser& p) {
  Pool2d q;
  GPUQ_TENSOR_CHECK(p.start({"x", "mode", "window", "stride", "pad", "count_pad"}, {"x"}));
  q.dtype = p.dtype();
  Shape x;
  GPUQ_TENSOR_TRY(x, p.shape("x", 4, 4));
  std::string mode;
  GPUQ_TENSOR_TRY(mode, p.required_string("mode"));
  if (mode == "max") {
    q.mode = PoolMode::kMax;
  } else if (mode == "avg") {
    q.mode = PoolMode::kAvg;
  } else {
    return p.error("mode", "'" + mode + "' is not a pooling mode (max or avg)");
  }
  if (!p.has("window")) return p.error("window", "is required");
  std::array<int64_t, 2> window{}, stride{}, pad{};
  GPUQ_TENSOR_TRY(window, p.pair("window", {1, 1}, 1));
  GPUQ_TENSOR_TRY(stride, p.pair("stride", window, 1));
  GPUQ_TENSOR_TRY(pad, p.pair("pad", {0, 0}, 0));
  GPUQ_TENSOR_TRY(q.count_pad, p.flag("count_pad"));
  const int64_t in[2] = {x.dims[2], x.dims[3]};
  const char* axis[2] = {"height", "width"};
  int64_t out[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    if (pad[i] >= window[i]) {
      return p.error("pad", std::string(axis[i]) + " pad " + str(pad[i]) +
                                " must be less than the window's " + str(window[i]));
    }
    const int64_t padded = in[i] + 2 * pad[i];
    if (window[i] > padded) {
      return p.error("window", std::string(axis[i]) + " " + str(window[i]) +
                                   " is more than the padded input " + axis[i] + " " + str(padded) +
                                   " (" + str(in[i]) + " + 2 x pad " + str(pad[i]) + ")");
    }
    out[i] = (padded - window[i]) / stride[i] + 1;
    q.window[i] = window[i];
    q.stride[i] = stride[i];
    q.pad[i] = pad[i];
  }
  q.y = make_shape({x.dims[0], x.dims[1], out[0], out[1]});
  GPUQ_TENSOR_TRY(q.x, p.place("x", x));
  GPUQ_TENSOR_CHECK(p.finish("y", q.y));
  return TensorOp(std::move(q));
}

Result<TensorOp> parse_batchnorm(OpParser& p) {
  BatchNorm bn;
  GPUQ_TENSOR_CHECK(p.start({"x", "eps", "relu"}, {"x", "scale", "bias", "mean", "var"}));
  bn.dtype = p.dtype();
  Shape x;
  GPUQ_TENSOR_TRY(x, p.shape("x", 2, 4));
  if (x.rank == 3) {
    return p.error("x", "is " + x.to_string() + " (3-D), must be NxCxHxW or NxC");
  }
  GPUQ_TENSOR_TRY(bn.eps, p.real("eps", 1e-5));
  if (!(bn.eps > 0)) return p.error("eps", "is " + std::to_string(bn.eps) + ", must be > 0");
  GPUQ_TENSOR_TRY(bn.relu, p.flag("relu"));
  bn.y = x;
  const Shape c = make_shape({x.dims[1]});
  GPUQ_TENSOR_TRY(bn.x, p.place("x", x));
  GPUQ_TENSOR_TRY(bn.scale, p.place("scale", c));
  GPUQ_TENSOR_TRY(bn.bias, p.place("bias", c));
  GPUQ_TENSOR_TRY(bn.mean, p.place("mean", c));
  GPUQ_TENSOR_TRY(bn.var, p.place("var", c));
  GPUQ_TENSOR_CHECK(p.finish("y", bn.y));
  return TensorOp(std::move(bn));
}

Result<TensorOp> parse_gemm(OpParser& p) {
  Gemm g;
  GPUQ_TENSOR_CHECK(
      p.start({"a", "b", "c", "trans_a", "trans_b", "alpha", "beta"}, {"a", "b", "c"}));
  g.dtype = p.dtype();
  Shape a, b;
  GPUQ_TENSOR_TRY(a, p.shape("a", 2, 2));
  GPUQ_TENSOR_TRY(b, p.shape("b", 2, 2));
  GPUQ_TENSOR_TRY(g.trans_a, p.flag("trans_a"));
  GPUQ_TENSOR_TRY(g.trans_b, p.flag("trans_b"));
  GPUQ_TENSOR_TRY(g.alpha, p.real("alpha", 1.0));
  GPUQ_TENSOR_TRY(g.beta, p.real("beta", 0.0));
  g.m = g.trans_a ? a.dims[1] : a.dims[0];
  g.k = g.trans_a ? a.dims[0] : a.dims[1];
  const int64_t kb = g.trans_b ? b.dims[1] : b.dims[0];
  g.n = g.trans_b ? b.dims[0] : b.dims[1];
  if (kb != g.k) {
    return p.error("b", "op(b) is " + str(kb) + "x" + str(g.n) + " (b " + b.to_string() +
                            ", trans_b " + str(g.trans_b) + "): its " + str(kb) +
                            " rows must equal op(a)'s " + str(g.k) + " columns (a " +
                            a.to_string() + ", trans_a " + str(g.trans_a) + ")");
  }
  g.y = make_shape({g.m, g.n});
  std::optional<Shape> c;
  if (g.beta != 0) {
    if (!p.has("c")) {
      return p.error("c", "is required when beta is not 0 (beta " + std::to_string(g.beta) + ")");
    }
    GPUQ_TENSOR_TRY(c, p.shape("c", 2, 2));
    if (!(*c == g.y)) {
      return p.error("c", "is " + c->to_string() + ", must be MxN " + g.y.to_string());
    }
  } else if (p.has("c")) {
    return p.error("c", "given with beta 0 (c is only read when beta is not 0)");
  } else if (p.has("c_at")) {
    return p.error("c_at", "given without c");
  }
  GPUQ_TENSOR_TRY(g.a, p.place("a", a));
  GPUQ_TENSOR_TRY(g.b, p.place("b", b));
  if (c) {
    Operand co;
    GPUQ_TENSOR_TRY(co, p.place("c", *c));
    g.c = co;
  }
  GPUQ_TENSOR_CHECK(p.finish("y", g.y));
  return TensorOp(std::move(g));
}

#undef GPUQ_TENSOR_TRY
#undef GPUQ_TENSOR_CHECK

}  // namespace

const char* dtype_name(DType t) noexcept {
  return t == DType::kF16 ? "f16" : "f32";
}

uint64_t Shape::elements() const noexcept {
  if (rank == 0) return 0;
  uint64_t e = 1;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] <= 0) return 0;
    if (__builtin_mul_overflow(e, static_cast<uint64_t>(dims[i]), &e)) {
      return std::numeric_limits<uint64_t>::max();
    }
  }
  return e;
}

std::string Shape::to_string() const {
  std::string s;
  for (int i = 0; i < rank; ++i) {
    if (i > 0) s += 'x';
    s += std::to_string(dims[i]);
  }
  return s;
}

bool Shape::operator==(const Shape& o) const noexcept {
  if (rank != o.rank) return false;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] != o.dims[i]) return false;
  }
  return true;
}

Result<Shape> parse_shape(std::string_view text, std::string_view what) {
  auto fail = [&](const std::string& why) {
    return Error(ErrorCode::kInvalidArgument,
                 std::string(what) + ": '" + std::string(text) + "' " + why);
  };
  auto dims = split_dims(text);
  if (!dims) return fail("is not a shape (1 to 4 positive integers joined by x, like 2x3x32x32)");
  Shape s;
  for (int64_t d : *dims) {
    if (d < 1 || d > kMaxDim) {
      return fail("has dimension " + std::to_string(d) + ", each must be in [1, " +
                  std::to_string(kMaxDim) + "]");
    }
    s.dims[s.rank++] = d;
  }
  if (s.elements() > kMaxElements) return fail("has more than 2^48 elements");
  return s;
}

const char* op_kind_name(OpKind k) noexcept {
  switch (k) {
    case OpKind::kConv2d:
      return "conv2d";
    case OpKind::kActivation:
      return "activation";
    case OpKind::kSoftmax:
      return "softmax";
    case OpKind::kPool2d:
      return "pool2d";
    case OpKind::kBatchNorm:
      return "batchnorm";
    case OpKind::kGemm:
      return "gemm";
  }
  return "?";
}

std::optional<OpKind> op_kind_from_name(std::string_view name) noexcept {
  for (OpKind k : {OpKind::kConv2d, OpKind::kActivation, OpKind::kSoftmax, OpKind::kPool2d,
                   OpKind::kBatchNorm, OpKind::kGemm}) {
    if (name == op_kind_name(k)) return k;
  }
  return std::nullopt;
}

Result<TensorOp> parse_tensor_op(OpKind kind, const ParamBlock& params, const JobBuffers& buffers) {
  OpParser p(kind, params, buffers);
  switch (kind) {
    case OpKind::kConv2d:
      return parse_conv2d(p);
    case OpKind::kActivation:
      return parse_activation(p);
    case OpKind::kSoftmax:
      return parse_softmax(p);
    case OpKind::kPool2d:
      return parse_pool2d(p);
    case OpKind::kBatchNorm:
      return parse_batchnorm(p);
    case OpKind::kGemm:
      return parse_gemm(p);
  }
  return Error(ErrorCode::kInvalidArgument,
               "op kind " + std::to_string(static_cast<int>(kind)) + " is not a tensor op");
}

const Shape& result_shape(const TensorOp& op) noexcept {
  return std::visit([](const auto& o) -> const Shape& { return o.y; }, op);
}

DType result_dtype(const TensorOp& op) noexcept {
  return std::visit([](const auto& o) { return o.dtype; }, op);
}

uint64_t result_bytes(const TensorOp& op) noexcept {
  return result_shape(op).elements() * dtype_bytes(result_dtype(op));
}

}  // namespace gpuq::tensor
