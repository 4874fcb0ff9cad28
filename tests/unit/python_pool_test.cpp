// A Python pool's op listing (daemon/supervisor/python_pool.hpp), with stand-in interpreters
// (shell scripts that print what gpuq._worker --list-ops would): the ops registered, python_call
// first; a failing import named by pool module, exception and traceback; the module read from a
// traceback; the tail of stderr that --check-config prints.
#include <doctest/doctest.h>

#include <fstream>
#include <string>
#include <vector>

#include "ops.hpp"
#include "python_pool.hpp"
#include "support/scratch_dir.hpp"

namespace gpuq::daemon {
namespace {

using Scratch = test::ScratchDir;

PoolConfig python_pool(const std::string& interpreter, std::vector<std::string> modules) {
  PoolConfig p;
  p.name = "py";
  p.python = PythonPoolConfig{};
  p.python->interpreter = interpreter;
  p.python->modules = std::move(modules);
  return p;
}

// What Python prints for a module whose top level raises, imported by gpuq._worker.
const char* const kTraceback =
    "Traceback (most recent call last):\n"
    "  File \"<string>\", line 1, in <module>\n"
    "  File \"/venv/lib/python3.11/site-packages/gpuq/_worker.py\", line 661, in main\n"
    "    _import_modules(paths, modules)\n"
    "  File \"/venv/lib/python3.11/site-packages/gpuq/_worker.py\", line 54, in _import_modules\n"
    "    importlib.import_module(m)\n"
    "  File \"/usr/lib/python3.11/importlib/__init__.py\", line 126, in import_module\n"
    "    return _bootstrap._gcd_import(name[level:], package, level)\n"
    "  File \"<frozen importlib._bootstrap>\", line 1204, in _gcd_import\n"
    "  File \"/srv/ops/models/vision.py\", line 3, in <module>\n"
    "    import helper\n"
    "  File \"/srv/ops/helper.py\", line 10, in <module>\n"
    "    raise RuntimeError(\"no weights\")\n"
    "RuntimeError: no weights\n";

TEST_CASE("failing_module: the pool's module whose top level the traceback passes through") {
  CHECK(failing_module({"text", "models.vision"}, kTraceback) == "models.vision");
  CHECK(failing_module({"text", "helper"}, kTraceback) == "helper");  // the first listed one
  CHECK(failing_module({"text", "other"}, kTraceback).empty());       // neither: not told
  CHECK(failing_module({"only"}, kTraceback) == "only");              // one module: it
  const std::string missing =
      "Traceback (most recent call last):\n"
      "  File \"/venv/gpuq/_worker.py\", line 54, in _import_modules\n"
      "    importlib.import_module(m)\n"
      "ModuleNotFoundError: No module named 'models'\n";
  CHECK(failing_module({"text", "models.vision"}, missing) == "models.vision");
  // Before the import loop (gpuq itself missing): no module of the pool's is at fault.
  const std::string no_gpuq =
      "Traceback (most recent call last):\n"
      "  File \"<string>\", line 1, in <module>\n"
      "ModuleNotFoundError: No module named 'gpuq'\n";
  CHECK(failing_module({"only"}, no_gpuq).empty());
}

TEST_CASE("last_line and tail_lines") {
  CHECK(last_line(kTraceback) == "RuntimeError: no weights");
  CHECK(last_line("\n\n") == "");
  CHECK(tail_lines("a\nb\nc\n\n", 2, 100) == "b\nc");
  CHECK(tail_lines("a\nb\nc", 5, 100) == "a\nb\nc");
  CHECK(tail_lines("first\nsecond\nthird", 3, 12) == "second\nthird");  // 12 bytes: fits
  CHECK(tail_lines("first\nsecond\nthird", 3, 11) == "third");
  CHECK(tail_lines("0123456789", 1, 6) == "...789");  // a long last line keeps its end
  CHECK(tail_lines("", 3, 100) == "");
}

TEST_CASE("learn_python_pool: the listed ops are registered, python_call first") {
  Scratch s;
  const std::string python = s.script("python-ok", R"(echo 'a line a module printed' >&2
echo '[{"name":"pp_first","summary":"one"},{"name":"pp_batched","summary":"two","max_batch_size":8,"max_queue_delay_us":100}]'
)");
  PoolConfig pool = python_pool(python, {"mod"});
  PythonListingDetail detail;
  auto ops = learn_python_pool(pool, 7, &detail);
  REQUIRE_MESSAGE(ops, ops.error().message());
  REQUIRE(ops->size() == 3);
  CHECK((*ops)[0].name == kPythonCallOp);
  CHECK((*ops)[1].name == "pp_first");
  CHECK((*ops)[2].name == "pp_batched");
  CHECK((*ops)[2].batching.max_batch_size == 8);
  CHECK((*ops)[1].id > 0);
  CHECK(python_op_list(7).find("pp_batched") != std::string::npos);
}

TEST_CASE("learn_python_pool: a module that fails to import names the module and the error") {
  Scratch s;
  std::ofstream(s.dir + "/traceback.txt") << kTraceback;
  const std::string python =
      s.script("python-bad", "cat " + s.dir + "/traceback.txt >&2\nexit 1\n");
  PoolConfig pool = python_pool(python, {"text", "models.vision"});
  PythonListingDetail detail;
  auto ops = learn_python_pool(pool, 8, &detail);
  REQUIRE_FALSE(ops);
  CHECK(ops.error().message() ==
        "importing module 'models.vision' failed (exit status 1): RuntimeError: no weights");
  CHECK(detail.module == "models.vision");
  CHECK(detail.stderr_text.find("raise RuntimeError") != std::string::npos);
  CHECK(python_op_list(8) == "[]");

  PoolConfig missing = python_pool(s.dir + "/no-such-python", {"text"});
  auto none = learn_python_pool(missing, 9, &detail);
  REQUIRE_FALSE(none);
  CHECK(none.error().message().find("python.interpreter: '" + s.dir +
                                    "/no-such-python' is not an executable") == 0);
}

TEST_CASE("learn_python_pool: an interpreter without gpuq says to install it") {
  Scratch s;
  const std::string python =
      s.script("python-nogpuq",
               "echo 'Traceback (most recent call last):' >&2\n"
               "echo '  File \"<string>\", line 1, in <module>' >&2\n"
               "echo \"ModuleNotFoundError: No module named 'gpuq'\" >&2\nexit 1\n");
  PoolConfig pool = python_pool(python, {"mod"});
  PythonListingDetail detail;
  auto ops = learn_python_pool(pool, 10, &detail);
  REQUIRE_FALSE(ops);
  CHECK(ops.error().message() ==
        "listing its ops failed (exit status 1): ModuleNotFoundError: No module named 'gpuq' "
        "(install gpuq in the environment of " +
            python + ")");
  CHECK(detail.module.empty());
}

}  // namespace
}  // namespace gpuq::daemon
