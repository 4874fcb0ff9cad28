// gpuq._native's worker half: a Python worker (gpuq._worker's main(), started by gpuqd for a
// Python pool) runs gpuq's own worker runtime (daemon/worker: the job loop, descriptor
// validation, cancellation, the ring, the fault handling) with an OpBackend that calls back
// into Python for the pool's ops. The loop runs with the GIL released; each Python op takes it
// for the call. The built-in CPU ops (noop, echo, sleep, checksum) run as in gpuq-worker.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <variant>
#include <vector>

#include "gpuq/common/shm_layout.hpp"
#include "op_backend.hpp"
#include "ops.hpp"
#include "worker_loop.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace gpuq::python {
namespace {

using daemon::OpBackend;
using daemon::OpContext;
using daemon::OpInfo;
using daemon::OpOutput;

// The running job's cancel flag, for gpuq.cancelled() (one call at a time per worker); for a
// batched call, its jobs' flags instead.
std::atomic<const std::atomic<uint32_t>*> g_cancel_flag{nullptr};
std::atomic<const std::vector<const std::atomic<uint32_t>*>*> g_batch_flags{nullptr};
// The running job's parts when it streams (docs/design/streams.md), for gpuq._worker's
// generator ops: null for a job that answers once.
std::atomic<daemon::PartSink*> g_parts{nullptr};

// Whether a batched call should stop: a time limit of one of its jobs passed (the supervisor
// raises it on the job it watches), or every job of it was cancelled by its client. A client's
// cancel alone does not stop a call that serves others.
bool batch_cancelled(const std::vector<const std::atomic<uint32_t>*>& flags) {
  bool all_cancelled = !flags.empty();
  for (const auto* f : flags) {
    const uint32_t why = f->load(std::memory_order_relaxed);
    if ((why & kCancelByTimeLimit) != 0) return true;
    if ((why & kCancelByClient) == 0) all_cancelled = false;
  }
  return all_cancelled;
}

// A Python memoryview of `bytes` bytes at `p` (no copy).
nb::object view_of(const std::byte* p, uint64_t bytes, bool writable) {
  return nb::steal(PyMemoryView_FromMemory(reinterpret_cast<char*>(const_cast<std::byte*>(p)),
                                           static_cast<Py_ssize_t>(bytes),
                                           writable ? PyBUF_WRITE : PyBUF_READ));
}

// Lets go of a view the op was given. That guards nothing: numpy arrays made over it keep the
// bare pointer, and an op that keeps one past its call may read the next job's bytes, or crash
// this worker once the client's segment is unmapped (docs/python.md).
void release_view(const nb::object& v) {
  (void)PyObject_CallMethod(v.ptr(), "release", nullptr);
  if (PyErr_Occurred() != nullptr) PyErr_Clear();
}

// A failed job's error from what the Runtime said of it (its code, message and record's size).
Error job_error(const OpContext& ctx, int code, const std::string& message, uint64_t bytes) {
  ctx.failure_output_bytes = std::min(bytes, ctx.output_capacity);
  const ErrorCode ec =
      code > 0 && code <= kMaxErrorCode ? static_cast<ErrorCode>(code) : ErrorCode::kOpFailed;
  return Error(ec, message);
}

// A job's result from what Runtime.run or run_batch said of it: (code, message, bytes, value).
Result<OpOutput> job_result(const OpContext& ctx, int code, const std::string& message,
                            uint64_t bytes, uint64_t value) {
  if (code != 0) return job_error(ctx, code, message, bytes);
  return OpOutput{std::min(bytes, ctx.output_capacity), value};
}

// Where a job's call header is (py.h, py.n); -1 when the param is missing or not an int, which
// the Runtime reports.
int64_t int_param(const OpContext& ctx, std::string_view key) {
  auto v = ctx.params.get_int(key, -1, 0, INT64_MAX);
  return v ? *v : -1;
}

nb::dict params_of(const OpContext& ctx) {
  nb::dict params;
  for (const auto& p : ctx.params.entries()) {
    std::visit([&](const auto& v) { params[p.key.c_str()] = nb::cast(v); }, p.value);
  }
  return params;
}

// What the Python side printed for an exception, as one line for an Error.
std::string describe_python_error(nb::python_error& e) {
  std::string what = e.what();
  e.restore();
  PyErr_Print();  // the whole traceback, on stderr (the daemon's log)
  return what;
}

class PythonBackend final : public OpBackend {
 public:
  // `handler`: gpuq._worker's Runtime (start, describe, run, client_mapped, client_unmapping,
  // and its `poisoned` flag).
  void set(nb::object handler) { handler_ = std::move(handler); }
  void set_options(const daemon::WorkerOptions& o) { options_ = o; }

  Result<void> start() override {
    nb::gil_scoped_acquire gil;
    try {
      handler_.attr("start")(options_.pool_id, options_.memory_limit_bytes,
                             options_.memory_limit_fraction);
    } catch (nb::python_error& e) {
      return Error(ErrorCode::kInternal, "on_start: " + describe_python_error(e));
    }
    return {};
  }

  nlohmann::json describe() const override {
    nb::gil_scoped_acquire gil;
    try {
      return nlohmann::json::parse(nb::cast<std::string>(handler_.attr("describe")()));
    } catch (...) {
      return nlohmann::json::object();
    }
  }

  std::string op_list() const override { return daemon::python_op_list(options_.pool_id); }

  void client_mapped(uint32_t client, void* base, uint64_t bytes) override {
    call_quietly("client_mapped", client, reinterpret_cast<uintptr_t>(base), bytes);
  }
  void client_unmapping(uint32_t client, void* base, uint64_t bytes) override {
    call_quietly("client_unmapping", client, reinterpret_cast<uintptr_t>(base), bytes);
  }

  Result<OpOutput> run(const OpInfo& op, const OpContext& ctx) override {
    if (op.run != nullptr) return op.run(ctx);  // a built-in CPU op
    if (op.python == nullptr) {
      return Error(ErrorCode::kUnknownOp, std::string(op.name) +
                                              ": not an op of Python pools (tensor and plug-in ops "
                                              "run on cpu and gpu pools)");
    }
    g_cancel_flag.store(&ctx.cancel_requested, std::memory_order_relaxed);
    g_parts.store(ctx.parts, std::memory_order_relaxed);
    struct Clear {
      ~Clear() {
        g_cancel_flag.store(nullptr, std::memory_order_relaxed);
        g_parts.store(nullptr, std::memory_order_relaxed);
      }
    } clear;
    const int64_t h = int_param(ctx, daemon::kPythonHeaderParam);
    const int64_t n = int_param(ctx, daemon::kPythonHeaderBytesParam);
    nb::gil_scoped_acquire gil;
    try {
      // Views of the client's segment, zero copy: the input read-only, except for a callable's
      // (gpuq.Executor copies its arguments into the job's own block, and a function may
      // change its arguments in place, as in a ProcessPoolExecutor).
      const bool writable_input = std::string_view(op.name) == daemon::kPythonCallOp;
      nb::object in = view_of(ctx.input, ctx.input_bytes, writable_input);
      nb::object out = view_of(ctx.output, ctx.output_capacity, true);
      if (!in.is_valid() || !out.is_valid()) throw nb::python_error();
      auto [code, message, bytes, value] =
          nb::cast<std::tuple<int, std::string, uint64_t, uint64_t>>(
              handler_.attr("run")(op.name, in, out, h, n));
      release_view(in);
      release_view(out);
      // Read now, with the GIL held: the loop asks must_exit() after every job.
      must_exit_ = nb::cast<bool>(handler_.attr("poisoned"));
      return job_result(ctx, code, message, bytes, value);
    } catch (nb::python_error& e) {
      return Error(ErrorCode::kOpFailed, std::string(op.name) + ": the worker runtime failed: " +
                                             describe_python_error(e));
    } catch (const std::exception& e) {
      return Error(ErrorCode::kOpFailed,
                   std::string(op.name) + ": the worker runtime failed: " + e.what());
    }
  }

  void run_batch(const OpInfo& op, std::span<const OpContext* const> jobs,
                 std::vector<Result<OpOutput>>& results,
                 std::vector<uint32_t>& call_rows) override {
    if (op.python == nullptr || jobs.empty()) {
      OpBackend::run_batch(op, jobs, results, call_rows);
      return;
    }
    if (jobs.size() == 1) {
      // A batch of one (a lone caller, a quiet spell) is called as an unbatched op's job is,
      // with its own arrays: the batch path's decoding, grouping and concatenation cost a
      // lone job of a small model a tenth of its rows/s (bench_batching.py, 1 client).
      results.push_back(run(op, *jobs[0]));
      const uint64_t rows = daemon::python_rows(jobs[0]->params);
      call_rows.push_back(static_cast<uint32_t>(rows == 0 ? 1 : rows));
      return;
    }
    flags_.clear();
    for (const OpContext* ctx : jobs) flags_.push_back(&ctx->cancel_requested);
    g_batch_flags.store(&flags_, std::memory_order_relaxed);
    struct Clear {
      ~Clear() { g_batch_flags.store(nullptr, std::memory_order_relaxed); }
    } clear;
    const size_t first = results.size();
    nb::gil_scoped_acquire gil;
    try {
      nb::list ins;
      nb::list outs;
      nb::list params;
      views_.clear();
      for (const OpContext* ctx : jobs) {
        nb::object in = view_of(ctx->input, ctx->input_bytes, false);
        nb::object out = view_of(ctx->output, ctx->output_capacity, true);
        if (!in.is_valid() || !out.is_valid()) throw nb::python_error();
        ins.append(in);
        outs.append(out);
        views_.push_back(std::move(in));
        views_.push_back(std::move(out));
        params.append(params_of(*ctx));
      }
      auto [outcomes, rows] =
          nb::cast<std::tuple<std::vector<std::tuple<int, std::string, uint64_t, uint64_t>>,
                              std::vector<uint32_t>>>(
              handler_.attr("run_batch")(op.name, ins, outs, params));
      for (const nb::object& v : views_) release_view(v);
      views_.clear();
      must_exit_ = nb::cast<bool>(handler_.attr("poisoned"));
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (i >= outcomes.size()) {
          results.push_back(Error(ErrorCode::kInternal, std::string(op.name) +
                                                            ": the worker runtime lost a job of "
                                                            "the batch"));
          continue;
        }
        const auto& [code, message, bytes, value] = outcomes[i];
        results.push_back(job_result(*jobs[i], code, message, bytes, value));
      }
      call_rows.insert(call_rows.end(), rows.begin(), rows.end());
    } catch (nb::python_error& e) {
      views_.clear();
      const std::string why =
          std::string(op.name) + ": the worker runtime failed: " + describe_python_error(e);
      results.erase(results.begin() + static_cast<std::ptrdiff_t>(first), results.end());
      for (size_t i = 0; i < jobs.size(); ++i) results.push_back(Error(ErrorCode::kOpFailed, why));
    } catch (const std::exception& e) {
      views_.clear();
      results.erase(results.begin() + static_cast<std::ptrdiff_t>(first), results.end());
      for (size_t i = 0; i < jobs.size(); ++i) {
        results.push_back(Error(ErrorCode::kOpFailed,
                                std::string(op.name) + ": the worker runtime failed: " + e.what()));
      }
    }
  }

  // A step op's sequences (docs/design/streams.md, "Step-level batching"): the Runtime keeps
  // each one's state by `key`.
  Result<void> step_start(const OpInfo& op, const OpContext& ctx, uint64_t key) override {
    if (op.python == nullptr) return OpBackend::step_start(op, ctx, key);
    g_cancel_flag.store(&ctx.cancel_requested, std::memory_order_relaxed);
    struct Clear {
      ~Clear() { g_cancel_flag.store(nullptr, std::memory_order_relaxed); }
    } clear;
    const int64_t h = int_param(ctx, daemon::kPythonHeaderParam);
    const int64_t n = int_param(ctx, daemon::kPythonHeaderBytesParam);
    nb::gil_scoped_acquire gil;
    try {
      nb::object in = view_of(ctx.input, ctx.input_bytes, false);
      nb::object out = view_of(ctx.output, ctx.output_capacity, true);
      if (!in.is_valid() || !out.is_valid()) throw nb::python_error();
      auto [code, message, bytes] = nb::cast<std::tuple<int, std::string, uint64_t>>(
          handler_.attr("step_start")(op.name, key, in, out, h, n));
      release_view(in);
      release_view(out);
      must_exit_ = nb::cast<bool>(handler_.attr("poisoned"));
      if (code != 0) return job_error(ctx, code, message, bytes);
      return {};
    } catch (nb::python_error& e) {
      return Error(ErrorCode::kOpFailed, std::string(op.name) + ": the worker runtime failed: " +
                                             describe_python_error(e));
    } catch (const std::exception& e) {
      return Error(ErrorCode::kOpFailed,
                   std::string(op.name) + ": the worker runtime failed: " + e.what());
    }
  }

  void step(const OpInfo& op, std::span<const daemon::StepJob> jobs,
            std::vector<Result<daemon::StepOutput>>& results) override {
    if (op.python == nullptr || jobs.empty()) {
      OpBackend::step(op, jobs, results);
      return;
    }
    flags_.clear();
    for (const daemon::StepJob& j : jobs) flags_.push_back(&j.ctx->cancel_requested);
    g_batch_flags.store(&flags_, std::memory_order_relaxed);
    struct Clear {
      ~Clear() { g_batch_flags.store(nullptr, std::memory_order_relaxed); }
    } clear;
    nb::gil_scoped_acquire gil;
    // The runtime itself failed: every sequence of the step with it.
    const size_t first = results.size();
    auto fail_all = [&](const std::string& why) {
      results.erase(results.begin() + static_cast<std::ptrdiff_t>(first), results.end());
      for (size_t i = 0; i < jobs.size(); ++i) {
        results.emplace_back(Error(ErrorCode::kOpFailed, why));
      }
    };
    try {
      nb::list keys;
      nb::list cells;
      nb::list streams;
      views_.clear();
      for (const daemon::StepJob& j : jobs) {
        nb::object cell = view_of(j.cell.data(), j.cell.size(), true);
        if (!cell.is_valid()) throw nb::python_error();
        keys.append(j.key);
        cells.append(cell);
        streams.append(j.streams);
        views_.push_back(std::move(cell));
      }
      auto outcomes = nb::cast<std::vector<std::tuple<int, std::string, uint64_t, bool>>>(
          handler_.attr("step")(op.name, keys, cells, streams));
      for (const nb::object& v : views_) release_view(v);
      views_.clear();
      must_exit_ = nb::cast<bool>(handler_.attr("poisoned"));
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (i >= outcomes.size()) {
          results.emplace_back(Error(
              ErrorCode::kInternal, std::string(op.name) + ": the worker runtime lost a sequence"));
          continue;
        }
        const auto& [code, message, bytes, done] = outcomes[i];
        if (code != 0) {
          results.emplace_back(job_error(*jobs[i].ctx, code, message, bytes));
        } else {
          results.emplace_back(
              daemon::StepOutput{std::min<uint64_t>(bytes, jobs[i].cell.size()), done});
        }
      }
    } catch (nb::python_error& e) {
      views_.clear();
      fail_all(std::string(op.name) + ": the worker runtime failed: " + describe_python_error(e));
    } catch (const std::exception& e) {
      views_.clear();
      fail_all(std::string(op.name) + ": the worker runtime failed: " + e.what());
    }
  }

  void step_end(const OpInfo& op, uint64_t key) override {
    if (op.python != nullptr) call_quietly("step_end", key);
  }

  // Whether the last Python op left the CUDA context poisoned (Runtime.poisoned, read by run()):
  // no GIL and no Python call per job.
  bool must_exit() const override { return must_exit_; }

 private:
  template <typename... A>
  void call_quietly(const char* method, A... args) {
    nb::gil_scoped_acquire gil;
    try {
      handler_.attr(method)(args...);
    } catch (nb::python_error& e) {
      describe_python_error(e);
    }
  }

  nb::object handler_;
  daemon::WorkerOptions options_;
  std::vector<const std::atomic<uint32_t>*> flags_;  // the running batch's cancel flags
  std::vector<nb::object> views_;                    // its memoryviews, released after it
  bool must_exit_ = false;
};

PythonBackend& backend() {
  static PythonBackend* b = new PythonBackend();  // leaked: used until the process exits
  return *b;
}

OpBackend& backend_for(const daemon::WorkerOptions& o) {
  backend().set_options(o);
  return backend();
}

}  // namespace

void bind_worker(nb::module_& m) {
  m.def(
      "register_python_ops",
      [](uint32_t pool,
         const std::vector<std::tuple<uint32_t, std::string, uint32_t, uint32_t, bool>>& ops) {
        for (const auto& [id, name, max_batch_size, max_queue_delay_us, step] : ops) {
          auto r = daemon::add_python_op(
              name, "", pool, id, daemon::BatchSettings{max_batch_size, max_queue_delay_us, step});
          if (!r) throw std::invalid_argument(r.error().message());
        }
      },
      "pool"_a, "ops"_a,
      "Adds this worker's Python ops to the registry, with gpuqd's ids and their batching "
      "(max_batch_size, max_queue_delay_us, step: a step op's).");
  m.def(
      "run_worker",
      [](std::vector<std::string> args, nb::object handler) {
        backend().set(std::move(handler));
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        nb::gil_scoped_release unlocked;
        return daemon::worker_main(static_cast<int>(args.size()), argv.data(), "gpuq-python-worker",
                                   backend_for);
      },
      "argv"_a, "handler"_a,
      "Runs gpuq's worker loop with `handler` for the Python ops (GIL released); the exit "
      "status.");
  m.def(
      "job_streams", [] { return g_parts.load(std::memory_order_relaxed) != nullptr; },
      "Whether the running job is a stream (its caller reads parts as they are made).");
  m.def(
      "part_cell",
      []() -> std::tuple<nb::object, int, std::string> {
        daemon::PartSink* parts = g_parts.load(std::memory_order_relaxed);
        if (parts == nullptr) {
          return {nb::none(), static_cast<int>(ErrorCode::kInvalidArgument),
                  "the running job is not a stream"};
        }
        Result<std::span<std::byte>> cell = Error(ErrorCode::kInternal, "no cell");
        {
          nb::gil_scoped_release unlocked;  // it may wait for the caller to read
          cell = parts->next_cell();
        }
        if (!cell)
          return {nb::none(), static_cast<int>(cell.error().code()), cell.error().message()};
        nb::object view = view_of(cell->data(), cell->size(), true);
        if (!view.is_valid()) throw nb::python_error();
        return {view, 0, std::string()};
      },
      "The running stream's next part cell, a writable memoryview (waits while every cell "
      "holds an unread part): (view, 0, '') or (None, code, why) when the job was asked to "
      "stop, or its caller read nothing for stream_reader_timeout_ms.");
  m.def(
      "part_publish",
      [](uint64_t bytes) {
        if (daemon::PartSink* parts = g_parts.load(std::memory_order_relaxed)) {
          parts->publish(bytes);
        }
      },
      "bytes"_a, "Publishes the part just written into the cell part_cell() gave.");
  m.def(
      "job_cancelled",
      [] {
        if (const auto* flags = g_batch_flags.load(std::memory_order_relaxed)) {
          return batch_cancelled(*flags);
        }
        const auto* flag = g_cancel_flag.load(std::memory_order_relaxed);
        return flag != nullptr && flag->load(std::memory_order_relaxed) != 0;
      },
      "Whether the running job was asked to stop (its client cancelled it, its time limit); in "
      "a batched call, whether a job's time limit passed or every job was cancelled.");
}

}  // namespace gpuq::python
