#include "gpuq/common/runtime_dir.hpp"

#include <unistd.h>

#include <cstdlib>

namespace gpuq {

std::string resolve_daemon_runtime_dir(const std::string& explicit_dir) {
  if (!explicit_dir.empty()) return explicit_dir;
  if (const char* d = std::getenv("RUNTIME_DIRECTORY"); d != nullptr && *d != '\0') {
    std::string s(d);
    // systemd may list several directories separated by ':'; the first is ours.
    return s.substr(0, s.find(':'));
  }
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x != nullptr && *x != '\0') {
    return std::string(x) + "/gpuq";
  }
  return "/tmp/gpuq-" + std::to_string(getuid());
}

std::string resolve_client_runtime_dir(const std::string& explicit_dir) {
  if (!explicit_dir.empty()) return explicit_dir;
  if (const char* g = std::getenv("GPUQ_RUNTIME_DIR"); g != nullptr && *g != '\0') return g;
  return resolve_daemon_runtime_dir({});
}

}  // namespace gpuq
