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
struct PythonOp {
  std::string name;
  std::string summary;
  std::vector<uint32_t> pools;  // the Python pools that have it
};

// The op a Python pool runs for gpuq.Executor: a pickled callable (refused by a pool whose
// python.allow_callables is false). Every Python pool has it.
inline constexpr const char* kPythonCallOp = "python_call";

// Adds a Python op with id `id` (above every id registered so far), or adds `pool` to the
// op of that name when it has one. Same rules as add_plugin_ops. Errors: InvalidArgument
// naming the op and the pool when a name is malformed or taken by a built-in or plug-in op.
Result<uint32_t> add_python_op(const std::string& name, const std::string& summary, uint32_t pool,
                               std::optional<uint32_t> id = std::nullopt);

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
