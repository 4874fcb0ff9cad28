// Plug-in ops (gpuq/plugin.h): loading a plug-in in a worker, listing its ops for the supervisor
// from a child process (the supervisor never dlopens a plug-in, which may link CUDA), and running
// one job through an op's function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpuq/error.hpp"
#include "ops.hpp"

namespace gpuq::daemon {

// dlopens `path` (RTLD_NOW | RTLD_LOCAL; never closed) and calls its gpuq_plugin_register with a
// collecting registrar. Worker side only. Errors: InvalidArgument naming the plug-in (dlopen's
// or dlsym's message, a non-zero register code, a bad add_op, no op registered). Not thread-safe.
Result<std::vector<PluginOp>> load_plugin(const std::string& path);

// `gpuq-worker --list-plugin-ops PATH`: load_plugin(PATH), then prints the ops as a JSON array
// ({name, summary, has_cpu, has_gpu}) on stdout. Returns 0, or 1 with the reason on stderr.
int list_plugin_ops_main(const std::string& path);

// Supervisor side: runs `worker_path --list-plugin-ops plugin_path` in a child with a time
// limit and parses its answer (functions null). Call while the process is single-threaded.
// Errors: InvalidArgument naming the plug-in, with the child's stderr or the time limit.
Result<std::vector<PluginOp>> list_plugin_ops_isolated(const std::string& worker_path,
                                                       const std::string& plugin_path,
                                                       uint32_t timeout_ms);

// What a GPU worker hands a plug-in op besides the buffers (void*: CUDA types stay out).
struct PluginDeviceHandles {
  void* stream = nullptr;
  void* cudnn = nullptr;
  void* cublas = nullptr;
};

// Runs plug-in op `op` with `fn` (its cpu_fn or gpu_fn, non-null) on `input`/`output` (host or
// device pointers; sizes from `ctx`). Errors: the op's code and message (OpFailed for a code gpuq
// does not know; InvalidArgument if it claims more output than the capacity).
Result<OpOutput> run_plugin_op(const OpInfo& op, void* fn, const OpContext& ctx, const void* input,
                               void* output, const PluginDeviceHandles& device = {});

}  // namespace gpuq::daemon
