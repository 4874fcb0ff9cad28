// GPU benchmarks of gpuq, on this machine's first GPU:
//   first_job_ms      gpuqd started (posix_spawn) -> the first gemm job on its gpu pool done:
//                     process start, GPU discovery, the worker's context, stream, handles and
//                     pool, the client's connect and registration;
//   conv2d, gemm      per-job time of a small conv2d (1x16x32x32, 16x16x3x3, pad 1) and gemm
//                     (64x64x64), f32: through gpuq (submit + wait, one job in flight) against
//                     the same cuDNN / cuBLAS call made directly in this process (copy in from
//                     pinned memory, compute, copy out, synchronize: cublasGemmEx with
//                     CUBLAS_COMPUTE_32F, and the conv2d algorithm the worker's rule picks,
//                     the first of cuDNN's heuristics without TF32); 5 rounds, each gpuq (a
//                     fresh daemon) then direct, so that drift falls on both, each series after
//                     a warm-up of half its length: the median of the rounds' medians, and their
//                     ratio (each round's in the JSON). conv2d also from a client connected with
//                     spin = 1 ms (_spin_1ms): the default 50 us spin gives up on a job that
//                     long and its wait pays a futex wake-up;
//   h2d_gbps          host -> device bandwidth of 256 MiB from a malloc'd buffer registered with
//                     cudaHostRegister (what a GPU worker does with each client segment) and
//                     from cudaMallocHost;
//   restart_ms        a sticky CUDA error (gpu_fault_test, with GPUQ_TEST_HOOKS=1) fails its
//                     job -> the next gemm on the pool done by the fresh worker.
// Prints one JSON object (device name, date, every figure) to stdout and, with --json FILE,
// to FILE. Exit status: 0 done, 1 a step failed, 2 bad arguments, 77 no CUDA device.
//
// This process uses CUDA itself (the direct baselines); gpuqd is started with posix_spawn,
// never a bare fork, so no CUDA state crosses into it.
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda_check.hpp"
#include "gpuq/client.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Small nonzero floats (not zeros: they can run faster than real data and hide unwritten
// output), the same in every buffer.
void fill(void* p, size_t bytes) {
  auto* f = static_cast<float*>(p);
  for (size_t i = 0; i < bytes / sizeof(float); ++i)
    f[i] = static_cast<float>(i % 7) * 0.25f - 0.75f;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "gpu_bench: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
T must(gpuq::Result<T> r, const char* what) {
  if (!r) die(std::string(what) + ": " + r.error().to_string());
  return std::move(r).value();
}
void must(gpuq::Result<void> r, const char* what) {
  if (!r) die(std::string(what) + ": " + r.error().to_string());
}

// gpuqd with a cpu pool and a gpu pool on GPU 0, in a fresh runtime directory.
class Daemon {
 public:
  Daemon(const std::string& gpuqd, bool test_hooks) {
    char tmpl[] = "/tmp/gpuq-gpu-bench-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) die("mkdtemp");
    dir_ = tmpl;
    const std::string config = dir_ + "/config.json";
    std::ofstream(config) << R"({"pools":[{"name":"cpu","kind":"cpu","workers":1},
                                          {"name":"gpu","kind":"gpu","gpus":[0]}]})";
    std::vector<std::string> args = {gpuqd, "--config", config, "--runtime-dir", dir_ + "/run"};
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    if (test_hooks) env.emplace_back("GPUQ_TEST_HOOKS=1");
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    started_ = Clock::now();
    if (posix_spawn(&pid_, gpuqd.c_str(), nullptr, nullptr, argv.data(), envp.data()) != 0) {
      die("posix_spawn " + gpuqd);
    }
  }
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
    std::string cmd = "rm -rf '" + dir_ + "'";
    if (std::system(cmd.c_str()) != 0)
      std::fprintf(stderr, "gpu_bench: cannot remove %s\n", dir_.c_str());
  }
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  Clock::time_point started() const { return started_; }

  // Connects, retrying while the socket is not there yet (up to 60 s).
  // spin: ConnectOptions::spin (the default, 50 us, when 0).
  gpuq::Client connect(std::chrono::nanoseconds spin = {}) const {
    gpuq::ConnectOptions o;
    o.runtime_dir = dir_ + "/run";
    o.segment_bytes = 64ull << 20;
    if (spin.count() > 0) o.spin = spin;
    for (auto deadline = Clock::now() + std::chrono::seconds(60);;) {
      auto c = gpuq::Client::connect(o);
      if (c) return std::move(c).value();
      if (Clock::now() > deadline) die("connect: " + c.error().to_string());
      usleep(1000);
    }
  }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  Clock::time_point started_;
};

// A tensor job of fixed buffers, submitted again and again.
struct GpuqJob {
  gpuq::JobSpec spec;

  gpuq::JobResult run(gpuq::Client& client) const {
    gpuq::Job job = must(client.submit(spec, std::chrono::seconds(60)), "submit");
    return must(job.wait(std::chrono::seconds(120)), "wait");
  }
  void run_ok(gpuq::Client& client) const {
    gpuq::JobResult r = run(client);
    if (r.status != gpuq::JobStatus::kDone) {
      die(spec.op + ": " + std::string(gpuq::error_code_name(r.code)) + ": " + r.message);
    }
  }
};

GpuqJob gemm_job(gpuq::Client& client, int n) {
  const uint64_t bytes = uint64_t(n) * n * 4;
  gpuq::Buffer in = must(client.allocate(2 * bytes), "allocate");
  gpuq::Buffer out = must(client.allocate(bytes), "allocate");
  fill(in.data(), 2 * bytes);
  GpuqJob j;
  j.spec.op = "gemm";
  j.spec.pool = "gpu";
  j.spec.input = in;
  j.spec.output = out;
  const std::string shape = std::to_string(n) + "x" + std::to_string(n);
  j.spec.params = {gpuq::JobParam::text("a", shape), gpuq::JobParam::text("b", shape)};
  return j;
}

GpuqJob conv_job(gpuq::Client& client) {
  const uint64_t x = 16 * 32 * 32 * 4, w = 16 * 16 * 9 * 4;
  gpuq::Buffer in = must(client.allocate(x + w), "allocate");
  gpuq::Buffer out = must(client.allocate(x), "allocate");
  fill(in.data(), x + w);
  GpuqJob j;
  j.spec.op = "conv2d";
  j.spec.pool = "gpu";
  j.spec.input = in;
  j.spec.output = out;
  j.spec.params = {gpuq::JobParam::text("x", "1x16x32x32"), gpuq::JobParam::text("w", "16x16x3x3"),
                   gpuq::JobParam::text("pad", "1x1")};
  return j;
}

std::vector<double> time_gpuq(gpuq::Client& client, const GpuqJob& job, int warmup, int n) {
  for (int i = 0; i < warmup; ++i) job.run_ok(client);
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    job.run_ok(client);
    us.push_back(ms_since(t0) * 1000);
  }
  return us;
}

// The direct baselines: one context, stream and handles, as a GPU worker has them.
struct Direct {
  cudaStream_t stream = nullptr;
  cudnnHandle_t cudnn = nullptr;
  cublasHandle_t cublas = nullptr;

  gpuq::Result<void> init() {
    GPUQ_CUDA(cudaSetDevice(0));
    GPUQ_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    GPUQ_CUDNN(cudnnCreate(&cudnn));
    GPUQ_CUDNN(cudnnSetStream(cudnn, stream));
    GPUQ_CUBLAS(cublasCreate(&cublas));
    GPUQ_CUBLAS(cublasSetStream(cublas, stream));
    return {};
  }

  // One gemm n^3 job: pinned in -> device, cublasSgemm, device -> pinned out, synchronize.
  gpuq::Result<std::vector<double>> gemm(int n, int warmup, int iters) {
    const size_t bytes = size_t(n) * n * 4;
    void *host = nullptr, *dev = nullptr;
    GPUQ_CUDA(cudaMallocHost(&host, 3 * bytes));
    GPUQ_CUDA(cudaMalloc(&dev, 3 * bytes));
    fill(host, 2 * bytes);
    std::vector<double> us;
    const float one = 1, zero = 0;
    auto* d = static_cast<float*>(dev);
    for (int i = 0; i < warmup + iters; ++i) {
      auto t0 = Clock::now();
      GPUQ_CUDA(cudaMemcpyAsync(dev, host, 2 * bytes, cudaMemcpyHostToDevice, stream));
      GPUQ_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, d + n * n,
                               CUDA_R_32F, n, d, CUDA_R_32F, n, &zero, d + 2 * n * n, CUDA_R_32F, n,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      GPUQ_CUDA(cudaMemcpyAsync(static_cast<char*>(host) + 2 * bytes, d + 2 * n * n, bytes,
                                cudaMemcpyDeviceToHost, stream));
      GPUQ_CUDA(cudaStreamSynchronize(stream));
      if (i >= warmup) us.push_back(ms_since(t0) * 1000);
    }
    GPUQ_CUDA(cudaFree(dev));
    GPUQ_CUDA(cudaFreeHost(host));
    return us;
  }

  // One conv2d job of the gpuq one's shape, with the algorithm chosen once, as the worker does.
  gpuq::Result<std::vector<double>> conv(int warmup, int iters) {
    const size_t xb = 16 * 32 * 32 * 4, wb = 16 * 16 * 9 * 4;
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t c;
    GPUQ_CUDNN(cudnnCreateTensorDescriptor(&x));
    GPUQ_CUDNN(cudnnCreateTensorDescriptor(&y));
    GPUQ_CUDNN(cudnnCreateFilterDescriptor(&w));
    GPUQ_CUDNN(cudnnCreateConvolutionDescriptor(&c));
    GPUQ_CUDNN(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, 16, 32, 32));
    GPUQ_CUDNN(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, 16, 32, 32));
    GPUQ_CUDNN(cudnnSetFilter4dDescriptor(w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, 16, 16, 3, 3));
    GPUQ_CUDNN(cudnnSetConvolution2dDescriptor(c, 1, 1, 1, 1, 1, 1, CUDNN_CROSS_CORRELATION,
                                               CUDNN_DATA_FLOAT));
    GPUQ_CUDNN(cudnnSetConvolutionMathType(c, CUDNN_FMA_MATH));
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int returned = 0;
    GPUQ_CUDNN(cudnnGetConvolutionForwardAlgorithm_v7(
        cudnn, x, w, c, y, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &returned, perf));
    // The worker's rule: the first that succeeds without TF32.
    int pick = -1;
    for (int i = 0; i < returned && pick < 0; ++i) {
      if (perf[i].status == CUDNN_STATUS_SUCCESS &&
          (perf[i].mathType == CUDNN_FMA_MATH || perf[i].mathType == CUDNN_DEFAULT_MATH)) {
        pick = i;
      }
    }
    if (pick < 0) return gpuq::Error(gpuq::ErrorCode::kInternal, "no conv algorithm");
    const cudnnConvolutionFwdAlgo_t algo = perf[pick].algo;
    GPUQ_CUDNN(cudnnSetConvolutionMathType(c, perf[pick].mathType));
    size_t ws_bytes = 0;
    GPUQ_CUDNN(cudnnGetConvolutionForwardWorkspaceSize(cudnn, x, w, c, y, algo, &ws_bytes));
    void *host = nullptr, *dev = nullptr, *ws = nullptr;
    GPUQ_CUDA(cudaMallocHost(&host, xb + wb + xb));
    GPUQ_CUDA(cudaMalloc(&dev, xb + wb + xb));
    if (ws_bytes > 0) GPUQ_CUDA(cudaMalloc(&ws, ws_bytes));
    fill(host, xb + wb);
    auto* d = static_cast<char*>(dev);
    const float one = 1, zero = 0;
    std::vector<double> us;
    for (int i = 0; i < warmup + iters; ++i) {
      auto t0 = Clock::now();
      GPUQ_CUDA(cudaMemcpyAsync(dev, host, xb + wb, cudaMemcpyHostToDevice, stream));
      GPUQ_CUDNN(cudnnConvolutionForward(cudnn, &one, x, d, w, d + xb, c, algo, ws, ws_bytes, &zero,
                                         y, d + xb + wb));
      GPUQ_CUDA(cudaMemcpyAsync(static_cast<char*>(host) + xb + wb, d + xb + wb, xb,
                                cudaMemcpyDeviceToHost, stream));
      GPUQ_CUDA(cudaStreamSynchronize(stream));
      if (i >= warmup) us.push_back(ms_since(t0) * 1000);
    }
    GPUQ_CUDA(cudaFree(dev));
    if (ws != nullptr) GPUQ_CUDA(cudaFree(ws));
    GPUQ_CUDA(cudaFreeHost(host));
    (void)cudnnDestroyTensorDescriptor(x);
    (void)cudnnDestroyTensorDescriptor(y);
    (void)cudnnDestroyFilterDescriptor(w);
    (void)cudnnDestroyConvolutionDescriptor(c);
    return us;
  }

  // GB/s of `reps` copies of `bytes` from `host` to the device, timed with events.
  gpuq::Result<double> h2d(void* host, size_t bytes, int reps) {
    void* dev = nullptr;
    GPUQ_CUDA(cudaMalloc(&dev, bytes));
    cudaEvent_t a, b;
    GPUQ_CUDA(cudaEventCreate(&a));
    GPUQ_CUDA(cudaEventCreate(&b));
    GPUQ_CUDA(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));  // warm-up
    GPUQ_CUDA(cudaEventRecord(a, stream));
    for (int i = 0; i < reps; ++i) {
      GPUQ_CUDA(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));
    }
    GPUQ_CUDA(cudaEventRecord(b, stream));
    GPUQ_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    GPUQ_CUDA(cudaEventElapsedTime(&ms, a, b));
    GPUQ_CUDA(cudaFree(dev));
    (void)cudaEventDestroy(a);
    (void)cudaEventDestroy(b);
    return double(bytes) * reps / (ms / 1000.0) / 1e9;
  }
};

std::string utc_now() {
  char buf[32];
  std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, gpuqd = GPUQ_BENCH_GPUQD;
  int iters = 1000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--gpuqd" && i + 1 < argc) {
      gpuqd = argv[++i];
    } else if (a == "--quick") {
      iters = 20;
    } else {
      std::fprintf(stderr, "usage: gpu_bench [--json FILE] [--gpuqd PATH] [--quick]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gpu_bench: no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) die("cudaGetDeviceProperties");
  json out{{"bench", "gpu"}, {"device", prop.name}, {"date", utc_now()}, {"iterations", iters}};

  // Rounds of: through gpuq (a fresh daemon: its first job, then per-job times), then the same
  // directly in this process (its context made in the first round and kept).
  constexpr int kRounds = 5;
  const int warmup = iters / 2;  // and the GPU's clocks up before each timed series
  std::vector<double> gpuq_gemm, gpuq_conv, gpuq_conv_spin, direct_gemm, direct_conv;
  json rounds = json::array();
  Direct direct;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<double> gg, gc, gs;
    {
      Daemon daemon(gpuqd, false);
      gpuq::Client client = daemon.connect();
      GpuqJob gemm = gemm_job(client, 64);
      gemm.run_ok(client);
      if (round == 0) out["first_job_ms"] = ms_since(daemon.started());
      gg = time_gpuq(client, gemm, warmup, iters);
      gc = time_gpuq(client, conv_job(client), warmup, iters);
      // The same conv2d from a client that spins up to 1 ms before it sleeps: its waits catch
      // the result as it lands, where the default 50 us spin gives up on an ~80 us job and pays
      // a futex wake-up.
      gpuq::Client spinning = daemon.connect(std::chrono::milliseconds(1));
      gs = time_gpuq(spinning, conv_job(spinning), warmup, iters);
    }
    if (round == 0) must(direct.init(), "direct: init");
    const std::vector<double> dg = must(direct.gemm(64, warmup, iters), "direct gemm");
    const std::vector<double> dc = must(direct.conv(warmup, iters), "direct conv");
    rounds.push_back(
        {{"gemm_64", {{"gpuq_median_us", median(gg)}, {"direct_median_us", median(dg)}}},
         {"conv2d_1x16x32x32_k16r3",
          {{"gpuq_median_us", median(gc)},
           {"gpuq_spin_1ms_median_us", median(gs)},
           {"direct_median_us", median(dc)}}}});
    gpuq_gemm.push_back(median(gg));
    gpuq_conv.push_back(median(gc));
    gpuq_conv_spin.push_back(median(gs));
    direct_gemm.push_back(median(dg));
    direct_conv.push_back(median(dc));
  }
  out["rounds"] = rounds;
  // Restart after a sticky error.
  {
    Daemon daemon(gpuqd, true);
    gpuq::Client client = daemon.connect();
    GpuqJob gemm = gemm_job(client, 64);
    gemm.run_ok(client);
    GpuqJob fault;
    fault.spec.op = "gpu_fault_test";
    fault.spec.pool = "gpu";
    gpuq::JobResult r = fault.run(client);
    if (r.status != gpuq::JobStatus::kFailed) die("gpu_fault_test did not fail");
    auto t0 = Clock::now();
    gemm.run_ok(client);
    out["restart_ms"] = ms_since(t0);
    out["fault_message"] = r.message;
  }

  auto entry = [](const std::vector<double>& via, const std::vector<double>& base) {
    return json{{"gpuq_median_us", median(via)},
                {"direct_median_us", median(base)},
                {"ratio", median(via) / median(base)},
                {"overhead_us", median(via) - median(base)}};
  };
  out["gemm_64"] = entry(gpuq_gemm, direct_gemm);
  out["conv2d_1x16x32x32_k16r3"] = entry(gpuq_conv, direct_conv);
  out["conv2d_1x16x32x32_k16r3_spin_1ms"] = entry(gpuq_conv_spin, direct_conv);

  const size_t bytes = 256ull << 20;
  void* pageable = std::aligned_alloc(4096, bytes);
  if (pageable == nullptr) die("aligned_alloc");
  std::memset(pageable, 1, bytes);
  if (cudaHostRegister(pageable, bytes, cudaHostRegisterDefault) != cudaSuccess) {
    die("cudaHostRegister");
  }
  void* pinned = nullptr;
  if (cudaMallocHost(&pinned, bytes) != cudaSuccess) die("cudaMallocHost");
  std::memset(pinned, 1, bytes);
  out["h2d_gbps"] = {{"host_register", must(direct.h2d(pageable, bytes, 10), "h2d registered")},
                     {"malloc_host", must(direct.h2d(pinned, bytes, 10), "h2d malloc_host")},
                     {"bytes", bytes}};
  (void)cudaHostUnregister(pageable);
  std::free(pageable);
  (void)cudaFreeHost(pinned);

  const std::string text = out.dump(2);
  std::printf("%s\n", text.c_str());
  if (!json_path.empty()) std::ofstream(json_path) << text << "\n";
  return 0;
}
