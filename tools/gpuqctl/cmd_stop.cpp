// gpuqctl stop: asks the daemon to drain (finish its jobs, accept no new ones) and exit.
#include <iostream>
#include <optional>
#include <string>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"

namespace gpuq::ctl {
namespace {

int run_stop(const std::string& runtime_dir) {
  gpuq::Result<void> r = gpuq::daemon_stop(runtime_dir);
  if (!r) return daemon_error(r.error());
  std::cout << "stopping: daemon is draining\n";
  return kExitOk;
}

}  // namespace

int cmd_stop(ArgCursor& cursor, std::string& runtime_dir) {
  if (std::optional<int> done = parse_no_arguments(cursor, runtime_dir, "stop")) return *done;
  return run_stop(runtime_dir);
}

}  // namespace gpuq::ctl
