// A Python pool's processes as gpuqd starts them (docs/python.md, "Python pools"): the command
// and environment of its listing child and its workers, and the listing itself: the pool's
// interpreter importing the pool's modules with `--list-ops` (the GPU hidden, within a time
// limit), the ops it prints registered, and, when the import fails, which module failed and why.
// The supervisor runs it at start (learn_python_ops, pool_plan.hpp) and `gpuqd --check-config`
// runs the same, so that a module that does not import is found before the daemon starts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "gpuq/error.hpp"
#include "ops.hpp"

namespace gpuq::daemon {

// Importing a framework (torch, TensorFlow) takes seconds; a listing that takes longer than this
// is stuck (a module that waits on a network file), and the pool is unavailable.
inline constexpr uint32_t kPythonListTimeoutMs = 60'000;

// The command that starts a Python pool's process (its listing child, its workers): the
// interpreter running gpuq._worker's main, with the current directory left off sys.path
// (`python -m` would put it first, and gpuqd's working directory is no place to import from).
std::vector<std::string> python_worker_command(const PythonPoolConfig& py);

// The environment of a Python pool's processes (the listing child and its workers): this
// process's, less the CUDA variables, plus the pool's `python.env` and PYTHONUNBUFFERED=1.
std::vector<std::string> python_environment(const PythonPoolConfig& py);

// More on a failed listing than its error's one line.
struct PythonListingDetail {
  std::string module;       // the pool's module that failed to import; empty when unknown
  std::string stderr_text;  // all the child printed on stderr (the traceback); empty: nothing
};

// The listing child of pool `pool_id` (`pool` must have `python`, its interpreter resolved):
// its argv and environment. Its stdout is the op list, its stderr what the modules printed.
struct PythonListingCommand {
  std::vector<std::string> argv;
  std::vector<std::string> env;
};
PythonListingCommand python_listing_command(const PoolConfig& pool, uint32_t pool_id);

// What a listing child's output says: its ops, python_call first (not registered yet), or why
// not, in one line ("importing module 'm' failed (exit status 1): RuntimeError: ..."), with
// `detail` filled from `err`. `status`: as waitpid() reports it.
Result<std::vector<ListedPythonOp>> parse_python_listing(const PoolConfig& pool,
                                                         const std::string& out,
                                                         const std::string& err, int status,
                                                         PythonListingDetail* detail);

// Resolves the pool's interpreter in PATH (writing the absolute path back into
// `pool.python->interpreter`). Errors: InvalidArgument naming python.interpreter.
Result<void> resolve_python_interpreter(PoolConfig& pool);

// Lists pool `pool_id`'s ops (`pool` must have `python`) as the daemon does: resolves its
// interpreter in PATH (writing the absolute path back into `pool.python->interpreter`), runs the
// listing child within kPythonListTimeoutMs, and registers the ops it prints (python_call first)
// with add_python_op. Errors: InvalidArgument in one line ("importing module 'm' failed (exit
// status 1): RuntimeError: ...", a malformed op list, a clash of op names), with `detail` filled;
// no op is then the pool's (forget_python_pool). Call single-threaded (it forks; the registry is
// not thread-safe).
Result<std::vector<ListedPythonOp>> learn_python_pool(PoolConfig& pool, uint32_t pool_id,
                                                      PythonListingDetail* detail);

// The pool's module whose import failed, read from the listing child's traceback: the only
// module; else the first module file whose top level (`in <module>`) the traceback passes
// through below gpuq._worker's import loop; else the one a ModuleNotFoundError names. Empty
// when none of `modules` can be told.
std::string failing_module(const std::vector<std::string>& modules, const std::string& traceback);

// The last non-empty line of `text` (a traceback's exception), at most 300 characters.
std::string last_line(const std::string& text);

// The last `max_lines` lines of `text`, at most `max_bytes` of it (cut at a line start).
std::string tail_lines(const std::string& text, size_t max_lines, size_t max_bytes);

}  // namespace gpuq::daemon
