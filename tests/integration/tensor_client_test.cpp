// Integration: the client side of the tensor ops against a real daemon's cpu pool: Client::conv2d
// and the other calls, with operands in separate buffers, compared with the float64 references
// (tests/support/reference_ops.hpp); their refusals before submitting (a buffer of another
// client, f16 for a cpu pool); and gpuqctl submit with several --input files, tensors included.
#include <fstream>
#include <iterator>
#include <random>

#include "gpuq/common/params.hpp"
#include "gpuq/common/tensor_ops.hpp"
#include "integration/integration_support.hpp"
#include "support/reference_ops.hpp"

#ifndef GPUQ_TEST_HAVE_ONEDNN
#error "build with -DGPUQ_TEST_HAVE_ONEDNN=0 or 1 (does gpuq-worker run tensor ops on cpu pools?)"
#endif

namespace gpuq::test {
namespace {

// Without oneDNN a cpu pool fails every tensor op with UnknownOp: the cases that run them skip.
constexpr bool kNoCpuTensorOps = GPUQ_TEST_HAVE_ONEDNN == 0;

// A scratch directory for gpuqctl's files, removed at the end of the test case.
class ScratchDir {
 public:
  ScratchDir() {
    char dir[] = "/tmp/gpuqt-tensor-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    path_ = dir;
  }
  ~ScratchDir() { run_command("rm -rf '" + path_ + "'"); }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_bytes(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  REQUIRE_MESSAGE(out.good(), "cannot write " << path);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot read " << path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

CommandResult gpuqctl(const DaemonProcess& daemon, const std::string& args) {
  return run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                     daemon.runtime_dir() + "' " + args + " 2>&1");
}

Tensor make_tensor(Client& client, Shape shape, DType dtype = DType::kF32) {
  const Buffer b = allocate(client, shape_bytes(shape, dtype));
  Result<Tensor> t = Tensor::make(b, std::move(shape), dtype);
  REQUIRE_MESSAGE(t.ok(), error_text(t));
  return t.value();
}

void fill_uniform(const Tensor& t, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  float* p = t.data_as<float>();
  for (uint64_t i = 0; i < t.elements(); ++i) p[i] = dist(rng);
}

// The op a worker parses from `spec`: the same parser, the same buffers.
tensor::TensorOp parse_spec(const JobSpec& spec) {
  ParamWriter writer;
  for (const JobParam& p : spec.params) {
    ParamValue v;
    if (p.type == JobParam::Type::kInt) v = p.int_value;
    if (p.type == JobParam::Type::kFloat) v = p.float_value;
    if (p.type == JobParam::Type::kString) v = p.string_value;
    REQUIRE(writer.add(p.key, v).ok());
  }
  Result<ParamBlock> block = ParamBlock::parse(writer.data(), writer.size());
  REQUIRE(block.ok());
  Result<tensor::TensorOp> op = tensor::parse_tensor_op(
      *tensor::op_kind_from_name(spec.op), block.value(),
      {spec.input.offset, spec.input.size, spec.output.offset, spec.output.size});
  REQUIRE_MESSAGE(op.ok(), error_text(op));
  return op.value();
}

// Runs `job` (already submitted from `spec`'s tensors) and compares y with the reference of
// the op the spec describes.
void check_against_reference(Result<Job> job, Result<JobSpec> spec, const Tensor& y) {
  REQUIRE_MESSAGE(spec.ok(), error_text(spec));
  REQUIRE_MESSAGE(job.ok(), "submit " << spec->op << ": " << error_text(job));
  const JobResult r = wait_done(job.value());
  CHECK(r.output_size == y.bytes());
  const tensor::TensorOp op = parse_spec(spec.value());
  const std::vector<double> want = reference_op(op, spec->input.data());
  REQUIRE(want.size() == y.elements());
  const Difference d = compare_result(want, y.data(), tensor::DType::kF32);
  CHECK_MESSAGE(d.worst <= tolerance(tensor::DType::kF32),
                spec->op << ": element " << d.index << " is " << d.got << ", want " << d.want);
}

}  // namespace

TEST_CASE("Client tensor calls run on a cpu pool and match the references" *
          doctest::skip(kNoCpuTensorOps)) {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  std::mt19937_64 rng(42);

  SUBCASE("conv2d with bias, padding, stride and groups; operands allocated out of order") {
    const Tensor b = make_tensor(client, {6});
    const Tensor w = make_tensor(client, {6, 2, 3, 3});
    const Tensor x = make_tensor(client, {2, 4, 9, 9});
    Conv2dOptions opts;
    opts.pad = {1, 1};
    opts.stride = {2, 1};
    opts.groups = 2;
    opts.relu = true;
    Result<Shape> shape = conv2d_result_shape(x.shape(), w.shape(), opts);
    REQUIRE(shape.ok());
    CHECK(shape.value() == Shape{2, 6, 5, 9});
    const Tensor y = make_tensor(client, shape.value());
    for (const Tensor* t : {&x, &w, &b}) fill_uniform(*t, rng);
    check_against_reference(client.conv2d(x, w, b, y, opts), conv2d_job(x, w, b, y, opts), y);
  }
  SUBCASE("gemm with transposed b, alpha, beta and c") {
    const Tensor a = make_tensor(client, {5, 7});
    const Tensor b = make_tensor(client, {3, 7});  // stored N x K
    const Tensor c = make_tensor(client, {5, 3});
    const Tensor y = make_tensor(client, {5, 3});
    GemmOptions opts;
    opts.trans_b = true;
    opts.alpha = 0.5;
    opts.beta = 2;
    for (const Tensor* t : {&a, &b, &c}) fill_uniform(*t, rng);
    check_against_reference(client.gemm(a, b, c, y, opts), gemm_job(a, b, c, y, opts), y);
  }
  SUBCASE("activation, softmax, pool2d and batchnorm") {
    const Tensor x = make_tensor(client, {2, 3, 6, 6});
    fill_uniform(x, rng);
    const Tensor same = make_tensor(client, x.shape());
    check_against_reference(client.activation(x, same, ActivationMode::kTanh),
                            activation_job(x, same, ActivationMode::kTanh), same);
    SoftmaxOptions log;
    log.log = true;
    check_against_reference(client.softmax(x, same, log), softmax_job(x, same, log), same);
    Pool2dOptions pool;
    pool.mode = PoolMode::kAvg;
    pool.window = {3, 3};
    pool.stride = std::array<int64_t, 2>{2, 2};
    pool.pad = {1, 1};
    const Tensor pooled = make_tensor(client, pool2d_result_shape(x.shape(), pool).value());
    check_against_reference(client.pool2d(x, pooled, pool), pool2d_job(x, pooled, pool), pooled);
    const Tensor scale = make_tensor(client, {3});
    const Tensor bias = make_tensor(client, {3});
    const Tensor mean = make_tensor(client, {3});
    const Tensor var = make_tensor(client, {3});
    for (const Tensor* t : {&scale, &bias, &mean}) fill_uniform(*t, rng);
    for (uint64_t i = 0; i < 3; ++i) var.data_as<float>()[i] = 0.5f + static_cast<float>(i);
    BatchNormOptions bn;
    bn.eps = 1e-3;
    check_against_reference(client.batchnorm(x, scale, bias, mean, var, same, bn),
                            batchnorm_job(x, scale, bias, mean, var, same, bn), same);
  }
}

TEST_CASE("gpuqctl submit conv2d with tensors in files matches the reference" *
          doctest::skip(kNoCpuTensorOps)) {
  DaemonProcess daemon(one_pool_config(1));
  ScratchDir dir;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  // x 1x3x8x8, w 4x3x3x3, b 4, pad 1x1: y 1x4x8x8.
  std::vector<float> x(1 * 3 * 8 * 8), w(4 * 3 * 3 * 3), b(4);
  for (std::vector<float>* v : {&x, &w, &b}) {
    for (float& e : *v) e = dist(rng);
  }
  write_bytes(dir.file("x.bin"), x.data(), x.size() * 4);
  write_bytes(dir.file("w.bin"), w.data(), w.size() * 4);
  write_bytes(dir.file("b.bin"), b.data(), b.size() * 4);

  const CommandResult run = gpuqctl(
      daemon, "submit conv2d --input '" + dir.file("x.bin") + "' --input '" + dir.file("w.bin") +
                  "' --input '" + dir.file("b.bin") +
                  "' --param x=1x3x8x8 --param w=4x3x3x3 --param b=4 --param pad=1x1 --output '" +
                  dir.file("y.bin") + "'");

  INFO("gpuqctl: " << run.output);
  REQUIRE(run.exit_code == 0);
  const std::string y = read_bytes(dir.file("y.bin"));
  REQUIRE(y.size() == 1 * 4 * 8 * 8 * 4);
  // The reference of the same params over the same bytes, packed as gpuqctl packs them.
  std::string input;
  for (const char* name : {"x.bin", "w.bin", "b.bin"}) input += read_bytes(dir.file(name));
  ParamWriter params;
  REQUIRE(params.add("x", std::string("1x3x8x8")).ok());
  REQUIRE(params.add("w", std::string("4x3x3x3")).ok());
  REQUIRE(params.add("b", std::string("4")).ok());
  REQUIRE(params.add("pad", std::string("1x1")).ok());
  Result<ParamBlock> block = ParamBlock::parse(params.data(), params.size());
  REQUIRE(block.ok());
  Result<tensor::TensorOp> op = tensor::parse_tensor_op(tensor::OpKind::kConv2d, block.value(),
                                                        {0, input.size(), 1 << 20, y.size()});
  REQUIRE_MESSAGE(op.ok(), error_text(op));
  const std::vector<double> want =
      reference_op(op.value(), reinterpret_cast<const std::byte*>(input.data()));
  const Difference d =
      compare_result(want, reinterpret_cast<const std::byte*>(y.data()), tensor::DType::kF32);
  CHECK_MESSAGE(d.worst <= tolerance(tensor::DType::kF32),
                "element " << d.index << " is " << d.got << ", want " << d.want);
}

TEST_CASE("gpuqctl submit concatenates several --input files in order") {
  DaemonProcess daemon(one_pool_config(1));
  ScratchDir dir;
  const std::string first = "first file, ";
  const std::string second = "then the second";
  write_bytes(dir.file("a.bin"), first.data(), first.size());
  write_bytes(dir.file("b.bin"), second.data(), second.size());

  const CommandResult run =
      gpuqctl(daemon, "submit echo --input '" + dir.file("a.bin") + "' --input '" +
                          dir.file("b.bin") + "' --output '" + dir.file("out.bin") + "'");

  INFO("gpuqctl: " << run.output);
  REQUIRE(run.exit_code == 0);
  CHECK(read_bytes(dir.file("out.bin")) == first + second);
}

TEST_CASE("gpuqctl submit of a tensor op checks files and shapes before submitting") {
  DaemonProcess daemon(one_pool_config(1));
  ScratchDir dir;
  const std::vector<char> x(1 * 3 * 8 * 8 * 4), w_short(400);
  write_bytes(dir.file("x.bin"), x.data(), x.size());
  write_bytes(dir.file("w.bin"), w_short.data(), w_short.size());
  const std::string inputs =
      "--input '" + dir.file("x.bin") + "' --input '" + dir.file("w.bin") + "' ";

  const CommandResult short_file =
      gpuqctl(daemon, "submit conv2d " + inputs + "--param x=1x3x8x8 --param w=4x3x3x3");
  CHECK(short_file.exit_code == 2);
  CHECK_MESSAGE(short_file.output.find("conv2d: --input '" + dir.file("w.bin") +
                                       "' holds 400 bytes, operand w (4x3x3x3 f32) needs 432") !=
                    std::string::npos,
                short_file.output);

  const CommandResult bad_shape =
      gpuqctl(daemon, "submit conv2d " + inputs + "--param x=1x3x8 --param w=4x3x3x3");
  CHECK(bad_shape.exit_code == 2);
  CHECK_MESSAGE(
      bad_shape.output.find("conv2d: x: is 1x3x8 (3-D), must be 4-D") != std::string::npos,
      bad_shape.output);

  const CommandResult missing =
      gpuqctl(daemon, "submit conv2d --input '" + dir.file("none.bin") + "' --param x=1x3x8x8");
  CHECK(missing.exit_code == 1);
  CHECK_MESSAGE(missing.output.find("cannot open '" + dir.file("none.bin") +
                                    "': No such file or directory") != std::string::npos,
                missing.output);
}

TEST_CASE("Client tensor calls refuse a buffer of another client and f16 on a cpu pool") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Client other = connect_client(daemon);
  const Tensor x = make_tensor(client, {2, 3});
  const Tensor b = make_tensor(client, {3, 4});
  const Tensor y = make_tensor(client, {2, 4});
  const Tensor foreign = make_tensor(other, {3, 4});

  Result<Job> job = client.gemm(x, foreign, std::nullopt, y);
  REQUIRE_FALSE(job.ok());
  CHECK(job.error().code() == ErrorCode::kInvalidArgument);
  CHECK_MESSAGE(job.error().message().rfind("gemm: b: its buffer (offset ", 0) == 0,
                job.error().message());

  const Tensor x16 = make_tensor(client, {2, 3}, DType::kF16);
  const Tensor b16 = make_tensor(client, {3, 4}, DType::kF16);
  const Tensor y16 = make_tensor(client, {2, 4}, DType::kF16);
  Result<Job> half = client.gemm(x16, b16, std::nullopt, y16);
  REQUIRE_FALSE(half.ok());
  CHECK(
      half.error().message() ==
      "gemm: dtype: f16 is not supported on cpu pools (f32 only), and pool 'cpu' is one; submit it "
      "to a gpu pool");

  // Refusals leave the client usable.
  check_echo_works(client);
}

}  // namespace gpuq::test
