// Where the daemon keeps its socket: --runtime-dir, else $RUNTIME_DIRECTORY (systemd), else
// $XDG_RUNTIME_DIR/gpuq, else /tmp/gpuq-$UID. Clients resolve it the same way, after
// $GPUQ_RUNTIME_DIR.
#pragma once

#include <string>

namespace gpuq {

// The daemon's rule. `explicit_dir` (from --runtime-dir) wins when not empty.
std::string resolve_daemon_runtime_dir(const std::string& explicit_dir);
// The client's rule: `explicit_dir`, else $GPUQ_RUNTIME_DIR, else the daemon's rule.
std::string resolve_client_runtime_dir(const std::string& explicit_dir);

inline constexpr const char* kSocketName = "gpuqd.sock";
// File in the runtime directory naming the current queue segment (so a restarted daemon can
// remove the segment a killed one left behind).
inline constexpr const char* kSegmentNameFile = "queue-segment";

}  // namespace gpuq
