// GPU: a real gpuqd with a gpu pool (gpuq-gpu-worker on this machine's first GPU) and a cpu pool.
// Every tensor op runs on the GPU in f32 and f16 and is checked against a float64 reference
// computed here from the same (rounded) operands; status shows the device and pinned
// registration, and the jobs report pinned copies; a job beyond a small memory_limit fails with
// OutOfMemory and the same worker process serves the next one; the test op gpu_fault_test (a
// real sticky CUDA error) fails only its job, the worker is replaced by a new process, and the
// other jobs succeed; a job whose kernel runs long (gpu_fault_test with spin_us) ends at its
// time limit or its client's cancel while the kernel runs on, and the same worker serves on.
//
// Exits 77 (ctest: skipped) when the CUDA runtime reports no device (gpu_test_main.cpp: a
// child process asks, so this one, a client, never initialises CUDA; gpuqd and the clients
// never touch it, the workers do).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

// ---- f16 on the host ------------------------------------------------------------------------

uint16_t to_half(float f) {  // round to nearest even; no f16 subnormals are produced here
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (exp <= 0) return static_cast<uint16_t>(sign);  // flush tiny values to zero
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
}

float from_half(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp == 0) {
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- float64 references ---------------------------------------------------------------------

using Vec = std::vector<double>;

Vec conv2d_ref(const Vec& x, const Vec& w, const Vec* b, int n, int c, int h, int wd, int k, int r,
               int s, int pad, int stride, int groups, bool relu, int* oh_out, int* ow_out) {
  const int oh = (h + 2 * pad - r) / stride + 1, ow = (wd + 2 * pad - s) / stride + 1;
  const int cg = c / groups, kg = k / groups;
  Vec y(static_cast<size_t>(n) * k * oh * ow);
  for (int in = 0; in < n; ++in)
    for (int ik = 0; ik < k; ++ik)
      for (int oy = 0; oy < oh; ++oy)
        for (int ox = 0; ox < ow; ++ox) {
          double acc = b ? (*b)[ik] : 0.0;
          const int g = ik / kg;
          for (int ic = 0; ic < cg; ++ic)
            for (int ry = 0; ry < r; ++ry)
              for (int sx = 0; sx < s; ++sx) {
                const int iy = oy * stride - pad + ry, ix = ox * stride - pad + sx;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                acc += x[((static_cast<size_t>(in) * c + g * cg + ic) * h + iy) * wd + ix] *
                       w[((static_cast<size_t>(ik) * cg + ic) * r + ry) * s + sx];
              }
          y[((static_cast<size_t>(in) * k + ik) * oh + oy) * ow + ox] =
              relu ? std::max(acc, 0.0) : acc;
        }
  *oh_out = oh;
  *ow_out = ow;
  return y;
}

Vec gemm_ref(const Vec& a, const Vec& b, const Vec* c, int m, int n, int k, bool ta, bool tb,
             double alpha, double beta) {
  Vec y(static_cast<size_t>(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double acc = 0;
      for (int p = 0; p < k; ++p) {
        const double av =
            ta ? a[static_cast<size_t>(p) * m + i] : a[static_cast<size_t>(i) * k + p];
        const double bv =
            tb ? b[static_cast<size_t>(j) * k + p] : b[static_cast<size_t>(p) * n + j];
        acc += av * bv;
      }
      y[static_cast<size_t>(i) * n + j] =
          alpha * acc + (c ? beta * (*c)[static_cast<size_t>(i) * n + j] : 0.0);
    }
  return y;
}

// ---- running a tensor op --------------------------------------------------------------------

struct TensorJob {
  std::string op;
  std::vector<JobParam> params;
  std::vector<Vec> operands;  // in the op's order, back to back
  size_t result_elements = 0;
};

struct TensorResult {
  JobResult job;
  Vec y;
};

// Rounds every operand to the dtype (so the reference sees what the GPU sees).
void round_operands(std::vector<Vec>& operands, bool f16) {
  for (Vec& v : operands)
    for (double& e : v) e = f16 ? from_half(to_half(static_cast<float>(e))) : static_cast<float>(e);
}

TensorResult run_tensor(Client& client, const std::string& pool, TensorJob job, bool f16) {
  const size_t esize = f16 ? 2 : 4;
  size_t in_elems = 0;
  for (const Vec& v : job.operands) in_elems += v.size();
  Buffer in = allocate(client, in_elems * esize);
  Buffer out = allocate(client, job.result_elements * esize);
  std::byte* p = in.data();
  for (const Vec& v : job.operands)
    for (double e : v) {
      if (f16) {
        const uint16_t h = to_half(static_cast<float>(e));
        std::memcpy(p, &h, 2);
      } else {
        const float f = static_cast<float>(e);
        std::memcpy(p, &f, 4);
      }
      p += esize;
    }
  JobSpec spec = job_spec(job.op, in, out, pool);
  spec.params = job.params;
  if (f16) spec.params.push_back(JobParam::text("dtype", "f16"));
  Job j = submit_ok(client, spec);
  TensorResult r{wait_result(j), {}};
  if (r.job.status == JobStatus::kDone) {
    REQUIRE(r.job.output_size == job.result_elements * esize);
    for (size_t i = 0; i < job.result_elements; ++i) {
      if (f16) {
        uint16_t h;
        std::memcpy(&h, out.data() + 2 * i, 2);
        r.y.push_back(from_half(h));
      } else {
        float f;
        std::memcpy(&f, out.data() + 4 * i, 4);
        r.y.push_back(f);
      }
    }
  }
  client.release(in);
  client.release(out);
  return r;
}

void check_close(const Vec& got, const Vec& want, bool f16) {
  REQUIRE(got.size() == want.size());
  // f32: the GPU's f32 sums against float64. f16: the result rounded to f16 (11 bits) after an
  // f32 accumulation.
  const double tol = f16 ? 1e-2 : 1e-4;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::fabs(got[i] - want[i]) > tol * std::max(1.0, std::fabs(want[i]))) {
      if (bad++ == 0) first = i;
    }
  }
  CHECK_MESSAGE(bad == 0, bad << " of " << got.size() << " elements off; first at " << first
                              << ": got " << got[first] << ", want " << want[first]);
}

// Runs `t` on the gpu pool and checks it against `want`; in f32 also against the cpu pool's
// result for the same job when the cpu pool can run it (a build with oneDNN). Returns the gpu
// job's result.
JobResult expect_op(Client& client, const TensorJob& t, const Vec& want, bool f16,
                    const std::string& what) {
  TensorResult gpu = run_tensor(client, "gpu", t, f16);
  INFO(what << ": " << gpu.job.message);
  REQUIRE(gpu.job.status == JobStatus::kDone);
  check_close(gpu.y, want, f16);
  if (!f16) {
    TensorResult cpu = run_tensor(client, "cpu", t, false);
    if (cpu.job.status == JobStatus::kDone) {
      INFO("against the cpu pool");
      check_close(gpu.y, cpu.y, false);
    } else {
      MESSAGE("cpu pool cannot run " << t.op << " (" << cpu.job.message << "): not compared");
    }
  }
  return gpu.job;
}

Vec random_vec(std::mt19937& rng, size_t n, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> d(lo, hi);
  Vec v(n);
  for (double& e : v) e = d(rng);
  return v;
}

std::string gpu_config(const std::string& memory_limit = "0.5") {
  return R"({"pools":[{"name":"cpu","kind":"cpu","workers":1},
                      {"name":"gpu","kind":"gpu","gpus":[0],"memory_limit":)" +
         memory_limit + "}]}";
}

const nlohmann::json& gpu_pool(const nlohmann::json& status) {
  for (const auto& p : status["pools"]) {
    if (p["name"] == "gpu") return p;
  }
  FAIL("no pool gpu in " << status.dump());
  return status;
}

pid_t gpu_worker_pid(const DaemonProcess& daemon) {
  const auto pids = daemon.worker_pids("gpu");
  REQUIRE(pids.size() == 1);
  return pids[0];
}

// ---- the ops --------------------------------------------------------------------------------

void check_every_op(Client& client, bool f16) {
  std::mt19937 rng(f16 ? 16 : 32);
  INFO("dtype " << (f16 ? "f16" : "f32"));
  {  // conv2d with bias, padding, stride 1, groups 1, relu
    TensorJob t{
        "conv2d",
        {JobParam::text("x", "2x3x9x9"), JobParam::text("w", "4x3x3x3"), JobParam::text("b", "4"),
         JobParam::text("pad", "1x1"), JobParam::integer("relu", 1)},
        {random_vec(rng, 2 * 3 * 81), random_vec(rng, 4 * 27), random_vec(rng, 4)},
        2 * 4 * 81};
    round_operands(t.operands, f16);
    int oh = 0, ow = 0;
    const Vec want = conv2d_ref(t.operands[0], t.operands[1], &t.operands[2], 2, 3, 9, 9, 4, 3, 3,
                                1, 1, 1, true, &oh, &ow);
    const JobResult r = expect_op(client, t, want, f16, "conv2d");
    CHECK(r.value == 1);  // both copies from the pinned (registered) segment
  }
  {  // conv2d, grouped and strided, no bias
    TensorJob t{"conv2d",
                {JobParam::text("x", "1x4x8x8"), JobParam::text("w", "6x2x3x3"),
                 JobParam::text("stride", "2x2"), JobParam::integer("groups", 2)},
                {random_vec(rng, 4 * 64), random_vec(rng, 6 * 18)},
                1 * 6 * 3 * 3};
    round_operands(t.operands, f16);
    int oh = 0, ow = 0;
    const Vec want = conv2d_ref(t.operands[0], t.operands[1], nullptr, 1, 4, 8, 8, 6, 3, 3, 0, 2, 2,
                                false, &oh, &ow);
    REQUIRE(oh * ow == 9);
    expect_op(client, t, want, f16, "grouped conv2d");
  }
  for (const char* mode : {"relu", "sigmoid", "tanh"}) {
    TensorJob t{"activation",
                {JobParam::text("x", "3x5x7"), JobParam::text("mode", mode)},
                {random_vec(rng, 105, -3, 3)},
                105};
    round_operands(t.operands, f16);
    Vec want = t.operands[0];
    for (double& e : want) {
      e = std::string(mode) == "relu"      ? std::max(e, 0.0)
          : std::string(mode) == "sigmoid" ? 1.0 / (1.0 + std::exp(-e))
                                           : std::tanh(e);
    }
    expect_op(client, t, want, f16, std::string("activation ") + mode);
  }
  for (int log : {0, 1}) {  // softmax over dim 1 of 2x5x3x2
    TensorJob t{"softmax",
                {JobParam::text("x", "2x5x3x2"), JobParam::integer("log", log)},
                {random_vec(rng, 60, -4, 4)},
                60};
    round_operands(t.operands, f16);
    const Vec& x = t.operands[0];
    Vec want(60);
    for (int n = 0; n < 2; ++n)
      for (int i = 0; i < 6; ++i) {
        double mx = -1e300, sum = 0;
        for (int c = 0; c < 5; ++c) mx = std::max(mx, x[(n * 5 + c) * 6 + i]);
        for (int c = 0; c < 5; ++c) sum += std::exp(x[(n * 5 + c) * 6 + i] - mx);
        for (int c = 0; c < 5; ++c) {
          const double v = x[(n * 5 + c) * 6 + i] - mx;
          want[(n * 5 + c) * 6 + i] = log ? v - std::log(sum) : std::exp(v) / sum;
        }
      }
    expect_op(client, t, want, f16, "softmax log=" + std::to_string(log));
  }
  for (const char* mode : {"max", "avg"}) {  // 3x3 window, stride 2, pad 1, without count_pad
    TensorJob t{"pool2d",
                {JobParam::text("x", "2x3x7x7"), JobParam::text("mode", mode),
                 JobParam::text("window", "3x3"), JobParam::text("stride", "2x2"),
                 JobParam::text("pad", "1x1")},
                {random_vec(rng, 2 * 3 * 49)},
                2 * 3 * 4 * 4};
    round_operands(t.operands, f16);
    const Vec& x = t.operands[0];
    Vec want;
    for (int nc = 0; nc < 6; ++nc)
      for (int oy = 0; oy < 4; ++oy)
        for (int ox = 0; ox < 4; ++ox) {
          double mx = -1e300, sum = 0;
          int cells = 0;
          for (int ry = 0; ry < 3; ++ry)
            for (int sx = 0; sx < 3; ++sx) {
              const int iy = oy * 2 - 1 + ry, ix = ox * 2 - 1 + sx;
              if (iy < 0 || iy >= 7 || ix < 0 || ix >= 7) continue;
              const double v = x[(nc * 7 + iy) * 7 + ix];
              mx = std::max(mx, v);
              sum += v;
              ++cells;
            }
          want.push_back(std::string(mode) == "max" ? mx : sum / cells);
        }
    expect_op(client, t, want, f16, std::string("pool2d ") + mode);
  }
  {  // batchnorm, inference, with relu
    TensorJob t{
        "batchnorm",
        {JobParam::text("x", "2x4x3x3"), JobParam::real("eps", 1e-3), JobParam::integer("relu", 1)},
        {random_vec(rng, 72), random_vec(rng, 4, 0.5, 2), random_vec(rng, 4), random_vec(rng, 4),
         random_vec(rng, 4, 0.5, 2)},
        72};
    round_operands(t.operands, f16);
    Vec want(72);
    for (int n = 0; n < 2; ++n)
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 9; ++i) {
          const size_t at = (n * 4 + c) * 9 + i;
          const double v = t.operands[1][c] * (t.operands[0][at] - t.operands[3][c]) /
                               std::sqrt(t.operands[4][c] + 1e-3) +
                           t.operands[2][c];
          want[at] = std::max(v, 0.0);
        }
    expect_op(client, t, want, f16, "batchnorm");
  }
  for (int variant = 0; variant < 3; ++variant) {  // plain; trans_a with beta and c; trans_b
    const int m = 17, n = 23, k = 31;
    const bool ta = variant == 1, tb = variant == 2;
    TensorJob t{
        "gemm",
        {JobParam::text("a", ta ? "31x17" : "17x31"), JobParam::text("b", tb ? "23x31" : "31x23")},
        {random_vec(rng, m * k), random_vec(rng, k * n)},
        static_cast<size_t>(m) * n};
    double alpha = 1, beta = 0;
    if (ta) {
      alpha = 0.5;
      beta = 2;
      t.params.push_back(JobParam::integer("trans_a", 1));
      t.params.push_back(JobParam::real("alpha", alpha));
      t.params.push_back(JobParam::real("beta", beta));
      t.params.push_back(JobParam::text("c", "17x23"));
      t.operands.push_back(random_vec(rng, m * n));
    }
    if (tb) t.params.push_back(JobParam::integer("trans_b", 1));
    round_operands(t.operands, f16);
    const Vec want = gemm_ref(t.operands[0], t.operands[1], ta ? &t.operands[2] : nullptr, m, n, k,
                              ta, tb, alpha, beta);
    expect_op(client, t, want, f16, "gemm variant " + std::to_string(variant));
  }
}

// gpuqd with the gpu pool and the test hooks on (the op gpu_fault_test).
DaemonOptions hooked_gpu_options() {
  DaemonOptions options;
  options.config_json = gpu_config();
  options.env = {"GPUQ_TEST_HOOKS=1"};
  return options;
}

// A small f32 gemm (m x k times k x n, random operands from `seed`) on the gpu pool, checked
// against the float64 reference: the pool serves (after an error, a cancel, a replacement).
void check_small_gemm(Client& client, unsigned seed, int m, int k, int n, const char* when) {
  std::mt19937 rng(seed);
  TensorJob t{
      "gemm",
      {JobParam::text("a", std::to_string(m) + "x" + std::to_string(k)),
       JobParam::text("b", std::to_string(k) + "x" + std::to_string(n))},
      {random_vec(rng, static_cast<size_t>(m) * k), random_vec(rng, static_cast<size_t>(k) * n)},
      static_cast<size_t>(m) * n};
  round_operands(t.operands, false);
  TensorResult r = run_tensor(client, "gpu", t, false);
  INFO(when << ": " << r.job.message);
  REQUIRE(r.job.status == JobStatus::kDone);
  check_close(r.y, gemm_ref(t.operands[0], t.operands[1], nullptr, m, n, k, false, false, 1, 0),
              false);
}

TEST_CASE("every tensor op on the GPU, f32 and f16, matches the float64 reference") {
  DaemonProcess daemon(gpu_config());
  Client client = connect_client(daemon);

  check_every_op(client, false);
  check_every_op(client, true);

  // Built-in ops run on the GPU worker's host side.
  Buffer in = allocate(client, 4096), out = allocate(client, 4096);
  std::memset(in.data(), 7, 4096);
  Job echo = submit_ok(client, job_spec("echo", in, out, "gpu"));
  CHECK(wait_done(echo).output_size == 4096);
  CHECK(std::memcmp(in.data(), out.data(), 4096) == 0);
  CHECK(daemon.terminate().ok());
}

TEST_CASE("status shows the GPU worker's device, memory limit and pinned registration") {
  DaemonProcess daemon(gpu_config("268435456"));

  const nlohmann::json status = daemon.status();
  const nlohmann::json& pool = gpu_pool(status);
  REQUIRE(pool["workers"].size() == 1);
  const nlohmann::json& backend = pool["workers"][0]["backend"];
  INFO("backend: " << backend.dump());
  CHECK(backend["kind"] == "gpu");
  CHECK_FALSE(backend["device"].get<std::string>().empty());
  CHECK(backend["compute_capability"].get<std::string>().find('.') != std::string::npos);
  CHECK(backend["memory_total"].get<uint64_t>() > 0);
  CHECK(backend["memory_limit"] == 268435456);
  CHECK(backend["pinned_registration"] == true);
  // The cpu pool's workers say nothing of a GPU.
  const nlohmann::json& cpu_worker = status["pools"][0]["workers"][0];
  CHECK((!cpu_worker.contains("backend") || cpu_worker["backend"].value("kind", "") != "gpu"));
  CHECK(daemon.terminate().ok());
}

TEST_CASE("a job beyond memory_limit fails OutOfMemory; the same worker serves the next job") {
  DaemonProcess daemon(gpu_config("67108864"));  // 64 MiB
  Client client = connect_client(daemon, 256ull << 20);
  const pid_t before = gpu_worker_pid(daemon);

  // gemm 4096^3 in f32: 128 MiB of operands alone.
  Buffer in = allocate(client, 2 * 4096ull * 4096 * 4), out = allocate(client, 4096ull * 4096 * 4);
  JobSpec big = job_spec("gemm", in, out, "gpu");
  big.params = {JobParam::text("a", "4096x4096"), JobParam::text("b", "4096x4096")};
  Job oom = submit_ok(client, big);
  const JobResult failed = wait_result(oom);
  INFO("message: " << failed.message);
  CHECK(failed.status == JobStatus::kFailed);
  CHECK(failed.code == ErrorCode::kOutOfMemory);
  CHECK(failed.message.find("memory_limit") != std::string::npos);
  client.release(in);
  client.release(out);

  check_small_gemm(client, 7, 8, 8, 8, "after OOM");
  CHECK(gpu_worker_pid(daemon) == before);
  CHECK(daemon.terminate().ok());
}

TEST_CASE("a sticky CUDA error fails only its job; the worker is replaced; other jobs succeed") {
  DaemonProcess daemon(hooked_gpu_options());
  Client client = connect_client(daemon);
  const pid_t before = gpu_worker_pid(daemon);

  Job fault = submit_ok(client, job_spec("gpu_fault_test", {}, {}, "gpu"));
  Job on_cpu = submit_ok(client, sleep_spec(1000, "cpu"));
  const JobResult failed = wait_result(fault);
  INFO("message: " << failed.message);
  CHECK(failed.status == JobStatus::kFailed);
  CHECK(failed.code == ErrorCode::kOpFailed);
  CHECK(failed.message.find("cudaErrorIllegalAddress") != std::string::npos);
  wait_done(on_cpu);

  // A fresh process takes the worker's place and serves the pool.
  pid_t after = 0;
  REQUIRE(wait_until(
      [&] {
        const nlohmann::json status = daemon.status();  // `pool` refers into it
        const nlohmann::json& pool = gpu_pool(status);
        if (pool["workers"].size() != 1 || pool["workers"][0]["state"] != "ready") return false;
        after = pool["workers"][0]["pid"].get<pid_t>();
        return after != before;
      },
      60s));
  CHECK(after != before);
  check_small_gemm(client, 9, 4, 8, 5, "after the fault");
  // Without the hooks the op does not exist on the GPU worker (see docs/ops.md); with them, only
  // the job that ran it failed.
  Job later = submit_ok(client, noop_spec("gpu"));
  wait_done(later);
  CHECK(daemon.terminate().ok());
}

TEST_CASE("a long kernel's job ends at its time limit or cancel; the same worker serves on") {
  // gpu_fault_test with spin_us: one kernel that runs 3 s, waited for as a long tensor job is.
  // The worker looks at the job's cancel flag while it waits, so the job ends at once, and the
  // worker keeps its context: no forced stop, no replacement.
  DaemonProcess daemon(hooked_gpu_options());
  Client client = connect_client(daemon);
  const pid_t before = gpu_worker_pid(daemon);
  JobSpec spin = job_spec("gpu_fault_test", {}, {}, "gpu");
  spin.params = {JobParam::integer("spin_us", 3'000'000)};

  spin.time_limit = 200ms;
  auto t0 = std::chrono::steady_clock::now();
  Job limited = submit_ok(client, spin);
  const JobResult timed_out = wait_result(limited);
  const auto limited_took = std::chrono::steady_clock::now() - t0;
  INFO("message: " << timed_out.message);
  CHECK(timed_out.status == JobStatus::kFailed);
  CHECK(timed_out.code == ErrorCode::kTimedOut);
  CHECK(timed_out.message.find("time limit (200 ms)") != std::string::npos);
  CHECK(limited_took < 2s);  // not the kernel's 3 s

  spin.time_limit = 0ms;
  t0 = std::chrono::steady_clock::now();
  Job cancelled = submit_ok(client, spin);
  std::this_thread::sleep_for(300ms);
  CHECK(cancelled.cancel().ok());
  const JobResult c = wait_result(cancelled);
  const auto cancel_took = std::chrono::steady_clock::now() - t0;
  INFO("message: " << c.message);
  CHECK(c.status == JobStatus::kCancelled);
  CHECK(cancel_took < 2500ms);

  // The next job runs after the kernels still on the stream, on the same worker.
  check_small_gemm(client, 11, 4, 8, 5, "after the time limit and the cancel");
  const nlohmann::json status = daemon.status();
  const nlohmann::json& worker = gpu_pool(status)["workers"][0];
  CHECK(worker["pid"].get<pid_t>() == before);
  CHECK(worker.value("stops_forced", 0) == 0);
  CHECK(daemon.terminate().ok());
}

TEST_CASE(
    "gpuqd without gpuq-gpu-worker beside it: the C++ gpu pool is unavailable, saying it needs "
    "gpuq-gpu-worker") {
  // gpuqd and gpuq-worker copied to a directory of their own, as a build without CUDA installs
  // them: the GPU is found, but there is nothing to run on it.
  char dir[] = "/tmp/gpuq-nocuda-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string base = dir;
  const std::string gpuqd = std::string(gpuqd_path());
  const std::string worker = gpuqd.substr(0, gpuqd.rfind('/')) + "/gpuq-worker";
  REQUIRE(run_command("cp '" + gpuqd + "' '" + worker + "' '" + base + "/'").exit_code == 0);
  {
    std::ofstream config(base + "/config.json");
    config << gpu_config();
  }
  const std::string run_dir = base + "/run";
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::execl((base + "/gpuqd").c_str(), "gpuqd", "--config", (base + "/config.json").c_str(),
            "--runtime-dir", run_dir.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }

  nlohmann::json status;
  const bool answered = wait_until(
      [&] {
        const CommandResult r =
            run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" + run_dir +
                        "' status --json 2>/dev/null");
        if (r.exit_code != 0) return false;
        status = nlohmann::json::parse(r.output, nullptr, false);
        return !status.is_discarded() && status["pools"][0]["status"] == "ready";
      },
      30s);
  ::kill(pid, SIGTERM);
  int exit_status = 0;
  ::waitpid(pid, &exit_status, 0);
  run_command("rm -rf '" + base + "'");

  REQUIRE(answered);
  INFO("status: " << status.dump());
  CHECK(status["gpu_discovery"]["gpu_worker"].is_null());
  const nlohmann::json& pool = gpu_pool(status);
  CHECK(pool["status"] == "unavailable");
  const std::string reason = pool["reason"].get<std::string>();
  CHECK(reason.find("a C++ gpu pool needs gpuq-gpu-worker, which is not installed (looked for "
                    "next to gpuqd in " +
                    base + " and in " + base + "/../libexec/gpuq)") != std::string::npos);
  CHECK(status["pools"][0]["status"] == "ready");
}

}  // namespace
}  // namespace gpuq::test
