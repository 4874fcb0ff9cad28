#!/usr/bin/env bash
# netns.sh PYTHON COMMAND...: runs COMMAND in new network and PID namespaces whose only network
# interface is loopback, brought up by PYTHON (no iproute2 needed). For the scale-out tests
# and the Ray benchmark (docs/scale-out.md, "Testing"): Ray picks the machine's own non-loopback
# address for its nodes and will not take 127.0.0.1, so outside such a namespace its processes
# would bind and dial that address; inside it, everything stays on 127.0.0.1 and the fixed
# ports cannot clash with another run. The PID namespace ends every process the command left
# behind when it exits (a Ray or Dask process a failed test did not stop).
#
# Root uses plain namespaces; another user gets a user namespace mapping it to root (where the
# kernel allows unprivileged user namespaces). The exit status is COMMAND's.
set -euo pipefail

if [[ "${GPUQ_NETNS_INNER:-}" == 1 ]]; then
  unset GPUQ_NETNS_INNER
  py="$1"
  shift
  "${py}" - <<'EOF_PY'
import fcntl, socket, struct
# SIOCGIFFLAGS / SIOCSIFFLAGS on "lo": set IFF_UP.
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifreq = struct.pack("16sH14x", b"lo", 0)
flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, ifreq))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1))
EOF_PY
  # Not exec: this shell stays PID 1 of the namespace and reaps what gets re-parented to it.
  rc=0
  "$@" || rc=$?
  exit "${rc}"
fi

(($# >= 2)) || { echo "usage: $0 PYTHON COMMAND..." >&2; exit 2; }
flags=(--net --pid --fork --mount-proc --kill-child)
((EUID == 0)) || flags=(--user --map-root-user "${flags[@]}")
GPUQ_NETNS_INNER=1 exec unshare "${flags[@]}" bash "${BASH_SOURCE[0]}" "$@"
