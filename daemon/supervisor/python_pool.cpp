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

}  // namespace

PythonListingCommand python_listing_command(const PoolConfig& pool, uint32_t pool_id) {
  const PythonPoolConfig& py = *pool.python;
  PythonListingCommand c;
  c.argv = python_worker_command(py);
  c.argv.insert(c.argv.end(), {"--list-ops", "--pool-id", std::to_string(pool_id)});
  for (const auto& m : py.modules) c.argv.insert(c.argv.end(), {"--module", m});
  for (const auto& p : py.path) c.argv.insert(c.argv.end(), {"--path", p});
  c.env = python_environment(py);
  c.env.emplace_back("CUDA_VISIBLE_DEVICES=-1");  // the listing sees no GPU
  return c;
}

Result<std::vector<ListedPythonOp>> parse_python_listing(const PoolConfig& pool,
                                                         const std::string& out,
                                                         const std::string& err, int status,
                                                         PythonListingDetail* detail) {
  const PythonPoolConfig& py = *pool.python;
  *detail = {};
  detail->stderr_text = err;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string why = last_line(err);
    if (why.find("No module named 'gpuq'") != std::string::npos) {
      why += " (install gpuq in the environment of " + py.interpreter + ")";
    }
    detail->module = failing_module(py.modules, err);
    return Error(ErrorCode::kInvalidArgument,
                 (detail->module.empty() ? std::string("listing its ops failed")
                                         : "importing module '" + detail->module + "' failed") +
                     " (" + describe_child_status(status) + ")" +
                     (why.empty() ? std::string() : ": " + why));
  }
  std::vector<ListedPythonOp> ops;
  ListedPythonOp call;
  call.name = kPythonCallOp;
  call.summary = "runs a client's pickled callable (gpuq.Executor)";
  ops.push_back(std::move(call));
  try {
    for (const auto& j : nlohmann::json::parse(out)) {
      ListedPythonOp op;
      op.name = j.at("name").get<std::string>();
      op.summary = j.at("summary").get<std::string>();
      op.batching.max_batch_size = j.value("max_batch_size", 1u);
      op.batching.max_queue_delay_us = j.value("max_queue_delay_us", 0u);
      op.batching.step = j.value("step", false);
      ops.push_back(std::move(op));
    }
  } catch (const std::exception& e) {
    return Error(ErrorCode::kInvalidArgument, std::string("malformed op list: ") + e.what());
  }
  return ops;
}

Result<void> resolve_python_interpreter(PoolConfig& pool) {
  const std::string found = find_executable(pool.python->interpreter);
  if (found.empty()) {
    return Error(ErrorCode::kInvalidArgument,
                 "python.interpreter: '" + pool.python->interpreter +
                     "' is not an executable (an absolute path, or a name in PATH)");
  }
  pool.python->interpreter = found;
  return {};
}

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
  if (auto r = resolve_python_interpreter(pool); !r) return r.error();
  const PythonListingCommand command = python_listing_command(pool, pool_id);
  auto child = run_child_for_output(command.argv, command.env, kPythonListTimeoutMs);
  if (!child) {
    return Error(ErrorCode::kInvalidArgument, "listing its ops " + child.error().message());
  }
  auto ops = parse_python_listing(pool, child->out, child->err, child->status, detail);
  if (!ops) return ops.error();
  if (auto r = set_python_pool_ops(pool_id, *ops); !r) {
    // No op is this pool's (set_python_pool_ops changed nothing).
    return Error(ErrorCode::kInvalidArgument, r.error().message());
  }
  return ops;
}

}  // namespace gpuq::daemon
