// Where the daemon keeps its socket: --runtime-dir, else $RUNTIME_DIRECTORY (systemd), else
// $XDG_RUNTIME_DIR/gpuq, else /tmp/gpuq-$UID. Clients resolve it the same way, after
// $GPUQ_RUNTIME_DIR, and fall back to the system daemon's /run/gpuq (docs/service.md).
#pragma once

#include <string>

namespace gpuq {

// The daemon's rule. `explicit_dir` (from --runtime-dir) wins when not empty.
std::string resolve_daemon_runtime_dir(const std::string& explicit_dir);

// The client's rule: `explicit_dir`, else $GPUQ_RUNTIME_DIR, else the daemon's rule (a daemon of
// the client's own user) if a socket is there, else kSystemRuntimeDir (the gpuqd.service unit's
// RuntimeDirectory) if that directory exists, else the daemon's rule, so that the error names the
// per-user path. Looks at the file system (stat); never fails.
std::string resolve_client_runtime_dir(const std::string& explicit_dir);

// The runtime directory of the system-wide daemon: systemd/gpuqd.service sets
// RuntimeDirectory=gpuq, which systemd creates as /run/gpuq.
inline constexpr const char* kSystemRuntimeDir = "/run/gpuq";

inline constexpr const char* kSocketName = "gpuqd.sock";
// File in the runtime directory naming the current queue segment (so a restarted daemon can
// remove the segment a killed one left behind).
inline constexpr const char* kSegmentNameFile = "queue-segment";

namespace detail {
// resolve_client_runtime_dir with the system daemon's directory as a parameter (for tests).
std::string resolve_client_runtime_dir(const std::string& explicit_dir,
                                       const std::string& system_dir);
}  // namespace detail

}  // namespace gpuq
