// The GPU worker's backend (gpu_backend.hpp): one context, stream, cuDNN and cuBLAS handle
// and device memory pool per worker; the catalog's tensor ops on cuDNN (the legacy API, still
// supported in cuDNN 9) and cuBLAS.
#include "gpu_backend.hpp"

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "cuda_check.hpp"
#include "gpu_kernels.hpp"
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

// A conv2d's shape, the key of the per-worker algorithm cache.
std::string conv_key(const Conv2d& c) {
  return std::string(dtype_name(c.dtype)) + " x" + c.x.shape.to_string() + " w" +
         c.w.shape.to_string() + " s" + std::to_string(c.stride[0]) + "x" +
         std::to_string(c.stride[1]) + " p" + std::to_string(c.pad[0]) + "x" +
         std::to_string(c.pad[1]) + " d" + std::to_string(c.dilation[0]) + "x" +
         std::to_string(c.dilation[1]) + " g" + std::to_string(c.groups);
}

struct ConvChoice {
  cudnnConvolutionFwdAlgo_t algo;
  cudnnMathType_t math;
  size_t workspace;
};

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
              ? run_fault_test()
              : Result<OpOutput>(Error(ErrorCode::kUnknownOp, std::string(kFaultTestOp) +
                                                                  ": a test op, enabled only with "
                                                                  "GPUQ_TEST_HOOKS=1"));
    }
    if (!r) return after_failure(std::move(r).error());
    return r;
  }

  bool must_exit() const override { return poisoned_; }
  uint64_t device_memory_budget() const override { return limit_; }
  uint64_t device_memory_used() const override { return used_; }

  Result<DeviceMemory> allocate(uint64_t bytes, const char* what) {
    if (bytes == 0) return DeviceMemory();
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

  Result<OpOutput> run_fault_test() {
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

  Result<OpOutput> run_tensor(OpKind kind, const OpContext& ctx) {
    const JobBuffers buffers{ctx.input_offset, ctx.input_bytes, ctx.output_offset,
                             ctx.output_capacity};
    auto parsed = parse_tensor_op(kind, ctx.params, buffers);
    if (!parsed) return std::move(parsed).error();
    const TensorOp& top = *parsed;
    const uint64_t out_bytes = result_bytes(top);
    const bool from_pinned = pinned(ctx.input, ctx.input_bytes) && pinned(ctx.output, out_bytes);

    auto in = allocate(ctx.input_bytes, op_kind_name(kind));
    if (!in) return std::move(in).error();
    auto out = allocate(out_bytes, op_kind_name(kind));
    if (!out) return std::move(out).error();
    GPUQ_CUDA(
        cudaMemcpyAsync(in->get(), ctx.input, ctx.input_bytes, cudaMemcpyHostToDevice, stream_));
    Result<void> ran = std::visit(
        [&](const auto& o) { return compute(o, ctx.input, in->get(), out->get()); }, top);
    if (!ran) return std::move(ran).error();
    GPUQ_CUDA(cudaMemcpyAsync(ctx.output, out->get(), out_bytes, cudaMemcpyDeviceToHost, stream_));
    GPUQ_CUDA(cudaStreamSynchronize(stream_));
    return OpOutput{out_bytes, from_pinned ? 1u : 0u};
  }

  // Each op: `host` is the job's input buffer on the host (read only for the few values an op
  // needs there), `in` its copy on the device, `out` the result's device buffer.
  Result<void> compute(const Conv2d& c, const std::byte*, std::byte* in, std::byte* out) {
    const char* op = "conv2d";
    TensorDesc x, y;
    FilterDesc w;
    ConvDesc conv;
    if (auto r = make_tensor(x, c.dtype, c.x.shape, op, "x"); !r) return r;
    if (auto r = make_tensor(y, c.dtype, c.y, op, "y"); !r) return r;
    for (int i = 0; i < 4; ++i) {
      if (!fits_int(c.w.shape.dims[i])) return too_large(op, "w");
    }
    for (int i = 0; i < 2; ++i) {
      if (!fits_int(c.stride[i]) || !fits_int(c.pad[i]) || !fits_int(c.dilation[i])) {
        return too_large(op, "stride, pad or dilation");
      }
    }
    if (!fits_int(c.groups)) return too_large(op, "groups");
    GPUQ_CUDNN(cudnnCreateFilterDescriptor(&w.d));
    GPUQ_CUDNN(cudnnSetFilter4dDescriptor(
        w.d, cudnn_type(c.dtype), CUDNN_TENSOR_NCHW, static_cast<int>(c.w.shape.dims[0]),
        static_cast<int>(c.w.shape.dims[1]), static_cast<int>(c.w.shape.dims[2]),
        static_cast<int>(c.w.shape.dims[3])));
    GPUQ_CUDNN(cudnnCreateConvolutionDescriptor(&conv.d));
    // f16 tensors with f32 accumulation; f32 without TF32 (results as precise as the CPU's).
    GPUQ_CUDNN(cudnnSetConvolution2dDescriptor(
        conv.d, static_cast<int>(c.pad[0]), static_cast<int>(c.pad[1]),
        static_cast<int>(c.stride[0]), static_cast<int>(c.stride[1]),
        static_cast<int>(c.dilation[0]), static_cast<int>(c.dilation[1]), CUDNN_CROSS_CORRELATION,
        CUDNN_DATA_FLOAT));
    GPUQ_CUDNN(cudnnSetConvolutionGroupCount(conv.d, static_cast<int>(c.groups)));
    const cudnnMathType_t math = c.dtype == DType::kF16 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    GPUQ_CUDNN(cudnnSetConvolutionMathType(conv.d, math));
    int on = 0, oc = 0, oh = 0, ow = 0;
    GPUQ_CUDNN(cudnnGetConvolution2dForwardOutputDim(conv.d, x.d, w.d, &on, &oc, &oh, &ow));
    if (on != c.y.dims[0] || oc != c.y.dims[1] || oh != c.y.dims[2] || ow != c.y.dims[3]) {
      return Error(ErrorCode::kInternal, "conv2d: cuDNN's output shape " + std::to_string(on) +
                                             "x" + std::to_string(oc) + "x" + std::to_string(oh) +
                                             "x" + std::to_string(ow) + " is not the parser's " +
                                             c.y.to_string());
    }

    // The algorithm: chosen once per shape (cuDNN's heuristics, the first whose workspace fits
    // the budget), then cached for the worker's life.
    const std::string key = conv_key(c);
    auto found = conv_cache_.find(key);
    if (found == conv_cache_.end()) {
      cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
      int returned = 0;
      GPUQ_CUDNN(cudnnGetConvolutionForwardAlgorithm_v7(
          cudnn_, x.d, w.d, conv.d, y.d, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &returned, perf));
      const uint64_t room = limit_ - used_;
      std::optional<ConvChoice> choice;
      for (int i = 0; i < returned && !choice; ++i) {
        if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
        if (c.dtype == DType::kF32 && perf[i].mathType != CUDNN_FMA_MATH &&
            perf[i].mathType != CUDNN_DEFAULT_MATH) {
          continue;
        }
        if (perf[i].memory > room) continue;
        choice = ConvChoice{perf[i].algo, perf[i].mathType, perf[i].memory};
      }
      if (!choice) {
        return Error(ErrorCode::kOutOfMemory,
                     "conv2d " + key + ": no cuDNN algorithm fits in the " + std::to_string(room) +
                         " bytes left of the worker's memory_limit");
      }
      GPUQ_CUDNN(cudnnSetConvolutionMathType(conv.d, choice->math));
      GPUQ_CUDNN(cudnnGetConvolutionForwardWorkspaceSize(cudnn_, x.d, w.d, conv.d, y.d,
                                                         choice->algo, &choice->workspace));
      found = conv_cache_.emplace(key, *choice).first;
    }
    const ConvChoice& ch = found->second;
    GPUQ_CUDNN(cudnnSetConvolutionMathType(conv.d, ch.math));
    auto ws = allocate(ch.workspace, "conv2d workspace");
    if (!ws) return std::move(ws).error();
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnConvolutionForward(cudnn_, &one, x.d, in + c.x.offset, w.d, in + c.w.offset,
                                       conv.d, ch.algo, ws->get(), ch.workspace, &zero, y.d, out));
    if (c.b) {
      TensorDesc b;
      if (auto r = make_tensor(b, c.dtype, Dims4{1, oc, 1, 1}); !r) return r;
      GPUQ_CUDNN(cudnnAddTensor(cudnn_, &one, b.d, in + c.b->offset, &one, y.d, out));
    }
    if (c.relu) return activation_in_place(Activation::kRelu, y, out);
    return {};
  }

  Result<void> compute(const ActivationOp& a, const std::byte*, std::byte* in, std::byte* out) {
    TensorDesc x;
    if (a.x.shape.elements() > static_cast<uint64_t>(INT_MAX)) return too_large("activation", "x");
    Dims4 flat{1, 1, 1, static_cast<int>(a.x.shape.elements())};
    if (auto r = make_tensor(x, a.dtype, flat); !r) return r;
    ActivationDesc ad;
    if (auto r = make_activation(ad, a.mode); !r) return r;
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnActivationForward(cudnn_, ad.d, &one, x.d, in + a.x.offset, &zero, x.d, out));
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

  Result<void> activation_in_place(Activation mode, const TensorDesc& y, std::byte* out) {
    ActivationDesc ad;
    if (auto r = make_activation(ad, mode); !r) return r;
    const float one = 1.0f, zero = 0.0f;
    GPUQ_CUDNN(cudnnActivationForward(cudnn_, ad.d, &one, y.d, out, &zero, y.d, out));
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
  std::map<uint32_t, ClientSegment> segments_;
  std::map<std::string, ConvChoice> conv_cache_;
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
