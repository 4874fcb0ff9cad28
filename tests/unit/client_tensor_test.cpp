// Unit: the client library's tensor helpers (gpuq/tensor.hpp) and the JobSpecs its builders
// make (conv2d_job() and the others): input span, "_at" offsets, parameter keys and values,
// defaults left out, and the errors raised before anything is submitted. No daemon: the
// tensors are raw views (Buffers with an offset and no address).
#include <doctest/doctest.h>

#include <optional>
#include <string>

#include "gpuq/client.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/tensor_ops.hpp"

namespace {

using gpuq::Buffer;
using gpuq::DType;
using gpuq::JobParam;
using gpuq::JobSpec;
using gpuq::Result;
using gpuq::Shape;
using gpuq::Tensor;

// A tensor at `offset` of the segment, its buffer exactly its bytes.
Tensor at(uint64_t offset, Shape shape, DType dtype = DType::kF32) {
  const uint64_t bytes = gpuq::shape_bytes(shape, dtype);
  REQUIRE(bytes > 0);
  Result<Tensor> t = Tensor::make(Buffer{offset, bytes, nullptr}, std::move(shape), dtype);
  REQUIRE_MESSAGE(t.ok(), t.error().to_string());
  return t.value();
}

// The parameters as "key=value" strings, in order: what the test compares.
std::vector<std::string> params_of(const JobSpec& spec) {
  std::vector<std::string> out;
  for (const JobParam& p : spec.params) {
    switch (p.type) {
      case JobParam::Type::kInt:
        out.push_back(p.key + "=" + std::to_string(p.int_value));
        break;
      case JobParam::Type::kFloat:
        out.push_back(p.key + "=" + std::to_string(p.float_value) + "f");
        break;
      case JobParam::Type::kString:
        out.push_back(p.key + "='" + p.string_value + "'");
        break;
    }
  }
  return out;
}

// Encodes the params as the client library does at submit, parses them back, and runs the
// workers' parser (gpuq/common/tensor_ops.hpp) on them with the spec's buffers: the job the
// builder made is one a worker accepts, with y's size as its result.
void require_parses(const JobSpec& spec) {
  gpuq::ParamWriter writer;
  for (const JobParam& p : spec.params) {
    gpuq::ParamValue v;
    if (p.type == JobParam::Type::kInt) v = p.int_value;
    if (p.type == JobParam::Type::kFloat) v = p.float_value;
    if (p.type == JobParam::Type::kString) v = p.string_value;
    Result<void> r = writer.add(p.key, v);
    REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  }
  Result<gpuq::ParamBlock> block = gpuq::ParamBlock::parse(writer.data(), writer.size());
  REQUIRE_MESSAGE(block.ok(), block.error().to_string());
  CHECK(block->entries().size() == spec.params.size());

  std::optional<gpuq::tensor::OpKind> kind = gpuq::tensor::op_kind_from_name(spec.op);
  REQUIRE(kind.has_value());
  const gpuq::tensor::JobBuffers buffers{spec.input.offset, spec.input.size, spec.output.offset,
                                         spec.output.size};
  Result<gpuq::tensor::TensorOp> op = gpuq::tensor::parse_tensor_op(*kind, *block, buffers);
  REQUIRE_MESSAGE(op.ok(), op.error().to_string());
  CHECK(gpuq::tensor::result_bytes(op.value()) == spec.output.size);
}

std::string error_of(const Result<JobSpec>& r) {
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == gpuq::ErrorCode::kInvalidArgument);
  return r.error().message();
}

using Params = std::vector<std::string>;

}  // namespace

TEST_CASE("shapes: text form, element counts and their limits") {
  CHECK(gpuq::shape_string({2, 3, 32, 32}) == "2x3x32x32");
  CHECK(gpuq::shape_string({7}) == "7");
  CHECK(gpuq::shape_elements({2, 3, 4}).value() == 24);
  CHECK(gpuq::shape_bytes({2, 3, 4}, DType::kF16) == 48);
  CHECK(gpuq::shape_bytes({}, DType::kF32) == 0);
  CHECK(gpuq::shape_bytes({1, 0}, DType::kF32) == 0);

  Result<uint64_t> empty = gpuq::shape_elements({}, "x");
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.error().message() == "x: shape '' has 0 dimensions, must have 1 to 4");
  CHECK_FALSE(gpuq::shape_elements({1, 2, 3, 4, 5}).ok());
  Result<uint64_t> zero = gpuq::shape_elements({2, 0, 3}, "w");
  REQUIRE_FALSE(zero.ok());
  CHECK(zero.error().message() == "w: shape 2x0x3: dimension 1 is 0, must be in [1, 2147483647]");
  CHECK_FALSE(gpuq::shape_elements({int64_t{1} << 31}).ok());
  Result<uint64_t> huge = gpuq::shape_elements({1 << 30, 1 << 30});
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().message().find("more than 2^48 elements") != std::string::npos);
}

TEST_CASE("Tensor::make checks that the buffer holds the shape's bytes") {
  Result<Tensor> ok = Tensor::make(Buffer{128, 100, nullptr}, {5, 5}, DType::kF32);
  REQUIRE(ok.ok());
  CHECK(ok->bytes() == 100);
  CHECK(ok->elements() == 25);
  CHECK(ok->buffer().offset == 128);

  Result<Tensor> small = Tensor::make(Buffer{0, 99, nullptr}, {5, 5});
  REQUIRE_FALSE(small.ok());
  CHECK(small.error().code() == gpuq::ErrorCode::kInvalidArgument);
  CHECK(small.error().message() == "tensor: a f32 5x5 tensor needs 100 bytes, the buffer has 99");
  CHECK(Tensor::make(Buffer{0, 50, nullptr}, {5, 5}, DType::kF16).ok());
  CHECK_FALSE(Tensor::make(Buffer{0, 1000, nullptr}, {5, -5}).ok());
}

TEST_CASE("conv2d_job: operands back to back need no _at, defaults are left out") {
  const Tensor x = at(0, {1, 3, 8, 8});    // 768 bytes
  const Tensor w = at(768, {4, 3, 3, 3});  // 432 bytes
  const Tensor y = at(4096, {1, 4, 8, 8});
  gpuq::Conv2dOptions opts;
  opts.pad = {1, 1};
  Result<JobSpec> spec = gpuq::conv2d_job(x, w, std::nullopt, y, opts);
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  require_parses(*spec);
  CHECK(spec->op == "conv2d");
  CHECK(spec->input.offset == 0);
  CHECK(spec->input.size == 768 + 432);
  CHECK(spec->output.offset == 4096);
  CHECK(spec->output.size == 1 * 4 * 8 * 8 * 4);
  CHECK(params_of(*spec) == Params{"x='1x3x8x8'", "w='4x3x3x3'", "pad='1x1'"});
}

TEST_CASE("conv2d_job: separate buffers give the span over them and _at offsets") {
  const Tensor w = at(1024, {4, 3, 3, 3});  // 432 bytes
  const Tensor x = at(2048, {1, 3, 8, 8});  // 768 bytes, the highest
  const Tensor b = at(960, {4});            // 16 bytes, the lowest
  const Tensor y = at(8192, {1, 4, 3, 2});  // W: dilated filter 5, (8 - 5) / 2 + 1 = 2
  gpuq::Conv2dOptions opts;
  opts.stride = {2, 2};
  opts.dilation = {1, 2};
  opts.relu = true;
  Result<JobSpec> spec = gpuq::conv2d_job(x, w, b, y, opts);
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  require_parses(*spec);
  CHECK(spec->input.offset == 960);
  CHECK(spec->input.size == 2048 + 768 - 960);
  CHECK(params_of(*spec) == Params{"x='1x3x8x8'", "w='4x3x3x3'", "b='4'", "stride='2x2'",
                                   "dilation='1x2'", "relu=1", "x_at=1088", "w_at=64", "b_at=0"});
}

TEST_CASE("conv2d_job: the first operand in place, a later one not: _at from there on") {
  const Tensor x = at(0, {1, 4, 4, 4});    // 256 bytes
  const Tensor w = at(512, {2, 2, 1, 1});  // groups 2: C / groups = 2
  const Tensor y = at(4096, {1, 2, 4, 4});
  gpuq::Conv2dOptions opts;
  opts.groups = 2;
  Result<JobSpec> spec = gpuq::conv2d_job(x, w, std::nullopt, y, opts);
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  require_parses(*spec);
  CHECK(params_of(*spec) == Params{"x='1x4x4x4'", "w='2x2x1x1'", "groups=2", "w_at=512"});
}

TEST_CASE("conv2d_job: inconsistent shapes and options are refused before submitting") {
  const Tensor x = at(0, {1, 3, 8, 8});
  const Tensor w = at(1024, {4, 3, 3, 3});
  const Tensor y = at(4096, {1, 4, 6, 6});

  CHECK(error_of(gpuq::conv2d_job(x, w, std::nullopt, at(4096, {1, 4, 8, 8}), {})) ==
        "conv2d: y: shape 1x4x8x8, the result's is 1x4x6x6");
  CHECK(error_of(gpuq::conv2d_job(x, at(1024, {4, 2, 3, 3}), std::nullopt, y, {})) ==
        "conv2d: w: shape 4x2x3x3: dimension 1 is 2, must be C / groups = 3 / 1 = 3 (x is "
        "1x3x8x8)");
  CHECK(error_of(gpuq::conv2d_job(at(0, {3, 8, 8}), w, std::nullopt, y, {})) ==
        "conv2d: x: shape 3x8x8 has 3 dimensions, the op needs 4");
  CHECK(error_of(gpuq::conv2d_job(x, w, at(2048, {5}), y, {})) ==
        "conv2d: b: shape 5 has 5 elements, must have K = 4");
  gpuq::Conv2dOptions bad_groups;
  bad_groups.groups = 2;
  CHECK(error_of(gpuq::conv2d_job(x, w, std::nullopt, y, bad_groups)) ==
        "conv2d: groups: 2 must be >= 1 and divide C (3) and K (4)");
  gpuq::Conv2dOptions zero_stride;
  zero_stride.stride = {0, 1};
  CHECK(error_of(gpuq::conv2d_job(x, w, std::nullopt, y, zero_stride)) ==
        "conv2d: stride: 0x1 is out of range: each must be in [1, 2147483647]");
  CHECK(error_of(gpuq::conv2d_job(at(0, {1, 3, 2, 2}), w, std::nullopt, y, {})) ==
        "conv2d: H: the padded input (2 + 2 x 0 = 2) is shorter than the dilated filter (3): "
        "the result would be empty");
  // y over an operand; an operand of another dtype; an unaligned operand.
  CHECK(error_of(gpuq::conv2d_job(x, w, std::nullopt, at(512, {1, 4, 6, 6}), {})) ==
        "conv2d: y: bytes [512, 1088) overlap operand x's [0, 768)");
  CHECK(error_of(gpuq::conv2d_job(x, at(1024, {4, 3, 3, 3}, DType::kF16), std::nullopt, y, {})) ==
        "conv2d: w: dtype f16, the operand x is f32 (every operand and y share one)");
  CHECK(error_of(gpuq::conv2d_job(x, at(1026, {4, 3, 3, 3}), std::nullopt, y, {})) ==
        "conv2d: w: offset 1026 in the segment is not a multiple of the element size 4");
  CHECK(error_of(gpuq::conv2d_job(x, w, std::nullopt, Tensor(), {})) ==
        "conv2d: y: an empty Tensor (use Tensor::make)");
}

TEST_CASE("conv2d_job: f16 sends its dtype") {
  const Tensor x = at(0, {1, 3, 8, 8}, DType::kF16);
  const Tensor w = at(384, {4, 3, 3, 3}, DType::kF16);
  const Tensor y = at(4096, {1, 4, 6, 6}, DType::kF16);
  Result<JobSpec> spec = gpuq::conv2d_job(x, w, std::nullopt, y, {});
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  require_parses(*spec);
  CHECK(params_of(*spec) == Params{"x='1x3x8x8'", "w='4x3x3x3'", "dtype='f16'"});
  CHECK(spec->output.size == 4 * 6 * 6 * 2);
}

TEST_CASE("conv2d_job: parameters over 192 bytes are refused with the key at fault") {
  // Large dimensions spell long shapes; every option away from its default and every operand
  // placed with _at.
  const int64_t big = 1000000000;
  const Tensor w = at(0, {big, 1, 1, 1});
  const Tensor x = at(uint64_t{1} << 33, {1, big, 1, 1});
  const Tensor b = at(uint64_t{1} << 34, {big});
  const Tensor y = at(uint64_t{1} << 35, {1, big, 3, 3});
  gpuq::Conv2dOptions opts;
  opts.groups = big;
  opts.stride = {big, big};
  opts.dilation = {big, big};
  opts.pad = {big, big};
  opts.relu = true;
  const std::string message = error_of(gpuq::conv2d_job(x, w, b, y, opts));
  CHECK(message.rfind("conv2d: params exceed 192 bytes at key '", 0) == 0);
}

TEST_CASE("activation_job and softmax_job") {
  const Tensor x = at(0, {2, 10});
  const Tensor y = at(1024, {2, 10});
  Result<JobSpec> act = gpuq::activation_job(x, y, gpuq::ActivationMode::kSigmoid);
  REQUIRE(act.ok());
  require_parses(*act);
  CHECK(act->op == "activation");
  CHECK(params_of(*act) == Params{"x='2x10'", "mode='sigmoid'"});
  Result<JobSpec> relu = gpuq::activation_job(at(0, {7}), at(64, {7}), gpuq::ActivationMode::kRelu);
  REQUIRE(relu.ok());
  require_parses(*relu);
  CHECK(params_of(*relu) == Params{"x='7'", "mode='relu'"});
  CHECK(error_of(gpuq::activation_job(x, at(1024, {20}), gpuq::ActivationMode::kTanh)) ==
        "activation: y: shape 20, the result's is 2x10");

  Result<JobSpec> soft = gpuq::softmax_job(x, y);
  REQUIRE(soft.ok());
  require_parses(*soft);
  CHECK(params_of(*soft) == Params{"x='2x10'"});
  gpuq::SoftmaxOptions log;
  log.log = true;
  Result<JobSpec> log_soft = gpuq::softmax_job(x, y, log);
  REQUIRE(log_soft.ok());
  require_parses(*log_soft);
  CHECK(params_of(*log_soft) == Params{"x='2x10'", "log=1"});
  CHECK(error_of(gpuq::softmax_job(at(0, {20}), at(1024, {20}))) ==
        "softmax: x: shape 20 has 1 dimensions, the op needs 2 to 4");
}

TEST_CASE("pool2d_job: stride defaults to the window") {
  const Tensor x = at(0, {1, 2, 8, 8});
  gpuq::Pool2dOptions opts;
  opts.window = {2, 2};
  Result<JobSpec> spec = gpuq::pool2d_job(x, at(1024, {1, 2, 4, 4}), opts);
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  require_parses(*spec);
  CHECK(params_of(*spec) == Params{"x='1x2x8x8'", "mode='max'", "window='2x2'"});

  opts.mode = gpuq::PoolMode::kAvg;
  opts.stride = std::array<int64_t, 2>{1, 1};
  opts.pad = {1, 1};
  opts.count_pad = true;
  Result<JobSpec> avg = gpuq::pool2d_job(x, at(1024, {1, 2, 9, 9}), opts);
  REQUIRE_MESSAGE(avg.ok(), avg.error().to_string());
  require_parses(*avg);
  CHECK(params_of(*avg) == Params{"x='1x2x8x8'", "mode='avg'", "window='2x2'", "stride='1x1'",
                                  "pad='1x1'", "count_pad=1"});
  opts.pad = {2, 0};
  CHECK(error_of(gpuq::pool2d_job(x, at(1024, {1, 2, 9, 9}), opts)) ==
        "pool2d: pad: 2x0 must be less than the window 2x2");
}

TEST_CASE("batchnorm_job: four per-channel operands, eps only when not the default") {
  const Tensor x = at(0, {2, 3, 4, 4});  // 384 bytes
  const Tensor scale = at(384, {3});
  const Tensor bias = at(396, {3});
  const Tensor mean = at(408, {3});
  const Tensor var = at(420, {3});
  const Tensor y = at(4096, {2, 3, 4, 4});
  Result<JobSpec> spec = gpuq::batchnorm_job(x, scale, bias, mean, var, y);
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  require_parses(*spec);
  CHECK(params_of(*spec) == Params{"x='2x3x4x4'"});
  CHECK(spec->input.size == 432);

  gpuq::BatchNormOptions opts;
  opts.eps = 1e-3;
  opts.relu = true;
  const Tensor var_apart = at(1024, {3});
  Result<JobSpec> apart = gpuq::batchnorm_job(x, scale, bias, mean, var_apart, y, opts);
  REQUIRE(apart.ok());
  require_parses(*apart);
  CHECK(params_of(*apart) == Params{"x='2x3x4x4'", "eps=0.001000f", "relu=1", "var_at=1024"});
  CHECK(error_of(gpuq::batchnorm_job(x, at(384, {4}), bias, mean, var, y)) ==
        "batchnorm: scale: shape 4 has 4 elements, must have C = 3 (x is 2x3x4x4)");
  opts.eps = 0;
  CHECK(error_of(gpuq::batchnorm_job(x, scale, bias, mean, var, y, opts)) ==
        "batchnorm: eps: 0 must be > 0");
}

TEST_CASE("gemm_job: transposes, alpha and beta, and c exactly when beta != 0") {
  const Tensor a = at(0, {4, 3});   // stored K x M with trans_a: M = 3, K = 4
  const Tensor b = at(64, {5, 4});  // stored N x K with trans_b: N = 5
  const Tensor y = at(1024, {3, 5});
  gpuq::GemmOptions opts;
  opts.trans_a = true;
  opts.trans_b = true;
  Result<JobSpec> spec = gpuq::gemm_job(a, b, std::nullopt, y, opts);
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  require_parses(*spec);
  CHECK(params_of(*spec) == Params{"a='4x3'", "b='5x4'", "trans_a=1", "trans_b=1", "b_at=64"});
  CHECK(spec->input.size == 64 + 80);

  opts.alpha = 2;
  opts.beta = 0.5;
  const Tensor c = at(512, {3, 5});
  Result<JobSpec> with_c = gpuq::gemm_job(a, b, c, y, opts);
  REQUIRE_MESSAGE(with_c.ok(), with_c.error().to_string());
  require_parses(*with_c);
  CHECK(params_of(*with_c) == Params{"a='4x3'", "b='5x4'", "c='3x5'", "trans_a=1", "trans_b=1",
                                     "alpha=2.000000f", "beta=0.500000f", "b_at=64", "c_at=512"});
  CHECK(error_of(gpuq::gemm_job(a, b, std::nullopt, y, opts)) ==
        "gemm: c: beta is 0.500000: c must be given");
  CHECK(error_of(gpuq::gemm_job(a, b, at(512, {5, 3}), y, opts)) ==
        "gemm: c: shape 5x3, must be M x N = 3x5");
  CHECK(error_of(gpuq::gemm_job(a, b, c, y, {})).find("gemm: b: op(a) is 4x3") == 0);
  opts.beta = 0;
  CHECK(error_of(gpuq::gemm_job(a, b, c, y, opts)) ==
        "gemm: c: given while beta is 0 (c is read only when beta != 0)");
}
