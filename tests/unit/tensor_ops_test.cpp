// Unit tests of the tensor ops' parameter parser (common/include/gpuq/common/tensor_ops.hpp):
// each op's happy path, shapes, placement of operands in the input buffer, and each error.
#include "gpuq/common/tensor_ops.hpp"

#include <doctest/doctest.h>

#include "support/rng.hpp"
#include "support/test_support.hpp"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace gpuq::tensor {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ParamBlock block(std::initializer_list<Param> params) {
  ParamWriter w;
  for (const auto& p : params) REQUIRE(w.add(p.key, p.value).ok());
  auto b = ParamBlock::parse(w.data(), w.size());
  REQUIRE(b.ok());
  return std::move(b).value();
}

// An input buffer of 1 MiB at arena offset 0 and an output buffer of 1 MiB right after it.
constexpr JobBuffers kBuffers{0, 1 << 20, 1 << 20, 1 << 20};

Result<TensorOp> parse(OpKind kind, std::initializer_list<Param> params,
                       const JobBuffers& buffers = kBuffers) {
  return parse_tensor_op(kind, block(params), buffers);
}

// The error message of a parse that must fail with InvalidArgument.
std::string failure(OpKind kind, std::initializer_list<Param> params,
                    const JobBuffers& buffers = kBuffers) {
  auto r = parse(kind, params, buffers);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInvalidArgument);
  return r.error().message();
}

Param s(const char* key, const char* value) {
  return Param{key, std::string(value)};
}
Param i(const char* key, int64_t value) {
  return Param{key, value};
}
Param f(const char* key, double value) {
  return Param{key, value};
}

TEST_CASE("parse_shape reads 1 to 4 positive dimensions") {
  auto one = parse_shape("7", "x");
  REQUIRE(one.ok());
  CHECK(one->rank == 1);
  CHECK(one->dims[0] == 7);
  auto four = parse_shape("2x3x32x31", "x");
  REQUIRE(four.ok());
  CHECK(four->rank == 4);
  CHECK(four->elements() == 2u * 3 * 32 * 31);
  CHECK(four->to_string() == "2x3x32x31");
  auto big = parse_shape("2147483647", "x");
  REQUIRE(big.ok());
  CHECK(big->dims[0] == 2147483647);
  CHECK(parse_shape("65536x65536x65536", "x").value() ==
        parse_shape("65536x65536x65536", "y").value());
}

TEST_CASE("parse_shape refuses malformed text, zero, too many dimensions and too many elements") {
  for (const char* bad :
       {"", "x", "2x", "x2", "2xx3", "2X3", " 2", "2 ", "+2", "-1", "2x-1", "1.5", "1x2x3x4x5",
        "abc", "0", "2x0x3", "2147483648", "99999999999999999999", "65536x65536x65536x2"}) {
    CAPTURE(bad);
    auto r = parse_shape(bad, "conv2d: x");
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(r.error().message(), "conv2d: x: '" + std::string(bad) + "'"));
  }
}

TEST_CASE("a value quoted in an error shows bytes outside printable ASCII as '?'") {
  auto r = parse_shape(std::string_view("2x\x80", 3), "conv2d: x");
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.error().message(), "conv2d: x: '2x?' is not a shape"));
}

TEST_CASE("op kind names round-trip and dtype names") {
  for (OpKind k : {OpKind::kConv2d, OpKind::kActivation, OpKind::kSoftmax, OpKind::kPool2d,
                   OpKind::kBatchNorm, OpKind::kGemm}) {
    auto back = op_kind_from_name(op_kind_name(k));
    REQUIRE(back.has_value());
    CHECK(*back == k);
  }
  CHECK(std::string(op_kind_name(OpKind::kBatchNorm)) == "batchnorm");
  CHECK_FALSE(op_kind_from_name("conv").has_value());
  CHECK_FALSE(op_kind_from_name("").has_value());
  CHECK(std::string(dtype_name(DType::kF32)) == "f32");
  CHECK(std::string(dtype_name(DType::kF16)) == "f16");
  CHECK(dtype_bytes(DType::kF16) == 2);
}

// ---- conv2d -----------------------------------------------------------------------------------

TEST_CASE("conv2d: groups, stride, pad, dilation, bias and relu give the documented shape") {
  auto r =
      parse(OpKind::kConv2d, {s("x", "2x4x9x7"), s("w", "6x2x3x3"), s("b", "6"), s("stride", "2x1"),
                              s("pad", "1x0"), s("dilation", "2x1"), i("groups", 2), i("relu", 1)});
  REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  const auto& c = std::get<Conv2d>(*r);
  CHECK(c.dtype == DType::kF32);
  CHECK(c.groups == 2);
  CHECK(c.relu);
  CHECK(c.stride[0] == 2);
  CHECK(c.stride[1] == 1);
  CHECK(c.pad[0] == 1);
  CHECK(c.dilation[0] == 2);
  // OH = (9 + 2 - 2 * 2 - 1) / 2 + 1 = 4, OW = (7 - 2 - 1) / 1 + 1 = 5.
  CHECK(c.y.to_string() == "2x6x4x5");
  CHECK(c.x.offset == 0);
  CHECK(c.x.bytes == 2 * 4 * 9 * 7 * 4);
  CHECK(c.w.offset == 2016);
  CHECK(c.w.bytes == 6 * 2 * 3 * 3 * 4);
  REQUIRE(c.b.has_value());
  CHECK(c.b->offset == 2016 + 432);
  CHECK(c.b->bytes == 24);
  CHECK(result_shape(*r) == c.y);
  CHECK(result_dtype(*r) == DType::kF32);
  CHECK(result_bytes(*r) == 2 * 6 * 4 * 5 * 4);
}

TEST_CASE("conv2d: defaults, no bias, f16 and operands placed with _at") {
  auto r = parse(OpKind::kConv2d, {s("x", "1x3x5x5"), s("w", "2x3x5x5"), s("dtype", "f16"),
                                   i("w_at", 1000), i("x_at", 2)});
  REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  const auto& c = std::get<Conv2d>(*r);
  CHECK(c.dtype == DType::kF16);
  CHECK_FALSE(c.b.has_value());
  CHECK_FALSE(c.relu);
  CHECK(c.groups == 1);
  CHECK(c.y.to_string() == "1x2x1x1");
  CHECK(c.x.offset == 2);
  CHECK(c.x.bytes == 75 * 2);
  CHECK(c.w.offset == 1000);
  CHECK(result_bytes(*r) == 4);
}

TEST_CASE("a shape key takes an integer as a 1-D shape (gpuqctl's b=16)") {
  auto r = parse(OpKind::kConv2d, {s("x", "1x1x3x3"), s("w", "4x1x3x3"), i("b", 4)});
  REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  CHECK(std::get<Conv2d>(*r).b->shape.to_string() == "4");
  auto a = parse(OpKind::kActivation, {i("x", 7), s("mode", "relu")});
  REQUIRE(a.ok());
  CHECK(std::get<ActivationOp>(*a).y.to_string() == "7");
  CHECK(contains(failure(OpKind::kActivation, {i("x", 0), s("mode", "relu")}),
                 "activation: x: is 0, a dimension must be in [1, 2147483647]"));
  CHECK(contains(failure(OpKind::kActivation, {f("x", 7.0), s("mode", "relu")}),
                 "activation: x: must be a shape string like 2x3x32x32 (or an integer for 1-D)"));
  CHECK(contains(failure(OpKind::kSoftmax, {i("x", 7)}),
                 "softmax: x: is 7 (1-D), must be 2-D to 4-D"));
}

TEST_CASE("conv2d: an operand without _at follows the previous one, wherever that was put") {
  auto r =
      parse(OpKind::kConv2d, {s("x", "1x1x2x2"), s("w", "1x1x1x1"), s("b", "1"), i("w_at", 64)});
  REQUIRE(r.ok());
  const auto& c = std::get<Conv2d>(*r);
  CHECK(c.x.offset == 0);
  CHECK(c.w.offset == 64);
  CHECK(c.b->offset == 68);
}

TEST_CASE("conv2d: inconsistent shapes are refused with the values named") {
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x4x5x5"), s("w", "2x3x3x3")}),
                 "conv2d: w: is 2x3x3x3: its 3 channels x groups 1 must equal x's 4 channels"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x4x5x5"), s("w", "2x1x3x3"), i("groups", 3)}),
                 "conv2d: groups: 3 does not divide x's 4 channels"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x4x5x5"), s("w", "3x2x3x3"), i("groups", 2)}),
                 "conv2d: groups: 2 does not divide w's 3 output channels"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x4x5x5"), s("w", "2x4x3x3"), s("b", "3")}),
                 "conv2d: b: has 3 elements, must have w's 2 output channels"));
  CHECK(contains(
      failure(OpKind::kConv2d, {s("x", "1x1x4x4"), s("w", "1x1x3x3"), s("dilation", "2x1")}),
      "conv2d: w: the kernel height 3 with dilation 2 spans 5, more than the padded "
      "input height 4"));
  CHECK(
      contains(failure(OpKind::kConv2d, {s("x", "1x1x4x2"), s("w", "1x1x1x3")}), "kernel width 3"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3")}),
                 "conv2d: w: is 1x1x3 (3-D), must be 4-D"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5")}), "conv2d: w: is required"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1xx3")}),
                 "conv2d: w: '1x1xx3' is not a shape"));
}

TEST_CASE("conv2d: bad keys and values are refused naming the key") {
  CHECK(contains(
      failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), s("strides", "2x2")}),
      "conv2d: strides: unknown key (conv2d takes dtype, x, w, b, stride"));
  CHECK(
      contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), s("stride", "0x1")}),
               "conv2d: stride: '0x1': each must be in [1, 2147483647]"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), s("pad", "1")}),
                 "conv2d: pad: '1' is not a pair of integers like 2x2"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), i("pad", 1)}),
                 "conv2d: pad: must be a string"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), i("relu", 2)}),
                 "conv2d: relu: is 2, must be 0 or 1"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), f("relu", 1)}),
                 "conv2d: relu: must be an integer 0 or 1"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), i("groups", 0)}),
                 "conv2d: groups: is 0, must be in [1, 2147483647]"));
  CHECK(
      contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), s("dtype", "f64")}),
               "conv2d: dtype: 'f64' is not a dtype (f32 or f16)"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), i("b_at", 0)}),
                 "conv2d: b_at: given without b"));
  CHECK(
      contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), s("x", "1x1x5x5")}),
               "conv2d: x: given twice"));
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x5x5"), s("w", "1x1x3x3"), i("x_at", -4)}),
                 "conv2d: x_at: is -4"));
}

TEST_CASE("conv2d: a result dimension beyond 2^31 - 1 is refused") {
  CHECK(contains(
      failure(OpKind::kConv2d, {s("x", "1x1x1x1"), s("w", "1x1x1x1"), s("pad", "2147483647x0")}),
      "conv2d: y: the result's dimension 2 would be 4294967295"));
}

// ---- Placement of operands, common to every op --------------------------------------------------

TEST_CASE("operands must lie inside the input buffer") {
  // x is 1x1x4x4 f32 = 64 bytes, w 36 bytes: 100 in all.
  JobBuffers small{0, 99, 4096, 4096};
  CHECK(contains(failure(OpKind::kConv2d, {s("x", "1x1x4x4"), s("w", "1x1x3x3")}, small),
                 "conv2d: w: w (1x1x3x3 f32, 36 bytes) at byte 64 of the input buffer ends past "
                 "its end (99 bytes)"));
  CHECK(contains(
      failure(OpKind::kConv2d, {s("x", "1x1x4x4"), s("w", "1x1x3x3"), i("x_at", INT64_MAX)}, small),
      "conv2d: x_at: x (1x1x4x4 f32, 64 bytes) at byte 9223372036854775807"));
  JobBuffers exact{0, 100, 4096, 4096};
  CHECK(parse(OpKind::kConv2d, {s("x", "1x1x4x4"), s("w", "1x1x3x3")}, exact).ok());
  JobBuffers empty{0, 0, 4096, 4096};
  CHECK(contains(failure(OpKind::kActivation, {s("x", "1"), s("mode", "relu")}, empty),
                 "activation: x: x (1 f32, 4 bytes) at byte 0 of the input buffer ends past"));
}

TEST_CASE("operands must be aligned to their element size in the arena") {
  CHECK(contains(failure(OpKind::kActivation, {s("x", "4"), s("mode", "tanh"), i("x_at", 2)}),
                 "activation: x_at: x (4 f32, 16 bytes) at byte 2 of the input buffer is not "
                 "aligned to its 4-byte elements (arena offset 2)"));
  CHECK(
      parse(OpKind::kActivation, {s("x", "4"), s("mode", "tanh"), i("x_at", 2), s("dtype", "f16")})
          .ok());
  JobBuffers odd{6, 1024, 4096, 4096};
  CHECK(contains(failure(OpKind::kActivation, {s("x", "4"), s("mode", "tanh")}, odd),
                 "(arena offset 6)"));
  CHECK(parse(OpKind::kActivation, {s("x", "4"), s("mode", "tanh"), i("x_at", 2)}, odd).ok());
  JobBuffers odd_out{0, 1024, 4098, 4096};
  CHECK(contains(failure(OpKind::kActivation, {s("x", "4"), s("mode", "tanh")}, odd_out),
                 "activation: y: the output buffer (arena offset 4098) is not aligned to the "
                 "4-byte elements"));
}

TEST_CASE("operands must not overlap the output buffer") {
  // The output buffer is arena bytes [1000, 1100); the input [0, 2000).
  JobBuffers b{0, 2000, 1000, 100};
  CHECK(contains(failure(OpKind::kActivation, {s("x", "4"), s("mode", "relu"), i("x_at", 1096)}, b),
                 "activation: x_at: x (4 f32, 16 bytes) at byte 1096 of the input buffer overlaps "
                 "the output buffer (arena bytes 1000 to 1100)"));
  CHECK(contains(failure(OpKind::kActivation, {s("x", "4"), s("mode", "relu"), i("x_at", 988)}, b),
                 "overlaps the output buffer"));
  CHECK(parse(OpKind::kActivation, {s("x", "4"), s("mode", "relu"), i("x_at", 984)}, b).ok());
  CHECK(parse(OpKind::kActivation, {s("x", "4"), s("mode", "relu"), i("x_at", 1100)}, b).ok());
  // An input buffer that starts inside the output.
  JobBuffers inside{1040, 100, 1000, 100};
  CHECK(contains(failure(OpKind::kActivation, {s("x", "4"), s("mode", "relu")}, inside),
                 "overlaps the output buffer"));
}

TEST_CASE("the result must fit in the output buffer") {
  JobBuffers b{0, 4096, 8192, 15};
  CHECK(contains(failure(OpKind::kActivation, {s("x", "2x2"), s("mode", "relu")}, b),
                 "activation: y: the result 2x2 f32 is 16 bytes, the output buffer holds 15"));
  JobBuffers fits{0, 4096, 8192, 16};
  CHECK(parse(OpKind::kActivation, {s("x", "2x2"), s("mode", "relu")}, fits).ok());
}

TEST_CASE("an operand over 2^48 bytes is refused without overflow") {
  CHECK(contains(failure(OpKind::kActivation, {s("x", "65536x65536x65536"), s("mode", "relu")}),
                 "activation: x: 65536x65536x65536 f32 is too large"));
}

// ---- activation, softmax ----------------------------------------------------------------------

TEST_CASE("activation: each mode, any rank") {
  for (auto [name, mode] :
       {std::pair{"relu", Activation::kRelu}, std::pair{"sigmoid", Activation::kSigmoid},
        std::pair{"tanh", Activation::kTanh}}) {
    auto r = parse(OpKind::kActivation, {s("x", "3x1x2x5"), s("mode", name)});
    REQUIRE(r.ok());
    const auto& a = std::get<ActivationOp>(*r);
    CHECK(a.mode == mode);
    CHECK(a.y.to_string() == "3x1x2x5");
    CHECK(a.x.bytes == 120);
  }
  CHECK(contains(failure(OpKind::kActivation, {s("x", "3"), s("mode", "gelu")}),
                 "activation: mode: 'gelu' is not an activation (relu, sigmoid or tanh)"));
  CHECK(contains(failure(OpKind::kActivation, {s("x", "3")}), "activation: mode: is required"));
  CHECK(contains(failure(OpKind::kActivation, {s("mode", "relu")}), "activation: x: is required"));
  CHECK(contains(failure(OpKind::kActivation, {s("x", "3"), s("mode", "relu"), i("log", 1)}),
                 "activation: log: unknown key"));
}

TEST_CASE("softmax: rank 2 to 4, log") {
  auto r = parse(OpKind::kSoftmax, {s("x", "4x10"), i("log", 1)});
  REQUIRE(r.ok());
  CHECK(std::get<Softmax>(*r).log);
  CHECK(std::get<Softmax>(*r).y.to_string() == "4x10");
  CHECK_FALSE(std::get<Softmax>(parse(OpKind::kSoftmax, {s("x", "2x3x4x5")}).value()).log);
  CHECK(contains(failure(OpKind::kSoftmax, {s("x", "10")}),
                 "softmax: x: is 10 (1-D), must be 2-D to 4-D"));
  CHECK(contains(failure(OpKind::kSoftmax, {s("x", "2x3"), i("log", -1)}),
                 "softmax: log: is -1, must be 0 or 1"));
  CHECK(contains(failure(OpKind::kSoftmax, {s("x", "2x3"), i("axis", 1)}),
                 "softmax: axis: unknown key"));
}

// ---- pool2d -----------------------------------------------------------------------------------

TEST_CASE("pool2d: the stride defaults to the window; pad and count_pad") {
  auto r = parse(OpKind::kPool2d, {s("x", "2x3x7x8"), s("mode", "max"), s("window", "2x3")});
  REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  const auto& p = std::get<Pool2d>(*r);
  CHECK(p.mode == PoolMode::kMax);
  CHECK(p.stride[0] == 2);
  CHECK(p.stride[1] == 3);
  CHECK(p.y.to_string() == "2x3x3x2");  // (7 - 2) / 2 + 1, (8 - 3) / 3 + 1

  auto avg = parse(OpKind::kPool2d, {s("x", "1x1x5x5"), s("mode", "avg"), s("window", "3x3"),
                                     s("stride", "2x1"), s("pad", "1x2"), i("count_pad", 1)});
  REQUIRE_MESSAGE(avg.ok(), avg.error().to_string());
  const auto& a = std::get<Pool2d>(*avg);
  CHECK(a.mode == PoolMode::kAvg);
  CHECK(a.count_pad);
  CHECK(a.y.to_string() == "1x1x3x7");  // (5 + 2 - 3) / 2 + 1, (5 + 4 - 3) / 1 + 1
}

TEST_CASE("pool2d: errors") {
  CHECK(contains(failure(OpKind::kPool2d, {s("x", "1x1x5x5"), s("mode", "max")}),
                 "pool2d: window: is required"));
  CHECK(
      contains(failure(OpKind::kPool2d, {s("x", "1x1x5x5"), s("mode", "min"), s("window", "2x2")}),
               "pool2d: mode: 'min' is not a pooling mode (max or avg)"));
  CHECK(contains(failure(OpKind::kPool2d, {s("x", "1x1x5x5"), s("mode", "avg"), s("window", "2x2"),
                                           s("pad", "0x2")}),
                 "pool2d: pad: width pad 2 must be less than the window's 2"));
  CHECK(
      contains(failure(OpKind::kPool2d, {s("x", "1x1x5x2"), s("mode", "avg"), s("window", "3x3")}),
               "pool2d: window: width 3 is more than the padded input width 2"));
  CHECK(contains(failure(OpKind::kPool2d, {s("x", "1x5x5"), s("mode", "avg"), s("window", "3x3")}),
                 "pool2d: x: is 1x5x5 (3-D), must be 4-D"));
  CHECK(contains(failure(OpKind::kPool2d, {s("x", "1x1x5x5"), s("mode", "avg"), s("window", "3x3"),
                                           i("count_pad", 5)}),
                 "pool2d: count_pad: is 5"));
}

// ---- batchnorm --------------------------------------------------------------------------------

TEST_CASE("batchnorm: x then scale, bias, mean and var of C elements each") {
  auto r = parse(OpKind::kBatchNorm, {s("x", "2x3x4x5"), f("eps", 1e-3), i("relu", 1)});
  REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  const auto& b = std::get<BatchNorm>(*r);
  CHECK(b.eps == 1e-3);
  CHECK(b.relu);
  CHECK(b.y.to_string() == "2x3x4x5");
  CHECK(b.scale.shape.to_string() == "3");
  CHECK(b.scale.offset == 480);
  CHECK(b.bias.offset == 492);
  CHECK(b.mean.offset == 504);
  CHECK(b.var.offset == 516);
  CHECK(b.var.bytes == 12);

  auto nc = parse(OpKind::kBatchNorm, {s("x", "8x6"), i("eps", 1), i("mean_at", 4096)});
  REQUIRE_MESSAGE(nc.ok(), nc.error().to_string());
  CHECK(std::get<BatchNorm>(*nc).eps == 1.0);
  CHECK(std::get<BatchNorm>(*nc).mean.offset == 4096);
  CHECK(std::get<BatchNorm>(*nc).var.offset == 4096 + 24);
  CHECK(std::get<BatchNorm>(parse(OpKind::kBatchNorm, {s("x", "1x2")}).value()).eps == 1e-5);
}

TEST_CASE("batchnorm: errors") {
  CHECK(contains(failure(OpKind::kBatchNorm, {s("x", "2x3x4")}),
                 "batchnorm: x: is 2x3x4 (3-D), must be NxCxHxW or NxC"));
  CHECK(contains(failure(OpKind::kBatchNorm, {s("x", "2x3"), f("eps", 0.0)}),
                 "batchnorm: eps: is 0.000000, must be > 0"));
  CHECK(contains(failure(OpKind::kBatchNorm, {s("x", "2x3"), f("eps", -1.0)}), "must be > 0"));
  CHECK(contains(failure(OpKind::kBatchNorm, {s("x", "2x3"), s("eps", "small")}),
                 "batchnorm: eps: must be a number"));
  JobBuffers b{0, 24 + 4 * 12 - 1, 4096, 4096};
  CHECK(contains(failure(OpKind::kBatchNorm, {s("x", "2x3")}, b),
                 "batchnorm: var: var (3 f32, 12 bytes) at byte 60"));
}

// ---- gemm -------------------------------------------------------------------------------------

TEST_CASE("gemm: transposes give M, N and K") {
  struct Case {
    const char* a;
    const char* b;
    int64_t ta, tb, m, n, k;
  };
  for (const auto& c : {Case{"3x5", "5x7", 0, 0, 3, 7, 5}, Case{"5x3", "5x7", 1, 0, 3, 7, 5},
                        Case{"3x5", "7x5", 0, 1, 3, 7, 5}, Case{"5x3", "7x5", 1, 1, 3, 7, 5}}) {
    CAPTURE(c.ta);
    CAPTURE(c.tb);
    auto r =
        parse(OpKind::kGemm, {s("a", c.a), s("b", c.b), i("trans_a", c.ta), i("trans_b", c.tb)});
    REQUIRE_MESSAGE(r.ok(), r.error().to_string());
    const auto& g = std::get<Gemm>(*r);
    CHECK(g.m == c.m);
    CHECK(g.n == c.n);
    CHECK(g.k == c.k);
    CHECK(g.y.to_string() == "3x7");
    CHECK(g.a.offset == 0);
    CHECK(g.b.offset == 60);
    CHECK(g.alpha == 1.0);
    CHECK(g.beta == 0.0);
    CHECK_FALSE(g.c.has_value());
  }
}

TEST_CASE("gemm: alpha, beta and c") {
  auto r = parse(OpKind::kGemm,
                 {s("a", "2x3"), s("b", "3x4"), f("alpha", 0.5), i("beta", 2), s("c", "2x4")});
  REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  const auto& g = std::get<Gemm>(*r);
  CHECK(g.alpha == 0.5);
  CHECK(g.beta == 2.0);
  REQUIRE(g.c.has_value());
  CHECK(g.c->offset == 24 + 48);
  CHECK(g.c->bytes == 32);
}

TEST_CASE("gemm: errors") {
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3"), s("b", "4x5")}),
                 "gemm: b: op(b) is 4x5 (b 4x5, trans_b 0): its 4 rows must equal op(a)'s 3 "
                 "columns (a 2x3, trans_a 0)"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3"), s("b", "3x5"), f("beta", 1.0)}),
                 "gemm: c: is required when beta is not 0"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3"), s("b", "3x5"), s("c", "2x5")}),
                 "gemm: c: given with beta 0"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3"), s("b", "3x5"), i("c_at", 0)}),
                 "gemm: c_at: given without c"));
  CHECK(contains(
      failure(OpKind::kGemm, {s("a", "2x3"), s("b", "3x5"), f("beta", 1.0), s("c", "5x2")}),
      "gemm: c: is 5x2, must be MxN 2x5"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3x1"), s("b", "3x5")}),
                 "gemm: a: is 2x3x1 (3-D), must be 2-D"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3"), s("b", "3x5"), s("alpha", "1")}),
                 "gemm: alpha: must be a number"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3"), s("b", "3x5"),
                                         f("alpha", std::numeric_limits<double>::infinity())}),
                 "gemm: alpha: must be finite"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x3"), s("b", "3x5"), i("trans_c", 1)}),
                 "gemm: trans_c: unknown key"));
}

TEST_CASE("every op refuses an unknown dtype and a wrongly typed one") {
  CHECK(contains(failure(OpKind::kSoftmax, {s("x", "2x2"), s("dtype", "bf16")}),
                 "softmax: dtype: 'bf16' is not a dtype"));
  CHECK(contains(failure(OpKind::kGemm, {s("a", "2x2"), s("b", "2x2"), i("dtype", 1)}),
                 "gemm: dtype: must be a string"));
}

// Random parameters from every op's keys, random buffers: whatever the parser accepts must be
// safe for a backend (operands inside the input, aligned, clear of the output; the result fits).
TEST_CASE("random parameters: what parses is always within the buffers") {
  const uint64_t seed = test::test_seed(0x7e45);
  INFO("seed " << seed);
  test::Rng rng(seed);
  // Each op's keys, its required ones first; and keys of other ops.
  const std::vector<std::vector<const char*>> op_keys = {
      {"x", "w", "b", "stride", "pad", "dilation", "groups", "relu", "x_at", "w_at", "b_at"},
      {"x", "mode", "x_at"},
      {"x", "log", "x_at"},
      {"x", "mode", "window", "stride", "pad", "count_pad", "x_at"},
      {"x", "eps", "relu", "x_at", "scale_at", "bias_at", "mean_at", "var_at"},
      {"a", "b", "c", "trans_a", "trans_b", "alpha", "beta", "a_at", "b_at", "c_at"}};
  const size_t required[] = {2, 2, 1, 3, 1, 2};
  const char* words[] = {"relu", "sigmoid", "tanh", "max", "avg", "f32", "f16", "", "x"};
  auto dim = [&]() -> std::string {
    switch (rng.between(0, 19)) {
      case 0:
        return "0";
      case 1:
        return "2147483647";
      default:
        return std::to_string(rng.between(1, 5));
    }
  };
  auto shape = [&](uint64_t rank) {
    std::string t = dim();
    for (uint64_t d = 1; d < rank; ++d) t.append("x").append(dim());
    return t;
  };
  auto value_for = [&](std::string_view key) -> ParamValue {
    const uint64_t pick = rng.between(0, 29);
    if (pick == 0) return static_cast<int64_t>(rng.between(0, 6)) - 1;
    if (pick == 1) return static_cast<double>(rng.between(0, 4)) - 1.5;
    if (pick == 2) return std::string(words[rng.between(0, std::size(words) - 1)]);
    if (key == "mode") return std::string(words[rng.between(0, 4)]);
    if (key == "stride" || key == "pad" || key == "dilation" || key == "window") {
      return std::to_string(rng.between(0, 3)) + "x" + std::to_string(rng.between(0, 3));
    }
    if (key.size() > 3 && key.substr(key.size() - 3) == "_at") {
      return static_cast<int64_t>(rng.between(0, 1024) & ~uint64_t{1});
    }
    if (key == "x" || key == "w" || key == "a" || key == "b" || key == "c") {
      return shape(key == "x" || key == "w" ? 4 : 2);
    }
    if (key == "eps" || key == "alpha" || key == "beta") return static_cast<double>(pick % 8) / 4;
    return static_cast<int64_t>(rng.between(0, 2));
  };
  uint64_t parsed = 0;
  for (uint64_t iter = 0; iter < test::scaled(20000); ++iter) {
    const auto kind = static_cast<OpKind>(rng.between(0, 5));
    const auto& keys = op_keys[static_cast<size_t>(kind)];
    ParamWriter w;
    std::set<std::string> added;
    auto add = [&](const char* key) {
      // A key given twice now and then; each add may exceed the block (the entry is left out).
      if (added.insert(key).second || rng.chance(0.05)) (void)w.add(key, value_for(key));
    };
    for (size_t k = 0; k < required[static_cast<size_t>(kind)]; ++k) {
      if (rng.chance(0.95)) add(keys[k]);
    }
    const uint64_t extra = rng.between(0, 4);
    for (uint64_t k = 0; k < extra; ++k) {
      const auto& from = rng.chance(0.95) ? keys : op_keys[rng.between(0, 5)];
      add(from[rng.between(0, from.size() - 1)]);
    }
    if (rng.chance(0.1)) (void)w.add("dtype", std::string(rng.chance(0.5) ? "f16" : "f32"));
    auto block = ParamBlock::parse(w.data(), w.size());
    REQUIRE(block.ok());
    JobBuffers b{rng.between(0, 8), rng.between(0, 8192), 0, rng.between(0, 4096)};
    // Mostly an output after the input; else anywhere (often overlapping it).
    b.output_offset = rng.chance(0.8) ? b.input_offset + b.input_bytes + rng.between(0, 8)
                                      : rng.between(0, 12288);
    auto op = parse_tensor_op(kind, *block, b);
    if (!op) {
      CHECK(op.error().code() == ErrorCode::kInvalidArgument);
      CHECK(op.error().message().rfind(std::string(op_kind_name(kind)) + ": ", 0) == 0);
      continue;
    }
    ++parsed;
    const uint64_t esize = dtype_bytes(result_dtype(*op));
    auto operand = [&](const Operand& o) {
      CHECK(o.bytes == o.shape.elements() * esize);
      CHECK(o.offset + o.bytes <= b.input_bytes);
      CHECK((b.input_offset + o.offset) % esize == 0);
      const uint64_t begin = b.input_offset + o.offset, end = begin + o.bytes;
      CHECK((end <= b.output_offset || begin >= b.output_offset + b.output_capacity));
    };
    std::visit(
        [&](const auto& o) {
          using T = std::decay_t<decltype(o)>;
          if constexpr (std::is_same_v<T, Conv2d>) {
            operand(o.x);
            operand(o.w);
            if (o.b) operand(*o.b);
          } else if constexpr (std::is_same_v<T, BatchNorm>) {
            for (const auto* x : {&o.x, &o.scale, &o.bias, &o.mean, &o.var}) operand(*x);
          } else if constexpr (std::is_same_v<T, Gemm>) {
            operand(o.a);
            operand(o.b);
            if (o.c) operand(*o.c);
          } else {
            operand(o.x);
          }
        },
        *op);
    CHECK(result_bytes(*op) <= b.output_capacity);
    CHECK(b.output_offset % esize == 0);
  }
  MESSAGE(parsed << " of " << test::scaled(20000) << " random parameter sets parsed");
  CHECK(parsed > 0);
}

}  // namespace
}  // namespace gpuq::tensor
