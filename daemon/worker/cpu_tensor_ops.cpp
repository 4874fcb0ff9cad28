// The tensor ops on oneDNN (2.x, CPU engine), f32, on the caller's thread.
//
// The operands are wrapped in place: a dnnl::memory over the client's own bytes (plain
// row-major layouts, described by their strides), the result written straight into the output
// buffer; nothing is copied except gemm's c, which is copied to the output first and then
// accumulated into (a sum post-op). oneDNN keeps its own cache of primitives keyed by their
// descriptors (1024 entries by default), so a repeated shape skips the JIT compilation.
//
// Threading: Debian's libdnnl is built with OpenMP (GNU libgomp). A worker is pinned to one CPU
// and runs one job at a time, so cpu_tensor_ops_start() sets the OpenMP runtime's thread count
// to 1 (a team of threads on one pinned CPU only contends; and with no extra thread,
// ThreadSanitizer has nothing in uninstrumented libgomp to report). omp_set_num_threads is
// looked up at run time, in the libgomp that libdnnl has loaded, rather than linked: linking an
// OpenMP runtime ourselves could bring a second one (clang's libomp) into the process.
#include <dlfcn.h>

#include <oneapi/dnnl/dnnl_debug.h>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu_tensor_ops.hpp"

namespace gpuq::daemon {
namespace {

using dnnl::algorithm;
using dnnl::memory;
using dnnl::prop_kind;
using Dt = dnnl::memory::data_type;

// TensorOp's alternatives are in OpKind's order (checked in cpu_tensor_ops.hpp).
const char* op_name(const tensor::TensorOp& op) {
  return tensor::op_kind_name(static_cast<tensor::OpKind>(op.index()));
}

struct Runtime {
  dnnl::engine engine;
  dnnl::stream stream;
};

std::optional<Runtime>& runtime() {
  static std::optional<Runtime> rt;
  return rt;
}

void set_single_thread() {
  using SetThreads = void (*)(int);
  void* sym = dlsym(RTLD_DEFAULT, "omp_set_num_threads");
  if (sym != nullptr) reinterpret_cast<SetThreads>(sym)(1);
}

memory::dims dims_of(const tensor::Shape& s) {
  return memory::dims(s.dims, s.dims + s.rank);
}

// A dense row-major f32 tensor of these dimensions.
memory::desc plain(const memory::dims& dims) {
  memory::dims strides(dims.size());
  memory::dim stride = 1;
  for (size_t i = dims.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= dims[i];
  }
  return memory::desc(dims, Dt::f32, strides);
}

memory::desc plain(const tensor::Shape& s) {
  return plain(dims_of(s));
}

// oneDNN never writes a source; its memory handles are not const.
memory wrap(const memory::desc& md, const std::byte* p, uint64_t offset) {
  return memory(md, runtime()->engine, const_cast<std::byte*>(p) + offset);
}
memory wrap_out(const memory::desc& md, std::byte* p) {
  return memory(md, runtime()->engine, p);
}

void execute(const dnnl::primitive& prim, const std::unordered_map<int, memory>& args) {
  prim.execute(runtime()->stream, args);
  runtime()->stream.wait();
}

void run_conv2d(const tensor::Conv2d& c, const std::byte* in, std::byte* out) {
  const int64_t g = c.groups;
  const tensor::Shape& x = c.x.shape;
  const tensor::Shape& w = c.w.shape;
  memory::desc src = plain(x);
  memory::desc dst = plain(c.y);
  // Grouped weights are K x C/g x R x S as stored, which is g x K/g x C/g x R x S (goihw).
  memory::desc wei =
      g == 1 ? plain(w) : plain(memory::dims{g, w.dims[0] / g, w.dims[1], w.dims[2], w.dims[3]});
  const memory::dims strides{c.stride[0], c.stride[1]};
  const memory::dims dilates{c.dilation[0] - 1, c.dilation[1] - 1};  // oneDNN: 0 = dense
  const memory::dims pad{c.pad[0], c.pad[1]};
  dnnl::primitive_attr attr;
  if (c.relu) {
    dnnl::post_ops po;
    po.append_eltwise(1.f, algorithm::eltwise_relu, 0.f, 0.f);
    attr.set_post_ops(po);
  }
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, wrap(src, in, c.x.offset)},
                                       {DNNL_ARG_WEIGHTS, wrap(wei, in, c.w.offset)},
                                       {DNNL_ARG_DST, wrap_out(dst, out)}};
  std::optional<dnnl::convolution_forward::desc> d;
  if (c.b) {
    memory::desc bias = plain(c.b->shape);
    d.emplace(prop_kind::forward_inference, algorithm::convolution_direct, src, wei, bias, dst,
              strides, dilates, pad, pad);
    args.emplace(DNNL_ARG_BIAS, wrap(bias, in, c.b->offset));
  } else {
    d.emplace(prop_kind::forward_inference, algorithm::convolution_direct, src, wei, dst, strides,
              dilates, pad, pad);
  }
  dnnl::convolution_forward::primitive_desc pd(*d, attr, runtime()->engine);
  execute(dnnl::convolution_forward(pd), args);
}

void run_activation(const tensor::ActivationOp& a, const std::byte* in, std::byte* out) {
  algorithm alg = algorithm::eltwise_relu;
  if (a.mode == tensor::Activation::kSigmoid) alg = algorithm::eltwise_logistic;
  if (a.mode == tensor::Activation::kTanh) alg = algorithm::eltwise_tanh;
  memory::desc md = plain(a.x.shape);
  dnnl::eltwise_forward::desc d(prop_kind::forward_inference, alg, md, 0.f, 0.f);
  dnnl::eltwise_forward::primitive_desc pd(d, runtime()->engine);
  execute(dnnl::eltwise_forward(pd),
          {{DNNL_ARG_SRC, wrap(md, in, a.x.offset)}, {DNNL_ARG_DST, wrap_out(md, out)}});
}

void run_softmax(const tensor::Softmax& s, const std::byte* in, std::byte* out) {
  memory::desc md = plain(s.x.shape);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, wrap(md, in, s.x.offset)},
                                       {DNNL_ARG_DST, wrap_out(md, out)}};
  if (s.log) {
    dnnl::logsoftmax_forward::desc d(prop_kind::forward_inference, md, 1);
    dnnl::logsoftmax_forward::primitive_desc pd(d, runtime()->engine);
    execute(dnnl::logsoftmax_forward(pd), args);
  } else {
    dnnl::softmax_forward::desc d(prop_kind::forward_inference, md, 1);
    dnnl::softmax_forward::primitive_desc pd(d, runtime()->engine);
    execute(dnnl::softmax_forward(pd), args);
  }
}

void run_pool2d(const tensor::Pool2d& p, const std::byte* in, std::byte* out) {
  algorithm alg = algorithm::pooling_max;
  if (p.mode == tensor::PoolMode::kAvg) {
    alg = p.count_pad ? algorithm::pooling_avg_include_padding
                      : algorithm::pooling_avg_exclude_padding;
  }
  memory::desc src = plain(p.x.shape);
  memory::desc dst = plain(p.y);
  const memory::dims pad{p.pad[0], p.pad[1]};
  dnnl::pooling_forward::desc d(prop_kind::forward_inference, alg, src, dst,
                                {p.stride[0], p.stride[1]}, {p.window[0], p.window[1]}, pad, pad);
  dnnl::pooling_forward::primitive_desc pd(d, runtime()->engine);
  execute(dnnl::pooling_forward(pd),
          {{DNNL_ARG_SRC, wrap(src, in, p.x.offset)}, {DNNL_ARG_DST, wrap_out(dst, out)}});
}

void run_batchnorm(const tensor::BatchNorm& b, const std::byte* in, std::byte* out) {
  memory::desc md = plain(b.x.shape);
  memory::desc c = plain(b.scale.shape);
  auto flags = dnnl::normalization_flags::use_global_stats | dnnl::normalization_flags::use_scale |
               dnnl::normalization_flags::use_shift;
  if (b.relu) flags = flags | dnnl::normalization_flags::fuse_norm_relu;
  dnnl::batch_normalization_forward::desc d(prop_kind::forward_inference, md,
                                            static_cast<float>(b.eps), flags);
  dnnl::batch_normalization_forward::primitive_desc pd(d, runtime()->engine);
  execute(dnnl::batch_normalization_forward(pd), {{DNNL_ARG_SRC, wrap(md, in, b.x.offset)},
                                                  {DNNL_ARG_SCALE, wrap(c, in, b.scale.offset)},
                                                  {DNNL_ARG_SHIFT, wrap(c, in, b.bias.offset)},
                                                  {DNNL_ARG_MEAN, wrap(c, in, b.mean.offset)},
                                                  {DNNL_ARG_VARIANCE, wrap(c, in, b.var.offset)},
                                                  {DNNL_ARG_DST, wrap_out(md, out)}});
}

// y = alpha op(a) op(b) + beta c: matmul over strided views of a and b (a transpose is a
// swap of strides), alpha an output scale, beta c a sum post-op over c copied into y first.
void run_gemm(const tensor::Gemm& g, const std::byte* in, std::byte* out) {
  const memory::dim m = g.m, n = g.n, k = g.k;
  memory::desc a(memory::dims{m, k}, Dt::f32, g.trans_a ? memory::dims{1, m} : memory::dims{k, 1});
  memory::desc b(memory::dims{k, n}, Dt::f32, g.trans_b ? memory::dims{1, k} : memory::dims{n, 1});
  memory::desc y = plain(g.y);
  dnnl::primitive_attr attr;
  if (g.alpha != 1.0) attr.set_output_scales(0, {static_cast<float>(g.alpha)});
  if (g.c) {
    std::memcpy(out, in + g.c->offset, g.c->bytes);
    dnnl::post_ops po;
    po.append_sum(static_cast<float>(g.beta));
    attr.set_post_ops(po);
  }
  dnnl::matmul::desc d(a, b, y);
  dnnl::matmul::primitive_desc pd(d, attr, runtime()->engine);
  execute(dnnl::matmul(pd), {{DNNL_ARG_SRC, wrap(a, in, g.a.offset)},
                             {DNNL_ARG_WEIGHTS, wrap(b, in, g.b.offset)},
                             {DNNL_ARG_DST, wrap_out(y, out)}});
}

}  // namespace

bool cpu_tensor_ops_available() noexcept {
  return true;
}

Result<void> cpu_tensor_ops_start() {
  if (runtime()) return {};
  set_single_thread();
  try {
    dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    runtime().emplace(Runtime{std::move(engine), std::move(stream)});
  } catch (const dnnl::error& e) {
    return Error(ErrorCode::kOpFailed,
                 std::string("oneDNN: cannot create the CPU engine: ") + e.what());
  }
  return {};
}

Result<OpOutput> run_cpu_tensor_op(const tensor::TensorOp& op, const std::byte* input,
                                   std::byte* output, const std::atomic<uint32_t>& cancel) {
  const char* name = op_name(op);
  if (tensor::result_dtype(op) != tensor::DType::kF32) {
    return Error(ErrorCode::kInvalidArgument,
                 std::string(name) + ": dtype: " + tensor::dtype_name(tensor::result_dtype(op)) +
                     " is not supported on cpu pools (f32 only); submit it to a gpu pool");
  }
  if (auto started = cpu_tensor_ops_start(); !started) return started.error();
  if (cancel.load(std::memory_order_relaxed) != 0) {
    return Error(ErrorCode::kCancelled, std::string(name) + ": cancelled before it started");
  }
  try {
    std::visit(
        [&](const auto& o) {
          using T = std::decay_t<decltype(o)>;
          if constexpr (std::is_same_v<T, tensor::Conv2d>) run_conv2d(o, input, output);
          if constexpr (std::is_same_v<T, tensor::ActivationOp>) run_activation(o, input, output);
          if constexpr (std::is_same_v<T, tensor::Softmax>) run_softmax(o, input, output);
          if constexpr (std::is_same_v<T, tensor::Pool2d>) run_pool2d(o, input, output);
          if constexpr (std::is_same_v<T, tensor::BatchNorm>) run_batchnorm(o, input, output);
          if constexpr (std::is_same_v<T, tensor::Gemm>) run_gemm(o, input, output);
        },
        op);
  } catch (const dnnl::error& e) {
    return Error(ErrorCode::kOpFailed, std::string(name) + ": oneDNN: " + e.what() + " (" +
                                           dnnl_status2str(e.status) + ")");
  }
  return OpOutput{tensor::result_bytes(op), 0};
}

}  // namespace gpuq::daemon
