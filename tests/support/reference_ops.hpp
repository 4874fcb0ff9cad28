// Float64 reference implementations of the catalog's tensor ops (gpuq/common/tensor_ops.hpp),
// written for clarity, not speed: the definitions the CPU (oneDNN) and GPU (cuDNN, cuBLAS)
// results are compared against. Header-only and independent of any backend; f32 and f16 inputs.
//
//   auto op = tensor::parse_tensor_op(kind, params, buffers);          // the spec
//   std::vector<double> want = test::reference_op(*op, input_bytes);   // y, row-major
//   auto diff = test::compare_result(want, output_bytes, tensor::result_dtype(*op));
//   CHECK(diff.worst <= test::tolerance(tensor::result_dtype(*op)));
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <variant>
#include <vector>

#include "gpuq/common/tensor_ops.hpp"

namespace gpuq::test {

// IEEE binary16 <-> double (round to nearest even on the way in).
inline double half_to_double(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1f;
  const int frac = h & 0x3ff;
  double v;
  if (exp == 0) {
    v = std::ldexp(frac, -24);
  } else if (exp == 31) {
    v = frac == 0 ? std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(frac + 1024, exp - 25);
  }
  return sign ? -v : v;
}

inline uint16_t double_to_half(double d) {
  float f = static_cast<float>(d);
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - exp;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // may carry into the exponent: right
  return static_cast<uint16_t>(sign | h);
}

// Element i of a dense array of `t` at `p`.
inline double read_element(const std::byte* p, tensor::DType t, uint64_t i) {
  if (t == tensor::DType::kF16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return half_to_double(h);
  }
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

inline void write_element(std::byte* p, tensor::DType t, uint64_t i, double v) {
  if (t == tensor::DType::kF16) {
    const uint16_t h = double_to_half(v);
    std::memcpy(p + 2 * i, &h, 2);
  } else {
    const float f = static_cast<float>(v);
    std::memcpy(p + 4 * i, &f, 4);
  }
}

// An operand of the input buffer, read as doubles.
inline std::vector<double> read_operand(const std::byte* input, const tensor::Operand& o,
                                        tensor::DType t) {
  std::vector<double> v(o.shape.elements());
  for (uint64_t i = 0; i < v.size(); ++i) v[i] = read_element(input + o.offset, t, i);
  return v;
}

inline std::vector<double> reference_conv2d(const tensor::Conv2d& c, const std::byte* input) {
  const auto x = read_operand(input, c.x, c.dtype);
  const auto w = read_operand(input, c.w, c.dtype);
  std::vector<double> b;
  if (c.b) b = read_operand(input, *c.b, c.dtype);
  const int64_t n_ = c.x.shape.dims[0], ch = c.x.shape.dims[1], h = c.x.shape.dims[2],
                wd = c.x.shape.dims[3];
  const int64_t k_ = c.w.shape.dims[0], cg = c.w.shape.dims[1], r_ = c.w.shape.dims[2],
                s_ = c.w.shape.dims[3];
  const int64_t oh_ = c.y.dims[2], ow_ = c.y.dims[3];
  const int64_t kg = k_ / c.groups;
  std::vector<double> y(c.y.elements());
  for (int64_t n = 0; n < n_; ++n) {
    for (int64_t k = 0; k < k_; ++k) {
      const int64_t g = k / kg;
      for (int64_t oh = 0; oh < oh_; ++oh) {
        for (int64_t ow = 0; ow < ow_; ++ow) {
          double sum = c.b ? b[k] : 0.0;
          for (int64_t ci = 0; ci < cg; ++ci) {
            for (int64_t r = 0; r < r_; ++r) {
              const int64_t ih = oh * c.stride[0] - c.pad[0] + r * c.dilation[0];
              if (ih < 0 || ih >= h) continue;
              for (int64_t s = 0; s < s_; ++s) {
                const int64_t iw = ow * c.stride[1] - c.pad[1] + s * c.dilation[1];
                if (iw < 0 || iw >= wd) continue;
                sum += x[((n * ch + g * cg + ci) * h + ih) * wd + iw] *
                       w[((k * cg + ci) * r_ + r) * s_ + s];
              }
            }
          }
          if (c.relu) sum = std::max(sum, 0.0);
          y[((n * k_ + k) * oh_ + oh) * ow_ + ow] = sum;
        }
      }
    }
  }
  return y;
}

inline std::vector<double> reference_activation(const tensor::ActivationOp& a,
                                                const std::byte* input) {
  auto y = read_operand(input, a.x, a.dtype);
  for (double& v : y) {
    switch (a.mode) {
      case tensor::Activation::kRelu:
        v = std::max(v, 0.0);
        break;
      case tensor::Activation::kSigmoid:
        v = 1.0 / (1.0 + std::exp(-v));
        break;
      case tensor::Activation::kTanh:
        v = std::tanh(v);
        break;
    }
  }
  return y;
}

inline std::vector<double> reference_softmax(const tensor::Softmax& s, const std::byte* input) {
  const auto x = read_operand(input, s.x, s.dtype);
  const int64_t outer = s.x.shape.dims[0], ch = s.x.shape.dims[1];
  int64_t inner = 1;
  for (int i = 2; i < s.x.shape.rank; ++i) inner *= s.x.shape.dims[i];
  std::vector<double> y(x.size());
  for (int64_t n = 0; n < outer; ++n) {
    for (int64_t i = 0; i < inner; ++i) {
      auto at = [&](int64_t c) { return (n * ch + c) * inner + i; };
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t c = 0; c < ch; ++c) mx = std::max(mx, x[at(c)]);
      double sum = 0;
      for (int64_t c = 0; c < ch; ++c) sum += std::exp(x[at(c)] - mx);
      for (int64_t c = 0; c < ch; ++c) {
        y[at(c)] = s.log ? x[at(c)] - mx - std::log(sum) : std::exp(x[at(c)] - mx) / sum;
      }
    }
  }
  return y;
}

inline std::vector<double> reference_pool2d(const tensor::Pool2d& p, const std::byte* input) {
  const auto x = read_operand(input, p.x, p.dtype);
  const int64_t nc = p.x.shape.dims[0] * p.x.shape.dims[1], h = p.x.shape.dims[2],
                wd = p.x.shape.dims[3];
  const int64_t oh_ = p.y.dims[2], ow_ = p.y.dims[3];
  std::vector<double> y(p.y.elements());
  for (int64_t plane = 0; plane < nc; ++plane) {
    for (int64_t oh = 0; oh < oh_; ++oh) {
      for (int64_t ow = 0; ow < ow_; ++ow) {
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        int64_t inside = 0;
        for (int64_t r = 0; r < p.window[0]; ++r) {
          const int64_t ih = oh * p.stride[0] - p.pad[0] + r;
          if (ih < 0 || ih >= h) continue;
          for (int64_t s = 0; s < p.window[1]; ++s) {
            const int64_t iw = ow * p.stride[1] - p.pad[1] + s;
            if (iw < 0 || iw >= wd) continue;
            const double v = x[(plane * h + ih) * wd + iw];
            mx = std::max(mx, v);
            sum += v;
            ++inside;
          }
        }
        double out = mx;
        if (p.mode == tensor::PoolMode::kAvg) {
          const int64_t count = p.count_pad ? p.window[0] * p.window[1] : inside;
          out = sum / static_cast<double>(count);
        }
        y[(plane * oh_ + oh) * ow_ + ow] = out;
      }
    }
  }
  return y;
}

inline std::vector<double> reference_batchnorm(const tensor::BatchNorm& b, const std::byte* input) {
  const auto x = read_operand(input, b.x, b.dtype);
  const auto scale = read_operand(input, b.scale, b.dtype);
  const auto bias = read_operand(input, b.bias, b.dtype);
  const auto mean = read_operand(input, b.mean, b.dtype);
  const auto var = read_operand(input, b.var, b.dtype);
  const int64_t n_ = b.x.shape.dims[0], ch = b.x.shape.dims[1];
  const int64_t inner = b.x.shape.rank == 4 ? b.x.shape.dims[2] * b.x.shape.dims[3] : 1;
  std::vector<double> y(x.size());
  for (int64_t n = 0; n < n_; ++n) {
    for (int64_t c = 0; c < ch; ++c) {
      const double inv = 1.0 / std::sqrt(var[c] + b.eps);
      for (int64_t i = 0; i < inner; ++i) {
        const int64_t at = (n * ch + c) * inner + i;
        double v = scale[c] * (x[at] - mean[c]) * inv + bias[c];
        y[at] = b.relu ? std::max(v, 0.0) : v;
      }
    }
  }
  return y;
}

inline std::vector<double> reference_gemm(const tensor::Gemm& g, const std::byte* input) {
  const auto a = read_operand(input, g.a, g.dtype);
  const auto b = read_operand(input, g.b, g.dtype);
  std::vector<double> c;
  if (g.c) c = read_operand(input, *g.c, g.dtype);
  const int64_t m_ = g.m, n_ = g.n, k_ = g.k;
  std::vector<double> y(static_cast<size_t>(m_ * n_));
  for (int64_t i = 0; i < m_; ++i) {
    for (int64_t j = 0; j < n_; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < k_; ++p) {
        const double av = g.trans_a ? a[p * m_ + i] : a[i * k_ + p];
        const double bv = g.trans_b ? b[j * k_ + p] : b[p * n_ + j];
        sum += av * bv;
      }
      double v = g.alpha * sum;
      if (g.c) v += g.beta * c[i * n_ + j];
      y[i * n_ + j] = v;
    }
  }
  return y;
}

// The result of any op, row-major in the shape of tensor::result_shape(op).
inline std::vector<double> reference_op(const tensor::TensorOp& op, const std::byte* input) {
  return std::visit(
      [&](const auto& o) -> std::vector<double> {
        using T = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<T, tensor::Conv2d>) return reference_conv2d(o, input);
        if constexpr (std::is_same_v<T, tensor::ActivationOp>) {
          return reference_activation(o, input);
        }
        if constexpr (std::is_same_v<T, tensor::Softmax>) return reference_softmax(o, input);
        if constexpr (std::is_same_v<T, tensor::Pool2d>) return reference_pool2d(o, input);
        if constexpr (std::is_same_v<T, tensor::BatchNorm>) return reference_batchnorm(o, input);
        if constexpr (std::is_same_v<T, tensor::Gemm>) return reference_gemm(o, input);
      },
      op);
}

// How far a backend's result is from the reference: for each element
// |got - want| / (|want| + rms(want)), the root mean square keeping elements near zero (where
// sums of mixed signs cancel) from dominating. `worst` is the largest, at `index`.
struct Difference {
  double worst = 0;
  uint64_t index = 0;
  double got = 0, want = 0;
  bool nonfinite = false;  // a NaN or infinity where the reference is finite
};

inline Difference compare_result(const std::vector<double>& want, const std::byte* got,
                                 tensor::DType t) {
  double sq = 0;
  for (double v : want) sq += v * v;
  const double rms = want.empty() ? 0 : std::sqrt(sq / static_cast<double>(want.size()));
  Difference d;
  for (uint64_t i = 0; i < want.size(); ++i) {
    const double g = read_element(got, t, i);
    if (!std::isfinite(g) && std::isfinite(want[i])) {
      d.nonfinite = true;
      d.worst = std::numeric_limits<double>::infinity();
      d.index = i;
      d.got = g;
      d.want = want[i];
      return d;
    }
    const double denom = std::abs(want[i]) + rms;
    const double e = denom == 0 ? std::abs(g - want[i]) : std::abs(g - want[i]) / denom;
    if (e > d.worst) {
      d.worst = e;
      d.index = i;
      d.got = g;
      d.want = want[i];
    }
  }
  return d;
}

// The bound on Difference::worst for results of this dtype (accumulations of a few thousand
// terms of values around 1).
inline double tolerance(tensor::DType t) {
  return t == tensor::DType::kF16 ? 2e-2 : 1e-4;
}

}  // namespace gpuq::test
