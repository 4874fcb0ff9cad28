// gpuqctl restart POOL [--timeout S]: a rolling restart of the pool (docs/design/live_changes.md):
// its workers are replaced one by one by new processes, each made ready before the one it
// replaces stops taking jobs. Waits for the end: exit 0 with the new generation, or 1 with why
// the rollout stopped (a new worker that did not start: its stderr; the old workers serve on).
#include <cmath>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"

namespace gpuq::ctl {
namespace {

int run_restart(const std::string& pool, const std::string& runtime_dir, double timeout_s) {
  const auto seconds = static_cast<uint32_t>(std::ceil(timeout_s));
  gpuq::Result<uint32_t> g = gpuq::daemon_restart_pool(pool, runtime_dir, seconds);
  if (!g) return daemon_error(g.error());
  std::cout << "pool " << pool << " restarted: every worker runs generation " << *g << '\n';
  return kExitOk;
}

}  // namespace

int cmd_restart(ArgCursor& cursor, std::string& runtime_dir) {
  std::optional<std::string> pool;
  double timeout_s = 0;
  std::string error;
  while (!cursor.done()) {
    const std::string_view arg = cursor.peek();
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return kExitOk;
    }
    if (take_wait_option(cursor, runtime_dir, timeout_s, error)) {
      if (!error.empty()) return usage_error(error);
    } else if (!arg.starts_with("-") && !pool) {
      pool = std::string(cursor.next());
    } else {
      return usage_error("unknown argument '" + std::string(arg) + "' for restart");
    }
  }
  if (!pool) return usage_error("restart: which pool? (gpuqctl restart POOL; status lists them)");
  return run_restart(*pool, runtime_dir, timeout_s);
}

}  // namespace gpuq::ctl
