// gpuq._native: the Python package's binding of libgpuq (gpuq/client.hpp), with nanobind.
//
// Deliberately thin: the Python layer (gpuq/_client.py) owns the public API, argument checks and
// futures; this file turns its calls into the C++ client's and back. What lives here:
//   Connection  one gpuq::Client (shared: Blocks and Jobs keep its mapping alive)
//   Block       one allocation in the client's payload segment; numpy arrays made by
//               Connection.allocate() keep it alive (as their base), and it returns the bytes
//               to the segment when the last of them is gone
//   Connection.submit_call  a Python op's job: its arguments laid out by call_codec.hpp
//   Job         one gpuq::Job; wait() releases the GIL (in slices, checking for signals between
//               them) and may run in several threads at once; poll() is lock-free, as in C++
// Every gpuq::Error becomes the Python exception the package registered for its code
// (set_error_factory), with the daemon's message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "call_codec.hpp"
#include "gpuq/client.hpp"
#include "gpuq/common/runtime_dir.hpp"
#include "job_options.hpp"
#include "ops.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using gpuq::python::JobOptions;

namespace {

// The package's factory: (code: int, message: str) -> an exception instance. A leaked
// reference: it must outlive every call, including those made while the interpreter exits.
PyObject* g_error_factory = nullptr;

[[noreturn]] void raise_error(const gpuq::Error& e) {
  if (g_error_factory != nullptr) {
    nb::object exc = nb::borrow(g_error_factory)(static_cast<int>(e.code()), e.message());
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    throw nb::python_error();
  }
  throw std::runtime_error(e.to_string());
}

template <typename T>
T take(gpuq::Result<T>&& r) {
  if (!r) raise_error(r.error());
  return std::move(*r);
}

void check(const gpuq::Result<void>& r) {
  if (!r) raise_error(r.error());
}

std::chrono::nanoseconds ns(int64_t v) {
  return std::chrono::nanoseconds(v);
}

struct Block {
  std::shared_ptr<gpuq::Client> client;
  gpuq::Buffer buffer;

  Block(std::shared_ptr<gpuq::Client> c, gpuq::Buffer b) : client(std::move(c)), buffer(b) {}
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block() { client->release(buffer); }  // ignored by the library in a forked child
};

// (status, code, message, output_size, value, worker_id, queued_ns, run_ns)
using ResultTuple =
    std::tuple<int, int, std::string, uint64_t, uint64_t, uint32_t, uint64_t, uint64_t>;

ResultTuple to_tuple(const gpuq::JobResult& r) {
  return {static_cast<int>(r.status),
          static_cast<int>(r.code),
          r.message,
          r.output_size,
          r.value,
          r.worker_id,
          r.queued_ns,
          r.run_ns};
}

class Job {
 public:
  explicit Job(gpuq::Job job) : job_(std::move(job)) {}

  // The result, or None when `timeout_ns` passed first (negative: no limit). Waits with the
  // GIL released, in slices (in_slices). Several threads may wait on one Job at once (as
  // poll() and cancel() may): the library's wait only reads the slot, and its event count
  // wakes every waiter.
  std::optional<ResultTuple> wait(int64_t timeout_ns) {
    auto r =
        in_slices<gpuq::JobResult>(timeout_ns, [&](int64_t slice) { return job_.wait(ns(slice)); });
    if (!r) return std::nullopt;
    return to_tuple(*r);
  }

  // A stream's next part (gpuq::Job::next_part), waiting as wait() does: (index, address,
  // size) of a part (its bytes in the job's output buffer, valid until the next call);
  // (-1, 0, 0) once the stream has ended well; None when `timeout_ns` passed first. The job's
  // error, after its last part, is raised.
  std::optional<std::tuple<int64_t, uintptr_t, uint64_t>> next_part(int64_t timeout_ns) {
    auto r = in_slices<std::optional<gpuq::JobPart>>(
        timeout_ns, [&](int64_t slice) { return job_.next_part(ns(slice)); });
    if (!r) return std::nullopt;
    if (!r->has_value()) return std::tuple<int64_t, uintptr_t, uint64_t>{-1, 0, 0};
    return std::tuple<int64_t, uintptr_t, uint64_t>{
        (*r)->index, reinterpret_cast<uintptr_t>((*r)->data), (*r)->size};
  }

  int poll() const { return static_cast<int>(take(job_.poll())); }

  void cancel() { check(job_.cancel()); }

  bool cancel_queued() { return take(job_.cancel_queued()); }

  void wake_waiters() const noexcept { job_.wake_waiters(); }

  // gpuq::Job::wait_any over `jobs` (Job objects of one connection), with the GIL released:
  // the positions of those that have ended, empty after `timeout_ns` (negative: no limit) or a
  // wake_waiters(). `interruptible`: wait in slices of 100 ms between which the signal handlers
  // run (for the main thread; a watcher thread sleeps in one piece).
  static std::vector<size_t> wait_any(const nb::list& jobs, int64_t timeout_ns,
                                      bool interruptible) {
    std::vector<const gpuq::Job*> list;
    list.reserve(jobs.size());
    for (nb::handle j : jobs) list.push_back(&nb::cast<const Job&>(j).job_);
    constexpr int64_t kSliceNs = 100'000'000;
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      int64_t slice = timeout_ns;
      if (interruptible) {
        const int64_t spent = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - start)
                                  .count();
        slice = timeout_ns < 0 ? kSliceNs
                               : std::min(kSliceNs, std::max<int64_t>(timeout_ns - spent, 0));
      }
      gpuq::Result<std::vector<size_t>> r = gpuq::Error(gpuq::ErrorCode::kInternal, "not waited");
      const auto slice_start = std::chrono::steady_clock::now();
      {
        nb::gil_scoped_release unlocked;
        r = gpuq::Job::wait_any(list, ns(slice));
      }
      if (!r) raise_error(r.error());
      // Done, out of time, or woken by wake_waiters() before the slice's end.
      if (!interruptible || !r->empty() || slice == timeout_ns ||
          std::chrono::steady_clock::now() - slice_start < ns(slice)) {
        return std::move(*r);
      }
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (timeout_ns >= 0 && std::chrono::steady_clock::now() - start >= ns(timeout_ns)) {
        return {};
      }
    }
  }

 private:
  // Calls `step(slice_ns)` (a wait of the library's that returns Timeout when its slice passed)
  // with the GIL released, in slices of at most 100 ms between which it takes the GIL and runs
  // the signal handlers, so that Ctrl-C interrupts a long wait: its value, or None once
  // `timeout_ns` (negative: no limit) has passed. Its other errors are raised.
  template <typename T, typename Step>
  static std::optional<T> in_slices(int64_t timeout_ns, Step&& step) {
    constexpr int64_t kSliceNs = 100'000'000;
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      int64_t slice = kSliceNs;
      if (timeout_ns >= 0) {
        const int64_t spent = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - start)
                                  .count();
        slice = std::min(slice, std::max<int64_t>(timeout_ns - spent, 0));
      }
      std::optional<gpuq::Result<T>> r;
      {
        nb::gil_scoped_release unlocked;
        r.emplace(step(slice));
      }
      if (*r) return std::optional<T>(std::in_place, std::move(**r));
      if ((*r).error().code() != gpuq::ErrorCode::kTimeout) raise_error((*r).error());
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (timeout_ns >= 0 && std::chrono::steady_clock::now() - start >= ns(timeout_ns)) {
        return std::nullopt;
      }
    }
  }

  gpuq::Job job_;
};

std::vector<gpuq::JobParam> to_params(const nb::list& params) {
  std::vector<gpuq::JobParam> out;
  out.reserve(params.size());
  for (nb::handle item : params) {
    auto kv = nb::cast<std::tuple<std::string, nb::object>>(item);
    std::string key = std::move(std::get<0>(kv));
    nb::handle v = std::get<1>(kv);
    if (nb::isinstance<nb::bool_>(v) || nb::isinstance<nb::int_>(v)) {
      out.push_back(gpuq::JobParam::integer(std::move(key), nb::cast<int64_t>(v)));
    } else if (nb::isinstance<nb::float_>(v)) {
      out.push_back(gpuq::JobParam::real(std::move(key), nb::cast<double>(v)));
    } else if (nb::isinstance<nb::str>(v)) {
      out.push_back(gpuq::JobParam::text(std::move(key), nb::cast<std::string>(v)));
    } else {
      raise_error(gpuq::Error(gpuq::ErrorCode::kInvalidArgument,
                              "param " + key + ": must be an int, float or str, not " +
                                  nb::cast<std::string>(nb::str(v.type().attr("__name__")))));
    }
  }
  return out;
}

// ---- tensor ops ---------------------------------------------------------------------------------

gpuq::DType to_dtype(const std::string& name) {
  if (name == "f32") return gpuq::DType::kF32;
  if (name == "f16") return gpuq::DType::kF16;
  raise_error(
      gpuq::Error(gpuq::ErrorCode::kInvalidArgument, "dtype: '" + name + "' is not f32 or f16"));
}

std::array<int64_t, 2> pair(const nb::dict& opts, const char* key, std::array<int64_t, 2> dflt) {
  if (!opts.contains(key)) return dflt;
  nb::object v = opts[key];
  if (nb::isinstance<nb::int_>(v)) {
    const auto x = nb::cast<int64_t>(v);
    return {x, x};
  }
  auto t = nb::cast<std::tuple<int64_t, int64_t>>(v);
  return {std::get<0>(t), std::get<1>(t)};
}

template <typename T>
T opt(const nb::dict& opts, const char* key, T dflt) {
  return opts.contains(key) ? nb::cast<T>(opts[key]) : dflt;
}

gpuq::Conv2dOptions conv2d_options(const nb::dict& o) {
  gpuq::Conv2dOptions c;
  c.stride = pair(o, "stride", c.stride);
  c.pad = pair(o, "padding", c.pad);
  c.dilation = pair(o, "dilation", c.dilation);
  c.groups = opt<int64_t>(o, "groups", c.groups);
  c.relu = opt<bool>(o, "relu", c.relu);
  return c;
}

gpuq::Pool2dOptions pool2d_options(const nb::dict& o) {
  gpuq::Pool2dOptions p;
  const std::string mode = opt<std::string>(o, "mode", "max");
  if (mode == "max") {
    p.mode = gpuq::PoolMode::kMax;
  } else if (mode == "avg") {
    p.mode = gpuq::PoolMode::kAvg;
  } else {
    raise_error(gpuq::Error(gpuq::ErrorCode::kInvalidArgument,
                            "pool2d: mode: '" + mode + "' is not max or avg"));
  }
  p.window = pair(o, "window", p.window);
  if (o.contains("stride") && !o["stride"].is_none()) p.stride = pair(o, "stride", p.window);
  p.pad = pair(o, "padding", p.pad);
  p.count_pad = opt<bool>(o, "count_pad", p.count_pad);
  return p;
}

gpuq::GemmOptions gemm_options(const nb::dict& o) {
  gpuq::GemmOptions g;
  g.trans_a = opt<bool>(o, "trans_a", g.trans_a);
  g.trans_b = opt<bool>(o, "trans_b", g.trans_b);
  g.alpha = opt<double>(o, "alpha", g.alpha);
  g.beta = opt<double>(o, "beta", g.beta);
  return g;
}

gpuq::ActivationMode activation_mode(const nb::dict& o) {
  const std::string mode = opt<std::string>(o, "mode", "relu");
  if (mode == "relu") return gpuq::ActivationMode::kRelu;
  if (mode == "sigmoid") return gpuq::ActivationMode::kSigmoid;
  if (mode == "tanh") return gpuq::ActivationMode::kTanh;
  raise_error(gpuq::Error(gpuq::ErrorCode::kInvalidArgument,
                          "activation: mode: '" + mode + "' is not relu, sigmoid or tanh"));
}

using Operand = std::optional<std::tuple<uint64_t, gpuq::Shape>>;  // (offset, shape) or None

class Connection {
 public:
  static std::unique_ptr<Connection> connect(const std::string& runtime_dir, uint64_t segment_bytes,
                                             const std::string& name, int64_t spin_ns,
                                             bool keep_running_jobs) {
    gpuq::ConnectOptions o;
    o.runtime_dir = runtime_dir;
    o.segment_bytes = segment_bytes;
    o.name = name;
    o.spin = ns(spin_ns);
    o.keep_running_jobs = keep_running_jobs;
    gpuq::Result<gpuq::Client> c = gpuq::Error(gpuq::ErrorCode::kInternal, "not connected");
    {
      nb::gil_scoped_release unlocked;
      c = gpuq::Client::connect(o);
    }
    return std::make_unique<Connection>(std::make_shared<gpuq::Client>(take(std::move(c))));
  }

  explicit Connection(std::shared_ptr<gpuq::Client> c) : client_(std::move(c)) {}

  // A reference of the caller's own for a call that releases the GIL: close() in another
  // thread meanwhile must not destroy the Client under it.
  std::shared_ptr<gpuq::Client> shared() const {
    client();  // raises when closed
    return client_;
  }

  gpuq::Client& client() const {
    if (!client_) {
      raise_error(gpuq::Error(gpuq::ErrorCode::kDisconnected, "this client is closed"));
    }
    return *client_;
  }

  // A 1-D uint8 array over `size` new bytes of the segment; its base owns them.
  nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> allocate(uint64_t size) {
    gpuq::Buffer b = take(client().allocate(size));
    auto* block = new Block(client_, b);
    nb::object owner = nb::cast(block, nb::rv_policy::take_ownership);
    const size_t shape[1] = {static_cast<size_t>(size)};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(b.ptr, 1, shape, owner);
  }

  Job* submit(const std::string& op, uint64_t in_off, uint64_t in_len, uint64_t out_off,
              uint64_t out_len, const nb::list& params, const JobOptions& options) {
    const std::shared_ptr<gpuq::Client> held = shared();
    gpuq::Client& c = *held;
    gpuq::JobSpec spec;
    spec.op = op;
    std::byte* arena = c.arena();
    if (in_len != 0) spec.input = gpuq::Buffer{in_off, in_len, arena + in_off};
    if (out_len != 0) spec.output = gpuq::Buffer{out_off, out_len, arena + out_off};
    spec.params = to_params(params);
    options.apply(spec);
    return run(c, spec, options);
  }

  // submit() of a job without buffers or params: the short path of Client.submit.
  Job* submit_plain(const std::string& op, const JobOptions& options) {
    const std::shared_ptr<gpuq::Client> held = shared();
    gpuq::Client& c = *held;
    gpuq::JobSpec spec;
    spec.op = op;
    options.apply(spec);
    return run(c, spec, options);
  }

  // A Python op's job (gpuq._calls): `args` (a tuple) and `kwargs` (a dict or None) laid out
  // by the codec (call_codec.hpp) in one block of the segment, `output_bytes` of room for the
  // answer after them, and submitted. `block`: a uint8 array from allocate() that the caller
  // made room for (gpuq._room, after this found none), else None and one is allocated here.
  // `callable_job`: gpuq.Executor's, whose arrays are all copied (its function may change them
  // in place); else a named op's, which also gets py.r (its rows, for batching). Returns (job,
  // the answer's room as a uint8 array, which owns the block, and the arrays passed in place or
  // None). Errors: InvalidArgument for an argument that cannot travel, OutOfMemory, and
  // submit()'s.
  nb::tuple submit_call(const std::string& op, nb::handle args, nb::handle kwargs,
                        uint64_t output_bytes, uint32_t flags, bool callable_job,
                        const JobOptions& options, nb::handle block) {
    namespace codec = gpuq::python::codec;
    const std::shared_ptr<gpuq::Client> held = shared();
    gpuq::Client& c = *held;
    std::byte* arena = c.arena();
    std::optional<codec::CallPlan> plan;
    try {
      plan.emplace(args, kwargs, flags, callable_job, arena, c.arena_bytes());
    } catch (const std::invalid_argument& e) {
      raise_error(gpuq::Error(gpuq::ErrorCode::kInvalidArgument, e.what()));
    }
    const uint64_t need = plan->block_bytes(output_bytes);
    nb::object owner;
    uint64_t block_off = 0;
    if (block.is_none()) {
      const gpuq::Buffer b = take(c.allocate(need));
      owner = nb::cast(new Block(held, b), nb::rv_policy::take_ownership);
      block_off = b.offset;
    } else {
      Py_buffer v;
      if (PyObject_GetBuffer(block.ptr(), &v, PyBUF_SIMPLE) != 0) throw nb::python_error();
      const auto p = reinterpret_cast<uintptr_t>(v.buf);
      const auto base = reinterpret_cast<uintptr_t>(arena);
      const auto len = static_cast<uint64_t>(v.len);
      PyBuffer_Release(&v);
      if (p < base || p - base > c.arena_bytes() || len > c.arena_bytes() - (p - base) ||
          len < need) {
        raise_error(gpuq::Error(gpuq::ErrorCode::kInternal, "submit_call: the block given is not " +
                                                                std::to_string(need) +
                                                                " bytes of this client's segment"));
      }
      owner = nb::borrow(block);
      block_off = p - base;
    }
    const codec::CallPlan::Layout at = plan->write(arena, block_off);
    gpuq::JobSpec spec;
    spec.op = op;
    spec.input = gpuq::Buffer{at.span_offset, at.span_length, arena + at.span_offset};
    spec.output = gpuq::Buffer{at.output_offset, output_bytes, arena + at.output_offset};
    spec.params.reserve(3);
    spec.params.push_back(gpuq::JobParam::integer(gpuq::daemon::kPythonHeaderParam,
                                                  static_cast<int64_t>(at.header_offset)));
    spec.params.push_back(gpuq::JobParam::integer(gpuq::daemon::kPythonHeaderBytesParam,
                                                  static_cast<int64_t>(at.header_length)));
    if (!callable_job) {
      spec.params.push_back(
          gpuq::JobParam::integer(gpuq::daemon::kPythonRowsParam, static_cast<int64_t>(at.rows)));
    }
    options.apply(spec);
    nb::object job = nb::cast(run(c, spec, options), nb::rv_policy::take_ownership);
    const size_t shape[1] = {static_cast<size_t>(output_bytes)};
    nb::object out = nb::cast(
        nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(arena + at.output_offset, 1, shape, owner));
    nb::list kept = plan->in_place();
    return nb::make_tuple(job, out, kept.size() != 0 ? nb::object(kept) : nb::none());
  }

  // The block submit_call needs for this call (gpuq._room makes room for it).
  uint64_t call_block_bytes(nb::handle args, nb::handle kwargs, uint64_t output_bytes,
                            uint32_t flags, bool callable_job) const {
    gpuq::Client& c = client();
    try {
      return gpuq::python::codec::CallPlan(args, kwargs, flags, callable_job, c.arena(),
                                           c.arena_bytes())
          .block_bytes(output_bytes);
    } catch (const std::invalid_argument& e) {
      raise_error(gpuq::Error(gpuq::ErrorCode::kInvalidArgument, e.what()));
    }
  }

  Job* tensor(const std::string& op, const std::vector<Operand>& operands,
              const std::tuple<uint64_t, gpuq::Shape>& y, const std::string& dtype_name,
              const nb::dict& opts, const JobOptions& options) {
    const std::shared_ptr<gpuq::Client> held = shared();
    gpuq::Client& c = *held;
    const gpuq::DType dtype = to_dtype(dtype_name);
    auto tensor_of = [&](const Operand& o) -> std::optional<gpuq::Tensor> {
      if (!o) return std::nullopt;
      const auto& [off, shape] = *o;
      const uint64_t bytes = gpuq::shape_bytes(shape, dtype);
      return take(gpuq::Tensor::make(gpuq::Buffer{off, bytes, c.arena() + off}, shape, dtype));
    };
    std::vector<std::optional<gpuq::Tensor>> t;
    t.reserve(operands.size());
    for (const Operand& o : operands) t.push_back(tensor_of(o));
    const gpuq::Tensor out = *tensor_of(y);
    auto need = [&](size_t i) -> const gpuq::Tensor& {
      if (i >= t.size() || !t[i]) {
        raise_error(gpuq::Error(gpuq::ErrorCode::kInvalidArgument,
                                op + ": operand " + std::to_string(i) + " is missing"));
      }
      return *t[i];
    };
    auto maybe = [&](size_t i) { return i < t.size() ? t[i] : std::nullopt; };
    gpuq::Result<gpuq::JobSpec> spec = gpuq::Error(gpuq::ErrorCode::kUnknownOp, op);
    if (op == "conv2d") {
      spec = gpuq::conv2d_job(need(0), need(1), maybe(2), out, conv2d_options(opts));
    } else if (op == "activation") {
      spec = gpuq::activation_job(need(0), out, activation_mode(opts));
    } else if (op == "softmax") {
      gpuq::SoftmaxOptions s;
      s.log = opt<bool>(opts, "log", false);
      spec = gpuq::softmax_job(need(0), out, s);
    } else if (op == "pool2d") {
      spec = gpuq::pool2d_job(need(0), out, pool2d_options(opts));
    } else if (op == "batchnorm") {
      gpuq::BatchNormOptions b;
      b.eps = opt<double>(opts, "eps", b.eps);
      b.relu = opt<bool>(opts, "relu", b.relu);
      spec = gpuq::batchnorm_job(need(0), need(1), need(2), need(3), need(4), out, b);
    } else if (op == "gemm") {
      spec = gpuq::gemm_job(need(0), need(1), maybe(2), out, gemm_options(opts));
    }
    gpuq::JobSpec s = take(std::move(spec));
    options.apply(s);
    return run(c, s, options);
  }

  std::vector<
      std::tuple<std::string, std::string, uint32_t, uint32_t, bool, std::string, std::string>>
  pools() const {
    std::vector<
        std::tuple<std::string, std::string, uint32_t, uint32_t, bool, std::string, std::string>>
        out;
    for (const gpuq::PoolInfo& p : client().pools()) {
      out.emplace_back(p.name, p.kind, p.capacity, p.client_share, p.available,
                       p.unavailable_reason, p.runs_on);
    }
    return out;
  }

  std::vector<std::string> ops() const { return client().ops(); }
  uint64_t segment_bytes() const { return client().segment_bytes(); }
  uint32_t slot_count() const { return client().slot_count(); }
  uint64_t epoch() const { return client().daemon_epoch(); }
  uintptr_t arena_address() const { return reinterpret_cast<uintptr_t>(client().arena()); }
  uint64_t arena_bytes() const { return client().arena_bytes(); }
  bool closed() const { return !client_; }
  // Drops this handle's reference: the connection ends once the arrays and jobs that still
  // use it are gone too (their memory stays valid until then).
  void close() { client_.reset(); }

 private:
  static Job* run(gpuq::Client& c, const gpuq::JobSpec& spec, const JobOptions& options) {
    // try_submit never blocks: with room in the ring (the common case) the GIL stays held.
    gpuq::Result<gpuq::Job> job = c.try_submit(spec);
    if (!job && job.error().code() == gpuq::ErrorCode::kQueueFull && !options.try_only) {
      nb::gil_scoped_release unlocked;
      job = c.submit(spec, ns(options.timeout_ns));
    }
    return new Job(take(std::move(job)));
  }

  std::shared_ptr<gpuq::Client> client_;
};

std::vector<int64_t> shape_or_raise(gpuq::Result<gpuq::Shape>&& s) {
  return take(std::move(s));
}

}  // namespace

namespace gpuq::python {
void bind_worker(nb::module_& m);  // worker.cpp
void bind_codec(nb::module_& m);   // call_codec_binding.cpp
void bind_facts(nb::module_& m);   // facts.cpp
}  // namespace gpuq::python

NB_MODULE(_native, m) {
  // Objects alive when the interpreter exits (a module-level client, its arrays) are normal.
  nb::set_leak_warnings(false);
  m.doc() = "gpuq's native binding of libgpuq; use the gpuq package, not this module.";
  gpuq::python::bind_worker(m);
  gpuq::python::bind_codec(m);
  gpuq::python::bind_facts(m);

  m.def(
      "set_error_factory",
      [](nb::object f) {
        Py_XDECREF(g_error_factory);
        g_error_factory = f.release().ptr();
      },
      "factory"_a, "Registers (code, message) -> exception used for every gpuq error.");

  nb::class_<JobOptions>(m, "JobOptions",
                         "A job's options, checked (gpuq._options.job_options makes them).")
      .def(nb::init<std::string, int64_t, int64_t, bool, uint32_t, bool, uint32_t>(), "pool"_a = "",
           "timeout_ns"_a = -1, "expire_ns"_a = -1, "retryable"_a = false, "time_limit_ms"_a = 0,
           "try_only"_a = false, "priority"_a = 0)
      // Writable for gpuq._options.replace, which changes a copy; the package never changes
      // an options value it did not just copy.
      .def_rw("pool", &JobOptions::pool)
      .def_rw("timeout_ns", &JobOptions::timeout_ns)
      .def_rw("expire_ns", &JobOptions::expire_ns)
      .def_rw("retryable", &JobOptions::retryable)
      .def_rw("time_limit_ms", &JobOptions::time_limit_ms)
      .def_rw("try_only", &JobOptions::try_only)
      .def_rw("priority", &JobOptions::priority)
      .def_rw("stream_window", &JobOptions::stream_window)
      .def("__copy__", [](const JobOptions& o) { return o; })
      .def("__repr__", [](const JobOptions& o) {
        return "JobOptions(pool='" + o.pool + "', timeout_ns=" + std::to_string(o.timeout_ns) +
               ", expire_ns=" + std::to_string(o.expire_ns) +
               ", retryable=" + (o.retryable ? "True" : "False") +
               ", time_limit_ms=" + std::to_string(o.time_limit_ms) +
               ", try_only=" + (o.try_only ? "True" : "False") +
               ", priority=" + std::to_string(o.priority) +
               ", stream_window=" + std::to_string(o.stream_window) + ")";
      });

  nb::class_<Block>(m, "Block", "An allocation in a client's payload segment (array base).");

  nb::class_<Job>(m, "Job", "A submitted job (gpuq::Job).")
      .def("wait", &Job::wait, "timeout_ns"_a,
           "Waits for the result (GIL released); None if timeout_ns passed first.")
      .def("poll", &Job::poll, "The job's status as an int (gpuq::JobStatus), lock-free.")
      .def("next_part", &Job::next_part, "timeout_ns"_a,
           "A stream's next part: (index, address, size), (-1, 0, 0) at its end, None after "
           "timeout_ns (negative: no limit); its error raised after its last part.")
      .def("cancel", &Job::cancel, "Cancels the job (gpuq::Job::cancel).")
      .def("cancel_queued", &Job::cancel_queued,
           "Cancels the job if it is still queued: whether it did (gpuq::Job::cancel_queued).")
      .def("wake_waiters", &Job::wake_waiters,
           "Wakes every wait_any() on this job's connection (gpuq::Job::wake_waiters).")
      .def_static("wait_any", &Job::wait_any, "jobs"_a, "timeout_ns"_a, "interruptible"_a,
                  "Positions of the jobs that have ended (gpuq::Job::wait_any, GIL released).");

  nb::class_<Connection>(m, "Connection", "One connection to the daemon (gpuq::Client).")
      .def_static("connect", &Connection::connect, "runtime_dir"_a, "segment_bytes"_a, "name"_a,
                  "spin_ns"_a, "keep_running_jobs"_a, "Connects (GIL released).")
      .def("allocate", &Connection::allocate, "size"_a,
           "A uint8 array over new bytes of the segment.")
      .def("submit", &Connection::submit, "op"_a, "in_off"_a, "in_len"_a, "out_off"_a, "out_len"_a,
           "params"_a, "options"_a, nb::rv_policy::take_ownership,
           "Submits a job (the GIL is released while it waits for room).")
      .def("submit_plain", &Connection::submit_plain, "op"_a, "options"_a,
           nb::rv_policy::take_ownership, "submit() without buffers or params.")
      .def("submit_call", &Connection::submit_call, "op"_a, "args"_a, "kwargs"_a.none(),
           "output_bytes"_a, "flags"_a, "callable_job"_a, "options"_a, "block"_a.none(),
           "Submits a Python op's job, its arguments laid out by the codec: (job, answer room, "
           "arrays passed in place or None).")
      .def("call_block_bytes", &Connection::call_block_bytes, "args"_a, "kwargs"_a.none(),
           "output_bytes"_a, "flags"_a, "callable_job"_a, "The block submit_call needs.")
      .def("tensor", &Connection::tensor, "op"_a, "operands"_a, "y"_a, "dtype"_a, "opts"_a,
           "options"_a, nb::rv_policy::take_ownership,
           "Submits a tensor op (the GIL is released while it waits for room).")
      .def("pools", &Connection::pools,
           "(name, kind, capacity, client_share, available, reason, runs_on) per pool.")
      .def("ops", &Connection::ops, "The op names the daemon serves.")
      .def_prop_ro("segment_bytes", &Connection::segment_bytes)
      .def_prop_ro("slot_count", &Connection::slot_count)
      .def_prop_ro("epoch", &Connection::epoch)
      .def_prop_ro("arena_address", &Connection::arena_address)
      .def_prop_ro("arena_bytes", &Connection::arena_bytes)
      .def_prop_ro("closed", &Connection::closed)
      .def("close", &Connection::close, "Drops this handle's reference to the connection.");

  m.def(
      "status_json",
      [](const std::string& runtime_dir) {
        gpuq::Result<std::string> r = gpuq::Error(gpuq::ErrorCode::kInternal, "");
        {
          nb::gil_scoped_release unlocked;
          r = gpuq::daemon_status_json(runtime_dir);
        }
        return take(std::move(r));
      },
      "runtime_dir"_a, "The daemon's status document (JSON text).");
  m.def(
      "metrics_text",
      [](const std::string& runtime_dir) {
        gpuq::Result<std::string> r = gpuq::Error(gpuq::ErrorCode::kInternal, "");
        {
          nb::gil_scoped_release unlocked;
          r = gpuq::daemon_metrics_text(runtime_dir);
        }
        return take(std::move(r));
      },
      "runtime_dir"_a, "The daemon's metrics in the Prometheus text format.");
  m.def(
      "stop",
      [](const std::string& runtime_dir) {
        gpuq::Result<void> r;
        {
          nb::gil_scoped_release unlocked;
          r = gpuq::daemon_stop(runtime_dir);
        }
        check(r);
      },
      "runtime_dir"_a, "Asks the daemon to drain and exit.");
  m.def(
      "restart_pool",
      [](const std::string& runtime_dir, const std::string& pool, uint32_t timeout_s) {
        gpuq::Result<uint32_t> r = gpuq::Error(gpuq::ErrorCode::kInternal, "");
        {
          nb::gil_scoped_release unlocked;  // a rollout takes seconds
          r = gpuq::daemon_restart_pool(pool, runtime_dir, timeout_s);
        }
        return take(std::move(r));
      },
      "runtime_dir"_a, "pool"_a, "timeout_s"_a,
      "A rolling restart of the pool; its new generation once every worker runs it.");
  m.def(
      "reload",
      [](const std::string& runtime_dir, uint32_t timeout_s) {
        gpuq::Result<std::vector<std::string>> r = gpuq::Error(gpuq::ErrorCode::kInternal, "");
        {
          nb::gil_scoped_release unlocked;  // its rollouts take seconds
          r = gpuq::daemon_reload(runtime_dir, timeout_s);
        }
        return take(std::move(r));
      },
      "runtime_dir"_a, "timeout_s"_a,
      "Reads the daemon's config file again and applies it; one line per change.");
  m.def(
      "cpp_noop_round_trips",
      [](Connection& c, uint32_t n) {
        // The C++ client's own loop, for bench/python: n no-op round trips (submit, then wait
        // for the result) on this connection, each timed alone; nanoseconds, in order.
        std::vector<uint64_t> ns_each(n);
        const std::shared_ptr<gpuq::Client> held = c.shared();
        gpuq::Client& client = *held;
        gpuq::JobSpec spec;
        spec.op = "noop";
        nb::gil_scoped_release unlocked;
        for (uint32_t i = 0; i < n; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          auto job = client.submit(spec);
          if (!job) break;
          if (!job->wait()) break;
          const auto t1 = std::chrono::steady_clock::now();
          ns_each[i] = static_cast<uint64_t>(
              std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
        }
        return ns_each;
      },
      "connection"_a, "n"_a, "Benchmark helper: n timed C++ no-op round trips.");
  m.def("default_runtime_dir", &gpuq::default_runtime_dir);
  // Where a daemon started with `--runtime-dir explicit_dir` listens (the whole rule when it is
  // empty): gpuq serve's (docs/service.md, "Finding the daemon").
  m.def("daemon_runtime_dir", &gpuq::resolve_daemon_runtime_dir, "explicit_dir"_a = "");
  m.def("version", [] { return std::string(gpuq::version()); });
  m.def(
      "conv2d_shape",
      [](const gpuq::Shape& x, const gpuq::Shape& w, const nb::dict& opts) {
        return shape_or_raise(gpuq::conv2d_result_shape(x, w, conv2d_options(opts)));
      },
      "x"_a, "w"_a, "opts"_a);
  m.def(
      "pool2d_shape",
      [](const gpuq::Shape& x, const nb::dict& opts) {
        return shape_or_raise(gpuq::pool2d_result_shape(x, pool2d_options(opts)));
      },
      "x"_a, "opts"_a);
  m.def(
      "gemm_shape",
      [](const gpuq::Shape& a, const gpuq::Shape& b, const nb::dict& opts) {
        return shape_or_raise(gpuq::gemm_result_shape(a, b, gemm_options(opts)));
      },
      "a"_a, "b"_a, "opts"_a);
}
