// Unit tests of the CPU worker's tensor ops (daemon/worker/cpu_tensor_ops.cpp, oneDNN): random
// shapes and values through OpBackend::run with a real OpContext over one arena, each result
// compared with the float64 reference (tests/support/reference_ops.hpp). In a build without
// oneDNN only the "not in this build" case runs; the others report skipped.
// GPUQ_TEST_SEED=<n> replays a run.
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_tensor_ops.hpp"
#include "op_backend.hpp"
#include "ops.hpp"
#include "support/reference_ops.hpp"
#include "support/rng.hpp"
#include "support/test_support.hpp"

namespace gpuq::daemon {
namespace {

using tensor::OpKind;
const bool kNoOneDnn = !cpu_tensor_ops_available();

const OpInfo& op_named(const char* name) {
  for (const auto& op : op_registry()) {
    if (std::string(op.name) == name) return op;
  }
  FAIL("no op " << name);
  return op_registry()[0];
}

std::string text(const std::vector<Param>& params) {
  std::string s;
  for (const auto& p : params) {
    s += p.key + "=";
    if (const auto* i = std::get_if<int64_t>(&p.value)) s += std::to_string(*i);
    if (const auto* d = std::get_if<double>(&p.value)) s += std::to_string(*d);
    if (const auto* t = std::get_if<std::string>(&p.value)) s += *t;
    s += " ";
  }
  return s;
}

std::string dims(std::initializer_list<uint64_t> d) {
  std::string s;
  for (uint64_t v : d) {
    if (!s.empty()) s += 'x';
    s += std::to_string(v);
  }
  return s;
}

// One job: an arena holding the input buffer (the operands where the parser puts them, random
// values in [-1, 1]; batchnorm's var in [0.1, 2]) and, after it, the output buffer.
struct Job {
  OpKind kind;
  std::vector<Param> params;
  ParamBlock block;
  tensor::TensorOp spec;
  std::vector<float> arena;  // floats: 4-byte aligned
  uint64_t input_bytes = 0, output_offset = 0, output_capacity = 0;

  const std::byte* input() const { return reinterpret_cast<const std::byte*>(arena.data()); }
  std::byte* output() { return reinterpret_cast<std::byte*>(arena.data()) + output_offset; }
};

ParamBlock block_of(const std::vector<Param>& params) {
  ParamWriter w;
  for (const auto& p : params) REQUIRE(w.add(p.key, p.value).ok());
  auto b = ParamBlock::parse(w.data(), w.size());
  REQUIRE(b.ok());
  return std::move(b).value();
}

double uniform(test::Rng& rng, double lo, double hi) {
  return lo + (hi - lo) * static_cast<double>(rng.next() >> 11) * 0x1.0p-53;
}

Job make_job(OpKind kind, std::vector<Param> params, test::Rng& rng) {
  Job j{kind, std::move(params), ParamBlock{}, tensor::Gemm{}, {}, 0, 0, 0};
  j.block = block_of(j.params);
  // Parse once against unbounded buffers to learn where the operands go.
  constexpr uint64_t kHuge = uint64_t{1} << 40;
  auto probe = tensor::parse_tensor_op(kind, j.block, {0, kHuge, kHuge, kHuge});
  REQUIRE_MESSAGE(probe.ok(), probe.error().to_string(), " for ", text(j.params));
  uint64_t in = 0;
  std::visit(
      [&](const auto& o) {
        auto extend = [&](const tensor::Operand& x) { in = std::max(in, x.offset + x.bytes); };
        using T = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<T, tensor::Conv2d>) {
          extend(o.x);
          extend(o.w);
          if (o.b) extend(*o.b);
        } else if constexpr (std::is_same_v<T, tensor::BatchNorm>) {
          for (const auto* x : {&o.x, &o.scale, &o.bias, &o.mean, &o.var}) extend(*x);
        } else if constexpr (std::is_same_v<T, tensor::Gemm>) {
          extend(o.a);
          extend(o.b);
          if (o.c) extend(*o.c);
        } else {
          extend(o.x);
        }
      },
      *probe);
  j.input_bytes = (in + 63) / 64 * 64;
  j.output_offset = j.input_bytes + 64;
  j.output_capacity = tensor::result_bytes(*probe);
  j.arena.assign((j.output_offset + j.output_capacity) / 4, 0.f);
  for (uint64_t i = 0; i < j.input_bytes / 4; ++i) {
    j.arena[i] = static_cast<float>(uniform(rng, -1, 1));
  }
  if (const auto* bn = std::get_if<tensor::BatchNorm>(&*probe)) {
    for (uint64_t i = 0; i < bn->var.bytes / 4; ++i) {
      j.arena[bn->var.offset / 4 + i] = static_cast<float>(uniform(rng, 0.1, 2));
    }
  }
  // The output starts as NaN, so that an element left unwritten fails the comparison.
  for (uint64_t i = j.output_offset / 4; i < j.arena.size(); ++i) {
    j.arena[i] = std::numeric_limits<float>::quiet_NaN();
  }
  auto spec = tensor::parse_tensor_op(kind, j.block,
                                      {0, j.input_bytes, j.output_offset, j.output_capacity});
  REQUIRE_MESSAGE(spec.ok(), spec.error().to_string());
  j.spec = std::move(spec).value();
  return j;
}

Result<OpOutput> run_job(Job& j, const std::atomic<uint32_t>& cancel) {
  OpContext ctx{j.input(), j.input_bytes, j.output(), j.output_capacity,
                j.block,   cancel,        0,          j.output_offset};
  return cpu_backend().run(op_named(tensor::op_kind_name(j.kind)), ctx);
}

// Runs the job on the backend and compares its result with the reference.
void check_job(OpKind kind, std::vector<Param> params, test::Rng& rng) {
  Job j = make_job(kind, std::move(params), rng);
  CAPTURE(text(j.params));
  std::atomic<uint32_t> cancel{0};
  auto r = run_job(j, cancel);
  REQUIRE_MESSAGE(r.ok(), r.error().to_string());
  CHECK(r->output_bytes == j.output_capacity);
  const auto want = test::reference_op(j.spec, j.input());
  const auto diff = test::compare_result(want, j.output(), tensor::DType::kF32);
  CHECK_MESSAGE(diff.worst <= test::tolerance(tensor::DType::kF32), "element ", diff.index,
                ": got ", diff.got, ", want ", diff.want, " (error ", diff.worst, ")");
}

Param s(const char* key, const std::string& value) {
  return Param{key, value};
}
Param i(const char* key, int64_t value) {
  return Param{key, value};
}
Param f(const char* key, double value) {
  return Param{key, value};
}
uint64_t pick(test::Rng& rng, uint64_t lo, uint64_t hi) {
  return rng.between(lo, hi);
}

const uint64_t kSeed = test::test_seed(0x5eed'c0de);
const uint64_t kCases = test::scaled(40);

TEST_CASE("cpu backend: its tensor ops run oneDNN on one thread" * doctest::skip(kNoOneDnn)) {
  REQUIRE(cpu_backend().start().ok());
  CHECK(cpu_backend().describe()["tensor_ops"] == "onednn");
  using MaxThreads = int (*)();
  void* sym = dlsym(RTLD_DEFAULT, "omp_get_max_threads");
  if (sym != nullptr) CHECK(reinterpret_cast<MaxThreads>(sym)() == 1);
}

TEST_CASE("cpu backend: conv2d matches the reference" * doctest::skip(kNoOneDnn)) {
  INFO("seed " << kSeed);
  test::Rng rng(kSeed);
  for (uint64_t iter = 0; iter < kCases; ++iter) {
    const uint64_t g = pick(rng, 1, 3), cg = pick(rng, 1, 4), kg = pick(rng, 1, 4);
    const uint64_t r = pick(rng, 1, 5), sw = pick(rng, 1, 5);
    const uint64_t dh = pick(rng, 1, 3), dw = pick(rng, 1, 3);
    const uint64_t ph = pick(rng, 0, 2), pw = pick(rng, 0, 2);
    const uint64_t spanh = dh * (r - 1) + 1, spanw = dw * (sw - 1) + 1;
    const uint64_t h = std::max<uint64_t>(1, spanh + pick(rng, 0, 9) - std::min(spanh - 1, 2 * ph));
    const uint64_t w = std::max<uint64_t>(1, spanw + pick(rng, 0, 9) - std::min(spanw - 1, 2 * pw));
    std::vector<Param> p{s("x", dims({pick(rng, 1, 3), cg * g, h, w})),
                         s("w", dims({kg * g, cg, r, sw}))};
    if (rng.chance(0.5)) p.push_back(s("b", std::to_string(kg * g)));
    p.push_back(s("stride", dims({pick(rng, 1, 3), pick(rng, 1, 3)})));
    p.push_back(s("pad", std::to_string(ph) + "x" + std::to_string(pw)));
    p.push_back(s("dilation", dims({dh, dw})));
    if (g > 1 || rng.chance(0.3)) p.push_back(i("groups", static_cast<int64_t>(g)));
    if (rng.chance(0.5)) p.push_back(i("relu", 1));
    check_job(OpKind::kConv2d, p, rng);
  }
}

TEST_CASE("cpu backend: a larger conv2d, and operands placed with _at" * doctest::skip(kNoOneDnn)) {
  test::Rng rng(kSeed + 1);
  check_job(
      OpKind::kConv2d,
      {s("x", "2x16x23x19"), s("w", "24x16x3x3"), s("b", "24"), s("pad", "1x1"), i("relu", 1)},
      rng);
  // w after b, with gaps between them.
  check_job(OpKind::kConv2d,
            {s("x", "1x3x7x7"), s("w", "4x3x2x2"), s("b", "4"), i("b_at", 4096), i("w_at", 8192),
             s("stride", "2x2")},
            rng);
}

TEST_CASE("cpu backend: activation matches the reference" * doctest::skip(kNoOneDnn)) {
  INFO("seed " << kSeed);
  test::Rng rng(kSeed + 2);
  for (uint64_t iter = 0; iter < kCases; ++iter) {
    std::string x;
    const uint64_t rank = pick(rng, 1, 4);
    for (uint64_t d = 0; d < rank; ++d) {
      if (d != 0) x += 'x';
      x += std::to_string(pick(rng, 1, 9));
    }
    const char* modes[] = {"relu", "sigmoid", "tanh"};
    check_job(OpKind::kActivation, {s("x", x), s("mode", modes[pick(rng, 0, 2)])}, rng);
  }
}

TEST_CASE("cpu backend: softmax and log-softmax match the reference" * doctest::skip(kNoOneDnn)) {
  INFO("seed " << kSeed);
  test::Rng rng(kSeed + 3);
  for (uint64_t iter = 0; iter < kCases; ++iter) {
    std::string x = std::to_string(pick(rng, 1, 5)) + "x" + std::to_string(pick(rng, 1, 33));
    const uint64_t extra = pick(rng, 0, 2);
    for (uint64_t d = 0; d < extra; ++d) x.append("x").append(std::to_string(pick(rng, 1, 6)));
    std::vector<Param> p{s("x", x)};
    if (rng.chance(0.5)) p.push_back(i("log", 1));
    check_job(OpKind::kSoftmax, p, rng);
  }
}

TEST_CASE("cpu backend: pool2d matches the reference" * doctest::skip(kNoOneDnn)) {
  INFO("seed " << kSeed);
  test::Rng rng(kSeed + 4);
  for (uint64_t iter = 0; iter < kCases; ++iter) {
    const uint64_t wh = pick(rng, 1, 4), ww = pick(rng, 1, 4);
    const uint64_t ph = pick(rng, 0, wh - 1), pw = pick(rng, 0, ww - 1);
    const uint64_t h = std::max<uint64_t>(1, wh + pick(rng, 0, 9) - std::min(wh - 1, 2 * ph));
    const uint64_t w = std::max<uint64_t>(1, ww + pick(rng, 0, 9) - std::min(ww - 1, 2 * pw));
    std::vector<Param> p{s("x", dims({pick(rng, 1, 2), pick(rng, 1, 5), h, w})),
                         s("mode", rng.chance(0.5) ? "max" : "avg"), s("window", dims({wh, ww}))};
    if (rng.chance(0.6)) p.push_back(s("stride", dims({pick(rng, 1, 3), pick(rng, 1, 3)})));
    p.push_back(s("pad", dims({ph, pw})));
    if (rng.chance(0.5)) p.push_back(i("count_pad", 1));
    check_job(OpKind::kPool2d, p, rng);
  }
}

TEST_CASE("cpu backend: batchnorm matches the reference" * doctest::skip(kNoOneDnn)) {
  INFO("seed " << kSeed);
  test::Rng rng(kSeed + 5);
  for (uint64_t iter = 0; iter < kCases; ++iter) {
    std::string x = dims({pick(rng, 1, 4), pick(rng, 1, 9)});
    if (rng.chance(0.7)) x.append("x").append(dims({pick(rng, 1, 7), pick(rng, 1, 7)}));
    std::vector<Param> p{s("x", x)};
    if (rng.chance(0.5)) p.push_back(f("eps", uniform(rng, 1e-5, 0.1)));
    if (rng.chance(0.5)) p.push_back(i("relu", 1));
    check_job(OpKind::kBatchNorm, p, rng);
  }
}

TEST_CASE("cpu backend: gemm matches the reference" * doctest::skip(kNoOneDnn)) {
  INFO("seed " << kSeed);
  test::Rng rng(kSeed + 6);
  for (uint64_t iter = 0; iter < kCases; ++iter) {
    const uint64_t m = pick(rng, 1, 40), n = pick(rng, 1, 40), k = pick(rng, 1, 40);
    const bool ta = rng.chance(0.5), tb = rng.chance(0.5);
    std::vector<Param> p{s("a", ta ? dims({k, m}) : dims({m, k})),
                         s("b", tb ? dims({n, k}) : dims({k, n}))};
    if (ta) p.push_back(i("trans_a", 1));
    if (tb) p.push_back(i("trans_b", 1));
    if (rng.chance(0.5)) p.push_back(f("alpha", uniform(rng, -2, 2)));
    if (rng.chance(0.5)) {
      p.push_back(f("beta", uniform(rng, -2, 2)));
      p.push_back(s("c", dims({m, n})));
    }
    check_job(OpKind::kGemm, p, rng);
  }
  check_job(OpKind::kGemm, {s("a", "100x300"), s("b", "300x70"), i("beta", 1), s("c", "100x70")},
            rng);
}

TEST_CASE("cpu backend: f16 is refused naming the cpu pool" * doctest::skip(kNoOneDnn)) {
  test::Rng rng(kSeed);
  Job j = make_job(OpKind::kGemm, {s("a", "2x2"), s("b", "2x2"), s("dtype", "f16")}, rng);
  std::atomic<uint32_t> cancel{0};
  auto r = run_job(j, cancel);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInvalidArgument);
  CHECK(r.error().message() ==
        "gemm: dtype: f16 is not supported on cpu pools (f32 only); submit it to a gpu pool");
}

TEST_CASE("cpu backend: a cancel raised before the op starts ends it cancelled" *
          doctest::skip(kNoOneDnn)) {
  test::Rng rng(kSeed);
  Job j = make_job(OpKind::kActivation, {s("x", "4"), s("mode", "relu")}, rng);
  std::atomic<uint32_t> cancel{1};
  auto r = run_job(j, cancel);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kCancelled);
}

TEST_CASE("cpu backend: bad parameters and buffers fail before anything runs") {
  test::Rng rng(kSeed);
  Job j = make_job(OpKind::kGemm, {s("a", "2x3"), s("b", "3x2")}, rng);
  std::atomic<uint32_t> cancel{0};
  // An output buffer one element short.
  OpContext short_out{j.input(), j.input_bytes, j.output(), j.output_capacity - 4,
                      j.block,   cancel,        0,          j.output_offset};
  auto r = cpu_backend().run(op_named("gemm"), short_out);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInvalidArgument);
  CHECK(r.error().message() ==
        "gemm: y: the result 2x2 f32 is 16 bytes, the output buffer holds 12");
  // An output buffer that overlaps the input: it starts at arena offset 8.
  OpContext overlap{j.input(), j.input_bytes, j.output(), j.output_capacity, j.block, cancel, 0, 8};
  auto o = cpu_backend().run(op_named("gemm"), overlap);
  REQUIRE_FALSE(o.ok());
  CHECK(o.error().message().find("overlaps the output buffer") != std::string::npos);
}

TEST_CASE("cpu backend without oneDNN: tensor ops fail 'not in this build'" *
          doctest::skip(!kNoOneDnn)) {
  test::Rng rng(kSeed);
  Job j = make_job(OpKind::kConv2d, {s("x", "1x1x3x3"), s("w", "1x1x3x3")}, rng);
  std::atomic<uint32_t> cancel{0};
  auto r = run_job(j, cancel);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kUnknownOp);
  CHECK(r.error().message().find("conv2d: tensor ops on cpu pools are not in this build") == 0);
}

TEST_CASE("reference_ops: binary16 conversions round-trip and round to nearest even") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) continue;  // NaN
    CAPTURE(h);
    REQUIRE(test::double_to_half(test::half_to_double(static_cast<uint16_t>(h))) == h);
  }
  CHECK(test::double_to_half(1.0) == 0x3c00);
  CHECK(test::double_to_half(-2.0) == 0xc000);
  CHECK(test::double_to_half(65504.0) == 0x7bff);
  CHECK(test::double_to_half(65520.0) == 0x7c00);  // rounds up to infinity
  CHECK(test::double_to_half(std::ldexp(1.0, -24)) == 0x0001);
  CHECK(test::double_to_half(std::ldexp(1.0, -25)) == 0x0000);        // a tie: to even, 0
  CHECK(test::double_to_half(std::ldexp(3.0, -25)) == 0x0002);        // a tie: to even, 2
  CHECK(test::double_to_half(1.0 + std::ldexp(1.0, -11)) == 0x3c00);  // a tie: to even
  CHECK(test::double_to_half(1.0 + std::ldexp(3.0, -11)) == 0x3c02);
  CHECK(test::half_to_double(0x3555) == doctest::Approx(1.0 / 3).epsilon(1e-3));
}

TEST_CASE("the registry lists the six tensor ops with stable ids") {
  struct Want {
    uint32_t id;
    const char* name;
    OpKind kind;
  };
  for (const auto& w :
       {Want{5, "conv2d", OpKind::kConv2d}, Want{6, "activation", OpKind::kActivation},
        Want{7, "softmax", OpKind::kSoftmax}, Want{8, "pool2d", OpKind::kPool2d},
        Want{9, "batchnorm", OpKind::kBatchNorm}, Want{10, "gemm", OpKind::kGemm}}) {
    const OpInfo* op = find_op(w.id);
    REQUIRE(op != nullptr);
    CHECK(std::string(op->name) == w.name);
    CHECK((op->run == nullptr));
    REQUIRE(op->tensor.has_value());
    CHECK(*op->tensor == w.kind);
    CHECK(std::string(op->name) == tensor::op_kind_name(w.kind));
  }
}

}  // namespace
}  // namespace gpuq::daemon
