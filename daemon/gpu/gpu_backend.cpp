// The GPU worker's backend (gpu_backend.hpp): one context, stream, cuDNN and cuBLAS handle
// and device memory pool per worker; the catalog's tensor ops on cuDNN (the legacy API, still
// supported in cuDNN 9) and cuBLAS.
#include "gpu_backend.hpp"

#include <sched.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cuda_check.hpp"
#include "gpu_kernels.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/tensor_ops.hpp"
#include "plugins.hpp"

namespace gpuq::daemon {
namespace {

using nlohmann::json;
using namespace gpuq::tensor;

// The test-only op (registered in ops.cpp); it runs only with GPUQ_TEST_HOOKS=1.
constexpr const char* kFaultTestOp = "gpu_fault_test";
// cuBLAS's workspace, taken from the budget once: at most this, at most 1/8 of the budget.
constexpr uint64_t kCublasWorkspaceBytes = 4ull << 20;
// A tensor job's device buffers (input, output, cuDNN workspace) come from buffers the worker
// keeps from job to job, up to this much each and at most 1/8 of the budget; a larger job
// allocates its own for its run. Kept buffers count in the budget; a job that would not fit
// beside them frees them first.
constexpr uint64_t kKeptBufferBytes = 64ull << 20;
// A tensor job estimated at this many floating-point operations or more, or whose buffers hold
// this many bytes or more, waits for its kernels in slices and looks at the cancel flag
// between them, and copies its result back only once they are done: a cancel or time limit
// ends it then, the worker and its context stay (the kernel already running finishes on the
// stream, before the next job's work). Smaller jobs enqueue copy in, kernels and copy out at
// once and wait once: a second wait would cost them more than they run.
constexpr double kCancellableFlops = 1e10;
constexpr uint64_t kCancellableBytes = 1ull << 30;
// The cancellable wait spins on the event this long, then yields the CPU between looks.
constexpr uint64_t kWaitSpinNs = 1'000'000;

Error out_of_budget(uint64_t want, uint64_t used, uint64_t limit, const char* what) {
  return Error(ErrorCode::kOutOfMemory, std::string(what) + ": " + std::to_string(want) +
                                            " bytes of device memory asked, " +
                                            std::to_string(used) + " of the worker's " +
                                            std::to_string(limit) + "-byte memory_limit in use");
}

Error too_large(const char* op, const std::string& what) {
  return Error(ErrorCode::kInvalidArgument,
               std::string(op) + ": " + what + ": a dimension is too large for cuDNN (2^31 - 1)");
}

cudnnDataType_t cudnn_type(DType t) {
  return t == DType::kF16 ? CUDNN_DATA_HALF : CUDNN_DATA_FLOAT;
}

// binary16 -> float, for the few per-channel values cuDNN wants in f32 (batchnorm).
float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Owners of cuDNN descriptors; their destroy calls cannot fail in a way a caller could act on.
struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc() = default;
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  ~TensorDesc() {
    if (d != nullptr) (void)cudnnDestroyTensorDescriptor(d);
  }
};
struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  FilterDesc() = default;
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
  ~FilterDesc() {
    if (d != nullptr) (void)cudnnDestroyFilterDescriptor(d);
  }
};
struct ConvDesc {
  cudnnConvolutionDescriptor_t d = nullptr;
  ConvDesc() = default;
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
  ~ConvDesc() {
    if (d != nullptr) (void)cudnnDestroyConvolutionDescriptor(d);
  }
};
struct ActivationDesc {
  cudnnActivationDescriptor_t d = nullptr;
  ActivationDesc() = default;
  ActivationDesc(const ActivationDesc&) = delete;
  ActivationDesc& operator=(const ActivationDesc&) = delete;
  ~ActivationDesc() {
    if (d != nullptr) (void)cudnnDestroyActivationDescriptor(d);
  }
};
struct PoolingDesc {
  cudnnPoolingDescriptor_t d = nullptr;
  PoolingDesc() = default;
  PoolingDesc(const PoolingDesc&) = delete;
  PoolingDesc& operator=(const PoolingDesc&) = delete;
  ~PoolingDesc() {
    if (d != nullptr) (void)cudnnDestroyPoolingDescriptor(d);
  }
};

bool fits_int(int64_t v) {
  return v >= 0 && v <= INT_MAX;
}

// A shape as cuDNN's 4-D NCHW: rank 4 as is, NxC -> NxCx1x1, NxCxH -> NxCxHx1, and a rank-1
// shape (elementwise ops only) -> 1x1x1xW.
struct Dims4 {
  int n = 1, c = 1, h = 1, w = 1;
};
bool to_dims4(const Shape& s, Dims4* out) {
  int64_t d[4] = {1, 1, 1, 1};
  if (s.rank == 1) {
    d[3] = s.dims[0];
  } else {
    for (int i = 0; i < s.rank; ++i) d[i] = s.dims[i];
  }
  for (int64_t v : d) {
    if (!fits_int(v)) return false;
  }
  *out = Dims4{static_cast<int>(d[0]), static_cast<int>(d[1]), static_cast<int>(d[2]),
               static_cast<int>(d[3])};
  return true;
}

Result<void> make_tensor(TensorDesc& t, DType dtype, const Dims4& d) {
  GPUQ_CUDNN(cudnnCreateTensorDescriptor(&t.d));
  GPUQ_CUDNN(
      cudnnSetTensor4dDescriptor(t.d, CUDNN_TENSOR_NCHW, cudnn_type(dtype), d.n, d.c, d.h, d.w));
  return {};
}

Result<void> make_tensor(TensorDesc& t, DType dtype, const Shape& s, const char* op,
                         const char* what) {
  Dims4 d;
  if (!to_dims4(s, &d)) return too_large(op, what);
  return make_tensor(t, dtype, d);
}

Result<void> make_activation(ActivationDesc& a, Activation mode) {
  const cudnnActivationMode_t m = mode == Activation::kRelu      ? CUDNN_ACTIVATION_RELU
                                  : mode == Activation::kSigmoid ? CUDNN_ACTIVATION_SIGMOID
                                                                 : CUDNN_ACTIVATION_TANH;
  GPUQ_CUDNN(cudnnCreateActivationDescriptor(&a.d));
  GPUQ_CUDNN(cudnnSetActivationDescriptor(a.d, m, CUDNN_NOT_PROPAGATE_NAN, 0.0));
  return {};
}

// A conv2d's shape, for messages.
std::string conv_key(const Conv2d& c) {
  return std::string(dtype_name(c.dtype)) + " x" + c.x.shape.to_string() + " w" +
         c.w.shape.to_string() + " s" + std::to_string(c.stride[0]) + "x" +
         std::to_string(c.stride[1]) + " p" + std::to_string(c.pad[0]) + "x" +
         std::to_string(c.pad[1]) + " d" + std::to_string(c.dilation[0]) + "x" +
         std::to_string(c.dilation[1]) + " g" + std::to_string(c.groups);
}

// The same as the key of the per-worker plan cache: no strings made per job.
using ConvKey = std::array<int64_t, 16>;
ConvKey conv_plan_key(const Conv2d& c) {
  return {static_cast<int64_t>(c.dtype),
          c.x.shape.dims[0],
          c.x.shape.dims[1],
          c.x.shape.dims[2],
          c.x.shape.dims[3],
          c.w.shape.dims[0],
          c.w.shape.dims[1],
          c.w.shape.dims[2],
          c.w.shape.dims[3],
          c.stride[0],
          c.stride[1],
          c.pad[0],
          c.pad[1],
          c.dilation[0],
          c.dilation[1],
          c.groups};
}

// Everything cuDNN needs for one conv2d shape, made on its first job and kept for the
// worker's life (at most kMaxConvPlans shapes): descriptors of x, w, y and the bias, the
// convolution, and the algorithm chosen with its workspace size.
struct ConvPlan {
  TensorDesc x, y, bias;
  FilterDesc w;
  ConvDesc conv;
  cudnnConvolutionFwdAlgo_t algo{};
  size_t workspace = 0;
};
constexpr size_t kMaxConvPlans = 256;

// An estimate of a tensor op's floating-point operations, to tell a long job from a short one.
double flops_of(const Conv2d& c) {
  return 2.0 * static_cast<double>(c.y.elements()) * static_cast<double>(c.w.shape.dims[1]) *
         static_cast<double>(c.w.shape.dims[2]) * static_cast<double>(c.w.shape.dims[3]);
}
double flops_of(const Gemm& g) {
  return 2.0 * static_cast<double>(g.m) * static_cast<double>(g.n) * static_cast<double>(g.k);
}
template <typename Op>  // the elementwise and per-window ops: a few per element of x
double flops_of(const Op& o) {
  return 8.0 * static_cast<double>(o.x.shape.elements());
}

struct ClientSegment {
  const std::byte* base;
  uint64_t bytes;
  bool registered;
};

class GpuBackend;

// Device memory from the worker's pool, returned on destruction (stream-ordered).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(GpuBackend* owner, void* p, uint64_t bytes) : owner_(owner), p_(p), bytes_(bytes) {}
  DeviceMemory(DeviceMemory&& o) noexcept
      : owner_(std::exchange(o.owner_, nullptr)),
        p_(std::exchange(o.p_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    if (this != &o) {
      reset();
      owner_ = std::exchange(o.owner_, nullptr);
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { reset(); }

  std::byte* get() const { return static_cast<std::byte*>(p_); }
  uint64_t bytes() const { return bytes_; }
  void reset();

 private:
  GpuBackend* owner_ = nullptr;
  void* p_ = nullptr;
  uint64_t bytes_ = 0;
};

class GpuBackend final : public OpBackend {
 public:
  explicit GpuBackend(const WorkerOptions& o) : options_(o) {
    const char* hooks = std::getenv("GPUQ_TEST_HOOKS");
    test_hooks_ = hooks != nullptr && std::strcmp(hooks, "1") == 0;
  }

  Result<void> start() override {
    GPUQ_CUDA(cudaSetDevice(0));   // the only device this worker sees
    GPUQ_CUDA(cudaFree(nullptr));  // creates the context now, not on the first job
    cudaDeviceProp prop{};
    GPUQ_CUDA(cudaGetDeviceProperties(&prop, 0));
    device_name_ = prop.name;
    cc_major_ = prop.major;
    cc_minor_ = prop.minor;
    total_bytes_ = prop.totalGlobalMem;
    limit_ = options_.memory_limit_bytes > 0
                 ? std::min<uint64_t>(options_.memory_limit_bytes, total_bytes_)
                 : static_cast<uint64_t>(options_.memory_limit_fraction *
                                         static_cast<double>(total_bytes_));
    int register_ok = 0;
    GPUQ_CUDA(cudaDeviceGetAttribute(&register_ok, cudaDevAttrHostRegisterSupported, 0));
    host_register_supported_ = register_ok != 0;

    GPUQ_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    GPUQ_CUDA(cudaMemPoolCreate(&pool_, &props));
    // Keep what the pool holds up to the budget: memory freed by one job serves the next
    // without going back to the driver.
    uint64_t threshold = limit_;
    GPUQ_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));

    GPUQ_CUDNN(cudnnCreate(&cudnn_));
    GPUQ_CUDNN(cudnnSetStream(cudnn_, stream_));
    GPUQ_CUBLAS(cublasCreate(&cublas_));
    GPUQ_CUBLAS(cublasSetStream(cublas_, stream_));
    GPUQ_CUBLAS(cublasSetPointerMode(cublas_, CUBLAS_POINTER_MODE_HOST));
    auto ws = allocate(std::min(kCublasWorkspaceBytes, limit_ / 8), "cuBLAS workspace");
    if (!ws) return std::move(ws).error();
    cublas_workspace_ = std::move(*ws);
    GPUQ_CUBLAS(cublasSetWorkspace(cublas_, cublas_workspace_.get(), cublas_workspace_.bytes()));
    GPUQ_CUDA(cudaEventCreateWithFlags(&computed_, cudaEventDisableTiming));
    GPUQ_CUDA(cudaStreamSynchronize(stream_));
    started_ = true;
    for (auto& [client, seg] : segments_) register_segment(client, seg);
    GPUQ_LOG_INFO("GPU %s (compute %d.%d), %llu MiB, memory_limit %llu MiB", device_name_.c_str(),
                  cc_major_, cc_minor_, static_cast<unsigned long long>(total_bytes_ >> 20),
                  static_cast<unsigned long long>(limit_ >> 20));
    return {};
  }

  json describe() const override {
    uint32_t pinned = 0;
    for (const auto& [client, seg] : segments_) pinned += seg.registered ? 1 : 0;
    return json{{"kind", "gpu"},
                {"device", device_name_},
                {"compute_capability", std::to_string(cc_major_) + "." + std::to_string(cc_minor_)},
                {"memory_total", total_bytes_},
                {"memory_limit", limit_},
                {"pinned_registration", host_register_supported_},
                {"pinned_clients", pinned},
                {"clients", segments_.size()}};
  }

  void client_mapped(uint32_t client, void* base, uint64_t bytes) override {
    ClientSegment seg{static_cast<const std::byte*>(base), bytes, false};
    // Before start() (the segments of clients already connected) there is no context yet:
    // start() registers them.
    if (started_) register_segment(client, seg);
    segments_[client] = seg;
  }

  void client_unmapping(uint32_t client, void* base, uint64_t /*bytes*/) override {
    auto it = segments_.find(client);
    if (it == segments_.end()) return;
    if (it->second.registered && !poisoned_) {
      if (left_running_) {  // a cancelled job's copy in may still read this segment
        if (cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
          GPUQ_LOG_WARN("client %u: cudaStreamSynchronize before unregistering: %s", client,
                        cudaGetErrorString(e));
        }
        left_running_ = false;
      }
      if (cudaError_t e = cudaHostUnregister(base); e != cudaSuccess) {
        GPUQ_LOG_WARN("client %u: cudaHostUnregister: %s", client, cudaGetErrorString(e));
        (void)cudaGetLastError();
      }
    }
    segments_.erase(it);
  }

  Result<OpOutput> run(const OpInfo& op, const OpContext& ctx) override {
    if (op.run != nullptr) return op.run(ctx);  // built-in ops: on the host, as on a CPU pool
    Result<OpOutput> r = Error(ErrorCode::kUnknownOp,
                               std::string(op.name) + ": no GPU implementation in this build");
    if (op.tensor) {
      r = run_tensor(*op.tensor, ctx);
    } else if (op.plugin != nullptr) {
      r = run_plugin(op, ctx);
    } else if (std::strcmp(op.name, kFaultTestOp) == 0) {
      r = test_hooks_
              ? run_fault_test(ctx)
              : Result<OpOutput>(Error(ErrorCode::kUnknownOp, std::string(kFaultTestOp) +
                                                                  ": a test op, enabled only with "
                                                                  "GPUQ_TEST_HOOKS=1"));
    }
    // A cancel (wait_for_kernels) leaves the job's kernels running on the stream: no
    // synchronization here, the next job's finds any error.
    if (!r && r.error().code() != ErrorCode::kCancelled) return after_failure(std::move(r).error());
    return r;
  }

  bool must_exit() const override { return poisoned_; }
  uint64_t device_memory_budget() const override { return limit_; }
  uint64_t device_memory_used() const override { return used_; }

  Result<DeviceMemory> allocate(uint64_t bytes, const char* what) {
    if (bytes == 0) return DeviceMemory();
    if (bytes <= limit_ && used_ > limit_ - bytes) {
      // The buffers kept for the next jobs give way first (stream-ordered frees: the work
      // already enqueued that uses them comes first), but not the one this job's data is in.
      if (!io_in_use_) kept_io_.reset();
      kept_workspace_.reset();
    }
    if (bytes > limit_ || used_ > limit_ - bytes) return out_of_budget(bytes, used_, limit_, what);
    void* p = nullptr;
    GPUQ_CUDA(cudaMallocFromPoolAsync(&p, bytes, pool_, stream_));
    used_ += bytes;
    return DeviceMemory(this, p, bytes);
  }

  void release(void* p, uint64_t bytes) {
    used_ -= bytes;
    if (poisoned_) return;  // the context is lost; the process exits soon
    if (cudaError_t e = cudaFreeAsync(p, stream_); e != cudaSuccess) {
      GPUQ_LOG_WARN("cudaFreeAsync: %s", cudaGetErrorString(e));
    }
  }

 private:
  void register_segment(uint32_t client, ClientSegment& seg) {
    seg.registered = false;
    if (!host_register_supported_) return;
    cudaError_t e =
        cudaHostRegister(const_cast<std::byte*>(seg.base), seg.bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it
      GPUQ_LOG_WARN(
          "client %u: cudaHostRegister of its %llu-byte segment: %s; its copies run "
          "from pageable memory",
          client, static_cast<unsigned long long>(seg.bytes), cudaGetErrorString(e));
      return;
    }
    seg.registered = true;
  }

  bool pinned(const std::byte* p, uint64_t bytes) const {
    for (const auto& [client, seg] : segments_) {
      if (p >= seg.base && p + bytes <= seg.base + seg.bytes) return seg.registered;
    }
    return false;
  }

  // A job failed: is the context still good? A sticky error shows on the next synchronization
  // (and on every call after it); any other error is cleared.
  Error after_failure(Error e) {
    cudaError_t s = cudaStreamSynchronize(stream_);
    if (s == cudaSuccess) s = cudaGetLastError();
    if (!gpu::is_sticky_cuda_error(s)) {
      (void)cudaGetLastError();
      return e;
    }
    poisoned_ = true;
    const std::string name = cudaGetErrorName(s);
    std::string message = e.message();
    if (message.find(name) == std::string::npos) {
      message += "; then " + name + ": " + cudaGetErrorString(s);
    }
    GPUQ_LOG_ERROR("sticky CUDA error, the context is lost: %s", message.c_str());
    // The cause after the consequence: a long call and file can only cut the message's tail.
    return Error(ErrorCode::kOpFailed, "sticky CUDA error, the worker is replaced: " + message);
  }

  // The test op: with spin_us > 0, a kernel that runs that long, waited for as a long tensor
  // job is (cancellable: the path a cancel or time limit takes without replacing the worker);
  // else a kernel that writes far out of bounds, a sticky error.
  Result<OpOutput> run_fault_test(const OpContext& ctx) {
    auto spin_us = ctx.params.get_int("spin_us", 0, 0, 60'000'000);
    if (!spin_us) return spin_us.error();
    if (*spin_us > 0) {
      GPUQ_CUDA(gpu::launch_spin(static_cast<uint64_t>(*spin_us) * 1000, stream_));
      auto done = wait_for_kernels(ctx, kFaultTestOp);
      if (!done) return std::move(done).error();
      return OpOutput{0, static_cast<uint64_t>(*spin_us)};
    }
    auto buf = allocate(256, kFaultTestOp);
    if (!buf) return std::move(buf).error();
    // 2^47 bytes on: past the top of the x86-64 user address space, where unified addressing
    // puts every device and host mapping, so nothing can be mapped there (not even host memory
    // the GPU could reach through HMM).
    GPUQ_CUDA(gpu::launch_out_of_bounds_write(reinterpret_cast<float*>(buf->get()),
                                              uint64_t{1} << 47, stream_));
    GPUQ_CUDA(cudaStreamSynchronize(stream_));
    return Error(ErrorCode::kInternal, std::string(kFaultTestOp) + ": the kernel did not fault");
  }

  // A plug-in op (gpuq/plugin.h): the input copied to device memory from the budget, an output
  // buffer of the job's capacity, the op enqueues on stream_, then the result's output_bytes
  // come back. A failure goes through after_failure (run()), which catches a sticky error.
  Result<OpOutput> run_plugin(const OpInfo& op, const OpContext& ctx) {
    if (op.plugin->gpu_fn == nullptr) {
      return Error(ErrorCode::kUnknownOp, std::string(op.name) + ": plug-in " + op.plugin->library +
                                              " has no GPU implementation of this op");
    }
    auto in = allocate(ctx.input_bytes, op.name);
    if (!in) return std::move(in).error();
    auto out = allocate(ctx.output_capacity, op.name);
    if (!out) return std::move(out).error();
    GPUQ_CUDA(
        cudaMemcpyAsync(in->get(), ctx.input, ctx.input_bytes, cudaMemcpyHostToDevice, stream_));
    auto r = run_plugin_op(op, op.plugin->gpu_fn, ctx, in->get(), out->get(),
                           PluginDeviceHandles{stream_, cudnn_, cublas_});
    if (!r) return r;
    GPUQ_CUDA(cudaStreamSynchronize(stream_));
    GPUQ_CUDA(cudaGetLastError());
    if (r->output_bytes > 0) {
      GPUQ_CUDA(cudaMemcpyAsync(ctx.output, out->get(), r->output_bytes, cudaMemcpyDeviceToHost,
                                stream_));
      GPUQ_CUDA(cudaStreamSynchronize(stream_));
    }
    return r;
  }

  // A kept buffer of at least `bytes` (grown to it, within kKeptBufferBytes and 1/8 of the
  // budget), or null when the job needs more than that and must allocate its own.
  Result<std::byte*> kept(DeviceMemory& buf, uint64_t bytes, const char* what) {
    const uint64_t cap = std::min(kKeptBufferBytes, limit_ / 8);
    if (bytes > cap) return nullptr;
    if (buf.bytes() < bytes) {
      const uint64_t size = std::min(cap, std::max({bytes, 2 * buf.bytes(), uint64_t{1} << 20}));
      buf.reset();
      auto grown = allocate(size, what);
      if (!grown) return std::move(grown).error();
      buf = std::move(*grown);
    }
    return buf.get();
  }

  // Device memory for one job: from `buf` kept between jobs where it fits, else `own`,
  // allocated for this job alone.
  Result<std::byte*> job_memory(DeviceMemory& buf, DeviceMemory& own, uint64_t bytes,
                                const char* what) {
    if (bytes == 0) return nullptr;
    auto p = kept(buf, bytes, what);
    if (!p) return p;
    if (*p != nullptr) return p;
    auto mine = allocate(bytes, what);
    if (!mine) return std::move(mine).error();
    own = std::move(*mine);
    return own.get();
  }

  Result<OpOutput> run_tensor(OpKind kind, const OpContext& ctx) {
    const JobBuffers buffers{ctx.input_offset, ctx.input_bytes, ctx.output_offset,
                             ctx.output_capacity};
    auto parsed = parse_tensor_op(kind, ctx.params, buffers);
    if (!parsed) return std::move(parsed).error();
    const TensorOp& top = *parsed;
    const char* name = op_kind_name(kind);
    const uint64_t out_bytes = result_bytes(top);
    const bool from_pinned = pinned(ctx.input, ctx.input_bytes) && pinned(ctx.output, out_bytes);

    // Input and output in one buffer, the output 256-byte aligned after the input.
    const uint64_t out_at = (ctx.input_bytes + 255) & ~uint64_t{255};
    DeviceMemory own;
    auto io = job_memory(kept_io_, own, out_at + out_bytes, name);
    if (!io) return std::move(io).error();
    std::byte* in = *io;
    std::byte* out = *io + out_at;
    io_in_use_ = own.get() == nullptr;
    struct Release {
      bool& flag;
      ~Release() { flag = false; }
    } release{io_in_use_};
    job_workspace_ = DeviceMemory();
    GPUQ_CUDA(cudaMemcpyAsync(in, ctx.input, ctx.input_bytes, cudaMemcpyHostToDevice, stream_));
    const bool cancellable =
        std::visit([](const auto& o) { return flops_of(o); }, top) >= kCancellableFlops ||
        ctx.input_bytes + out_bytes >= kCancellableBytes;
    Result<void> ran =
        std::visit([&](const auto& o) { return compute(o, ctx.input, in, out); }, top);
    if (!ran) return std::move(ran).error();
    if (cancellable) {
      auto done = wait_for_kernels(ctx, name);
      if (!done) return std::move(done).error();
    }
    GPUQ_CUDA(cudaMemcpyAsync(ctx.output, out, out_bytes, cudaMemcpyDeviceToHost, stream_));
    GPUQ_CUDA(cudaStreamSynchronize(stream_));
    left_running_ = false;
    job_workspace_ = DeviceMemory();
    return OpOutput{out_bytes, from_pinned ? 1u : 0u};
  }

  // After a cancellable job's kernels are enqueued: waits for them, looking at the job's cancel
  // flag between looks at the stream. Cancelled: nothing more is enqueued (no result is copied
  // back) and the job ends kCancelled now. Its copy in and kernels (and those of earlier
  // cancelled jobs) finish on the stream before any later work, and its device memory is freed
  // after them (stream-ordered). Its copy in may still read the client's segment: the worker
  // waits for the stream before it unregisters a segment (client_unmapping).
  Result<void> wait_for_kernels(const OpContext& ctx, const char* name) {
    GPUQ_CUDA(cudaEventRecord(computed_, stream_));
    const uint64_t start = monotonic_ns();
    for (;;) {
      const cudaError_t e = cudaEventQuery(computed_);
      if (e == cudaSuccess) return {};
      if (e != cudaErrorNotReady) GPUQ_CUDA(e);
      if (ctx.cancel_requested.load(std::memory_order_relaxed) != 0) {
        left_running_ = true;
        job_workspace_ = DeviceMemory();
        return Error(ErrorCode::kCancelled, std::string(name) + ": cancelled while running");
      }
      if (monotonic_ns() - start > kWaitSpinNs) sched_yield();
    }
  }

  // The plan of a conv2d's shape: made on its first job (descriptors, and the algorithm by
  // cuDNN's heuristics: the first whose workspace fits the budget), then kept.
  Result<const ConvPlan*> conv_plan(const Conv2d& c) {
    const ConvKey key = conv_plan_key(c);
    if (auto found = conv_plans_.find(key); found != conv_plans_.end()) return found->second.get();
    const char* op = "conv2d";
    auto plan = std::make_unique<ConvPlan>();
    if (auto r = make_tensor(plan->x, c.dtype, c.x.shape, op, "x"); !r) return r.error();
    if (auto r = make_tensor(plan->y, c.dtype, c.y, op, "y"); !r) return r.error();
    for (int i = 0; i < 4; ++i) {
      if (!fits_int(c.w.shape.dims[i])) return too_large(op, "w");
    }
    for (int i = 0; i < 2; ++i) {
      if (!fits_int(c.stride[i]) || !fits_int(c.pad[i]) || !fits_int(c.dilation[i])) {
        return too_large(op, "stride, pad or dilation");
      }
    }
    if (!fits_int(c.groups)) return too_large(op, "groups");
    GPUQ_CUDNN(cudnnCreateFilterDescriptor(&plan->w.d));
    GPUQ_CUDNN(cudnnSetFilter4dDescriptor(
        plan->w.d, cudnn_type(c.dtype), CUDNN_TENSOR_NCHW, static_cast<int>(c.w.shape.dims[0]),
        static_cast<int>(c.w.shape.dims[1]), static_cast<int>(c.w.shape.dims[2]),
        static_cast<int>(c.w.shape.dims[3])));
    GPUQ_CUDNN(cudnnCreateConvolutionDescriptor(&plan->conv.d));
    // f16 tensors with f32 accumulation; f32 without TF32 (results as precise as the CPU's).
    GPUQ_CUDNN(cudnnSetConvolution2dDescriptor(
        plan->conv.d, static_cast<int>(c.pad[0]), static_cast<int>(c.pad[1]),
        static_cast<int>(c.stride[0]), static_cast<int>(c.stride[1]),
        static_cast<int>(c.dilation[0]), static_cast<int>(c.dilation[1]), CUDNN_CROSS_CORRELATION,
        CUDNN_DATA_FLOAT));
    GPUQ_CUDNN(cudnnSetConvolutionGroupCount(plan->conv.d, static_cast<int>(c.groups)));
    const cudnnMathType_t math = c.dtype == DType::kF16 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    GPUQ_CUDNN(cudnnSetConvolutionMathType(plan->conv.d, math));
    int on = 0, oc = 0, oh = 0, ow = 0;
    GPUQ_CUDNN(cudnnGetConvolution2dForwardOutputDim(plan->conv.d, plan->x.d, plan->w.d, &on, &oc,
                                                     &oh, &ow));
    if (on != c.y.dims[0] || oc != c.y.dims[1] || oh != c.y.dims[2] || ow != c.y.dims[3]) {
      return Error(ErrorCode::kInternal, "conv2d: cuDNN's output shape " + std::to_string(on) +
                                             "x" + std::to_string(oc) + "x" + std::to_string(oh) +
                                             "x" + std::to_string(ow) + " is not the parser's " +
                                             c.y.to_string());
    }
    if (auto r = make_tensor(plan->bias, c.dtype, Dims4{1, oc, 1, 1}); !r) return r.error();
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int returned = 0;
    GPUQ_CUDNN(cudnnGetConvolutionForwardAlgorithm_v7(cudnn_, plan->x.d, plan->w.d, plan->conv.d,
                                                      plan->y.d, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
                                                      &returned, perf));
    const uint64_t room = limit_ - used_;
    bool chosen = false;
    for (int i = 0; i < returned && !chosen; ++i) {
      if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
      if (c.dtype == DType::kF32 && perf[i].mathType != CUDNN_FMA_MATH &&
          perf[i].mathType != CUDNN_DEFAULT_MATH) {
        continue;
      }
      if (perf[i].memory > room) continue;
      plan->algo = perf[i].algo;
      GPUQ_CUDNN(cudnnSetConvolutionMathType(plan->conv.d, perf[i].mathType));
      chosen = true;
    }
    if (!chosen) {
      return Error(ErrorCode::kOutOfMemory,
                   "conv2d " + conv_key(c) + ": no cuDNN algorithm fits in the " +
                       std::to_string(room) + " bytes left of the worker's memory_limit");
    }
    GPUQ_CUDNN(cudnnGetConvolutionForwardWorkspaceSize(cudnn_, plan->x.d, plan->w.d, plan->conv.d,
                                                       plan->y.d, plan->algo, &plan->workspace));
    if (conv_plans_.size() >= kMaxConvPlans) conv_plans_.clear();  // many shapes: start over
    return conv_plans_.emplace(key, std::move(plan)).first->second.get();
  }

  // Each op: `host` is the job's input buffer on the host (read only for the few values an op
  // needs there), `in` its copy on the device, `out` the result's device buffer.
  Result<void> compute(const Conv2d& c, const std::byte*, std::byte* in, std::byte* out) {
    auto planned = conv_plan(c);
    if (!planned) return std::move(planned).error();
    const ConvPlan& p = **planned;
    auto ws = job_memory(kept_workspace_, job_workspace_, p.workspace, "conv2d workspace");
    if (!ws) return std::move(ws).error();
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnConvolutionForward(cudnn_, &one, p.x.d, in + c.x.offset, p.w.d, in + c.w.offset,
                                       p.conv.d, p.algo, *ws, p.workspace, &zero, p.y.d, out));
    if (c.b) GPUQ_CUDNN(cudnnAddTensor(cudnn_, &one, p.bias.d, in + c.b->offset, &one, p.y.d, out));
    if (c.relu) return activation_in_place(Activation::kRelu, p.y, out);
    return {};
  }

  Result<void> compute(const ActivationOp& a, const std::byte*, std::byte* in, std::byte* out) {
    TensorDesc x;
    if (a.x.shape.elements() > static_cast<uint64_t>(INT_MAX)) return too_large("activation", "x");
    Dims4 flat{1, 1, 1, static_cast<int>(a.x.shape.elements())};
    if (auto r = make_tensor(x, a.dtype, flat); !r) return r;
    auto ad = activation(a.mode);
    if (!ad) return std::move(ad).error();
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnActivationForward(cudnn_, *ad, &one, x.d, in + a.x.offset, &zero, x.d, out));
    return {};
  }

  Result<void> compute(const Softmax& s, const std::byte*, std::byte* in, std::byte* out) {
    TensorDesc x;
    if (auto r = make_tensor(x, s.dtype, s.x.shape, "softmax", "x"); !r) return r;
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnSoftmaxForward(cudnn_, s.log ? CUDNN_SOFTMAX_LOG : CUDNN_SOFTMAX_ACCURATE,
                                   CUDNN_SOFTMAX_MODE_CHANNEL, &one, x.d, in + s.x.offset, &zero,
                                   x.d, out));
    return {};
  }

  Result<void> compute(const Pool2d& p, const std::byte*, std::byte* in, std::byte* out) {
    const char* op = "pool2d";
    TensorDesc x, y;
    if (auto r = make_tensor(x, p.dtype, p.x.shape, op, "x"); !r) return r;
    if (auto r = make_tensor(y, p.dtype, p.y, op, "y"); !r) return r;
    for (int i = 0; i < 2; ++i) {
      if (!fits_int(p.window[i]) || !fits_int(p.stride[i]) || !fits_int(p.pad[i])) {
        return too_large(op, "window, stride or pad");
      }
    }
    const cudnnPoolingMode_t mode = p.mode == PoolMode::kMax ? CUDNN_POOLING_MAX
                                    : p.count_pad ? CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING
                                                  : CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING;
    PoolingDesc pd;
    GPUQ_CUDNN(cudnnCreatePoolingDescriptor(&pd.d));
    GPUQ_CUDNN(cudnnSetPooling2dDescriptor(
        pd.d, mode, CUDNN_NOT_PROPAGATE_NAN, static_cast<int>(p.window[0]),
        static_cast<int>(p.window[1]), static_cast<int>(p.pad[0]), static_cast<int>(p.pad[1]),
        static_cast<int>(p.stride[0]), static_cast<int>(p.stride[1])));
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnPoolingForward(cudnn_, pd.d, &one, x.d, in + p.x.offset, &zero, y.d, out));
    return {};
  }

  Result<void> compute(const BatchNorm& b, const std::byte* host, std::byte* in, std::byte* out) {
    const char* op = "batchnorm";
    TensorDesc x, params;
    if (auto r = make_tensor(x, b.dtype, b.x.shape, op, "x"); !r) return r;
    const int64_t channels = b.x.shape.dims[1];
    if (!fits_int(channels)) return too_large(op, "x");
    // cuDNN takes the per-channel values in f32 for f16 data too.
    if (auto r = make_tensor(params, DType::kF32, Dims4{1, static_cast<int>(channels), 1, 1}); !r) {
      return r;
    }
    const Operand* const sources[4] = {&b.scale, &b.bias, &b.mean, &b.var};
    const std::byte* p[4];
    DeviceMemory converted;
    if (b.dtype == DType::kF32) {
      for (int i = 0; i < 4; ++i) p[i] = in + sources[i]->offset;
    } else {
      std::vector<float> values(4 * static_cast<size_t>(channels));
      for (int i = 0; i < 4; ++i) {
        for (int64_t k = 0; k < channels; ++k) {
          uint16_t h;
          std::memcpy(&h, host + sources[i]->offset + 2 * k, sizeof h);
          values[i * channels + k] = half_to_float(h);
        }
      }
      auto dev = allocate(values.size() * sizeof(float), op);
      if (!dev) return std::move(dev).error();
      converted = std::move(*dev);
      GPUQ_CUDA(cudaMemcpyAsync(converted.get(), values.data(), values.size() * sizeof(float),
                                cudaMemcpyHostToDevice, stream_));
      GPUQ_CUDA(cudaStreamSynchronize(stream_));  // `values` goes out of scope
      for (int i = 0; i < 4; ++i) p[i] = converted.get() + i * channels * sizeof(float);
    }
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnBatchNormalizationForwardInference(cudnn_, CUDNN_BATCHNORM_SPATIAL, &one, &zero,
                                                       x.d, in + b.x.offset, x.d, out, params.d,
                                                       p[0], p[1], p[2], p[3], b.eps));
    if (b.relu) return activation_in_place(Activation::kRelu, x, out);
    return {};
  }

  Result<void> compute(const Gemm& g, const std::byte*, std::byte* in, std::byte* out) {
    if (!fits_int(g.m) || !fits_int(g.n) || !fits_int(g.k)) {
      return Error(ErrorCode::kInvalidArgument, "gemm: m, n or k above 2^31 - 1 (cuBLAS)");
    }
    const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
    const cudaDataType_t t = g.dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_32F;
    if (g.c) {
      GPUQ_CUDA(
          cudaMemcpyAsync(out, in + g.c->offset, g.c->bytes, cudaMemcpyDeviceToDevice, stream_));
    }
    // Row-major y = op(a) op(b) is column-major y^T = op(b)^T op(a)^T, and a row-major matrix
    // is its transpose in column-major: hand cuBLAS b first, then a, each with its stored row
    // length as leading dimension.
    const float alpha = static_cast<float>(g.alpha), beta = static_cast<float>(g.beta);
    GPUQ_CUBLAS(cublasGemmEx(
        cublas_, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m,
        k, &alpha, in + g.b.offset, t, g.trans_b ? k : n, in + g.a.offset, t, g.trans_a ? m : k,
        &beta, out, t, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return {};
  }

  // The activation descriptor of a mode, made once.
  Result<cudnnActivationDescriptor_t> activation(Activation mode) {
    ActivationDesc& ad = activations_[static_cast<size_t>(mode)];
    if (ad.d == nullptr) {
      if (auto r = make_activation(ad, mode); !r) {
        if (ad.d != nullptr) (void)cudnnDestroyActivationDescriptor(std::exchange(ad.d, nullptr));
        return r.error();
      }
    }
    return ad.d;
  }

  Result<void> activation_in_place(Activation mode, const TensorDesc& y, std::byte* out) {
    auto ad = activation(mode);
    if (!ad) return std::move(ad).error();
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnActivationForward(cudnn_, *ad, &one, y.d, out, &zero, y.d, out));
    return {};
  }

  WorkerOptions options_;
  bool test_hooks_ = false;
  bool started_ = false;
  bool poisoned_ = false;  // a sticky CUDA error: must_exit()
  std::string device_name_;
  int cc_major_ = 0, cc_minor_ = 0;
  uint64_t total_bytes_ = 0;
  uint64_t limit_ = 0;  // the budget of device memory this worker's jobs may use
  uint64_t used_ = 0;   // allocated from the pool now
  bool host_register_supported_ = false;
  cudaStream_t stream_ = nullptr;
  cudaMemPool_t pool_ = nullptr;
  cudnnHandle_t cudnn_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  DeviceMemory cublas_workspace_;
  DeviceMemory kept_io_;            // tensor jobs' input and output, kept between jobs
  DeviceMemory kept_workspace_;     // conv2d's cuDNN workspace, kept between jobs
  DeviceMemory job_workspace_;      // a workspace too large to keep: this job's alone
  bool io_in_use_ = false;          // a job's data is in kept_io_ (allocate must not free it)
  cudaEvent_t computed_ = nullptr;  // a cancellable job's kernels are done
  // A cancelled job's work may still be on the stream (wait_for_kernels): until the next
  // synchronization of the stream, a segment is unregistered only after one.
  bool left_running_ = false;
  std::map<uint32_t, ClientSegment> segments_;
  std::map<ConvKey, std::unique_ptr<ConvPlan>> conv_plans_;
  std::array<ActivationDesc, 3> activations_;  // by Activation: relu, sigmoid, tanh
};

void DeviceMemory::reset() {
  if (owner_ != nullptr && p_ != nullptr) owner_->release(p_, bytes_);
  owner_ = nullptr;
  p_ = nullptr;
  bytes_ = 0;
}

}  // namespace

OpBackend& gpu_backend(const WorkerOptions& options) {
  // Never destroyed: the process exits with its context, and a destructor here would run
  // CUDA calls after the runtime has begun to unload.
  static GpuBackend* backend = new GpuBackend(options);
  return *backend;
}

}  // namespace gpuq::daemon
