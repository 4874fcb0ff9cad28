#include "python_pool.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include "child_output.hpp"

namespace gpuq::daemon {
namespace {

// `name` looked up in PATH (an absolute path stays as it is); empty when not found.
std::string find_executable(const std::string& name) {
  if (name.find('/') != std::string::npos) return ::access(name.c_str(), X_OK) == 0 ? name : "";
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (dir.empty()) continue;
    std::string full = dir + "/" + name;
    if (::access(full.c_str(), X_OK) == 0) return full;
  }
  return "";
}

bool ends_with(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

// Whether `file` (a traceback's path) is module `module`'s source: a/b.py or a/b/__init__.py
// for "a.b".
bool is_module_file(const std::string& file, const std::string& module) {
  std::string rel = module;
  for (char& ch : rel) {
    if (ch == '.') ch = '/';
  }
  return ends_with(file, "/" + rel + ".py") || ends_with(file, "/" + rel + "/__init__.py") ||
         file == rel + ".py";
}

// Runs the pool's listing child; its ops, or why not (the whole stderr in `traceback`).
Result<std::vector<ListedPythonOp>> list_python_ops(const PoolConfig& pool, uint32_t pool_id,
                                                    std::string* traceback) {
  const PythonPoolConfig& py = *pool.python;
  std::vector<std::string> argv = python_worker_command(py);
  argv.insert(argv.end(), {"--list-ops", "--pool-id", std::to_string(pool_id)});
  for (const auto& m : py.modules) argv.insert(argv.end(), {"--module", m});
  for (const auto& p : py.path) argv.insert(argv.end(), {"--path", p});
  std::vector<std::string> env = python_environment(py);
  env.emplace_back("CUDA_VISIBLE_DEVICES=-1");  // the listing sees no GPU
  auto child = run_child_for_output(argv, env, kPythonListTimeoutMs);
  if (!child) {
    return Error(ErrorCode::kInvalidArgument, "listing its ops " + child.error().message());
  }
  *traceback = child->err;
  if (!WIFEXITED(child->status) || WEXITSTATUS(child->status) != 0) {
    std::string why = last_line(child->err);
    if (why.find("No module named 'gpuq'") != std::string::npos) {
      why += " (install gpuq in the environment of " + py.interpreter + ")";
    }
    const std::string module = failing_module(py.modules, child->err);
    return Error(ErrorCode::kInvalidArgument,
                 (module.empty() ? std::string("listing its ops failed")
                                 : "importing module '" + module + "' failed") +
                     " (" + describe_child_status(child->status) + ")" +
                     (why.empty() ? std::string() : ": " + why));
  }
  std::vector<ListedPythonOp> ops;
  try {
    for (const auto& j : nlohmann::json::parse(child->out)) {
      ListedPythonOp op;
      op.name = j.at("name").get<std::string>();
      op.summary = j.at("summary").get<std::string>();
      op.batching.max_batch_size = j.value("max_batch_size", 1u);
      op.batching.max_queue_delay_us = j.value("max_queue_delay_us", 0u);
      ops.push_back(std::move(op));
    }
  } catch (const std::exception& e) {
    return Error(ErrorCode::kInvalidArgument, std::string("malformed op list: ") + e.what());
  }
  return ops;
}

}  // namespace

std::vector<std::string> python_worker_command(const PythonPoolConfig& py) {
  return {py.interpreter, "-c",
          "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
          "from gpuq._worker import main; sys.exit(main())"};
}

std::vector<std::string> python_environment(const PythonPoolConfig& py) {
  std::vector<std::string> drop = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NOTIFY_SOCKET",
                                   "PYTHONUNBUFFERED"};
  for (const auto& [name, value] : py.env) drop.push_back(name);
  std::vector<std::string> env = environment_without(drop);
  for (const auto& [name, value] : py.env) env.push_back(name + "=" + value);
  env.emplace_back("PYTHONUNBUFFERED=1");  // a traceback reaches the log as it is printed
  return env;
}

std::string last_line(const std::string& text) {
  size_t end = text.find_last_not_of("\n\r ");
  if (end == std::string::npos) return "";
  size_t begin = text.rfind('\n', end);
  begin = begin == std::string::npos ? 0 : begin + 1;
  std::string line = text.substr(begin, end + 1 - begin);
  if (line.size() > 300) line = line.substr(0, 297) + "...";
  return line;
}

std::string tail_lines(const std::string& text, size_t max_lines, size_t max_bytes) {
  const size_t last = text.find_last_not_of("\n\r ");
  if (last == std::string::npos || max_lines == 0) return "";
  const size_t end = last + 1;
  // Walk back one line start at a time while the lines and the bytes allow.
  size_t begin = end;
  for (size_t lines = 0; lines < max_lines && begin > 0; ++lines) {
    const size_t nl = begin >= 2 ? text.rfind('\n', begin - 2) : std::string::npos;
    const size_t start = nl == std::string::npos ? 0 : nl + 1;
    if (end - start > max_bytes && lines > 0) break;
    begin = start;
  }
  std::string tail = text.substr(begin, end - begin);
  if (tail.size() > max_bytes) tail = "..." + tail.substr(tail.size() - max_bytes + 3);
  return tail;
}

std::string failing_module(const std::vector<std::string>& modules, const std::string& traceback) {
  // Before gpuq._worker's import loop (gpuq itself missing, bad arguments): no module of the
  // pool's is at fault.
  const size_t loop = traceback.find("in _import_modules");
  if (loop == std::string::npos) return "";
  std::istringstream lines(traceback.substr(loop));
  for (std::string line; std::getline(lines, line);) {
    const size_t file = line.find("File \"");
    if (file == std::string::npos || line.find("in <module>") == std::string::npos) continue;
    const size_t begin = file + 6;
    const size_t end = line.find('"', begin);
    if (end == std::string::npos) continue;
    const std::string path = line.substr(begin, end - begin);
    for (const std::string& m : modules) {
      if (is_module_file(path, m)) return m;
    }
  }
  const std::string missing = "No module named '";
  if (const size_t at = traceback.rfind(missing); at != std::string::npos) {
    const size_t begin = at + missing.size();
    const size_t end = traceback.find('\'', begin);
    const std::string name = traceback.substr(begin, end - begin);
    for (const std::string& m : modules) {
      if (m == name || m.starts_with(name + ".")) return m;
    }
  }
  return modules.size() == 1 ? modules[0] : "";
}

Result<std::vector<ListedPythonOp>> learn_python_pool(PoolConfig& pool, uint32_t pool_id,
                                                      PythonListingDetail* detail) {
  *detail = {};
  const std::string found = find_executable(pool.python->interpreter);
  if (found.empty()) {
    return Error(ErrorCode::kInvalidArgument,
                 "python.interpreter: '" + pool.python->interpreter +
                     "' is not an executable (an absolute path, or a name in PATH)");
  }
  pool.python->interpreter = found;
  auto ops = list_python_ops(pool, pool_id, &detail->stderr_text);
  if (!ops) {
    detail->module = failing_module(pool.python->modules, detail->stderr_text);
    return ops.error();
  }
  ListedPythonOp call;
  call.name = kPythonCallOp;
  call.summary = "runs a client's pickled callable (gpuq.Executor)";
  ops->insert(ops->begin(), std::move(call));
  for (ListedPythonOp& op : *ops) {
    auto id = add_python_op(op.name, op.summary, pool_id, std::nullopt, op.batching);
    if (!id) {
      // No op is this pool's, not even those registered before the one that failed.
      forget_python_pool(pool_id);
      return Error(ErrorCode::kInvalidArgument, id.error().message());
    }
    op.id = *id;
  }
  return ops;
}

}  // namespace gpuq::daemon
