#include "gpuq/common/runtime_dir.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "gpuq/common/posix_call.hpp"

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

namespace detail {

std::string resolve_client_runtime_dir(const std::string& explicit_dir,
                                       const std::string& system_dir) {
  if (!explicit_dir.empty()) return explicit_dir;
  if (const char* g = std::getenv("GPUQ_RUNTIME_DIR"); g != nullptr && *g != '\0') return g;
  std::string own = resolve_daemon_runtime_dir({});
  // Each stat below is a probe: whatever its failure (ENOENT, EACCES), the path is not used.
  struct stat st {};
  // A socket in the user's own directory: a daemon of this user (or one that died; then the
  // connection error names this path, which is what the user must see).
  const std::string socket = own + "/" + kSocketName;
  if (GPUQ_POSIX_CALL(::stat, socket.c_str(), &st).ok() && S_ISSOCK(st.st_mode)) return own;
  // Else the system daemon's directory, if there is one. A user outside the daemon's group
  // cannot look inside it (mode 0750), so its existence decides, not the socket's: connecting
  // then fails with PermissionDenied, which says what to fix.
  if (!system_dir.empty() && GPUQ_POSIX_CALL(::stat, system_dir.c_str(), &st).ok() &&
      S_ISDIR(st.st_mode)) {
    return system_dir;
  }
  return own;
}

}  // namespace detail

std::string resolve_client_runtime_dir(const std::string& explicit_dir) {
  return detail::resolve_client_runtime_dir(explicit_dir, kSystemRuntimeDir);
}

}  // namespace gpuq
