// The op registry: every op a worker can run, looked up by id (from the job descriptor) or by
// name (for the op table the supervisor sends to clients). Built-in CPU ops: noop, echo, sleep,
// checksum; the catalog's tensor ops: conv2d, activation, softmax, pool2d, batchnorm, gemm
// (gpuq/common/tensor_ops.hpp), which each backend runs its own way. docs/ops.md documents each.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gpuq/common/params.hpp"
#include "gpuq/common/tensor_ops.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

// Where a streaming job's op puts its parts (docs/design/streams.md): the worker's
// StreamWriter. An op makes a part by asking for the next cell, writing the part into it, and
// publishing it; the client can read it at once.
class PartSink {
 public:
  // The cell the next part goes into (a multiple of 64 bytes). Waits while the client has
  // `window` parts unread; Cancelled when the job is asked to stop meanwhile (cancelled, its
  // time limit, its client gone) or when the client has read no part for the daemon's
  // stream_reader_timeout_ms (the message says so).
  virtual Result<std::span<std::byte>> next_cell() = 0;
  // Publishes the part just written into the cell next_cell() gave, `bytes` of it.
  virtual void publish(uint64_t bytes) = 0;
  // Parts published so far.
  virtual uint32_t parts() const = 0;

 protected:
  ~PartSink() = default;
};

// What an op gets. The buffers are already validated to lie inside the client's arena.
struct OpContext {
  const std::byte* input;
  uint64_t input_bytes;
  std::byte* output;
  uint64_t output_capacity;
  const ParamBlock& params;
  const std::atomic<uint32_t>& cancel_requested;  // ops that loop poll it
  // Where the buffers start in the client's arena (both buffers are in the same one): what
  // an op needs to tell whether they overlap.
  uint64_t input_offset = 0;
  uint64_t output_offset = 0;
  // An op that fails may leave a record of its failure at the start of the output buffer and
  // say its size here (a Python op: the exception's type and traceback); the client gets it as
  // the failed job's output size. At most output_capacity.
  mutable uint64_t failure_output_bytes = 0;
  // A streaming job's parts (JobSpec::stream_window); null for a job that answers once. Its
  // output buffer then holds the part cells: an op that streams writes only through this.
  PartSink* parts = nullptr;
};

struct OpOutput {
  uint64_t output_bytes = 0;
  uint64_t value = 0;
};

using OpFunction = Result<OpOutput> (*)(const OpContext&);

struct OpInfo {
  uint32_t id;  // stable, part of the wire format; never reused
  const char* name;
  const char* summary;
  OpFunction run;  // the same on every pool; null for a tensor op
  // A catalog tensor op (gpuq/common/tensor_ops.hpp), which each backend implements its own
  // way (oneDNN on CPU pools, cuDNN and cuBLAS on GPU pools).
  std::optional<tensor::OpKind> tensor = std::nullopt;
  // A plug-in op (ids from kFirstPluginOpId; plugins.hpp): its functions in a worker (null in
  // the supervisor, which never loads a plug-in) and which pool kinds it has one for.
  const struct PluginOp* plugin = nullptr;
  // A Python op (a function a Python pool's module registered with @gpuq.op): which pools
  // have it. Only a Python worker of one of those pools runs it.
  const struct PythonOp* python = nullptr;
};

// Plug-in ops get ids kFirstPluginOpId + their index over all plug-ins (config order, then
// registration order): the same rule in the supervisor and every worker.
inline constexpr uint32_t kFirstPluginOpId = 2000;

// A plug-in op as the registry holds it. `cpu_fn`/`gpu_fn` are gpuq_plugin_op_fn (gpuq/plugin.h)
// in a worker that loaded the plug-in; null in the supervisor.
struct PluginOp {
  std::string name;
  std::string summary;
  std::string library;  // the plug-in's path
  bool has_cpu = false;
  bool has_gpu = false;
  void* cpu_fn = nullptr;
  void* gpu_fn = nullptr;
};

// A Python op as the registry holds it (docs/python.md, "Python pools"). Its ids follow the
// plug-in ops: the supervisor numbers them (pool order, then each module's registration order;
// one id per name, however many pools have it) and tells each Python worker its pool's.
// A Python op's dynamic batching (docs/python.md, "Dynamic batching"): a worker that takes one
// of its jobs gathers further queued jobs of it, up to `max_batch_size` rows or until
// `max_queue_delay_us` has passed, and calls the function once for all of them. 1: no batching.
// A step op (`step`, docs/design/streams.md "Step-level batching") batches per step instead: a
// worker holds up to `max_batch_size` live sequences of it and runs one call per step for them.
struct BatchSettings {
  uint32_t max_batch_size = 1;
  uint32_t max_queue_delay_us = 0;
  bool step = false;
  // Whether a worker runs the op's jobs together (its calls are counted as batches).
  bool batched() const noexcept { return max_batch_size > 1 || step; }
  bool operator==(const BatchSettings&) const = default;
};
inline constexpr uint32_t kMaxBatchSize = 65536;
inline constexpr uint32_t kMaxQueueDelayUs = 1'000'000;

struct PythonOp {
  std::string name;
  std::string summary;
  std::vector<uint32_t> pools;  // the Python pools that have it
  // Each pool's batching of it, by the index of the pool in `pools` (each pool's module
  // decorates its own function).
  std::vector<BatchSettings> batching;
  // This op's batching on `pool`; no batching for a pool that does not have it.
  BatchSettings batching_on(uint32_t pool) const noexcept {
    for (size_t i = 0; i < pools.size() && i < batching.size(); ++i) {
      if (pools[i] == pool) return batching[i];
    }
    return {};
  }
};

// The op a Python pool runs for gpuq.Executor: a pickled callable (refused by a pool whose
// python.allow_callables is false). Every Python pool has it.
inline constexpr const char* kPythonCallOp = "python_call";

// The params of a Python op's job (written by gpuq._native's submit_call, docs/python.md,
// "Wire format"): where its call header lies in its input span, and a named op's rows (the
// first axis its arrays share; 0: none), which a batched op's gatherer counts.
inline constexpr const char* kPythonHeaderParam = "py.h";       // the header's offset
inline constexpr const char* kPythonHeaderBytesParam = "py.n";  // its length in bytes
inline constexpr const char* kPythonRowsParam = "py.r";
// A Python op's job's rows, as its client wrote them (py.r; 0: its arrays do not share a first
// axis, so it runs alone in a batch); 1 when it says nothing. Python's side of the call checks
// that the arrays have no more rows than that (gpuq._batching.check_rows), so a batch's call
// never gets more than max_batch_size rows.
uint64_t python_rows(const ParamBlock& params);

// Adds a Python op with id `id` (above every id registered so far), or adds `pool` to the
// op of that name when it has one, with `batching` as that pool's. Same rules as
// add_plugin_ops. Errors: InvalidArgument naming the op and the pool when a name is malformed
// or taken by a built-in or plug-in op, or its batching is out of range (max_batch_size 1 to
// kMaxBatchSize, max_queue_delay_us at most kMaxQueueDelayUs).
Result<uint32_t> add_python_op(const std::string& name, const std::string& summary, uint32_t pool,
                               std::optional<uint32_t> id = std::nullopt,
                               BatchSettings batching = {});

// A Python op as a pool's listing reports it (python_pool.hpp), and the id it has once
// registered.
struct ListedPythonOp {
  std::string name;
  std::string summary;
  BatchSettings batching;
  uint32_t id = 0;  // the id it was registered with
};

// Makes `ops` the Python ops of `pool`, all or nothing: each listed name keeps the id it has
// (in any pool), a new name gets the next free id (a removed op's id is never given again),
// `pool` leaves every op not listed, and each op's batching on `pool` is the listed one. Sets
// each op's `id`. True when the pool's op names changed. Errors (nothing changed): as
// add_python_op's, and InvalidArgument for a name listed twice. Supervisor only (single
// thread); a worker's registry is made once, at its start.
Result<bool> set_python_pool_ops(uint32_t pool, std::vector<ListedPythonOp>& ops);
// The Python ops of `pool` as set_python_pool_ops takes them (registry order).
std::vector<ListedPythonOp> python_pool_ops(uint32_t pool);

// Appends plug-in ops to this process's registry, ids kFirstPluginOpId onwards, in order. Call
// once at start-up, before any thread reads the registry (not thread-safe; the registry is
// immutable afterwards). Errors: InvalidArgument naming the op and its plug-in when a name is
// malformed or already taken.
Result<void> add_plugin_ops(std::vector<PluginOp> ops);

// Whether `name` is a well-formed op name: 1-48 characters of [a-z0-9_].
bool valid_op_name(std::string_view name);

// The plug-in ops of this process's registry as a JSON array of [id, name]: a worker sends
// its list with WorkerReady, and the supervisor refuses a worker whose list differs from its
// own (a plug-in file changed on disk since gpuqd started would renumber the ops).
std::string plugin_op_list();
// Takes `pool` off every Python op's list (its listing failed part way): no op is the pool's.
void forget_python_pool(uint32_t pool);

// The Python ops of `pool`, as plugin_op_list: what a Python worker sends with WorkerReady.
std::string python_op_list(uint32_t pool);

// All registered ops, in id order: the built-ins, then any plug-in ops. Thread-safe once
// add_plugin_ops has run (immutable).
std::span<const OpInfo> op_registry();
// The op with this id, or nullptr.
const OpInfo* find_op(uint32_t id);

}  // namespace gpuq::daemon
