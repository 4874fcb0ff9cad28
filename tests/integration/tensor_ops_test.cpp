// Integration: the tensor ops through a real gpuqd and its cpu pool's gpuq-worker. conv2d and
// gemm jobs with random values, checked against the float64 reference
// (tests/support/reference_ops.hpp); a bad shape and f16 fail with InvalidArgument naming the
// key. In a build without oneDNN (GPUQ_WITH_ONEDNN) the valid jobs must fail "not in this
// build" instead.
#include <cmath>
#include <limits>

#include "gpuq/common/tensor_ops.hpp"
#include "integration/integration_support.hpp"
#include "support/reference_ops.hpp"
#include "support/rng.hpp"

namespace gpuq::test {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The same parameters as the job's, for the reference (the worker parsed its own copy).
ParamBlock block_of(const std::vector<JobParam>& params) {
  ParamWriter w;
  for (const auto& p : params) {
    Result<void> r = p.type == JobParam::Type::kInt     ? w.add(p.key, p.int_value)
                     : p.type == JobParam::Type::kFloat ? w.add(p.key, p.float_value)
                                                        : w.add(p.key, p.string_value);
    REQUIRE(r.ok());
  }
  auto b = ParamBlock::parse(w.data(), w.size());
  REQUIRE(b.ok());
  return std::move(b).value();
}

// Runs `op` on the cpu pool with `params` over a fresh input buffer of `input_bytes` random
// floats in [-1, 1] and an output buffer of `output_bytes` (prefilled with NaN); with oneDNN,
// checks the result against the reference.
void check_tensor_job(Client& client, tensor::OpKind kind, std::vector<JobParam> params,
                      uint64_t input_bytes, uint64_t output_bytes, uint64_t seed) {
  const char* op = tensor::op_kind_name(kind);
  INFO(op << " seed " << seed);
  Buffer in = allocate(client, input_bytes);
  Buffer out = allocate(client, output_bytes);
  Rng rng(seed);
  for (uint64_t i = 0; i < input_bytes / 4; ++i) {
    const float v = static_cast<float>(static_cast<double>(rng.next() >> 11) * 0x1.0p-52 - 1.0);
    std::memcpy(in.data() + 4 * i, &v, 4);
  }
  for (uint64_t i = 0; i < output_bytes / 4; ++i) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(out.data() + 4 * i, &nan, 4);
  }
  const ParamBlock block = block_of(params);
  auto spec = tensor::parse_tensor_op(kind, block, {in.offset, in.size, out.offset, out.size});
  REQUIRE_MESSAGE(spec.ok(), error_text(spec));

  JobSpec spec_of_job = job_spec(op, in, out, "cpu");
  spec_of_job.params = std::move(params);
  Job job = submit_ok(client, spec_of_job);
  JobResult r = wait_result(job);
  if (!GPUQ_TEST_HAVE_ONEDNN) {
    CHECK(r.status == JobStatus::kFailed);
    CHECK(r.code == ErrorCode::kUnknownOp);
    CHECK(contains(r.message, "tensor ops on cpu pools are not in this build"));
    return;
  }
  REQUIRE_MESSAGE(r.status == JobStatus::kDone, error_code_name(r.code) << ": " << r.message);
  CHECK(r.output_size == tensor::result_bytes(*spec));
  const auto want = reference_op(*spec, in.data());
  const auto diff = compare_result(want, out.data(), tensor::DType::kF32);
  CHECK_MESSAGE(diff.worst <= tolerance(tensor::DType::kF32),
                "element " << diff.index << ": got " << diff.got << ", want " << diff.want);
  client.release(in);
  client.release(out);
}

TEST_CASE("tensor ops run on the cpu pool's worker and match the reference") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon, 8ull << 20);
  const uint64_t seed = test_seed(0x7e45'0f5);

  SUBCASE("conv2d with groups, stride, pad, dilation, bias and relu") {
    // x 2x6x17x13, w 8x3x3x3 (groups 2), b 8: y 2x8x9x11.
    const uint64_t x = 2 * 6 * 17 * 13, w = 8 * 3 * 3 * 3, b = 8;
    check_tensor_job(client, tensor::OpKind::kConv2d,
                     {JobParam::text("x", "2x6x17x13"), JobParam::text("w", "8x3x3x3"),
                      JobParam::text("b", "8"), JobParam::text("stride", "2x1"),
                      JobParam::text("pad", "1x1"), JobParam::text("dilation", "1x2"),
                      JobParam::integer("groups", 2), JobParam::integer("relu", 1)},
                     4 * (x + w + b), 4 * 2 * 8 * 9 * 11, seed);
  }

  SUBCASE("gemm with transposes, alpha, beta and c, b placed with b_at") {
    // op(a) = a^T: 37x29, op(b) = b^T: 29x41; c 37x41. b at byte 8192, c after it.
    const uint64_t c_at = 8192 + 4 * 41 * 29;
    check_tensor_job(client, tensor::OpKind::kGemm,
                     {JobParam::text("a", "29x37"), JobParam::text("b", "41x29"),
                      JobParam::integer("trans_a", 1), JobParam::integer("trans_b", 1),
                      JobParam::real("alpha", 0.75), JobParam::real("beta", -1.5),
                      JobParam::text("c", "37x41"), JobParam::integer("b_at", 8192)},
                     c_at + 4 * 37 * 41, 4 * 37 * 41, seed + 1);
  }
}

TEST_CASE("a tensor job with a bad shape or f16 on the cpu pool fails with InvalidArgument") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon, 1ull << 20);
  Buffer in = allocate(client, 4096);
  Buffer out = allocate(client, 4096);

  JobSpec bad = job_spec("conv2d", in, out, "cpu");
  bad.params = {JobParam::text("x", "1x4x8x8"), JobParam::text("w", "2x3x3x3")};
  Job job = submit_ok(client, bad);
  JobResult r = wait_result(job);
  CHECK(r.status == JobStatus::kFailed);
  CHECK(r.code == ErrorCode::kInvalidArgument);
  CHECK(r.message ==
        "conv2d: w: is 2x3x3x3: its 3 channels x groups 1 must equal x's 4 channels (x is "
        "1x4x8x8)");

  JobSpec half = job_spec("gemm", in, out, "cpu");
  half.params = {JobParam::text("a", "4x4"), JobParam::text("b", "4x4"),
                 JobParam::text("dtype", "f16")};
  Job job2 = submit_ok(client, half);
  JobResult r2 = wait_result(job2);
  CHECK(r2.status == JobStatus::kFailed);
  if (GPUQ_TEST_HAVE_ONEDNN) {
    CHECK(r2.code == ErrorCode::kInvalidArgument);
    CHECK(contains(r2.message, "gemm: dtype: f16 is not supported on cpu pools"));
  } else {
    CHECK(r2.code == ErrorCode::kUnknownOp);
  }
  // The worker is still there and serves the next job.
  check_echo_works(client);
}

}  // namespace
}  // namespace gpuq::test
