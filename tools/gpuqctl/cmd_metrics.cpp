// gpuqctl metrics: the daemon's metrics in the Prometheus text format (docs/metrics.md), read
// from the control socket; what the HTTP listener serves at /metrics.
#include <iostream>
#include <optional>
#include <string>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"

namespace gpuq::ctl {

int cmd_metrics(ArgCursor& cursor, std::string& runtime_dir) {
  if (std::optional<int> done = parse_no_arguments(cursor, runtime_dir, "metrics")) return *done;
  gpuq::Result<std::string> text = gpuq::daemon_metrics_text(runtime_dir);
  if (!text) return daemon_error(text.error());
  std::cout << *text << std::flush;
  return kExitOk;
}

}  // namespace gpuq::ctl
