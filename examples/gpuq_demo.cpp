// gpuq_demo: a small client of the gpuq daemon, using only the public C++ API.
//
// For each built-in op (noop, echo, checksum, sleep) it submits --jobs jobs with --inflight of
// them in flight, checks every result (echo output byte-exact, checksum equal to a CRC32C
// computed here), and prints jobs/s and latency percentiles. Then it runs tensor ops through
// the client's tensor calls (a 3x3 conv2d with bias and ReLU, a 64x64x64 gemm), each result
// checked against a plain loop computed here; a daemon whose CPU workers were built without
// oneDNN says so, and the demo skips them.
//
//   gpuq_demo [--runtime-dir DIR] [--jobs N] [--inflight K]
#include <gpuq/client.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// CRC32C (Castagnoli), computed here independently of the daemon to check its answers.
uint32_t crc32c_reference(const std::byte* p, size_t n) {
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i)
    crc = table[(crc ^ static_cast<uint8_t>(p[i])) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

struct Slot {
  gpuq::Buffer in, out;
  size_t size = 0;
  gpuq::Job job;
  Clock::time_point start;
};

// Runs `total` jobs of `op` with `inflight` in flight. Returns the number of failures.
int run_op(gpuq::Client& client, const std::string& op, int total, int inflight,
           std::mt19937& rng) {
  std::vector<Slot> slots(static_cast<size_t>(inflight));
  const size_t max_size = op == "echo" || op == "checksum" ? 64 * 1024 : 0;
  for (auto& s : slots) {
    if (max_size == 0) continue;
    auto in = client.allocate(max_size);
    auto out = client.allocate(max_size);
    if (!in || !out) {
      std::fprintf(stderr, "allocate: %s\n", (!in ? in.error() : out.error()).to_string().c_str());
      return total;
    }
    s.in = *in;
    s.out = *out;
    // Random contents once; each job then stamps its own sequence number (below), so a stale
    // output from an earlier job cannot pass the check.
    for (size_t b = 0; b < max_size; ++b) s.in.data()[b] = static_cast<std::byte>(rng());
  }
  uint64_t sequence = 0;
  std::vector<double> latencies_us;
  latencies_us.reserve(static_cast<size_t>(total));
  int submitted = 0, finished = 0, failures = 0;
  std::deque<size_t> pending;
  const auto t0 = Clock::now();
  auto submit = [&](size_t i) -> bool {
    Slot& s = slots[i];
    gpuq::JobSpec spec;
    spec.op = op;
    if (max_size > 0) {
      s.size = std::uniform_int_distribution<size_t>(1, max_size)(rng);
      ++sequence;
      std::memcpy(s.in.data(), &sequence, std::min(s.size, sizeof sequence));
      std::memcpy(s.in.data() + s.size - std::min(s.size, sizeof sequence), &sequence,
                  std::min(s.size, sizeof sequence));
      spec.input = s.in.slice(0, s.size);
      spec.output = s.out;
    }
    if (op == "sleep") spec.params.push_back(gpuq::JobParam::integer("us", 100));
    s.start = Clock::now();
    auto job = client.submit(spec, std::chrono::seconds(10));
    if (!job) {
      std::fprintf(stderr, "%s: submit: %s\n", op.c_str(), job.error().to_string().c_str());
      return false;
    }
    s.job = std::move(*job);
    pending.push_back(i);
    ++submitted;
    return true;
  };
  for (size_t i = 0; i < slots.size() && submitted < total; ++i) {
    if (!submit(i)) return total;
  }
  while (!pending.empty()) {
    size_t i = pending.front();
    pending.pop_front();
    Slot& s = slots[i];
    auto r = s.job.wait(std::chrono::seconds(30));
    latencies_us.push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - s.start).count());
    ++finished;
    bool good = r && r->ok();
    if (good && op == "echo") {
      good = r->output_size == s.size && std::memcmp(s.in.data(), s.out.data(), s.size) == 0;
    } else if (good && op == "checksum") {
      good = r->value == crc32c_reference(s.in.data(), s.size);
    }
    if (!good) {
      if (failures++ == 0) {
        std::fprintf(stderr, "%s: job failed: %s\n", op.c_str(),
                     !r ? r.error().to_string().c_str()
                        : (std::string(gpuq::error_code_name(r->code)) + ": " + r->message +
                           " (or wrong output)")
                              .c_str());
      }
    }
    s.job = gpuq::Job();
    if (submitted < total && !submit(i)) return total - finished + failures;
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::sort(latencies_us.begin(), latencies_us.end());
  auto pct = [&](double p) {
    return latencies_us[std::min(
        latencies_us.size() - 1,
        static_cast<size_t>(p * static_cast<double>(latencies_us.size())))];
  };
  std::printf("%-9s %7d jobs  %6d failed  %9.0f jobs/s   p50 %8.1f us   p99 %8.1f us\n", op.c_str(),
              finished, failures, finished / secs, pct(0.50), pct(0.99));
  for (auto& s : slots) {
    if (!s.in.empty()) client.release(s.in);
    if (!s.out.empty()) client.release(s.out);
  }
  return failures;
}

// y = relu(conv(x, w) + b), stride 1, pad 1, 3x3 window, one image, in plain loops.
std::vector<float> conv2d_reference(const float* x, const float* w, const float* b, int c, int k,
                                    int h, int wd) {
  std::vector<float> y(static_cast<size_t>(k) * h * wd);
  for (int o = 0; o < k; ++o)
    for (int i = 0; i < h; ++i)
      for (int j = 0; j < wd; ++j) {
        double acc = b[o];
        for (int ci = 0; ci < c; ++ci)
          for (int r = 0; r < 3; ++r)
            for (int t = 0; t < 3; ++t) {
              const int yi = i + r - 1, xj = j + t - 1;
              if (yi < 0 || yi >= h || xj < 0 || xj >= wd) continue;
              acc += double{x[(ci * h + yi) * wd + xj]} * w[((o * c + ci) * 3 + r) * 3 + t];
            }
        y[(static_cast<size_t>(o) * h + i) * wd + j] = static_cast<float>(std::max(acc, 0.0));
      }
  return y;
}

bool close_enough(const float* got, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= 1e-4f * (1.0f + std::fabs(want[i])))) return false;
  }
  return true;
}

// Runs `total` conv2d and `total` gemm jobs one after another, checking each result. Returns
// the number of failures; -1 if the daemon's CPU workers have no tensor ops.
int run_tensor_ops(gpuq::Client& client, int total, std::mt19937& rng) {
  constexpr int C = 8, K = 16, H = 16, W = 16, M = 64;
  auto tensor = [&](gpuq::Shape shape) -> gpuq::Result<gpuq::Tensor> {
    auto buffer = client.allocate(gpuq::shape_bytes(shape, gpuq::DType::kF32));
    if (!buffer) return buffer.error();
    return gpuq::Tensor::make(*buffer, std::move(shape));
  };
  auto x = tensor({1, C, H, W}), w = tensor({K, C, 3, 3}), b = tensor({K});
  auto y = tensor({1, K, H, W}), a = tensor({M, M}), bm = tensor({M, M}), ym = tensor({M, M});
  for (auto* t : {&x, &w, &b, &y, &a, &bm, &ym}) {
    if (!*t) {
      std::fprintf(stderr, "tensor: %s\n", t->error().to_string().c_str());
      return 2 * total;
    }
  }
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (auto* t : {&x, &w, &b, &a, &bm}) {
    for (uint64_t i = 0; i < (*t)->elements(); ++i) (*t)->data_as<float>()[i] = value(rng);
  }
  const std::vector<float> conv_want =
      conv2d_reference(x->data_as<float>(), w->data_as<float>(), b->data_as<float>(), C, K, H, W);
  std::vector<float> gemm_want(static_cast<size_t>(M) * M);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < M; ++j) {
      double acc = 0;
      for (int l = 0; l < M; ++l)
        acc += double{a->data_as<float>()[i * M + l]} * bm->data_as<float>()[l * M + j];
      gemm_want[static_cast<size_t>(i) * M + j] = static_cast<float>(acc);
    }
  gpuq::Conv2dOptions conv;
  conv.pad = {1, 1};
  conv.relu = true;
  int failures = 0;
  for (const char* op : {"conv2d", "gemm"}) {
    const bool is_conv = op[0] == 'c';
    std::vector<double> us;
    const int failures_before = failures;
    const auto t0 = Clock::now();
    for (int n = 0; n < total; ++n) {
      const gpuq::Tensor& out = is_conv ? *y : *ym;
      std::fill_n(out.data_as<float>(), out.elements(), NAN);
      const auto start = Clock::now();
      auto job =
          is_conv ? client.conv2d(*x, *w, *b, *y, conv) : client.gemm(*a, *bm, std::nullopt, *ym);
      auto r = job ? job->wait() : gpuq::Result<gpuq::JobResult>(job.error());
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      if (r && r->code == gpuq::ErrorCode::kUnknownOp) {
        std::printf("%-9s skipped: %s\n", op, r->message.c_str());
        return -1;
      }
      if (!r || !r->ok() || !close_enough(out.data_as<float>(), is_conv ? conv_want : gemm_want)) {
        if (failures++ == 0) {
          std::fprintf(stderr, "%s: %s\n", op,
                       !r ? r.error().to_string().c_str()
                          : (!r->ok() ? r->message.c_str() : "result differs from the reference"));
        }
      }
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    std::sort(us.begin(), us.end());
    std::printf("%-9s %7d jobs  %6d failed  %9.0f jobs/s   p50 %8.1f us   p99 %8.1f us   (%s)\n",
                op, total, failures - failures_before, total / secs, us[us.size() / 2],
                us[us.size() * 99 / 100],
                is_conv ? "1x8x16x16 * 16x8x3x3, pad 1, bias, relu" : "64x64 * 64x64");
  }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  gpuq::ConnectOptions options;
  int jobs = 5000, inflight = 8;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--runtime-dir" && i + 1 < argc) {
      options.runtime_dir = argv[++i];
    } else if (a == "--jobs" && i + 1 < argc) {
      jobs = std::atoi(argv[++i]);
    } else if (a == "--inflight" && i + 1 < argc) {
      inflight = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: gpuq_demo [--runtime-dir DIR] [--jobs N] [--inflight K]\n");
      return 2;
    }
  }
  if (jobs < 1 || inflight < 1) {
    std::fprintf(stderr, "gpuq_demo: --jobs and --inflight must be positive\n");
    return 2;
  }
  auto client = gpuq::Client::connect(options);
  if (!client) {
    std::fprintf(stderr, "gpuq_demo: cannot connect: %s\n", client.error().to_string().c_str());
    return 1;
  }
  std::printf("connected to gpuqd (pools:");
  for (const auto& p : client->pools())
    std::printf(" %s[%s, %u slots]", p.name.c_str(), p.kind.c_str(), p.capacity);
  std::printf("), %d jobs per op, %d in flight\n", jobs, inflight);
  std::mt19937 rng(12345);
  int failures = 0;
  for (const char* op : {"noop", "echo", "checksum", "sleep"}) {
    failures += run_op(*client, op, jobs, inflight, rng);
  }
  failures += std::max(0, run_tensor_ops(*client, std::min(jobs, 500), rng));
  std::printf(failures == 0 ? "all jobs completed with correct results\n"
                            : "%d jobs failed or gave wrong results\n",
              failures);
  return failures == 0 ? 0 : 1;
}
