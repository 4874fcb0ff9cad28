// gpuqctl reload [--timeout S]: the daemon reads its config file again and applies what changed
// (docs/service.md, "Config reload"), as SIGHUP does. Waits until it is applied and the rolling
// restarts it started have ended: exit 0 with one line per change, or 1 with why nothing
// changed (a key that cannot change live, a bad file) or which rollout failed.
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
int cmd_reload(ArgCursor& cursor, std::string& runtime_dir) {
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
    } else {
      return usage_error("unknown argument '" + std::string(arg) + "' for reload");
    }
  }
  const auto seconds = static_cast<uint32_t>(std::ceil(timeout_s));
  gpuq::Result<std::vector<std::string>> changes = gpuq::daemon_reload(runtime_dir, seconds);
  if (!changes) return daemon_error(changes.error());
  for (const std::string& line : *changes) std::cout << line << '\n';
  return kExitOk;
}

}  // namespace gpuq::ctl
